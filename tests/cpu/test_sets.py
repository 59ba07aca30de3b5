"""Sets (exchange/sets/): named, versioned tensor sets followed by other processes.

Every case runs real processes: readers and publishers are child interpreters started
here, each bounded by a timeout, speaking to the test through lines on stdout. Each test
gets a sets directory of its own (EXCHANGE_SETS_DIR); the second-user cases use the
default directory under a base of their own (XDG_RUNTIME_DIR) and need root (they switch
a child to user nobody). Children inherit EXCHANGE_PURE_PYTHON: CI runs the file on both
paths.
"""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import exchange as tx
from exchange.errors import ExchangeError, LifetimeError

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 60
NOBODY = 65534

#: What every child imports first. ``checked(snap)``: the version's checksum holds (its
#: "data" sums to its "sum"), else the child fails loudly.
PRELUDE = """
import json, os, sys, time, signal
import numpy as np
import exchange as tx
from exchange.errors import ExchangeError, LifetimeError
import exchange.sets
def say(*words):
    print(*words, flush=True)
def checked(snap, numbered=True):
    data = np.from_dlpack(snap["data"])
    total = int(np.from_dlpack(snap["sum"])[0])
    if int(data.sum()) != total or (numbered and int(data[0]) != snap.version * 1000):
        say("TORN", snap.version, int(data.sum()), total)
        sys.exit(3)
    return snap.version
def version(n, size=4096):
    data = np.full(size, n * 1000, dtype=np.int64)
    data[1:] = np.arange(1, size) % 97
    return {"data": data, "sum": np.array([data.sum()], dtype=np.int64)}
"""


def version(n: int, size: int = 4096) -> dict:
    data = np.full(size, n * 1000, dtype=np.int64)
    data[1:] = np.arange(1, size) % 97
    return {"data": data, "sum": np.array([data.sum()], dtype=np.int64)}


def checked(snap, numbered: bool = True) -> int:
    """The version's checksum holds (no torn read); ``numbered``: its content is the one
    published as its number (one publisher, numbering from 1)."""
    data = np.from_dlpack(snap["data"])
    assert int(data.sum()) == int(np.from_dlpack(snap["sum"])[0]), f"torn version {snap.version}"
    assert not numbered or int(data[0]) == snap.version * 1000
    return snap.version


