"""GPU tests: one probe for a usable CUDA device, markers, the shared fixtures, and
what keeps one bad test from costing the run (time limits, results written as they
come, a test's child processes ended after it).

Without a usable device every test in this folder is skipped with the probe's reason
(the backend's own words: no cuda-python, no driver, no device). The probe catches
only ``tx.BackendUnavailableError``: any other failure is a real error and shows. A
peer that is missing or cannot run here (CuPy, PyTorch's CUDA build, JAX's GPU backend)
skips the tests that need it with ``peer unusable: <peer>: <why>``, the reason
ci/check_gpu_results.py accepts only where ci/gpu_preflight.py found that peer unusable
too. Helpers for the tests live in ``gpu_helpers.py`` (this file is never imported).

Time limits (seconds, ``EXCHANGE_GPU_TEST_TIMEOUT``, default 45; 0: none), over a
test's setup, call and teardown: past the limit the test fails and the run goes on
(pytest-timeout's signal method where that plugin has a ``--timeout``, else our own
SIGALRM); should the test be stuck where no signal gets through (a driver call that
never returns), every thread's stack is printed HARD_GRACE_S (15) seconds later and the
process ends. ``EXCHANGE_GPU_RESULTS``: a file each test's start and outcome is appended to as
it happens (JSON lines), so a run that ends early still tells what ran and what hung;
the stuck test's stacks go to that path with ``.stacks`` added.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import multiprocessing
import os
import signal
import sys
from pathlib import Path

import pytest

import exchange as tx

HERE = Path(__file__).resolve().parent

# JAX takes most of the GPU's memory at its first use unless told not to.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

#: Default seconds one GPU test may take (setup, call and teardown).
DEFAULT_TIMEOUT_S = 45.0
#: Seconds past the limit before a test stuck beyond signals ends the process
#: (EXCHANGE_GPU_TEST_HARD_GRACE).
HARD_GRACE_S = float(os.environ.get("EXCHANGE_GPU_TEST_HARD_GRACE", "15"))

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


def _mine(item: pytest.Item) -> bool:
    return HERE in Path(str(item.path)).resolve().parents


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a usable CUDA device (tests/gpu; skipped with the reason without one)")
    config.addinivalue_line("markers", "multi_gpu(n): needs at least n CUDA devices")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if _mine(item)]
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


def peer_unusable(peer: str, why: str) -> None:
    """Skip the test: ``peer`` (cupy, torch, jax) is missing or cannot run here."""
    pytest.skip(f"peer unusable: {peer}: {why}")


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def cuda():
    """The loaded CUDA backend (exchange.devices.cuda.CUDABackend)."""
    from exchange.devices.base import get_backend

    return get_backend(tx.DeviceType.kDLCUDA)


@pytest.fixture(scope="session")
def cp():
    """CuPy, made to use device 0, once it has run a kernel (as the preflight checks)."""
    try:
        import cupy
    except ImportError as exc:
        peer_unusable("cupy", f"CuPy cannot be imported ({exc})")
    try:
        cupy.cuda.Device(0).use()
        value = int((cupy.arange(10) * 2).sum())
    except Exception as exc:  # no NVRTC, a CuPy of another CUDA major: its tests cannot run
        peer_unusable("cupy", f"CuPy cannot run a kernel ({type(exc).__name__}: {exc})")
    if value != 90:
        peer_unusable("cupy", f"a CuPy kernel computed {value}, not 90")
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
    try:
        import torch
    except ImportError as exc:
        peer_unusable("torch", f"PyTorch cannot be imported ({exc})")
    if not torch.cuda.is_available():
        peer_unusable("torch", f"PyTorch {torch.__version__} has no usable CUDA device (CPU build?)")
    return torch


@pytest.fixture(scope="session")
def jax_gpu():
    """JAX with a GPU backend, or skip."""
    try:
        import jax
    except ImportError as exc:
        peer_unusable("jax", f"JAX cannot be imported ({exc})")
    try:
        devices = jax.devices("gpu")
    except RuntimeError as exc:
        peer_unusable("jax", f"JAX {jax.__version__} has no GPU backend: {exc}")
    if not devices:
        peer_unusable("jax", f"JAX {jax.__version__} sees no GPU")
    return jax


# -- time limits, results as they come, children ended --------------------------------------------
class GPUTestTimeout(Exception):
    """A GPU test ran past EXCHANGE_GPU_TEST_TIMEOUT (raised in it by SIGALRM)."""


def _test_timeout() -> float:
    """Seconds one GPU test may take (EXCHANGE_GPU_TEST_TIMEOUT; 0: no limit)."""
    try:
        return max(0.0, float(os.environ.get("EXCHANGE_GPU_TEST_TIMEOUT", DEFAULT_TIMEOUT_S)))
    except ValueError:
        return DEFAULT_TIMEOUT_S


def _plugin_timeout(config: pytest.Config) -> float:
    """pytest-timeout's --timeout where that plugin is active, else 0."""
    if not config.pluginmanager.hasplugin("timeout"):
        return 0.0
    try:
        return float(config.getoption("timeout") or 0)
    except (ValueError, TypeError):
        return 0.0


