"""Defects found by a hostile review of sets (exchange/sets/), each shown by a failing case.

Every case runs its processes in a child interpreter with a timeout: what it shows is a
crash (a reader killed by a signal) or a hang.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 30  # (s) each child


def _run(code: str, sets_dir: Path, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    sets_dir.mkdir(mode=0o700, exist_ok=True)
    env = dict(os.environ, EXCHANGE_SETS_DIR=str(sets_dir))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=timeout)


# A fake publisher (a process of the same user listening on the name's socket) sends
# version 1 in region 1, then version 2 in the same region id with a larger size; the
# reader still holds version 1's snapshot (all 1s) and reads it again: it must read
# the same bytes (version 2's are 2s), not fault.
FAKE_PUBLISHER_REGROWS_A_HELD_REGION = r"""
import array, fcntl, json, mmap, os, socket, subprocess, sys
from exchange.channels.memfd import F_SEAL_FUTURE_WRITE
from exchange.sets.names import socket_path

READER = '''
import sys, time, exchange as tx, numpy as np
sub = tx.subscribe("regrow")
snap = sub.latest(timeout=10)
a = np.from_dlpack(snap["a"])
print("first", int(a.sum()), flush=True)
try:
    print("next", sub.next(timeout=1).version, flush=True)
except Exception as exc:
    print("next:", type(exc).__name__, flush=True)
time.sleep(0.5)
print("again", int(a.sum()), flush=True)   # the held snapshot must stay readable
'''

def memfd(n, fill=1):
    fd = os.memfd_create("fake", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, n)
    m = mmap.mmap(fd, n)
    m[:] = bytes([fill]) * n
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE)
    return fd, m

def send(c, message, fd):
    c.sendmsg([json.dumps(message).encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])

listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind(socket_path("regrow"))
listener.listen(1)
reader = subprocess.Popen([sys.executable, "-c", READER])
listener.settimeout(15)
c, _ = listener.accept()
counter, cm = memfd(4096)
cm[:8] = (1).to_bytes(8, "little")
send(c, ["counter", 0], counter)
c.settimeout(10)
c.recv(1 << 16)  # the reader's follow
entries = [["a", "int8", [4096], 0]]
r1, m1 = memfd(65536)
send(c, ["version", 1, 1, 1, 65536, 4096, 1, entries], r1)
c.recv(1 << 16)  # took
r2, m2 = memfd(131072, fill=2)
send(c, ["version", 1, 2, 1, 131072, 4096, 1, entries], r2)
reader.wait(20)
print("reader exit", reader.returncode, flush=True)
"""


def test_a_publisher_message_never_unmaps_a_region_a_snapshot_holds(tmp_path):
    # subscriber.py _Connection.region(): a region id mapped already but smaller than
    # the new message says is unmapped even while snapshots in it are held (r.uses > 0);
    # reading the held snapshot then faults (SIGSEGV), or reads whatever the kernel
    # mapped at that address next (version 2's bytes), instead of the connection failing.
    out = _run(FAKE_PUBLISHER_REGROWS_A_HELD_REGION, tmp_path / "sets")
    assert "first 4096" in out.stdout, out.stdout + out.stderr
    assert "reader exit 0" in out.stdout, out.stdout + out.stderr
    assert "again 4096" in out.stdout, out.stdout + out.stderr


CLOSE_WHILE_ANOTHER_THREAD_WAITS = r"""
import threading, time, exchange as tx, numpy as np
tx.publish("waiting", {"a": np.arange(4.0)})
sub = tx.subscribe("waiting")
sub.latest(timeout=10)
threading.Thread(target=lambda: sub.next(), daemon=True).start()  # waits for a version that never comes
time.sleep(0.5)
closer = threading.Thread(target=sub.close, daemon=True)
closer.start()
closer.join(5)
print("close returned" if not closer.is_alive() else "close still blocked after 5 s", flush=True)
"""


def test_close_returns_while_another_thread_waits_in_next(tmp_path):
    # Subscription._take holds self._lock for the whole wait; close() takes the same
    # lock, so it blocks until a version is published (for ever if none is).
    out = _run(CLOSE_WHILE_ANOTHER_THREAD_WAITS, tmp_path / "sets")
    assert "close returned" in out.stdout, out.stdout + out.stderr


OFFERS_AFTER_CLOSE = r"""
import gc, time, exchange as tx, numpy as np, exchange.sets as sets
tx.publish("late", {"a": np.arange(1000.0)})
sub = tx.subscribe("late")
held = sub.latest(timeout=10)          # a snapshot kept past close()
tx.publish("late", {"a": np.arange(1000.0)})   # offered to sub, on its way
sub.close()
newest = None
for _ in range(4):
    newest = tx.publish("late", {"a": np.arange(1000.0)})
