"""``tensor-exchange bench`` section "trace": what ``tx.trace()`` costs, off (it
must cost nothing there, so it can stay built in) and on.

* ``trace_off_hop_ratio``: the import hop ``tx.from_dlpack(a)`` (1 KiB NumPy array) with
  tracing built in but off (a trace has run and ended in that process), over the same
  hop in a core built without the tracing hooks (``-DEXCHANGE_NO_TRACE``, which leaves
  out the record-creation note). Both cores are built here from the C sources, with the
  same compiler and flags, each run by five child processes; rounds go through all ten
  in turn (medians per core over its five processes). Needs the C sources (a checkout or an sdist) and a
  C compiler; not measured in ``--quick`` (it builds the core twice, about 20 s) or from
  a wheel install (None, with the reason in the details).
* ``trace_on_hop_us``: what a chain pays per hop while a trace records, in
  microseconds: a 4-stage NumPy chain (1 KiB, ``max_in_flight=1``), runs of 200 batches
  traced and untraced in interleaved rounds, the difference of the medians per batch
  over the hops the chain reports per batch (5: into each stage, and out of the last).
* ``trace_mb_1000_batches``: the file a 1,000-batch run of that chain writes, in MB
  (10**6 bytes).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .bench import Config, _gc_off

__all__ = ["KEYS", "TARGETS", "measure", "format"]

KEYS = ("trace_off_hop_ratio", "trace_on_hop_us", "trace_mb_1000_batches")
TARGETS = {"trace_off_hop_ratio": 1.05, "trace_on_hop_us": 2.0, "trace_mb_1000_batches": 20.0}

STAGES = 4
BATCHES = 200
COPIES = 5  # child processes per core in trace_off_hop_ratio


def _chain() -> Any:
    import exchange as tx

    return tx.Chain([tx.Stage(_same, framework="numpy", name=f"stage{k}") for k in range(STAGES)], max_in_flight=1)


def _same(x: Any) -> Any:
    return x


def measure_on(cfg: Config) -> dict[str, Any]:
    """``trace_on_hop_us`` and ``trace_mb_1000_batches`` (module docstring)."""
    import numpy as np

    import exchange as tx

    chain = _chain()
    batches = [np.ones(256, dtype=np.float32)] * BATCHES
    hops = len(chain.run(batches[:1]).hops)
    rounds = 7 if cfg.quick else 21

    def per_batch(trace: bool) -> float:
        recording = tx.trace(None, capacity=1_000_000) if trace else None
        if recording is not None:
            recording.start()
        t0 = time.perf_counter_ns()
        run = chain.run(batches)
        elapsed = time.perf_counter_ns() - t0
        if recording is not None:
            recording.stop()
        del run
        return elapsed / BATCHES

    off, on = [], []
    with _gc_off():
        per_batch(False), per_batch(True)  # warm-up
        for _ in range(rounds):
            off.append(per_batch(False))
            on.append(per_batch(True))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.json")
        with tx.trace(path) as recording:
            for _ in range(1000 // BATCHES):
                chain.run(batches)
        size = os.path.getsize(path)
        events = len(recording.events())
    chain.close()
    added = statistics.median(on) - statistics.median(off)
    return {"off_ns_per_batch": statistics.median(off), "on_ns_per_batch": statistics.median(on),
            "hops_per_batch": hops, "stages": STAGES, "added_us_per_stage": added / STAGES / 1e3,
            "trace_on_hop_us": added / hops / 1e3, "bytes_1000_batches": size, "events_1000_batches": events,
            "rounds": rounds}


# -- tracing built in but off, against a core built without its hooks -----------------------
_CHILD = r"""
import sys, time, itertools, gc
import numpy as np
import exchange as tx
from exchange import _core
assert _core.compiled(), _core.WHY_PURE
with tx.trace(None):   # tracing loaded, run once, and off again: "built in but off"
    tx.from_dlpack(np.zeros(1))
a = np.ones(256, dtype=np.float32)
f = tx.from_dlpack
gc.disable()
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    rep = itertools.repeat(None, n)
    t0 = time.perf_counter_ns()
    for _ in rep:
        f(a)
    print((time.perf_counter_ns() - t0) / n, flush=True)
