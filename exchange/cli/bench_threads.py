"""``tensor-exchange bench`` section "threads": exchanges per second from 1, 2, 4 and 8
threads at once, one exchange being NumPy -> tx -> NumPy
(``np.from_dlpack(tx.from_dlpack(a))``, both registry paths), beside NumPy -> NumPy ->
NumPy; ``thread_scaling`` maps the thread count to exchanges per second (no target).
Always on the CPU. The details sit in ``details["threads"]``.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from .bench import Config, _gc_off, _loop1, _loop2

__all__ = ["KEYS", "TARGETS", "DETAILS", "THREAD_COUNTS", "measure", "format"]

KEYS = ("thread_scaling",)
TARGETS: dict[str, float] = {}
#: The entries of ``details`` this section fills.
DETAILS = ("threads",)
THREAD_COUNTS = (1, 2, 4, 8)
_ns = time.perf_counter_ns


def measure(cfg: Config, peers: dict[str, Any]) -> dict[str, Any]:
    threads = measure_threads(cfg)
    return {"keys": {"thread_scaling": {k: float(v) for k, v in threads["exchanges_per_s"].items()}},
            "details": {"threads": threads}}


def _rate(f: Callable[[Any], Any], g: Callable[[Any], Any] | None, threads: int, seconds: float) -> dict[str, Any]:
    import numpy as np

    arrays = [np.ones(256, dtype=np.float32) for _ in range(threads)]
    counts = [0] * threads
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)
    stop = threading.Event()

    def work(i: int) -> None:
        a, n = arrays[i], 0
        try:
            start.wait()
            while not stop.is_set():
                if g is None:
                    _loop1(f, a, 64)
                else:
                    _loop2(f, g, a, 64)
                n += 64
        except BaseException as exc:  # reported in details; the count stays what it was
            errors.append(exc)
        counts[i] = n

    pool = [threading.Thread(target=work, args=(i,), name=f"tx-bench-{i}") for i in range(threads)]
    for th in pool:
        th.start()
    start.wait()
    t0 = _ns()
    time.sleep(seconds)
    stop.set()
    for th in pool:
        th.join()
    elapsed = (_ns() - t0) / 1e9
    return {"per_s": sum(counts) / elapsed, "per_thread": counts, "errors": [repr(e) for e in errors]}


def measure_threads(cfg: Config) -> dict[str, Any]:
    """One exchange is NumPy -> tx -> NumPy (import and export, both registry paths)."""
    import numpy as np

    import exchange as tx

    reg = tx.registry()
    before = reg.stats()
    ours, peer = {}, {}
    with _gc_off():
        for n in THREAD_COUNTS:
            ours[str(n)] = _rate(np.from_dlpack, tx.from_dlpack, n, cfg.thread_seconds)
            peer[str(n)] = _rate(np.from_dlpack, np.from_dlpack, n, cfg.thread_seconds)
    after = reg.stats()
    one = ours["1"]["per_s"] or 1.0
    return {
        "exchange": "np.from_dlpack(tx.from_dlpack(ndarray))",
        "peer": "np.from_dlpack(np.from_dlpack(ndarray))",
        "exchanges_per_s": {k: v["per_s"] for k, v in ours.items()},
        "speedup_vs_1": {k: v["per_s"] / one for k, v in ours.items()},
        "peer_exchanges_per_s": {k: v["per_s"] for k, v in peer.items()},
        "per_thread_counts": {k: v["per_thread"] for k, v in ours.items()},
        "errors": [e for v in ours.values() for e in v["errors"]],
        "registry_balanced": (after["live_records"] == before["live_records"]
                              and after["exports_outstanding"] == before["exports_outstanding"]),
        "seconds_each": cfg.thread_seconds,
    }


def format(section: dict[str, Any]) -> list[str]:
    th = section["details"]["threads"]
    lines = [f"{'threads':>7} {'exchanges/s':>12} {'vs 1':>6} {'numpy peer/s':>13}"]
    for k, v in th["exchanges_per_s"].items():
        lines.append(f"{k:>7} {v:12,.0f} {th['speedup_vs_1'][k]:6.2f} {th['peer_exchanges_per_s'][k]:13,.0f}")
    if th["errors"]:
        lines.append(f"thread errors: {th['errors'][:3]}")
    if not th["registry_balanced"]:
        lines.append("registry NOT balanced after the thread runs")
    return lines