@pytest.fixture(autouse=True)
def sets_dir(tmp_path, monkeypatch):
    d = tmp_path / "sets"
    monkeypatch.setenv("EXCHANGE_SETS_DIR", str(d))
    yield d
    import exchange.sets as sets

    left = list(sets._state().publishers.values())
    for s in sets.stats():  # what a failed test left published here
        if s["role"] == "publisher":
            sets.unpublish(s["name"])
    # A version a reader of this process let go is freed once the publisher's runtime
    # thread reads the release: wait for it, so that the next test counts no memory
    # file of this one (bounded: a hold a test keeps on purpose does not fail this).
    deadline = time.monotonic() + 10
    while any(p.versions for p in left) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class Child:
    """A child interpreter running PRELUDE + ``code``; ``line()`` reads its next line."""

    def __init__(self, code: str, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(code), *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=_env())
        import queue
        import threading

        self.lines: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def line(self, timeout: float = TIMEOUT) -> str:
        import queue

        try:
            text = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise AssertionError(f"child said nothing within {timeout} s: {self.proc.stderr.read()[-3000:]}") from None
        if text is None:
            self.proc.wait(TIMEOUT)
            raise AssertionError(f"child ended (rc {self.proc.returncode}): {self.proc.stderr.read()[-3000:]}")
        return text.strip()

    def _read(self) -> None:
        for text in self.proc.stdout:
            self.lines.put(text)
        self.lines.put(None)

    def send(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = TIMEOUT) -> tuple[int, str, str]:
        """Close its stdin, wait for its end: (exit status, what it said, its stderr)."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self.reader.join(timeout)
        out = []
        while not self.lines.empty():
            text = self.lines.get()
            if text is not None:
                out.append(text)
        return self.proc.returncode, "".join(out), self.proc.stderr.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(TIMEOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid


def _wait_for(cond, timeout: float = TIMEOUT, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        gc.collect()
        time.sleep(0.01)


def _publisher(name: str):
    import exchange.sets as sets

    return sets._state().publishers[name]


# -- names ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "x" * 65, "é", "a b"])
def test_a_bad_name_is_a_value_error(bad):
    with pytest.raises(ValueError, match="1-64 characters"):
        tx.publish(bad, version(1))
    with pytest.raises(ValueError):
        tx.subscribe(bad)


def test_a_directory_not_this_users_alone_is_refused(tmp_path, monkeypatch):
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    monkeypatch.setenv("EXCHANGE_SETS_DIR", str(open_dir))
    with pytest.raises(ExchangeError, match="0700"):
        tx.publish("x", version(1))
    link = tmp_path / "link"
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    link.symlink_to(private)
    monkeypatch.setenv("EXCHANGE_SETS_DIR", str(link))
    with pytest.raises(ExchangeError, match="symlink"):
        tx.subscribe("x")


def test_the_directory_is_made_private(sets_dir):
    tx.publish("made", version(1))
    assert (sets_dir.stat().st_mode & 0o777) == 0o700
    assert ((sets_dir / "made.sock").stat().st_mode & 0o777) == 0o600


# -- readers ----------------------------------------------------------------------------------------
READER = """
import sys
kind, name, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
sub = tx.subscribe(name)
say("READY")
seen = []
snap = sub.latest(timeout=60)
while True:
    if kind == "torch":
        import torch
        t = torch.from_dlpack(snap["data"])
        assert int(t[0]) == snap.version * 1000 and int(t.sum()) == int(torch.from_dlpack(snap["sum"])[0])
    elif kind == "jax":
        import jax.numpy as jnp
        t = jnp.from_dlpack(snap["data"])  # asks __dlpack__ for a legacy capsule
        assert int(t[0]) == snap.version * 1000
        assert int(t.sum()) == int(jnp.from_dlpack(snap["sum"])[0])
    checked(snap)
    assert all(snap[k].readonly for k in snap)
    seen.append(snap.version)
    if snap.version >= count:
        break
    snap = sub.next(timeout=60)
