"""tx.trace(): the Chrome trace event file a real chain writes, checked against the format
(required fields, begin and end matched, times monotonic, every flow's two ends) and
against the run it recorded (a span per stage per batch, the hops of ChainResult, each
record's life, stream-ordered releases, other processes' holds)."""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

import exchange as tx
from exchange import tracing
from trace_format import check_format, spans_inside

def _four_framework_chain():
    pytest.importorskip("onnxruntime")
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    from exchange.cli import demo

    rng = np.random.default_rng(0)
    layers = ((rng.standard_normal((64, 8), dtype=np.float32), rng.standard_normal(8, dtype=np.float32)),
              (rng.standard_normal((8, 10), dtype=np.float32), rng.standard_normal(10, dtype=np.float32)))
    weights = demo.MLPWeights(layers=layers, input_scale=1 / 16)
    session = demo.make_session(demo.build_onnx_model(weights, scale_input=False), threads=1)
    return demo.build_chain(session, weights), rng


@pytest.mark.parametrize("max_in_flight", [1, 2])
def test_a_real_four_framework_chain_traces_each_stage_hop_and_record(tmp_path, max_in_flight):
    chain, rng = _four_framework_chain()
    chain.max_in_flight = max_in_flight if chain._pipelined else 1
    batches = [rng.integers(0, 17, size=(6, 64)).astype(np.float32) for _ in range(3)]
    path = tmp_path / "run.json"
    with tx.trace(path) as recording:
        run = chain.run(batches)
        outputs = [np.asarray(o[0]) if isinstance(o, tuple) else o for o in run.outputs]
        del outputs
        run.outputs.clear()
    stages = list(chain.stages)
    chain.close()
    doc = json.loads(path.read_text())
    events = check_format(doc)
    spans_inside(events)
    assert doc["otherData"]["dropped_entries"] == recording.dropped == 0

    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    per_stage = Counter(names[e["tid"]] for e in spans)
    assert per_stage == {f"stage {k}: {s.name} ({s.framework})": len(batches) for k, s in enumerate(stages)}
    assert [s.framework for s in stages] == ["numpy", "onnxruntime", "torch", "jax"]
    assert sorted(e["args"]["batch"] for e in spans) == sorted(list(range(len(batches))) * 4)

    hops = [e["args"] for e in events if e["ph"] == "i" and e["cat"] == "hop"]
    expected = [h for batch in run.batch_hops for h in batch]
    key = lambda h: (h["from"], h["to"], h["bytes"], h["shared"])  # noqa: E731
    assert sorted(map(key, hops)) == sorted(map(key, expected))
    flows = [e for e in events if e["ph"] == "s"]
    assert len(flows) == len(batches) * 3  # stage k -> k+1, per batch

    records = [e for e in events if e["ph"] == "b" and e["cat"] == "record"]
    assert records and all({"id", "bytes", "kind", "origin"} <= set(e["args"]) for e in records)
    assert any(e["args"]["origin"].startswith("imported from") for e in records)
    ended = {e["id2"]["local"] for e in events if e["ph"] == "e" and e["cat"] == "record"}
    assert {e["id2"]["local"] for e in records} <= ended
    live = [e for e in events if e["ph"] == "C" and e["name"] == "live bytes"]
    assert len(live) == len(batches) and all(e["args"].get("cpu", 0) > 0 for e in live)


def test_stream_ordered_releases_show_on_their_streams_track(tmp_path):
    s = tx.create_stream("cpu")
    gate = __import__("threading").Event()
    s.submit(gate.wait, 10)
    with tx.trace(None) as recording:
        t = tx.from_dlpack(np.ones(1000), stream=s)
        rid = tx.registry().snapshot()[-1].id
        del t
        assert tx.registry().stats()["pending_releases"] >= 1
        gate.set()
        tx.registry().collect(timeout=10)
    s.close()
    events = check_format({"traceEvents": recording.events(), "displayTimeUnit": "ms", "otherData": {}})
    release = [e for e in events if e.get("cat") == "release" and e["id2"]["local"] == rid]
    assert [e["ph"] for e in release] == ["b", "e"]
    assert release[0]["name"] == f"release on {tracing._stream_name(s)}"
    assert release[1]["ts"] > release[0]["ts"]
    pending = [e for e in events if e["ph"] == "C" and e["name"] == "pending bytes"]
    assert any(e["args"].get("cpu", 0) >= 8000 for e in pending)


