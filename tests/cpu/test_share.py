"""Exchange across processes on one machine (exchange/sharing/): tx.share, tx.attach,
ownership that survives a crash, multiprocessing Queues and Pipes.

Every test uses real processes (multiprocessing, spawn unless it says otherwise), waits
on them with timeouts, and ends with the checks of ``_clean``: no named segment in
/dev/shm, no shared memory or descriptor left in this process, this registry back to
where it was and no remote holder left.
"""

from __future__ import annotations

import copy
import gc
import importlib
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time

import numpy as np
import pytest

import exchange as tx
from share_fixtures import clean_sharing, warm_sharing  # noqa: F401  (autouse: every test here)
from share_helpers import (
    ANSWER_TIMEOUT,
    EXHAUST_FDS,
    Script,
    Worker,
    WorkerError,
    dev_shm,
    exchange_peer,
    fd_count,
    memfd_count,
    stop,
    wait_until,
)

REG = tx.registry()
share_module = importlib.import_module("exchange.sharing")
from exchange.sharing import loop as share_loop, receiving, serving  # noqa: E402


def _shared(n=16, start=0.0):
    t = tx.empty(n, "float32", shared=True)
    np.from_dlpack(t)[...] = np.arange(n, dtype=np.float32) + start
    return t


# -- items 1 and 2: share and attach --------------------------------------------------------
def test_attach_in_another_process_is_the_same_memory():
    t = _shared()
    created = REG.created_total
    h = tx.share(t)
    assert REG.created_total == created, "shared memory must be handed over without a copy"
    assert isinstance(h, tx.ShareHandle) and h.shape == (16,) and h.dtype.name == "float32" and h.pid == os.getpid()
    with Worker() as w:
        info = w.call("attach", "a", pickle.loads(pickle.dumps(h)))
        assert info["shape"] == (16,) and info["dtype"] == "float32" and not info["readonly"]
        assert info["origin"] == f"imported from process {os.getpid()} (tx.attach)"
        assert w.call("read", "a", 3) == 3.0
        w.call("write", "a", 5, 42.0)  # the child writes, the parent reads
        assert np.from_dlpack(t)[5] == 42.0
        np.from_dlpack(t)[7] = -1.0  # and back
        assert w.call("read", "a", 7) == -1.0
        # any framework takes it through DLPack in the child: torch too
        w.call("drop", "a")


def test_shared_memory_comes_from_anonymous_arenas_and_is_reused():
    from exchange.devices.cpu import arena_stats

    t = tx.empty((4, 4), "int32", shared=True)
    before = arena_stats()
    assert before["blocks_in_use"] >= 1 and memfd_count() == (before["arenas"], before["arenas"])
    assert t.data_ptr % 64 == 0
    address = t.data_ptr
    np.from_dlpack(t)[...] = 7
    del t
    assert arena_stats()["blocks_in_use"] == before["blocks_in_use"] - 1
    u = tx.empty((4, 4), "int32", shared=True)  # the freed block again: no new memory, no first touch
    assert u.data_ptr == address and arena_stats()["arenas"] == before["arenas"]
    big = tx.empty(8 << 20, "uint8", shared=True)  # above SMALL_MAX: an arena of its own, page-aligned
    assert big.data_ptr % 4096 == 0 and arena_stats()["arenas"] == before["arenas"] + 1
    big_address = big.data_ptr
    del big
    again = tx.empty(8 << 20, "uint8", shared=True)  # kept, and given to the next of the same size
    assert again.data_ptr == big_address and arena_stats()["arenas"] == before["arenas"] + 1


def test_holders_name_the_process_and_stats_count_it():
    t = _shared()
    record = t.record
    h = tx.share(t)
    assert record.holders == ["tx.Tensor", "tx.ShareHandle #%d (in transit)" % h._f.nonce]
    with Worker() as w:
        w.call("attach", "a", h)
        assert record.holders == ["tx.Tensor", f"process {w.pid}"], "the first attach ends the lease"
        assert REG.stats()["remote_holders"] == 1
        w.call("drop", "a")
        assert wait_until(lambda: record.holders == ["tx.Tensor"], 10)
        assert REG.stats()["remote_holders"] == 0


def test_one_holder_per_process_however_many_views():
    t = _shared()
    record = t.record
    with Worker() as w:
        w.call("attach", "a", tx.share(t))
        w.call("attach", "b", tx.share(t))  # another handle to the same memory
        w.call("hold", "c", t)  # and once more through the Queue's reducer (its lease ends after, unasked)
        assert wait_until(lambda: record.holders == ["tx.Tensor", f"process {w.pid}"], 10)
        stats = w.call("stats")
        assert stats["live_records"] == 1 and stats["memfd"] == (1, 1), "one mapping in the child"
        w.call("drop", "a")
        w.call("drop", "b")
        assert record.holders == ["tx.Tensor", f"process {w.pid}"]
        w.call("drop", "c")
        assert wait_until(lambda: record.holders == ["tx.Tensor"], 10)


def test_memory_lives_while_a_receiver_holds_it():
    t = _shared(start=5.0)
    record = t.record
    with Worker() as w:
        w.call("hold", "a", t)
        del t
        gc.collect()
        assert record.state == "live" and record.holders == [f"process {w.pid}"]
        assert w.call("read", "a", 0) == 5.0
        w.call("drop", "a")
        assert wait_until(lambda: record.state == "released", 10)


