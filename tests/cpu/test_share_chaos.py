"""Chaos across processes (issue 19): 50 rounds in which a worker process is killed with
SIGKILL at a random point of sharing, attaching, holding or releasing, as the sender or
as the receiver, while this process (the survivor) goes on with its side of the round.
After each round the survivor drops its tensors and must be left with nothing: no
descriptor (socket, pidfd, memory file), no mapping, no byte, no holder or lease.

The kill point is the N-th line of the sharing machinery run by one thread of the
victim (its main thread, or its serving thread), SIGKILL from inside (share_helpers'
``arm_kill``); the rounds, their steps and their kill points come from one seed, printed
and in every failure message. Replay one with ``TX_CHAOS_SEED=<seed>``.
"""

from __future__ import annotations

import collections
import gc
import os
import queue
import random
import time

import numpy as np

import exchange as tx
from share_fixtures import clean_sharing, warm_sharing  # noqa: F401  (autouse: every test here)
from share_helpers import ANSWER_TIMEOUT, Worker, fd_count, memfd_count, wait_until

from exchange.devices.cpu import arena_stats

REG = tx.registry()
ROUNDS = 50
DEAD = object()


def _call(w: Worker, op: str, *args):
    """The worker's answer to ``op``: its value, an ("err", type, text) tuple for an error
    it reported, or DEAD when it died first."""
    if not w.proc.is_alive():
        return DEAD
    try:
        w.send(op, *args)
    except (OSError, ValueError):
        return DEAD
    deadline = time.monotonic() + ANSWER_TIMEOUT
    while time.monotonic() < deadline:
        try:
            reply = w.outbox.get(timeout=0.05)
        except queue.Empty:
            if w.proc.is_alive():
                continue
            try:
                reply = w.outbox.get(timeout=0.5)  # an answer sent just before it died
            except (queue.Empty, EOFError, OSError):
                return DEAD
        except (EOFError, OSError):  # it died while sending the answer
            return DEAD
        return reply[1] if reply[0] == "ok" else reply
    raise AssertionError(f"worker {w.pid} alive but silent for {ANSWER_TIMEOUT} s after {op}")


def _fd_names() -> dict:
    names = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            names[name] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return names


def _new_fds(before: dict) -> dict:
    return {k: v for k, v in _fd_names().items() if before.get(k) != v}


def _values(t) -> list:
    return np.from_dlpack(t).reshape(-1).tolist()


def _victim_sends(rng: random.Random, w: Worker, note) -> tuple[list, list]:
    """The victim shares; this process attaches, reads, holds and releases. Returns what
    this process holds (tensors, handles) when the round ends."""
    held, handles = [], []
    for k in range(rng.randint(2, 6)):
        n, start = rng.choice((1, 7, 1024, 1 << 16)), float(100 * k)
        h = _call(w, rng.choice(("share", "share", "share_private")), k, n, start)
        note(f"share {k}")
        if h is DEAD or isinstance(h, tuple):
            break
        handles.append(h)
        for _ in range(rng.randint(0, 2)):
            try:
                t = tx.attach(h)
            except (tx.LifetimeError, tx.ExchangeError) as exc:  # the sender died meanwhile
                note(f"attach {k}: {type(exc).__name__}")
                continue
            assert _values(t)[:3] == [start, start + 1, start + 2][: min(3, n)], (k, _values(t)[:3])
            held.append(t)
            note(f"attach {k}")
        if rng.random() < 0.5 and _call(w, "drop", k) is DEAD:  # the sender lets go of its own tensor
            break
        if held and rng.random() < 0.4:
            held.pop(rng.randrange(len(held)))  # a release to the sender
            note("release")
        if rng.random() < 0.2:
            handles[-1].close()
            note(f"close {k}")
    for t in held:  # CPU memory stays valid after the sender died
        assert _values(t)[0] % 100 == 0
    return held, handles