"""


def _sources() -> Path | None:
    import exchange

    native = Path(exchange.__file__).parent / "native"
    return native if (native / "native.h").is_file() else None


def _build(native: Path, out: Path, no_trace: bool) -> None:
    """The core from ``native``'s sources, as ``pip install`` builds it (setuptools'
    build_ext, the same compiler and flags), into ``out/exchange``."""
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    sources = sorted(str(p) for p in native.glob("*.c"))
    macros = [("EXCHANGE_NO_TRACE", "1")] if no_trace else []
    ext = Extension("exchange._native", sources, define_macros=macros)
    dist = Distribution({"name": "tensor-exchange-bench", "ext_modules": [ext]})
    cmd = build_ext(dist)
    cmd.build_lib = str(out)
    cmd.build_temp = str(out / "tmp")
    cmd.ensure_finalized()
    cmd.run()


def _package_copy(where: Path) -> None:
    import exchange

    src = Path(exchange.__file__).parent
    shutil.copytree(src, where / "exchange", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("_native*.so", "__pycache__", "native"))
    devices = Path(exchange.__file__).parent / "devices"
    if not devices.is_dir():  # a checkout: the backends live in the top-level devices/
        checkout = src.parent / "devices"
        if checkout.is_dir():
            shutil.copytree(checkout, where / "exchange" / "devices", dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__"))


def measure_off(cfg: Config) -> dict[str, Any]:
    """``trace_off_hop_ratio`` (module docstring); ``{"ratio": None, "why": ...}`` where
    it cannot be measured here."""
    if cfg.quick:
        return {"ratio": None, "why": "not measured in --quick: it builds the core twice (about 20 s)"}
    native = _sources()
    if native is None:
        return {"ratio": None, "why": "the C sources are not here (a wheel install); run the bench from a checkout"}
    if shutil.which(os.environ.get("CC", "gcc")) is None and shutil.which("cc") is None:
        return {"ratio": None, "why": "no C compiler on PATH"}
    with tempfile.TemporaryDirectory(prefix="tx-bench-trace-") as tmp:
        roots = {"with hooks": Path(tmp) / "hooks", "without hooks": Path(tmp) / "bare"}
        try:
            for name, root in roots.items():
                _package_copy(root)
                _build(native, root, no_trace=name == "without hooks")
        except Exception as exc:  # a failed build is a reason, not a crash of the bench
            return {"ratio": None, "why": f"building the core failed: {type(exc).__name__}: {exc}"}
        return _alternate(roots, rounds=15)


def _alternate(roots: dict[str, Path], rounds: int, copies: int = COPIES) -> dict[str, Any]:
    """The hop in ``copies`` child processes per core, all sampled in turn each round;
    each core's median over its children's samples. Several processes per core, since
    where a process's code and data land in memory moves a 200 ns hop by a few percent
    from one process to the next (seen here: 0.95 to 1.05 with one each)."""
    env = {k: v for k, v in os.environ.items() if k not in ("EXCHANGE_PURE_PYTHON", "PYTHONPATH")}
    children: list[tuple[str, subprocess.Popen]] = []
    try:
        for _ in range(copies):
            for name, root in roots.items():
                children.append((name, subprocess.Popen(
                    [sys.executable, "-c", _CHILD], cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    text=True, env=dict(env, PYTHONPATH=str(root)))))
        for name, child in children:
            if child.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                return {"ratio": None, "why": f"a child with the core {name} did not start"}
        samples: dict[str, list[float]] = {name: [] for name in roots}
        n = 100_000
        for _ in range(rounds):
            for name, child in children:
                child.stdin.write(f"{n}\n")  # type: ignore[union-attr]
                child.stdin.flush()  # type: ignore[union-attr]
                samples[name].append(float(child.stdout.readline()))  # type: ignore[union-attr]
    finally:
        for _name, child in children:
            if child.stdin:
                child.stdin.close()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
    on, off = (statistics.median(samples[name]) for name in roots)
    return {"ratio": on / off, "with_hooks_ns": on, "without_hooks_ns": off, "rounds": rounds,
            "processes_per_core": copies, "hops_per_sample": n}


def measure(cfg: Config, peers: dict[str, Any]) -> dict[str, Any]:
    off = measure_off(cfg)
    on = measure_on(cfg)
    return {"keys": {"trace_off_hop_ratio": off["ratio"], "trace_on_hop_us": on["trace_on_hop_us"],
                     "trace_mb_1000_batches": on["bytes_1000_batches"] / 1e6},
            "details": {"off": off, "on": on}}


def format(section: dict[str, Any]) -> list[str]:
    keys, d = section["keys"], section["details"]
    off, on = d["off"], d["on"]
    if keys["trace_off_hop_ratio"] is None:
        first = f"trace off: import hop, built in vs built without   not measured: {off['why']}"
    else:
        first = (f"trace off: import hop, built in vs built without   {off['with_hooks_ns']:.0f} ns vs "
                 f"{off['without_hooks_ns']:.0f} ns   ratio {keys['trace_off_hop_ratio']:.3f} (target <= 1.05)")
    return [
        first,
        f"trace on: added per chain hop ({on['hops_per_batch']} hops a batch)   "
        f"{keys['trace_on_hop_us']:.2f} us (target <= 2); {on['added_us_per_stage']:.2f} us per stage",
        f"trace of 1,000 batches   {keys['trace_mb_1000_batches']:.1f} MB, {on['events_1000_batches']} events "
        "(target <= 20 MB)",
    ]
