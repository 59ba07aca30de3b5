"""``tensor-exchange bench`` section ``share``: handing a tensor to another process.

A tensor of 1 KiB, 1 MiB and 64 MiB goes through a ``multiprocessing`` Queue (spawn) to
a worker process that reads one element and replies with it on a second Queue; a
sample (a hand-off) is the time from ``put`` to that reply. tx sends a
``tx.empty(..., shared=True)`` tensor, warm: the same one each time, in an arena the
worker has mapped already (the reducer shares it, the worker takes it without asking
the sender: zero-copy, no round trip). The peers, same sizes, same Queues, same run:
a PyTorch tensor after ``share_memory_()`` through ``torch.multiprocessing``'s
reducers, and the standard library's way, a ``multiprocessing.shared_memory`` segment
made once, its name and size sent, the worker attaching it by name each time (as a
user of the standard library writes it, with no cache of attached segments: no
ownership at all). The candidates are sampled in turn (the order rotating every
round); each figure is the median of all its samples.

Then throughput: 1 KiB tensors, a new ``tx.empty(..., shared=True)`` each (a block
the arena reuses once the worker has let it go), put back to back; the worker replies
to each; hand-offs per second from the first put to the last reply. Beside it
(details), the same with one ``shared_memory`` segment's name.

Keys (``--json``): ``handoff_us_1kib`` and ``handoff_us_1mib``, tx's medians;
``handoff_shm_ratio``, tx over ``shared_memory`` by name, the larger of the two sizes
(target <= 1.2); ``handoff_per_s_1kib`` (target >= 5000); ``share_attach_us`` and
``torch_mp_us``, the medians at 64 MiB in microseconds; ``share_ratio``, tx over torch
at 64 MiB, and ``share_ratio_1mib``, the same at 1 MiB (target <= 0.3 each).
``details`` holds every size, the Queue's own round trip (an int) and the registries'
and arenas' state after the run. Without PyTorch the torch figures and their ratios
are NaN (and no target is missed).
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from typing import Any

__all__ = ["KEYS", "TARGETS", "FLOORS", "measure", "format"]

KEYS = ("handoff_us_1kib", "handoff_us_1mib", "handoff_shm_ratio", "handoff_per_s_1kib", "share_attach_us",
        "torch_mp_us", "share_ratio", "share_ratio_1mib")
#: Ratios: at most (tx over the peer, same sizes, same run).
TARGETS = {"handoff_shm_ratio": 1.2, "share_ratio": 0.3, "share_ratio_1mib": 0.3}
#: Hand-offs per second: at least.
FLOORS = {"handoff_per_s_1kib": 5000.0}

KiB, MiB = 1 << 10, 1 << 20
SIZES = (KiB, MiB, 64 * MiB)
_TIMEOUT = 60.0


def _worker(inbox: Any, outbox: Any) -> None:
    """Read one element of each tensor that arrives and reply with it; at the end,
    reply with this process's registry stats."""
    import numpy as np

    import exchange as tx

    while True:
        item = inbox.get(timeout=_TIMEOUT * 5)
        if item is None:
            break
        if isinstance(item, tx.Tensor):
            value = int(np.from_dlpack(item)[0])
        elif isinstance(item, int):
            value = item
        elif isinstance(item, tuple):  # a shared_memory segment's (name, bytes)
            value = _read_shared_memory(*item)
        else:  # a torch tensor
            value = int(item[0])
        outbox.put(value)
        del item
    gc.collect()
    tx.registry().collect(timeout=10)
    outbox.put(dict(tx.registry().stats()))


def _read_shared_memory(name: str, nbytes: int) -> int:
    """Attach a ``multiprocessing.shared_memory`` segment by name, read its first byte,
    let it go."""
    from multiprocessing import shared_memory

    import numpy as np

    segment = shared_memory.SharedMemory(name=name)
    view = np.ndarray((nbytes,), np.uint8, segment.buf)
    value = int(view[0])
    del view
    segment.close()  # the sender unlinks it (its resource tracker, shared with this process, forgets the name)
    return value


