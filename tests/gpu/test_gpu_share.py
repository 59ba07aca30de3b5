"""CUDA memory across processes (exchange/sharing/ over cuda.core IPC).

A producer process fills shared pool memory with a kernel and shares it while the
kernel runs; a consumer process attaches it and reads it with a kernel of its own,
dropping the tensor while that kernel runs. The consumer must see the producer's data
(its stream waits for the producer's kernel), and the producer's memory must not be
freed before the consumer's kernel has read it (EXCHANGE_DEBUG_POISON=1 makes the
producer's free fill the memory with a pattern first). Also: a dead producer makes the
consumer's next use a LifetimeError; a dead consumer's holds are dropped. Real
processes (spawn), every wait bounded.
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing as mp
import os
import signal
import time

import pytest

import exchange as tx
from gpu_helpers import SPIN_NS, stop_worker
from gpu_share_workers import BASE, N, TIMEOUT, consumer, producer

share_module = importlib.import_module("exchange.sharing")


class _Proc:
    def __init__(self, target, *args):
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=target, args=(self.inbox, self.outbox, *args), daemon=True)
        self.proc.start()

    def call(self, *message):
        self.inbox.put(message)
        return self.get()

    def get(self):
        reply = self.outbox.get(timeout=TIMEOUT)
        assert reply[0] != "err", f"{reply[1]}: {reply[2]}"
        return reply

    def close(self):
        stop_worker(self.proc, self.inbox, self.outbox, TIMEOUT)


@pytest.fixture
def procs():
    """make(poison) -> (producer, consumer, channel): two processes and the Queue from
    the producer to the consumer."""
    made, queues = [], []

    def make(poison=True):
        channel = mp.get_context("spawn").Queue()
        queues.append(channel)
        p, c = _Proc(producer, channel, poison), _Proc(consumer, channel)
        made.extend([p, c])
        return p, c, channel

    yield make
    for proc in made:
        proc.close()
    for q in queues:
        q.close()
        q.join_thread()


def _wait(predicate, seconds):
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        gc.collect()
        time.sleep(0.01)
    return True


def test_producer_kernel_consumer_kernel_then_release(cuda, procs):
    p, c, _ = procs(poison=True)
    c.inbox.put(("read", SPIN_NS))
    assert p.call("share", SPIN_NS) == ("ok", True), "the producer's kernel ended before sharing: cannot tell order"
    dropped = c.get()
    assert dropped[0] == "dropped"
    assert dropped[2] is False, "the consumer's kernel ended before its tensor was dropped: cannot tell order"
    assert dropped[1] != "released", "the consumer unmapped the memory while its kernel still read it"
    state, holders = p.call("state")[1]
    assert state != "released", f"the producer freed the memory while the consumer's kernel read it ({holders})"
    assert c.get() == ("ok", True), "the consumer read poisoned memory, or not the producer's data"
    stats = c.call("stats")[1]  # waits for the consumer's release, which sends it to the producer
    assert stats["live_records"] == 0 and stats["remote_holders"] == 0, stats
    assert _wait(lambda: p.call("stats")[1]["live_records"] == 0, 10), p.call("stats")[1]
    stats = p.call("stats")[1]
    assert stats["remote_holders"] == 0 and stats["pending_releases"] == 0, stats


def test_holders_name_the_consumer_process(cuda, procs):
    p, c, _ = procs(poison=False)
    c.inbox.put(("hold",))
    assert p.call("share", 0)[0] == "ok"
    assert c.get() == ("ok", "cuda:0")
    assert c.call("sum")[1] == pytest.approx(N * BASE + N * (N - 1) / 2, rel=1e-3)
    state, holders = p.call("state")[1]
    assert state == "live" and holders == [f"process {c.proc.pid}"]
    assert p.call("stats")[1]["remote_holders"] == 1
    c.call("drop")
    assert _wait(lambda: p.call("state")[1][0] == "released", 10)
    assert p.call("stats")[1]["remote_holders"] == 0


def test_one_mapping_per_allocation_whatever_the_handles_say(cuda, procs):
    """Two handles of one allocation, one of them read-only, attached in one process:
    one import, one record, one pointer (importing an allocation twice gives duplicate
    pointers whose first close unmaps both, cuda-python#2783)."""
    _, c, _ = procs(poison=False)
    t = tx.empty((N,), "float32", device="cuda:0", shared=True)
    writable, other = tx.share(t), tx.share(t)
    readonly = share_module.ShareHandle._make(other._f._replace(readonly=True), sent=True)
    ptr_a, ptr_b, ro_a, ro_b, live = c.call("attach_both", writable, readonly)[1]
    assert ptr_a == ptr_b and live == 1, "a second handle of the allocation imported it again"
    assert (ro_a, ro_b) == (False, True)
    assert _wait(lambda: t.record.holders == ["tx.Tensor", f"process {c.proc.pid}"], 10), t.record.holders
    c.call("drop")
    other.close()
    assert _wait(lambda: t.record.holders == ["tx.Tensor"], 10), t.record.holders


def test_dead_producer_makes_the_next_use_a_lifetime_error(cuda, procs):
    p, c, _ = procs(poison=False)
    c.inbox.put(("hold",))
    assert p.call("share", 0)[0] == "ok"
    assert c.get()[0] == "ok"
    os.kill(p.proc.pid, signal.SIGKILL)
    p.proc.join(TIMEOUT)
    reply = c.call("use", 5.0)
    assert reply[0] == "lifetime" and "exited" in reply[1], reply
    assert reply[2].startswith(f"<tx.Tensor (closed: process {p.proc.pid}, which shared"), reply  # not "borrow"
    c.call("drop")  # releasing after the producer died: no crash, no error
    stats = c.call("stats")[1]
    assert stats["live_records"] == 0, stats


def test_dead_consumer_releases_the_producers_memory(cuda, procs):
    p, c, _ = procs(poison=False)
    c.inbox.put(("hold",))
    assert p.call("share", 0)[0] == "ok"
    assert c.get()[0] == "ok"
    os.kill(c.proc.pid, signal.SIGKILL)
    c.proc.join(TIMEOUT)
    assert _wait(lambda: p.call("state")[1][0] == "released", 2.0), "not released within 2 s of the consumer's death"
    assert p.call("stats")[1]["remote_holders"] == 0


def test_private_cuda_memory_is_copied_into_the_ipc_pool(cuda, cp, procs):
    _, c, channel = procs(poison=False)
    a = cp.arange(N, dtype=cp.float32) + cp.float32(BASE)
    t = tx.from_dlpack(a)
    with pytest.raises(BufferError, match="IPC-enabled pool"):
        tx.share(t, copy=False)
    c.inbox.put(("hold",))
    channel.put(t)  # copied by the reducer into this process's IPC pool
    assert c.get() == ("ok", "cuda:0")
    assert c.call("sum")[1] == pytest.approx(float(a.sum()), rel=1e-3)
    c.call("drop")
    del t
    assert tx.registry().collect(timeout=30)
    assert _wait(lambda: tx.registry().stats()["remote_holders"] == 0, 10)


def test_shared_allocation_and_bad_devices(cuda):
    t = tx.empty((256,), "float32", device="cuda:0", shared=True)
    from exchange.channels.cuda import ipc

    assert ipc(cuda).shareable(t.record._owner)
    h = tx.share(t, copy=False)
    assert h.device == tx.Device.parse("cuda:0") and h._f.kind == "cuda"
    fake = share_module._rebuild_handle(tuple(h._f._replace(
        pid=h._f.pid + 1_000_000, channel=("GPU-00000000-0000-0000-0000-000000000000",) + h._f.channel[1:])))
    with pytest.raises(tx.DeviceError, match="does not see"):
        tx.attach(fake)
    h.close()
    with pytest.raises(ValueError, match="shared=True"):
        tx.empty(4, device="cuda_host", shared=True)
    pinned = tx.empty(4, device="cuda_host")
    with pytest.raises(BufferError, match="not supported"):
        tx.share(pinned)
    u = tx.attach(tx.share(t))  # in the sending process: a view of the same record
    assert u.record is t.record
    del u, t, pinned
