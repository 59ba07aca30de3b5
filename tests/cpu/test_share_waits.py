"""Every wait of sharing across processes is bounded, a stopped sender delays only its
own attaches, and the waits are set under their documented names
(``exchange.sharing.settings``). Issue 19, items 7 and 8.

A stopped sender is a real worker process under SIGSTOP; a full backlog is real
connections nobody accepts. Each wait of the test itself is bounded (share_helpers.Bounded).
"""

from __future__ import annotations

import linecache
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import exchange as tx
from exchange.sharing import settings
from share_fixtures import clean_sharing, warm_sharing  # noqa: F401  (autouse: every test here)
from share_helpers import ANSWER_TIMEOUT, Bounded, Worker, fill_backlog, is_stopped, wait_until


def _in_connect(thread) -> bool:
    """``thread`` is blocked in a socket connect() of the sharing package right now."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        code = frame.f_code
        if "sharing" in code.co_filename and ".connect(" in linecache.getline(code.co_filename, frame.f_lineno):
            return True
        frame = frame.f_back
    return False


class _Stopped:
    """A worker that shared a tensor (its handle: ``handle``), then stopped (SIGSTOP),
    optionally with its listen backlog full. Resumed and closed on exit."""

    def __init__(self, full_backlog: bool) -> None:
        self.worker = Worker()
        self.handle = self.worker.call("share", "a", 8, 1.0)
        self.worker.call("drop", "a")  # only the handle's lease holds the memory now
        self.junk: list = []
        os.kill(self.worker.pid, signal.SIGSTOP)
        assert wait_until(lambda: is_stopped(self.worker.pid), 10), "SIGSTOP did not stop the worker"
        if full_backlog:
            self.junk = fill_backlog(self.handle._f.address)

    def resume(self) -> None:
        os.kill(self.worker.pid, signal.SIGCONT)
        for s in self.junk:
            s.close()
        self.junk = []

    def __enter__(self) -> "_Stopped":
        return self

    def __exit__(self, *exc) -> None:
        self.resume()
        self.worker.close()


def test_an_attach_to_a_stopped_sender_with_a_full_backlog_gives_up_after_the_timeout(monkeypatch):
    # Item 7: connect() had no timeout: still blocked after 20 s with a 3 s timeout.
    monkeypatch.setattr(settings, "request_timeout", 1.0)
    with _Stopped(full_backlog=True) as stopped:
        assert len(stopped.junk) > 0
        state, value = Bounded(lambda: tx.attach(stopped.handle)).wait(30)
        assert state == "err" and isinstance(value, tx.ExchangeError), (state, value)
        assert "within 1 s" in str(value) and "backlog" in str(value), value
        stopped.resume()
        monkeypatch.setattr(settings, "request_timeout", 30.0)  # (the resumed sender has a backlog to accept)
        u = tx.attach(stopped.handle)  # nothing was sent: the handle kept its lease
        assert float(np.from_dlpack(u)[3]) == 4.0
        del u


def test_a_stopped_sender_never_delays_an_attach_from_another_sender(monkeypatch):
    # Item 7: the blocked connect ran under a lock every attach takes: an attach from a
    # healthy sender waited for it (over 15 s).
    monkeypatch.setattr(settings, "request_timeout", 60.0)
    with _Stopped(full_backlog=True) as stopped, Worker() as healthy:
        h = healthy.call("share", "b", 8, 2.0)
        stuck = Bounded(lambda: tx.attach(stopped.handle))
        assert wait_until(lambda: _in_connect(stuck.thread), 10), "the attach of the stopped sender is not connecting"
        state, value = Bounded(lambda: float(np.from_dlpack(tx.attach(h))[0])).wait(30)
        assert stuck.result[0] == "running", "the stopped sender's attach ended: cannot tell"
        assert (state, value) == ("ok", 2.0), (state, value)
        stopped.resume()
        state, value = stuck.wait(ANSWER_TIMEOUT)
        assert state == "ok", value
        del value


def test_a_stopped_sender_with_a_full_socket_delays_nothing_else_in_this_process():
    # Releases to a stopped sender wait for room in its socket on this process's one
    # background thread; that wait must not stall the thread, which also serves what this
    # process shares.
    n = 3000
    with Worker() as sender, Worker() as receiver:
        held = [tx.attach(h) for h in sender.call("share_many", n, 4)]  # n mappings of the sender's
        os.kill(sender.pid, signal.SIGSTOP)
        try:
            assert wait_until(lambda: is_stopped(sender.pid), 10)
            del held  # n release packets: more than its socket takes
            mine = tx.empty(4, "float32", shared=True)
            np.from_dlpack(mine)[:] = 5.0
            h = tx.share(mine)
            state, value = Bounded(lambda: receiver.call("attach", "m", h, timeout=30)).wait(40)
            assert state == "ok", (state, value)
            assert receiver.call("read", "m", 1) == 5.0
            receiver.call("drop", "m")
            del mine, h
        finally:
            os.kill(sender.pid, signal.SIGCONT)
        assert wait_until(lambda: sender.call("stats")["remote_holders"] == 0, 30), sender.call("stats")


def test_request_timeout_applies_to_a_connection_already_open(monkeypatch):
    # Item 8: the timeout was read once, when the connection was made: setting it later
    # did nothing for that sender (an attach waited 30 s, not 1).
    with Worker() as w:
        h1, h2 = w.call("share", "a", 8), w.call("share", "b", 8)
        u = tx.attach(h1)  # the connection is open now, made under the default
        monkeypatch.setattr(settings, "request_timeout", 1.0)
        os.kill(w.pid, signal.SIGSTOP)
        try:
            assert wait_until(lambda: is_stopped(w.pid), 10)
            state, value = Bounded(lambda: tx.attach(h2)).wait(20)
        finally:
            os.kill(w.pid, signal.SIGCONT)
        assert state == "err" and isinstance(value, tx.ExchangeError) and "within 1 s" in str(value), (state, value)
        del u


def _flood(address: bytes) -> socket.socket:
    """A same-user connection that sends sync requests until the sender stops taking them
    (its replies to this socket, never read, fill it) and reads nothing."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(address)
    s.setblocking(False)
    rid = 0
    while True:
        rid += 1
        try:
            s.send(b'["sync", %d]' % rid)
        except BlockingIOError:
            return s


