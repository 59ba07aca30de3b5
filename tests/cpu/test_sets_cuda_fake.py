"""Sets on CUDA memory, their ordering logic, on the fake CUDA of test_cuda_without_gpu.

Two fake "processes" share one IPC world: backend A publishes, backend B reads (the
test switches which one the library loads, as the publisher's and the reader's
processes would each have their own). The world hands IPC events, pools and
allocations from one to the other and logs, in order, every stream wait, copy, pool
import and allocation import, so the tests read what was queued before what. The fake
streams' events complete when a test says so (``busy()`` / ``finish()``). What the
device does with that order is tests/gpu/test_gpu_sets.py's to check.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import socket
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

import exchange as tx
import exchange.devices as devices_package
from exchange.channels import cuda_sets
from exchange.devices import base
from exchange.sets import wire
from exchange.sets.names import NameLock
from test_cuda_without_gpu import FakeDriver, make_fake_core, make_fake_cupy

_TYPES = (tx.DeviceType.kDLCUDA, tx.DeviceType.kDLCUDAHost, tx.DeviceType.kDLCUDAManaged)
_names = itertools.count()


def _name(what: str) -> str:
    return f"fk-{what}-{os.getpid()}-{next(_names)}"


def _add_ipc(core, driver, world, tag):
    """Give a fake cuda.core what IPC needs: pools with a uuid and a descriptor (a real
    file descriptor, so the socket can carry it), allocations with a descriptor, events
    with a handle of their own; every import and wait logged in ``world.log``."""
    Event, Stream, Buffer, MR = core.Event, core.Stream, core.Buffer, core.DeviceMemoryResource

    def event_descriptor(self):
        eid = getattr(self, "ipc_id", None)
        if eid is None:
            eid = self.ipc_id = next(world.ids)
            world.events[eid] = self
        return core.IPCEventDescriptor._init(eid.to_bytes(64, "little"), False)

    def open_event(cls, descriptor):
        original = world.events[int.from_bytes(descriptor.reserved, "little")]
        other = cls.__new__(cls)
        other.stream, other.gate, other.ipc_id = original.stream, original.gate, original.ipc_id
        world.log.append(("open", tag, other.ipc_id))
        return other

    Event.ipc_descriptor = property(event_descriptor)
    Event.from_ipc_descriptor = classmethod(open_event)
    plain_wait = Stream.wait

    def wait(self, event):
        world.log.append(("wait", tag, self.handle, getattr(event, "ipc_id", None), event.stream))
        plain_wait(self, event)

    Stream.wait = wait
    plain_copy = driver.cuMemcpyAsync

    def copy(dst, src, nbytes, stream):
        world.log.append(("copy", tag, int(stream), int(dst)))
        return plain_copy(dst, src, nbytes, stream)

    driver.cuMemcpyAsync = copy

    class IPCBufferDescriptor:
        @staticmethod
        def _init(payload, size):
            made = IPCBufferDescriptor.__new__(IPCBufferDescriptor)
            made.payload, made.size = payload, size
            return made

        def __reduce__(self):
            return IPCBufferDescriptor._init, (self.payload, self.size)

    core.IPCBufferDescriptor = IPCBufferDescriptor
    Buffer.memory_resource = property(lambda self: self.mr)
    Buffer.ipc_descriptor = property(lambda self: IPCBufferDescriptor._init(
        int(self.handle).to_bytes(8, "little") + bytes(56), self.size))

    def import_buffer(mr, descriptor, stream=None):
        assert mr.imported and isinstance(stream, Stream)
        address = int.from_bytes(descriptor.payload[:8], "little")
        world.log.append(("import", tag, address))
        return Buffer(address, descriptor.size, mr)

    Buffer.from_ipc_descriptor = staticmethod(import_buffer)

    def pool_uuid(self):
        if not hasattr(self, "_uuid"):
            self._uuid = f"pool-{tag}-{self.ordinal}"
        return self._uuid

    def pool_fd(self):
        if not hasattr(self, "_fd"):
            self._fd = os.open(os.devnull, os.O_RDONLY)
            world.fds.append(self._fd)
        return self._fd

    def import_pool(cls, ordinal, fd):
        os.fstat(fd)  # a descriptor that came over the socket
        made = cls(ordinal)
        made.imported = True
        world.log.append(("pool", tag, ordinal))
        return made

    MR.uuid = property(pool_uuid)
    MR.allocation_handle = property(pool_fd)
    MR.imported = False
    MR.from_allocation_handle = classmethod(import_pool)
    core.Device.uuid = property(lambda self: f"GPU-fake-{self.ordinal}")


@pytest.fixture
def procs(monkeypatch):
    """Two fake CUDA processes, A (the publisher) and B (the reader); ``procs.be(p)``
    makes the library use p's backend."""
    from exchange.devices import cuda as cuda_module

    world = SimpleNamespace(ids=itertools.count(1), events={}, log=[], fds=[])
    made = {}
    for tag in "AB":
        driver = FakeDriver(count=2)
        core = make_fake_core(driver)
        _add_ipc(core, driver, world, tag)
        made[tag] = SimpleNamespace(tag=tag, backend=cuda_module.CUDABackend(core, driver, 2), driver=driver,
                                    core=core)
    monkeypatch.setattr(cuda_module, "_cupy", make_fake_cupy)
    loaded = {t: base._loaded.get(t) for t in _TYPES}
    base.register_backend(_TYPES, lambda: made["A"].backend)

    def be(p):
        for t in _TYPES:
            base._loaded[t] = p.backend

    be(made["A"])
    # Readers map versions on the runtime's thread as they arrive, whatever backend the
    # test's thread has switched to: the reader's side is B's, as a process's is its own.
    monkeypatch.setattr(cuda_sets, "_reader_backend", lambda: made["B"].backend)
    try:
        yield SimpleNamespace(A=made["A"], B=made["B"], world=world, be=be)
        gc.collect()
        assert tx.registry().collect(timeout=5)
    finally:
        base.register_backend(_TYPES, devices_package._load_cuda)
        base._loaded.update({t: b for t, b in loaded.items() if b is not None})
        for fd in world.fds:
            os.close(fd)


