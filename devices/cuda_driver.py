"""Loading the CUDA backend's driver layer: NVIDIA cuda-python (``cuda.core``,
``cuda.bindings``), the driver's initialisation and device count, what a CUDA error
becomes here (``DeviceError``, ``CUDAOutOfMemoryError``), and which CUDA the installed
driver speaks (``driver_cuda_major``, ``install_hint``: what doctor and the demos say
to install). A helper of exchange/devices/cuda.py, which re-exports its public names.

Nothing here imports a CUDA package at import time: ``load_driver`` does, when the
backend loads, and ``driver_cuda_major`` tries to.
"""

from __future__ import annotations

import importlib
import os
import re
from typing import Any

from exchange.errors import BackendUnavailableError, DeviceError

__all__ = ["CUDA_ERRORS", "CUDAOutOfMemoryError", "device_error", "driver_cuda_major", "install_hint", "load_driver"]

# cuda.core's exception class(es), set by load_driver(); ``except ()`` catches nothing until then.
CUDA_ERRORS: tuple[type[BaseException], ...] = ()


class CUDAOutOfMemoryError(DeviceError, MemoryError):
    """A CUDA allocation failed for want of memory (also a MemoryError)."""


def device_error(exc: BaseException) -> DeviceError:
    text = str(exc)
    cls = CUDAOutOfMemoryError if "OUT_OF_MEMORY" in text or "out of memory" in text else DeviceError
    return cls(f"CUDA call failed: {text}")


# -- which CUDA the driver speaks (install hints) ------------------------------------------
def driver_cuda_major() -> int | None:
    """The CUDA major version the installed NVIDIA driver supports (13 for the R580
    drivers and later, 12 for R525 to R575), or None where no NVIDIA driver is installed.

    Asks ``cuDriverGetVersion`` through cuda.bindings when it imports (that call needs no
    ``cuInit``), else reads the kernel module's version from ``/proc/driver/nvidia/version``
    (NVIDIA's driver branches: R525 brought CUDA 12.0, R580 CUDA 13.0). Never raises."""
    try:
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
        if err == driver.CUresult.CUDA_SUCCESS and int(version) > 0:
            return int(version) // 1000  # 13000 is CUDA 13.0
    except Exception:  # cuda-python missing, or no libcuda to load
        pass
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8", errors="replace") as fh:
            return _cuda_major_of_driver(fh.readline())
    except OSError:
        return None


def _cuda_major_of_driver(line: str) -> int | None:
    """The CUDA major of the driver named in ``/proc/driver/nvidia/version``'s first line
    (``NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  ...``), None if none is."""
    found = re.search(r"\s(\d{3,4})\.\d+(?:\.\d+)?\s", line + " ")
    if found is None:
        return None
    branch = int(found.group(1))
    return 13 if branch >= 580 else 12 if branch >= 525 else 11


def install_hint() -> str | None:
    """What to install for CUDA support on this machine, in one line, naming the extra
    that matches the driver (``tensor-exchange[cuda13]`` on a CUDA 13 driver), or None
    where no NVIDIA driver is installed (there is nothing to install then)."""
    major = driver_cuda_major()
    if major is None:
        return None
    if major < 12:
        return (f"the NVIDIA driver here supports CUDA {major}; the CUDA backend needs a CUDA 12 or 13 driver "
                "(R525 or later)")
    cuda = min(major, 13)
    return (f"this driver speaks CUDA {major}: pip install 'tensor-exchange[cuda{cuda}]' "
            f"(cuda-python and cupy-cuda{cuda}x); for the GPU peers a CUDA build of torch and 'jax[cuda{cuda}]'")


def _cupy_package() -> str:
    major = driver_cuda_major()
    return f"cupy-cuda{min(major, 13)}x" if major and major >= 12 else "cupy-cuda13x (or cupy-cuda12x)"


# -- loading ---------------------------------------------------------------------------------
def _import_core() -> Any:
    """``cuda.core`` (>= 0.5 puts everything at top level; older releases under
    ``cuda.core.experimental``)."""
    try:
        import cuda.core as cc
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the CUDA backend needs NVIDIA cuda-python's cuda.core, which cannot be imported ({exc})"
        ) from exc
    if hasattr(cc, "Device"):
        return cc
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            experimental = importlib.import_module("cuda.core.experimental")
    except ImportError as exc:
        raise BackendUnavailableError(f"cuda.core is installed but has no Device ({exc}); upgrade cuda-core") from exc
    return experimental


def _core_errors(cc: Any) -> tuple[type[BaseException], ...]:
    for name in (cc.__name__ + "._utils.cuda_utils", "cuda.core._utils.cuda_utils"):
        try:
            return (importlib.import_module(name).CUDAError,)
        except (ImportError, AttributeError):
            continue
    return ()


def _error_text(driver: Any, err: Any) -> str:
    try:
        _, name = driver.cuGetErrorName(err)
        _, text = driver.cuGetErrorString(err)
        name = name.decode() if isinstance(name, bytes) else str(name)
        text = text.decode() if isinstance(text, bytes) else str(text)
        return f"{name}: {text}"
    except Exception:  # an unknown code: say what we have
        return str(err)


def load_driver() -> tuple[Any, Any, int]:
    """Import cuda-python, initialise the driver and count the devices.

    Returns ``(cuda.core, cuda.bindings.driver, device count)`` for the backend
    (``exchange.devices.cuda.load``), and sets ``CUDA_ERRORS``. Raises ``BackendUnavailableError`` (an
    ImportError) saying why when this machine cannot run it: cuda-python missing, no
    NVIDIA driver (libcuda cannot be loaded), the driver refusing to initialise, or no
    visible device. CuPy is not needed to load; strided copies ask for it when used.
    """
    global CUDA_ERRORS
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the CUDA backend needs NVIDIA cuda-python (cuda.bindings), which cannot be imported ({exc})"
        ) from exc
    cc = _import_core()
    try:
        (err,) = driver.cuInit(0)
    except (RuntimeError, OSError) as exc:  # cuda.pathfinder's DynamicLibNotFoundError, "Failed to dlopen libcuda"
        raise BackendUnavailableError(f"no NVIDIA driver, so no CUDA: libcuda cannot be loaded ({exc})") from exc
    if err != driver.CUresult.CUDA_SUCCESS:
        hint = ""
        if err == driver.CUresult.CUDA_ERROR_NO_DEVICE:
            hint = f" (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!s})"
        raise BackendUnavailableError(f"the NVIDIA driver did not initialise: {_error_text(driver, err)}{hint}")
    err, count = driver.cuDeviceGetCount()
    if err != driver.CUresult.CUDA_SUCCESS:
        raise BackendUnavailableError(f"cannot count CUDA devices: {_error_text(driver, err)}")
    if count < 1:
        raise BackendUnavailableError("the NVIDIA driver sees no CUDA device")
    CUDA_ERRORS = _core_errors(cc)
    return cc, driver, int(count)
