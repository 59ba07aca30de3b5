"""The core seam (exchange/_core): one table of release, holder and capsule cases run
through the compiled core and through its pure-Python twin, each in a child process
chosen by EXCHANGE_PURE_PYTHON, with identical results asked of both; and the API both
faces give, name for name.

A case returns plain data (record ids made relative, exceptions as their type and
message), so that any difference between the paths shows up as a diff of two dicts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPILED_BUILT = importlib.util.find_spec("exchange._native") is not None

CASES = r'''
import copy, gc, json, sys, warnings
import numpy as np
import exchange as tx
from exchange import _core

reg = tx.registry()


def stats(*keys):
    s = reg.stats()
    return {k: s[k] for k in keys}


def error(fn):
    try:
        fn()
    except BaseException as exc:
        return [type(exc).__name__, str(exc)]
    return None


def no_stream_release():
    before = reg.stats()
    t = tx.empty(4)
    rec = t.record
    live = [rec.state, rec.kind, rec.origin, rec.holders, rec.nbytes]
    mid = reg.stats()
    del t
    after = reg.stats()
    return {"live": live, "after": rec.state,
            "made": mid["created_total"] - before["created_total"],
            "released": after["released_total"] - before["released_total"],
            "bytes": [mid["live_bytes"].get("cpu", 0) - before["live_bytes"].get("cpu", 0),
                      after["live_bytes"].get("cpu", 0) - before["live_bytes"].get("cpu", 0)]}


def holders_in_order():
    t = tx.empty(2)
    rec = t.record
    view = copy.copy(t)
    cap = t.__dlpack__(max_version=(1, 3))
    seen = [len(rec.holders), sorted(h.split(" #")[0] for h in rec.holders)]
    del t
    seen.append([rec.state, len(rec.holders)])
    del cap
    seen.append([rec.state, len(rec.holders)])
    del view
    seen.append([rec.state, len(rec.holders)])
    return seen


def export_then_consumer_deleter():
    base = reg.stats()["exports_outstanding"]
    t = tx.empty(3, "int32")
    rec = t.record
    arr = np.from_dlpack(t)
    out = [reg.stats()["exports_outstanding"] - base]
    del t
    out.append(rec.state)
    del arr
    out += [rec.state, reg.stats()["exports_outstanding"] - base]
    return out


def unconsumed_capsule_released():
    t = tx.empty(1)
    rec = t.record
    cap = t.__dlpack__()
    del t
    state = rec.state
    del cap
    return [state, rec.state]


def own_capsule_comes_back():
    base = stats("exports_outstanding", "live_records")
    t = tx.empty(5)
    cap = t.__dlpack__(max_version=(1, 3))
    back = tx.from_dlpack(cap)
    out = {"same_record": back.record is t.record, "holders": len(t.record.holders),
           "delta": {k: v - base[k] for k, v in stats("exports_outstanding", "live_records").items()},
           "again": error(lambda: tx.from_dlpack(cap))}
    rec = t.record
    del t, back
    out["after"] = rec.state
    return out


def import_releases_once():
    base = stats("imports_outstanding", "live_records")
    a = np.arange(6, dtype=np.float64)
    t = tx.from_dlpack(a)
    rec = t.record
    out = {"kind": rec.kind, "origin": rec.origin, "readonly": t.readonly, "mutability": t.mutability,
           "delta": {k: v - base[k] for k, v in stats("imports_outstanding", "live_records").items()}}
    v = copy.copy(t)
    del t
    out["held_by_view"] = rec.state
    del v
    out["after"] = [rec.state, {k: v - base[k] for k, v in stats("imports_outstanding", "live_records").items()}]
    return out


def legacy_capsule_is_read_only():
    a = np.arange(3, dtype=np.float32)
    t = tx.from_dlpack(a.__dlpack__())
    return {"readonly": t.readonly, "mutability": t.mutability, "legacy_export": error(lambda: t.__dlpack__()),
            "versioned_flags": error(lambda: t.__dlpack__(max_version=(1, 0)))}


def refused_capsules():
    a = np.arange(3, dtype=np.float32)
    cap = a.__dlpack__(max_version=(1, 3))
    t = tx.from_dlpack(cap)
    out = {"consumed": error(lambda: tx.from_dlpack(cap)), "not_capsule": error(lambda: tx.from_dlpack(3))}
    del t
    return out


def stream_ordered_release():
    s = tx.create_stream("cpu")
    t = tx.empty(8)
    rec = t.record
    tx.record_stream(t, s)
    s.submit(lambda: None)
    del t
    reg.collect(timeout=10)
    return [rec.state, len(rec.streams)]


def failing_release_warns():
    t = tx.empty(4)
    rec = t.record
    real = rec._release

    def boom():
        real()
        raise OSError("free failed")

    rec._release = boom
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del t
    return [rec.state, [str(w.message).replace(str(rec.id), "N") for w in caught]]


def holder_after_release():
    t = tx.empty(1)
    rec = t.record
    del t
    return [[m.replace(f"#{rec.id} ", "#N ") for m in error(lambda: reg.add_holder(rec, "late"))], rec.state]


def held_record_discarded():
    base = reg.stats()
    rec, token = reg.new_held_record(tx.Device.parse("cpu"), 4096, 16, "test", "imported", None, None, "L",
                                     "a holder")
    out = [rec.label, rec.holders, token > 0, rec.origin]
    reg.discard(rec)
    after = reg.stats()
    return out + [rec.state, after["created_total"] - base["created_total"],
                  after["released_total"] - base["released_total"],
                  after["imports_outstanding"] - base["imports_outstanding"]]


def trace_hears_records_gone():
    registry_module = sys.modules["exchange.registry"]

    gone = []
    registry_module.set_note_gone(lambda r: gone.append(r.nbytes))
    try:
        t = tx.empty(7, "uint8")
        del t
    finally:
        registry_module.set_note_gone(None)
    return gone


def peek_reads_without_consuming():
    a = np.arange(12, dtype=np.int16).reshape(3, 4)
    cap = a.__dlpack__(max_version=(1, 3))
    info = _core.peek(cap)
    t = tx.from_dlpack(cap)
    return [info[0], info[2:5], info[6:], list(t.shape)]  # not info[5]: the data's address


def tracked_leak():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tx.track(strict=False):
            kept = tx.empty(2)
    return [len(caught), "still alive" in str(caught[0].message), kept.record.state]


def counters_and_peak():
    reg.reset_peak()
    t = tx.empty(1024, "uint8")
    peak = reg.end_peak()
    return [peak >= 1024, reg.pending_bytes(t.device)]


def streaming_copy():
    # Sizes and offsets on either side of what streams past the cache (1 MiB, 16-byte
    # aligned stores): the same bytes as NumPy's copy, and the errors.
    src = np.random.default_rng(7).integers(0, 256, (3 << 20) + 77, dtype=np.uint8)
    out = []
    for n, d_off, s_off in [(0, 0, 0), (100, 3, 5), ((1 << 20) - 1, 0, 0), (1 << 20, 1, 0), ((3 << 20) + 13, 7, 64)]:
        dst = np.zeros(n + d_off + 16, dtype=np.uint8)
        _core.copy_streaming(dst.ctypes.data + d_off, src.ctypes.data + s_off, n)
        out.append(bool((dst[d_off:d_off + n] == src[s_off:s_off + n]).all()) and not dst[:d_off].any()
                   and not dst[d_off + n:].any())
    return [out, error(lambda: _core.copy_streaming(0, src.ctypes.data, -1)),
            error(lambda: _core.copy_streaming(0, src.ctypes.data, 4))]


def element_bytes():
    # A tensor's _nbytes (what a chain's hop report reads, with no closed check): its
    # nbytes, for shapes with and without zeros and itemsizes 1 to 16.
    arrays = [np.zeros((3, 4), np.float32), np.zeros(0), np.zeros((2, 0, 3), np.int8), np.zeros(5, np.bool_),
              np.zeros((7,), np.complex128), np.zeros((), np.float64), np.zeros((2, 3, 4, 5), np.uint16)]
    tensors = [tx.from_dlpack(a) for a in arrays]
    return [[t._nbytes, t.nbytes] for t in tensors]


def stage_call():
    # A chain stage's hot path: the hop noted as (template, nbytes) before the call, the
    # call's milliseconds added to acc[index]; a failing call leaves its hop and no time.
    t = tx.from_dlpack(np.zeros((2, 3), np.float32))
    hops, acc = [], [0.0, 0.0]
    out = _core.call_stage(lambda a: a * 2, 21, t, hops, "template", acc, 1)
    failed = error(lambda: _core.call_stage(lambda a: 1 / 0, 1, t, hops, "template", acc, 0))
    refused = [error(lambda: _core.call_stage(len, [], object(), [], None, [0.0], 0)),
               error(lambda: _core.call_stage(len, [], t, [], None, [0.0], 1))]
    return [out, hops, acc[0] == 0.0, acc[1] > 0.0, failed, refused]


def host_queue():
    # A host stream's queue: items run in order (a put_in in its context), what one lets
    # out goes to on_error, dropped items to drop, the stop to on_stop; puts refused once
    # closed; in a forked child the queued items come out unrun.
    import contextvars
    import threading
    import time
    var = contextvars.ContextVar("tx_seam_var", default="unset")
    ctx = contextvars.copy_context()
    ctx.run(var.set, "in its context")
    q = _core.HostQueue()
    seen, errors, dropped, stopped = [], [], [], []
    queued = [q.put(seen.append, (1,), None), q.put_in(ctx, lambda: seen.append(var.get())),
              q.put(lambda: 1 / 0, (), None), q.seq, q.done, q.pending]
    worker = threading.Thread(target=q.run, args=(lambda: stopped.append(True),
                                                  lambda exc, fn: errors.append(type(exc).__name__),
                                                  lambda fn, tag: dropped.append(tag)))
    worker.start()
    deadline = time.monotonic() + 10
    while q.done < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    q.dropping = True
    q.put(seen.append, (2,), "a tag")
    closing = [q.close(), q.close(), q.put(seen.append, (3,), None), q.put_in(ctx, seen.append, 4), q.closed]
    worker.join(10)
    refused = [error(lambda: q.put(1, (), None))[0], error(lambda: q.put(len, [], None))[0],
               error(lambda: q.put_in({}, len))[0], error(lambda: q.put_in(ctx, 1))[0]]
    forked = _core.HostQueue()
    forked.put(seen.append, (5,), "t")
    forked.put_in(ctx, len, "x")
    items = forked.after_fork()
    after = [[(fn == seen.append, args, tag) for fn, args, tag in items][0], len(items), forked.pending,
             forked.closed, forked.dropping, forked.put(len, ("y",), None)]
    return [queued, seen, errors, dropped, stopped, closing, q.seq, q.done, worker.is_alive(), refused, after]


def tensors_in_one_call():
    # A set's version: many tensors over one record, each a holder; a bad entry leaves
    # no holder behind.
    from exchange.dtypes import dtype
    base = np.arange(64, dtype=np.float32)
    whole = tx.from_dlpack(base)
    rec = whole.record
    f32 = dtype("float32")
    made = _core.new_tensors(rec, base.ctypes.data, [(0, (2, 3), (3, 1), f32), (64, (4,), (1,), f32)], True)
    view = [len(rec.holders), [list(t.shape) for t in made], [t.readonly for t in made],
            [np.from_dlpack(t).tolist() for t in made]]
    bad = error(lambda: _core.new_tensors(rec, base.ctypes.data, [(0, (2,), (1,), f32), (8, [2], (1,), f32)], True))
    after_bad = len(rec.holders)
    del made
    return view + [bad[0], after_bad, len(rec.holders), whole.shape[0]]



def plain_stage_task():
    # A pipelined chain's task for a plain NumPy stage (the compiled core runs its taken
    # path in C): each way a batch leaves it, through real chains of two host streams.
    def run(*fns, batches=3):
        chain = tx.Chain([tx.Stage(f, framework="numpy", name=f"s{k}") for k, f in enumerate(fns)],
                         max_in_flight=2)
        try:
            r = chain.run([np.arange(4, dtype=np.float32) + k for k in range(batches)])
            outs = [np.from_dlpack(o).tolist() if not isinstance(o, (tuple, dict)) else
                    {k: np.from_dlpack(v).tolist() for k, v in (o.items() if isinstance(o, dict) else enumerate(o))}
                    for o in r.outputs]
            return ["ok", outs, [[h["from"], h["to"], h["bytes"], h["shared"]] for h in r.hops],
                    len(r.batch_hops), sorted(r.stage_ms)]
        except BaseException as exc:
            cause = exc.__cause__
            return ["raised", type(exc).__name__, str(exc), type(cause).__name__ if cause else None]
        finally:
            chain.close()

    def boom(x):
        raise ValueError("model exploded")

    def interrupt(x):
        raise KeyboardInterrupt

    with tx.borrow(bytearray(16), shape=(4,), dtype="float32") as ended:
        pass  # a view whose scope has ended: NumPy's take of it fails
    closed = tx.Chain([tx.Stage(lambda x: x, framework="numpy"), tx.Stage(lambda x: x, framework="numpy")],
                      max_in_flight=2)
    try:
        not_taken = closed.run([ended])
    except BaseException as exc:
        not_taken = [type(exc).__name__, str(exc)]
    closed.close()
    live = stats("live_records")
    results = [run(lambda x: x * 2, lambda x: x + 1),
               run(lambda x: x, boom),
               run(lambda x: 5, lambda x: x),
               run(lambda x: (x, x + 1), lambda a, b: a + b),
               run(lambda x: x, lambda x: {"a": x, "b": x * 3}),
               run(lambda x: x, interrupt),
               not_taken[:1] + [not_taken[1].split(":")[0]]]
    gc.collect()
    return results + [stats("live_records") == live]

cases = {name: fn for name, fn in globals().items() if callable(fn) and getattr(fn, "__module__", "") == "__main__"
         and name not in ("stats", "error")}
results = {}
for name, fn in cases.items():
    try:
        results[name] = fn()
    except BaseException as exc:
        results[name] = ["raised", type(exc).__name__, str(exc)]
    gc.collect()
json.dump({"compiled": _core.compiled(), "results": results}, sys.stdout)
'''


def _run(pure: bool) -> dict:
    env = {**os.environ, "EXCHANGE_PURE_PYTHON": "1" if pure else "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CASES], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert out["compiled"] is (not pure), out["compiled"]
    return out["results"]


@pytest.fixture(scope="module")
def pure() -> dict:
    return _run(pure=True)


@pytest.mark.skipif(not COMPILED_BUILT, reason="the compiled core exchange._native is not built here")
def test_both_paths_give_the_same_results(pure):
    compiled = _run(pure=False)
    assert compiled.keys() == pure.keys()
    diff = {name: {"compiled": compiled[name], "pure": pure[name]} for name in compiled if compiled[name] != pure[name]}
    assert not diff, json.dumps(diff, indent=1)


def test_the_cases_say_what_the_rules_say(pure):
    # The table's outcomes, as the release rules state them (whichever path ran).
    r = pure
    assert r["no_stream_release"]["live"][:3] == ["live", "allocated", "allocated"]
    assert r["no_stream_release"]["after"] == "released"
    assert r["no_stream_release"]["bytes"] == [16, 0] and r["no_stream_release"]["released"] == 1
    assert r["holders_in_order"] == [3, ["DLPack export", "tx.Tensor", "tx.Tensor"], ["live", 2], ["live", 1],
                                     ["released", 0]]
    assert r["export_then_consumer_deleter"] == [1, "live", "released", 0]
    assert r["unconsumed_capsule_released"] == ["live", "released"]
    assert r["own_capsule_comes_back"]["same_record"] is True
    assert r["own_capsule_comes_back"]["delta"] == {"exports_outstanding": 0, "live_records": 1}
    assert r["own_capsule_comes_back"]["again"][0] == "ValueError"
    assert r["import_releases_once"]["after"] == ["released", {"imports_outstanding": 0, "live_records": 0}]
    assert r["import_releases_once"]["held_by_view"] == "live"
    assert r["legacy_capsule_is_read_only"]["legacy_export"] is None  # it came in legacy: it may go out so
    assert r["refused_capsules"]["consumed"][0] == "ValueError"
    assert r["refused_capsules"]["not_capsule"][0] == "TypeError"
    assert r["stream_ordered_release"] == ["released", 0]
    assert r["failing_release_warns"][0] == "released"
    assert "free failed" in r["failing_release_warns"][1][0]
    assert r["holder_after_release"][0][0] == "LifetimeError"
    assert r["held_record_discarded"][4:] == ["released", 1, 1, 0]
    assert r["trace_hears_records_gone"] == [7]
    assert r["peek_reads_without_consuming"][3] == [3, 4]
    assert r["tracked_leak"] == [1, True, "live"]
    assert r["counters_and_peak"] == [True, 0]
    assert r["tensors_in_one_call"] == [3, [[2, 3], [4]], [True, True], [[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]],
                                        [16.0, 17.0, 18.0, 19.0]], "TypeError", 3, 1, 64]
    assert r["element_bytes"] == [[48, 48], [0, 0], [0, 0], [5, 5], [112, 112], [8, 8], [240, 240]]
    assert r["stage_call"] == [42, [["template", 24], ["template", 24]], True, True,
                               ["ZeroDivisionError", "division by zero"],
                               [["TypeError", "call_stage: tensor must be a tx.Tensor, hops and acc lists"],
                                ["IndexError", "call_stage: index out of range of acc"]]]
    assert r["host_queue"] == [[True, True, True, 3, 0, 3], [1, "in its context"], ["ZeroDivisionError"],
                               ["a tag"], [True], [True, False, False, False, True], 4, 4, False,
                               ["TypeError"] * 4, [[True, [5], "t"], 2, 0, True, True, False]]
    ok, failed, not_array, grouped, as_dict, interrupted, not_taken, nothing_left = r["plain_stage_task"]
    assert ok == ["ok", [[2 * k + 1.0, 2 * k + 3, 2 * k + 5, 2 * k + 7] for k in range(3)],
                  [["input", "numpy", 16, True], ["numpy", "numpy", 16, True], ["numpy", "tx", 16, True]], 3,
                  ["s0", "s1"]]
    assert failed == ["raised", "StageError", "stage 1 's1' (numpy) failed: ValueError: model exploded", "ValueError"]
    assert not_array[:2] == ["raised", "TypeError"] and "returned an int" in not_array[2]
    assert grouped[:2] == ["ok", [[2 * k + 1.0, 2 * k + 3, 2 * k + 5, 2 * k + 7] for k in range(3)]]
    assert as_dict[1][0] == {"a": [0.0, 1.0, 2.0, 3.0], "b": [0.0, 3.0, 6.0, 9.0]}
    assert interrupted == ["raised", "KeyboardInterrupt", "", None]  # not wrapped, as `except Exception` leaves it
    assert not_taken == ["StageError", "stage 0 '<lambda>' (numpy) could not take its input from input"]
    assert nothing_left
    assert r["streaming_copy"] == [[True] * 5, ["ValueError", "copy_streaming: nbytes must be >= 0, got -1"],
                                   ["ValueError", "copy_streaming: a null address"]]


@pytest.mark.skipif(not COMPILED_BUILT, reason="the compiled core exchange._native is not built here")
def test_both_faces_give_the_same_api():
    from exchange._core import _compiled as compiled, _pure
    from exchange._core.api import NAMES

    assert compiled.__all__ == _pure.__all__ == NAMES
    for name in NAMES:
        assert callable(getattr(compiled, name)), name
        assert callable(getattr(_pure, name)), name


@pytest.mark.skipif(not COMPILED_BUILT, reason="the compiled core exchange._native is not built here")
def test_a_pipelined_plain_stage_runs_the_compiled_task():
    # Where the compiled core runs, a pipelined NumPy stage's task is its PlainTask (the
    # plain_stage_task case above checks it gives the Python task's results).
    code = ("import exchange as tx\n"
            "c = tx.Chain([tx.Stage(lambda x: x, framework='numpy'), tx.Stage(lambda x: x, framework='numpy')])\n"
            "task = c._plain_task(c._plans[0], [0.0, 0.0], c._run_one, c._run_stage, None, None, None)\n"
            "print(type(task).__name__)\n"
            "c.close()\n")
    env = {**os.environ, "EXCHANGE_PURE_PYTHON": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "PlainTask"


def test_the_path_is_chosen_once_and_reported():
    from exchange import _core, capsule

    assert not hasattr(capsule, "NATIVE")  # the seam alone says which path runs
    assert _core.compiled() is (os.environ.get("EXCHANGE_PURE_PYTHON", "") in ("", "0") and COMPILED_BUILT)
