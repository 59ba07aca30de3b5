"""Shared memory from arenas (issue 20): blocks carved from a few large shared arenas per
process, mapped once by each receiver, handed off through multiprocessing without a
round trip to the sender, released in batches, reused only after every holder in
every process has let go. Real processes throughout (share_helpers' Worker)."""

from __future__ import annotations

import gc
import pickle

import numpy as np
import pytest

import exchange as tx
from exchange.devices.cpu import Arenas, arena_stats
from exchange.sharing import serving
from share_fixtures import clean_sharing, warm_sharing  # noqa: F401  (autouse: every test here)
from share_helpers import Worker, WorkerError, wait_until

REG = tx.registry()


def _shared(n: int = 256, start: float = 0.0) -> tx.Tensor:
    t = tx.empty(n, "float32", shared=True)
    np.from_dlpack(t)[...] = np.arange(n, dtype=np.float32) + start
    return t


def test_a_mapped_arena_needs_no_round_trip():
    """After the first hand-off from an arena, a Tensor through a Queue is attached with
    no request to the sender: its take goes later, unasked, in a batch."""
    with Worker() as w:
        w.call("hold", "first", _shared())  # maps the arena: one request
        first = w.call("requests")
        assert first >= 1
        for k in range(50):
            t = _shared(start=float(k))  # new blocks of the same arena
            w.call("hold", k, t)
            assert w.call("read", k, 3) == k + 3.0
        assert w.call("requests") == first, "a hand-off from a mapped arena asked the sender"
        records = [r for r in REG.snapshot() if f"process {w.pid}" in r.holders]
        assert wait_until(lambda: REG.stats()["remote_holders"] == 51 and REG.stats()["leases_in_transit"] == 0, 10)
        w.call("drop_all")
        assert wait_until(lambda: REG.stats()["remote_holders"] == 0, 10)
        del records


def test_a_block_goes_back_only_after_every_holder_let_go():
    t = _shared(start=1.0)
    address, record = t.data_ptr, t.record
    blocks = arena_stats()["blocks_in_use"]
    with Worker() as w:
        w.call("hold", "a", t)
        del t
        gc.collect()
        assert wait_until(lambda: record.holders == [f"process {w.pid}"], 10)
        assert arena_stats()["blocks_in_use"] == blocks, "the block went back while the worker held it"
        other = tx.empty(256, "float32", shared=True)  # the same size class: never the held block
        assert other.data_ptr != address
        assert w.call("read", "a", 0) == 1.0
        w.call("drop", "a")
        assert wait_until(lambda: record.state == "released", 10)
        assert arena_stats()["blocks_in_use"] == blocks  # `other` in, the held block back
        again = tx.empty(256, "float32", shared=True)
        assert again.data_ptr == address, "a freed block is handed out again"
        del other, again


def test_releases_reach_the_sender_in_batches():
    tensors = [_shared(16) for _ in range(200)]
    records = [t.record for t in tensors]
    with Worker() as w:
        for k, t in enumerate(tensors):
            w.call("hold", k, t)
        del tensors, t
        assert wait_until(lambda: all(r.holders == [f"process {w.pid}"] for r in records), 10)
        peer = next(p for p in serving.server().peers.values() if p.pid == w.pid)
        before = peer.handled
        w.call("drop_all")
        assert wait_until(lambda: all(r.state == "released" for r in records), 10)
        packets = peer.handled - before
        assert packets <= 40, f"200 releases came in {packets} packets"  # (one each: 200; a loaded machine splits the batch)


def test_isolated_share_is_mapped_alone():
    """isolated=True: memory of its own, so the receiver maps that and no arena."""
    t = _shared(1024, start=2.0)
    with Worker() as w:
        w.call("attach", "a", tx.share(t, isolated=True))
        assert w.call("read", "a", 0) == 2.0
        assert w.call("mapped_sizes") == [4096], "the receiver maps the tensor's own memory only"
        w.call("attach", "b", tx.share(t))
        assert Arenas.ARENA_BYTES in w.call("mapped_sizes"), "a plain share maps the arena"
    with pytest.raises(TypeError, match="isolated"):
        tx.share(t, isolated="yes")


