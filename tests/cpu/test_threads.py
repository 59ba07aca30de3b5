"""Concurrency and volume: the registry stays consistent under many threads exchanging
at once, and a long run of round trips leaves nothing behind.

The registry is process-wide, so "empty" here means: back to what it held before the
test (nothing, when this file runs alone), with no release pending.
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest

import exchange as tx
from lifetime_helpers import CountingProducer, live_ids, settle

THREADS = 8
PER_THREAD = 2500  # exchanges per thread
JOIN_TIMEOUT = 180.0  # seconds; a deadlock fails the test instead of hanging the suite


def _baseline() -> tuple[dict, set[int]]:
    settle()
    return tx.registry().stats(), live_ids()


def _assert_back_to(before: dict, before_ids: set[int]) -> dict:
    settle()
    after = tx.registry().stats()
    left = [r for r in tx.registry().snapshot() if r.id not in before_ids]
    assert not left, "records left alive: " + "; ".join(r.describe() for r in left[:5])
    assert after["live_records"] == before["live_records"]
    assert after["pending_releases"] == 0
    assert after["exports_outstanding"] == before["exports_outstanding"]
    assert after["imports_outstanding"] == before["imports_outstanding"]
    assert after["live_bytes"] == before["live_bytes"]
    made = after["created_total"] - before["created_total"]
    assert after["released_total"] - before["released_total"] == made
    return after


def test_eight_threads_exporting_importing_and_releasing_at_once():
    before, before_ids = _baseline()
    handoff: queue.Queue = queue.Queue()  # tensors made on one thread, dropped on another
    shared_stream = tx.create_stream()
    producers = [CountingProducer(16, poison=False) for _ in range(THREADS)]
    made = [0] * THREADS
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def worker(i: int) -> None:
        producer = producers[i]
        source = np.arange(16, dtype=np.float32)
        try:
            start.wait()
            for k in range(PER_THREAD):
                op = k % 6
                if op == 0:  # numpy -> us -> numpy
                    t = tx.from_dlpack(source)
                    b = np.from_dlpack(t)
                    assert b[3] == 3.0
                    del t, b
                elif op == 1:  # allocate, export, import our own capsule, hand it to another thread
                    t = tx.empty(8, "int32")
                    u = tx.from_dlpack(t.__dlpack__(max_version=(1, 3)))
                    handoff.put(u)
                    del t, u
                elif op == 2:  # drop what another thread made
                    try:
                        handoff.get_nowait()
                    except queue.Empty:
                        pass
                elif op == 3:  # a producer's capsule, a view, and stream-ordered release
                    t = tx.from_dlpack(producer.capsule())
                    made[i] += 1
                    v = tx.from_dlpack(t)
                    tx.record_stream(v, shared_stream)
                    shared_stream.submit(lambda: None)
                    del t, v
                elif op == 4:  # unconsumed capsules are released by their destructor
                    t = tx.from_dlpack(producer.capsule())
                    made[i] += 1
                    caps = [t.__dlpack__(max_version=(1, 3)), t.__dlpack__()]
                    del t, caps
                else:  # the inspection calls race with all of the above
                    stats = tx.registry().stats()
                    assert stats["live_records"] >= 0
                    tx.registry().snapshot()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT)
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"threads still running after {JOIN_TIMEOUT} s (deadlock?): {stuck}"
    assert not errors, errors[:3]
    while not handoff.empty():
        handoff.get_nowait()
    shared_stream.close()
    after = _assert_back_to(before, before_ids)
    assert after["created_total"] - before["created_total"] >= THREADS * PER_THREAD // 2
    for i, p in enumerate(producers):
        assert not p.errors, p.errors[:3]
        assert p.calls == made[i] and p.outstanding() == 0


@pytest.mark.slow
def test_100k_round_trips_leave_the_registry_empty():
    before, before_ids = _baseline()
    a = np.arange(10, dtype=np.float32)
    for _ in range(100_000):
        b = np.from_dlpack(tx.from_dlpack(a))
    assert b[9] == 9.0
    del b
    after = _assert_back_to(before, before_ids)
    assert after["created_total"] - before["created_total"] == 100_000
    if not before_ids:  # alone in the process: literally nothing left
        assert after["live_records"] == 0 and after["live_bytes"] == {}