def _order(p):
    from exchange.channels.cuda import ipc

    return ipc(p.backend).order_stream(0)


def _source(values: np.ndarray, stream=None) -> tx.Tensor:
    t = tx.empty(values.shape, values.dtype.name, device="cuda:0", stream=stream)
    np.ctypeslib.as_array((np.ctypeslib.ctypes.c_byte * values.nbytes).from_address(t.data_ptr))[:] = \
        values.view(np.int8).ravel()
    return t


def _host(t: tx.Tensor) -> np.ndarray:
    n = int(np.prod(t.shape)) * t.dtype.itemsize
    raw = bytes((np.ctypeslib.ctypes.c_byte * n).from_address(t.data_ptr))
    return np.frombuffer(raw, np.dtype(t.dtype.name)).reshape(t.shape)


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@contextlib.contextmanager
def _as(procs, p):
    before = base._loaded.get(tx.DeviceType.kDLCUDA)
    procs.be(p)
    try:
        yield
    finally:
        procs.be(procs.A if before is procs.A.backend else procs.B)


def test_the_readers_stream_waits_on_the_publishers_event_before_any_use(procs):
    from exchange.devices.cuda_streams import HOST_SYNCS

    name = _name("order")
    writer = tx.create_stream("cuda:0")
    src = _source(np.arange(64, dtype=np.float32), writer)
    writer.core.busy()  # the producer's work is still running: the copy must wait for it
    syncs = HOST_SYNCS.count
    v = tx.publish(name, {"w": src})
    pub = _order(procs.A)
    log = procs.world.log
    copies = [i for i, e in enumerate(log) if e[0] == "copy" and e[1] == "A"]
    waits = [i for i, e in enumerate(log) if e[0] == "wait" and e[1] == "A" and e[2] == pub.handle
             and e[4] is writer.core]
    assert copies and waits and waits[0] < copies[0], "the copy was not queued after the producer's stream"
    assert copies and all(log[i][2] == pub.handle for i in copies), "the copy ran off the region's stream"
    writer.core.finish()
    with _as(procs, procs.B), tx.subscribe(name) as sub:
        snap = sub.latest(timeout=10)
        reader = _order(procs.B)
        ready = [e[3] for e in log if e[0] == "wait" and e[1] == "B" and e[2] == reader.handle and e[3]]
        imports = [i for i, e in enumerate(log) if e[0] == "import" and e[1] == "B"]
        assert ready, "the reader's stream never waited on the publisher's event"
        first_wait = next(i for i, e in enumerate(log) if e[0] == "wait" and e[1] == "B" and e[3] == ready[0])
        assert first_wait < imports[0], "the allocation was mapped before the reader's stream waited"
        assert procs.world.events[ready[0]].stream is pub.core, "the event waited on is not the publisher's"
        t = snap["w"]
        assert t.stream is reader and t.device == tx.Device.parse("cuda:0")
        # a consumer's stream waits for the reader's stream (the usual handshake)
        consumer = tx.create_stream("cuda:0")
        mark = len(log)
        cap = t.__dlpack__(stream=consumer.handle, max_version=(1, 0))
        assert any(e[0] == "wait" and e[2] == consumer.handle and e[4].handle == reader.handle for e in log[mark:])
        del cap
        assert HOST_SYNCS.count == syncs, "publishing or taking blocked the host"
        np.testing.assert_array_equal(_host(t), np.arange(64, dtype=np.float32))
        assert v.readers == [os.getpid()]
        del t, snap
    _wait_for(lambda: not v.readers)
    tx.unpublish(name)