def test_two_processes_attach_one_handle():
    t = _shared()
    h = tx.share(t)
    with Worker() as w1, Worker() as w2:
        w1.call("attach", "a", h)
        w2.call("attach", "a", h)
        assert sorted(t.record.holders) == sorted(["tx.Tensor", f"process {w1.pid}", f"process {w2.pid}"])
        w1.call("write", "a", 0, 9.0)
        assert w2.call("read", "a", 0) == 9.0
        assert REG.stats()["remote_holders"] == 2


def test_a_receiver_hands_on_arena_memory_as_a_copy():
    """A receiver maps the sender's whole arena: what it hands on is a copy, so no third
    process ever maps the sender's arena."""
    t = _shared()
    with Worker() as w1, Worker() as w2:
        w1.call("attach", "a", tx.share(t))
        w2.call("attach", "a", w1.call("share_held", "a"))
        w2.call("write", "a", 1, 77.0)
        assert np.from_dlpack(t)[1] == 1.0 and w1.call("read", "a", 1) == 1.0
        assert w2.call("stats")["memfd"] == (1, 1), "w2 maps w1's arena only"
        with pytest.raises(WorkerError, match="BufferError.*arena of the process it was attached from"):
            w1.call("share_held_no_copy", "a")


def test_a_receiver_shares_on_what_it_attached():
    """Memory of its own (isolated=True) is handed on as it is: a third process maps it too."""
    t = _shared()
    with Worker() as w1, Worker() as w2:
        w1.call("attach", "a", tx.share(t, isolated=True))  # a copy in memory of its own
        h2 = w1.call("share_held", "a")  # w1 shares the memory it attached: no copy
        assert h2.pid == w1.pid
        w2.call("attach", "a", h2)
        w2.call("write", "a", 1, 77.0)
        assert w1.call("read", "a", 1) == 77.0 and np.from_dlpack(t)[1] == 1.0
        w1.call("drop", "a")
        w2.call("drop", "a")
    assert wait_until(lambda: t.record.holders == ["tx.Tensor"] and REG.stats()["live_records"] == 1, 10)


def test_attach_in_the_sending_process_is_a_view_of_the_same_record():
    t = _shared()
    h = tx.share(t)
    u = tx.attach(h)
    assert u.record is t.record and u.data_ptr == t.data_ptr
    assert t.record.holders == ["tx.Tensor", "tx.Tensor"], "the lease ended at the first attach"
    v = tx.attach(h)  # attached twice: another view
    assert v.record is t.record
    del u, v


def test_views_with_strides_and_offset_keep_their_layout():
    t = tx.empty((4, 6), "float64", shared=True)
    np.from_dlpack(t)[...] = np.arange(24).reshape(4, 6)
    view = tx.from_dlpack(np.from_dlpack(t)[1:, ::-2])  # an import: private... so copied
    assert view.record is not t.record
    h = tx.share(view)
    assert h.strides == (3, 1) and h.shape == (3, 3)  # a copy is C-contiguous
    with Worker() as w:
        w.call("attach", "a", h)
        assert w.call("read", "a", 0) == 11.0 and w.call("read", "a", 8) == 19.0
    del view, h


def test_a_view_of_shared_memory_is_shared_with_its_offset():
    t = tx.empty((4, 6), "float64", shared=True)
    np.from_dlpack(t)[...] = np.arange(24).reshape(4, 6)
    import exchange.tensor as tensor_module

    view = tensor_module.Tensor._make(t.record, t.data_ptr + 6 * 8 + 5 * 8, (3, 3), (6, -2), t.dtype, False)
    h = tx.share(view, copy=False)
    assert h.strides == (6, -2) and h._f.offset == 11 * 8
    with Worker() as w:
        w.call("attach", "a", h)
        assert [w.call("read", "a", i) for i in range(3)] == [11.0, 9.0, 7.0]
    del view, h


# -- copies ------------------------------------------------------------------------------------
def test_private_memory_is_copied_and_copy_false_says_why():
    a = np.arange(8, dtype=np.float32)
    t = tx.from_dlpack(a)
    with pytest.raises(BufferError, match="private to this process.*shared=True"):
        tx.share(t, copy=False)
    h = tx.share(t)  # a copy, held by the handle's lease
    with Worker() as w:
        w.call("attach", "a", h)
        assert w.call("read", "a", 3) == 3.0
        w.call("write", "a", 3, 100.0)
        assert a[3] == 3.0, "a copy: the child's write does not reach the NumPy array"
    del t, h


def test_copy_true_copies_shared_memory_too():
    t = _shared()
    h = tx.share(t, copy=True)
    with Worker() as w:
        w.call("attach", "a", h)
        w.call("write", "a", 0, 5.0)
        assert np.from_dlpack(t)[0] == 0.0


def test_borrowed_memory_is_copied_or_refused():
    buf = bytearray(np.arange(4, dtype=np.float32).tobytes())
    with tx.borrow(buf, shape=(4,), dtype="float32") as view:
        with pytest.raises(BufferError, match="borrowed"):
            tx.share(view, copy=False)
        h = tx.share(view)
    with Worker() as w:  # the copy outlives the borrow scope
        w.call("attach", "a", h)
        assert w.call("read", "a", 2) == 2.0
    del h


