"""Helpers for the cross-process tests (test_share.py): a scripted worker process, and
what a test checks after it (no shared memory left, no descriptor leaked, registries
consistent).

A ``Worker`` is a real process (multiprocessing, spawn unless told otherwise) that runs
``serve``: it takes commands from a Queue and answers on another, every wait bounded
by a timeout, so a test that goes wrong fails instead of hanging. Tensors and handles
travel on those Queues as they would in an application: a tx.Tensor through the
library's multiprocessing reducer, a ShareHandle by pickling.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import signal
import time
from typing import Any

#: Seconds a test waits for any one answer of a worker.
ANSWER_TIMEOUT = 60.0


class WorkerError(Exception):
    """A command failed in the worker: ``args`` are (exception type name, message)."""


def memfd_count(pid: int | str = "self") -> tuple[int, int]:
    """(open descriptors, mappings) of this library's shared memory in process ``pid``."""
    fds = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "memfd:tensor-exchange" in os.readlink(f"/proc/{pid}/fd/{name}"):
                fds += 1
        except OSError:
            pass
    with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as fh:
        maps = sum("memfd:tensor-exchange" in line for line in fh)
    return fds, maps


def stop(processes: Any, queues: Any = (), conns: Any = ()) -> None:
    """A test's cleanup: kill what is still running, then close its queues (waiting for
    their feeder threads) and connections, so no descriptor outlives the test."""
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(ANSWER_TIMEOUT)
    for c in conns:
        c.close()
    for q in queues:
        q.close()
        q.join_thread()


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def dev_shm() -> set[str]:
    """The named shared-memory segments on this machine, less multiprocessing's own
    semaphores (``sem.*``, which its Queues make and its resource tracker removes)."""
    return {name for name in os.listdir("/dev/shm") if not name.startswith("sem.")}


def wait_until(predicate: Any, timeout: float) -> bool:
    """Poll ``predicate()`` until it is true or ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


# -- the worker process ----------------------------------------------------------------------------
def _info(t: Any) -> dict:
    return {"data_ptr": t.data_ptr, "shape": t.shape, "dtype": t.dtype.name, "readonly": t.readonly,
            "device": str(t.device), "holders": t.record.holders, "origin": t.record.origin}


def serve(inbox: Any, outbox: Any) -> None:
    """The worker's loop: ``(op, *args)`` in, ``("ok", result)`` or ``("err", type, text)`` out."""
    import numpy as np

    import exchange as tx

    held: dict[Any, Any] = {}

    def stats() -> dict:
        gc.collect()
        tx.registry().collect(timeout=10)
        out = dict(tx.registry().stats())
        out["memfd"] = memfd_count()
        out["pid"] = os.getpid()
        return out

    def write(t: Any, i: int, v: float) -> None:
        np.from_dlpack(t).reshape(-1)[i] = v  # NumPy's ValueError for read-only memory

    def fill(t: Any, start: float) -> None:
        np.from_dlpack(t)[...] = np.arange(t.size, dtype=np.from_dlpack(t).dtype).reshape(t.shape) + start

    ops = {
        "hold": lambda key, t: (held.__setitem__(key, t), _info(t))[1],
        "attach": lambda key, h: (held.__setitem__(key, tx.attach(h)), _info(held[key]))[1],
        "read": lambda key, i: float(np.from_dlpack(held[key]).reshape(-1)[i]),
        "sum": lambda key: float(np.from_dlpack(held[key]).sum()),
        "write": lambda key, i, v: write(held[key], i, v),
        "drop": lambda key: held.pop(key, None) and None,
        "drop_all": lambda: held.clear(),
        "holders": lambda key: held[key].record.holders,
        "share": lambda key, n, start=0.0: _share_new(tx, held, key, n, start, fill),
        "share_held": lambda key: tx.share(held[key]),
        "send_back": lambda key: held[key],
        "close_handle": lambda h: h.close(),
        "stats": stats,
        "exit": lambda: None,
    }
    while True:
        try:
            message = inbox.get(timeout=ANSWER_TIMEOUT * 2)
        except queue.Empty:
            return  # the test is gone
        op, args = message[0], message[1:]
        try:
            outbox.put(("ok", ops[op](*args)))
        except BaseException as exc:  # report it; the test decides
            outbox.put(("err", type(exc).__name__, str(exc)))
        del message, args
        if op == "exit":
            return


def _share_new(tx: Any, held: dict, key: Any, n: int, start: float, fill: Any) -> Any:
    t = tx.empty(n, "float32", shared=True)
    fill(t, start)
    held[key] = t
    return tx.share(t)