def test_reader_tensors_are_read_only_with_no_legacy_exemption(procs):
    name = _name("ro")
    tx.publish(name, {"w": _source(np.ones(8, np.float32))})
    with _as(procs, procs.B), tx.subscribe(name) as sub, sub.latest(timeout=10) as snap:
        t = snap["w"]
        assert t.readonly and t._record.immutable and not t._record.sealed
        with pytest.raises(BufferError):
            t.__dlpack__(stream=1)  # a legacy capsule cannot say read-only: refused on CUDA
        del t
    tx.unpublish(name)


def test_a_region_is_reused_only_after_the_readers_release_events(procs):
    name = _name("reuse")
    log = procs.world.log
    v1 = tx.publish(name, {"w": _source(np.full(256, 1, np.float32))})
    with _as(procs, procs.B):
        sub = tx.subscribe(name)
        snap = sub.latest(timeout=10)
        t = snap["w"]
        region1 = t.data_ptr
        user = tx.create_stream("cuda:0")
        cap = t.__dlpack__(stream=user.handle, max_version=(1, 0))  # the reader's work, on its stream
        del cap
        user.core.busy()  # ... still running
    held = len(log)
    for k in (2, 3):  # while it is held, new versions go elsewhere
        tx.publish(name, {"w": _source(np.full(256, k, np.float32))})
        assert not any(e[0] == "copy" and e[3] == region1 for e in log[held:]), "a held region was written"
    with _as(procs, procs.B):
        mark = len(log)
        del t, snap  # the release: B's default stream waits for the user's stream, then an IPC event
        gc.collect()
        default = procs.B.backend.default_stream(tx.Device.parse("cuda:0"))
        after = log[mark:]
        user_wait = next(i for i, e in enumerate(after) if e[1] == "B" and e[2] == default.handle
                         and e[4].handle == user.handle)
        assert user_wait is not None, "the release did not wait for the reader's stream"
    _wait_for(lambda: not v1.readers)
    pub = _order(procs.A)
    released = [e for e in log[mark:] if e[0] == "wait" and e[1] == "A" and e[2] == pub.handle and e[3]]
    assert released, "the publisher's stream never waited on the reader's release event"
    release_event = procs.world.events[released[-1][3]]
    assert release_event.stream is procs.B.core.LEGACY_DEFAULT_STREAM
    at = log.index(released[-1])
    for k in (4, 5, 6):  # region 1 is free now: a later version reuses it, after the wait
        tx.publish(name, {"w": _source(np.full(256, k, np.float32))})
    reuse = [i for i, e in enumerate(log) if i > held and e[0] == "copy" and e[3] == region1]
    assert reuse, "the released region was never reused"
    assert all(i > at for i in reuse), "the region was written before the publisher waited on the release event"
    user.core.finish()
    sub.close()
    tx.unpublish(name)