def test_readonly_stays_readonly():
    a = np.arange(4, dtype=np.float32)
    a.flags.writeable = False
    t = tx.from_dlpack(a)
    assert t.readonly
    h = tx.share(t)
    assert h.readonly
    with Worker() as w:
        info = w.call("attach", "a", h)
        assert info["readonly"]
        assert w.call("read", "a", 1) == 1.0
        with pytest.raises(WorkerError, match="read-only"):
            w.call("write", "a", 1, 3.0)
    del t, h


def test_zero_size_tensor_needs_no_memory():
    t = tx.empty((0, 3), "float32", shared=True)
    h = tx.share(t)
    with Worker() as w:
        info = w.call("attach", "a", h)
        assert info["shape"] == (0, 3)
    assert t.record.holders == ["tx.Tensor"]


# -- the lease ---------------------------------------------------------------------------------
def test_lease_holds_memory_until_close():
    t = _shared()
    record = t.record
    h = tx.share(t)
    del t
    gc.collect()
    assert record.state == "live", "the handle in transit holds the memory"
    h.close()
    assert record.state == "released"
    with pytest.raises(ValueError, match=r"closed \(its close\(\) gave up its lease\), so it cannot be attached; "
                                         r"for a new handle, call tx\.share\(tensor\) again in this process"):
        tx.attach(h)


def test_lease_closed_by_the_receiver():
    t = _shared()
    record = t.record
    h = tx.share(t)
    del t
    with Worker() as w:
        w.call("close_handle", h)
        assert wait_until(lambda: record.state == "released", 10)


def test_attaching_a_handle_closed_here_names_its_sender():
    with Worker() as w:
        h = w.call("share", "a", 8)
        h.close()
        with pytest.raises(ValueError, match=r"so it cannot be attached; for a new handle, call tx\.share\(tensor\) "
                                             rf"again in the sending process \(pid {w.pid}\)"):
            tx.attach(h)


def test_handle_never_sent_lets_go_when_collected():
    t = _shared()
    record = t.record
    h = tx.share(t)
    del t, h
    gc.collect()
    assert record.state == "released"


def test_copies_of_a_handle_never_sent_let_go_when_collected():
    # copy.copy / copy.deepcopy go through __reduce__ unless told otherwise, which marks
    # the handle as sent: its lease would then hold the memory until this process exits.
    t = _shared()
    record = t.record
    h = tx.share(t)
    c, d = copy.copy(h), copy.deepcopy({"handle": h})["handle"]
    assert (c.shape, d.nbytes) == ((16,), 64)
    del t, h, c, d
    gc.collect()
    assert record.state == "released", record.holders


def test_lease_ends_at_first_attach_then_memory_follows_the_receiver():
    t = _shared()
    record = t.record
    h = tx.share(t)
    pickle.dumps(h)  # sent somewhere: only attach, close or exit end the lease now
    del t
    with Worker() as w:
        w.call("attach", "a", h)
        assert record.holders == [f"process {w.pid}"]
        w.call("drop", "a")
        assert wait_until(lambda: record.state == "released", 10)
    with pytest.raises(tx.LifetimeError, match="released"):
        tx.attach(h)  # attached again after the memory went: a clear error
    del h


# -- item 4: multiprocessing ------------------------------------------------------------------
def _echo(conn, q, r):
    import numpy as np  # noqa: F401

    import exchange as tx

    base = tx.registry().stats()["live_records"]  # a forked child starts with copies of the parent's records
    t = conn.recv()
    conn.send((type(t).__name__, t.shape, t.dtype.name, float(np.from_dlpack(t)[2])))
    np.from_dlpack(t)[2] = -7.0
    conn.send(t)  # and back through the Pipe
    u = q.get(timeout=60)
    r.put((type(u).__name__, float(np.from_dlpack(u)[0])))
    conn.recv()
    del t, u
    wait_until(lambda: tx.registry().stats()["live_records"] == base, 10)  # the parent's releases arrive
    conn.send(tx.registry().stats()["live_records"] - base)
    conn.recv()


@pytest.mark.parametrize("method", [
    "spawn", "forkserver",
    # JAX's threads warn about fork; the child runs no JAX
    pytest.param("fork", marks=pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")),
])
def test_queue_and_pipe_carry_tensors(method):
    ctx = mp.get_context(method)
    parent, child = ctx.Pipe()
    q, r = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_echo, args=(child, q, r), daemon=True)
    p.start()
    try:
        t = _shared()
        parent.send(t)
        assert parent.poll(ANSWER_TIMEOUT)
        assert parent.recv() == ("Tensor", (16,), "float32", 2.0)
        assert parent.poll(ANSWER_TIMEOUT)
        back = parent.recv()
        # Sent back, it is a copy the child made: what it attached lies in this process's
        # arena, which the child hands on to nobody, this process included.
        assert isinstance(back, tx.Tensor) and back.record.origin == f"imported from process {p.pid} (tx.attach)"
        assert np.from_dlpack(t)[2] == -7.0 and np.from_dlpack(back)[2] == -7.0
        np.from_dlpack(back)[3] = 8.0
        assert np.from_dlpack(t)[3] == 3.0
        q.put(tx.from_dlpack(np.full(3, 4.0)))  # private memory: copied by the reducer
        assert r.get(timeout=ANSWER_TIMEOUT) == ("Tensor", 4.0)
        del back
        parent.send("drop")
        assert parent.poll(ANSWER_TIMEOUT)
        assert parent.recv() == 0
        parent.send("exit")
        p.join(ANSWER_TIMEOUT)
        assert p.exitcode == 0
        del t
    finally:
        stop([p], (q, r), (parent, child))