class Worker:
    """A process running ``serve``; ``call(op, *args)`` returns its answer (or raises
    WorkerError). ``stop()`` asks it to exit, ``kill()`` sends SIGKILL."""

    def __init__(self, method: str = "spawn") -> None:
        ctx = mp.get_context(method)
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=serve, args=(self.inbox, self.outbox), daemon=True)
        self.proc.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, op: str, *args: Any) -> None:
        self.inbox.put((op, *args))

    def answer(self, timeout: float = ANSWER_TIMEOUT) -> Any:
        reply = self.outbox.get(timeout=timeout)
        if reply[0] == "err":
            raise WorkerError(reply[1], reply[2])
        return reply[1]

    def call(self, op: str, *args: Any, timeout: float = ANSWER_TIMEOUT) -> Any:
        self.send(op, *args)
        return self.answer(timeout)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(ANSWER_TIMEOUT)

    def stop(self) -> int | None:
        """Ask the worker to exit (it may hold tensors: interpreter shutdown with live
        memory); returns its exit code (SIGKILL after a timeout)."""
        if self.proc.is_alive():
            try:
                self.send("exit")
            except (OSError, ValueError):
                pass
            self.proc.join(ANSWER_TIMEOUT)
        if self.proc.is_alive():
            self.kill()
        return self.proc.exitcode

    def close(self) -> None:
        self.stop()
        for q in (self.inbox, self.outbox):
            q.close()
            q.join_thread()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- two processes exchanging many tensors -----------------------------------------------------------
def exchange_peer(send_q: Any, recv_q: Any, report_q: Any, n: int, start: float) -> None:
    """Send ``n`` shared tensors (values start + k) on ``send_q`` from a thread while
    receiving ``n`` on ``recv_q`` (checking each, then dropping it); then wait until
    every tensor sent has been released by the other side, and report the registry's
    stats, the shared-memory count and any error."""
    import threading

    import numpy as np

    import exchange as tx

    errors: list[str] = []

    def sender() -> None:
        try:
            for k in range(n):
                t = tx.empty(256, "float32", shared=True)
                np.from_dlpack(t)[...] = start + k
                send_q.put(t)
                del t
        except BaseException as exc:
            errors.append(f"send: {type(exc).__name__}: {exc}")

    thread = threading.Thread(target=sender)
    thread.start()
    try:
        for k in range(n):
            t = recv_q.get(timeout=ANSWER_TIMEOUT)
            a = np.from_dlpack(t)
            if not isinstance(t, tx.Tensor) or float(a[0]) != float(a[-1]) or float(a[0]) < 0:
                errors.append(f"received {type(t).__name__} with {a[:2]}")
            del a, t
    except BaseException as exc:
        errors.append(f"receive: {type(exc).__name__}: {exc}")
    thread.join(ANSWER_TIMEOUT)
    send_q.close()
    send_q.join_thread()  # everything sent has left this process
    reg = tx.registry()
    wait_until(lambda: reg.stats()["live_records"] == 0 and reg.stats()["remote_holders"] == 0, ANSWER_TIMEOUT)
    out = dict(reg.stats())
    out["memfd"] = memfd_count()
    out["errors"] = errors
    report_q.put(out)
    # Stay until told, so the other side never finds this process gone mid-release.
    try:
        recv_q.get(timeout=ANSWER_TIMEOUT)
    except queue.Empty:
        pass


# -- a process of its own, for what needs its own limits ---------------------------------------------
class Script:
    """``python -c code`` in a new process (the project on its path), talked to in lines:
    ``send(text)`` writes one line to its stdin, ``line()`` reads one line of its stdout
    (AssertionError, with its stderr, after ``timeout`` seconds or when it ends first).
    For cases that change process-wide limits (RLIMIT_NOFILE) or may hang."""

    def __init__(self, code: str, timeout: float = ANSWER_TIMEOUT) -> None:
        import subprocess
        import sys
        import textwrap
        from pathlib import Path

        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        self.timeout = timeout
        self.proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def send(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def line(self) -> str:
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        text = self.proc.stdout.readline() if ready else ""
        if not text:
            self.close()
            raise AssertionError(f"the script said nothing within {self.timeout:g} s "
                                 f"(exit {self.proc.returncode}): {self.proc.stderr.read()[-3000:]}")
        return text.rstrip("\n")

    def close(self) -> int:
        """Wait for the end (SIGKILL after the timeout); returns the exit status."""
        import subprocess

        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(self.timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(self.timeout)
        return self.proc.returncode


#: Code for a Script: ``exhaust(free)`` opens /dev/null until no descriptor is left (the
#: hard limit lowered first, so the library cannot lift it), then closes ``free`` of them;
#: returns the list to close later. ``fd_kinds()`` counts open descriptors by kind.
EXHAUST_FDS = '''
import os, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

def exhaust(free=0):
    junk = []
    try:
        while True:
            junk.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    for _ in range(free):
        os.close(junk.pop())
    return junk

def release(junk):
    for fd in junk:
        os.close(fd)
    junk.clear()

def fd_kinds():
    kinds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            kind = os.readlink(f"/proc/self/fd/{name}").split(":")[0]
        except OSError:
            continue
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds
'''