def test_records_alive_at_the_end_are_closed_there_and_said_so():
    with tx.trace(None) as recording:
        kept = tx.empty(16, "float32")
    events = recording.events()
    end = [e for e in events if e["ph"] == "e" and e["cat"] == "record"]
    assert len(end) == 1 and end[0]["args"] == {"alive_at_end": True}
    del kept


def test_the_ring_drops_the_oldest_and_says_how_many():
    with tx.trace(None, capacity=10) as recording:
        for _ in range(20):
            t = tx.from_dlpack(np.zeros(1))
            del t
    assert recording.dropped == recording.dropped == 30  # 40 record events, 10 kept; reading counts nothing
    events = recording.events()
    assert events[2]["name"] == "30 entries dropped (ring of 10)"


def test_bad_paths_and_arguments_fail_before_any_work(tmp_path):
    with pytest.raises(FileNotFoundError, match="cannot write the trace to .*give a path"):
        with tx.trace(tmp_path / "missing" / "run.json"):
            pytest.fail("the block must not run")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        with tx.trace(tmp_path):
            pytest.fail("the block must not run")
    with pytest.raises(ValueError, match="capacity must be an int from 1"):
        tx.trace(capacity=0)
    with tx.trace(None):
        with pytest.raises(RuntimeError, match="already recording"):
            tx.trace(None).start()
    assert tracing.active() is None


def test_tracing_off_leaves_no_hook_on(tmp_path):
    """After a trace, the registry's creation note is off again (no cost while off)."""
    with tx.trace(None):
        pass
    assert tracing.active() is None
    assert tx.registry()._trackers == 0


def _hold_and_report(q_in, q_out):
    t = q_in.get()
    q_out.put(float(np.from_dlpack(t).sum()))
    q_in.get()  # hold until told to let go
    del t


def test_another_process_holds_show_as_held_by_that_process():
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_hold_and_report, args=(q_in, q_out))
    child.start()
    try:
        with tx.trace(None) as recording:
            t = tx.empty(256, "float32", shared=True)
            np.from_dlpack(t)[:] = 1.0
            q_in.put(t)
            assert q_out.get(timeout=60) == 256.0
            q_in.put(None)
            child.join(timeout=60)
            tx.registry().collect(timeout=10)
        events = recording.events()
    finally:
        if child.is_alive():
            child.kill()
    held = [e for e in events if e.get("cat") == "remote"]
    assert [e["ph"] for e in held] == ["b", "e"]
    assert held[0]["name"] == f"held by process {child.pid}" and held[0]["args"]["pid"] == child.pid


def _read_set_traced(name, q_out):
    """A reader of the set ``name`` under its own trace: take the newest version, read
    it, let it go; report the sum and the trace's set events."""
    with tx.trace(None) as recording:
        with tx.subscribe(name) as sub:
            snap = sub.latest(timeout=60)
            total = float(np.from_dlpack(snap["w"]).sum())
            snap.close()
            del snap
        tx.registry().collect(timeout=10)
    q_out.put((total, [e for e in recording.events() if e.get("cat") == "set"]))


def test_a_set_publish_and_each_readers_take_and_release_are_traced():
    """The publisher's trace shows each publish (copied, then a draft's without a copy);
    a reader process's own trace shows its take of the version and the release, as one
    span naming the version and the publisher."""
    name = f"tx-trace-{os.getpid()}"
    ctx = mp.get_context("spawn")
    q_out = ctx.Queue()
    try:
        with tx.trace(None) as recording:
            tx.publish(name, {"w": np.full(256, 2.0, dtype=np.float32)})
            draft = tx.draft(name, {"w": ((256,), "float32")})
            np.from_dlpack(draft["w"])[:] = 1.0
            version = draft.publish()
            del draft
            child = ctx.Process(target=_read_set_traced, args=(name, q_out))
            child.start()
            total, reader_events = q_out.get(timeout=120)
            child.join(timeout=60)
        events = [e for e in recording.events() if e.get("cat") == "set"]
    finally:
        tx.unpublish(name)
    assert total == 256.0
    published = [e for e in events if e["ph"] == "i"]
    assert [e["name"] for e in published] == [f"publish {name}"] * 2
    assert [(e["args"]["version"], e["args"]["copied"]) for e in published] == [(1, True), (2, False)]
    assert published[1]["args"]["bytes"] == version.nbytes and published[1]["args"]["tensors"] == 1
    held = [e for e in reader_events if e["ph"] in ("b", "e")]
    assert [e["ph"] for e in held] == ["b", "e"], reader_events
    assert held[0]["name"] == f"set {name} held" and held[0]["args"]["version"] == 2
    assert held[0]["args"]["publisher"] == os.getpid() and "held_at_end" not in held[1].get("args", {})
    assert held[0]["ts"] <= held[1]["ts"]