def test_reply_timeout_is_how_long_the_server_waits_for_a_receiver_that_does_not_read():
    with Worker() as w:
        h = w.call("share", "a", 8)
        w.call("setting", "reply_timeout", 600.0)
        s = _flood(h._f.address)
        time.sleep(6.0)  # longer than the default (5 s): the setting keeps the reader connected
        assert w.call("peers") == 1, "disconnected although reply_timeout is 600 s"
        s.close()
        assert wait_until(lambda: w.call("peers") == 0, 10)
        w.call("setting", "reply_timeout", 0.2)
        s = _flood(h._f.address)
        assert wait_until(lambda: w.call("peers") == 0, 30), "a receiver that does not read was never disconnected"
        s.close()
        u = tx.attach(h)  # and the sender serves the others
        assert float(np.from_dlpack(u)[3]) == 3.0
        del u


SETTINGS = r"""
import types
import exchange as tx
tx.share                                   # the function first: it once shadowed its module
import exchange.sharing as sharing
from exchange.sharing import settings
assert isinstance(sharing, types.ModuleType) and sharing.settings is settings and tx.share is sharing.share
assert (settings.request_timeout, settings.reply_timeout) == (30.0, 5.0)
settings.request_timeout = 2
settings.reply_timeout = 0.5
assert sharing.protocol.settings.request_timeout == 2.0 and sharing.protocol.settings.reply_timeout == 0.5
errors = []
for name in ("request_timeout", "reply_timeout"):
    for bad in (0, -1, float("nan"), float("inf"), "3", True, None):
        try:
            setattr(settings, name, bad)
        except (TypeError, ValueError) as exc:
            errors.append(name in str(exc))
try:
    settings.request_timout = 1
except AttributeError:
    errors.append(True)
assert errors == [True] * 15, errors
print("OK", settings)
"""


def test_the_settings_are_one_object_under_their_documented_name():
    # Item 8: exchange.share.REQUEST_TIMEOUT raised AttributeError (the function tx.share
    # shadowed the module), and setting it on what `import exchange.share as s` gave did nothing.
    proc = subprocess.run([sys.executable, "-c", SETTINGS], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("OK exchange.sharing.settings(request_timeout=2, reply_timeout=0.5)"), proc.stdout