say("SEEN", json.dumps(seen))
"""


@pytest.mark.parametrize("kind", ["numpy", "torch", "jax"])
def test_readers_started_before_and_after_the_first_publish(kind):
    name = f"follow-{kind}"
    early = Child(READER, kind, name, "3")
    assert early.line() == "READY"
    time.sleep(0.2)  # subscribed, no publisher yet: its latest() waits
    v1 = tx.publish(name, version(1))
    assert v1.number == 1 and v1.name == name and set(v1.keys()) == {"data", "sum"}
    late = Child(READER, kind, name, "3")
    assert late.line() == "READY"
    _wait_for(lambda: len(_publisher(name).conns) == 2, what="both readers connected")
    time.sleep(0.2)
    tx.publish(name, version(2))
    time.sleep(0.2)
    tx.publish(name, version(3))
    for child in (early, late):
        words = child.line().split(None, 1)
        assert words[0] == "SEEN", words
        seen = json.loads(words[1])
        assert seen == sorted(set(seen)) and seen[-1] == 3
        rc, _, err = child.finish()
        assert rc == 0, err[-3000:]


def test_a_process_reads_its_own_set():
    with tx.subscribe("own") as sub:
        v = tx.publish("own", version(1))
        snap = sub.latest(timeout=10)
        assert checked(snap) == 1 and snap.name == "own"
        assert v.readers == [os.getpid()]
        t = snap["data"]
        snap.close()
        with pytest.raises(LifetimeError):
            snap["data"]
        assert v.readers == [os.getpid()]  # the tensor taken keeps the version
        del t
        _wait_for(lambda: v.readers == [], what="the hold let go")
        with pytest.raises(TimeoutError):
            sub.next(timeout=0.2)
        tx.publish("own", version(2))
        assert checked(sub.next(timeout=10)) == 2


def test_readers_tensors_are_read_only_and_the_kernel_enforces_it():
    tx.publish("sealed", version(1))
    code = """
    import ctypes
    snap = tx.subscribe(sys.argv[1]).latest(timeout=30)
    t = snap["data"]
    assert t.readonly and t.mutability == "readonly"
    a = np.from_dlpack(t)
    assert not a.flags.writeable
    import mmap
    fd = t._record._owner.fd  # the region's descriptor, as the reader holds it
    for how in (lambda: mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE),
                lambda: os.pwrite(os.open(f"/proc/self/fd/{fd}", os.O_RDWR), b"x", 0)):
        try:
            how()
            say("MAPPED_WRITABLE")
        except PermissionError:
            pass
    say("WRITING")
    ctypes.memset(t.data_ptr, 0, 8)  # past every flag: the kernel's mapping is read-only
    say("WROTE")
    """
    child = Child(code, "sealed")
    rc, out, err = child.finish()
    assert "WRITING" in out and "WROTE" not in out and "MAPPED_WRITABLE" not in out, (out, err[-3000:])
    assert rc == -signal.SIGSEGV or rc == -signal.SIGBUS, rc


def test_an_ordinary_read_only_tensor_keeps_the_legacy_refusal():
    a = np.arange(4.0)
    a.flags.writeable = False
    t = tx.from_dlpack(a)
    assert t.readonly is True
    with pytest.raises(BufferError, match="read-only"):
        t.__dlpack__()
    with tx.subscribe("legacy") as sub:
        tx.publish("legacy", version(1))
        snap = sub.latest(timeout=10)
        capsule = snap["data"].__dlpack__()  # sealed by the kernel: a legacy capsule goes
        assert type(capsule).__name__ == "PyCapsule"
        del capsule, snap


def test_tvm_ffi_and_onnx_runtime_read_a_version():
    tvm_ffi = pytest.importorskip("tvm_ffi")
    ort = pytest.importorskip("onnxruntime.capi._pybind_state")
    with tx.subscribe("others") as sub:
        tx.publish("others", {"w": np.arange(6, dtype=np.float32)})
        snap = sub.latest(timeout=10)
        # tvm-ffi: the C exchange API refuses read-only memory, its fallback asks __dlpack__() (legacy)
        assert np.from_dlpack(tvm_ffi.from_dlpack(snap["w"])).tolist() == list(range(6))
        assert ort.OrtValue.from_dlpack(snap["w"].__dlpack__()).shape() == [6]


# -- drafts ----------------------------------------------------------------------------------------
DRAFT_PUBLISHER = """
import torch
name = sys.argv[1]
for n in (1, 2, 3):
    d = tx.draft(name, {"data": ((4096,), "int64"), "sum": ((1,), "int64")})
    src = version(n)
    for key in d:
        torch.from_dlpack(d[key]).copy_(torch.from_numpy(src[key]))  # the trainer's own copy_
    v = d.publish()
    assert d["data"].readonly and v.number == n
    try:
        np.from_dlpack(d["data"])[0] = 1
        say("WRITABLE")
    except ValueError:
        pass
    say("PUBLISHED", n)
    del d, v  # the draft's tensors go: only readers keep the version now
    sys.stdin.readline()
