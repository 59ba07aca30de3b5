"""Who is at the other end of a connection (issue 19, items 2 and 3): a receiver checks
that the process answering at a handle's address is the very process that made the
handle (same pid, as its own PID namespace sees it, same start time, same boot) and of
its own user, before it sends anything; an impostor gets nothing and the attach raises
LifetimeError naming the sender that exited; a live sender of another user is a
PermissionError that says so.

Another local user is a throwaway uid (share_helpers.throwaway_uid), which needs root:
those cases skip otherwise. Its side runs as a forked child that drops to that uid after
its imports (share_helpers.as_user). PID namespaces come from ``unshare --pid --fork``.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess

import numpy as np
import pytest

import exchange as tx
from share_fixtures import clean_sharing, warm_sharing  # noqa: F401  (autouse: every test here)
from share_helpers import (
    ATTACH_LINES,
    IMPOSTOR,
    SKIP_SECOND_USER,
    Script,
    Worker,
    as_user,
    throwaway_uid,
    wait_until,
)

REG = tx.registry()


def _other_uid() -> int:
    uid = throwaway_uid()
    if uid is None:
        pytest.skip(SKIP_SECOND_USER)
    return uid


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, timeout=30).returncode == 0


def _exited_sender() -> tuple:
    """A handle (8 float32 from 1.0) of a worker that has exited since, and its pid."""
    w = Worker()
    h = w.call("share", "a", 8, 1.0)
    w.close()
    return h, w.pid


def _impostor(h, uid=None, prefix=()) -> Script:
    script = Script(as_user(IMPOSTOR, uid), prefix=prefix)
    script.send(f"{h._f.address.hex()} {h._f.span}")
    assert script.line() == "listening"
    return script


@pytest.mark.parametrize("who", ["this user", "another user"])
def test_an_impostor_at_an_exited_senders_address_is_sent_nothing(who):
    # Item 2: a process of uid 1001 bound the exited sender's socket name (abstract names
    # are world-readable in /proc/net/unix), answered the attach with its own memory
    # ([666.0, ...] came back as the sender's) and received the handle's secret.
    uid = _other_uid() if who == "another user" else None
    h, pid = _exited_sender()
    impostor = _impostor(h, uid)
    try:
        with pytest.raises(tx.LifetimeError, match=rf"process {pid} that shared this memory has exited.*not it"):
            tx.attach(h)
        out = json.loads(impostor.line())
    finally:
        assert impostor.close() == 0
    assert out == {"received": "", "answered": 0}, f"the impostor was sent {bytes.fromhex(out['received'])!r}"


@pytest.mark.skipif(not _can_unshare(), reason="needs unshare --pid (root or user namespaces)")
def test_an_impostor_with_the_senders_pid_in_another_pid_namespace_is_refused():
    # Each is pid 1 in a PID namespace of its own: the same pid number as the handle's, a
    # different process (a pid reused, in effect): its start time tells.
    sender = Script(as_user(_SENDER_THEN_EXIT, None), prefix=("unshare", "--pid", "--fork"))
    h = pickle.loads(bytes.fromhex(sender.line()))
    assert h.pid == 1
    sender.send("exit")
    assert sender.close() == 0
    impostor = _impostor(h, prefix=("unshare", "--pid", "--fork"))
    try:
        with pytest.raises(tx.LifetimeError, match="process 1 that shared this memory has exited.*not it"):
            tx.attach(h)
        out = json.loads(impostor.line())
    finally:
        assert impostor.close() == 0
    assert out == {"received": "", "answered": 0}


_SENDER_THEN_EXIT = """
t = tx.empty(8, "float32", shared=True)
np.from_dlpack(t)[:] = np.arange(8) + 1.0
print(pickle.dumps(tx.share(t)).hex(), flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(not _can_unshare(), reason="needs unshare --pid (root or user namespaces)")
def test_a_sender_in_a_child_pid_namespace_is_verified_and_attached():
    # The handle says pid 1 (as the sender sees itself); this process sees another number:
    # the check goes through the namespaces' pids (NSpid), not the number alone.
    sender = Script(as_user(_SENDER_THEN_EXIT, None), prefix=("unshare", "--pid", "--fork"))
    try:
        h = pickle.loads(bytes.fromhex(sender.line()))
        assert h.pid == 1
        t = tx.attach(h)
        assert np.from_dlpack(t).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
        assert t.record.origin.startswith("imported from process ") and t.record.origin != "imported from process 1 (tx.attach)"
        del t
    finally:
        sender.send("exit")
        assert sender.close() == 0


def test_a_live_sender_refusing_another_user_is_a_permission_error():
    # Item 3: the refused attach said "process 9371 that shared this memory has exited"
    # while 9371 was alive and had refused the other uid.
    uid = _other_uid()
    with Worker() as w:
        h = w.call("share", "a", 8, 1.0)
        script = Script(as_user(ATTACH_LINES, uid))
        try:
            script.send(pickle.dumps(h).hex())
            out = json.loads(script.line())
        finally:
            assert script.close() == 0
        error = out.get("error", "")
        assert error.startswith("PermissionError") and f"process {w.pid} that shared this memory is alive" in error, out
        assert f"uid {uid}" in error and "its own user" in error, out
        assert w.call("stats")["remote_holders"] == 0
        assert wait_until(lambda: w.call("peers") == 0, 10), "another user's connection was kept"


_SHARE_AS_USER = """
t = tx.empty(8, "float32", shared=True)
np.from_dlpack(t)[:] = 7.0
print(pickle.dumps(tx.share(t)).hex(), flush=True)
sys.stdin.readline()
print(json.dumps(tx.registry().stats()["remote_holders"]), flush=True)
sys.stdin.readline()
"""


def test_uid_0_may_attach_another_users_memory():
    # What a peer of uid 0 may do: attach (the sender admits it: the kernel lets root
    # read any process's memory anyway); it still needs the handle and its secret.
    uid = _other_uid()
    sender = Script(as_user(_SHARE_AS_USER, uid))
    try:
        h = pickle.loads(bytes.fromhex(sender.line()))
        t = tx.attach(h)
        assert float(np.from_dlpack(t)[0]) == 7.0
        sender.send("holders?")
        assert json.loads(sender.line()) == 1
        del t
        sender.send("exit")
    finally:
        assert sender.close() == 0


def _forged(h, **changes):
    from exchange.sharing import handle as share_handle

    return share_handle._rebuild_handle(tuple(h._f._replace(**changes)))


def test_a_handle_naming_a_live_senders_address_but_another_process_is_refused():
    with Worker() as w:
        h = w.call("share", "a", 8, 1.0)
        # Not connected yet: the process at the address is checked, and is not the one named.
        with pytest.raises(tx.LifetimeError, match="not it"):
            tx.attach(_forged(h, start=h._f.start + 1))
        with pytest.raises(tx.LifetimeError, match="not it"):
            tx.attach(_forged(h, pid=h._f.pid + 1))
        t = tx.attach(h)  # connected, to the real sender
        for forged in (_forged(h, start=h._f.start + 1), _forged(h, pid=h._f.pid + 1)):
            with pytest.raises(ValueError, match="forged"):
                tx.attach(forged)
        assert float(np.from_dlpack(t)[0]) == 1.0
        del t
