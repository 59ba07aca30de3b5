"""Sets on CUDA memory across real processes (exchange/sets over exchange/channels/cuda_sets.py).

The test process publishes a set on cuda:0: version k holds ``a`` (N floats, all k)
and ``b`` (k + i), written by kernels that first spin on a stream of their own, and
published at once (no host wait): tx.publish copies them in stream order, a tx.draft
has CuPy write in place. A reader process (spawn; CuPy or PyTorch) follows the set
with ``Subscription.next()`` and checks every version it takes on the GPU, on a stream
of its own: all of one version (no torn version), the publisher's writes seen (its
stream waited on the publisher's event), tensors read-only. A reader that drops a
version while a slow kernel of its own still reads it must find, once that kernel
ends, the version's values in its copy although the publisher meanwhile published
versions that reuse the region (the publisher's writes wait on the reader's release
event). Every wait bounded by TIMEOUT.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import time
from typing import Any

import numpy as np
import pytest

import exchange as tx
from gpu_helpers import BLOCK, GRID, cupy_stream, raw_view, stop_worker

#: Seconds any one wait of these tests or their reader may take (EXCHANGE_GPU_SHARE_TIMEOUT, default 20).
TIMEOUT = float(os.environ.get("EXCHANGE_GPU_SHARE_TIMEOUT", "20"))
N = 1 << 16
#: How long the publisher's fill and the reader's slow copy spin, ns.
SPIN_NS = 200_000_000


# -- the reader process ----------------------------------------------------------------------------
def _framework(kind: str) -> Any:
    """What the reader does with its framework: ``(take, minmax, slow_copy, on_stream,
    sync, arange)``: import a tensor, its (min, max) as floats, a copy queued behind a
    spin, a context that makes the reader's stream current, a wait for that stream,
    ``arange(N)`` on the device."""
    if kind == "cupy":
        import cupy as cp

        from gpu_helpers import KERNELS

        cp.cuda.Device(0).use()
        copy = cp.RawModule(code=KERNELS).get_function("spin_then_copy")
        stream = cp.cuda.Stream(non_blocking=True)

        def slow_copy(arr: Any) -> Any:
            out = cp.empty(N, dtype=cp.float32)
            copy(GRID, BLOCK, (arr, out, np.int64(N), np.uint64(SPIN_NS)))
            return out

        return cp.from_dlpack, lambda x: (float(x.min()), float(x.max())), slow_copy, lambda: stream, \
            stream.synchronize, lambda: cp.arange(N, dtype=cp.float32)
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    stream = torch.cuda.Stream()

    def slow_copy(arr: Any) -> Any:
        torch.cuda._sleep(int(2e8))  # about SPIN_NS of GPU cycles, queued before the copy
        return arr.clone()

    return torch.from_dlpack, lambda x: (float(x.min()), float(x.max())), slow_copy, \
        lambda: torch.cuda.stream(stream), stream.synchronize, \
        lambda: torch.arange(N, dtype=torch.float32, device="cuda:0")


def reader(kind: str, name: str, inbox: Any, outbox: Any) -> None:
    """Commands: ("take",): the next version, checked (answers ("ok", version, good,
    read-only refused to a legacy capsule)); ("hold_slow",): the next version, copied by
    a slow kernel, dropped while it runs (("ok", version)), then ("finish",): the copy
    checked (("ok", good)); ("follow", last): every version up to ``last``, checked
    (("ok", [(version, good)...])); ("exit",)."""
    try:
        take, minmax, slow_copy, on_stream, sync, arange = _framework(kind)
    except Exception as exc:
        outbox.put(("unusable", f"{type(exc).__name__}: {exc}"))
        return
    sub = tx.subscribe(name)
    outbox.put(("ready",))
    pending: list = []

    def check(snap: Any) -> bool:
        k = float(snap.version)
        with on_stream():
            a, b = take(snap["a"]), take(snap["b"])
            good = minmax(a) == (k, k) and minmax(b - arange()) == (k, k)
        return good

    def refused(snap: Any) -> bool:
        try:
            snap["a"].__dlpack__(stream=1)
        except BufferError:
            return True
        return False

    def one() -> None:
        with sub.next(timeout=TIMEOUT) as snap:
            outbox.put(("ok", snap.version, check(snap), refused(snap), snap["a"].readonly))

    def hold_slow() -> None:
        snap = sub.next(timeout=TIMEOUT)
        with on_stream():
            arr = take(snap["b"])
            out = slow_copy(arr)
        pending[:] = [snap.version, out]
        del arr, snap  # released while the slow copy still reads it
        gc.collect()
        outbox.put(("ok", pending[0]))

    def finish() -> None:
        version, out = pending
        sync()
        with on_stream():
            good = minmax(out - arange()) == (float(version), float(version))
        outbox.put(("ok", good))

    def follow(last: int) -> None:
        seen = []
        while not seen or seen[-1][0] < last:
            with sub.next(timeout=TIMEOUT) as snap:
                seen.append((snap.version, check(snap)))
        outbox.put(("ok", seen))

    ops = {"take": one, "hold_slow": hold_slow, "finish": finish, "follow": follow}
    while True:
        try:
            message = inbox.get(timeout=TIMEOUT * 2)
        except queue.Empty:
            return
        if message[0] == "exit":
            sub.close()
            outbox.put(("ok",))
            return
        try:
            ops[message[0]](*message[1:])
        except BaseException as exc:
            outbox.put(("err", type(exc).__name__, str(exc)))


# -- the publisher (this process) ------------------------------------------------------------------
class _Reader:
    def __init__(self, kind: str, name: str) -> None:
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=reader, args=(kind, name, self.inbox, self.outbox), daemon=True)
        self.proc.start()

    def get(self) -> tuple:
        reply = self.outbox.get(timeout=TIMEOUT)
        assert reply[0] != "err", f"the reader failed: {reply[1]}: {reply[2]}"
        return reply

    def call(self, *message: Any) -> tuple:
        self.inbox.put(message)
        return self.get()

    def close(self) -> None:
        stop_worker(self.proc, self.inbox, self.outbox, TIMEOUT)


@pytest.fixture
def start():
    made: list[_Reader] = []

    def make(kind: str, name: str) -> _Reader:
        r = _Reader(kind, name)
        made.append(r)
        first = r.get()
        if first[0] == "unusable":
            pytest.skip(f"peer unusable: {kind}: {first[1]}")  # (conftest.peer_unusable's words)
        return r

    yield make
    for r in made:
        r.close()


def _version(cp: Any, kernels: Any, k: int, spin: int = 0) -> dict:
    """Version k's tensors, written on a stream of their own by kernels that spin first
    (still running when this returns)."""
    s = tx.create_stream("cuda:0")
    a = tx.empty((N,), "float32", device="cuda:0", stream=s)
    b = tx.empty((N,), "float32", device="cuda:0", stream=s)
    with cupy_stream(cp, s):
        kernels["spin_then_fill"](GRID, BLOCK, (raw_view(cp, b), np.int64(N), np.uint64(spin), np.float32(k)))
        raw_view(cp, a).fill(np.float32(k))
    return {"a": a, "b": b}


def _draft(cp: Any, name: str, k: int) -> tx.Version:
    d = tx.draft(name, {"a": ((N,), "float32"), "b": ((N,), "float32")}, device="cuda:0")
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        a, b = cp.from_dlpack(d["a"]), cp.from_dlpack(d["b"])  # s waits for the region's stream
        a.fill(np.float32(k))
        b[:] = cp.arange(N, dtype=cp.float32) + np.float32(k)
    del a, b  # (views dropped before publish: docs/processes.md)
    return d.publish()  # readers wait for s's writes, with no host wait here


def _regions_made(name: str) -> int:
    from exchange.sets import _state

    return next(_state().publishers[name].region_ids) - 1  # (regions are numbered from 1)


@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_a_cuda_set_followed_by_a_reader_process(cp, kernels, warm, start, kind, request):
    if kind == "torch":
        request.getfixturevalue("torch_cuda")
    name = f"gpu-set-{kind}-{os.getpid()}"
    r = start(kind, name)
    try:
        # 1-4: each version written by a kernel still spinning when it is published
        for k in range(1, 5):
            v = tx.publish(name, _version(cp, kernels, k, SPIN_NS if k == 1 else 0))
            assert v.number == k and v.nbytes == 2 * N * 4
            version, good, refused, readonly = r.call("take")
            assert (version, good) == (k, True), f"version {version} read wrong values"
            assert refused and readonly, "a reader's CUDA tensor went out writable or as a legacy capsule"
        # 5: a draft written by CuPy in place
        assert _draft(cp, name, 5).number == 5
        assert r.call("take")[1:3] == (5, True)
        # 6: the reader drops it while a slow kernel of its own still reads it; versions
        # published meanwhile reuse regions, only after the reader's release event
        tx.publish(name, _version(cp, kernels, 6))
        assert r.call("hold_slow") == ("ok", 6)
        for k in range(7, 12):
            tx.publish(name, _version(cp, kernels, k))
        assert r.call("finish") == ("ok", True), "a released region was written before the reader's work ended"
        assert _regions_made(name) <= 4, "regions were not reused"  # (11 versions)
        # 12-31: published as fast as possible while the reader follows: never a torn version
        r.inbox.put(("follow", 31))
        for k in range(12, 32):
            tx.publish(name, _version(cp, kernels, k), timeout=TIMEOUT)
        seen = r.get()[1]
        assert seen and seen[-1][0] == 31 and all(good for _, good in seen), seen
        assert [v for v, _ in seen] == sorted({v for v, _ in seen}), seen
    finally:
        try:
            tx.unpublish(name)
        except tx.ExchangeError:
            pass  # (it failed before its first publish)


def test_a_cuda_set_outlives_its_publishers_unpublish_for_a_holder(cp, kernels, warm, start):
    name = f"gpu-set-hold-{os.getpid()}"
    r = start("cupy", name)
    tx.publish(name, _version(cp, kernels, 1))
    assert r.call("hold_slow") == ("ok", 1)
    tx.unpublish(name)  # the reader's work still runs: the region is freed after its release event
    time.sleep(0.05)  # (the runtime's thread has read the release by now, most likely: the free is queued)
    # Canaries from the same pool, filled at once: a free not ordered after the reader's
    # work would hand its region to one of them while the reader's kernel still reads it
    s = tx.create_stream("cuda:0")
    canaries = [tx.empty((2 * N,), "float32", device="cuda:0", stream=s, shared=True) for _ in range(4)]
    with cupy_stream(cp, s):
        for c in canaries:
            kernels["fill_f32"](GRID, BLOCK, (raw_view(cp, c), np.int64(2 * N), np.float32(-1.0)))
    assert r.call("finish") == ("ok", True), "the region was freed and reused before the reader's work ended"
    del canaries
    gc.collect()


def test_a_cuda_set_read_in_its_publishers_own_process(cp, kernels, warm):
    # no IPC import of its own memory (CUDA refuses its own handles): the same ordering
    name = f"gpu-set-self-{os.getpid()}"
    try:
        with tx.subscribe(name) as sub:
            for k in range(1, 6):
                tx.publish(name, _version(cp, kernels, k, SPIN_NS if k == 1 else 0))
                with sub.next(timeout=TIMEOUT) as snap:
                    s = cp.cuda.Stream(non_blocking=True)
                    with s:
                        a, b = cp.from_dlpack(snap["a"]), cp.from_dlpack(snap["b"])
                        assert snap.version == k
                        assert float(a.min()) == float(a.max()) == k
                        d = b - cp.arange(N, dtype=cp.float32)
                        assert float(d.min()) == float(d.max()) == k
                    del a, b, d
    finally:
        tx.unpublish(name)
