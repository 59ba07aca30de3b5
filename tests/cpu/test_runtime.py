"""The process runtime (exchange/runtime.py): its hooks run in their declared order in a
forked child, at a normal exit and at the end of a fork-started multiprocessing child;
its one background thread serves sharing and inspection both; its singletons.

What forks or exits runs in a subprocess with a timeout.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from exchange import runtime

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
TIMEOUT = 120


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env.pop("EXCHANGE_INSPECT", None)
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT, env=env)


def _lines(proc: subprocess.CompletedProcess, tag: str) -> list[str]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [ln.split(" ", 1)[1] for ln in proc.stdout.splitlines() if ln.startswith(tag + " ")]


# -- the order ------------------------------------------------------------------------------------
#: Hooks registered in an order that is neither theirs nor its reverse: they must run by
#: ``order``, then name. The child writes what ran into a pipe and ends with os._exit.
FORK_ORDER = r"""
import os
from exchange import runtime
ran = []
for order, name in [(300, "c"), (100, "b"), (500, "e"), (100, "a"), (200, "d")]:
    runtime.register("after_fork_in_child", "test." + name, lambda name=name: ran.append(name), order)
    runtime.register("before_fork", "test." + name, lambda name=name: ran.append("before " + name), order)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, " ".join(ran).encode())
    os._exit(0)
os.close(w)
print("CHILD", os.read(r, 4096).decode(), flush=True)
os.waitpid(pid, 0)
print("PARENT", " ".join(ran), flush=True)
"""


def test_fork_hooks_run_in_their_declared_order_in_the_child():
    proc = _run(FORK_ORDER)
    before = "before a before b before d before c before e"
    assert _lines(proc, "PARENT") == [before]
    assert _lines(proc, "CHILD") == [before + " a b d c e"]  # the child inherits what ran before the fork


LIBRARY_ORDER = r"""
import exchange, exchange.devices.cpu, exchange.sharing.serving, exchange.sharing.receiving, exchange.tracing
import exchange.inspection
from exchange import runtime
for kind in runtime.KINDS:
    print("HOOKS", kind, " ".join(runtime.hooks(kind)), flush=True)
"""


def test_the_library_registers_its_hooks_in_the_layer_order():
    hooks = {line.split(" ", 1)[0]: line.split(" ", 1)[1].split() for line in _lines(_run(LIBRARY_ORDER), "HOOKS")}
    child = hooks["after_fork_in_child"]
    want = ["runtime.loop", "registry", "devices.cpu.host_streams", "tracing", "sharing.server", "sharing.connections",
            "inspection.server"]
    assert [h for h in child if h in want] == want, child
    assert hooks["at_exit"] == ["devices.cpu.host_streams", "sharing.flush"]  # streams' work first, then the flush
    assert hooks["before_fork"] == ["sharing.handle"]


# -- exit -----------------------------------------------------------------------------------------
#: Two exit hooks registered in reverse order; each prints the pid it runs in.
EXIT_HOOKS = r"""
import os, sys, multiprocessing as mp
from exchange import runtime
runtime.register("at_exit", "test.late", lambda: print("EXIT late", os.getpid(), flush=True), 900)
runtime.register("at_exit", "test.early", lambda: print("EXIT early", os.getpid(), flush=True), 1)

def child():
    print("CHILD", os.getpid(), flush=True)

if __name__ == "__main__":
    print("PARENT", os.getpid(), flush=True)
    if sys.argv[1] == "fork":
        p = mp.get_context("fork").Process(target=child)
        p.start()
        p.join(60)
        print("JOINED", p.exitcode, flush=True)
"""


def test_exit_hooks_run_once_in_order_at_a_normal_exit():
    proc = _run(EXIT_HOOKS, "none")
    pid = _lines(proc, "PARENT")[0]
    assert _lines(proc, "EXIT") == [f"early {pid}", f"late {pid}"]


def test_exit_hooks_run_at_the_end_of_a_fork_started_multiprocessing_child():
    # that child ends with os._exit, which skips atexit: the runtime's hook runs all the same
    proc = _run(EXIT_HOOKS, "fork")
    parent, child = _lines(proc, "PARENT")[0], _lines(proc, "CHILD")[0]
    assert _lines(proc, "JOINED") == ["0"]
    assert _lines(proc, "EXIT") == [f"early {child}", f"late {child}", f"early {parent}", f"late {parent}"]


# -- one thread -----------------------------------------------------------------------------------
#: A fork-started child attaches what this process shares (served by its thread) while
#: this process serves inspection and asks itself (answered by the same thread).
ONE_THREAD = r"""
import os, threading, multiprocessing as mp
import numpy as np
import exchange as tx
from exchange import inspection, runtime
from exchange.sharing import serving