def test_one_pool_import_per_reader_connection_across_many_versions(procs, monkeypatch):
    name = _name("pool")
    sent = []
    plain_send = wire.send

    def spy(sock, message, fd=-1, flags=0):
        if message[0] == "version":
            sent.append((message[2], fd >= 0, message[8][3] if len(message) > 8 else None))
        plain_send(sock, message, fd, flags)

    monkeypatch.setattr(wire, "send", spy)
    tx.publish(name, {"w": _source(np.zeros(64, np.float32))})
    with _as(procs, procs.B):
        sub = tx.subscribe(name)
        seen = []
        for k in range(1, 13):
            if k > 1:
                with _as(procs, procs.A):
                    tx.publish(name, {"w": _source(np.full(64, k, np.float32))})
            with sub.next(timeout=10) as snap:
                t = snap["w"]
                seen.append((snap.version, float(_host(t)[0])))
                del t
        assert seen == [(1, 0.0)] + [(k, float(k)) for k in range(2, 13)], seen
        pools = [e for e in procs.world.log if e[0] == "pool" and e[1] == "B"]
        assert len(pools) == 1, f"the pool was imported {len(pools)} times"
        assert [fd for _, fd, _ in sent] == [True] + [False] * 11, "the pool's descriptor went more than once"
        assert len({d for _, _, d in sent}) < len(sent), "no version reused a region"
        # a second connection (another subscription) gets the descriptor once more; this
        # process has the pool mapped already and imports it no more
        with tx.subscribe(name) as other, other.latest(timeout=10):
            pass
        assert sent[-1][1] is True
        assert len([e for e in procs.world.log if e[0] == "pool" and e[1] == "B"]) == 1
        sub.close()
    tx.unpublish(name)


def test_two_snapshots_of_one_version_share_one_import(procs):
    name = _name("twice")
    tx.publish(name, {"w": _source(np.arange(16, dtype=np.int32))})
    log = procs.world.log
    with _as(procs, procs.B):
        with tx.subscribe(name) as a, tx.subscribe(name) as b:
            sa, sb = a.latest(timeout=10), b.latest(timeout=10)
            assert sa["w"].data_ptr == sb["w"].data_ptr
            assert len([e for e in log if e[0] == "import" and e[1] == "B"]) == 1
            closed = len([e for e in procs.B.driver.calls if e[0] == "close"])
            del sa
            gc.collect()
            assert len([e for e in procs.B.driver.calls if e[0] == "close"]) == closed, "unmapped under a holder"
            np.testing.assert_array_equal(_host(sb["w"]), np.arange(16, dtype=np.int32))
            del sb
            gc.collect()
            assert len([e for e in procs.B.driver.calls if e[0] == "close"]) == closed + 1
    tx.unpublish(name)


def test_a_draft_on_cuda_orders_readers_after_the_streams_that_wrote_it(procs):
    name = _name("draft")
    d = tx.draft(name, {"w": ((32,), "float32")}, device="cuda:0")
    w = d["w"]
    assert w.device == tx.Device.parse("cuda:0") and w.stream is _order(procs.A)
    writer = tx.create_stream("cuda:0")
    cap = w.__dlpack__(stream=writer.handle, max_version=(1, 0))  # a framework writes on `writer`
    del cap
    writer.core.busy()
    mark = len(procs.world.log)
    v = d.publish()
    pub = _order(procs.A)
    waits = [e for e in procs.world.log[mark:] if e[0] == "wait" and e[2] == pub.handle]
    assert any(e[4].handle == writer.handle for e in waits), "the ready event did not wait for the draft's writer"
    writer.core.finish()
    with pytest.raises(BufferError, match="cpu"):
        tx.publish(name, {"w": np.zeros(3, np.float32)})  # the set is on cuda:0
    del w, d
    with _as(procs, procs.B), tx.subscribe(name) as sub, sub.latest(timeout=10) as snap:
        assert snap.version == v.number and snap["w"].shape == (32,)
    tx.unpublish(name)


# -- malformed messages ----------------------------------------------------------------------------
def _good_part():
    return [int(tx.DeviceType.kDLCUDA), "GPU-fake-0", "pool-A-0", "ab" * 64, 65536, "cd" * 64]


