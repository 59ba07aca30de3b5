"""The ownership registry (``tx.registry()``) and ``tx.track``.

One record per piece of memory (allocated, imported, borrowed) with holders, streams,
state, origin and label; ``stats()``, ``snapshot()``, ``collect()``; ``track()`` raising
LeakError (or warning) for what a block left alive; EXCHANGE_DEBUG=1 keeping where each
record was made. The registry is process-wide, so every check here is a difference
from the state before the test, never an absolute count.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import exchange as tx
from lifetime_helpers import CountingProducer, Gate, no_leaks

REPO = Path(__file__).resolve().parents[2]
STATS_KEYS = {"live_records", "live_bytes", "exports_outstanding", "imports_outstanding",
              "pending_releases", "created_total", "released_total"}


@pytest.fixture
def reg():
    with no_leaks() as registry:
        yield registry


def test_registry_is_one_per_process(reg):
    assert tx.registry() is reg
    assert isinstance(reg, tx.Registry)


def test_stats_has_every_documented_key(reg):
    stats = reg.stats()
    assert STATS_KEYS <= set(stats)
    assert isinstance(stats["live_bytes"], dict)
    for key in STATS_KEYS - {"live_bytes"}:
        assert isinstance(stats[key], int) and stats[key] >= 0


def test_allocated_record(reg):
    before = reg.stats()
    t = tx.empty((4, 5), "float32")
    rec = t.record
    assert rec.origin == "allocated"
    assert rec.device == tx.Device.parse("cpu")
    assert rec.nbytes == 80
    assert rec.address == t.data_ptr and rec.address % 64 == 0
    assert rec.state == "live"
    assert rec.holders == ["tx.Tensor"]
    assert rec.streams == []
    assert rec.label is None
    assert rec in reg.snapshot()
    after = reg.stats()
    assert after["live_records"] == before["live_records"] + 1
    assert after["live_bytes"].get("cpu", 0) == before["live_bytes"].get("cpu", 0) + 80
    assert after["created_total"] == before["created_total"] + 1
    assert after["imports_outstanding"] == before["imports_outstanding"]
    del t
    assert rec.state == "released"
    assert rec not in reg.snapshot()
    final = reg.stats()
    assert final["live_records"] == before["live_records"]
    assert final["released_total"] == before["released_total"] + 1


def test_imported_record_names_its_producer(reg):
    a = np.arange(6, dtype=np.float64)
    before = reg.stats()
    t = tx.from_dlpack(a)
    rec = t.record
    assert rec.origin == "imported from numpy.ndarray"
    assert rec.address == a.ctypes.data and rec.nbytes == 48
    assert reg.stats()["imports_outstanding"] == before["imports_outstanding"] + 1
    del t
    assert rec.state == "released"
    assert reg.stats()["imports_outstanding"] == before["imports_outstanding"]


def test_imported_from_a_bare_capsule_and_from_torch(reg):
    torch = pytest.importorskip("torch")
    producer = CountingProducer(8)
    t = tx.from_dlpack(producer.capsule())
    assert t.record.origin == "imported from a DLPack capsule"
    u = tx.from_dlpack(torch.arange(4, dtype=torch.float32))
    assert u.record.origin == "imported from torch.Tensor"
    del t, u
    assert producer.calls == 1


def test_borrowed_record_with_label(reg):
    buf = bytearray(32)
    with tx.borrow(buf, label="scratch") as view:
        rec = view.record
        assert rec.origin == "borrowed"
        assert rec.label == "scratch"
        assert rec.nbytes == 32
        assert rec.holders == ["tx.borrow view"]
        assert rec.state == "live"
        assert "scratch" in rec.describe()
        assert rec in reg.snapshot()
    assert rec.state == "released"
    assert rec not in reg.snapshot()


def test_holders_track_tensors_and_exports(reg):
    before = reg.stats()
    t = tx.empty(8, "int32")
    rec = t.record
    view = tx.from_dlpack(t)  # a second view over the same record
    assert view.record is rec
    assert rec.holders == ["tx.Tensor", "tx.Tensor"]
    cap = t.__dlpack__(max_version=(1, 3))
    assert len(rec.holders) == 3 and any(h.startswith("DLPack export #") for h in rec.holders)
    assert reg.stats()["exports_outstanding"] == before["exports_outstanding"] + 1
    arr = np.from_dlpack(t)  # a consumed export stays a holder until numpy lets go
    assert reg.stats()["exports_outstanding"] == before["exports_outstanding"] + 2
    del cap  # an unconsumed capsule's destructor releases its export
    assert reg.stats()["exports_outstanding"] == before["exports_outstanding"] + 1
    del t, view
    assert rec.state == "live" and len(rec.holders) == 1
    del arr
    assert rec.state == "released"
    assert reg.stats()["exports_outstanding"] == before["exports_outstanding"]


def test_streams_are_recorded_once(reg):
    s1, s2 = tx.create_stream(), tx.create_stream()
    t = tx.empty(4)
    tx.record_stream(t, s1)
    tx.record_stream(t, s1)
    tx.record_stream(t, s2)
    assert t.record.streams == [s1, s2]
    u = tx.from_dlpack(np.zeros(3), stream=s2)
    assert u.record.streams == [s2]
    del t, u
    s1.close()
    s2.close()


def test_live_bytes_per_device_and_snapshot_order(reg):
    before = reg.stats()["live_bytes"].get("cpu", 0)
    ts = [tx.empty(n, "uint8") for n in (10, 20, 30)]
    assert reg.stats()["live_bytes"]["cpu"] == before + 60
    snap = reg.snapshot()
    ids = [r.id for r in snap]
    assert ids == sorted(ids)
    mine = [r for r in snap if r in {t.record for t in ts}]
    assert [r.nbytes for r in mine] == [10, 20, 30]
    assert all(r.state == "live" for r in snap)
    del ts, mine, snap
    assert reg.stats()["live_bytes"].get("cpu", 0) == before


def test_collect_returns_false_on_timeout_then_true(reg):
    s = tx.create_stream()
    gate = Gate()
    t = tx.empty(16)
    rec = t.record
    tx.record_stream(t, s)
    s.submit(gate)
    del t
    assert rec.state == "releasing"
    assert reg.stats()["pending_releases"] >= 1
    assert rec in reg.snapshot()  # releasing records are still listed
    assert reg.collect(timeout=0.05) is False
    assert rec.state == "releasing"
    gate.open()
    assert reg.collect(timeout=10) is True
    assert rec.state == "released"
    assert reg.collect() is True  # nothing pending: returns at once
    s.close()


def test_registry_calls_from_many_threads_agree(reg):
    # stats/snapshot/collect race with records being made and dropped
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            while not stop.is_set():
                t = tx.empty(8)
                tx.from_dlpack(t)
                del t
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def inspect() -> None:
        try:
            for _ in range(300):
                s = reg.stats()
                assert s["live_records"] >= 0 and s["pending_releases"] >= 0
                for r in reg.snapshot():
                    assert r.state in ("live", "releasing", "released")
                reg.collect(timeout=1)
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    workers = [threading.Thread(target=churn) for _ in range(2)]
    inspector = threading.Thread(target=inspect)
    for w in workers:
        w.start()
    inspector.start()
    inspector.join(60)
    stop.set()
    for w in workers:
        w.join(60)
    assert not inspector.is_alive() and not any(w.is_alive() for w in workers)
    assert not errors, errors


def test_debug_mode_keeps_where_a_record_was_made(reg, monkeypatch):
    monkeypatch.setattr(reg, "debug", True)
    t = tx.empty(4)
    assert t.record.where and "test_debug_mode_keeps_where_a_record_was_made" in t.record.where
    assert "made at" in t.record.describe()
    monkeypatch.setattr(reg, "debug", False)
    u = tx.empty(4)
    assert u.record.where is None


def test_exchange_debug_environment_variable():
    code = textwrap.dedent("""
        import exchange as tx
        def make_it():
            return tx.empty(3)
        t = make_it()
        print(tx.registry().debug, "make_it" in (t.record.where or ""))
    """)
    out = {}
    for value in ("1", ""):
        env = dict(os.environ, EXCHANGE_DEBUG=value)
        r = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        out[value] = r.stdout.split()
    assert out["1"] == ["True", "True"]
    assert out[""] == ["False", "False"]


# -- tx.track ---------------------------------------------------------------------------
def test_track_passes_when_everything_is_released(reg):
    with tx.track() as r:
        assert r is reg
        t = tx.empty(10)
        a = np.from_dlpack(t)
        u = tx.from_dlpack(np.ones(3))
        del t, a, u


def test_track_raises_leak_error_naming_every_leak(reg):
    keep = []
    with pytest.raises(tx.LeakError) as info:
        with tx.track():
            keep.append(tx.empty(5, "float32"))
            keep.append(tx.from_dlpack(np.arange(4.0)))
            buf = bytearray(8)
            with tx.borrow(buf, label="scratch"):
                pass  # closed and released: not a leak
            tx.empty(7)  # dropped at once: not a leak
    message = str(info.value)
    assert "2 record(s)" in message
    for t in keep:
        assert f"#{t.record.id}" in message
    assert "allocated" in message and "imported from numpy.ndarray" in message
    assert "held by tx.Tensor" in message
    assert "scratch" not in message
    keep.clear()


def test_track_ignores_records_made_before_the_block(reg):
    old = tx.empty(3)
    with tx.track():
        view = tx.from_dlpack(old)  # a new holder of an old record, dropped in the block
        del view
    del old


def test_track_in_debug_mode_says_where_the_leak_was_made(reg, monkeypatch):
    monkeypatch.setattr(reg, "debug", True)
    keep = []

    def leaky_helper() -> None:
        keep.append(tx.empty(2))

    with pytest.raises(tx.LeakError, match="leaky_helper"):
        with tx.track():
            leaky_helper()
    keep.clear()


def test_track_non_strict_warns(reg):
    keep = []
    with pytest.warns(tx.ExchangeWarning, match="still alive"):
        with tx.track(strict=False):
            keep.append(tx.empty(2))
    keep.clear()


def test_track_waits_for_pending_releases(reg):
    # The last holder goes inside the block while a host stream still uses the memory;
    # the stream finishes a little later. track() must wait for it, not report a leak.
    s = tx.create_stream()
    gate = Gate()
    with tx.track():
        t = tx.empty(64)
        rec = t.record
        tx.record_stream(t, s)
        s.submit(gate)
        del t
        assert rec.state == "releasing"
        threading.Timer(0.1, gate.open).start()
    assert rec.state == "released"
    s.close()


def test_track_nested_raises_and_the_outer_block_still_works(reg):
    keep = []
    with pytest.raises(tx.LeakError):
        with tx.track():
            with pytest.raises(RuntimeError, match="nested"):
                with tx.track():
                    pass  # pragma: no cover
            keep.append(tx.empty(1))
    keep.clear()
    with tx.track():  # the flag was reset: a new block works
        pass


def test_track_does_not_mask_the_blocks_own_error(reg):
    with pytest.raises(KeyError):
        with tx.track():
            t = tx.empty(1)  # noqa: F841  (alive when the error leaves the block)
            raise KeyError("boom")
    with tx.track():
        pass


# -- bad input ------------------------------------------------------------------------------
def test_collect_runs_in_several_threads_at_once_and_loses_nothing(reg):
    # Issue 14 item 4: collect() may run in several threads at once (it used to raise
    # RuntimeError for the second); each waits, and the release runs exactly once.
    s = tx.create_stream()
    gate = Gate()
    producer = CountingProducer(4)
    t = tx.from_dlpack(producer.capsule(), stream=s)
    rec = t.record
    s.submit(gate)
    before = reg.stats()
    del t
    results: list[bool] = []
    waiters = [threading.Thread(target=lambda: results.append(reg.collect(20))) for _ in range(3)]
    for w in waiters:
        w.start()
    assert reg.collect(timeout=0) is False  # a fourth, on this thread, at the same time
    assert rec.state == "releasing" and producer.calls == 0
    gate.open()
    for w in waiters:
        w.join(20)
    assert not any(w.is_alive() for w in waiters) and results == [True, True, True]
    assert rec.state == "released" and producer.calls == 1 and not producer.errors
    assert reg.stats()["released_total"] == before["released_total"] + 1
    s.close()


@pytest.mark.parametrize("timeout", ["5", [1], -1.0, float("nan"), True])
def test_collect_refuses_a_timeout_that_is_not_seconds(reg, timeout):
    # Issue 14 item 11: a clear TypeError / ValueError, not a raw error from deep inside.
    with pytest.raises((TypeError, ValueError), match="timeout"):
        reg.collect(timeout=timeout)


def test_totals_add_up(reg):
    before = reg.stats()
    keep = [tx.empty(2), tx.from_dlpack(np.ones(2))]
    mid = reg.stats()
    assert mid["created_total"] - mid["released_total"] - (before["created_total"] - before["released_total"]) == 2
    assert mid["live_records"] == before["live_records"] + 2
    keep.clear()
    after = reg.stats()
    assert after["created_total"] - after["released_total"] == before["created_total"] - before["released_total"]