def _victim_receives(rng: random.Random, w: Worker, note) -> tuple[list, list]:
    """This process shares; the victim attaches, holds, shares on and releases; this
    process attaches what the victim shares on."""
    mine, handles, held = [], [], []
    for k in range(rng.randint(2, 6)):
        n, start = rng.choice((1, 7, 1024, 1 << 16)), float(100 * k)
        t = tx.empty(n, "float32", shared=True) if rng.random() < 0.7 else tx.from_dlpack(np.empty(n, np.float32))
        np.from_dlpack(t)[:] = np.arange(n, dtype=np.float32) + start
        mine.append(t)
        h = tx.share(t)
        handles.append(h)
        if _call(w, "attach", k, h) is DEAD:
            break
        note(f"peer attach {k}")
        if rng.random() < 0.4:
            h2 = _call(w, "share_held", k)  # the victim shares on what it attached
            if h2 is DEAD:
                break
            if not isinstance(h2, tuple):
                handles.append(h2)
                try:
                    held.append(tx.attach(h2))
                    note(f"attach shared-on {k}")
                except (tx.LifetimeError, tx.ExchangeError) as exc:
                    note(f"attach shared-on {k}: {type(exc).__name__}")
        if rng.random() < 0.5 and _call(w, "drop", k) is DEAD:
            break
        if mine and rng.random() < 0.3:
            mine.pop(rng.randrange(len(mine)))  # this process lets go: the victim's hold keeps it
    return mine + held, handles


def _round(seed: int, r: int, rng: random.Random, baseline: dict) -> str:
    role = rng.choice(("sends", "receives"))
    thread = rng.choice(("main", "tx-runtime"))
    # A victim's round runs about 700-2000 lines of sharing on its main thread and
    # 100-400 on its serving thread: a point beyond what it runs is a kill at rest (holding).
    at = rng.randint(1, 2000 if thread == "main" else 450)
    steps: list[str] = []
    where = f"chaos seed {seed}, round {r}: the victim {role}, SIGKILL at line {at} of its {thread} thread"
    w = Worker()
    try:
        assert _call(w, "arm_kill", thread, at) is None
        play = _victim_sends if role == "sends" else _victim_receives
        held, handles = play(rng, w, steps.append)
        steps.append("killed by then" if not w.proc.is_alive() else "alive: SIGKILL now")
        w.kill()
    finally:
        w.close()
    # The survivor lets go: its handles (the leases of those the victim never attached),
    # then its tensors.
    for h in handles:
        try:
            h.close()
        except tx.ExchangeError:
            pass
    del held, handles, w  # (the worker object holds its Queues' pipes)
    gc.collect()

    def clean() -> bool:  # (this process's own arenas stay, for reuse: one descriptor and mapping each)
        stats, arenas = REG.stats(), arena_stats()
        return (stats["live_records"] == baseline["live_records"] and stats["remote_holders"] == 0
                and stats["leases_in_transit"] == 0 and not stats["live_bytes"] and arenas["blocks_in_use"] == 0
                and fd_count() - arenas["arenas"] <= baseline["fds"]
                and memfd_count() == (arenas["arenas"], arenas["arenas"]))

    assert wait_until(clean, 10), (f"{where}; steps {steps}: left behind {REG.stats()}, {arena_stats()}, descriptors "
                                   f"{fd_count()} (before {baseline['fds']} besides arenas: new "
                                   f"{_new_fds(baseline['fd_names'])}), shared memory {memfd_count()}")
    return f"{where}: {', '.join(steps)}"