"""


def test_a_publisher_writes_a_draft_with_pytorch_and_readers_take_it_without_a_copy():
    pub = Child(DRAFT_PUBLISHER, "drafted")
    sub = tx.subscribe("drafted")
    addresses = set()
    for n in (1, 2, 3):
        assert pub.line() == f"PUBLISHED {n}"
        snap = sub.next(timeout=30)
        assert checked(snap) == n
        addresses.add(snap["data"].data_ptr)
        del snap
        gc.collect()
        time.sleep(0.2)  # the release reaches the publisher (its thread reads it)
        pub.send("go")
    assert len(addresses) <= 2  # one mapping per region, reused
    rc, out, err = pub.finish()
    assert rc == 0 and "WRITABLE" not in out, err[-3000:]
    sub.close()


def test_copy_false_refuses_and_a_draft_publishes_without_a_copy():
    with pytest.raises(BufferError, match="copy"):
        tx.publish("nocopy", version(1), copy=False)
    d = tx.draft("nocopy", {"w": ((3,), "float32")})
    np.from_dlpack(d["w"])[:] = [1, 2, 3]
    v = tx.publish("nocopy", d)
    assert v.number == 1 and d["w"].readonly
    with pytest.raises(ExchangeError):
        d.publish()
    with tx.subscribe("nocopy") as sub:
        assert np.from_dlpack(sub.latest(timeout=10)["w"]).tolist() == [1, 2, 3]


def test_unpublish_with_a_draft_outstanding():
    fds_before = _memfds()
    d = tx.draft("drafty", {"w": ((1000,), "float64")})
    tx.unpublish("drafty")
    with pytest.raises(LifetimeError, match="unpublished"):
        d.publish()
    np.from_dlpack(d["w"])[:] = 1.0  # its memory stays mapped while its tensors live
    assert _memfds() == fds_before + 1
    del d
    gc.collect()
    assert _memfds() == fds_before  # then its region goes


# -- holds, reuse, bounds -------------------------------------------------------------------------
HOLDER = """
name = sys.argv[1]
sub = tx.subscribe(name)
old = sub.latest(timeout=30)
before = np.from_dlpack(old["data"]).copy()
say("HOLDING", old.version)
sys.stdin.readline()
assert np.array_equal(np.from_dlpack(old["data"]), before) and checked(old) == 1
say("UNCHANGED")
sys.stdin.readline()
del old
say("LET_GO")
sys.stdin.readline()
"""


def test_a_reader_holding_an_old_version_while_many_are_published():
    tx.publish("held", version(1))
    child = Child(HOLDER, "held")
    assert child.line() == "HOLDING 1"
    p = _publisher("held")
    first = p.versions[1]
    for n in range(2, 202):
        tx.publish("held", version(n))
        assert first.region.id not in {v.region.id for k, v in p.versions.items() if k != 1}
    assert p.readers(1) == [child.pid]
    # Regions reused, five at most: the held one, the newest, the one being written, and
    # the two the reader's subscription may hold a moment (the version offered to it and
    # the one before, let go once the reader hears of the newer).
    assert next(p.region_ids) <= 6
    child.send("check")
    assert child.line() == "UNCHANGED"
    child.send("drop")
    assert child.line() == "LET_GO"
    # Version 1 goes with the reader's drop; 200 goes once the reader's runtime thread has
    # heard of 201 (a thread of its own, which may still be reading the 200 offers).
    _wait_for(lambda: list(p.versions) == [201], what="version 1 and the offers before 201 let go")
    child.send("end")
    assert child.finish()[0] == 0


SPARE_READER = """
sub = tx.subscribe(sys.argv[1])
held = None
for cmd in sys.stdin:
    if cmd.strip() == "take":
        held = sub.next(timeout=30)  # (the version before is let go)
        say("TOOK", held.version)
    else:
        say("MAPPED", len(sub._conn.regions))
"""


def test_a_free_region_goes_after_a_while_here_and_in_the_readers(monkeypatch):
    # A region kept free for the next version is given back once unused for SPARE_IDLE_S:
    # closed here, and unmapped by the readers that kept a mapping of it.
    from exchange.sets import publisher

    monkeypatch.setattr(publisher, "SPARE_IDLE_S", 3.0)  # (the reader must answer within it, under load too)
    tx.publish("spare", version(1))
    p = _publisher("spare")
    child = Child(SPARE_READER, "spare")
    child.send("take")
    assert child.line() == "TOOK 1"
    tx.publish("spare", version(2))  # a second region: the reader holds version 1's
    child.send("take")
    assert child.line() == "TOOK 2"
    _wait_for(lambda: len(p.free) == 1, what="version 1's region free for reuse")
    child.send("mapped")
    assert child.line() == "MAPPED 2"  # the reader keeps the free region mapped meanwhile
    _wait_for(lambda: not p.free, what="the free region closed")
    deadline = time.monotonic() + TIMEOUT
    while True:
        child.send("mapped")
        if child.line() == "MAPPED 1" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    child.send("mapped")
    assert child.line() == "MAPPED 1"
    tx.publish("spare", version(3))  # a fresh region: the set works on
    child.send("take")
    assert child.line() == "TOOK 3"
    assert child.finish()[0] == 0


STALLED_READER = """
import threading
from exchange import runtime
sub = tx.subscribe(sys.argv[1])
gate = threading.Event()
held = None
for cmd in sys.stdin:
    if cmd.strip() == "take":
        held = sub.next(timeout=30)
        say("TOOK", held.version)
    elif cmd.strip() == "stall":  # the runtime's thread, which receives offers, waits
        runtime.loop().post(lambda: gate.wait(60))
        say("STALLED")