@pytest.mark.parametrize("change", [
    lambda p: p.__setitem__(5, "cd" * 63),          # an event handle of the wrong size
    lambda p: p.__setitem__(3, "zz" * 64),          # not hex
    lambda p: p.__setitem__(4, 1 << 20),            # an allocation of another size than its region
    lambda p: p.__setitem__(0, int(tx.DeviceType.kDLCPU)),  # host memory has no part
    lambda p: p.__setitem__(0, 12345),              # no device type
    lambda p: p.append("extra"),                    # a field too many
    lambda p: p.__setitem__(1, 7),                  # a uuid that is no string
])
def test_a_malformed_cuda_version_message_is_refused(procs, change):
    name = _name("bad")
    part = _good_part()
    change(part)
    lock = NameLock(name)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(lock.socket_path)
    server.listen(1)
    got = {}

    def serve():
        conn, _ = server.accept()
        with conn:
            m, fds = wire.receive(conn)
            wire.close_fds(fds)
            got["take"] = m
            entries = [["w", "float32", [4], 0]]
            with open(os.devnull, "rb") as f:
                wire.send(conn, ["version", m[1], 1, 1, 65536, 16, 1, entries, part], f.fileno())
            got["after"] = wire.receive(conn)[0]  # end of stream: the reader hung up

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    try:
        with _as(procs, procs.B), tx.subscribe(name) as sub:
            with pytest.raises(tx.LifetimeError, match="malformed"):
                sub.latest(timeout=10)
        th.join(10)
        assert got["take"][0] == "follow" and got["after"] is None
        assert not [e for e in procs.world.log if e[0] in ("pool", "import")], "mapped a malformed version"
    finally:
        server.close()
        lock.close()


def test_the_wire_checks_release_tokens_and_parts():
    assert wire.check_request(["release", 3, "ab" * 64]) == ["release", 3, "ab" * 64]
    for bad in (["release", 3, "xyz"], ["release", 3, "a"], ["release", 3, 7], ["release", 3, ""],
                ["release", 3, "ab" * 200]):
        with pytest.raises(ValueError):
            wire.check_request(bad)
    message = ["version", 1, 1, 1, 65536, 16, 1, None]
    assert wire.check_reply(message + [_good_part()])
    for bad in ([], ["x" * 300], [1.5], [[1]], list(range(9)), {"a": 1}):
        with pytest.raises(ValueError):
            wire.check_reply(message + [bad])


def test_a_reader_in_the_publishers_own_process_imports_nothing(procs, monkeypatch):
    # CUDA does not open a process's own IPC handles: the region's memory and the events
    # are used as they are, in the same order
    monkeypatch.setattr(cuda_sets, "_reader_backend", lambda: procs.A.backend)  # the reader is A too
    name = _name("self")
    log = procs.world.log
    writer = tx.create_stream("cuda:0")
    v1 = tx.publish(name, {"w": _source(np.arange(32, dtype=np.float32), writer)})
    pub = _order(procs.A)
    mark = len(log)
    with tx.subscribe(name) as sub:
        snap = sub.latest(timeout=10)
        t = snap["w"]
        region1 = t.data_ptr
        assert not [e for e in log[mark:] if e[0] in ("pool", "import", "open")], "imported its own memory"
        assert any(e[0] == "wait" and e[2] == pub.handle and e[4] is pub.core for e in log[mark:]), \
            "the reader's stream did not wait on the publisher's ready event"
        np.testing.assert_array_equal(_host(t), np.arange(32, dtype=np.float32))
        user = tx.create_stream("cuda:0")
        cap = t.__dlpack__(stream=user.handle, max_version=(1, 0))  # the reader's work on `user`
        del cap, t, snap
        gc.collect()
        _wait_for(lambda: not v1.readers)
        default = procs.A.backend.default_stream(tx.Device.parse("cuda:0"))
        assert any(e[0] == "wait" and e[2] == pub.handle and e[4] is default.core for e in log[mark:]), \
            "the publisher's stream did not wait on the release event"
        at = max(i for i, e in enumerate(log) if e[0] == "wait" and e[2] == pub.handle and e[4] is default.core)
        for k in (2, 3, 4):
            tx.publish(name, {"w": _source(np.full(32, k, np.float32))})
        assert all(i > at for i, e in enumerate(log) if i > mark and e[0] == "copy" and e[3] == region1)
        with sub.latest(timeout=10) as snap:  # (the newest offered yet: 2, 3 or 4)
            assert float(_host(snap["w"])[0]) == snap.version > 1
    tx.unpublish(name)