def test_a_read_only_share_lies_in_a_sealed_arena_apart_from_writable_blocks():
    t = _shared(8, start=3.0)
    a = np.arange(8, dtype=np.float32) + 3.0
    a.flags.writeable = False
    with Worker() as w:
        rw = tx.share(t)
        w.call("attach", "rw", rw)
        h = tx.share(tx.from_dlpack(a))  # read-only: a copy in an arena sealed against writes
        assert h.readonly and h._f.arena != rw._f.arena
        info = w.call("attach", "ro", h)
        assert info["readonly"] and w.call("read", "ro", 7) == 10.0
        with pytest.raises(WorkerError, match="read-only"):
            w.call("write", "ro", 0, 1.0)
        w.call("write", "rw", 0, 9.0)  # the writable arena stays writable
        assert np.from_dlpack(t)[0] == 9.0


def test_the_same_pickle_attached_twice_counts_once_at_the_sender():
    """multiprocessing never unpickles one send twice; if someone does, the second take
    matches no lease and counts nothing (the first still holds the block)."""
    from multiprocessing.reduction import ForkingPickler

    t = _shared(start=4.0)
    record = t.record
    with Worker() as w:
        w.call("hold", "warm", _shared())  # the arena is mapped: the next attaches are takes
        data = bytes(ForkingPickler.dumps(t))
        refused = serving.server().refused_takes
        w.call("loads", "a", data)
        w.call("drop", "a")  # released: the record goes back to `t` alone
        assert wait_until(lambda: record.holders == ["tx.Tensor"], 10)
        w.call("loads", "b", data)
        assert wait_until(lambda: serving.server().refused_takes == refused + 1, 10)
        assert record.holders == ["tx.Tensor"], "a second take of one lease counted a holder"
        w.call("drop", "b")
        w.call("drop", "warm")
    assert wait_until(lambda: REG.stats()["remote_holders"] == 0, 10)


# JAX's fork warning, when an earlier test of this process started JAX: the forked child
# runs no JAX (NumPy and exchange only) and ends with os._exit, so it takes no lock of JAX's.
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_blocks_of_a_parent_arena_are_not_carved_in_a_forked_child():
    import multiprocessing as mp

    t = _shared(start=5.0)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_allocates, args=(q, t.data_ptr))
    p.start()
    try:
        result = q.get(timeout=60)
    finally:
        p.join(60)
    assert p.exitcode == 0
    assert result == ("ok", True), result
    assert np.from_dlpack(t)[0] == 5.0, "the child wrote into the parent's block"


def _child_allocates(q, parent_address):
    try:
        from exchange.devices.cpu import arena_stats as stats

        blocks = [tx.empty(256, "float32", shared=True) for _ in range(64)]
        for b in blocks:
            np.from_dlpack(b)[...] = -1.0
        q.put(("ok", all(b.data_ptr != parent_address for b in blocks) and stats()["arenas"] == 1))
    except BaseException as exc:
        q.put(("err", repr(exc)))


def test_a_handle_naming_another_block_of_the_arena_is_refused():
    """The sender says where the memory of an attach lies; a handle forged to name
    another block (of an arena mapped here already) is refused, and keeps its lease."""
    from exchange.sharing import ShareHandle

    with Worker() as w:
        a = tx.attach(w.call("share", "a", 64, 1.0))  # maps w's arena
        h = w.call("share", "b", 64, 2.0)
        forged = ShareHandle._make(h._f._replace(base=(h._f.base + 4096) % (1 << 20)), sent=True)
        with pytest.raises(ValueError, match="corrupted or forged"):
            tx.attach(forged)
        b = tx.attach(h)  # the honest handle still works
        assert float(np.from_dlpack(b)[0]) == 2.0 and float(np.from_dlpack(a)[0]) == 1.0
        del a, b


