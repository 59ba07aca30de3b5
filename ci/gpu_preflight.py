"""Preflight of the GPU check (ci/gpu-check.sh): prints the versions, then checks in a
few seconds what the GPU suite needs, and exits 1 naming every check that failed.

    python ci/gpu_preflight.py

Checks: pytest imports; an NVIDIA driver is installed; cuda.core's Device(0) is usable (set_current); a CuPy kernel
runs; torch.cuda.is_available(); jax.devices("gpu") is not empty. A missing GPU fails
the first CUDA check at once, and the others are then not tried (each would only say
the same after seconds of its own start-up).
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import subprocess
import sys
import time
from typing import Callable

#: (import name, distributions that provide it): versions come from the installed
#: metadata, so printing them imports nothing (torch or JAX would take seconds).
PACKAGES = (("numpy", ("numpy",)), ("pytest", ("pytest",)), ("cuda.core", ("cuda-core",)),
            ("cuda.bindings", ("cuda-bindings",)), ("cupy", ("cupy-cuda13x", "cupy-cuda12x", "cupy")),
            ("torch", ("torch",)), ("jax", ("jax",)), ("jaxlib", ("jaxlib",)),
            ("jax_plugins", ("jax-cuda13-plugin", "jax-cuda12-plugin")), ("ml_dtypes", ("ml_dtypes", "ml-dtypes")),
            ("onnxruntime", ("onnxruntime-gpu", "onnxruntime")), ("sklearn", ("scikit-learn",)), ("onnx", ("onnx",)),
            ("tvm_ffi", ("apache-tvm-ffi",)), ("pytest_timeout", ("pytest-timeout",)))


def versions() -> None:
    print(f"python {platform.python_version()} ({sys.executable})")
    from importlib import metadata
    from importlib.util import find_spec

    found = []
    for name, dists in PACKAGES:
        try:
            spec = find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            found.append(f"{name} -")
            continue
        version = "?"
        for dist in dists:
            try:
                version = f"{metadata.version(dist)}" + ("" if dist.replace("-", "_") == name else f" ({dist})")
                break
            except metadata.PackageNotFoundError:
                continue
        found.append(f"{name} {version}")
    print("versions: " + "; ".join(found))
    if shutil.which("nvidia-smi"):
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=15)
            print("nvidia-smi: " + (smi.stdout.strip() or smi.stderr.strip()))
        except (OSError, subprocess.SubprocessError) as exc:
            print(f"nvidia-smi: failed ({exc})")
    else:
        print("nvidia-smi: not found")
    print(f"compiler: {shutil.which('gcc') or shutil.which('cc') or 'none'}; "
          f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}")


def _driver() -> str:
    import ctypes.util

    from exchange.devices.cuda import driver_cuda_major

    major = driver_cuda_major()
    if major is None and ctypes.util.find_library("cuda") is None:
        raise RuntimeError("no usable GPU: no NVIDIA driver on this machine (no /proc/driver/nvidia/version, no libcuda)")
    return f"NVIDIA driver for CUDA {major if major is not None else '(version unknown)'}"


def _pytest() -> str:
    import pytest

    return f"pytest {pytest.__version__}"


def _cuda_core() -> str:
    try:
        import cuda.core as cc
    except ImportError as exc:
        raise RuntimeError(f"cuda.core cannot be imported: {exc}") from exc
    if not hasattr(cc, "Device"):  # cuda.core < 0.5 kept it here
        cc = importlib.import_module("cuda.core.experimental")
    try:
        device = cc.Device(0)
        device.set_current()
    except Exception as exc:  # no driver, or no device: the reason the whole check stops
        raise RuntimeError(f"no usable GPU: cuda.core Device(0) failed: {type(exc).__name__}: {exc}") from exc
    return f"cuda.core Device(0): {device.name}, compute {device.compute_capability.major}.{device.compute_capability.minor}"


def _cupy() -> str:
    import cupy

    value = int((cupy.arange(10) * 2).sum())  # an elementwise and a reduction kernel, compiled and run
    if value != 90:
        raise RuntimeError(f"a CuPy kernel computed {value}, not 90")
    return f"CuPy kernel ran on device {cupy.cuda.Device().id}"


def _torch() -> str:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"torch {torch.__version__}: torch.cuda.is_available() is False (CPU build, or no driver)")
    return f"torch.cuda: {torch.cuda.get_device_name(0)}"


def _jax() -> str:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    devices = jax.devices("gpu")
    if not devices:
        raise RuntimeError("jax.devices('gpu') is empty")
    return f"jax GPU: {devices[0]}"


CHECKS: list[tuple[str, Callable[[], str]]] = [("pytest", _pytest), ("driver", _driver), ("cuda.core", _cuda_core),
                                               ("cupy", _cupy),
                                               ("torch", _torch), ("jax", _jax)]


def main() -> int:
    started = time.perf_counter()
    versions()
    failed = []
    for name, check in CHECKS:
        t0 = time.perf_counter()
        try:
            print(f"preflight {name}: ok: {check()} ({time.perf_counter() - t0:.1f} s)", flush=True)
        except Exception as exc:  # every failure is reported, with its reason
            print(f"preflight {name}: FAILED: {type(exc).__name__}: {exc}", flush=True)
            failed.append(name)
            if "no usable GPU" in str(exc):
                print("preflight: no usable GPU here, so the remaining checks are not tried", flush=True)
                break
    print(f"preflight: {time.perf_counter() - started:.1f} s")
    if failed:
        print(f"GPU CHECK FAILED in preflight: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
