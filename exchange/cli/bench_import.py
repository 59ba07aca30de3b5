"""``tensor-exchange bench`` section ``import``: what ``import exchange`` adds to a
program that already imports NumPy.

Each sample is one new interpreter (``sys.executable -c ...``) that imports NumPy, then
times ``import exchange`` with ``time.perf_counter`` around it and prints the
milliseconds; the figure is the median over the rounds. (Timing whole interpreters
against ones importing NumPy alone measures the same thing, but NumPy's own import
varies by tens of milliseconds from one start to the next on a 2-core machine, more than
the difference.) Bytecode is cached as an installed package has it: the children write
and read their ``.pyc`` files under a temporary ``PYTHONPYCACHEPREFIX`` (warmed by one
run first), whatever ``PYTHONDONTWRITEBYTECODE`` says in the calling environment.
``details`` also gives the figure with nothing cached (every module compiled in every
run), as a checkout run with ``PYTHONDONTWRITEBYTECODE=1`` pays it.

Key (``--json``): ``import_added_ms`` (target <= 30: ``import exchange`` must stay cheap
for a program that only passes tensors through).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

__all__ = ["KEYS", "TARGETS", "measure", "format"]

KEYS = ("import_added_ms",)
TARGETS = {"import_added_ms": 30.0}

_CHILD = "import numpy, time; t = time.perf_counter(); import exchange; print((time.perf_counter() - t) * 1e3)"


def _sample(env: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, check=True, capture_output=True, text=True)
    return float(out.stdout.split()[-1])


def _median(rounds: int, env: dict[str, str]) -> dict[str, float]:
    samples = [_sample(env) for _ in range(rounds)]
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "max_ms": max(samples),
            "rounds": rounds}


def measure(cfg: Any, peers: dict[str, Any]) -> dict[str, Any]:
    rounds = 7 if cfg.quick else 21
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    with tempfile.TemporaryDirectory(prefix="tx-bench-pyc-") as cache:
        env["PYTHONPYCACHEPREFIX"] = cache
        _sample(env)  # writes the cached bytecode
        cached = _median(rounds, env)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    with tempfile.TemporaryDirectory(prefix="tx-bench-nopyc-") as empty:
        env["PYTHONPYCACHEPREFIX"] = empty  # nothing cached there, and nothing written
        compiled = _median(max(3, rounds // 3), env)
    return {"keys": {"import_added_ms": cached["median_ms"]},
            "details": {"cached_bytecode": cached, "no_bytecode": compiled}}


def format(section: dict[str, Any]) -> list[str]:
    d = section["details"]
    c, n = d["cached_bytecode"], d["no_bytecode"]
    added = section["keys"]["import_added_ms"]
    mark = "ok" if added <= TARGETS["import_added_ms"] else "MISSED"
    return ["import exchange, after import numpy (a new interpreter each round, medians):",
            f"  bytecode cached: import_added_ms = {added:.1f} ({mark}, target <= {TARGETS['import_added_ms']:g}; "
            f"{c['min_ms']:.1f}-{c['max_ms']:.1f} ms over {c['rounds']} rounds)",
            f"  nothing cached (every module compiled): {n['median_ms']:.1f} ms ({n['rounds']} rounds)"]
