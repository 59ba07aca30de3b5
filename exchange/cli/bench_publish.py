"""``tensor-exchange bench`` section ``publish``: delivering a new version of a tensor set
(``tx.publish`` / ``tx.subscribe``) to reader processes.

Three reader processes are started once for the section (spawn), each driven by a pipe;
they subscribe to the set and, told to, take its next version and hold all its tensors
(a ``tx.Snapshot`` and every ``tx.Tensor`` of it), then say so. The set: 256 float32
tensors made by PyTorch, 1 GiB in all (``--quick``: 16 MiB). Measured:

* ``publish_memcpy_ratio``: one delivery (``tx.publish`` of the PyTorch tensors, which
  copies them into the set's memory, until every reader has acknowledged holding all
  256 tensors of the new version) over one copy of the same bytes between two touched
  buffers of this process (``np.copyto``). Target <= 1.5.
* ``publish_torch_mp_ratio``: the same delivery over torch.multiprocessing's:
  ``share_memory_()`` of a fresh state dict (256 new tensors, written before the clock
  starts) and a ``Queue.put`` of it to each reader, until each acknowledged holding it.
  Rounds alternate between the two (first touch of fresh memory varies a lot); the
  ratio of their medians. Target <= 0.15.
* ``publish_handover_ms``: a draft's ``publish()`` (the tensors written into the
  version's memory beforehand with torch's ``copy_``: no copy at publish) until every
  reader acknowledged holding all 256 tensors; the median. Target <= 2.
  Beside them (details, no target): the standard library's way, ``shm_ms``: a fresh
  ``multiprocessing.shared_memory`` segment, the tensors copied into it, its name sent
  to each reader, which attaches it by name and makes a NumPy view per tensor.
* ``subscribe_next_us``: a reader's own cost of ``Subscription.next()`` once a new
  version is there and of taking its 256 tensors; the median over readers and rounds.
  Target <= 1,000.
* ``publish_pss_ratio``: with every reader holding the newest version and having read
  all of it, the sum over the four processes of the ``Pss`` (``/proc/PID/smaps``) of the
  set's mappings, over the bytes of the set's live versions (``exchange.sets.stats()``):
  the readers add no resident copy. Measured once the set is idle (no publish for
  ``SPARE_IDLE_S`` seconds, after which the publisher gives back the regions it kept
  free for the next version); the details give the same just after the last take
  (``hot``: with the spare region, 2 for a set of one live version). Target: within
  10 % (0.9 to 1.1).
* ``publish_aging_ratio`` and ``publish_memory_aging_ratio``: a second set of small
  versions (256 tensors of 1 KiB: 1,000 versions must fit in seconds), each taken by
  every reader: the median publish time of versions 991 to 1,000 over that of versions
  1 to 10, and the memory in use (the set's mappings' Pss summed over the processes,
  and their count) after 1,000 over after 10. Targets <= 1.5 and <= 1.1. ``--quick``
  publishes 200 versions, not 1,000 (said in the details).

The set's mappings are found from the readers: each reports the ranges of the mappings
that hold its tensors (``/proc/self/maps``) and their file name; the publisher's are the
mappings of that name made during the section (for the small set, after the large one
was unpublished). The publisher keeps a region its readers let go for the next version
(no fresh pages after warm-up) for ``SPARE_IDLE_S`` seconds, so just after a take its
resident bytes are those of its regions, live and free: the details' ``hot`` gives the
Pss over those (``pss_over_regions``) and over the live bytes (``pss_over_live``).
Without PyTorch the section is skipped (its keys NaN, no target missed).
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
from typing import Any

__all__ = ["KEYS", "TARGETS", "FLOORS", "measure", "format"]

KEYS = ("publish_memcpy_ratio", "publish_torch_mp_ratio", "publish_handover_ms", "subscribe_next_us",
        "publish_pss_ratio", "publish_aging_ratio", "publish_memory_aging_ratio")
TARGETS = {"publish_memcpy_ratio": 1.5, "publish_torch_mp_ratio": 0.15, "publish_handover_ms": 2.0,
           "subscribe_next_us": 1000.0, "publish_pss_ratio": 1.1, "publish_aging_ratio": 1.5,
           "publish_memory_aging_ratio": 1.1}
#: The Pss sum may not fall below the live bytes by more than 10 % either.
FLOORS = {"publish_pss_ratio": 0.9}

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
TENSORS = 256
READERS = 3
_TIMEOUT = 120.0


# -- the reader processes ----------------------------------------------------------------
def _maps_of(addresses: list[int]) -> list[tuple[int, int, str]]:
    """The mappings of this process (start, end, file name) holding any of ``addresses``."""
    out = []
    wanted = sorted(set(addresses))
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            parts = line.split(None, 5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if any(start <= a < end for a in wanted):
                out.append((start, end, parts[5].strip() if len(parts) > 5 else ""))
    return out


def _reader(conn: Any, queue: Any) -> None:
    """Follow the commands of ``conn`` until ``("stop",)``: ``("subscribe", name)``,
    ``("take",)`` (drop what is held, take the next version, hold all its tensors,
    reply ``("held", version, tensors, ns)`` with the take's own nanoseconds),
    ``("touch",)`` (read every byte held), ``("maps",)``, ``("drop",)``, ``("get",)``
    (hold the state dict ``queue``, torch.multiprocessing's, brings), ``("shm", name,
    tensors, elements)`` (attach a ``multiprocessing.shared_memory`` segment by name and
    hold a NumPy view of each tensor in it)."""
    import numpy as np

    import exchange as tx

    import torch.multiprocessing  # noqa: F401  (its reducers, for what the queue brings)

    sub = None
    held: Any = None
    while True:
        msg = conn.recv()
        op = msg[0]
        if op == "stop":
            break
        if op == "subscribe":
            held = None
            if sub is not None:
                sub.close()
            sub = tx.subscribe(msg[1])
            conn.send(("ok",))
        elif op == "take":
            held = _let_go(held)
            t0 = time.perf_counter_ns()
            snap = sub.next(timeout=_TIMEOUT)
            tensors = [snap[k] for k in snap.keys()]
            took = time.perf_counter_ns() - t0
            held = (snap, tensors)
            conn.send(("held", snap.version, len(tensors), took))
            del snap, tensors  # held (above) is what holds the version: no other name may
        elif op == "touch":
            conn.send(("ok", sum(float(np.from_dlpack(t).sum()) for t in held[1])))
        elif op == "maps":
            conn.send(("maps", os.getpid(), _maps_of([t.data_ptr for t in held[1]])))
        elif op == "drop":
            held = _let_go(held)
            gc.collect()
            conn.send(("ok",))
        elif op == "get":
            held = _let_go(held)
            held = queue.get(timeout=_TIMEOUT)
            conn.send(("held", 0, len(held), 0))
        elif op == "shm":
            held = _let_go(held)
            held = _attach_by_name(*msg[1:])
            conn.send(("held", 0, len(held[1]), 0))
    held = _let_go(held)
    if sub is not None:
        sub.close()
    reg = tx.registry()
    deadline = time.monotonic() + 10  # the mappings go once the subscription's connection has closed
    while True:
        gc.collect()
        reg.collect(timeout=1)
        if not reg.stats()["live_records"] or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    conn.send(("stats", dict(reg.stats())))


def _let_go(held: Any) -> None:
    """Drop what a reader holds: a snapshot and its tensors (closed), a state dict, or a
    shared_memory segment and its views (closed, not unlinked: the publisher does that)."""
    if isinstance(held, tuple):
        first, views = held
        views.clear()
        first.close()
    return None


def _attach_by_name(name: str, tensors: int, elements: int) -> tuple[Any, list[Any]]:
    """The standard library's way: attach the segment by name, a NumPy view per tensor."""
    from multiprocessing import shared_memory

    import numpy as np

    segment = shared_memory.SharedMemory(name=name)
    views = [np.ndarray((elements,), np.float32, segment.buf, k * elements * 4) for k in range(tensors)]
    return segment, views


class _Readers:
    """The reader processes and their pipes."""

    def __init__(self, ctx: Any, queues: list[Any]) -> None:
        self.pipes, self.procs = [], []
        for queue in queues:
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_reader, args=(there, queue), daemon=True)
            proc.start()
            self.pipes.append(here)
            self.procs.append(proc)

    def ask(self, *msg: Any) -> list[Any]:
        """Send ``msg`` to every reader, then return their replies."""
        for p in self.pipes:
            p.send(msg)
        return [self._reply(p) for p in self.pipes]

    @staticmethod
    def _reply(pipe: Any) -> Any:
        if not pipe.poll(_TIMEOUT):
            raise TimeoutError(f"a reader did not answer within {_TIMEOUT:g} s")
        return pipe.recv()

    def close(self) -> list[Any]:
        stats = []
        for p in self.pipes:
            try:
                p.send(("stop",))
                stats.append(self._reply(p)[1])
            except (OSError, EOFError, TimeoutError):
                stats.append(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        return stats


# -- memory --------------------------------------------------------------------------------
def _pss(pid: int, match: Any) -> tuple[int, int]:
    """(the Pss in bytes, the count) of the mappings of ``pid`` for which
    ``match(start, end, name)`` holds."""
    total = count = 0
    take = False
    with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            head = line.split(None, 5)
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                start, end = (int(x, 16) for x in head[0].split("-"))
                take = match(start, end, head[5].strip() if len(head) > 5 else "")
                count += take
            elif take and head[0] == "Pss:":
                total += int(head[1]) * KiB
    return total, count


def _own_maps() -> set[tuple[int, int]]:
    with open("/proc/self/maps", encoding="utf-8") as fh:
        return {tuple(int(x, 16) for x in line.split(None, 1)[0].split("-")) for line in fh}  # type: ignore[misc]


def _set_memory(readers: _Readers, before: set[tuple[int, int]]) -> dict[str, int]:
    """The set's mappings' Pss summed over this process and the readers, and their count:
    the readers' are the mappings holding their tensors; this process's, the mappings of
    the same file name made during the section (not in ``before``)."""
    replies = readers.ask("maps")
    names = {name for _, _, maps in replies for _, _, name in maps}
    pss = count = 0
    for _, pid, maps in replies:
        ranges = {(s, e) for s, e, _ in maps}
        p, c = _pss(pid, lambda s, e, _n, ranges=ranges: (s, e) in ranges)
        pss, count = pss + p, count + c
    p, c = _pss(os.getpid(), lambda s, e, n: n in names and (s, e) not in before)
    return {"pss_bytes": pss + p, "mappings": count + c, "publisher_pss_bytes": p}


def _set_row(name: str) -> dict[str, Any]:
    import exchange.sets

    for row in exchange.sets.stats():
        if row.get("name") == name and row.get("role") == "publisher":
            return dict(row)
    raise LookupError(f"exchange.sets.stats() has no publisher row for {name!r}")


def _live_bytes(row: dict[str, Any]) -> int:
    """Bytes of the set's live versions: ``live_versions`` a count (of versions of
    ``nbytes`` each) or a list (of versions' bytes or rows with ``nbytes``)."""
    if isinstance(row.get("live_bytes"), int):
        return row["live_bytes"]
    live = row["live_versions"]
    if isinstance(live, int):
        return live * int(row["nbytes"])
    return sum(int(v["nbytes"]) if isinstance(v, dict) else int(v) for v in live)


# -- the measurement -------------------------------------------------------------------------
def measure(cfg: Any, peers: dict[str, Any]) -> dict[str, Any]:
    torch = peers.get("torch")
    if torch is None:
        return {"keys": {k: math.nan for k in KEYS}, "details": {"skipped": "no PyTorch here"}}
    import multiprocessing

    import torch.multiprocessing  # noqa: F401  (the reducers torch's delivery uses)

    total = 16 * MiB if cfg.quick else GiB
    rounds = 3 if cfg.quick else 5
    versions = 200 if cfg.quick else 1000
    ctx = multiprocessing.get_context("spawn")
    before = _own_maps()
    name = f"tx-bench-{os.getpid()}"
    queues = [ctx.Queue() for _ in range(READERS)]
    readers = _Readers(ctx, queues)
    try:
        big = _deliveries(torch, readers, queues, name, total, rounds, before)
        import exchange as tx

        tx.unpublish(name)  # its regions (the free ones kept for reuse too) go before the small set's run
        gc.collect()
        small = _aging(torch, readers, f"{name}-small", versions, _own_maps())
    finally:
        for q in queues:
            q.close()
            q.join_thread()
        reader_stats = readers.close()
        import exchange as tx

        for n in (name, f"{name}-small"):
            try:
                tx.unpublish(n)
            except Exception:  # never published (the run failed before): nothing to take back
                pass
    gc.collect()
    keys = {
        "publish_memcpy_ratio": big["publish_ms"] / big["memcpy_ms"],
        "publish_torch_mp_ratio": big["publish_ms"] / big["torch_mp_ms"],
        "publish_handover_ms": big["handover_ms"],
        "subscribe_next_us": big["next_us"],
        "publish_pss_ratio": big["memory"]["pss_bytes"] / big["memory"]["live_bytes"],
        "publish_aging_ratio": small["late_publish_us"] / small["early_publish_us"],
        "publish_memory_aging_ratio": small["after_last"]["pss_bytes"] / small["after_10"]["pss_bytes"],
    }
    return {"keys": {k: float(v) for k, v in keys.items()},
            "details": {"bytes": total, "tensors": TENSORS, "readers": READERS, "rounds": rounds, **big,
                        "aging": small, "reader_registries": reader_stats,
                        "readers_balanced": all(s is not None and s["live_records"] == 0 for s in reader_stats)}}


def _state_dict(torch: Any, total: int, fill: float) -> dict[str, Any]:
    """256 float32 PyTorch tensors of ``total`` bytes in all, written (pages touched)."""
    n = total // TENSORS // 4
    return {f"layer{i:03d}.weight": torch.full((n,), fill + i, dtype=torch.float32) for i in range(TENSORS)}


def _deliveries(torch: Any, readers: _Readers, queues: list[Any], name: str, total: int, rounds: int,
                before: set[tuple[int, int]]) -> dict[str, Any]:
    import numpy as np

    import exchange as tx

    src = _state_dict(torch, total, 1.0)
    tx.publish(name, src)  # the set exists before the readers subscribe: their first take is of version 2
    readers.ask("subscribe", name)

    def deliver(publish: Any) -> float:
        t0 = time.perf_counter_ns()
        publish()
        for p in readers.pipes:
            p.send(("take",))
        replies = [readers._reply(p) for p in readers.pipes]
        took = time.perf_counter_ns() - t0
        assert all(r[0] == "held" and r[2] == TENSORS for r in replies), replies
        return took / 1e6

    def torch_round() -> float:
        fresh = _state_dict(torch, total, 2.0)  # made and written before the clock starts
        readers.ask("drop")  # the previous round's dicts go first
        t0 = time.perf_counter_ns()
        for t in fresh.values():
            t.share_memory_()
        for q in queues:
            q.put(fresh)
        for p in readers.pipes:
            p.send(("get",))
        replies = [readers._reply(p) for p in readers.pipes]
        took = time.perf_counter_ns() - t0
        assert all(r[2] == TENSORS for r in replies), replies
        del fresh
        return took / 1e6

    def shm_round() -> float:
        from multiprocessing import shared_memory

        fresh = _state_dict(torch, total, 4.0)
        elements = total // TENSORS // 4
        readers.ask("drop")
        t0 = time.perf_counter_ns()
        segment = shared_memory.SharedMemory(create=True, size=total)
        try:
            for k, t in enumerate(fresh.values()):
                np.ndarray((elements,), np.float32, segment.buf, k * elements * 4)[...] = t.numpy()
            for p in readers.pipes:
                p.send(("shm", segment.name, TENSORS, elements))
            replies = [readers._reply(p) for p in readers.pipes]
            took = time.perf_counter_ns() - t0
            assert all(r[2] == TENSORS for r in replies), replies
            readers.ask("drop")
        finally:
            segment.close()
            segment.unlink()
        return took / 1e6

    a = np.ones(total // 4, dtype=np.float32)
    b = np.zeros_like(a)
    np.copyto(b, a)
    memcpy = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        np.copyto(b, a)
        memcpy.append((time.perf_counter_ns() - t0) / 1e6)
    del a, b
    deliver(lambda: tx.publish(name, src))  # warm-up: the regions readers will reuse
    deliver(lambda: tx.publish(name, src))
    ours, theirs, shm = [], [], []
    for r in range(rounds):
        for which in ((0, 1, 2) if r % 2 == 0 else (2, 1, 0)):
            if which == 0:
                readers.ask("drop")
                ours.append(deliver(lambda: tx.publish(name, src)))
            elif which == 1:
                theirs.append(torch_round())
            else:
                shm.append(shm_round())
    readers.ask("drop")

    handover = []
    next_ns = []
    layout = {k: (tuple(t.shape), "float32") for k, t in src.items()}
    for _ in range(rounds * 2 + 1):
        draft = tx.draft(name, layout)
        for k, t in src.items():
            torch.from_dlpack(draft[k]).copy_(t)
        readers.ask("drop")
        handover.append(deliver(draft.publish))
        del draft
    handover.pop(0)  # the first draft may need a fresh region: warm-up
    for _ in range(rounds * 2):  # the reader's own cost, the version already there
        tx.publish(name, src)
        next_ns += [r[3] for r in readers.ask("take")]
    readers.ask("touch")
    # Hot: the regions the publisher keeps free for the next version are resident too
    # (no fresh pages for it); over all its regions the readers add nothing when this is 1.
    hot = _set_memory(readers, before)
    row = _set_row(name)
    hot["regions_bytes"] = int(row.get("regions", 0)) * int(row["nbytes"])
    hot["pss_over_regions"] = hot["pss_bytes"] / hot["regions_bytes"] if hot["regions_bytes"] else math.nan
    hot["pss_over_live"] = hot["pss_bytes"] / _live_bytes(row)
    # Idle: once no version was published for SPARE_IDLE_S, the free regions are given
    # back (here and in the readers): what the set holds is its live versions.
    from exchange.sets.publisher import SPARE_IDLE_S

    time.sleep(SPARE_IDLE_S + 1.0)
    memory = _set_memory(readers, before)
    memory["live_bytes"] = _live_bytes(_set_row(name))
    memory["stats_row"] = _set_row(name)
    memory["idle_s"] = SPARE_IDLE_S + 1.0
    memory["hot"] = hot
    readers.ask("drop")
    return {"memcpy_ms": statistics.median(memcpy), "publish_ms": statistics.median(ours),
            "torch_mp_ms": statistics.median(theirs), "shm_ms": statistics.median(shm),
            "shm_rounds_ms": shm, "handover_ms": statistics.median(handover),
            "next_us": statistics.median(next_ns) / 1e3, "publish_rounds_ms": ours, "torch_mp_rounds_ms": theirs,
            "memcpy_rounds_ms": memcpy, "handover_rounds_ms": handover, "memory": memory}


def _aging(torch: Any, readers: _Readers, name: str, versions: int, before: set[tuple[int, int]]) -> dict[str, Any]:
    """Publish ``versions`` small versions, each taken by every reader: the publish times
    of the first and last ten, and the set's memory after ten and after all."""
    import exchange as tx

    src = _state_dict(torch, TENSORS * KiB, 3.0)
    tx.publish(name, src)
    readers.ask("subscribe", name)
    times = []
    after_10: dict[str, int] = {}
    for k in range(versions):
        t0 = time.perf_counter_ns()
        tx.publish(name, src)
        times.append((time.perf_counter_ns() - t0) / 1e3)
        readers.ask("take")
        if k == 9:
            after_10 = _set_memory(readers, before)
    after_last = _set_memory(readers, before)
    readers.ask("drop")
    return {"versions": versions, "versions_note": "" if versions == 1000 else
            f"--quick: {versions} versions, not 1,000", "version_bytes": TENSORS * KiB,
            "early_publish_us": statistics.median(times[:10]), "late_publish_us": statistics.median(times[-10:]),
            "after_10": after_10, "after_last": after_last}


def format(section: dict[str, Any]) -> list[str]:
    d, k = section["details"], section["keys"]
    if "skipped" in d:
        return [f"tensor sets (publish): skipped ({d['skipped']})"]

    def mark(key: str) -> str:
        v = k[key]
        ok = v <= TARGETS[key] and v >= FLOORS.get(key, -math.inf)
        return f"(target {'0.9..' if key in FLOORS else '<= '}{TARGETS[key]:g}: {'ok' if ok else 'MISSED'})"

    size = f"{d['bytes'] // GiB} GiB" if d["bytes"] >= GiB else f"{d['bytes'] // MiB} MiB"
    a = d["aging"]
    return [
        f"tensor sets: a new version ({TENSORS} float32 tensors, {size}) to {READERS} reader processes",
        f"  tx.publish until all hold it   {d['publish_ms']:9.2f} ms   memcpy {d['memcpy_ms']:.2f} ms: "
        f"ratio {k['publish_memcpy_ratio']:.2f} {mark('publish_memcpy_ratio')}",
        f"  torch.multiprocessing          {d['torch_mp_ms']:9.2f} ms   ratio {k['publish_torch_mp_ratio']:.3f} "
        f"{mark('publish_torch_mp_ratio')}",
        f"  shared_memory by name          {d['shm_ms']:9.2f} ms   ratio {d['publish_ms'] / d['shm_ms']:.3f} "
        "(no target)",
        f"  draft handover                 {k['publish_handover_ms']:9.3f} ms   {mark('publish_handover_ms')}",
        f"  reader's next() + take         {k['subscribe_next_us']:9.1f} us   {mark('subscribe_next_us')}",
        f"  Pss of the set over live bytes {k['publish_pss_ratio']:9.3f}      {mark('publish_pss_ratio')} (idle "
        f"{d['memory']['idle_s']:g} s); just after the take {d['memory']['hot']['pss_over_live']:.3f}, over the "
        f"publisher's regions, free ones included: {d['memory']['hot']['pss_over_regions']:.3f}",
        f"  after {a['versions']} versions of {a['version_bytes'] // KiB} KiB: publish time x"
        f"{k['publish_aging_ratio']:.2f} {mark('publish_aging_ratio')}, memory x{k['publish_memory_aging_ratio']:.2f} "
        f"{mark('publish_memory_aging_ratio')}",
    ]
