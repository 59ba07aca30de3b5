"""The CUDA backend on a machine without a GPU.

1. What a user sees with no driver: ``tx.Device.parse("cuda:0")`` works, anything that
   needs the backend raises ``tx.BackendUnavailableError`` (an ImportError) saying why,
   and ``import exchange`` loads no CUDA module.
2. The backend's own logic (the DLPack stream table, stream objects, allocation and
   release, the copy paths, the handshake, stream-ordered release, poison-on-release)
   driven through ``tx`` by a fake cuda.core / cuda.bindings driver / CuPy whose
   "device memory" is host memory and whose streams complete when a test says so. It
   checks the plumbing and the ordering decisions; tests/gpu checks them on a device.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import exchange as tx
import exchange.devices as devices_package
from exchange.devices import base

# -- 1. without a driver ---------------------------------------------------------------------------


def _cuda_usable() -> bool:
    try:
        base.get_backend(tx.DeviceType.kDLCUDA)
    except tx.BackendUnavailableError:
        return False
    return True


def test_cuda_devices_parse_without_a_backend():
    d = tx.Device.parse("cuda:0")
    assert d.type == tx.DeviceType.kDLCUDA and d.id == 0 and str(d) == "cuda:0"
    assert tx.Device.parse("cuda") == d
    assert tx.Device.parse("cuda:3").id == 3
    assert tx.Device.parse("cuda_host").type == tx.DeviceType.kDLCUDAHost
    assert tx.Device.parse("cuda_managed").type == tx.DeviceType.kDLCUDAManaged
    assert tx.Device.parse(str(tx.Device.parse("cuda:2"))) == tx.Device.parse("cuda:2")


def test_cuda_use_without_a_device_says_why():
    if _cuda_usable():
        pytest.skip("a CUDA device is usable here; this test is for machines without one")
    for call in (lambda: tx.empty((4,), device="cuda"),
                 lambda: tx.empty((4,), device="cuda_host"),
                 lambda: tx.create_stream("cuda:0"),
                 lambda: tx.from_dlpack(np.zeros(3), device="cuda:0")):
        with pytest.raises(tx.BackendUnavailableError) as info:
            call()
        assert isinstance(info.value, ImportError)
        message = str(info.value)
        assert any(word in message for word in ("driver", "cuda-python", "cuda.core", "device")), message
    # the CPU keeps working
    assert tx.empty((4,)).device == tx.Device.parse("cpu")


def test_import_exchange_loads_no_cuda_module():
    code = textwrap.dedent("""
        import sys
        import exchange as tx
        import exchange.devices.cuda  # the backend module itself imports nothing CUDA until load()
        t = tx.empty((3,))
        tx.from_dlpack(t)
        bad = sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupy_backends', 'cuda'))
        print(bad)
    """)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


# -- 2. the backend's logic, on a fake CUDA --------------------------------------------------------


class FakeDriver:
    """The few cuda.bindings.driver calls the backend makes; memory is host memory."""

    class CUresult:
        CUDA_SUCCESS = 0
        CUDA_ERROR_NO_DEVICE = 100
        CUDA_ERROR_INVALID_CONTEXT = 201

    CUmemAttach_flags = SimpleNamespace(CU_MEM_ATTACH_GLOBAL=1)
    CUpointer_attribute = SimpleNamespace(CU_POINTER_ATTRIBUTE_MEMORY_TYPE=2)
    CUmemorytype = SimpleNamespace(CU_MEMORYTYPE_HOST=1, CU_MEMORYTYPE_DEVICE=2)

    def __init__(self, count: int) -> None:
        self.count = count
        self.current = 0  # context "address"; device n's primary context is 1000 + n
        self.blocks: dict[int, np.ndarray] = {}
        self.pinned: set[int] = set()  # addresses of "page-locked" blocks (the pinned resource's)
        self.calls: list[tuple] = []

    def host_block(self, nbytes: int) -> int:
        block = np.zeros(nbytes + 64, np.uint8)
        address = (block.ctypes.data + 63) // 64 * 64
        self.blocks[address] = block
        return address

    def cuCtxGetCurrent(self):
        return 0, self.current

    def cuCtxSetCurrent(self, ctx):
        self.calls.append(("cuCtxSetCurrent", int(ctx)))
        self.current = int(ctx)
        return (0,)

    def cuCtxGetDevice(self):
        if not self.current:
            return self.CUresult.CUDA_ERROR_INVALID_CONTEXT, None
        return 0, self.current - 1000

    def cuMemcpyAsync(self, dst, src, nbytes, stream):
        self.calls.append(("cuMemcpyAsync", int(stream), nbytes))
        ctypes.memmove(int(dst), int(src), nbytes)
        return (0,)

    def cuMemsetD8Async(self, dst, value, nbytes, stream):
        self.calls.append(("cuMemsetD8Async", int(stream), nbytes))
        ctypes.memset(int(dst), value, nbytes)
        return (0,)

    def cuPointerGetAttribute(self, attribute, address):
        assert attribute == self.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE
        for start in self.pinned:
            if start <= int(address) < start + self.blocks[start].size - 64:
                return 0, self.CUmemorytype.CU_MEMORYTYPE_HOST
        return 1, None  # CUDA_ERROR_INVALID_VALUE: memory CUDA does not know (pageable)

    def cuMemAllocManaged(self, nbytes, flags):
        assert flags == 1
        return 0, self.host_block(nbytes)

    def cuMemFree(self, address):
        self.calls.append(("cuMemFree", int(address)))
        del self.blocks[int(address)]
        return (0,)

    def cuGetErrorName(self, err):
        return 0, b"CUDA_ERROR_FAKE"

    def cuGetErrorString(self, err):
        return 0, b"a fake error"


def make_fake_core(driver: FakeDriver):
    """A fake cuda.core: streams whose events complete when the test opens a gate."""
    handles = itertools.count(0x7000)

    class IPCEventDescriptor:
        """As cuda.core's: made by its _init(bytes, blocking_sync), pickled through it."""

        def __init__(self, *args):
            raise RuntimeError("made by Event APIs only")

        @staticmethod
        def _init(reserved, blocking_sync):
            made = IPCEventDescriptor.__new__(IPCEventDescriptor)
            made.reserved, made.blocking_sync = reserved, blocking_sync
            return made

        def __reduce__(self):
            return IPCEventDescriptor._init, (self.reserved, self.blocking_sync)

    class Event:
        created = 0  # every Event made here (a pooled one is recorded again instead)
        opened: list = []  # descriptors of other processes' events opened (from_ipc_descriptor)

        def __init__(self, stream):
            Event.created += 1
            self.stream = stream
            self.gate = stream.gate

        @property
        def ipc_descriptor(self):
            return IPCEventDescriptor._init(bytes(64), False)

        @classmethod
        def from_ipc_descriptor(cls, descriptor):
            assert isinstance(descriptor, IPCEventDescriptor)
            Event.opened.append(descriptor)
            other = cls.__new__(cls)  # another process's event: not one made here
            other.stream, other.gate = None, {"open": True}
            return other

        @property
        def is_done(self):
            return self.gate["open"]

        def sync(self):
            assert self.gate["open"], "the host would block forever on a fake event"

    class Stream:
        def __init__(self, handle):
            self.handle = handle
            self.gate = {"open": True}
            self.waited: list = []

        @staticmethod
        def from_handle(handle):
            return Stream(handle)

        def busy(self):
            """Work queued from now on stays unfinished until finish()."""
            self.gate = {"open": False}

        def finish(self):
            self.gate["open"] = True

        def record(self, event=None, options=None):
            assert driver.current, "record() without a current context"
            if event is None:
                return Event(self)
            assert isinstance(event, Event)
            event.stream, event.gate = self, self.gate  # recorded again: now it marks this stream's work
            return event

        def wait(self, event):
            # cuStreamWaitEvent takes the work the event marks now: keep that, not the event
            assert isinstance(event, Event)
            self.waited.append(SimpleNamespace(stream=event.stream, gate=event.gate))

        def sync(self):
            assert self.gate["open"], "the host would block on a busy fake stream"

        def __cuda_stream__(self):
            return (0, int(self.handle))

    class Buffer:
        def __init__(self, address, size, mr):
            self.handle, self.size, self.mr, self.closed_on = address, size, mr, None

        def close(self, stream=None):
            assert self.closed_on is None, "closed twice"
            self.closed_on = stream
            driver.calls.append(("close", self.handle))
            mr.freed.append(self)  # the host block stays, so tests can read what was left in it

    class DeviceMemoryResource:
        freed: list = []

        def __init__(self, ordinal, options=None):
            self.ordinal = ordinal
            self.ipc_enabled = bool(getattr(options, "ipc_enabled", False))

        def allocate(self, size, *, stream):
            assert isinstance(stream, Stream)
            assert driver.current == 1000 + self.ordinal, "allocation without its device current"
            return Buffer(driver.host_block(size), size, self)

    mr = DeviceMemoryResource  # the class keeps the freed list for the tests

    class LegacyPinnedMemoryResource:
        def allocate(self, size, *, stream=None):
            address = driver.host_block(size)
            driver.pinned.add(address)
            return Buffer(address, size, mr)

    class Device:
        def __init__(self, ordinal):
            assert 0 <= ordinal < driver.count
            self.ordinal = ordinal
            self.properties = SimpleNamespace(memory_pools_supported=True)

        def set_current(self):
            driver.current = 1000 + self.ordinal

        def create_stream(self):
            return Stream(next(handles))

    return SimpleNamespace(__name__="fake_cuda_core", Event=Event, Stream=Stream, Buffer=Buffer, Device=Device,
                           IPCEventDescriptor=IPCEventDescriptor, EventOptions=lambda **kw: SimpleNamespace(**kw),
                           DeviceMemoryResourceOptions=lambda **kw: SimpleNamespace(**kw),
                           DeviceMemoryResource=DeviceMemoryResource,
                           LegacyPinnedMemoryResource=LegacyPinnedMemoryResource,
                           LEGACY_DEFAULT_STREAM=Stream(1), PER_THREAD_DEFAULT_STREAM=Stream(2))


