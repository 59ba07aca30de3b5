"""``tensor-exchange bench`` section "release at scale": what pending stream-ordered
releases cost the rest of the program: a stream that holds many releases back must not
slow the hops, the registry or the process's other threads.

Measured on host streams, in interleaved rounds (medians over rounds):

* ``pending_hop_ratio``: the import hop ``tx.from_dlpack(a)`` of an unrelated array while
  10,000 releases are pending on a blocked host stream, over the same hop with none;
* ``pending_build_s`` / ``pending_drain_s``: seconds to make those 10,000 pending releases
  (import on the stream, drop) and, once the stream is unblocked, to complete them all;
* ``reaper_cpu_fraction``: process CPU seconds over wall seconds during 1 s of waiting
  with 10,000 pending (the reaper must sleep);
* ``stats_us_at_1e5``: one ``stats()`` call with 100,000 live records, in microseconds;
* ``chain_live_ratio``: ``Chain.run`` on one small batch (1 KiB, two NumPy stages) with
  100,000 live records, over the same with none.

Details only (``curves``, drawn by ``--plot``): the import hop ``tx.from_dlpack(a)`` and
NumPy's own ``np.from_dlpack(a)`` (1 KiB float32), sampled in turn at each point
(``ratio``: the median of the per-round ratios, tx over NumPy), with
0, 100, 1,000, 10,000 and 100,000 further records held live, then with 0, 100, 1,000
and 10,000 releases pending on a blocked host stream: a hop's cost should not grow with
either, and NumPy's, which knows nothing of them, shows the machine's drift.

With a CUDA device the same pending-release figures on a CUDA stream held busy by a
spinning kernel (details only; skipped with the reason elsewhere).
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from .bench import Candidate, Config, _gc_off

__all__ = ["KEYS", "TARGETS", "measure", "format"]

KEYS = ("pending_hop_ratio", "pending_build_s", "pending_drain_s", "reaper_cpu_fraction", "stats_us_at_1e5",
        "chain_live_ratio")
TARGETS = {"pending_hop_ratio": 1.2, "pending_build_s": 0.25, "pending_drain_s": 0.25, "reaper_cpu_fraction": 0.02,
           "stats_us_at_1e5": 20.0, "chain_live_ratio": 1.2}

PENDING = 10_000
LIVE = 100_000
#: The points of the curves (details only): further live records, then pending releases.
LIVE_POINTS = (0, 100, 1_000, 10_000, LIVE)
PENDING_POINTS = (0, 100, 1_000, PENDING)


def measure_pending(cfg: Config) -> dict[str, Any]:
    import numpy as np

    import exchange as tx

    rounds = 5 if cfg.quick else 11
    a = np.arange(256, dtype=np.float32)
    hop = Candidate("tx", tx.from_dlpack, a)
    reg = tx.registry()
    s = tx.create_stream("cpu")
    idle, busy, build, drain = [], [], [], []
    cpu_fraction = None
    try:
        with _gc_off():
            hop.calibrate(cfg.sample_ns)
            for r in range(rounds):
                idle.append(hop.round_median(3))
                gate = threading.Event()
                s.submit(gate.wait, 60)
                x = np.zeros(4, np.float32)
                t0 = time.perf_counter()
                for _ in range(PENDING):
                    t = tx.from_dlpack(x, stream=s)
                    del t
                build.append(time.perf_counter() - t0)
                busy.append(hop.round_median(3))
                if r == 0:  # 1 s of waiting with everything pending: the reaper must sleep
                    c0, w0 = time.process_time(), time.perf_counter()
                    time.sleep(1.0)
                    cpu_fraction = (time.process_time() - c0) / (time.perf_counter() - w0)
                pending = reg.stats()["pending_releases"]
                t0 = time.perf_counter()
                gate.set()
                ok = reg.collect(60)
                drain.append(time.perf_counter() - t0)
                if not ok or pending < PENDING:
                    raise RuntimeError(f"round {r}: {pending} pending, drained: {ok}")
    finally:
        s.close()
    return {
        "pending": PENDING, "rounds": rounds,
        "idle_hop_ns": statistics.median(idle), "pending_hop_ns": statistics.median(busy),
        "ratio": statistics.median(b / i for b, i in zip(busy, idle)),
        "build_s": statistics.median(build), "drain_s": statistics.median(drain),
        "reaper_cpu_fraction": cpu_fraction,
        "samples": {"idle_hop_ns": idle, "pending_hop_ns": busy, "build_s": build, "drain_s": drain},
    }


def measure_stats(cfg: Config) -> dict[str, Any]:
    import numpy as np

    import exchange as tx

    reg = tx.registry()
    a = np.arange(4, dtype=np.float32)
    keep = [tx.from_dlpack(a) for _ in range(LIVE)]
    try:
        times = []
        with _gc_off():
            for _ in range(200 if cfg.quick else 1000):
                t0 = time.perf_counter_ns()
                reg.stats()
                times.append(time.perf_counter_ns() - t0)
        live = reg.stats()["live_records"]
    finally:
        del keep
    return {"live_records": live, "median_us": statistics.median(times) / 1e3, "max_us": max(times) / 1e3}


def measure_chain_live(cfg: Config) -> dict[str, Any]:
    import numpy as np

    import exchange as tx

    chain = tx.Chain([tx.Stage(lambda x: x * 2.0, framework="numpy", name="scale"),
                      tx.Stage(lambda x: x + 1.0, framework="numpy", name="shift")])
    batch = [np.ones(256, dtype=np.float32)]
    run = Candidate("chain", chain.run, batch)
    rounds = 3 if cfg.quick else 7
    alone, crowded = [], []
    try:
        with _gc_off():
            run.calibrate(cfg.sample_ns)
            for _ in range(rounds):
                alone.append(run.round_median(3))
                keep = [tx.from_dlpack(batch[0]) for _ in range(LIVE)]
                crowded.append(run.round_median(3))
                del keep
    finally:
        chain.close()
    return {"live_records": LIVE, "rounds": rounds, "alone_us": statistics.median(alone) / 1e3,
            "crowded_us": statistics.median(crowded) / 1e3,
            "ratio": statistics.median(c / a for c, a in zip(crowded, alone))}


def measure_curves(cfg: Config) -> dict[str, Any]:
    """The import hop and NumPy's own hop at each point of ``LIVE_POINTS`` (records held
    live besides whatever the process holds) and ``PENDING_POINTS`` (releases pending on
    a host stream blocked by a task). Every round climbs all the points afresh (then
    drops the records, unblocks the stream and waits for the releases), so the machine's
    drift is spread over the points; at each point the two hops are sampled in turn. A
    point's figures are medians over all its samples; ``ratio`` is the median of the
    per-round ratios, tx over NumPy, sampled back to back."""
    import numpy as np

    import exchange as tx

    reg = tx.registry()
    a = np.arange(256, dtype=np.float32)
    x = np.zeros(4, np.float32)
    hops = [Candidate("tx", tx.from_dlpack, a), Candidate("numpy", np.from_dlpack, a)]
    rounds, per_round = (3, 3) if cfg.quick else (5, 3)
    found: dict[tuple[str, int], dict[str, list[float]]] = {}
    last: dict[tuple[str, int], int] = {}

    def point(curve: str, n: int, r: int) -> None:
        got = found.setdefault((curve, n), {"tx": [], "numpy": [], "ratio": []})
        for i in range(per_round):
            order = hops if (r + i) % 2 == 0 else hops[::-1]
            for c in order:
                c.sample()
            got["ratio"].append(hops[0].samples[-1] / hops[1].samples[-1])
        for c in hops:
            got[c.name] += c.samples
            c.samples.clear()

    s = tx.create_stream("cpu")
    try:
        with _gc_off():
            for c in hops:
                c.calibrate(cfg.sample_ns)
            for r in range(rounds):
                keep: list[Any] = []
                for n in LIVE_POINTS:
                    keep.extend(tx.from_dlpack(x) for _ in range(n - len(keep)))
                    last[("live", n)] = reg.stats()["live_records"]
                    point("live", n, r)
                del keep
                gate = threading.Event()
                try:
                    s.submit(gate.wait, 60)
                    made = 0
                    for n in PENDING_POINTS:
                        for _ in range(n - made):
                            t = tx.from_dlpack(x, stream=s)
                            del t
                        made = n
                        last[("pending", n)] = reg.stats()["pending_releases"]
                        point("pending", n, r)
                finally:
                    gate.set()
                    reg.collect(60)
    finally:
        s.close()

    def rows(curve: str, points: tuple[int, ...], count: str, state: str) -> list[dict[str, Any]]:
        return [{count: n, state: last[(curve, n)],
                 **{f"{k}_ns": statistics.median(found[(curve, n)][k]) for k in ("tx", "numpy")},
                 "ratio": statistics.median(found[(curve, n)]["ratio"])} for n in points]

    return {"hop": "tx.from_dlpack(a) vs np.from_dlpack(a), a 1 KiB float32", "rounds": rounds,
            "samples_per_round": per_round, "live": rows("live", LIVE_POINTS, "held", "live_records"),
            "pending": rows("pending", PENDING_POINTS, "made", "pending_releases")}


def measure_cuda(cfg: Config) -> dict[str, Any]:
    """Pending releases on a CUDA stream held busy by a spinning CuPy kernel."""
    import exchange as tx

    try:
        import cupy

        s = tx.create_stream("cuda")
    except Exception as exc:
        return {"skipped": f"{type(exc).__name__}: {exc}"}
    try:
        spin = cupy.RawKernel(r'''
            extern "C" __global__ void spin(long long cycles) {
                long long start = clock64();
                while (clock64() - start < cycles) { }
            }''', "spin")
        reg = tx.registry()
        with cupy.cuda.Stream.from_external(s):
            x = cupy.zeros(4, dtype=cupy.float32)
            spin((1,), (1,), (cupy.int64(2_000_000_000),))  # about a second on a GPU at 2 GHz
        t0 = time.perf_counter()
        for _ in range(PENDING):
            t = tx.from_dlpack(x, stream=s)
            del t
        build = time.perf_counter() - t0
        pending = reg.stats()["pending_releases"]
        c0, w0 = time.process_time(), time.perf_counter()
        ok = reg.collect(60)
        wall = time.perf_counter() - w0
        return {"pending": pending, "build_s": build, "drain_wait_s": wall, "drained": ok,
                "cpu_fraction_while_waiting": (time.process_time() - c0) / wall}
    except Exception as exc:
        return {"skipped": f"{type(exc).__name__}: {exc}"}


def measure(cfg: Config, peers: dict[str, Any]) -> dict[str, Any]:
    pending = measure_pending(cfg)
    stats = measure_stats(cfg)
    chain = measure_chain_live(cfg)
    details = {"pending": pending, "stats": stats, "chain": chain, "curves": measure_curves(cfg),
               "cuda": measure_cuda(cfg)}
    keys = {
        "pending_hop_ratio": float(pending["ratio"]),
        "pending_build_s": float(pending["build_s"]),
        "pending_drain_s": float(pending["drain_s"]),
        "reaper_cpu_fraction": float(pending["reaper_cpu_fraction"]),
        "stats_us_at_1e5": float(stats["median_us"]),
        "chain_live_ratio": float(chain["ratio"]),
    }
    return {"keys": keys, "details": details}


def format(section: dict[str, Any]) -> list[str]:
    k, d = section["keys"], section["details"]

    def mark(key: str) -> str:
        return "ok" if k[key] <= TARGETS[key] else "MISSED"

    p = d["pending"]
    lines = [
        f"release at scale ({p['pending']:,} releases pending on a blocked host stream, {p['rounds']} rounds)",
        f"  import hop {p['idle_hop_ns'] / 1e3:.3f} us idle, {p['pending_hop_ns'] / 1e3:.3f} us with them pending: "
        f"ratio {k['pending_hop_ratio']:.2f} (<= {TARGETS['pending_hop_ratio']:g} {mark('pending_hop_ratio')})",
        f"  build {k['pending_build_s']:.3f} s, drain {k['pending_drain_s']:.3f} s "
        f"(each <= {TARGETS['pending_build_s']:g} {mark('pending_build_s')}/{mark('pending_drain_s')})",
        f"  CPU while waiting 1 s: {k['reaper_cpu_fraction']:.4f} of a core "
        f"(<= {TARGETS['reaper_cpu_fraction']:g} {mark('reaper_cpu_fraction')})",
        f"  stats() with {d['stats']['live_records']:,} live records: {k['stats_us_at_1e5']:.2f} us "
        f"(<= {TARGETS['stats_us_at_1e5']:g} {mark('stats_us_at_1e5')})",
        f"  Chain.run, one 1 KiB batch: {d['chain']['alone_us']:.1f} us alone, {d['chain']['crowded_us']:.1f} us "
        f"with {d['chain']['live_records']:,} live: ratio {k['chain_live_ratio']:.2f} "
        f"(<= {TARGETS['chain_live_ratio']:g} {mark('chain_live_ratio')})",
    ]
    curves = d.get("curves")
    if curves:
        for key, count, label in (("live", "held", "records held live"), ("pending", "made", "releases pending")):
            rows = curves[key]
            counts = "/".join(f"{r[count]:,}" for r in rows)
            ours, peer = ("/".join(f"{r[k] / 1e3:.2f}" for r in rows) for k in ("tx_ns", "numpy_ns"))
            ratios = "/".join(f"{r['ratio']:.2f}" for r in rows)
            lines.append(f"  import hop with {counts} {label}: tx {ours} us, np.from_dlpack {peer} us, "
                         f"ratio {ratios}")
    cuda = d["cuda"]
    if "skipped" in cuda:
        lines.append(f"  cuda: skipped: {cuda['skipped']}")
    else:
        lines.append(f"  cuda: {cuda['pending']:,} pending on a busy stream, build {cuda['build_s']:.3f} s, "
                     f"CPU while waiting {cuda['cpu_fraction_while_waiting']:.4f}")
    return lines