def test_plain_pickle_refuses_and_points_to_share():
    t = _shared()
    with pytest.raises(TypeError, match=r"tx\.share"):
        pickle.dumps(t)


# -- bad input -----------------------------------------------------------------------------------
def _forged(h, **changes):
    return share_module._rebuild_handle(tuple(h._f._replace(**changes)))


def test_forged_secret_is_refused_by_the_sender():
    with Worker() as w:
        h = w.call("share", "a", 8)
        with pytest.raises(ValueError, match="forged"):
            tx.attach(_forged(h, secret=bytes(16)))
        with pytest.raises(tx.LifetimeError, match="released.*forged"):
            tx.attach(_forged(h, entry=h._f.entry + 1000))
        u = tx.attach(h)  # the real one still works
        assert np.from_dlpack(u)[7] == 7.0
        del u
    t = _shared()
    h = tx.share(t)
    with pytest.raises(ValueError, match="forged"):
        tx.attach(_forged(h, secret=bytes(16)))  # in the sending process too
    h.close()


def test_truncated_or_malformed_handle_is_refused():
    t = _shared()
    h = tx.share(t)
    fields = tuple(h._f)
    with pytest.raises(ValueError, match="truncated"):
        share_module._rebuild_handle(fields[:-3])
    with pytest.raises(ValueError, match="field"):
        share_module._rebuild_handle(fields[:3] + ("not bytes",) + fields[4:])
    with pytest.raises(ValueError, match="outside"):
        _forged(h, offset=h._f.span)
    with pytest.raises(ValueError, match="version"):
        _forged(h, version=99)
    data = pickle.dumps(h)
    with pytest.raises(Exception):
        pickle.loads(data[: len(data) // 2])
    h.close()


def test_a_handle_claiming_more_than_its_memory_is_refused_where_that_memory_is_mapped():
    # The form check puts the layout inside the handle's own span; the span was checked
    # against the real memory only when a receiver first mapped it. A forged span over
    # memory a receiver already mapped, or in the sending process, gave a view 1 GiB past
    # the mapping: reading it was a segfault.
    with Worker() as w:
        h = w.call("share", "a", 4, 1.0)
        keep = tx.attach(h)  # mapped here, and kept
        forged = _forged(w.call("share_held", "a"), span=1 << 40, offset=1 << 30)
        with pytest.raises(ValueError, match="claims 1099511627776 shared bytes, the memory it names holds"):
            tx.attach(forged)
        assert np.from_dlpack(keep).tolist() == [1.0, 2.0, 3.0, 4.0]
        del keep
        forged.close()
        w.call("drop", "a")
    t = _shared(4)
    h = tx.share(t)
    with pytest.raises(ValueError, match="claims 1099511627776 shared bytes"):
        tx.attach(_forged(h, span=1 << 40, offset=1 << 30))  # in the sending process
    assert tx.attach(h).data_ptr == t.data_ptr  # the honest handle still attaches


_UNSEALED_SENDER = """
import os, pickle, sys, time
import exchange as tx

t = tx.empty(1 << 14, "float64", shared=True)
block = t.record._owner.arena.memory  # the arena the tensor lies in
evil = os.memfd_create("evil")  # a file nobody sealed: its sender can truncate it under a mapping
os.ftruncate(evil, block.nbytes)
os.close(block.fd)
block.fd = evil
print(pickle.dumps(tx.share(t)).hex(), flush=True)
sys.stdin.readline()
"""


def test_memory_its_sender_could_truncate_is_refused():
    # A sender of another user (a root receiver admits any) or a tampered one served a
    # memfd without F_SEAL_SHRINK, then truncated it once attached: the receiver's next
    # read was SIGBUS. The receiver now refuses a file not sealed against shrinking.
    sender = Script(_UNSEALED_SENDER)
    try:
        h = pickle.loads(bytes.fromhex(sender.line()))
        with pytest.raises(ValueError, match="not sealed against shrinking"):
            tx.attach(h)
        sender.send("done")
    finally:
        assert sender.close() == 0


def test_malformed_messages_drop_their_connection_quietly():
    # b"[" * 60000 (RecursionError in json) and an int of 1e400 (OverflowError) escaped the
    # serving loop's handler: an ExchangeWarning, and the peer stayed connected.
    import socket
    import warnings

    t = _shared(4)
    h = tx.share(t)
    srv = serving.server()
    for junk in (b"[" * 60000, b'["release", 1e400, 1, []]'):
        peers = len(srv.peers)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(ANSWER_TIMEOUT)
            sock.connect(h._f.address)
            assert wait_until(lambda: len(srv.peers) == peers + 1, 10)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sock.send(junk)
                assert sock.recv(64) == b"", "the server kept talking to a peer that sent junk"
            assert not [w for w in caught if "serving thread" in str(w.message)], [str(w.message) for w in caught]
        finally:
            sock.close()
        assert wait_until(lambda: len(srv.peers) == peers, 10)
    assert float(np.from_dlpack(tx.attach(h))[1]) == 1.0  # serving goes on


def test_a_forged_address_is_refused_by_the_form_check():
    h = tx.share(_shared(4))
    for address in (b"", b"\0" + b"a" * 200, b"\0tensor-exchange/" + b"x" * 100, b"/tmp/a-path"):
        with pytest.raises(ValueError, match="the sender's address"):
            _forged(h, address=address)
    h.close()


def test_handle_of_another_boot_or_machine_is_refused():
    t = _shared()
    h = tx.share(t)
    with pytest.raises(ValueError, match="another machine or boot"):
        tx.attach(_forged(h, boot="00000000-0000-0000-0000-000000000000"))
    h.close()


def test_handle_of_an_exited_process_is_refused():
    w = Worker()
    h = w.call("share", "a", 8)
    w.close()
    with pytest.raises(tx.LifetimeError, match="exited"):
        tx.attach(h)


def test_handle_for_a_cuda_device_this_process_lacks():
    with Worker() as w:
        h = w.call("share", "a", 8)
        gpu = ("GPU-00000000-0000-0000-0000-000000000000", "pool", b"")
        with pytest.raises((tx.BackendUnavailableError, tx.DeviceError), match="CUDA|GPU"):
            tx.attach(_forged(h, kind="cuda", device="cuda:3", channel=gpu, arena=0, base=0))  # no CUDA here, or not that GPU


def test_wrong_arguments():
    with pytest.raises(TypeError, match="tx.Tensor"):
        tx.share(np.zeros(3))
    with pytest.raises(TypeError, match="copy"):
        tx.share(_shared(), copy="yes")
    with pytest.raises(TypeError, match="ShareHandle"):
        tx.attach("handle")
    with pytest.raises(TypeError, match="tx.share"):
        tx.ShareHandle()
    t = _shared()
    h = tx.share(t)
    with pytest.raises(ValueError, match="stream"):  # CPU data from another process takes no stream
        tx.attach(_forged(h, pid=h._f.pid + 1_000_000), stream=tx.create_stream("cpu"))
    with pytest.raises(ValueError, match="stream"):  # nor in the sending process itself
        tx.attach(h, stream=tx.create_stream("cpu"))
    assert any("in transit" in holder for holder in t.record.holders), "the refused attach kept the lease"
    h.close()


# -- faults ----------------------------------------------------------------------------------------
def test_sigkill_of_a_receiver_holding_ten_tensors_releases_them():
    tensors = [_shared(start=k) for k in range(10)]
    records = [t.record for t in tensors]
    w = Worker()
    try:
        for k, t in enumerate(tensors):
            w.call("hold", k, t)
        del tensors, t
        gc.collect()
        assert wait_until(lambda: all(r.holders == [f"process {w.pid}"] for r in records), 10)  # (takes: in batches)
        assert REG.stats()["remote_holders"] == 10
        w.kill()
        released = wait_until(lambda: all(r.state == "released" for r in records), 10.0)
        assert released, f"not released within 10 s: {[r.holders for r in records if r.state != 'released']}"
        assert REG.stats()["remote_holders"] == 0
    finally:
        w.close()


def test_sigkill_of_the_sender_while_this_process_reads():
    w = Worker()
    try:
        h = w.call("share", "a", 1 << 16, 1.0)
        t = tx.attach(h)
        a = np.from_dlpack(t)
        total = float(a.sum())
        w.kill()
        assert float(a.sum()) == total, "CPU shared memory stays valid while this process maps it"
        a[:] = 2.0  # and writable
        assert float(a.sum()) == 2.0 * a.size
        assert wait_until(lambda: w.proc.exitcode is not None, 10)
        del a, t
        gc.collect()
        assert REG.stats()["live_records"] == REG.stats()["live_records"]  # consistent below (_clean)
    finally:
        w.close()


def test_sigkill_of_the_sender_while_another_process_reads():
    sender, reader = Worker(), Worker()
    try:
        h = sender.call("share", "a", 1 << 16, 1.0)
        reader.call("attach", "a", h)
        before = reader.call("sum", "a")
        sender.kill()
        assert reader.call("sum", "a") == before
        reader.call("drop", "a")
        # (the reader's runtime thread unmaps the dead sender's arena when it hears of the death)
        assert wait_until(lambda: reader.call("stats")["memfd"] == (0, 0), 10), reader.call("stats")
        stats = reader.call("stats")
        assert stats["live_records"] == 0 and stats["remote_holders"] == 0
    finally:
        sender.close()
        reader.close()


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_sender_and_receiver_exiting_at_once(how):
    sender, receiver = Worker(), Worker()
    try:
        h = sender.call("share", "a", 1 << 16)
        receiver.call("attach", "a", h)
        mine = tx.attach(h)  # this process survives: it holds the memory too
        if how == "exit":
            sender.send("exit")
            receiver.send("exit")
            for w in (sender, receiver):
                w.proc.join(ANSWER_TIMEOUT)
                assert w.proc.exitcode == 0, "interpreter exit with live shared memory must not crash"
        else:
            os.kill(sender.pid, 9)
            os.kill(receiver.pid, 9)
            for w in (sender, receiver):
                w.proc.join(ANSWER_TIMEOUT)
        assert float(np.from_dlpack(mine)[3]) == 3.0
        del mine
    finally:
        sender.close()
        receiver.close()


def test_receiver_exiting_normally_while_holding_releases():
    t = _shared()
    record = t.record
    w = Worker()
    try:
        w.call("hold", "a", t)
        del t
        w.send("exit")
        w.proc.join(ANSWER_TIMEOUT)
        assert w.proc.exitcode == 0
        assert wait_until(lambda: record.state == "released", 10.0)
    finally:
        w.close()


def test_a_burst_of_releases_larger_than_the_socket_buffer():
    """Dropping thousands of attached tensors at once sends more release messages than
    the socket holds: the rest wait, in order, for the serving thread; none is lost."""
    n = 3000
    tensors = [tx.empty(16, "float32", shared=True) for _ in range(n)]
    records = [t.record for t in tensors]
    with Worker() as w:
        for k, t in enumerate(tensors):
            w.send("hold", k, t)
        del tensors, t
        for _ in range(n):
            w.answer()
        assert wait_until(lambda: REG.stats()["remote_holders"] == n, 10)  # (takes come in batches, unasked)
        w.call("drop_all")
        assert wait_until(lambda: all(r.state == "released" for r in records), 30)
        assert REG.stats()["remote_holders"] == 0


# -- the target: 2 workers exchanging 1,000 tensors each way ------------------------------------------
def test_two_workers_exchange_a_thousand_tensors_each_way():
    ctx = mp.get_context("spawn")
    ab, ba, report = ctx.Queue(), ctx.Queue(), ctx.Queue()
    n = 1000
    a = ctx.Process(target=exchange_peer, args=(ab, ba, report, n, 0.0), daemon=True)
    b = ctx.Process(target=exchange_peer, args=(ba, ab, report, n, 10_000.0), daemon=True)
    a.start()
    b.start()
    try:
        reports = [report.get(timeout=ANSWER_TIMEOUT * 3), report.get(timeout=ANSWER_TIMEOUT * 3)]
        ab.put("done")
        ba.put("done")
        for p in (a, b):
            p.join(ANSWER_TIMEOUT)
            assert p.exitcode == 0
        for r in reports:
            assert r["errors"] == []
            assert r["live_records"] == 0 and r["remote_holders"] == 0 and r["blocks_in_use"] == 0, r
            assert r["memfd"][0] == r["memfd"][1] <= 2, r  # its arena, and the other's if still mapped
            assert r["created_total"] >= n and r["created_total"] == r["released_total"]
    finally:
        stop((a, b), (ab, ba, report))


# -- the serving thread ----------------------------------------------------------------------------
def _thread_ticks(native_id):
    with open(f"/proc/self/task/{native_id}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks


def test_serving_thread_sleeps_while_nothing_happens():
    t = _shared()
    with Worker() as w:
        w.call("attach", "a", tx.share(t))
        thread = share_loop.loop().thread
        assert thread is not None and thread.is_alive()
        before = _thread_ticks(thread.native_id)
        time.sleep(0.5)
        assert _thread_ticks(thread.native_id) - before <= 1, "the serving thread used CPU while idle"


def test_concurrent_attaches_from_threads():
    t = _shared(1024)
    handles = [tx.share(t) for _ in range(8)]
    with Worker() as w:
        h = w.call("share", "a", 1024, 3.0)
        out, errors = [], []

        def attach_many():
            try:
                for _ in range(20):
                    u = tx.attach(h)
                    out.append(float(np.from_dlpack(u)[0]))
                    del u
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=attach_many) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(ANSWER_TIMEOUT)
        assert errors == [] and out == [3.0] * 80
    for h in handles:
        h.close()


# -- a sender that stops answering, forks, descriptors running out, odd handles and replies -----------
def _stopped(pid):
    """Every thread of process ``pid`` is stopped (state T): SIGSTOP took effect."""
    states = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as fh:
                states.add(fh.read().rsplit(")", 1)[1].split()[0])
        except OSError:
            pass
    return states == {"T"}


def test_an_attach_that_timed_out_holds_nothing_in_the_sender(monkeypatch):
    # The sender is stopped (SIGSTOP): the attach gives up after request_timeout. When the
    # sender resumes it handles the request late; it must not count this process as a
    # holder for it (a hold nobody would ever release), and the handle's lease must stay,
    # so that trying again works.
    monkeypatch.setattr(share_module.settings, "request_timeout", 1.0)
    with Worker() as w:
        h = w.call("share", "a", 8)
        w.call("drop", "a")  # only the handle's lease holds the memory now
        os.kill(w.pid, signal.SIGSTOP)
        try:
            assert wait_until(lambda: _stopped(w.pid), 10), "SIGSTOP did not stop the worker"
            with pytest.raises(tx.ExchangeError, match="did not answer"):
                tx.attach(h)
        finally:
            os.kill(w.pid, signal.SIGCONT)
        monkeypatch.setattr(share_module.settings, "request_timeout", 30.0)  # (the late request comes first)
        u = tx.attach(h)
        assert float(np.from_dlpack(u)[7]) == 7.0
        assert w.call("stats")["remote_holders"] == 1
        del u
        assert wait_until(lambda: w.call("stats")["remote_holders"] == 0, 10), w.call("stats")
        assert w.call("stats")["live_records"] == 0


def _forked_child(t, out, go):
    try:
        gc.collect()
        out.put(("inherited", t.record.holders, tx.registry().stats()["remote_holders"]))
        out.put(("handle", pickle.dumps(tx.share(t))))
        go.get(timeout=ANSWER_TIMEOUT)
    except BaseException as exc:
        out.put(("error", repr(exc)))


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # JAX's threads: the child runs no JAX
def test_a_forked_child_shares_what_its_parent_shared():
    # The child inherits the parent's record of `t` with the parent's lease and remote
    # holder on it: they are the parent's business, not the child's (the child would keep
    # the memory for its whole life), and sharing `t` again in the child must work.
    t = _shared()
    with Worker() as w:
        w.call("attach", "a", tx.share(t))  # a remote holder in this process
        lease = tx.share(t)
        pickle.dumps(lease)  # and a lease in transit
        ctx = mp.get_context("fork")
        out, go = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_forked_child, args=(t, out, go), daemon=True)
        p.start()
        try:
            assert out.get(timeout=ANSWER_TIMEOUT) == ("inherited", ["tx.Tensor"], 0)
            kind, data = out.get(timeout=ANSWER_TIMEOUT)
            assert kind == "handle", data
            u = tx.attach(pickle.loads(data))  # the child's share: a copy (this process's arena is its own to carve)
            assert u.record is not t.record and u.record.origin == f"imported from process {p.pid} (tx.attach)"
            assert np.array_equal(np.from_dlpack(u), np.from_dlpack(t))
            np.from_dlpack(u)[0] = 42.0
            assert np.from_dlpack(t)[0] == 0.0
            del u
            go.put("exit")
            p.join(ANSWER_TIMEOUT)
            assert p.exitcode == 0
        finally:
            stop([p], (out, go))
        w.call("drop", "a")
    lease.close()
    assert wait_until(lambda: t.record.holders == ["tx.Tensor"], 10), t.record.holders


def _attach_inherited(h, out, go):
    try:
        go.get(timeout=ANSWER_TIMEOUT)
        t = tx.attach(h)
        out.put(("attached", float(np.from_dlpack(t)[3])))
    except BaseException as exc:
        out.put(("error", repr(exc)))


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # JAX's threads: the child runs no JAX
def test_a_handle_a_forked_child_inherited_keeps_its_lease():
    # A handle passed to a fork child as a Process argument is never pickled: the child
    # has a copy. Dropping the parent's copy (and the tensor) must not end the lease, as
    # `q.put(t); del t` does not: the child attaches later.
    t = _shared()
    record = t.record
    h = tx.share(t)
    ctx = mp.get_context("fork")
    out, go = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_attach_inherited, args=(h, out, go), daemon=True)
    p.start()
    try:
        del t, h
        gc.collect()
        assert record.state == "live", "the lease of a handle the child inherited holds the memory"
        go.put("attach")
        assert out.get(timeout=ANSWER_TIMEOUT) == ("attached", 3.0)
        p.join(ANSWER_TIMEOUT)
        assert p.exitcode == 0
        assert wait_until(lambda: record.state == "released", 10), record.holders
    finally:
        stop([p], (out, go))


