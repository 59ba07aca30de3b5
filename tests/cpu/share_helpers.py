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

import contextlib
import gc
import linecache
import multiprocessing as mp
import os
import pickle
import queue
import signal
import time
from pathlib import Path
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


@contextlib.contextmanager
def young_garbage_only() -> Any:
    """Inside, ``gc.collect()`` scans only the objects made inside (what was there before
    is frozen, ``gc.freeze``): a full collection in a process that has loaded PyTorch,
    JAX and Ray takes about 0.2 s, and the tests that attach once per line of the
    sharing code collect thousands of times. Garbage made inside is collected as ever."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def wait_until(predicate: Any, timeout: float) -> bool:
    """Poll ``predicate()`` until it is true or ``timeout`` seconds have passed. Cycles
    are collected first and then every half second: a full collection in a process that
    has loaded PyTorch, JAX and Ray takes tens of ms, too much for every 10 ms poll."""
    deadline = time.monotonic() + timeout
    collected = 0.0
    while True:
        now = time.monotonic()
        if now - collected >= 0.5:
            gc.collect()
            collected = now
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


# -- the worker process ----------------------------------------------------------------------------
def _requests() -> int:
    """Requests (attach, sync) this process has sent its senders: a local take sends none."""
    from exchange.sharing import receiving

    return sum(c.requests for c in receiving.connections().clients.values())


def _mapped_sizes() -> list[int]:
    """The sizes in bytes of this library's shared memory mapped in this process."""
    sizes = []
    with open("/proc/self/maps", encoding="ascii", errors="replace") as fh:
        for line in fh:
            if "memfd:tensor-exchange" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                sizes.append(hi - lo)
    return sorted(sizes)


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
        "share": lambda key, n, start=0.0, isolated=False: _share_new(tx, held, key, n, start, fill, isolated),
        "share_held": lambda key: tx.share(held[key]),
        "share_held_no_copy": lambda key: tx.share(held[key], copy=False),
        "share_readonly": lambda key, n, start=0.0, isolated=False: _share_readonly(tx, held, key, n, start, isolated),
        "values": lambda key: np.from_dlpack(held[key]).reshape(-1).tolist(),
        "arm_kill": lambda thread, n: _arm_kill(thread, n),
        "kill_count": lambda: _KILL_COUNT[0],
        "share_private": lambda key, n, start=0.0: _share_private(tx, held, key, n, start),
        "live_holders": lambda: (gc.collect(), [r.holders for r in tx.registry().snapshot()])[1],
        "share_many": lambda n, size: [tx.share(tx.empty(size, "float32", shared=True)) for _ in range(n)],
        "send_back": lambda key: held[key],
        "close_handle": lambda h: h.close(),
        "setting": lambda name, value: setattr(_settings(), name, value),
        "peers": lambda: len(_server().peers),
        "requests": lambda: _requests(),
        "loads": lambda key, data: (held.__setitem__(key, pickle.loads(data)), _info(held[key]))[1],
        "mapped_sizes": lambda: _mapped_sizes(),
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


def _share_private(tx: Any, held: dict, key: Any, n: int, start: float) -> Any:
    import numpy as np

    held[key] = tx.from_dlpack(np.arange(n, dtype=np.float32) + start)  # private: shared as a copy
    return tx.share(held[key])


_KILL_COUNT = [0]  # lines counted by arm_kill so far ("kill_count")