def test_batches_never_nest_nor_overflow_a_packet():
    """Releases and takes posted while a batch goes out join it, in order, in packets
    of at most RELEASE_BATCH messages: a batch inside a batch, or a packet over the
    socket's message size, would make the sender drop the connection (and every hold
    of this process with it). Here on a connection to this process's own server."""
    import time as _time

    from exchange.sharing import protocol, receiving

    t = _shared()
    h = tx.share(t)
    client = receiving.connections().client(h._f, _time.monotonic() + 10)
    try:
        # One answered request first: the server has taken the connection in by then
        # (under load its accept could come after the count, which then looked one short).
        assert client.request(["sync"], _time.monotonic() + 10)[0][0] == "ok"
        peer_count = len(serving.server().peers)
        fake = ["take", 0, 10**9, "00" * 16, 1]  # matches no entry: counted nowhere, refused quietly
        for k in range(3):
            client.post_batched(["release", 10**9, k, []])
        client._send(["batch", [["release", 10**9, 99, []]]])  # a batch while others wait
        for k in range(5 * receiving.RELEASE_BATCH):
            fake[1] = k
            with client.send_lock:  # many at once, past one packet's worth
                client.releases.append(list(fake))
        assert len(protocol.encode(["batch", client.releases])) > protocol.MAX_MESSAGE
        reply, _ = client.request(["sync"], _time.monotonic() + 10)
        assert reply[0] == "ok" and not client.dead
        assert len(serving.server().peers) == peer_count, "the sender dropped the connection"
    finally:  # a failure here must not leave this process's own connection to the next tests
        h.close()
        receiving.connections().sender_died(client)  # (this process's own connection: close it)


def _take_and_return(q, n):
    for _ in range(n):
        t = q.get(timeout=60)
        float(np.from_dlpack(t)[0])
    # returns at once: its takes still wait for their batch


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # as above: the child runs no JAX
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_receiver_that_exits_at_once_sends_its_takes_first(method):
    """A multiprocessing child ends with os._exit (fork) or after atexit (spawn): either
    way the takes waiting for their batch reach the sender first, and no lease is left."""
    import multiprocessing as mp

    ctx = mp.get_context(method)
    warm = ctx.Queue()
    p = ctx.Process(target=_take_and_return, args=(warm, 1))  # maps the arena: the next ones are takes
    p.start()
    warm.put(_shared())
    p.join(60)
    q = ctx.Queue()
    p = ctx.Process(target=_take_and_return, args=(q, 20))
    p.start()
    for k in range(20):
        q.put(_shared(16, start=float(k)))
    p.join(60)
    assert p.exitcode == 0
    assert wait_until(lambda: REG.stats()["leases_in_transit"] == 0 and REG.stats()["remote_holders"] == 0, 10), \
        REG.stats()
    for queue_ in (warm, q):
        queue_.close()
        queue_.join_thread()


def test_a_freed_dedicated_arena_serves_any_later_request_of_its_size_class():
    """Past SMALL_MAX a block gets an arena of its own, of its whole size class (a power
    of two): 40 shares of sizes between 4 and 8 MiB, each closed before the next, keep
    one arena between them, not one per size."""
    from exchange.devices.cpu import ARENAS

    before = arena_stats()
    small, big = Arenas.SMALL_MAX, 2 * Arenas.SMALL_MAX
    for k in range(40):
        n = small + 4096 + k * (big - small - 4096) // 39  # bytes, in (4 MiB, 8 MiB]
        h = tx.share(tx.from_dlpack(np.zeros(n, np.uint8)))  # a copy, in a dedicated arena
        assert h._f.arena and h._f.base == 0
        assert ARENAS.by_id[h._f.arena].memory.nbytes == big
        h.close()  # the copy goes back: its arena waits for the next request of its class
    after = arena_stats()
    assert after["arenas"] - before["arenas"] <= 1, (before, after)
    assert after["cached_bytes"] - before["cached_bytes"] <= big, (before, after)