_RECEIVER_OUT_OF_FDS = EXHAUST_FDS + """
import json, pickle, sys
import numpy as np
import exchange as tx

def attach_or_error(h):
    try:
        return tx.attach(h), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"

handles = [pickle.loads(bytes.fromhex(sys.stdin.readline())) for _ in range(2)]
before = fd_kinds()
out = {}
junk = exhaust(free=0)
t, out["first"] = attach_or_error(handles[0])   # nothing read or started yet: no descriptor for it
for free in (1, 2, 3, 4):                        # part of what an attach needs
    release(junk); junk = exhaust(free)
    t, out[f"free {free}"] = attach_or_error(handles[0])
release(junk)
t, out["after"] = attach_or_error(handles[0])
junk = exhaust(free=0)
u, out["no room for the memory"] = attach_or_error(handles[1])  # connected: only the memory's descriptor is missing
release(junk)
u, out["again"] = attach_or_error(handles[1])
out["values"] = [float(np.from_dlpack(t)[1]), float(np.from_dlpack(u)[2])]
del t, u
import gc; gc.collect(); tx.registry().collect(timeout=10)
after = fd_kinds()
out["new descriptors"] = {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)
                          if after.get(k, 0) != before.get(k, 0)}
out["live_records"] = tx.registry().stats()["live_records"]
print(json.dumps(out), flush=True)
"""


