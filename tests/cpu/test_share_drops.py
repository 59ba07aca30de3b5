"""``drop_leases`` against hand-offs taken without asking (issue 27, item 1).

A multiprocessing hand-off from an arena its receiver maps already is taken there with
no round trip; its take reaches the sender up to 2 ms later. A lease that
``drop_leases`` ended before that must never let the receiver read the block once the
sender has handed it out again: the take is refused there (the receiver attaches by a
round trip, and gets LifetimeError), or it reaches the sender before the block is freed
(``drop_leases`` fences every receiver that maps one of its arenas first). Real
processes throughout, every wait bounded.
"""

from __future__ import annotations

import gc
import os
import queue
import random
import signal
import threading
import time

import numpy as np
import pytest

import exchange as tx
from exchange.sharing import drop_leases, settings
from share_fixtures import clean_sharing, warm_sharing  # noqa: F401  (autouse: every test here)
from share_helpers import ANSWER_TIMEOUT, stop, wait_until

REG = tx.registry()


def _filled(value: float, n: int = 256) -> tx.Tensor:
    t = tx.empty(n, "float32", shared=True)
    np.from_dlpack(t)[...] = value
    return t


def _receiver(queues: dict, ctl, out) -> None:
    """Commands on ``ctl``: ("get", name) takes the next item of ``queues[name]`` and
    keeps it, answering ("ok", its first element) or ("err", type, text); ("read",)
    answers the first element of the last one kept; ("exit",) ends."""
    import numpy as np

    import exchange as tx  # noqa: F401  (the reducer)

    held = []
    while True:
        try:
            cmd = ctl.get(timeout=ANSWER_TIMEOUT * 2)
        except queue.Empty:
            return
        try:
            if cmd[0] == "exit":
                return
            if cmd[0] == "get":
                t = queues[cmd[1]].get(timeout=ANSWER_TIMEOUT)
                held.append(t)
                out.put(("ok", float(np.from_dlpack(t)[0])))
            elif cmd[0] == "read":
                out.put(("ok", float(np.from_dlpack(held[-1])[0])))
        except BaseException as exc:
            out.put(("err", type(exc).__name__, str(exc)))


class Receiver:
    """A spawn process running ``_receiver`` over Queues named ``names``."""

    def __init__(self, *names: str) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.queues = {name: ctx.Queue() for name in names}
        self.ctl, self.out = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_receiver, args=(self.queues, self.ctl, self.out), daemon=True)
        self.proc.start()

    def call(self, *cmd) -> tuple:
        self.ctl.put(cmd)
        return self.out.get(timeout=ANSWER_TIMEOUT)

    def close(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGCONT)  # (a test may have stopped it)
            self.ctl.put(("exit",))
            self.proc.join(ANSWER_TIMEOUT)
        stop([self.proc], [*self.queues.values(), self.ctl, self.out])

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _in_transit(q, value: float) -> None:
    """Put a tensor filled with ``value`` on ``q`` and drop this process's reference:
    only the hand-off's lease holds its block once the Queue's feeder has pickled it."""
    leases = REG.stats()["leases_in_transit"]
    q.put(_filled(value))
    gc.collect()
    assert wait_until(lambda: REG.stats()["leases_in_transit"] == leases + 1, 10), "the feeder did not pickle it"


def test_a_hand_off_whose_lease_was_dropped_is_refused_not_another_tensors_memory():
    """The issue's scenario: the receiver maps the arena; a hand-off waits in the Queue
    while the sender drops its lease and fills new tensors with 666; the receiver's
    get raises LifetimeError instead of reading the new tensor's block."""
    with Receiver("q") as r:
        warm = _filled(1.0)
        r.queues["q"].put(warm)
        assert r.call("get", "q") == ("ok", 1.0)  # the receiver maps the arena: the next hand-off is a take
        _in_transit(r.queues["q"], 7.0)
        time.sleep(0.3)
        started = time.monotonic()
        assert drop_leases(older_than=0.2) == 1
        assert time.monotonic() - started < 5, "drop_leases waited for a receiver that answers"
        fresh = [_filled(666.0) for _ in range(8)]  # the freed block is the next one handed out
        reply = r.call("get", "q")
        if reply[0] == "ok":
            for f in fresh:
                np.from_dlpack(f)[...] = 999.0
            pytest.fail(f"the receiver read {reply[1]}, then {r.call('read')[1]}: another tensor's block")
        assert reply[:2] == ("err", "LifetimeError"), reply
        assert "released" in reply[2]
        del warm, fresh


def test_a_dropped_hand_off_is_refused_where_its_arena_was_mapped_after_the_drop():
    """The receiver maps the arena only after the drop (through another attach), then
    unpickles the old hand-off: refused too (the attach that mapped the arena told it
    which leases may have been dropped)."""
    with Receiver("old", "new") as r:
        _in_transit(r.queues["old"], 7.0)
        time.sleep(0.3)
        assert drop_leases(older_than=0.2) == 1
        fresh = [_filled(666.0) for _ in range(8)]
        other = _filled(5.0)
        r.queues["new"].put(other)
        assert r.call("get", "new") == ("ok", 5.0)  # a round trip: maps the arena
        reply = r.call("get", "old")
        assert reply[:2] == ("err", "LifetimeError"), f"the receiver read another tensor's block: {reply}"
        del fresh, other


