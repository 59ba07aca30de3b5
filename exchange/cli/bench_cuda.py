"""``tensor-exchange bench`` section "cuda": the host's side of the CUDA hot path
(the host time a GPU pipeline pays per hop and per release, and the host syncs it must
never make), with ``--device cuda`` only (skipped with the reason otherwise).

* ``hop``: host time of one hop with its handshake, ``tx.from_dlpack(t, stream=b)`` for
  ``t``, 1 KiB of our device memory ordered on stream ``s`` (an event recorded on
  ``s``, ``b`` made to wait on it): each call timed alone, in WINDOWS windows of
  PER_WINDOW calls, results kept (their releases are not timed here);
* ``release``: host time of one release, the last holders of such a ``t`` and its view
  on ``b`` dropped (``s`` waits on an event recorded on ``b``, then ``cuMemFreeAsync``),
  each timed alone, windows as above;
* per window: the median and the largest call in microseconds; ``flatness``: the largest
  window median over the smallest (1.0 is flat: no growth, no stall as the run goes on);
* ``events_created`` and ``host_syncs``: what the CUDA backend counted over all the
  windows (``CUDABackend.events_created``, ``.host_syncs``): 0 once warm, since events
  come from the device's pool and nothing on the hot path blocks the host;
* ``chain``: host syncs over a ``tx.Chain`` of two CuPy stages on their own streams,
  CHAIN_BATCHES batches (three hops a batch), per 100 hops (target 0).

No top-level ``--json`` keys: the figures are in ``details.sections.cuda.details``.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

from .bench import Config, _gc_off

__all__ = ["KEYS", "TARGETS", "measure", "format"]

KEYS: tuple[str, ...] = ()
TARGETS: dict[str, float] = {}

WINDOWS = 8
PER_WINDOW = 250
CHAIN_BATCHES = 40

_ns = time.perf_counter_ns


def _windows(one: Any, setup: Any, windows: int, n: int) -> dict[str, Any]:
    """Time ``one(state, i)`` alone for i < n in each window, after ``state = setup(n)``."""
    medians, largest = [], []
    for _ in range(windows):
        state = setup(n)
        times = []
        with _gc_off():
            for i in range(n):
                t0 = _ns()
                one(state, i)
                times.append(_ns() - t0)
        del state
        gc.collect()
        medians.append(statistics.median(times) / 1e3)
        largest.append(max(times) / 1e3)
    return {"median_us": statistics.median(medians), "window_median_us": medians, "window_max_us": largest,
            "max_us": max(largest), "flatness": max(medians) / min(medians) if min(medians) > 0 else float("inf")}


def measure(cfg: Config, peers: dict[str, Any]) -> dict[str, Any]:
    if cfg.device != "cuda":
        return {"keys": {}, "details": {"skipped": "the CUDA hot path is measured with --device cuda"}}
    try:
        return {"keys": {}, "details": _measure(cfg, peers)}
    except Exception as exc:  # the other sections' figures still count
        return {"keys": {}, "details": {"skipped": f"{type(exc).__name__}: {exc}"}}


def _measure(cfg: Config, peers: dict[str, Any]) -> dict[str, Any]:
    import exchange as tx
    from exchange.devices.base import get_backend

    cuda = get_backend(tx.DeviceType.kDLCUDA)
    windows, n = (WINDOWS // 2, PER_WINDOW) if cfg.quick else (WINDOWS, PER_WINDOW * 4)
    s, b = tx.create_stream("cuda:0"), tx.create_stream("cuda:0")

    def tensors(k: int) -> list[Any]:
        return [tx.empty((256,), "float32", device="cuda:0", stream=s) for _ in range(k)]

    def hop_setup(k: int) -> dict[str, Any]:
        return {"t": tensors(k), "views": [None] * k}

    def hop(state: dict[str, Any], i: int) -> None:
        state["views"][i] = tx.from_dlpack(state["t"][i], stream=b)

    def release_setup(k: int) -> list[Any]:
        return [(t, tx.from_dlpack(t, stream=b)) for t in tensors(k)]

    def release(state: list[Any], i: int) -> None:
        state[i] = None  # the last holders: the stream-ordered free runs here

    for one, setup in ((hop, hop_setup), (release, release_setup)):  # warm-up: the event pool fills
        _windows(one, setup, 1, n)
    assert tx.registry().collect(timeout=30)
    events, syncs = cuda.events_created, cuda.host_syncs
    hops = _windows(hop, hop_setup, windows, n)
    releases = _windows(release, release_setup, windows, n)
    assert tx.registry().collect(timeout=30)
    events, syncs = cuda.events_created - events, cuda.host_syncs - syncs
    return {"windows": windows, "per_window": n, "hop": hops, "release": releases, "events_created": events,
            "host_syncs": syncs, "chain": _chain_syncs(cuda, peers)}


def _chain_syncs(cuda: Any, peers: dict[str, Any]) -> dict[str, Any]:
    import exchange as tx

    cp = peers.get("cupy")
    if cp is None:
        return {"skipped": "CuPy is not among the peers (the chain's stages are CuPy's)"}
    chain = tx.Chain([tx.Stage(lambda x: x * 2.0, framework="cupy", name="double", device="cuda:0"),
                      tx.Stage(lambda x: x + 1.0, framework="cupy", name="shift", device="cuda:0")], device="cuda:0")
    try:
        inputs = [cp.full((64, 64), float(i), dtype=cp.float32) for i in range(CHAIN_BATCHES)]
        chain.run(inputs[:2])  # warm-up: kernels compiled, events pooled
        cp.cuda.Stream.null.synchronize()
        before = cuda.host_syncs
        run = chain.run(inputs)
        hops = sum(len(batch) for batch in run.batch_hops)
        syncs = cuda.host_syncs - before
        del run, inputs
    finally:
        chain.close()
    gc.collect()
    return {"batches": CHAIN_BATCHES, "hops": hops, "host_syncs": syncs,
            "per_100_hops": 100.0 * syncs / hops if hops else None}


def format(section: dict[str, Any]) -> list[str]:
    d = section["details"]
    if "skipped" in d:
        return [f"cuda hot path: skipped: {d['skipped']}"]
    h, r, c = d["hop"], d["release"], d["chain"]
    chain = (f"  chain: skipped: {c['skipped']}" if "skipped" in c else
             f"  chain: {c['host_syncs']} host syncs in {c['hops']} CUDA hops ({c['per_100_hops']:.2f} per 100 hops; "
             "target 0)")
    return [
        f"cuda hot path: host time of one call, {d['windows']} windows of {d['per_window']}",
        f"  hop (handshake)   median {h['median_us']:.2f} us, window medians {min(h['window_median_us']):.2f}-"
        f"{max(h['window_median_us']):.2f} us (flatness {h['flatness']:.2f}), largest {h['max_us']:.1f} us",
        f"  release (ordered) median {r['median_us']:.2f} us, window medians {min(r['window_median_us']):.2f}-"
        f"{max(r['window_median_us']):.2f} us (flatness {r['flatness']:.2f}), largest {r['max_us']:.1f} us",
        f"  CUDA events created {d['events_created']}, host syncs {d['host_syncs']} (both 0 once warm)",
        chain,
    ]
