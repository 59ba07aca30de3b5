"""``tensor-exchange bench`` section "core": the compiled core's costs next to NumPy's
(what the compiled core exists to bring down), each a median over interleaved rounds in
the same run.

* ``round_trip_ratio``: NumPy -> tx -> NumPy, ``np.from_dlpack(tx.from_dlpack(a))``,
  over NumPy -> NumPy -> NumPy, ``np.from_dlpack(np.from_dlpack(a))``; ``a`` 1 KiB of
  float32 (256 elements), both results dropped at once;
* ``torch_import_ratio``: ``tx.from_dlpack(torch_tensor)`` over ``np.from_dlpack(a)``,
  both 1 KiB on the CPU; ``details`` also gives ``torch.from_dlpack(torch_tensor)``
  over the same, for scale (null, with the reason in ``details``, without PyTorch);
* ``record_bytes``: bytes per live imported record, by ``tracemalloc``:
  ``tx.from_dlpack(a)`` of one NumPy array 100,000 times, each result kept in a list
  made before tracing starts (so its slots do not count). Nothing else is subtracted:
  what NumPy allocates for the export that stays alive with the record (its managed
  tensor, its capsule) is part of what a live import costs. Only memory allocated
  through Python's allocators is seen (tracemalloc's reach);
* ``chain_small_hop_us``: what the inline chain adds per hop over hand-written glue,
  in microseconds. Ours: ``tx.Chain([Stage(x * 2), Stage(x + 1), Stage(x - 0.5)],
  max_in_flight=1)(x)`` (three NumPy stages) on a 1 KiB float32 batch, one batch a
  call as a user runs one; the peer: the same three functions glued as a user writes
  them, ``t = tx.from_dlpack(x)``, then per function ``t = tx.from_dlpack(f(
  np.from_dlpack(t)))``, so both sides do the same DLPack work and the same arithmetic
  and the difference is the chain's own work. ``chain(x)`` returns only the outputs, so
  it builds no report (hops, stage timings, peak); ``details`` gives, from the same
  rounds, ``chain.run([x])`` (one batch a run, with its full ``ChainResult``:
  ``run_hop_us``). Per round, (chain - glue) / 3 stage hops; the key is the median over
  rounds. ``details`` also gives the inline and the pipelined chain (default
  ``max_in_flight``, one host stream per stage) on 64 batches a ``run`` against 64
  glued batches, per batch and per stage hop;
* ``pure_import_hop_ratio``: the import hop ``tx.from_dlpack(a)`` over
  ``np.from_dlpack(a)`` on the pure-Python path, measured in a child process started
  here with ``EXCHANGE_PURE_PYTHON=1`` (same run, same timing method; no target: it
  must only not get worse).

Everything here runs on the CPU, whatever ``--device`` says.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import tracemalloc
from typing import Any

from .bench import Candidate, Config, compare

__all__ = ["KEYS", "TARGETS", "measure", "format"]

KEYS = ("round_trip_ratio", "torch_import_ratio", "record_bytes", "chain_small_hop_us", "pure_import_hop_ratio")
#: Upper bounds on a 2-core machine (pure_import_hop_ratio has none: reported only, it must
#: only not get worse).
TARGETS = {"round_trip_ratio": 2.0, "torch_import_ratio": 3.0, "record_bytes": 400.0, "chain_small_hop_us": 3.0}

RECORDS = 100_000
CHAIN_STAGES = 3
PIPE_BATCHES = 64


def _paired(ours: Candidate, peer: Candidate) -> float:
    """Median over rounds of ours / peer, sampled back to back in each round."""
    return statistics.median(o / p for o, p in zip(ours.samples, peer.samples))


def measure_round_trip(cfg: Config) -> dict[str, Any]:
    import numpy as np

    import exchange as tx

    a = np.arange(256, dtype=np.float32)
    ours = Candidate("tx", np.from_dlpack, a, g=tx.from_dlpack)
    peer = Candidate("numpy", np.from_dlpack, a, g=np.from_dlpack)
    res = compare([ours, peer], cfg.samples, cfg.sample_ns)
    return {"ours": "np.from_dlpack(tx.from_dlpack(a))", "peer": "np.from_dlpack(np.from_dlpack(a))",
            "tx_ns": res["tx"]["median_ns"], "numpy_ns": res["numpy"]["median_ns"], "ratio": _paired(ours, peer),
            "ratio_of_medians": res["tx"]["median_ns"] / res["numpy"]["median_ns"], "samples": res}


def measure_torch_import(cfg: Config, peers: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    import exchange as tx

    try:  # CPU tensors whatever --device says (peers holds PyTorch only where it has CUDA then)
        import torch
    except Exception as exc:  # not installed, or broken
        return {"skipped": f"PyTorch cannot be imported here ({type(exc).__name__}: {exc})"}
    a = np.arange(256, dtype=np.float32)
    tt = torch.arange(256, dtype=torch.float32)
    ours = Candidate("tx", tx.from_dlpack, tt)
    peer = Candidate("numpy", np.from_dlpack, a)
    own = Candidate("torch", torch.from_dlpack, tt)
    res = compare([ours, peer, own], cfg.samples, cfg.sample_ns)
    return {"ours": "tx.from_dlpack(torch_tensor)", "peer": "np.from_dlpack(ndarray)",
            "tx_ns": res["tx"]["median_ns"], "numpy_ns": res["numpy"]["median_ns"],
            "torch_ns": res["torch"]["median_ns"], "ratio": _paired(ours, peer),
            "torch_own_ratio": _paired(own, peer), "samples": res}


def measure_record_bytes(cfg: Config) -> dict[str, Any]:
    import numpy as np

    import exchange as tx

    a = np.arange(256, dtype=np.float32)
    rounds = 1 if cfg.quick else 5
    per, live = [], 0
    was_tracing = tracemalloc.is_tracing()
    for _ in range(rounds):
        keep: list[Any] = [None] * RECORDS
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for i in range(RECORDS):
                keep[i] = tx.from_dlpack(a)
            after = tracemalloc.get_traced_memory()[0]
        finally:
            if not was_tracing:
                tracemalloc.stop()
        live = tx.registry().stats()["live_records"]
        per.append((after - before) / RECORDS)
        del keep
    gc.collect()
    tx.registry().collect(timeout=10)
    return {"records": RECORDS, "rounds": rounds, "bytes_per_record": statistics.median(per), "samples": per,
            "live_records_while_held": live}


def _chain_functions() -> list[Any]:
    import numpy as np

    two, one, half = np.float32(2.0), np.float32(1.0), np.float32(0.5)

    def scale(x: Any) -> Any:
        return x * two

    def shift(x: Any) -> Any:
        return x + one

    def centre(x: Any) -> Any:
        return x - half

    return [scale, shift, centre]


def measure_chain_small(cfg: Config) -> dict[str, Any]:
    import numpy as np

    import exchange as tx

    fns = _chain_functions()
    x = np.ones(256, dtype=np.float32)
    from_dlpack, np_from_dlpack = tx.from_dlpack, np.from_dlpack

    def glued(y: Any) -> Any:
        t = from_dlpack(y)
        for f in fns:
            t = from_dlpack(f(np_from_dlpack(t)))
        return t

    def glued_batches(ys: list[Any]) -> Any:
        return [glued(y) for y in ys]

    inline = tx.Chain([tx.Stage(f, framework="numpy") for f in fns], max_in_flight=1)
    piped = tx.Chain([tx.Stage(f, framework="numpy") for f in fns])
    batches = [x] * PIPE_BATCHES
    try:
        np.testing.assert_array_equal(np.from_dlpack(inline(x)), np.from_dlpack(glued(x)))
        one = [Candidate("chain", inline, x), Candidate("glued", glued, x), Candidate("run", inline.run, (x,))]
        res = compare(one, cfg.chain_samples, cfg.sample_ns)
        many = [Candidate("inline", inline.run, batches), Candidate("pipelined", piped.run, batches),
                Candidate("glued", glued_batches, batches)]
        res_many = compare(many, max(5, cfg.chain_samples // 2), max(cfg.sample_ns, 10_000_000))
    finally:
        inline.close()
        piped.close()
    hop_us = statistics.median((c - g) / CHAIN_STAGES / 1e3 for c, g in zip(one[0].samples, one[1].samples))
    run_hop_us = statistics.median((r - g) / CHAIN_STAGES / 1e3 for r, g in zip(one[2].samples, one[1].samples))
    per_batch = {c.name: [s / PIPE_BATCHES for s in c.samples] for c in many}

    def over_glue(name: str) -> float:
        return statistics.median((c - g) / CHAIN_STAGES / 1e3 for c, g in zip(per_batch[name], per_batch["glued"]))

    return {
        "ours": "tx.Chain([scale, shift, centre] as numpy stages, max_in_flight=1)(x), x 1 KiB float32",
        "peer": "t = tx.from_dlpack(x); t = tx.from_dlpack(f(np.from_dlpack(t))) per function",
        "stages": CHAIN_STAGES, "chain_ns": res["chain"]["median_ns"], "glued_ns": res["glued"]["median_ns"],
        "hop_us": hop_us, "run_ns": res["run"]["median_ns"], "run_hop_us": run_hop_us,
        "runs_of": PIPE_BATCHES,
        "inline_batch_ns": statistics.median(per_batch["inline"]),
        "pipelined_batch_ns": statistics.median(per_batch["pipelined"]),
        "glued_batch_ns": statistics.median(per_batch["glued"]),
        "inline_run_hop_us": over_glue("inline"), "pipelined_hop_us": over_glue("pipelined"),
        "samples": res, "samples_runs": res_many,
    }


def _import_hop(samples: int, sample_ns: int) -> dict[str, Any]:
    """The import hop, tx over NumPy (run in the pure-Python child)."""
    import numpy as np

    import exchange as tx
    from exchange import _core

    a = np.arange(256, dtype=np.float32)
    ours, peer = Candidate("tx", tx.from_dlpack, a), Candidate("numpy", np.from_dlpack, a)
    res = compare([ours, peer], samples, sample_ns)
    return {"native": _core.compiled(), "tx_ns": res["tx"]["median_ns"], "numpy_ns": res["numpy"]["median_ns"],
            "ratio": _paired(ours, peer), "ratio_of_medians": res["tx"]["median_ns"] / res["numpy"]["median_ns"]}


def measure_pure_import(cfg: Config) -> dict[str, Any]:
    env = dict(os.environ, EXCHANGE_PURE_PYTHON="1")
    cmd = [sys.executable, "-m", "exchange.cli.bench_core", "--import-hop", str(cfg.samples), str(cfg.sample_ns)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the pure-Python import hop child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout)
    if out["native"]:
        raise RuntimeError("the pure-Python child used the compiled core despite EXCHANGE_PURE_PYTHON=1")
    return out


def measure(cfg: Config, peers: dict[str, Any]) -> dict[str, Any]:
    round_trip = measure_round_trip(cfg)
    torch_import = measure_torch_import(cfg, peers)
    chain = measure_chain_small(cfg)
    record = measure_record_bytes(cfg)
    pure = measure_pure_import(cfg)
    keys = {
        "round_trip_ratio": float(round_trip["ratio"]),
        "torch_import_ratio": None if "skipped" in torch_import else float(torch_import["ratio"]),
        "record_bytes": float(record["bytes_per_record"]),
        "chain_small_hop_us": float(chain["hop_us"]),
        "pure_import_hop_ratio": float(pure["ratio"]),
    }
    details = {"round_trip": round_trip, "torch_import": torch_import, "record": record, "chain": chain,
               "pure_import": pure}
    return {"keys": keys, "details": details}


def format(section: dict[str, Any]) -> list[str]:
    k, d = section["keys"], section["details"]

    def mark(key: str) -> str:
        value = k[key]
        if value is None:
            return "skipped"
        return f"(<= {TARGETS[key]:g} {'ok' if value <= TARGETS[key] else 'MISSED'})"

    rt, ch, rec, pure = d["round_trip"], d["chain"], d["record"], d["pure_import"]
    lines = [
        "core (1 KiB float32; medians over interleaved rounds)",
        f"  round trip np -> tx -> np {rt['tx_ns'] / 1e3:.3f} us, np -> np -> np {rt['numpy_ns'] / 1e3:.3f} us: "
        f"ratio {k['round_trip_ratio']:.2f} {mark('round_trip_ratio')}",
    ]
    ti = d["torch_import"]
    if "skipped" in ti:
        lines.append(f"  tx.from_dlpack(torch tensor): skipped: {ti['skipped']}")
    else:
        lines.append(f"  tx.from_dlpack(torch tensor) {ti['tx_ns'] / 1e3:.3f} us over np.from_dlpack "
                     f"{ti['numpy_ns'] / 1e3:.3f} us: ratio {k['torch_import_ratio']:.2f} "
                     f"{mark('torch_import_ratio')}; torch.from_dlpack {ti['torch_ns'] / 1e3:.3f} us "
                     f"({ti['torch_own_ratio']:.1f}x)")
    lines += [
        f"  live imported record: {k['record_bytes']:.0f} bytes each ({rec['records']:,} held, tracemalloc) "
        f"{mark('record_bytes')}",
        f"  inline chain(x), {ch['stages']} NumPy stages: {k['chain_small_hop_us']:.2f} us per hop over glue "
        f"({ch['chain_ns'] / 1e3:.1f} us vs {ch['glued_ns'] / 1e3:.1f} us a batch) {mark('chain_small_hop_us')}; "
        f"run([x]) with its report {ch['run_hop_us']:.2f} us",
        f"  runs of {ch['runs_of']} batches: inline {ch['inline_run_hop_us']:.2f} us, pipelined "
        f"{ch['pipelined_hop_us']:.2f} us per hop over glue ({ch['pipelined_batch_ns'] / 1e3:.1f} us a batch "
        f"pipelined, {ch['glued_batch_ns'] / 1e3:.1f} us glued)",
        f"  pure-Python import hop (EXCHANGE_PURE_PYTHON=1, a child process): {pure['tx_ns'] / 1e3:.2f} us, "
        f"ratio {k['pure_import_hop_ratio']:.1f} (no target; reported)",
    ]
    return lines


def _main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "--import-hop":
        print(json.dumps(_import_hop(int(argv[1]), int(argv[2]))))
        return 0
    print("usage: python -m exchange.cli.bench_core --import-hop SAMPLES SAMPLE_NS "
          "(the pure-Python child of the bench's core section)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