def test_fifty_rounds_of_sigkill_at_random_points_leave_nothing_on_the_surviving_side():
    seed = int(os.environ.get("TX_CHAOS_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"chaos seed {seed} (replay: TX_CHAOS_SEED={seed})")
    rng = random.Random(seed)
    gc.collect()
    baseline = {"live_records": REG.stats()["live_records"], "fds": fd_count() - arena_stats()["arenas"],
                "fd_names": _fd_names()}
    assert not REG.stats()["live_bytes"], "a clean start"
    for r in range(ROUNDS):
        print(_round(seed, r, rng, baseline))


# -- arenas: 10,000 hand-offs through a Queue, receivers killed at random points -----------------
HANDOFFS = 10_000
KILLS = 8
WINDOW = 64  # hand-offs sent and not yet acknowledged, at most


def test_ten_thousand_hand_offs_with_receivers_killed_leave_every_block_accounted_for():
    """This process hands 10,000 tensors of its arenas through a Queue to receivers, each
    holding a few, taking and releasing in batches, at most 64 hand-offs ahead of the
    receiver; SIGKILL strikes eight of them after a seeded number of hand-offs and a
    seeded pause (mid-stream: tensors in the pipe, takes and releases waiting for their
    batch). After the last receiver ends, every block still out is a lease in transit
    (a hand-off its receiver never took) and nothing else, and
    ``exchange.sharing.drop_leases()`` brings every block back. Replay with
    ``TX_CHAOS_SEED``."""
    import multiprocessing as mp
    import signal

    from exchange.sharing import drop_leases
    from share_helpers import arena_receiver

    seed = int(os.environ.get("TX_CHAOS_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"chaos seed {seed} (replay: TX_CHAOS_SEED={seed})")
    rng = random.Random(seed)
    where = f"chaos seed {seed}"
    gc.collect()
    live, blocks = REG.stats()["live_records"], arena_stats()["blocks_in_use"]
    kills = sorted(rng.sample(range(100, HANDOFFS), KILLS)) + [HANDOFFS]
    ctx = mp.get_context("spawn")
    sent, errors, received = 0, [], 0
    for n, stop_at in enumerate(kills):
        inbox, report = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=arena_receiver, args=(inbox, report, seed + n), daemon=True)
        p.start()
        first, acked = sent, 0
        try:
            assert report.get(timeout=ANSWER_TIMEOUT) == ("ready", 0), where
            while sent < stop_at:
                while sent - first - acked >= WINDOW:
                    kind, value = report.get(timeout=ANSWER_TIMEOUT)
                    if kind == "error":
                        errors.append(value)
                    acked = max(acked, value)
                t = tx.empty(rng.choice((16, 256, 4096)), "float32", shared=True)
                np.from_dlpack(t)[0] = sent
                inbox.put(t)
                del t
                sent += 1
            if stop_at < HANDOFFS:
                time.sleep(rng.random() * 0.005)  # it is taking what was sent (about 10 a ms)
                os.kill(p.pid, signal.SIGKILL)
            else:
                inbox.put(None)
            p.join(ANSWER_TIMEOUT)
            assert p.exitcode is not None, f"{where}: receiver {n} did not end"
            while True:
                try:
                    kind, value = report.get(timeout=0.2 if stop_at < HANDOFFS else ANSWER_TIMEOUT)
                except queue.Empty:
                    break
                if kind == "error":
                    errors.append(value)
                elif kind == "done":
                    received = value
                    break
        finally:
            if p.is_alive():
                p.kill()
                p.join(ANSWER_TIMEOUT)
            inbox.close()
            inbox.join_thread()  # everything put is in the pipe: a dead receiver's unread hand-offs stay there
            report.close()
    assert not errors, f"{where}: {errors[:5]}"
    assert received == HANDOFFS - kills[-2], f"{where}: the last receiver took {received} hand-offs"
    gc.collect()

    def settled() -> bool:
        stats = REG.stats()
        out = arena_stats()["blocks_in_use"] - blocks
        in_transit = [r for r in REG.snapshot() if r.holders and all(h.endswith("(in transit)") for h in r.holders)]
        return stats["remote_holders"] == 0 and out == len(in_transit) == stats["live_records"] - live

    assert wait_until(settled, 20), (f"{where}: blocks out {arena_stats()}, {REG.stats()}, holders "
                                      f"{collections.Counter(str(r.holders)[:40] for r in REG.snapshot()).most_common(8)}")
    lost = REG.stats()["leases_in_transit"]
    print(f"{where}: {HANDOFFS} hand-offs, {KILLS} receivers killed, {lost} hand-offs never taken")
    drop_leases()
    assert wait_until(lambda: arena_stats()["blocks_in_use"] == blocks and REG.stats()["live_records"] == live, 10), \
        (where, arena_stats(), REG.stats())
