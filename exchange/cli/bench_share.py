"""``tensor-exchange bench`` section ``share``: handing a tensor to another process.

One tensor of 1 MiB and one of 64 MiB go through a ``multiprocessing`` Queue (spawn) to
a worker process that reads one element and replies on a second Queue; a sample is the
time from ``put`` to the reply. tx sends ``tx.empty(..., shared=True)`` (the reducer
shares it, the worker attaches it: zero-copy); the peer sends a PyTorch tensor after
``share_memory_()`` through ``torch.multiprocessing``'s reducers, the same sizes, the
same Queues, in the same run. Both sides' memory is shareable from the start, so both
hops are dominated by the Queue's own pickling and pipe. Beside them (details only), the
standard library's way: a ``multiprocessing.shared_memory`` segment made once, its name
and size sent, the worker attaching it by name each time (as a user of the standard
library writes it, with no cache of attached segments). The candidates are sampled in
turn (the order rotating every round); each figure is the median of all its samples.

Keys (``--json``): ``share_attach_us`` and ``torch_mp_us``, the medians at 64 MiB in
microseconds; ``share_ratio``, tx over torch at 64 MiB (target <= 1.0);
``share_ratio_1mib``, the same at 1 MiB (target <= 1.15). ``details`` holds every size
(with ``shm_us``, the shared_memory peer), the Queue's own round trip (an int) and the
registries' state after the run. Without PyTorch the torch figures and the ratios are
NaN (and no target is missed).
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from typing import Any

__all__ = ["KEYS", "TARGETS", "measure", "format"]

KEYS = ("share_attach_us", "torch_mp_us", "share_ratio", "share_ratio_1mib")
#: Issue 12: tx over torch.multiprocessing, same sizes, same run.
TARGETS = {"share_ratio": 1.0, "share_ratio_1mib": 1.15}

MiB = 1 << 20
SIZES = (MiB, 64 * MiB)
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
        del candidates, x
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

    def median(name: str, size: int) -> float:
        s = samples.get((name, size))
        return statistics.median(s) if s else math.nan

    rows = []
    for size in SIZES:
        ours, peer = median("tx", size), median("torch", size)
        rows.append({"bytes": size, "tx_us": ours, "torch_us": peer, "ratio": ours / peer if peer == peer else math.nan,
                     "shm_us": median("shm", size),
                     "tx_p10_us": _quantile(samples[("tx", size)], 0.1),
                     "tx_p90_us": _quantile(samples[("tx", size)], 0.9)})
    big, small = rows[-1], rows[0]
    return {
        "keys": {
            "share_attach_us": float(big["tx_us"]),
            "torch_mp_us": float(big["torch_us"]),
            "share_ratio": float(big["ratio"]),
            "share_ratio_1mib": float(small["ratio"]),
        },
        "details": {
            "rows": rows,
            "queue_int_us": median("queue", 0),
            "rounds": rounds,
            "batch": batch,
            "samples_per_candidate": rounds * batch,
            "torch": torch is not None,
            "worker_registry": worker_stats,
            "registry_after": {k: own[k] for k in ("remote_holders", "live_records")},
            "consistent": worker_stats["live_records"] == 0 and worker_stats["remote_holders"] == 0
            and own["remote_holders"] == 0,
        },
    }


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q))]


def format(section: dict[str, Any]) -> list[str]:
    d = section["details"]
    lines = [f"{'hand-off to a process (Queue, spawn)':44} {'tx':>10} {'torch.mp':>10} {'ratio':>7}  target"]
    for row in d["rows"]:
        target = TARGETS["share_ratio"] if row["bytes"] == SIZES[-1] else TARGETS["share_ratio_1mib"]
        ratio = row["ratio"]
        mark = f"<= {target:g}  " + ("ok" if ratio <= target else "MISSED" if ratio == ratio else "no peer")
        lines.append(f"{'  ' + str(row['bytes'] // MiB) + ' MiB, worker reads one element':44} "
                     f"{row['tx_us']:8.1f}us {row['torch_us']:8.1f}us {ratio:7.2f}  {mark}")
    shm = ", ".join(f"{row['shm_us']:.1f} us at {row['bytes'] // MiB} MiB" for row in d["rows"] if "shm_us" in row)
    if shm:
        lines.append(f"(multiprocessing.shared_memory, attached by name each time: {shm})")
    lines.append(f"(the Queue's own round trip with an int: {d['queue_int_us']:.1f} us; "
                 f"registries after: {'consistent' if d['consistent'] else 'NOT CONSISTENT'})")
    return lines