def test_a_receiver_out_of_file_descriptors_gets_a_clear_error_and_recovers():
    import json

    tensors = [_shared(start=1.0), _shared(start=2.0)]
    handles = [tx.share(t, isolated=True) for t in tensors]  # memory of its own: a descriptor for each
    script = Script(_RECEIVER_OUT_OF_FDS)
    try:
        for h in handles:
            script.send(pickle.dumps(h).hex())
        out = json.loads(script.line())
    finally:
        assert script.close() == 0
    for key in ("first", "free 1", "free 2", "free 3", "free 4", "no room for the memory"):
        assert out[key] and out[key].startswith("OSError") and "file descriptor" in out[key], (key, out[key])
    assert out["after"] is None and out["again"] is None
    assert out["values"] == [2.0, 4.0]
    # What one working attach keeps: its connection (a socket), the sender's pidfd, and the
    # serving thread's selector and wake-up pipe. Nothing left over from the failed ones.
    assert out["new descriptors"] == {"socket": 1, "anon_inode": 2, "pipe": 2}, out["new descriptors"]
    assert out["live_records"] == 0
    del tensors
    assert wait_until(lambda: REG.stats()["remote_holders"] == 0, 10)
    for h in handles:
        h.close()


_SENDER_OUT_OF_FDS = EXHAUST_FDS + """
import importlib, json, pickle, sys, time
import numpy as np
import exchange as tx

share = importlib.import_module("exchange.sharing.loop")
t = tx.empty(8, "float32", shared=True)
np.from_dlpack(t)[...] = 5.0
print(pickle.dumps(tx.share(t)).hex(), flush=True)
stat = os.open(f"/proc/self/task/{share.loop().thread.native_id}/stat", os.O_RDONLY)  # opened while we can
junk = exhaust(free=0)
sys.stdin.readline()   # a receiver is connecting now
time.sleep(0.3)

def ticks():
    fields = os.pread(stat, 4096, 0).decode().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime of the serving thread

before = ticks()
time.sleep(1.0)
spent = ticks() - before
release(junk)
print(json.dumps({"ticks": spent, "hz": os.sysconf("SC_CLK_TCK")}), flush=True)
sys.stdin.readline()
"""