gate.set()
"""


def test_a_reader_that_does_not_read_pins_at_most_two_offers_and_then_takes_the_newest():
    # A reader whose runtime thread does not read is handed at most two versions it did
    # not take, which do not count against the bound; its next() then returns the newest
    # version published, not an offer that came before it.
    tx.publish("stalled", version(1), max_live_versions=2)
    p = _publisher("stalled")
    child = Child(STALLED_READER, "stalled")
    child.send("take")
    assert child.line() == "TOOK 1"
    child.send("stall")
    assert child.line() == "STALLED"
    for n in range(2, 12):
        tx.publish("stalled", version(n), when_full="raise")  # offers: never the bound
    with p.cond:
        offered = {k: v.offers.get(c) for k, v in p.versions.items() for c in v.offers if c.pid == child.proc.pid}
    assert offered == {2: 1, 3: 1}, offered
    child.send("take")  # (its own thread receives 2 and 3, lets 2 go, and waits for the newest)
    assert child.line() == "TOOK 11"
    _wait_for(lambda: sorted(p.versions) == [11], what="the offers let go")
    assert child.finish()[0] == 0


def test_the_bound_on_live_versions_waits_or_raises():
    with tx.subscribe("bounded") as sub:
        tx.publish("bounded", version(1), max_live_versions=2)
        a = sub.latest(timeout=10)
        tx.publish("bounded", version(2))
        b = sub.latest(timeout=10)
        assert (a.version, b.version) == (1, 2)
        with pytest.raises(ExchangeError, match="max_live_versions=2"):
            tx.publish("bounded", version(3), when_full="raise")
        with pytest.raises(TimeoutError):
            tx.publish("bounded", version(3), timeout=0.2)
        import threading

        threading.Timer(0.3, a.close).start()
        v3 = tx.publish("bounded", version(3), timeout=30)  # waits for the reader to let go
        assert v3.number == 3
        import exchange.sets as sets

        mine = {s["role"]: s for s in sets.stats() if s["name"] == "bounded"}
        assert mine["publisher"]["version"] == 3 and mine["publisher"]["live_versions"] == 2
        assert mine["publisher"]["readers"] == 1 and mine["publisher"]["nbytes"] == v3.nbytes
        assert mine["reader"]["version"] == 2


# -- publishers -------------------------------------------------------------------------------------
RACER = """
name, start = sys.argv[1], float(sys.argv[2])
time.sleep(max(0, start - time.time()))
try:
    tx.publish(name, version(1))
    say("WON")
except ExchangeError as exc:
    say("LOST", str(exc))
sys.stdin.readline()
"""


def test_two_publishers_racing_for_one_name():
    start = str(time.time() + 1.5)
    a, b = Child(RACER, "raced", start), Child(RACER, "raced", start)
    results = {a.pid: a.line(), b.pid: b.line()}
    won = [pid for pid, r in results.items() if r == "WON"]
    lost = [r for r in results.values() if r.startswith("LOST")]
    assert len(won) == 1 and len(lost) == 1, results
    assert f"process {won[0]}" in lost[0]
    with pytest.raises(ExchangeError, match=f"process {won[0]}"):
        tx.publish("raced", version(1))
    for c in (a, b):
        c.send("end")
        c.finish()


DYING = """
name = sys.argv[1]
tx.publish(name, version(1))
say("PUBLISHED")
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_dead_publishers_name_is_taken_over_and_its_readers_told():
    pub = Child(DYING, "taken")
    assert pub.line() == "PUBLISHED"
    sub = tx.subscribe("taken")
    snap = sub.latest(timeout=10)
    pub.send("die")
    pub.finish()
    with pytest.raises(LifetimeError, match=f"process {pub.pid}"):
        sub.next(timeout=10)
    assert checked(snap) == 1  # held tensors stay valid
    v = tx.publish("taken", version(1))  # the name is free: the kernel dropped the lock
    assert v.number == 1
    assert checked(sub.latest(timeout=10)) == 1  # the subscription follows the new publisher
    sub.close()


