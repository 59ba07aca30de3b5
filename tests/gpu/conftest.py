"""GPU tests: one probe for a usable CUDA device, markers, and the shared fixtures.

Without a usable device every test in this folder is skipped with the probe's reason
(the backend's own words: no cuda-python, no driver, no device). The probe catches
only ``tx.BackendUnavailableError``: any other failure is a real error and shows.
Helpers for the tests live in ``gpu_helpers.py`` (this file is never imported).
"""

from __future__ import annotations

import faulthandler
import gc
import os
from pathlib import Path

import pytest

import exchange as tx

HERE = Path(__file__).resolve().parent

# JAX takes most of the GPU's memory at its first use unless told not to.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

_probe_result: list = []  # [reason or None, device count], filled once


def _probe() -> tuple[str | None, int]:
    if not _probe_result:
        from exchange.devices.base import get_backend

        try:
            backend = get_backend(tx.DeviceType.kDLCUDA)
        except tx.BackendUnavailableError as exc:
            _probe_result.extend([f"no usable CUDA device: {exc}", 0])
        else:
            _probe_result.extend([None, backend.device_count])
    return _probe_result[0], _probe_result[1]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a usable CUDA device (tests/gpu; skipped with the reason without one)")
    config.addinivalue_line("markers", "multi_gpu(n): needs at least n CUDA devices")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if HERE in Path(str(item.path)).resolve().parents]
    if not mine:
        return
    reason, count = _probe()
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
            continue
        multi = item.get_closest_marker("multi_gpu")
        if multi is not None:
            need = int(multi.args[0]) if multi.args else 2
            if count < need:
                item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA devices, this machine has {count}"))


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def cuda():
    """The loaded CUDA backend (exchange.devices.cuda.CUDABackend)."""
    from exchange.devices.base import get_backend

    return get_backend(tx.DeviceType.kDLCUDA)


@pytest.fixture(scope="session")
def cp():
    """CuPy, made to use device 0."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    cupy.cuda.Device(0).use()
    return cupy


@pytest.fixture(scope="session")
def kernels(cp):
    """The test kernels (CuPy RawKernels; see gpu_helpers.KERNELS)."""
    from gpu_helpers import KERNELS

    module = cp.RawModule(code=KERNELS)
    return {name: module.get_function(name) for name in ("spin_then_fill", "spin_then_copy", "copy_f32", "fill_f32")}


@pytest.fixture(scope="session")
def warm(cp, kernels):
    """Compile and load, before any timed window opens, what the windows use: the test
    kernels and CuPy's own elementwise kernels (arange, + scalar, fill with a non-zero
    value, ==, all, full), so no window contains a compile."""
    x = cp.arange(1024, dtype=cp.float32) + cp.float32(7.0)
    y = cp.empty_like(x)
    y.fill(-1.0)
    bool((x == y).all())
    cp.full(16, -1.0, dtype=cp.float32)
    cp.cuda.Stream.null.synchronize()
    return True


@pytest.fixture(scope="session")
def torch_cuda():
    """PyTorch with a usable CUDA device, or skip."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip(f"PyTorch {torch.__version__} has no usable CUDA device (CPU build?)")
    return torch


@pytest.fixture(scope="session")
def jax_gpu():
    """JAX with a GPU backend, or skip."""
    jax = pytest.importorskip("jax", reason="JAX is not installed")
    try:
        devices = jax.devices("gpu")
    except RuntimeError as exc:
        pytest.skip(f"JAX {jax.__version__} has no GPU backend: {exc}")
    if not devices:
        pytest.skip(f"JAX {jax.__version__} sees no GPU")
    return jax


def _test_timeout(config: pytest.Config) -> float:
    """Seconds one GPU test may take (EXCHANGE_GPU_TEST_TIMEOUT, default 120; 0: none);
    pytest-timeout's own --timeout is used instead where that plugin is active."""
    if config.pluginmanager.hasplugin("timeout"):
        return 0.0
    try:
        return float(os.environ.get("EXCHANGE_GPU_TEST_TIMEOUT", "120"))
    except ValueError:
        return 120.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """A hung GPU test (a kernel that never ends, a deadlock) must not eat the whole GPU
    check: past the limit faulthandler prints every thread's stack and ends the process,
    so the streamed log (pytest -v names each test as it starts) shows where."""
    limit = _test_timeout(item.config) if HERE in Path(str(item.path)).resolve().parents else 0.0
    if limit > 0:
        faulthandler.dump_traceback_later(limit, exit=True)
    try:
        yield
    finally:
        if limit > 0:
            faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def _releases_complete():
    """Each test starts and ends with no release pending, so one test's memory cannot
    be blamed on the next."""
    yield
    gc.collect()
    if _probe()[0] is None:
        assert tx.registry().collect(timeout=30), "releases still pending 30 s after the test"