def measure(cfg: Any, peers: dict[str, Any]) -> dict[str, Any]:
    import multiprocessing
    from multiprocessing import shared_memory

    import exchange as tx

    torch = peers.get("torch")
    if torch is not None:
        import torch.multiprocessing  # noqa: F401  (registers torch's reducers for the Queue)
    rounds, batch = (11, 20) if cfg.quick else (31, 40)
    ctx = multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    worker = ctx.Process(target=_worker, args=(inbox, outbox), daemon=True)
    worker.start()
    segments: list[Any] = []
    try:
        candidates: list[tuple[str, int, Any]] = [("queue", 0, 1)]
        for size in SIZES:
            t = tx.empty(size, "uint8", shared=True)
            candidates.append(("tx", size, t))
            if torch is not None:
                candidates.append(("torch", size, torch.zeros(size, dtype=torch.uint8).share_memory_()))
            segments.append(shared_memory.SharedMemory(create=True, size=size))
            candidates.append(("shm", size, (segments[-1].name, size)))
        samples: dict[tuple[str, int], list[float]] = {(name, size): [] for name, size, _ in candidates}

        def trip(x: Any) -> int:
            t0 = time.perf_counter_ns()
            inbox.put(x)
            outbox.get(timeout=_TIMEOUT)
            return time.perf_counter_ns() - t0

        for _, _, x in candidates:  # warm-up: imports, first mappings, caches
            for _ in range(batch):
                trip(x)
        gc_was = gc.isenabled()
        gc.disable()
        try:
            k = len(candidates)
            for r in range(rounds):
                for j in range(k):
                    name, size, x = candidates[(r + j) % k]
                    for _ in range(batch):
                        samples[(name, size)].append(trip(x) / 1e3)
        finally:
            if gc_was:
                gc.enable()
        del candidates, x, t
        rates = _throughput(tx, inbox, outbox, segments, 2000 if cfg.quick else 5000)
        inbox.put(None)
        worker_stats = outbox.get(timeout=_TIMEOUT)
        worker.join(_TIMEOUT)
    finally:
        if worker.is_alive():
            worker.kill()
            worker.join(_TIMEOUT)
        for q in (inbox, outbox):
            q.close()
            q.join_thread()
        for segment in segments:
            segment.close()
            segment.unlink()
    gc.collect()
    reg = tx.registry()
    deadline = time.monotonic() + 10
    while reg.stats()["remote_holders"] and time.monotonic() < deadline:
        time.sleep(0.01)
    own = reg.stats()
    from exchange.devices.cpu import arena_stats

    def median(name: str, size: int) -> float:
        s = samples.get((name, size))
        return statistics.median(s) if s else math.nan

    rows = []
    for size in SIZES:
        ours, peer, shm = median("tx", size), median("torch", size), median("shm", size)
        rows.append({"bytes": size, "tx_us": ours, "torch_us": peer, "ratio": ours / peer if peer == peer else math.nan,
                     "shm_us": shm, "shm_ratio": ours / shm,
                     "tx_p10_us": _quantile(samples[("tx", size)], 0.1),
                     "tx_p90_us": _quantile(samples[("tx", size)], 0.9)})
    kib, mib, big = rows
    return {
        "keys": {
            "handoff_us_1kib": float(kib["tx_us"]),
            "handoff_us_1mib": float(mib["tx_us"]),
            "handoff_shm_ratio": float(max(kib["shm_ratio"], mib["shm_ratio"])),
            "handoff_per_s_1kib": float(rates["tx"]),
            "share_attach_us": float(big["tx_us"]),
            "torch_mp_us": float(big["torch_us"]),
            "share_ratio": float(big["ratio"]),
            "share_ratio_1mib": float(mib["ratio"]),
        },
        "details": {
            "rows": rows,
            "per_s_1kib": rates,
            "queue_int_us": median("queue", 0),
            "rounds": rounds,
            "batch": batch,
            "samples_per_candidate": rounds * batch,
            "torch": torch is not None,
            "worker_registry": worker_stats,
            "registry_after": {k: own[k] for k in ("remote_holders", "live_records")},
            "arenas_after": arena_stats(),
            "consistent": worker_stats["live_records"] == 0 and worker_stats["remote_holders"] == 0
            and own["remote_holders"] == 0,
        },
    }


def _throughput(tx: Any, inbox: Any, outbox: Any, segments: list, n: int) -> dict[str, float]:
    """Hand-offs per second of ``n`` 1 KiB tensors put back to back (tx: a new shared
    tensor each, filled; shared_memory: the 1 KiB segment's name), the worker replying
    to each: from the first put to the last reply, the better of two runs each."""
    import numpy as np

    def tx_run() -> float:
        t0 = time.perf_counter()
        for k in range(n):
            t = tx.empty(KiB, "uint8", shared=True)
            np.from_dlpack(t)[0] = k & 0x7F
            inbox.put(t)
            del t
        for _ in range(n):
            outbox.get(timeout=_TIMEOUT)
        return n / (time.perf_counter() - t0)

    def shm_run() -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            inbox.put((segments[0].name, KiB))
        for _ in range(n):
            outbox.get(timeout=_TIMEOUT)
        return n / (time.perf_counter() - t0)

    rates: dict[str, float] = {"tx": 0.0, "shm": 0.0}
    for _ in range(2):
        rates["tx"] = max(rates["tx"], tx_run())
        rates["shm"] = max(rates["shm"], shm_run())
    return rates


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q))]


def format(section: dict[str, Any]) -> list[str]:
    d, keys = section["details"], section["keys"]
    lines = [f"{'hand-off to a process (Queue, spawn)':40} {'tx':>10} {'torch.mp':>10} {'ratio':>6} "
             f"{'shm by name':>12} {'ratio':>6}"]
    for row in d["rows"]:
        size = f"{row['bytes'] // MiB} MiB" if row["bytes"] >= MiB else f"{row['bytes'] // KiB} KiB"
        lines.append(f"{'  ' + size + ', worker reads one element':40} {row['tx_us']:8.1f}us {row['torch_us']:8.1f}us "
                     f"{row['ratio']:6.2f} {row['shm_us']:10.1f}us {row['shm_ratio']:6.2f}")
    marks = []
    for bounds, sign in ((TARGETS, "<="), (FLOORS, ">=")):
        for key, bound in bounds.items():
            value = keys[key]
            ok = value <= bound if sign == "<=" else value >= bound
            marks.append(f"{key} {value:.3g} ({sign} {bound:g}: {'ok' if ok else 'MISSED' if value == value else 'no peer'})")
    lines.append("; ".join(marks))
    lines.append(f"(1 KiB hand-offs back to back: tx {d['per_s_1kib']['tx']:.0f}/s, shared_memory by name "
                 f"{d['per_s_1kib']['shm']:.0f}/s; the Queue's own round trip with an int: {d['queue_int_us']:.1f} us; "
                 f"registries after: {'consistent' if d['consistent'] else 'NOT CONSISTENT'})")
    return lines