def test_a_forked_child_is_not_the_publisher():
    code = """
    tx.publish("forked", version(1))
    pid = os.fork()
    if pid == 0:
        try:
            tx.publish("forked", version(2))
            os._exit(1)
        except ExchangeError as exc:
            os._exit(0 if f"process {os.getppid()}" in str(exc) else 2)
    _, status = os.waitpid(pid, 0)
    say("CHILD", os.waitstatus_to_exitcode(status))
    sub = tx.subscribe("forked")
    say("STILL", checked(sub.latest(timeout=10)))
    """
    child = Child(code)
    assert child.line() == "CHILD 0"
    assert child.line() == "STILL 1"
    assert child.finish()[0] == 0


UNPUB_READER = """
name = sys.argv[1]
sub = tx.subscribe(name)
snap = sub.latest(timeout=30)
t = snap["data"]
say("HOLDING", snap.version)
sys.stdin.readline()
try:
    sub.next(timeout=10)
    say("NO_ERROR")
except LifetimeError as exc:
    say("LIFETIME", str(exc))
assert checked(snap) == 1
del snap, t
say("DONE")
sys.stdin.readline()
"""


def test_unpublish_with_readers_holding():
    tx.publish("unpub", version(1))
    p = _publisher("unpub")
    child = Child(UNPUB_READER, "unpub")
    assert child.line() == "HOLDING 1"
    tx.unpublish("unpub")
    with pytest.raises(ExchangeError):
        tx.unpublish("unpub")
    assert list(p.versions) == [1] and p.readers(1) == [child.pid]  # still held: not freed
    child.send("next")
    text = child.line()
    assert text.startswith("LIFETIME") and f"process {os.getpid()}" in text, text
    assert child.line() == "DONE"
    _wait_for(lambda: not p.versions, what="the last reader let go")
    assert tx.publish("unpub", version(1)).number == 1  # the name is free again
    child.send("end")
    assert child.finish()[0] == 0


def test_junk_from_a_reader_ends_its_connection_and_serving_goes_on(sets_dir):
    import pickle
    import socket

    tx.publish("junk", version(1))
    for junk in (b"junk", b'["take", -1, 0]', b'["take", 1]', b'["release", true]', b"[" * 60000,
                 pickle.dumps({"take": 1}), b'["steal", 1, 0]'):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(10)
        s.connect(str(sets_dir / "junk.sock"))
        s.send(junk)
        assert s.recv(1 << 16).startswith(b'["counter",')  # sent to every reader on arrival
        assert s.recv(1 << 16) == b"", junk  # closed by the publisher, nothing answered
        s.close()
    with tx.subscribe("junk") as sub:
        assert checked(sub.latest(timeout=10)) == 1


@pytest.mark.parametrize("entries", [
    [["a", "float32", [4], 0], ["a", "float32", [4], 64]],       # a key twice
    [["a", "float32", [100], 0]],                                # past the version's bytes
    [["a", "float32", [4], 8]],                                  # not aligned
    [["a", "no-such-dtype", [4], 0]],
    [["a", "float32", [-1], 0]],
    [["a", "float32", [2 ** 62, 2 ** 62], 0]],
    [["", "float32", [4], 0]],
    [["a", "float32", "4", 0]],
    "not a list of entries",
])
def test_a_malformed_version_is_refused(entries):
    from exchange.sets import wire

    with pytest.raises(ValueError):
        if not isinstance(entries, list):
            wire.check_reply(["version", 1, 1, 1, 65536, 64, 1, entries])
        wire.check_entries(entries, 64)


def test_malformed_replies_are_refused():
    from exchange.sets import wire

    for m in (["version", 1, 1, 1, 64, 65536, 1, None], ["version", 1, 1, 1, 65536, 64, 1], ["gone", 1, 2],
              ["version", True, 1, 1, 65536, 64, 1, None], {"version": 1}, ["other"]):
        with pytest.raises(ValueError):
            wire.check_reply(m)