class FakeArray(np.ndarray):
    """A NumPy array that answers CuPy's ``.data.ptr``."""

    @property
    def data(self):
        return SimpleNamespace(ptr=self.__array_interface__["data"][0])


def make_fake_cupy():
    """Enough of CuPy for the backend's strided copies, over host memory."""
    from exchange.devices.cpu import numpy_view

    class _Context:
        def __init__(self, *args):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def ndarray(shape, dtype, memptr, strides):
        itemsize = np.dtype(dtype).itemsize
        view = numpy_view(memptr.ptr, tuple(shape), tuple(s // itemsize for s in strides), itemsize, dtype)
        return view.view(FakeArray)

    cuda = SimpleNamespace(
        Device=_Context,
        Stream=SimpleNamespace(from_external=lambda stream: _Context()),
        UnownedMemory=lambda ptr, size, owner, device_id: SimpleNamespace(ptr=ptr, owner=owner),
        MemoryPointer=lambda mem, offset: SimpleNamespace(ptr=mem.ptr + offset, mem=mem),
    )
    return SimpleNamespace(
        cuda=cuda,
        ndarray=ndarray,
        ascontiguousarray=lambda a: np.ascontiguousarray(a).view(FakeArray),
        empty=lambda shape, dtype: np.empty(shape, dtype).view(FakeArray),
    )


@pytest.fixture
def fake_cuda(monkeypatch):
    """The real CUDA backend class over the fakes, registered for the CUDA device types
    for the test (the real loader is put back after)."""
    from exchange.devices import cuda as cuda_module

    driver = FakeDriver(count=2)
    core = make_fake_core(driver)
    backend = cuda_module.CUDABackend(core, driver, 2)
    monkeypatch.setattr(cuda_module, "_cupy", make_fake_cupy)
    types = (tx.DeviceType.kDLCUDA, tx.DeviceType.kDLCUDAHost, tx.DeviceType.kDLCUDAManaged)
    loaded = {t: base._loaded.get(t) for t in types}  # a real backend, where a GPU loaded one
    base.register_backend(types, lambda: backend)
    try:
        yield SimpleNamespace(backend=backend, driver=driver, core=core)
        gc.collect()
        assert tx.registry().collect(timeout=5)
    finally:
        base.register_backend(types, devices_package._load_cuda)
        base._loaded.update({t: b for t, b in loaded.items() if b is not None})


CUDA0 = tx.Device.parse("cuda:0")


def test_fake_stream_table(fake_cuda):
    cuda = fake_cuda.backend
    legacy = cuda.stream_from_dlpack(None, CUDA0)
    assert legacy.handle == 1 and cuda.stream_from_dlpack(1, CUDA0) is legacy
    assert cuda.stream_from_dlpack(2, CUDA0).handle == 2
    assert cuda.stream_from_dlpack(-1, CUDA0) is None
    with pytest.raises(ValueError, match="ambiguous"):
        cuda.stream_from_dlpack(0, CUDA0)
    with pytest.raises(ValueError):
        cuda.stream_from_dlpack(-7, CUDA0)
    with pytest.raises(TypeError):
        cuda.stream_from_dlpack(True, CUDA0)
    with pytest.raises(TypeError):
        cuda.stream_from_dlpack("1", CUDA0)
    s = cuda.stream_from_dlpack(0x1234, CUDA0)
    assert s.handle == 0x1234 and s.device == CUDA0
    assert cuda.to_dlpack_stream(None, CUDA0) == 1
    assert cuda.to_dlpack_stream(s, CUDA0) == 0x1234
    assert cuda.default_stream(tx.Device.parse("cuda:1")).device == tx.Device.parse("cuda:1")


def test_fake_as_stream(fake_cuda):
    cuda = fake_cuda.backend
    ours = tx.create_stream("cuda:1")
    assert ours.device == tx.Device.parse("cuda:1") and ours.handle > 2
    assert cuda.as_stream(ours, "cuda:1") is ours
    with pytest.raises(ValueError, match="belongs to cuda:1"):
        cuda.as_stream(ours, CUDA0)
    assert cuda.as_stream(77, CUDA0).handle == 77
    with pytest.raises(ValueError):
        cuda.as_stream(-1, CUDA0)
    with pytest.raises(TypeError):
        cuda.as_stream(object(), CUDA0)
    core = fake_cuda.core.Stream(0x4242)
    wrapped = cuda.as_stream(core, CUDA0)
    assert wrapped.handle == 0x4242 and wrapped.core is core

    class TorchLike:  # a stream object by protocol, of another library
        def __cuda_stream__(self):
            return (0, 0x5151)

    obj = TorchLike()
    assert cuda.as_stream(obj, CUDA0).handle == 0x5151

    class NullStream:
        def __cuda_stream__(self):
            return (0, 0)

    assert cuda.as_stream(NullStream(), CUDA0).handle == 1  # the NULL stream is the legacy one
    assert ours.__cuda_stream__() == (0, ours.handle)
    assert "CUDAStream" in repr(ours) and "legacy" in repr(cuda.default_stream(CUDA0))


def test_fake_allocation_and_release(fake_cuda):
    before = len(fake_cuda.core.DeviceMemoryResource.freed)
    s = tx.create_stream("cuda:0")
    t = tx.empty((4, 4), "float32", device="cuda:0", stream=s)
    assert t.stream is s and t.data_ptr in fake_cuda.driver.blocks
    z = tx.empty((0,), device="cuda:0")
    assert z.data_ptr == 0
    del t, z
    assert tx.registry().collect(timeout=5)
    freed = fake_cuda.core.DeviceMemoryResource.freed[before:]
    assert len(freed) == 1 and freed[0].closed_on is s.core  # freed on the allocation stream
    with pytest.raises(ValueError, match="does not exist"):
        tx.empty((1,), device="cuda:2")


def test_fake_pinned_and_managed(fake_cuda):
    p = tx.empty((8,), "int32", device="cuda_host")
    host = np.from_dlpack(p)
    host[:] = np.arange(8)
    np.testing.assert_array_equal(np.from_dlpack(p, device="cpu"), np.arange(8))
    m = tx.empty((8,), "int32", device="cuda_managed")
    np.from_dlpack(m)[:] = 5
    address = m.data_ptr
    del m
    assert tx.registry().collect(timeout=5)
    assert ("cuMemFree", address) in fake_cuda.driver.calls


def test_fake_numpy_of_device_memory_is_refused_and_of_host_accessible_memory_is_a_view(fake_cuda):
    # As CuPy and PyTorch do: no implicit device-to-host copy; the error names the copy to make.
    d = tx.from_dlpack(np.arange(4, dtype=np.float32), device="cuda:0")
    for convert in (lambda: np.asarray(d), lambda: np.array(d), lambda: np.asarray(d, copy=True), lambda: d.numpy()):
        with pytest.raises(TypeError, match=r"cuda:0 memory.*tx\.from_dlpack\(t, device='cpu'\)"):
            convert()
    np.testing.assert_array_equal(tx.from_dlpack(d, device="cpu").numpy(), np.arange(4))  # the fix it names
    assert repr(d) == "tx.Tensor(shape=(4,), dtype=float32, device='cuda:0', strides=(1,))"  # never reads the device
    del d
    for device in ("cuda_host", "cuda_managed"):  # the host reads these: a view, no copy
        t = tx.empty((4,), "int32", device=device)
        a = np.asarray(t)
        assert a.ctypes.data == t.data_ptr
        a[:] = 3
        np.testing.assert_array_equal(t.numpy(), [3, 3, 3, 3])
        assert repr(t).startswith("tx.Tensor(shape=(4,)")  # repr never synchronises a device
        del t, a


def test_fake_copies_both_ways(fake_cuda):
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    for source in (a, a.transpose(2, 0, 1), a[:, ::-1, ::2], a[1]):
        t = tx.from_dlpack(source, device="cuda:0")
        assert str(t.device) == "cuda:0" and t.is_contiguous()
        back = tx.from_dlpack(t, device="cpu").numpy()
        np.testing.assert_array_equal(back, source)
    complex_source = (np.arange(12) + 1j).reshape(3, 4)
    t = tx.from_dlpack(complex_source, device="cuda:0")
    np.testing.assert_array_equal(np.from_dlpack(t, device="cpu"), complex_source)


def test_fake_strided_device_views(fake_cuda):
    """A strided tensor on the device (an import) copied device->device, device->CPU,
    CPU->strided device and into pinned memory: every copy path of the backend."""
    cuda = fake_cuda.backend
    base_t = tx.from_dlpack(np.arange(30, dtype=np.int64).reshape(5, 6), device="cuda:0")
    expected = np.arange(30, dtype=np.int64).reshape(5, 6)[::-1, ::2]
    view = _strided_view(base_t, (5, 3), (-6, 2), offset=24)
    np.testing.assert_array_equal(tx.from_dlpack(view, device="cpu").numpy(), expected)
    same = tx.from_dlpack(view, copy=True)
    assert same.is_contiguous() and str(same.device) == "cuda:0"
    np.testing.assert_array_equal(tx.from_dlpack(same, device="cpu").numpy(), expected)
    pinned = tx.from_dlpack(view, device="cuda_host")
    np.testing.assert_array_equal(np.from_dlpack(pinned, device="cpu"), expected)
    # into a strided destination, from the CPU and from the device
    dst = tx.from_dlpack(np.zeros((5, 6), np.int64), device="cuda:0")
    dst_view = _strided_view(dst, (5, 3), (-6, 2), offset=24)
    cuda.copy(dst_view, tx.from_dlpack(np.ascontiguousarray(expected)))
    np.testing.assert_array_equal(tx.from_dlpack(dst_view, device="cpu").numpy(), expected)
    cpu_dst = np.zeros((3, 5), np.int64)
    cuda.copy(tx.from_dlpack(cpu_dst.T), view)
    np.testing.assert_array_equal(cpu_dst.T, expected)


def _strided_view(t, shape, strides, offset):
    """A strided tx view over ``t``'s memory starting ``offset`` elements in (strides in
    elements), as an import of a framework's strided view would be."""
    import exchange.tensor as tensor_module

    return tensor_module.Tensor._make(t.record, t.data_ptr + offset * t.dtype.itemsize, shape, strides,
                                      t.dtype, False, t.stream)


def test_fake_handshake_records_then_waits(fake_cuda):
    cuda = fake_cuda.backend
    a, b = tx.create_stream("cuda:0"), tx.create_stream("cuda:0")
    t = tx.empty((16,), device="cuda:0", stream=a)
    capsule = t.__dlpack__(stream=b.handle, max_version=(1, 3))
    # the consumer wrapper wraps b's handle: its core stream is a new object; check the
    # record's streams and the wait on that handle
    streams = {s.handle for s in t.record.streams}
    assert {a.handle, b.handle} <= streams
    consumer = next(s for s in t.record.streams if s.handle == b.handle)
    assert consumer.core.waited and consumer.core.waited[-1].stream is a.core
    del capsule
    # same stream: no wait
    t.__dlpack__(stream=a.handle, max_version=(1, 3))
    assert not a.core.waited
    assert all(not s.core.waited for s in t.record.streams if s.handle == a.handle)
    # -1: no handshake; 0: refused
    t.__dlpack__(stream=-1, max_version=(1, 3))
    with pytest.raises(ValueError, match="ambiguous"):
        t.__dlpack__(stream=0)
    # a view on another stream waits for the data's stream too
    v = tx.from_dlpack(t, stream=b)
    assert b.core.waited and b.core.waited[-1].stream is a.core
    del v
    # a copy waits for the source's stream
    c = tx.empty((16,), device="cuda:0", stream=b)
    n = len(b.core.waited)
    from exchange.tensor import copy_into

    copy_into(c, t, b, cuda)  # the backend orders the copy; copy_into records its stream on both
    assert len(b.core.waited) == n + 1 and b.core.waited[-1].stream is a.core
    assert any(s is b for s in t.record.streams) and any(s is b for s in c.record.streams)


def test_fake_device_memory_frees_in_stream_order_without_the_reaper(fake_cuda, monkeypatch):
    # Issue 9 item 3: allocated device memory is freed at once, in stream order on the
    # device: the free stream (the allocation's, a) waits on an event recorded on b when
    # the last holder goes, then poison (debug) and cuMemFreeAsync run on a. No host
    # wait, no pending release, no reaper round trip.
    from exchange.devices.cuda import POISON_BYTE, POISON_ENV

    monkeypatch.setenv(POISON_ENV, "1")
    a, b = tx.create_stream("cuda:0"), tx.create_stream("cuda:0")
    t = tx.empty((256,), "uint8", device="cuda:0", stream=a)
    view = tx.from_dlpack(t, stream=b)  # b uses the memory ...
    b.core.busy()  # ... and its work has not finished
    record, address = t.record, t.data_ptr
    freed_before = len(fake_cuda.core.DeviceMemoryResource.freed)
    waited_before = len(a.core.waited)
    del t, view
    gc.collect()
    assert record.state == "released"
    assert tx.registry().stats()["pending_releases"] == 0
    freed = fake_cuda.core.DeviceMemoryResource.freed[freed_before:]
    assert len(freed) == 1 and freed[0].handle == address and freed[0].closed_on is a.core
    # a waits for b's work (an event recorded on b at the release), then frees
    new_waits = a.core.waited[waited_before:]
    assert any(e.stream is b.core and e.gate is b.core.gate for e in new_waits)
    poison = [c for c in fake_cuda.driver.calls if c[0] == "cuMemsetD8Async"]
    assert poison and poison[-1] == ("cuMemsetD8Async", a.handle, 256)  # on the free stream
    assert fake_cuda.driver.calls.index(poison[-1]) < fake_cuda.driver.calls.index(("close", address))
    assert set(bytes((ctypes.c_uint8 * 256).from_address(address))) == {POISON_BYTE}
    b.core.finish()


def test_fake_shared_device_memory_frees_in_stream_order_without_the_reaper(fake_cuda):
    # Issue 31 item 6: memory from the IPC-enabled pool (tx.empty(..., shared=True)) is
    # stream-ordered pool memory too, freed as above, even in a process whose only
    # device allocations are shared (this backend is new: _resource() never ran).
    a, b = tx.create_stream("cuda:0"), tx.create_stream("cuda:0")
    t = tx.empty((256,), "uint8", device="cuda:0", stream=a, shared=True)
    cuda = fake_cuda.backend
    assert 0 in cuda._ipc_resources and not cuda._device_resources  # from the IPC-enabled pool alone
    view = tx.from_dlpack(t, stream=b)
    b.core.busy()
    record, address = t.record, t.data_ptr
    freed_before = len(fake_cuda.core.DeviceMemoryResource.freed)
    waited_before = len(a.core.waited)
    del t, view
    gc.collect()
    try:
        assert record.state == "released", "shared device memory went to the reaper instead of freeing in stream order"
        assert tx.registry().stats()["pending_releases"] == 0
    finally:
        b.core.finish()  # a release left pending would fail the next tests
    freed = fake_cuda.core.DeviceMemoryResource.freed[freed_before:]
    assert len(freed) == 1 and freed[0].handle == address and freed[0].closed_on is a.core
    assert any(w.stream is b.core for w in a.core.waited[waited_before:])


def test_fake_per_thread_default_streams_of_two_threads_are_ordered(fake_cuda):
    # Issue 31 item 7: the per-thread default stream is handle 2 on every thread, yet a
    # different stream on each. Data written on one thread's and read on another's: the
    # reader's stream waits, on an event recorded through the legacy default stream
    # (which follows every thread's per-thread default stream); one thread's own
    # stream needs no wait. Its release on another thread frees through the legacy
    # stream too, after that thread's work.
    import threading

    cuda = fake_cuda.backend
    legacy, per_thread = fake_cuda.core.LEGACY_DEFAULT_STREAM, fake_cuda.core.PER_THREAD_DEFAULT_STREAM
    made = {}

    def produce():
        made["t"] = tx.empty((16,), "float32", device="cuda:0", stream=2)
        made["key"] = cuda.order_key(made["t"].stream)

    worker = threading.Thread(target=produce)
    worker.start()
    worker.join()
    t = made.pop("t")
    before = len(per_thread.waited)
    capsule = t.__dlpack__(stream=2, max_version=(1, 3))
    assert len(per_thread.waited) == before + 1, "the consumer's per-thread stream did not wait for the producer's"
    assert per_thread.waited[-1].stream is legacy
    del capsule
    mine = cuda.per_thread_stream(CUDA0)
    assert t.stream.handle == mine.handle == 2 and t.stream is not mine and t.stream.thread is worker
    assert made["key"] != cuda.order_key(mine)  # two threads' streams, two queues
    assert cuda.order_key(t.stream) == cuda.order_key(cuda.default_stream(CUDA0))  # reached through legacy
    own = tx.empty((16,), "float32", device="cuda:0", stream=2)  # this thread's own stream: no wait
    before = len(per_thread.waited)
    capsule = own.__dlpack__(stream=2, max_version=(1, 3))
    assert len(per_thread.waited) == before
    del capsule, own
    freed_before = len(fake_cuda.core.DeviceMemoryResource.freed)
    del t
    gc.collect()
    freed = fake_cuda.core.DeviceMemoryResource.freed[freed_before:]
    assert len(freed) == 1 and freed[0].closed_on is legacy


def test_fake_ipc_wait_opens_the_event_without_making_one(fake_cuda):
    # Issue 31 item 9: waiting on another process's event builds its descriptor from
    # the handle's bytes; no IPC event of this process is created (and thrown away) to
    # learn how.
    from exchange.channels.cuda import ipc

    cuda = ipc(fake_cuda.backend)  # the CUDA memory channel's side of the backend
    Event = fake_cuda.core.Event
    s = tx.create_stream("cuda:0")
    created, opened = Event.created, len(Event.opened)
    handle = bytes(range(64))
    cuda.wait(s, handle)
    cuda.wait(s, handle)
    assert Event.created == created, "ipc_wait made an event of its own"
    assert [(d.reserved, d.blocking_sync) for d in Event.opened[opened:]] == [(handle, False)] * 2
    assert len(s.core.waited) == 2
    with pytest.raises(ValueError, match="64 bytes"):
        cuda.wait(s, b"short")
    # what record sends is what wait takes
    event, sent = cuda.record(s)
    assert isinstance(sent, bytes) and len(sent) == 64


def test_fake_pinned_memory_release_waits_for_the_consumer_stream(fake_cuda):
    # Pinned (and managed) memory is host memory: its free must wait on the host for
    # the streams' events, so it keeps the reaper path.
    b = tx.create_stream("cuda:0")
    t = tx.empty((256,), "uint8", device="cuda_host")
    tx.record_stream(t, b)
    b.core.busy()
    record = t.record
    freed_before = len(fake_cuda.core.DeviceMemoryResource.freed)
    del t
    gc.collect()
    assert record.state == "releasing"
    assert tx.registry().stats()["pending_releases"] == 1
    assert tx.registry().stats()["pending_bytes"] == {"cuda_host": 256}
    assert not tx.registry().collect(timeout=0.05)
    assert len(fake_cuda.core.DeviceMemoryResource.freed) == freed_before
    b.core.finish()
    assert tx.registry().collect(timeout=5)
    assert record.state == "released"
    assert len(fake_cuda.core.DeviceMemoryResource.freed) == freed_before + 1


class FakeCudaProducer:
    """A producer of (fake) CUDA memory that records every ``__dlpack__`` call's
    keywords; ``refuses`` names keywords its signature lacks (TypeError, as Python
    raises for an unknown keyword)."""

    def __init__(self, tensor, refuses=()):
        self.tensor, self.refuses, self.calls = tensor, set(refuses), []

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        self.calls.append(dict(kwargs))
        bad = self.refuses & set(kwargs)
        if bad:
            raise TypeError(f"__dlpack__() got an unexpected keyword argument {sorted(bad)[0]!r}")
        kwargs.pop("stream", None)
        return self.tensor.__dlpack__(**kwargs)


def test_fake_handshake_always_passes_the_stream_as_an_int(fake_cuda):
    # Issue 9 item 5: 1 (legacy default) when the caller gave no stream, the handle of
    # the caller's stream, -1 passed through; never omitted, never 0.
    data = tx.empty((8,), device="cuda:0")
    s = tx.create_stream("cuda:0")
    p = FakeCudaProducer(data)
    t = tx.from_dlpack(p)
    assert p.calls[-1] == {"stream": 1, "max_version": (1, 3)}
    assert t.record is data.record  # our own export, taken back: one record
    t2 = tx.from_dlpack(p, stream=s)
    assert p.calls[-1] == {"stream": s.handle, "max_version": (1, 3)}
    t3 = tx.from_dlpack(p, stream=-1)
    assert p.calls[-1] == {"stream": -1, "max_version": (1, 3)} and t3.stream is None
    t4 = tx.from_dlpack(p, copy=False)
    assert p.calls[-1] == {"stream": 1, "max_version": (1, 3), "copy": False}
    for call in p.calls:
        assert type(call["stream"]) is int and call["stream"] != 0
    del t, t2, t3, t4


def test_fake_handshake_keeps_the_stream_when_newer_keywords_are_refused(fake_cuda):
    p = FakeCudaProducer(tx.empty((8,), device="cuda:0"), refuses={"max_version", "dl_device", "copy"})
    t = tx.from_dlpack(p)
    assert p.calls == [{"stream": 1, "max_version": (1, 3)}, {"stream": 1}]
    del t


def test_fake_producer_refusing_the_stream_gets_buffer_error(fake_cuda):
    data = tx.empty((8,), device="cuda:0")
    p = FakeCudaProducer(data, refuses={"stream"})
    before = tx.registry().stats()["live_records"]
    with pytest.raises(BufferError, match="FakeCudaProducer.__dlpack__ refused stream=1"):
        tx.from_dlpack(p)
    assert all(call.get("stream") == 1 for call in p.calls) and p.calls
    assert tx.registry().stats()["live_records"] == before  # nothing taken, nothing left


def test_cuda_producer_refused_before_its_dlpack_when_cuda_cannot_load():
    if _cuda_usable():
        pytest.skip("a CUDA device is usable here; this test is for machines without one")

    class Producer:
        calls = 0

        def __dlpack_device__(self):
            return (tx.DeviceType.kDLCUDA, 0)

        def __dlpack__(self, **kwargs):  # pragma: no cover - must not be reached
            Producer.calls += 1
            raise AssertionError("asked to export (and synchronise) for nothing")

    for stream in (None, -1):
        with pytest.raises(tx.BackendUnavailableError):
            tx.from_dlpack(Producer(), stream=stream)
    assert Producer.calls == 0


def test_fake_context_is_restored(fake_cuda):
    driver = fake_cuda.driver
    tx.empty((4,), device="cuda:1")
    driver.current = 1000  # another library made cuda:0 current
    s = tx.create_stream("cuda:1")
    s.record()
    assert driver.current == 1000, "the backend left cuda:1 current"
    driver.current = 0  # nothing current: the backend may leave its device current
    s.record()
    assert driver.current in (0, 1001)


# -- CUDA events from a pool (issue 17 item 3) ---------------------------------------------------


def test_fake_hops_and_releases_create_no_event_once_warm(fake_cuda):
    # Creating CUDA events on the hot path can stall the host for milliseconds
    # (sglang#39960): after one warm-up round, hops (the handshake's record-then-wait)
    # and releases (stream-ordered frees, and the reaper's events for pinned memory)
    # re-record events from the device's pool and create none.
    Event = fake_cuda.core.Event
    cuda = fake_cuda.backend
    a, b = tx.create_stream("cuda:0"), tx.create_stream("cuda:0")

    def round_trip():
        t = tx.empty((64,), "float32", device="cuda:0", stream=a)
        v = tx.from_dlpack(t, stream=b)  # hop: b waits on an event recorded on a
        capsule = t.__dlpack__(stream=b.handle, max_version=(1, 3))  # export hop to a consumer on b
        del capsule, v, t  # release: a waits on an event recorded on b, then frees
        p = tx.empty((64,), "float32", device="cuda_host")
        tx.record_stream(p, b)
        del p  # release through the reaper: an event on b, queried, then dropped
        gc.collect()
        assert tx.registry().collect(timeout=5)

    round_trip()  # warm-up: the pool fills
    created, counted = Event.created, cuda.events_created
    waits = len(a.core.waited)
    for _ in range(20):
        round_trip()
    assert Event.created == created, f"{Event.created - created} events created on the hot path once warm"
    assert cuda.events_created == counted
    # ... and the pooled events still order: every release made one wait on b's work
    # (b came in twice: our stream, and the export's wrapper of its handle)
    assert len(a.core.waited) == waits + 20 and all(w.stream.handle == b.handle for w in a.core.waited[waits:])
    assert tx.registry().stats()["pending_releases"] == 0


def test_fake_event_pool_never_reuses_an_event_someone_holds(fake_cuda):
    s = tx.create_stream("cuda:0")
    e = s.record()
    kept = e.core  # a caller keeps the cuda.core Event
    del e
    again = s.record()
    assert again.core is not kept, "an event still held elsewhere was recorded again"
    free = id(again.core)
    del again  # nobody else holds this one: it goes back and is recorded again next
    assert id(s.record().core) == free
    del kept


def test_fake_event_pool_is_bounded(fake_cuda):
    from exchange.devices.cuda import EVENT_POOL_SIZE

    s = tx.create_stream("cuda:1")
    events = [s.record() for _ in range(EVENT_POOL_SIZE + 10)]  # all alive at once: created
    del events
    pool = fake_cuda.backend._event_pools[1]
    assert len(pool) == EVENT_POOL_SIZE
    assert len(fake_cuda.backend._event_pools[0]) == 0  # per device


# -- the planted premature free (issue 17 item 2) --------------------------------------------------


def test_fake_unordered_free_switch_drops_the_stream_ordering(fake_cuda, monkeypatch, capfd):
    # The test-only switch that ci/gpu-check.sh sets for compute-sanitizer's plant: the
    # free goes on the allocation stream at once, without waiting for the stream that
    # still reads the memory. Without it (test above) the free stream waits for b.
    from exchange.devices.cuda import UNORDERED_FREE_ENV

    monkeypatch.setenv(UNORDERED_FREE_ENV, "1")
    a, b = tx.create_stream("cuda:0"), tx.create_stream("cuda:0")
    t = tx.empty((256,), "uint8", device="cuda:0", stream=a)
    view = tx.from_dlpack(t, stream=b)
    b.core.busy()  # b's reader has not finished
    address = t.data_ptr
    freed_before = len(fake_cuda.core.DeviceMemoryResource.freed)
    waited_before = len(a.core.waited)
    del t, view
    gc.collect()
    freed = fake_cuda.core.DeviceMemoryResource.freed[freed_before:]
    assert len(freed) == 1 and freed[0].handle == address and freed[0].closed_on is a.core
    assert a.core.waited[waited_before:] == [], "the planted free still waited for the reader's stream"
    b.core.finish()
    monkeypatch.delenv(UNORDERED_FREE_ENV)
    t = tx.empty((256,), "uint8", device="cuda:0", stream=a)  # switched off: ordered again
    view = tx.from_dlpack(t, stream=b)
    del t, view
    gc.collect()
    assert any(w.stream is b.core for w in a.core.waited[waited_before:])
    assert UNORDERED_FREE_ENV in capfd.readouterr().err or _said_before()


def _said_before() -> bool:
    from exchange.devices import cuda as cuda_module

    return bool(cuda_module._unordered_said)


# -- pinned memory that says kDLCPU (issue 17 fix 2) ----------------------------------------------


def test_fake_copy_from_cpu_typed_pinned_memory_has_read_its_source_on_return(fake_cuda):
    # A pinned PyTorch tensor's capsule says kDLCPU, and so does a NumPy view of pinned
    # memory: the library records the capsule's device (CPU). A copy from CPU memory
    # must have read its source when it returns (the caller may write the source next);
    # from page-locked pages the driver copies asynchronously, so the backend
    # synchronises the copy stream there (one host sync), and only there.
    cuda = fake_cuda.backend
    pinned = tx.empty((64,), "float32", device="cuda_host")
    # a plain NumPy array over the pinned block (as torch's pinned tensor is to us): kDLCPU
    host = np.ctypeslib.as_array((ctypes.c_float * 64).from_address(pinned.data_ptr))
    host[:] = np.arange(64, dtype=np.float32)
    as_cpu = tx.from_dlpack(host)
    assert as_cpu.__dlpack_device__() == (tx.DeviceType.kDLCPU, 0) and as_cpu.data_ptr == pinned.data_ptr
    before = cuda.host_syncs
    d = tx.from_dlpack(as_cpu, device="cuda:0")
    assert cuda.host_syncs == before + 1, "a copy from page-locked CPU-typed memory returned before reading it"
    np.testing.assert_array_equal(tx.from_dlpack(d, device="cpu").numpy(), np.arange(64, dtype=np.float32))
    # pageable memory: the driver stages it before returning, no sync
    before = cuda.host_syncs
    tx.from_dlpack(np.arange(64, dtype=np.float32), device="cuda:0")
    assert cuda.host_syncs == before
    # a strided destination from the page-locked source (the staged kernel path)
    dst = tx.from_dlpack(np.zeros((64, 2), np.float32), device="cuda:0")
    column = _strided_view(dst, (64,), (2,), offset=0)
    before = cuda.host_syncs
    cuda.copy(column, as_cpu)
    assert cuda.host_syncs == before + 1
    np.testing.assert_array_equal(tx.from_dlpack(dst, device="cpu").numpy()[:, 0], np.arange(64, dtype=np.float32))


def test_fake_bench_cuda_section_measures_the_hot_path(fake_cuda):
    # The bench's "cuda" section (exchange/cli/bench_cuda.py) over the fake backend: its
    # windows run, and what it counts is the backend's own: no event created and no host
    # sync once warm. The figures themselves come from a GPU run.
    from exchange.cli import bench, bench_cuda

    cfg = bench.Config(quick=True, device="cuda")
    details = bench_cuda.measure(cfg, {})["details"]
    assert "skipped" not in details, details
    assert details["events_created"] == 0 and details["host_syncs"] == 0
    for name in ("hop", "release"):
        figures = details[name]
        assert len(figures["window_median_us"]) == details["windows"] and figures["flatness"] >= 1.0
    assert "skipped" in details["chain"]  # no CuPy among the peers here
    lines = bench_cuda.format({"keys": {}, "details": details})
    assert lines[0].startswith("cuda hot path") and "events created 0" in lines[3]
    assert "skipped" in bench_cuda.measure(bench.Config(quick=True), {})["details"]  # --device cpu