def child(q, out):
    t = tx.attach(q.get(timeout=60))
    out.put(float(np.from_dlpack(t).sum()))
    q.get(timeout=60)  # on q: out.get could read back the sum just put

if __name__ == "__main__":
    ctx = mp.get_context("fork")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, out))
    p.start()
    t = tx.empty(10, "float32", shared=True)
    np.from_dlpack(t)[...] = 1.0
    q.put(tx.share(t))
    print("SUM", out.get(timeout=60), flush=True)
    tx.serve_inspection()
    reply = inspection.query(os.getpid(), rows=1, timeout=30)
    print("REMOTE", [r["pid"] for r in reply["remote_processes"]] == [p.pid], flush=True)
    same = serving.server().loop is inspection._server().loop is runtime.loop()
    print("SAME", same, flush=True)
    names = sorted(th.name for th in threading.enumerate() if th.name.startswith("tx-"))
    print("THREADS", " ".join(names), flush=True)
    q.put("done")
    p.join(60)
    print("EXIT", p.exitcode, flush=True)
"""


def test_one_background_thread_serves_sharing_and_inspection(tmp_path):
    script = tmp_path / "one_thread.py"
    script.write_text(ONE_THREAD)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env.pop("EXCHANGE_INSPECT", None)
    proc = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", str(script)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert _lines(proc, "SUM") == ["10.0"]
    assert _lines(proc, "REMOTE") == ["True"] and _lines(proc, "SAME") == ["True"]
    threads = _lines(proc, "THREADS")[0].split()
    assert threads.count("tx-runtime") == 1, threads
    assert not {"tx-share", "tx-inspect"} & set(threads), threads
    assert _lines(proc, "EXIT") == ["0"]


# -- the pieces -----------------------------------------------------------------------------------
def test_lazy_makes_one_object_on_first_use():
    made = []
    lazy = runtime.Lazy(lambda: made.append(1) or object(), "test.lazy_once", 10_000)
    assert lazy.peek() is None and not made
    first = lazy.get()
    assert lazy.get() is first and lazy.peek() is first and made == [1]
    assert lazy.take() is first and lazy.peek() is None
    assert lazy.get() is not first and made == [1, 1]


def test_lazy_tries_again_after_a_failed_make():
    calls = []

    def make():
        calls.append(1)
        if len(calls) == 1:
            raise OSError("no descriptor left")
        return "made"

    lazy = runtime.Lazy(make, "test.lazy_retry", 10_000)
    with pytest.raises(OSError):
        lazy.get()
    assert lazy.get() == "made"


def test_register_refuses_an_unknown_kind_and_a_second_name():
    with pytest.raises(ValueError, match="unknown hook kind"):
        runtime.register("at_fork", "test.unknown", lambda: None, 0)
    runtime.register("before_fork", "test.twice", lambda: None, 10_000)
    with pytest.raises(ValueError, match="registered already"):
        runtime.register("before_fork", "test.twice", lambda: None, 10_000)


LAZY_IN_CHILD = r"""
import os
from exchange import runtime

class Thing:
    def after_fork_in_child(self):
        print("RESET", os.getpid(), flush=True)

lazy = runtime.Lazy(Thing, "test.thing", 10_000)
parent = lazy.get()
pid = os.fork()
if pid == 0:
    print("CHILD", lazy.peek() is None and lazy.get() is not parent, flush=True)
    os._exit(0)
os.waitpid(pid, 0)
print("PARENT", lazy.get() is parent, flush=True)
"""


def test_a_forked_child_drops_the_parents_singleton():
    proc = _run(LAZY_IN_CHILD)
    assert _lines(proc, "CHILD") == ["True"] and _lines(proc, "PARENT") == ["True"]
    assert len(_lines(proc, "RESET")) == 1  # the parent's object reset once, in the child
