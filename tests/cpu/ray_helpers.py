"""What the Ray test modules share (test_ray.py, test_ray_nodes.py, test_ray_compiled.py):
a local cluster started afresh, an alarm that bounds each test, and the driver's live
records. Imports Ray only when a cluster is started.

The fixtures work where a test module imports them: ``cluster`` (a local cluster for
the module, shut down after it) and ``time_limit`` (each test stopped after the
module's ``LIMIT_S`` seconds)."""

from __future__ import annotations

import contextlib
import gc
import signal
import warnings
from typing import Iterator

import pytest

import exchange as tx


def start_local_cluster() -> None:
    """A local cluster of 2 CPUs and a 200 MiB store, no dashboard (any other stopped first)."""
    import ray

    from exchange.ray import objects as ray_objects

    if ray.is_initialized():
        ray.shutdown()
    with ray_starting_processes():
        ray_objects.init(num_cpus=2, object_store_memory=200 << 20)


@contextlib.contextmanager
def ray_starting_processes() -> Iterator[None]:
    """Without JAX's "os.fork() was called ... deadlock" warning, which Ray's start of its
    processes sets off once an earlier test of this process has started JAX. It is harmless
    there: Ray starts each process with ``subprocess.Popen(preexec_fn=...)``, whose child
    only blocks SIGINT and sets its parent-death signal before it execs; no JAX code, and
    no lock JAX's threads may hold, runs between the fork and the exec."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        yield


@contextlib.contextmanager
def alarm(limit_s: int) -> Iterator[None]:
    """TimeoutError in the main thread once ``limit_s`` seconds have passed."""
    def stop(signum, frame):
        raise TimeoutError(f"test ran past {limit_s} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(limit_s)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def live_ids() -> set[int]:
    """The ids of this process's live records, after a collection."""
    gc.collect()
    tx.registry().collect(timeout=5)
    return {r.id for r in tx.registry().snapshot()}


@pytest.fixture(scope="module", autouse=True)
def cluster():
    import ray

    start_local_cluster()
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def time_limit(request):
    with alarm(request.module.LIMIT_S):
        yield