def test_a_sender_out_of_file_descriptors_does_not_spin_and_serves_later():
    import json

    script = Script(_SENDER_OUT_OF_FDS)
    try:
        h = pickle.loads(bytes.fromhex(script.line()))
        got = []
        attacher = threading.Thread(target=lambda: got.append(tx.attach(h)))
        attacher.start()
        script.send("connecting")
        spent = json.loads(script.line())
        attacher.join(ANSWER_TIMEOUT)
        assert got, "the attach did not complete once the sender had descriptors again"
        assert float(np.from_dlpack(got[0])[3]) == 5.0
        # A busy loop on accept() burns the whole second (hz ticks); waiting burns ~nothing.
        assert spent["ticks"] <= spent["hz"] // 10, f"the serving thread spun: {spent}"
        got.clear()
        script.send("exit")
    finally:
        assert script.close() == 0


def test_a_forged_empty_handle_with_elements_is_refused():
    t = tx.empty((0, 4), "float32", shared=True)
    h = tx.share(t)
    with pytest.raises(ValueError, match="truncated, corrupted or forged"):
        _forged(h, shape=(1000, 1000), strides=(1000, 1))  # would allocate 4 MB from nothing


def test_a_malformed_reply_is_an_exchange_error():
    # A handle whose address names a socket that is not a tensor-exchange sender (forged,
    # or another version): its reply is refused with ExchangeError, never an IndexError.
    # (The fake sender runs in this process: the handle names this process, which passes
    # the receiver's check of who is at the other end.)
    import socket

    t = _shared()
    h = tx.share(t)
    for reply in (b'["ok", 1]', b'["err", 1, 0, "released"]', b'{"ok": 1}', b"\xff not json"):
        name = f"\0tensor-exchange/test-{os.getpid()}/{secrets_token()}".encode()
        server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server.bind(name)
        server.listen(1)

        def answer(server=server, reply=reply):
            conn, _ = server.accept()
            conn.recv(1 << 16)
            conn.send(reply)
            conn.recv(1 << 16)  # until the client closes
            conn.close()

        th = threading.Thread(target=answer, daemon=True)
        th.start()
        try:
            with pytest.raises(tx.ExchangeError, match="malformed reply"):
                tx.attach(_forged(h, address=name))
        finally:
            client = receiving.connections().clients.pop(name, None)
            if client is not None:
                receiving.connections().sender_died(client)
            th.join(ANSWER_TIMEOUT)
            server.close()
    h.close()