publisher = sets._state().publishers["late"]
deadline = time.monotonic() + 10  # (the declines come through the runtime thread)
while True:
    with publisher.cond:
        pinned = sorted(n for n, v in publisher.versions.items() if v.offers)
    if not pinned or time.monotonic() > deadline:
        break
    time.sleep(0.05)
print("offered, alive:", pinned, "held:", held.version, "newest:", newest.number, flush=True)
"""


def test_offers_that_arrive_after_close_are_let_go(tmp_path):
    # docs/processes.md: "an offer that arrives later is taken by the next call, or let
    # go at close()". Subscription.close() -> _Connection.finish() stops watching the
    # socket while a snapshot keeps the connection open, and nothing withdraws the
    # standing follow: the publisher goes on offering the versions published after
    # close(), which are never received nor declined, so two versions (regions) stay
    # pinned at the publisher for as long as the old snapshot lives.
    out = _run(OFFERS_AFTER_CLOSE, tmp_path / "sets")
    assert "offered, alive: []" in out.stdout, out.stdout + out.stderr


MAP_FAILURE_THEN_LATEST = r"""
import resource, subprocess, sys, time, exchange as tx, numpy as np
tx.publish("mapfail", {"a": np.zeros(10)})
READER = '''
import resource, sys, exchange as tx
sub = tx.subscribe("mapfail")
sub.latest(timeout=10)
vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20), hard))  # the next version cannot be mapped
print("limited", flush=True)
sys.stdin.readline()
try:
    sub.next(timeout=5)
except Exception as exc:
    print("next:", type(exc).__name__, flush=True)
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))  # it can now
try:
    print("latest:", sub.latest(timeout=3).version, flush=True)
except Exception as exc:
    print("latest:", type(exc).__name__, flush=True)
'''
reader = subprocess.Popen([sys.executable, "-c", READER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
assert reader.stdout.readline().strip() == "limited"
tx.publish("mapfail", {"a": np.zeros(8 << 20)})  # 64 MiB
reader.stdin.write("\n")
reader.stdin.flush()
print(reader.stdout.read(), flush=True)
reader.wait(20)
"""


def test_latest_returns_the_newest_after_a_version_could_not_be_mapped(tmp_path):
    # subscriber.py _Connection._offered: when mapping an offer fails it declines it and
    # keeps the error for the next take, but ``newest`` stays at the version before
    # while the counter page says the failed one is published; take() then neither
    # asks the publisher again (self.newest >= published is False) nor gets an offer
    # (the publisher's last_offered is past it): latest() waits for the next publish
    # (for ever without a timeout) though the newest version can be mapped now.
    out = _run(MAP_FAILURE_THEN_LATEST, tmp_path / "sets")
    assert "next: ExchangeError" in out.stdout, out.stdout + out.stderr
    assert "latest: 2" in out.stdout, out.stdout + out.stderr


NAN_TIMEOUT = r"""
import exchange as tx, numpy as np
tx.publish("nan", {"a": np.zeros(3)})
sub = tx.subscribe("nan")
sub.latest(timeout=5)
try:
    sub.next(timeout=float("nan"))
except Exception as exc:
    print("next:", type(exc).__name__, flush=True)
"""


def test_a_nan_timeout_is_refused_not_a_wait_for_ever(tmp_path):
    # tx.publish refuses a timeout that is not seconds >= 0 (sets/__init__.py _check_bound);
    # Subscription._take does not check it, and with NaN no deadline is ever passed
    # (``left <= 0`` is False), so next() waits for ever.
    try:
        out = _run(NAN_TIMEOUT, tmp_path / "sets", timeout=10)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"next(timeout=nan) still waiting after 10 s") from None
    assert "next: ValueError" in out.stdout, out.stdout + out.stderr


RELEASES_WHILE_THE_PUBLISHER_LAGS = r"""
import gc, signal, subprocess, sys, time, exchange as tx
PUBLISHER = '''
import sys, exchange as tx, numpy as np, exchange.sets as sets
v = tx.publish("lag", {"a": np.zeros(10)})
print("up", flush=True)
for line in sys.stdin:
    holds = sum(sets._state().publishers["lag"].versions[v.number].holds.values())
    print("holds", holds, flush=True)
'''
publisher = subprocess.Popen([sys.executable, "-c", PUBLISHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
assert publisher.stdout.readline().strip() == "up"
sub = tx.subscribe("lag")
snaps = [sub.latest(timeout=10) for _ in range(1000)]
publisher.send_signal(signal.SIGSTOP)   # stands for a publisher that does not run for a moment
del snaps
gc.collect()                            # 1000 releases, more than the socket buffers
time.sleep(0.2)
publisher.send_signal(signal.SIGCONT)
deadline = time.monotonic() + 20  # (the queued releases reach it in a few rounds of socket buffer)
while True:
    publisher.stdin.write("\n")
    publisher.stdin.flush()
    said = publisher.stdout.readline().strip()
    if said == "holds 0" or time.monotonic() > deadline:
        break
    time.sleep(0.05)
print(said, flush=True)
publisher.stdin.close()
publisher.wait(10)
"""


def test_no_release_is_lost_when_the_publisher_lags(tmp_path):
    # subscriber.py _Connection._tell sends with MSG_DONTWAIT and drops the message on
    # OSError ("or not reading"): when the socket to the publisher is full (the
    # publisher's runtime thread has not run), releases are lost for good and the
    # publisher counts those holds for as long as the connection lives (the version and
    # its region pinned, and counted against max_live_versions). Lost "took" and
    # "decline" messages would leave the publisher's offer count stuck the same way.
    out = _run(RELEASES_WHILE_THE_PUBLISHER_LAGS, tmp_path / "sets")
    assert "holds 0" in out.stdout, out.stdout + out.stderr


FORK_WHILE_OFFERS_ARRIVE = r"""
import os, subprocess, sys, threading, time, exchange as tx
PUBLISHER = '''
import time, exchange as tx, numpy as np
end = time.monotonic() + 25
while time.monotonic() < end:
    tx.publish("forking", {"a": np.zeros(100)})
    time.sleep(0.0005)
'''
publisher = subprocess.Popen([sys.executable, "-c", PUBLISHER])
sub = tx.subscribe("forking")
sub.latest(timeout=10)   # the runtime thread now receives an offer per version (under the connection's lock)

def serve():  # a thread taking versions as a server would (it takes the connection's lock too)
    while True:
        sub.latest(timeout=10).close()

threading.Thread(target=serve, daemon=True).start()
hung = 0
for _ in range(40):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 20 and not os.waitpid(pid, os.WNOHANG)[0]:  # (a hang is for ever)
        time.sleep(0.01)
    if time.monotonic() - t0 >= 20:
        hung += 1
        os.kill(pid, 9)
        os.waitpid(pid, 0)
publisher.kill()
print("children hung at fork:", hung, flush=True)
"""


def test_a_fork_while_offers_arrive_never_hangs_the_child(tmp_path):
    # subscriber.py _Connection.after_fork_in_child takes ``with self.lock``: a lock the
    # parent's runtime thread (receiving an offer) or a taking thread held at the fork
    # stays held in the child for ever, and the child hangs in the after-fork hooks
    # (any fork: multiprocessing's, a DataLoader's workers).
    out = _run(FORK_WHILE_OFFERS_ARRIVE, tmp_path / "sets", timeout=200)
    assert "children hung at fork: 0" in out.stdout, out.stdout + out.stderr