def _hammered(q, out, n: int) -> None:
    """Take a first tensor (a round trip: the arena is mapped from then on), then ``n``
    items ``(k, tensor filled with k)`` from ``q``, keeping each one taken; then, on a
    word from ``q``, read them all again. Answers (taken, refused, wrong)."""
    import numpy as np

    import exchange as tx

    first = q.get(timeout=ANSWER_TIMEOUT)
    out.put(("ready", float(np.from_dlpack(first)[0])))
    kept, refused, wrong = [], 0, []
    for _ in range(n):
        try:
            k, t = q.get(timeout=ANSWER_TIMEOUT)
        except tx.LifetimeError:
            refused += 1
            continue
        a = np.from_dlpack(t)
        if not (a == k).all():
            wrong.append((k, float(a[0])))
        kept.append((k, t))
    out.put(("taken", len(kept)))
    q.get(timeout=ANSWER_TIMEOUT)  # the sender has handed every freed block out again, rewritten
    for k, t in kept:
        a = np.from_dlpack(t)
        if not (a == k).all():
            wrong.append((k, float(a[0])))
    out.put((len(kept), refused, wrong[:10]))


def test_takes_racing_drop_leases_never_read_another_tensors_block():
    """Hand-offs stream to a receiver that maps the arena while another thread drops
    every lease in transit, again and again; the sender keeps handing freed blocks out
    again. Every tensor the receiver got reads its own values, to the end (it holds
    them all); the others raised LifetimeError."""
    import multiprocessing as mp

    n = 400
    ctx = mp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_hammered, args=(q, out, n), daemon=True)
    p.start()
    dropped = [0]
    done = threading.Event()

    def dropper() -> None:
        pause = random.Random(27)
        while not done.is_set():
            dropped[0] += drop_leases()
            time.sleep(pause.random() * 0.004)  # some hand-offs are taken before a drop, some after

    try:
        first = _filled(2.0)
        q.put(first)  # attached by a round trip: the receiver maps the arena
        assert out.get(timeout=ANSWER_TIMEOUT) == ("ready", 2.0)
        thread = threading.Thread(target=dropper)
        thread.start()
        try:
            for k in range(n):
                q.put((float(k), _filled(float(k))))
                if (k // 16) % 2:  # paced (takes race the drops), then a burst (drops catch hand-offs in the pipe)
                    time.sleep(0.001)
            assert out.get(timeout=ANSWER_TIMEOUT)[0] == "taken"
        finally:
            done.set()
            thread.join(ANSWER_TIMEOUT)
        refill = [_filled(-1.0) for _ in range(n)]  # every block freed under the receiver is rewritten
        q.put("check")
        taken, refused, wrong = out.get(timeout=ANSWER_TIMEOUT)
        print(f"{taken} taken, {refused} refused, {dropped[0]} leases dropped")
        assert not wrong, f"the receiver read other tensors' blocks (expected, read): {wrong}"
        assert taken + refused == n and refused <= dropped[0]
        del refill, first
    finally:
        stop([p], [q, out])
    assert wait_until(lambda: REG.stats()["remote_holders"] == 0, 10)
    drop_leases()  # (none left: every item was taken or refused)


def _stopped(pid: int) -> bool:
    """Every thread of process ``pid`` is stopped (a SIGSTOP takes effect thread by
    thread, as each is scheduled: until then one may still answer)."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat", "rb") as fh:
            states.append(fh.read().rsplit(b")", 1)[1].split()[0])
    return all(state in (b"T", b"t") for state in states)


def test_a_stopped_receiver_keeps_the_hand_offs_leases_and_a_later_call_drops_them():
    """A receiver that maps an arena and does not answer the fence (SIGSTOP) within
    ``request_timeout``: the multiprocessing hand-offs' leases stay (it might still
    take one), the others are dropped; once it runs again, the next call drops them."""
    old = settings.request_timeout
    with Receiver("q") as r:
        warm = _filled(1.0)
        r.queues["q"].put(warm)
        assert r.call("get", "q") == ("ok", 1.0)
        _in_transit(r.queues["q"], 7.0)
        plain = tx.share(_filled(3.0))  # a handle of ours: attached only by asking
        os.kill(r.proc.pid, signal.SIGSTOP)
        try:
            assert wait_until(lambda: _stopped(r.proc.pid), 10)
            settings.request_timeout = 1.0
            started = time.monotonic()
            assert drop_leases() == 1, "the hand-off's lease was dropped while its receiver could still take it"
            waited = time.monotonic() - started
            assert 0.9 <= waited < 10, waited
            assert REG.stats()["leases_in_transit"] == 1
        finally:
            settings.request_timeout = old
            os.kill(r.proc.pid, signal.SIGCONT)
        assert drop_leases() == 1  # it answers now
        assert REG.stats()["leases_in_transit"] == 0
        reply = r.call("get", "q")
        assert reply[:2] == ("err", "LifetimeError"), reply
        del warm, plain