@pytest.mark.once_per_ci
def test_demo_trace_option_writes_a_trace_and_refuses_a_bad_path(tmp_path):
    pytest.importorskip("sklearn")
    path = tmp_path / "demo.json"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "exchange", "demo", "--report", "json", "--batches", "3",
                           "--device", "cpu", "--trace", str(path)], capture_output=True, text=True, timeout=240,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert "trace written to" in proc.stderr
    events = check_format(json.loads(path.read_text()))
    assert Counter(e["name"] for e in events if e["ph"] == "X") == {"scale": 3, "mlp": 3, "softmax": 3, "argmax": 3}
    bad = subprocess.run([sys.executable, "-m", "exchange", "demo", "--trace", str(tmp_path / "no" / "x.json")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "cannot write the trace" in bad.stderr and "Traceback" not in bad.stderr


NVTX_CHILD = r"""
import sys, threading, numpy as np, exchange as tx
from exchange import tracing
chain = tx.Chain([tx.Stage(lambda x: x * 2.0, framework="numpy", name="double")], max_in_flight=1)
out = chain.run([np.ones(4)]).outputs[0]
assert float(np.from_dlpack(out).sum()) == 8.0
s = tx.create_stream("cpu")
t = tx.from_dlpack(np.ones(8), stream=s)
del t
tx.registry().collect(timeout=10)
s.close()
print(chain._nvtx is not None, "nvtx" in sys.modules, tracing._registry._NVTX is not None)
"""


@pytest.mark.parametrize("forced", [False, True])
def test_nvtx_ranges_only_where_asked_and_importable(forced):
    """EXCHANGE_NVTX=1 (or a profiler listening) with nvtx importable: the chain's stages
    and the stream-ordered releases go through NVTX ranges and still run; otherwise nvtx
    is not even imported (on the CPU, with no profiler attached)."""
    if forced:
        pytest.importorskip("nvtx")
    env = dict(os.environ, EXCHANGE_NVTX="1" if forced else "0")
    proc = subprocess.run([sys.executable, "-c", NVTX_CHILD], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == (["True", "True", "True"] if forced else ["False", "False", "False"])


EXIT_CHILD = r"""
import threading, numpy as np, exchange as tx
recording = tx.trace(None)
recording.start()
kept = [tx.from_dlpack(np.ones(64)) for _ in range(100)]
s = tx.create_stream("cpu")
pending = [tx.from_dlpack(np.ones(64), stream=s) for _ in range(50)]
def drop(ts):
    ts.clear()
threads = [threading.Thread(target=drop, args=(pending,)), threading.Thread(target=drop, args=(kept[:50],))]
for t in threads: t.start()
for t in threads: t.join()
print(len(recording.events()) > 0)
# exits with the trace still recording, records alive and a host stream open
"""


def test_a_trace_left_recording_at_exit_ends_quietly():
    """Records released by other threads while a trace records, then the interpreter
    exits with the trace still on: the notes stop at finalisation; no error, no
    "Exception ignored" from a deleter."""
    proc = subprocess.run([sys.executable, "-X", "dev", "-c", EXIT_CHILD], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


FORK_CHILD = r"""
import json, os, sys, numpy as np, exchange as tx
from exchange import tracing
path = sys.argv[1]
with tx.trace(path):
    a = tx.from_dlpack(np.zeros(4))          # 32 bytes, the parent's
    pid = os.fork()
    if pid == 0:                              # the child: not recording, never writes the file
        b = tx.from_dlpack(np.zeros(500))
        ok = tracing.active() is None and tx.registry()._trackers == 0
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    c = tx.from_dlpack(np.zeros(6))          # 48 bytes, the parent's
events = json.load(open(path))["traceEvents"]
sizes = sorted(e["args"]["bytes"] for e in events if e["ph"] == "b" and e["cat"] == "record")
assert sizes == [32, 48], sizes
assert {e["pid"] for e in events} == {os.getpid()}
print("ok")
"""


def test_a_forked_child_neither_records_into_nor_writes_the_parents_trace(tmp_path):
    proc = subprocess.run([sys.executable, "-c", FORK_CHILD, str(tmp_path / "fork.json")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_a_refused_trace_makes_no_file_and_the_file_is_made_empty_at_the_start(tmp_path):
    with tx.trace(None):
        with pytest.raises(RuntimeError, match="already recording"):
            tx.trace(tmp_path / "nested.json").start()
    assert not (tmp_path / "nested.json").exists()
    t = tx.trace(tmp_path / "later.json")
    t.start()
    assert (tmp_path / "later.json").read_bytes() == b""  # opened before any work, written when it ends
    t.stop()
    t.write(tmp_path / "later.json")
    assert json.loads((tmp_path / "later.json").read_text())["traceEvents"]
    with pytest.raises(ValueError, match="capacity must be an int from 1"):
        tx.trace(capacity=10 ** 30)


def test_a_fifo_or_a_link_as_the_path_is_refused_before_any_work(tmp_path):
    """A FIFO is refused at once (opening it would block); a symbolic link, dangling or
    not, too: a trace never writes through one."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        tx.trace(fifo).start()
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "target.json")
    with pytest.raises(OSError, match="it is a symbolic link"):
        tx.trace(link).start()
    assert link.is_symlink() and not (tmp_path / "target.json").exists()
    with tx.trace(None) as recording:
        pass
    with pytest.raises(OSError, match="it is a symbolic link"):
        recording.write(link)
    assert not (tmp_path / "target.json").exists()
    assert tracing.active() is None


OTHER_UID = 54321  # a uid no account has: the "other user" of the tests below


def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip(f"making a file of another user needs root (running as uid {os.geteuid()})")


@pytest.fixture
def sticky(tmp_path):
    """A sticky folder anyone may write in, as /tmp is."""
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o1777)
    return folder


def test_another_users_link_to_a_private_file_is_refused_before_the_work(sticky, tmp_path):
    """Another user plants ``run.json -> a private file`` in a folder such as /tmp: the
    trace is refused when it starts (the block never runs) and the file is unchanged;
    also when the link is planted after the trace started (the file was opened then)."""
    private = tmp_path / "private"
    private.write_text("secret")
    private.chmod(0o600)
    path = sticky / "run.json"
    path.symlink_to(private)
    if os.geteuid() == 0:
        os.lchown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(OSError, match="symbolic link") as info:
        with tx.trace(path):
            pytest.fail("the block must not run")
    assert info.value.errno == errno.ELOOP
    assert private.read_text() == "secret" and private.stat().st_mode & 0o777 == 0o600
    path.unlink()
    with tx.trace(path):  # opened here; a link put there meanwhile changes nothing
        os.rename(path, sticky / "moved.json")
        path.symlink_to(private)
    assert private.read_text() == "secret"
    assert json.loads((sticky / "moved.json").read_text())["traceEvents"]


def test_another_users_file_or_a_hard_link_is_refused_before_the_work(sticky, tmp_path):
    """A file another user made beforehand at the path (they could read what is written
    into it) is refused, as is a file with another name (a hard link to a private file)."""
    _require_root()
    planted = sticky / "run.json"
    planted.write_text("theirs")
    planted.chmod(0o666)
    os.chown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(PermissionError, match=rf"belongs to uid {OTHER_UID}, not to this process's user"):
        with tx.trace(planted):
            pytest.fail("the block must not run")
    assert planted.read_text() == "theirs"
    private = tmp_path / "private"
    private.write_text("secret")
    linked = sticky / "linked.json"
    os.link(private, linked)
    with pytest.raises(PermissionError, match="2 hard links"):
        tx.trace(linked).start()
    assert private.read_text() == "secret"
    assert tracing.active() is None


def test_a_new_trace_file_is_made_0600_and_an_own_file_keeps_its_mode(tmp_path):
    old = os.umask(0o022)
    try:
        with tx.trace(tmp_path / "new.json"):
            tx.from_dlpack(np.zeros(4))
        own = tmp_path / "own.json"
        own.write_text("x" * 100_000)  # longer than the trace: nothing of it is left
        own.chmod(0o644)
        with tx.trace(own):
            pass
    finally:
        os.umask(old)
    assert (tmp_path / "new.json").stat().st_mode & 0o777 == tracing.FILE_MODE == 0o600
    assert json.loads((tmp_path / "new.json").read_text())["traceEvents"]
    assert own.stat().st_mode & 0o777 == 0o644
    assert json.loads(own.read_text())["otherData"]["producer"] == "tensor-exchange"


def test_a_link_of_another_user_among_the_folders_of_the_path_is_refused(sticky, tmp_path):
    """``O_NOFOLLOW`` covers the last name only: with ``shared/traces`` another user's link
    to a private folder (a sticky folder as /tmp is; fs.protected_symlinks off, or root),
    or a link inside a folder of theirs (where no kernel setting guards), the trace
    overwrote ``run.json`` in the folder the link named. Refused before the block runs."""
    _require_root()
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "run.json").write_text("precious")
    link = sticky / "traces"
    link.symlink_to(private)
    os.lchown(link, OTHER_UID, OTHER_UID)
    theirs = sticky / "theirs"  # a folder of theirs, a link of theirs in it
    theirs.mkdir()
    (theirs / "sub").symlink_to(private)
    os.lchown(theirs / "sub", OTHER_UID, OTHER_UID)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    for path, name in ((link / "run.json", "traces"), (theirs / "sub" / "run.json", "sub"),
                       (sticky / "." / "traces" / ".." / "traces" / "run.json", "traces")):
        with pytest.raises(PermissionError, match=rf"the folder '{name}' on its way is a symbolic link of uid "
                                                  rf"{OTHER_UID}") as info:
            with tx.trace(path):
                pytest.fail("the block must not run")
        assert info.value.errno == errno.EPERM and str(path) in str(info.value)
    assert (private / "run.json").read_text() == "precious"
    assert sorted(os.listdir(private)) == ["run.json"]
    assert tracing.active() is None


def test_links_of_this_user_among_the_folders_are_followed(tmp_path, monkeypatch):
    """Folders are opened one by one: a link of this user (or root) on the way is followed
    as the kernel would, relative and absolute, ``..`` after it included; a loop of links
    and a missing folder are errors naming the path, before the work."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "ab").symlink_to("a/b")
    (tmp_path / "abs").symlink_to(tmp_path / "a")
    (tmp_path / "loop").symlink_to("loop")
    monkeypatch.chdir(tmp_path / "a")
    for path in (tmp_path / "ab" / "1.json", tmp_path / "abs" / "b" / "2.json",
                 tmp_path / "abs" / ".." / "ab" / "3.json", "b/../../ab/4.json", "./b/5.json"):
        with tx.trace(path):
            pass
    assert sorted(os.listdir(tmp_path / "a" / "b")) == [f"{k}.json" for k in range(1, 6)]
    for path, error in ((tmp_path / "loop" / "x.json", "Too many levels of symbolic links"),
                        (tmp_path / "nope" / "x.json", "No such file or directory"),
                        ("", "No such file or directory")):
        with pytest.raises(OSError, match=f"cannot write the trace to {str(path)!r}: {error}"):
            with tx.trace(path):
                pytest.fail("the block must not run")


FAILING_BLOCK = r"""
import os, resource, signal, sys
import exchange as tx
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
path = sys.argv[1]
with open(path, "w") as fh:
    fh.write("old")
try:
    with tx.trace(path):
        tx.from_dlpack(__import__("numpy").zeros(4))
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.RLIM_INFINITY))  # the write fails: EFBIG
        raise ValueError("the work failed")
except BaseException as exc:
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print(type(exc).__name__, exc, *getattr(exc, "__notes__", ["(no note)"]), sep="\n")
"""


def test_a_block_that_raises_is_traced_and_a_failed_write_does_not_hide_its_error(tmp_path):
    """The block raises: its trace is written all the same (what led to the error is in it).
    If that write fails too (a full disk, a file size limit), the block's error goes on,
    the failure added to it as a note; the write's error had replaced it."""
    path = tmp_path / "run.json"
    with pytest.raises(ValueError, match="the work failed"):
        with tx.trace(path):
            tx.from_dlpack(np.zeros(4))
            raise ValueError("the work failed")
    assert json.loads(path.read_text())["traceEvents"]
    proc = subprocess.run([sys.executable, "-c", FAILING_BLOCK, str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "ValueError", "the work failed", f"tx.trace: and the trace was not written: cannot write the trace to "
        f"{str(path)!r}: File too large (the file holds part of it at most)"], proc.stdout + proc.stderr[-3000:]