# -- another user -----------------------------------------------------------------------------------
OTHER_USER = """
import socket, fcntl
uid, target = int(sys.argv[1]), sys.argv[2]
os.setgroups([]); os.setgid(uid); os.setuid(uid)
out = {}
def attempt(what, fn):
    try:
        fn()
        out[what] = "ok"
    except Exception as exc:
        out[what] = type(exc).__name__
attempt("list", lambda: os.listdir(target))
def read():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(os.path.join(target, "secret.sock"))
attempt("read", read)
attempt("lock", lambda: os.open(os.path.join(target, "secret.lock"), os.O_RDWR))
os.environ["EXCHANGE_SETS_DIR"] = target
attempt("subscribe", lambda: tx.subscribe("secret").latest(timeout=1))
attempt("publish", lambda: tx.publish("secret", version(1)))
attempt("squat", lambda: tx.publish("other", version(1)))
say(json.dumps(out))
"""


def _require_root():
    if os.geteuid() != 0:
        pytest.skip("another user's attempts need two users: this test runs as root only")


def test_another_user_can_neither_list_read_publish_nor_squat(tmp_path, monkeypatch):
    _require_root()
    base = tmp_path / "run"
    base.mkdir()
    base.chmod(0o1777)  # as /tmp is
    tmp_path.chmod(0o755)
    monkeypatch.delenv("EXCHANGE_SETS_DIR")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    import exchange.sets.names as names

    tx.publish("secret", version(1))
    target = names.directory()
    child = Child(OTHER_USER, str(NOBODY), target)
    out = json.loads(child.line())
    assert child.finish()[0] == 0
    assert out == {"list": "PermissionError", "read": "PermissionError", "lock": "PermissionError",
                   "subscribe": "PermissionError", "publish": "PermissionError", "squat": "PermissionError"}, out
    with tx.subscribe("secret") as sub:
        assert checked(sub.latest(timeout=10)) == 1  # untouched


def test_a_directory_planted_by_another_user_is_refused(tmp_path, monkeypatch):
    _require_root()
    base = tmp_path / "run"
    base.mkdir()
    base.chmod(0o1777)
    tmp_path.chmod(0o755)
    planted = base / f"tensor-exchange-{os.getuid()}"
    planted.mkdir(mode=0o700)
    os.chown(planted, NOBODY, NOBODY)  # as if nobody made it first
    monkeypatch.delenv("EXCHANGE_SETS_DIR")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    with pytest.raises(ExchangeError, match="owned by uid 65534"):
        tx.publish("squatted", version(1))
    with pytest.raises(ExchangeError, match="owned by uid 65534"):
        tx.subscribe("squatted")


# -- chaos ------------------------------------------------------------------------------------------
CHAOS_READER = """
import random
name, seed = sys.argv[1], int(sys.argv[2])
rng = random.Random(seed)
sub = tx.subscribe(name)
held = []
say("READY")
while True:
    try:
        snap = sub.next(timeout=30)
    except LifetimeError:
        continue  # the publisher died: follow the next one
    checked(snap)
    held.append(snap)
    if len(held) > rng.randint(0, 3):
        checked(held.pop(rng.randrange(len(held))))
    time.sleep(rng.random() * 0.01)
"""

CHAOS_PUBLISHER = """
import random
name, seed, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)
while True:
    try:
        tx.publish(name, version(start), timeout=30, max_live_versions=16)
        break
    except ExchangeError:
        time.sleep(0.01)  # the previous publisher's lock is not dropped yet
say("PUBLISHING")
n = start
while True:
    n += 1
    if rng.random() < 0.5:
        d = tx.draft(name, {"data": ((4096,), "int64"), "sum": ((1,), "int64")}, timeout=30)
        src = version(n)
        np.from_dlpack(d["data"])[:] = src["data"]
        np.from_dlpack(d["sum"])[:] = src["sum"]
        d.publish()
        del d
    else:
        tx.publish(name, version(n), timeout=30)
    time.sleep(rng.random() * 0.005)
"""


def _memfds() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:tensor-exchange")
        except FileNotFoundError:  # (the listing's own descriptor)
            pass
    return count