def _arm_kill(thread: str, n: int) -> None:
    """SIGKILL this process at the ``n``-th line of the sharing machinery that its main
    thread (``thread="main"``) or its background thread (``"tx-runtime"``, started later)
    runs. One thread's lines come in an order its own work decides: a seed replays."""
    import signal
    import sys
    import threading

    count = _KILL_COUNT
    count[0] = 0
    code = sharing_code()

    def line(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            count[0] += 1
            if count[0] >= n:
                os.kill(os.getpid(), signal.SIGKILL)
        return line

    def call(frame: Any, event: str, arg: Any) -> Any:
        if threading.current_thread().name != thread and not (thread == "main" and threading.current_thread()
                                                              is threading.main_thread()):
            return None
        return line if frame.f_code.co_filename.startswith(code) else None

    if thread == "main":
        sys.settrace(call)
    else:
        threading.settrace(call)  # threads started from now on: the serving thread starts at the first share


def _share_readonly(tx: Any, held: dict, key: Any, n: int, start: float, isolated: bool = False) -> Any:
    import numpy as np

    a = np.arange(n, dtype=np.float32) + start
    a.flags.writeable = False
    held[key] = tx.from_dlpack(a)
    return tx.share(held[key], isolated=isolated)


def memfds() -> list[int]:
    """The descriptors of this library's shared memory open in this process (what a
    hostile receiver would look for)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if "memfd:tensor-exchange" in os.readlink(f"/proc/self/fd/{name}"):
                found.append(int(name))
        except OSError:
            pass
    return found


def _settings() -> Any:
    from exchange.sharing import settings

    return settings


def _server() -> Any:
    from exchange.sharing import serving

    return serving.server()


def _share_new(tx: Any, held: dict, key: Any, n: int, start: float, fill: Any, isolated: bool = False) -> Any:
    t = tx.empty(n, "float32", shared=True)
    fill(t, start)
    if isolated:  # memory of its own, shared as it is from then on
        t = tx.attach(tx.share(t, isolated=True))  # (here: a view of the copy; the handle's lease ends)
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
    from exchange.devices.cpu import arena_stats

    out["blocks_in_use"] = arena_stats()["blocks_in_use"]
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
    For cases that change process-wide limits (RLIMIT_NOFILE) or may hang. ``prefix``: a
    command to run it under (``("unshare", "--pid", "--fork")``)."""

    def __init__(self, code: str, timeout: float = ANSWER_TIMEOUT, prefix: tuple = ()) -> None:
        import subprocess
        import sys
        import textwrap
        from pathlib import Path

        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        self.timeout = timeout
        self.proc = subprocess.Popen([*prefix, sys.executable, "-c", textwrap.dedent(code)], stdin=subprocess.PIPE,
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


# -- waits that must end -------------------------------------------------------------------------------
class Bounded:
    """``fn()`` run on a daemon thread, so that a test can wait for it with a timeout and
    say what happened instead of hanging: ``wait(timeout)`` returns ("ok", value),
    ("err", exception) or ("running", None)."""

    def __init__(self, fn: Any) -> None:
        import threading

        self.result: tuple = ("running", None)
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Any) -> None:
        try:
            self.result = ("ok", fn())
        except BaseException as exc:  # reported, not raised: the test decides
            self.result = ("err", exc)

    def wait(self, timeout: float) -> tuple:
        self.thread.join(timeout)
        return self.result


def is_stopped(pid: int) -> bool:
    """Every thread of process ``pid`` is stopped (state T): SIGSTOP took effect."""
    states = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as fh:
                states.add(fh.read().rsplit(")", 1)[1].split()[0])
        except OSError:
            pass
    return states == {"T"}


def fill_backlog(address: bytes) -> list:
    """Connect to the listening socket ``address`` until its backlog is full (its owner
    is stopped: nobody accepts); returns the sockets, for the caller to close."""
    import socket

    socks = []
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.setblocking(False)
        try:
            s.connect(address)
        except BlockingIOError:
            s.close()
            return socks
        socks.append(s)


# -- another local user ------------------------------------------------------------------------------
_THROWAWAY: list = []


def throwaway_uid() -> int | None:
    """A uid no account and no process uses, to run a process as another local user; None
    unless this process runs as root (which alone can switch to it). Nothing is created:
    to the kernel a uid is a user; the tests' processes of that uid end with the test."""
    if os.geteuid() != 0:
        return None
    if not _THROWAWAY:
        import pwd

        used = set()
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/status") as fh:
                        used.update(int(x) for line in fh if line.startswith("Uid:") for x in line.split()[1:])
                except OSError:
                    pass
        for uid in range(59000, 60000):
            try:
                pwd.getpwuid(uid)
            except KeyError:
                if uid not in used:
                    _THROWAWAY.append(uid)
                    break
    return _THROWAWAY[0] if _THROWAWAY else None


SKIP_SECOND_USER = "needs root, to run a process as another local user (CI runs as root)"


def as_user(code: str, uid: int | None) -> str:
    """Code for a Script that runs ``code`` as ``uid`` (None: this user, no fork),
    talking on the Script's stdin and stdout. It imports first what the library and the
    code use, even what they load lazily (the checkout, or Python itself, may sit under
    a private home the other user cannot read), then forks: the child drops to ``uid``
    and runs ``code``; the parent waits for it and exits with its status."""
    import textwrap

    prelude = [
        "import ctypes, encodings.ascii, encodings.utf_8, fcntl, json, mmap, os, pickle, resource, select",
        "import socket, struct, sys, threading, time",
        "import numpy as np",
        "import exchange as tx",
        "import exchange.devices.cpu, exchange.channels.host, exchange.channels.memfd, exchange.sharing",
        "exchange.channels.memfd._libc()",
    ]
    if uid is not None:
        prelude += [
            "pid = os.fork()",
            "if pid:",
            "    sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))",
            f"os.setgroups([]); os.setgid({uid}); os.setuid({uid})",
            f"assert (os.getuid(), os.geteuid(), os.getgid()) == ({uid}, {uid}, {uid})",
        ]
    return "\n".join(prelude + [textwrap.dedent(code)])


#: Code for ``as_user``: attach each handle read (hex of its pickle, one a line) and print
#: what came of it as one JSON line: {"value": first element} or {"error": "Type: text"}.
ATTACH_LINES = """
for line in sys.stdin:
    try:
        t = tx.attach(pickle.loads(bytes.fromhex(line.strip())))
        print(json.dumps({"value": float(np.from_dlpack(t).reshape(-1)[0]), "readonly": t.readonly}), flush=True)
        del t
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
"""

#: Code for ``as_user``: an impostor. It reads a socket address and a size (hex, decimal;
#: one line), binds the address (that of a sender that has exited), and answers any attach
#: with memory of its own filled with 666.0; then prints one JSON line: every byte it
#: received (hex) and how many requests it answered.
IMPOSTOR = """
address, size = sys.stdin.readline().split()
server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
server.bind(bytes.fromhex(address))
server.listen(8)
fd = os.memfd_create("tensor-exchange")
os.ftruncate(fd, int(size))
os.pwrite(fd, np.full(int(size) // 4, 666.0, dtype=np.float32).tobytes(), 0)
print("listening", flush=True)
received, answered = b"", 0
if select.select([server], [], [], 60)[0]:
    conn, _ = server.accept()
    conn.settimeout(10)
    try:
        while True:
            data = conn.recv(1 << 16)
            if not data:
                break
            received += data
            message = json.loads(data)
            if message[0] == "attach":
                socket.send_fds(conn, [json.dumps(["ok", message[1], 1]).encode()], [fd])
                answered += 1
    except (socket.timeout, OSError, ValueError):
        pass
print(json.dumps({"received": received.hex(), "answered": answered}), flush=True)
"""


# -- faults injected at a line of the library -----------------------------------------------------------
#: The code of the sharing machinery: its package, the memory channels (exchange/channels/:
#: the host channel's attach, the arenas' SharedMemory) and the CPU backend.
#: Taken from the modules imported (on first use, so that importing these helpers imports
#: no sharing code), so that CI's wheel pass, tests/ copied away from the checkout,
#: strikes the installed package's lines.
_SHARING_CODE: list = []


def sharing_code() -> tuple[str, ...]:
    if not _SHARING_CODE:
        import exchange.channels
        import exchange.devices.cpu
        import exchange.runtime
        import exchange.sharing

        # runtime.py: sharing's background thread (its loop) lives there
        _SHARING_CODE.append((os.path.dirname(exchange.sharing.__file__), os.path.dirname(exchange.channels.__file__),
                              exchange.devices.cpu.__file__, exchange.runtime.__file__))
    return _SHARING_CODE[0]


_WITH_EXITS: dict = {}


def _with_exits(code: Any) -> set:
    """Offsets in ``code`` where a trace function sees a line event but a real Ctrl-C
    never strikes (CPython raises KeyboardInterrupt only where it checks for signals:
    function entry, loops, after calls): where a ``with`` block's exit begins (its
    __exit__ calls, normal and on an exception), and NOPs."""
    exits = _WITH_EXITS.get(code)
    if exits is None:
        import dis

        ins = list(dis.get_instructions(code))
        exits = set()
        for i in range(len(ins) - 4):
            if [x.opname for x in ins[i:i + 3]] == ["LOAD_CONST"] * 3 and all(x.argval is None for x in ins[i:i + 3]) \
                    and ins[i + 3].opname == "PRECALL" and ins[i + 4].opname == "CALL" and ins[i + 4].arg == 2:
                exits.add(ins[i].offset)
                if i and ins[i - 1].opname == "SWAP":
                    exits.add(ins[i - 1].offset)
            if ins[i].opname == "PUSH_EXC_INFO" and ins[i + 1].opname == "WITH_EXCEPT_START":
                exits.add(ins[i].offset)
        # The NOP of a ``try:`` line: CPython 3.11 leaves it outside every handler's range,
        # so an exception raised there would skip an enclosing ``with``; no signal is ever
        # raised at a NOP either.
        exits.update(x.offset for x in ins if x.opname == "NOP")
        _WITH_EXITS[code] = exits
    return exits


class Interrupt:
    """A trace function for ``sys.settrace`` that raises KeyboardInterrupt at the
    ``at``-th line of the sharing machinery (``sharing_code()``) this thread runs (0:
    never; ``lines`` counts them), as a Ctrl-C there would. ``where`` says where it
    struck. Not counted: the line events of ``with`` exits, where no Ctrl-C can strike
    (``_with_exits``). Nor reached: a Ctrl-C between a call's return and the store of
    its result, inside one line."""

    def __init__(self, at: int = 0) -> None:
        self.at = at
        self.lines = 0
        self.where = self.function = self.source = ""
        self.code = sharing_code()

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        return self._line if frame.f_code.co_filename.startswith(self.code) else None

    def _line(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lasti not in _with_exits(frame.f_code):
            self.lines += 1
            if self.lines == self.at:
                self.where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} ({frame.f_code.co_name})"
                self.function = frame.f_code.co_name
                self.source = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
                raise KeyboardInterrupt(f"injected at {self.where}")
        return self._line

    def run(self, fn: Any) -> Any:
        import sys

        sys.settrace(self)
        try:
            return fn()
        finally:
            sys.settrace(None)


# -- a receiver of many hand-offs (the arenas' chaos test) ----------------------------------------
def arena_receiver(inbox: Any, report: Any, seed: int) -> None:
    """Take tensors from ``inbox`` until None, checking each one's first value (the
    sender's count) increases; keep a random few of them alive (seeded), drop the rest.
    Says ("ready", 0) once started and ("ack", count) every 16; errors go to ``report``
    at once (the process may be killed any time); at the end, ("done", count)."""
    import random

    import numpy as np

    import exchange as tx

    rng = random.Random(seed)
    kept: list[Any] = []
    last, count = -1.0, 0
    report.put(("ready", 0))
    while True:
        t = inbox.get(timeout=ANSWER_TIMEOUT)
        if t is None:
            break
        value = float(np.from_dlpack(t)[0])
        if not isinstance(t, tx.Tensor) or value <= last:
            report.put(("error", f"hand-off {count}: {type(t).__name__} with {value} after {last}"))
        last, count = value, count + 1
        if count % 16 == 0:
            report.put(("ack", count))
        if rng.random() < 0.05:
            kept.append(t)
        if len(kept) > 20:
            kept.pop(rng.randrange(len(kept)))
        del t
    kept.clear()
    report.put(("done", count))