def secrets_token():
    import secrets

    return secrets.token_hex(4)


# -- importing the package from two threads at once ----------------------------------------------------
_RACE_CHILD = """
import pickle, sys, threading
import numpy as np
import exchange as tx

data = sys.stdin.buffer.read()
barrier, out = threading.Barrier(2), {}

def unpickle():  # a Queue's get on the main thread
    barrier.wait()
    try:
        out["tensor"] = pickle.loads(data)
    except BaseException as exc:
        out["unpickle"] = repr(exc)

def load():  # the reducer, on a Queue's feeder thread, sending this process's first Tensor
    barrier.wait()
    try:
        from exchange.sharing import reduce_tensor  # noqa: F401
    except BaseException as exc:
        out["import"] = repr(exc)

threads = [threading.Thread(target=unpickle), threading.Thread(target=load)]
for t in threads: t.start()
for t in threads: t.join()
print(float(np.from_dlpack(out["tensor"])[0]) if len(out) == 1 else out)
"""


def test_unpickling_while_another_thread_loads_sharing():
    """A process's first unpickle of a Tensor and its first send, on two threads at
    once, both load exchange.sharing; neither gets a half-initialized module. (With
    pickles naming a submodule, about one such process in two failed with ImportError.)"""
    import subprocess
    import sys
    from multiprocessing.reduction import ForkingPickler

    tensors = [tx.empty(4, "float32", shared=True) for _ in range(16)]
    for k, t in enumerate(tensors):
        np.from_dlpack(t)[...] = k
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for batch in range(0, len(tensors), 4):  # four fresh processes at a time
        procs = []
        for k in range(batch, batch + 4):
            data = bytes(ForkingPickler.dumps(tensors[k]))
            p = subprocess.Popen([sys.executable, "-c", _RACE_CHILD], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
            procs.append((k, p, data))
        for k, p, data in procs:
            out, err = p.communicate(data, timeout=ANSWER_TIMEOUT)
            assert p.returncode == 0 and out.decode().strip() == f"{float(k)}", (out, err[-2000:])