def test_chaos_killing_readers_at_random_points_leaves_the_publisher_whole():
    seed = int(os.environ.get("EXCHANGE_CHAOS_SEED", "1234"))
    print(f"seed {seed} (EXCHANGE_CHAOS_SEED)")  # shown with a failure
    rng = random.Random(seed)
    fds_before = _memfds()
    # Three readers holding up to 3 versions each (and the one they are taking): a bound
    # below that would make the publisher wait for readers that wait for it.
    tx.publish("chaos", version(1), max_live_versions=16)
    p = _publisher("chaos")
    readers = [Child(CHAOS_READER, "chaos", str(seed + i)) for i in range(3)]
    for r in readers:
        assert r.line() == "READY"
    n = 1
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        n += 1
        if rng.random() < 0.5:
            d = tx.draft("chaos", {"data": ((4096,), "int64"), "sum": ((1,), "int64")}, timeout=30)
            src = version(n)
            np.from_dlpack(d["data"])[:] = src["data"]
            np.from_dlpack(d["sum"])[:] = src["sum"]
            d.publish()
            del d
        else:
            tx.publish("chaos", version(n), timeout=30)
        if rng.random() < 0.02:  # a reader dies wherever it was: taking, holding, releasing
            i = rng.randrange(len(readers))
            readers[i].proc.send_signal(signal.SIGKILL)
            rc, _, err = readers[i].finish()
            assert rc == -signal.SIGKILL, err[-3000:]  # (3: a torn read)
            readers[i] = Child(CHAOS_READER, "chaos", str(rng.randrange(1 << 30)))
            assert readers[i].line() == "READY"
        time.sleep(rng.random() * 0.003)
    for r in readers:
        assert r.proc.poll() is None, r.proc.stderr.read()[-3000:]  # no torn read
        r.proc.send_signal(signal.SIGKILL)
        r.finish()
    gc.collect()
    _wait_for(lambda: list(p.versions) == [n] and not p.conns, what="every dead reader's holds dropped")
    assert p.reserved == 0
    regions = 1 + len(p.free)
    # every region accounted for (in use, or free), and the page of the newest version's number
    assert _memfds() - fds_before == regions + 1
    tx.unpublish("chaos")
    _wait_for(lambda: _memfds() == fds_before, what="the regions closed after unpublish")


def test_chaos_killing_publishers_at_random_points_leaves_the_reader_whole():
    seed = int(os.environ.get("EXCHANGE_CHAOS_SEED", "4321"))
    print(f"seed {seed} (EXCHANGE_CHAOS_SEED)")  # shown with a failure
    rng = random.Random(seed)
    records_before = tx.registry().stats()["live_records"]
    sub = tx.subscribe("chaos2")
    held, seen, start = [], 0, 1
    for round_ in range(4):
        pub = Child(CHAOS_PUBLISHER, "chaos2", str(seed + round_), str(start))
        assert pub.line() == "PUBLISHING"
        kill_at = time.monotonic() + rng.random() * 1.5
        while time.monotonic() < kill_at:
            try:
                snap = sub.next(timeout=10)
            except LifetimeError:
                break
            assert checked(snap, numbered=False) > 0
            seen += 1
            held.append(snap)
            if len(held) > 3:
                held.pop(rng.randrange(len(held)))
        pub.proc.send_signal(signal.SIGKILL)
        pub.finish()
        for snap in held:
            checked(snap, numbered=False)  # a dead publisher's versions stay valid and whole
        start += 100000
    assert seen > 0
    for snap in held:
        checked(snap, numbered=False)
    del held, snap
    sub.close()
    gc.collect()
    _wait_for(lambda: tx.registry().stats()["live_records"] == records_before, what="every record released")


def test_the_spare_delay_is_a_setting_and_a_bad_one_is_said():
    code = "import exchange.sets.publisher as p; print(p.SPARE_IDLE_S)"
    for value, want, warned in (("2.5", "2.5", False), ("0", "0.0", False), ("abc", "10.0", True),
                                ("-1", "10.0", True), ("nan", "10.0", True)):
        env = {**_env(), "EXCHANGE_SETS_SPARE_S": value}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip() == want, (value, proc.stdout)
        assert ("EXCHANGE_SETS_SPARE_S" in proc.stderr) is warned, (value, proc.stderr)
