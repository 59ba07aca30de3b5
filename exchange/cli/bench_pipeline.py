"""``tensor-exchange bench`` section "pipeline": what the pipelined in-process chain pays
to hand a batch from one stage's host stream to the next (the cost that decides when
pipelining a chain pays off).

``chain_pipelined_handoff_ratio``: the hand-off per stage of a 4-stage NumPy chain
(1 KiB float32, stages that return their input), pipelined (``max_in_flight=2``: each
stage on its own host stream) minus the same chain inline (``max_in_flight=1``), per
stage; over a bare Python thread hand-off of the same array, 4 worker threads passing it
on through ``queue.SimpleQueue`` with 2 in flight, minus the 4 calls made directly, per
stage. Runs of 400 batches, the four candidates in interleaved rounds, medians. Target
1.5.
"""

from __future__ import annotations

import queue
import statistics
import threading
import time
from typing import Any, Callable

from .bench import Config, _gc_off

__all__ = ["KEYS", "TARGETS", "measure", "format"]

KEYS = ("chain_pipelined_handoff_ratio",)
TARGETS = {"chain_pipelined_handoff_ratio": 1.5}

STAGES = 4
BATCHES = 400


def _same(x: Any) -> Any:
    return x


class _Bare:
    """STAGES threads handing each item on through SimpleQueues; ``run`` keeps 2 in flight."""

    def __init__(self) -> None:
        self.queues: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(STAGES + 1)]
        self.threads = [threading.Thread(target=self._work, args=(k,), daemon=True) for k in range(STAGES)]
        for t in self.threads:
            t.start()

    def _work(self, k: int) -> None:
        get, put = self.queues[k].get, self.queues[k + 1].put
        while True:
            item = get()
            if item is not None:
                item = _same(item)
            put(item)
            if item is None:
                return

    def run(self, items: list[Any]) -> None:
        first, last = self.queues[0], self.queues[-1]
        in_flight = 0
        for x in items:
            first.put(x)
            in_flight += 1
            if in_flight >= 2:
                last.get()
                in_flight -= 1
        while in_flight:
            last.get()
            in_flight -= 1

    def close(self) -> None:
        self.queues[0].put(None)
        self.queues[-1].get()
        for t in self.threads:
            t.join(5)


def measure(cfg: Config, peers: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    import exchange as tx

    def chain(in_flight: int) -> Any:
        return tx.Chain([tx.Stage(_same, framework="numpy", name=f"s{k}") for k in range(STAGES)],
                        max_in_flight=in_flight)

    pipelined, inline, bare = chain(2), chain(1), _Bare()
    items = [np.ones(256, dtype=np.float32)] * BATCHES

    def direct(xs: list[Any]) -> None:
        for x in xs:
            for _ in range(STAGES):
                x = _same(x)

    timed: dict[str, Callable[[], Any]] = {
        "pipelined": lambda: pipelined.run(items), "inline": lambda: inline.run(items),
        "bare": lambda: bare.run(items), "direct": lambda: direct(items)}
    samples: dict[str, list[float]] = {name: [] for name in timed}
    rounds = 7 if cfg.quick else 21
    try:
        with _gc_off():
            for f in timed.values():
                f()  # warm-up
            for _ in range(rounds):
                for name, f in timed.items():
                    t0 = time.perf_counter_ns()
                    result = f()
                    samples[name].append((time.perf_counter_ns() - t0) / BATCHES)
                    del result
    finally:
        pipelined.close()
        inline.close()
        bare.close()
    m = {name: statistics.median(v) for name, v in samples.items()}
    chain_us = (m["pipelined"] - m["inline"]) / STAGES / 1e3
    bare_us = (m["bare"] - m["direct"]) / STAGES / 1e3
    ratio = chain_us / bare_us if bare_us > 0 else None
    return {"keys": {"chain_pipelined_handoff_ratio": ratio},
            "details": {"ns_per_batch": m, "chain_handoff_us": chain_us, "bare_handoff_us": bare_us,
                        "stages": STAGES, "batches": BATCHES, "rounds": rounds}}


def format(section: dict[str, Any]) -> list[str]:
    d, ratio = section["details"], section["keys"]["chain_pipelined_handoff_ratio"]
    m = d["ns_per_batch"]
    shown = "n/a" if ratio is None else f"{ratio:.2f}"
    return [f"pipelined chain hand-off per stage {d['chain_handoff_us']:.1f} us (pipelined {m['pipelined'] / 1e3:.1f} "
            f"- inline {m['inline'] / 1e3:.1f} us a batch, {d['stages']} stages); bare thread hand-off "
            f"{d['bare_handoff_us']:.1f} us; ratio {shown} (target <= 1.5)"]