def _on_alarm(signum: int, frame: object) -> None:
    raise GPUTestTimeout(f"the test ran past its limit of {_test_timeout():g} s (EXCHANGE_GPU_TEST_TIMEOUT)")


def _kill_children(nodeid: str) -> None:
    """End the child processes a test left running (a spawned worker would keep its GPU
    context, and its waits, for minutes)."""
    for child in multiprocessing.active_children():
        print(f"\n{nodeid}: ending child process {child.pid} ({child.name}) left running", flush=True)
        child.kill()
        child.join(5)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    limit = _test_timeout() if _mine(item) else 0.0
    own_alarm = limit > 0 and not _plugin_timeout(item.config) and hasattr(signal, "setitimer")
    if limit > 0:  # stuck beyond signals: the stacks, then the end of the process
        faulthandler.dump_traceback_later(limit + HARD_GRACE_S, exit=True, file=_stacks_file())
    if own_alarm:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        if own_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        if limit > 0:
            faulthandler.cancel_dump_traceback_later()
        if _mine(item):
            _kill_children(item.nodeid)


_stacks: list = []


def _stacks_file():
    """Where faulthandler writes the stacks of a stuck test: EXCHANGE_GPU_RESULTS's path
    with ``.stacks`` added (pytest captures stderr into a file that is lost when the
    process ends that way), else stderr."""
    path = os.environ.get("EXCHANGE_GPU_RESULTS")
    if not path:
        return sys.stderr
    if not _stacks:
        _stacks.append(open(path + ".stacks", "a"))  # noqa: SIM115 - open for the whole run
    return _stacks[0]


def _results(line: dict) -> None:
    """Append one JSON line to EXCHANGE_GPU_RESULTS (one write, unbuffered: it is on
    disk even if the process is ended right after)."""
    path = os.environ.get("EXCHANGE_GPU_RESULTS")
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    finally:
        os.close(fd)


def _message(report: pytest.TestReport | pytest.CollectReport) -> str:
    if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    return str(report.longrepr or "")[-2000:]


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    _results({"nodeid": nodeid, "event": "start"})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":  # each test's outcome, and any setup or teardown failure
        _results({"nodeid": report.nodeid, "event": report.when, "outcome": report.outcome,
                  "seconds": round(report.duration, 3), "message": "" if report.passed else _message(report)})


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.outcome != "passed":  # a module skipped or failing as a whole
        _results({"nodeid": report.nodeid, "event": "collect", "outcome": report.outcome, "seconds": 0.0,
                  "message": _message(report)})


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under compute-sanitizer (EXCHANGE_GPU_SANITIZER=1) leave no device memory of
    ours or CuPy's pools at exit, so --leak-check reports only real leaks."""
    if not os.environ.get("EXCHANGE_GPU_SANITIZER") or _probe()[0] is not None:
        return
    gc.collect()
    tx.registry().collect(timeout=10)
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()


@pytest.fixture(autouse=True)
def _releases_complete():
    """Each test starts and ends with no release pending, so one test's memory cannot
    be blamed on the next."""
    yield
    gc.collect()
    if _probe()[0] is None:
        assert tx.registry().collect(timeout=30), "releases still pending 30 s after the test"
