"""``tensor-exchange bench`` section ``top``: what serving ``tensor-exchange top`` costs the
watched process (exchange/inspection.py).

Measured in this process, which plays the watched one:

* ``top_idle_hop_ratio``: the import hop ``tx.from_dlpack(a)`` (a 1 KiB NumPy array) with
  the inspection server running and nobody connected, over the same hop with it stopped;
  interleaved rounds (the order alternating), the median of the per-round ratios of
  medians. Target <= 1.05: serving adds nothing while nobody watches.
* ``top_refresh_ms_at_1e5``: with 100,000 live records, milliseconds the watched process
  spends on one refresh of the aggregates (``top``'s once-a-second request: building the
  reply and encoding it, as its serving thread does; the median). Target <= 1.0.
* ``top_largest_ms_at_1e5``: milliseconds of the scan behind the largest-records table
  there (made at most once every 5 s, whoever asks; the median). Target <= 20.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from .bench import Candidate, Config, _gc_off

__all__ = ["KEYS", "TARGETS", "measure", "format"]

KEYS = ("top_idle_hop_ratio", "top_refresh_ms_at_1e5", "top_largest_ms_at_1e5")
TARGETS = {"top_idle_hop_ratio": 1.05, "top_refresh_ms_at_1e5": 1.0, "top_largest_ms_at_1e5": 20.0}

LIVE = 100_000


def measure_idle(cfg: Config) -> dict[str, Any]:
    import numpy as np

    import exchange as tx
    from exchange import inspection

    rounds = 7 if cfg.quick else 21
    hop = Candidate("tx", tx.from_dlpack, np.arange(256, dtype=np.float32))
    t0 = time.perf_counter()
    inspection.serve_inspection()  # the first start imports the sharing helpers: not in the rounds
    first_start_ms = (time.perf_counter() - t0) * 1e3
    inspection.stop_inspection()
    serving, stopped = [], []
    with _gc_off():
        hop.calibrate(cfg.sample_ns)
        for r in range(rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                if on:
                    inspection.serve_inspection()
                    serving.append(hop.round_median(3))
                    inspection.stop_inspection()
                else:
                    stopped.append(hop.round_median(3))
    return {"rounds": rounds, "serving_hop_ns": statistics.median(serving),
            "stopped_hop_ns": statistics.median(stopped),
            "ratio": statistics.median(s / o for s, o in zip(serving, stopped)),
            "first_start_ms": first_start_ms}


def measure_live(cfg: Config) -> dict[str, Any]:
    import numpy as np

    import exchange as tx
    from exchange import inspection

    a = np.arange(4, dtype=np.float32)
    keep = [tx.from_dlpack(a) for _ in range(LIVE)]
    try:
        inspection.serve_inspection()
        server = inspection._server()
        refresh, scans, cached = [], [], []
        size = 0
        with _gc_off():
            for _ in range(50 if cfg.quick else 300):
                t0 = time.perf_counter_ns()
                size = len(server.reply(0))
                refresh.append((time.perf_counter_ns() - t0) / 1e6)
            for _ in range(3 if cfg.quick else 9):
                t0 = time.perf_counter_ns()
                server.scan_now()
                scans.append((time.perf_counter_ns() - t0) / 1e6)
            server.scan = server.scan_now()
            for _ in range(20 if cfg.quick else 100):  # top's refresh with the table, between scans
                t0 = time.perf_counter_ns()
                server.reply(10)
                cached.append((time.perf_counter_ns() - t0) / 1e6)
        live = tx.registry().stats()["live_records"]
    finally:
        inspection.stop_inspection()
        del keep
    return {"live_records": live, "refresh_ms": statistics.median(refresh), "refresh_max_ms": max(refresh),
            "reply_bytes": size, "scan_ms": statistics.median(scans), "scan_max_ms": max(scans),
            "refresh_with_table_ms": statistics.median(cached)}


def measure(cfg: Config, peers: dict[str, Any]) -> dict[str, Any]:
    from exchange import inspection

    was_serving = inspection.stop_inspection()  # EXCHANGE_INSPECT=1 in the bench's own environment
    try:
        idle = measure_idle(cfg)
        live = measure_live(cfg)
    finally:
        if was_serving:
            inspection.serve_inspection()
    keys = {"top_idle_hop_ratio": float(idle["ratio"]), "top_refresh_ms_at_1e5": float(live["refresh_ms"]),
            "top_largest_ms_at_1e5": float(live["scan_ms"])}
    return {"keys": keys, "details": {"idle": idle, "live": live}}


def format(section: dict[str, Any]) -> list[str]:
    k, d = section["keys"], section["details"]

    def mark(key: str) -> str:
        return "ok" if k[key] <= TARGETS[key] else "MISSED"

    i, live = d["idle"], d["live"]
    return [
        "top: what serving inspection costs the watched process",
        f"  import hop {i['serving_hop_ns'] / 1e3:.3f} us serving with nobody watching, "
        f"{i['stopped_hop_ns'] / 1e3:.3f} us stopped ({i['rounds']} rounds): ratio {k['top_idle_hop_ratio']:.3f} "
        f"(<= {TARGETS['top_idle_hop_ratio']:g} {mark('top_idle_hop_ratio')})",
        f"  with {live['live_records']:,} live records: one refresh of the aggregates "
        f"{k['top_refresh_ms_at_1e5']:.3f} ms (<= {TARGETS['top_refresh_ms_at_1e5']:g} "
        f"{mark('top_refresh_ms_at_1e5')}; {live['reply_bytes']:,} bytes), with the cached table "
        f"{live['refresh_with_table_ms']:.3f} ms",
        f"  the largest-records scan {k['top_largest_ms_at_1e5']:.1f} ms, at most once every 5 s "
        f"(<= {TARGETS['top_largest_ms_at_1e5']:g} {mark('top_largest_ms_at_1e5')}; "
        f"worst {live['scan_max_ms']:.1f} ms)",
    ]
