"""A hostile review of the core's HostQueue (compiled exchange/native/hostqueue.c and its
pure twin), call_stage, and the pipelined chain that runs on them: each case runs on both
paths (the queue and call_stage in-process, both classes; a host stream or chain in a
subprocess with EXCHANGE_PURE_PYTHON set, with a timeout, since the failures hang)."""

from __future__ import annotations

import contextvars
import importlib.util
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPILED_BUILT = importlib.util.find_spec("exchange._native") is not None
PATHS = [pytest.param("compiled", marks=pytest.mark.skipif(not COMPILED_BUILT, reason="compiled core not built")),
         "pure"]


def _core_of(path: str):
    if path == "compiled":
        from exchange._core import _compiled as core
    else:
        from exchange._core import _pure as core
    return core


@pytest.fixture(params=PATHS)
def core(request):
    return _core_of(request.param)


def _run(code: str, path: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {**os.environ, "EXCHANGE_PURE_PYTHON": "1" if path == "pure" else "0", "PYTHONPATH": str(ROOT),
               **(env or {})}
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environ, cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung ({timeout} s): {exc.stdout!r} {exc.stderr!r}")


def _worker(q, errors=None):
    t = threading.Thread(target=q.run, args=(lambda: None, lambda exc, fn: (errors or []).append(exc),
                                             lambda fn, tag: None), daemon=True)
    t.start()
    return t


# -- the queue ---------------------------------------------------------------------------------
def test_the_ring_keeps_order_when_it_grows_wrapped_around(core):
    q, seen = core.HostQueue(), []
    gate, at_gate = threading.Event(), threading.Event()
    for i in range(10):
        q.put(seen.append, (i,), None)
    q.put(lambda: (at_gate.set(), gate.wait()), (), None)
    worker = _worker(q)
    assert at_gate.wait(10)  # the worker is past 11 items: the next ones wrap, then the ring grows
    expected = list(range(10)) + list(range(100, 160))
    for i in range(100, 160):
        q.put(seen.append, (i,), None)
    gate.set()
    q.close()
    worker.join(10)
    assert seen == expected and q.seq == q.done == 71 and q.pending == 0


def test_many_posting_threads_keep_each_threads_order_and_the_counts(core):
    q, seen = core.HostQueue(), []
    worker = _worker(q)

    def post(k):
        for i in range(2000):
            if i % 2:
                q.put(seen.append, ((k, i),), None)
            else:
                q.put_in(contextvars.copy_context(), seen.append, (k, i))

    threads = [threading.Thread(target=post, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    q.close()
    worker.join(20)
    assert q.seq == q.done == len(seen) == 8000 and q.pending == 0
    for k in range(4):
        assert [i for j, i in seen if j == k] == list(range(2000))


def test_items_are_let_go_run_dropped_taken_after_fork_or_never_run(core):
    fn, arg, tag, ctx = (lambda *a: None), object(), object(), contextvars.copy_context()
    before = [sys.getrefcount(x) for x in (fn, arg, tag, ctx)]

    def raising(*a):
        raise KeyboardInterrupt

    for how in ("run", "dropped", "after_fork", "never run"):
        q = core.HostQueue()
        for _ in range(100):
            q.put(fn, (arg,), tag)
            q.put_in(ctx, fn, arg)
            q.put(raising, (arg,), tag)
        if how == "after_fork":
            assert len(q.after_fork()) == 300
        elif how != "never run":
            q.dropping = how == "dropped"
            q.close()
            t = threading.Thread(target=q.run, args=(lambda: None, lambda exc, fn: None, lambda fn, tag: None))
            t.start()
            t.join(10)
            assert q.done == 300
        del q
        after = [sys.getrefcount(x) for x in (fn, arg, tag, ctx)]
        assert after == before, how


def test_hooks_that_raise_are_reported_and_the_worker_goes_on(core, monkeypatch):
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reported.append(type(u.exc_value).__name__))
    q, seen = core.HostQueue(), []

    def bad_hook(*args):
        raise ValueError("hook")

    q.put(lambda: 1 / 0, (), None)
    q.put(seen.append, (1,), None)
    q.close()
    assert q.close() is False and q.put(seen.append, (2,), None) is False
    t = threading.Thread(target=q.run, args=(bad_hook, bad_hook, bad_hook))
    t.start()
    t.join(10)
    assert not t.is_alive() and seen == [1] and reported == ["ValueError", "ValueError"]


def test_put_takes_a_tuple_not_a_subclass_on_both_paths(core):
    # The compiled core took a tuple subclass the pure twin refuses.
    class Args(tuple):
        pass

    with pytest.raises(TypeError):
        core.HostQueue().put(len, Args(("x",)), None)


def test_call_stage_takes_lists_not_subclasses():
    # The compiled core took list subclasses the pure twin refuses (and set the items of
    # acc past its own __setitem__). On the path this process chose (a Tensor is that
    # path's): the file runs on both.
    import exchange as tx
    from exchange import _core

    class Hops(list):
        pass

    tensor = tx.from_dlpack(np.zeros(3))
    with pytest.raises(TypeError, match="lists"):
        _core.call_stage(len, [1], tensor, Hops(), "template", [0.0], 0)
    with pytest.raises(TypeError, match="lists"):
        _core.call_stage(len, [1], tensor, [], "template", Hops([0.0]), 0)


@pytest.mark.parametrize("path", PATHS)
def test_a_queue_run_on_the_main_thread_lets_ctrl_c_out(path):
    # The pure twin waits in SimpleQueue.get, which a KeyboardInterrupt leaves; the
    # compiled wait looked again after the signal and waited on, deaf to Ctrl-C.
    proc = _run(f"""
        import signal, threading
        from exchange._core import {'_compiled' if path == 'compiled' else '_pure'} as core
        # A shell's background job (CI's second pass) inherits SIGINT ignored: Python's
        # own handler, as a terminal's Ctrl-C finds it.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        q = core.HostQueue()
        threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
        try:
            q.run(lambda: None, lambda exc, fn: None, lambda fn, tag: None)
        except KeyboardInterrupt:
            print("interrupted")
        q.put(print, ("then ran",), None)
        q.close()
        q.run(lambda: None, lambda exc, fn: None, lambda fn, tag: None)
    """, path, timeout=20)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == ["interrupted", "then ran"]


# -- host streams and the pipelined chain ------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
def test_fork_with_items_queued_drops_them_in_the_child_and_runs_them_in_the_parent(path):
    proc = _run("""
        import contextvars, os, threading
        import exchange as tx
        s = tx.create_stream()
        gate = threading.Event()
        s.post(gate.wait)
        futures = [s.submit(lambda i=i: i) for i in range(5)]
        event = s.record()
        pid = os.fork()
        if pid == 0:
            ok = all(f.cancelled() for f in futures) and event.query() and s.pending == 0
            ok = ok and s.poster()(contextvars.copy_context(), print, "no") is False
            try:
                s.post(print, "no")
                ok = False
            except RuntimeError as exc:
                ok = ok and "forked" in str(exc)
            ok = ok and tx.create_stream().submit(lambda: 42).result(10) == 42
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        gate.set()
        print(os.waitstatus_to_exitcode(status), [f.result(10) for f in futures])
    """, path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "0 [0, 1, 2, 3, 4]"


@pytest.mark.parametrize("path", PATHS)
def test_a_pipelined_chain_whose_stream_was_closed_at_exit_raises_not_hangs(path):
    # The exit hook closes a host stream quietly (post_in then drops, not raises): the
    # chain's hand-off took that as queued, and the run waited for the batch for ever.
    proc = _run("""
        import numpy as np
        import exchange as tx
        chain = tx.Chain([tx.Stage(lambda a: a + 1, framework="numpy"),
                          tx.Stage(lambda a: a * 2, framework="torch")], max_in_flight=2)
        assert len(chain.run([np.ones(2)] * 3).outputs) == 3
        for k in (1, 0):  # as the exit hook does: the second stage's stream, then the first
            s = chain._own_streams[k]
            s._exiting = True
            s.close()
            try:
                chain.run([np.ones(2)] * 3)
                print("ran")
            except RuntimeError as exc:
                print(type(exc).__name__, "closed" in str(exc))
    """, path, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["RuntimeError", "True", "RuntimeError", "True"]


@pytest.mark.parametrize("path", PATHS)
def test_a_pipelined_chain_running_on_a_thread_at_exit_does_not_hang_the_exit(path):
    # The exit hook drops the tasks still queued on host streams (a chain's stage tasks
    # with them: drop has no batch to end), and the interpreter joins a non-daemon
    # thread before it ends: its pipelined run waited for those batches for ever.
    proc = _run("""
        import threading, time
        import numpy as np
        import exchange as tx
        def slow(a):
            time.sleep(0.002)
            return a + 1
        chain = tx.Chain([tx.Stage(slow, framework="numpy"), tx.Stage(slow, framework="numpy")], max_in_flight=4)
        def batches():
            while True:
                yield np.ones(4)
        def work():
            try:
                chain.run(batches())
            except RuntimeError:
                pass
        threading.Thread(target=work).start()  # not a daemon: the exit joins it
        time.sleep(0.3)
    """, path, timeout=20, env={"EXCHANGE_EXIT_TIMEOUT": "0.3"})
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_pipelined_run_returns_with_no_intermediate_held_by_a_stage_worker():
    # A plain stage's task let the batch go (done) while its frame still held the tensor it
    # took: the run returned with that intermediate live until the worker left the frame
    # (test_chain's release test saw one record too many now and then on the pure path).
    # A profile hook holds each worker in the task's return, when its locals are still
    # there, so the race is always lost. Runs on the path this process chose.
    import gc

    import exchange as tx

    def hold(frame, event, arg):
        if event == "return" and frame.f_code.co_name in ("plain_task", "task"):
            time.sleep(0.05)

    gc.collect()
    tx.registry().collect(timeout=10)
    base = tx.registry().stats()["live_records"]
    threading.setprofile(hold)
    try:
        chain = tx.Chain([tx.Stage(lambda a: a * 2, framework="numpy", name="a"),
                          tx.Stage(lambda a: a + 1, framework="numpy", name="b")], max_in_flight=2)
    finally:
        threading.setprofile(None)
    try:
        run = chain.run([np.ones(64, dtype=np.float32) for _ in range(3)])
        assert tx.registry().stats()["live_records"] == base + len(run.outputs)
    finally:
        chain.close()


@pytest.mark.parametrize("max_in_flight", [1, 2])
def test_a_chain_closed_by_another_thread_while_it_runs_says_so(max_in_flight):
    # Inline, close() dropped the plans under the run, and the batches after it came back
    # as they went in, no stage run; pipelined, the run raised the message of a host
    # stream the caller never made ("create a new stream").
    import exchange as tx

    closers: list = []

    def slow(a):
        if not closers:  # the run has begun: another thread closes the chain a moment later
            closers.append(threading.Timer(0.1, chain.close))
            closers[0].start()
        time.sleep(0.01)
        return a + 1

    chain = tx.Chain([tx.Stage(slow, framework="numpy")], max_in_flight=max_in_flight)
    try:
        with pytest.raises(RuntimeError, match="this chain was closed while it ran"):
            chain.run(np.zeros(2) for _ in range(200))
    finally:
        for c in closers:
            c.join()


def test_call_stage_refuses_an_index_that_is_not_an_int_before_the_stage_runs():
    # The pure twin called the stage (and noted its hop), then failed on acc[1.0], where
    # the compiled core refuses before anything.
    # On the path this process chose (a Tensor is that path's): the file runs on both.
    import exchange as tx
    from exchange import _core

    called, hops = [], []
    with pytest.raises(TypeError):
        _core.call_stage(called.append, 1, tx.from_dlpack(np.zeros(3)), hops, "template", [0.0, 0.0], 1.0)
    assert called == [] and hops == []


def test_pipelined_and_inline_runs_report_the_same_hops_and_outputs():
    # Shared hops kept compact while a pipelined run goes must come out as the dicts an
    # inline run gives, batch by batch, for plain NumPy stages, PyTorch ones, tuples and
    # dicts, and batches whose shape changes.
    pytest.importorskip("torch")
    import exchange as tx

    def chain(max_in_flight):
        return tx.Chain([tx.Stage(lambda a: {"x": a, "y": a * 3}, framework="numpy", name="split"),
                         tx.Stage(lambda x, y: (y - x, x), framework="torch", name="diff"),
                         tx.Stage(lambda a, b: a + b, framework="numpy", name="sum"),
                         tx.Stage(lambda a: a * 2, framework="numpy", name="double")], max_in_flight=max_in_flight)

    batches = [np.arange(n, dtype=np.float32) for n in (4, 8, 3, 16, 4)]
    runs = []
    for max_in_flight in (1, 2, 3):
        with chain(max_in_flight) as c:
            r = c.run(batches)
            runs.append(([np.from_dlpack(o).tolist() for o in r.outputs], r.batch_hops, r.hops, sorted(r.stage_ms)))
    assert runs[0] == runs[1] == runs[2]
    assert all(type(h) is dict for batch in runs[1][1] for h in batch)
    assert [batch[0]["bytes"] for batch in runs[1][1]] == [16, 32, 12, 64, 16]
