"""``tensor-exchange bench`` section ``import``: what ``import exchange`` adds to a
program that already imports NumPy.

Each sample is one new interpreter (``sys.executable -c ...``) timed from start to exit:
``import numpy`` alone against ``import numpy, exchange``, the two run in turn (the order
alternating every round), the figure the difference of their medians in milliseconds.
Bytecode is cached as an installed package has it: the children write and read their
``.pyc`` files under a temporary ``PYTHONPYCACHEPREFIX`` (warmed by one run of each
first), whatever ``PYTHONDONTWRITEBYTECODE`` says in the calling environment, so the
figure does not include compiling the sources. ``details`` also gives the figure
without any cached bytecode (every module compiled in every run), for a checkout run
with ``PYTHONDONTWRITEBYTECODE=1``.

Key (``--json``): ``import_added_ms`` (target <= 30, issue 18).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

__all__ = ["KEYS", "TARGETS", "measure", "format"]

KEYS = ("import_added_ms",)
TARGETS = {"import_added_ms": 30.0}

_BASE = "import numpy"
_WITH = "import numpy, exchange"


def _time(code: str, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True, stdout=subprocess.DEVNULL)
    return (time.perf_counter() - t0) * 1e3


def _added(rounds: int, env: dict[str, str]) -> dict[str, float]:
    base: list[float] = []
    with_us: list[float] = []
    for i in range(rounds):
        pair = ((base, _BASE), (with_us, _WITH)) if i % 2 == 0 else ((with_us, _WITH), (base, _BASE))
        for samples, code in pair:
            samples.append(_time(code, env))
    b, w = statistics.median(base), statistics.median(with_us)
    return {"numpy_ms": b, "numpy_and_exchange_ms": w, "added_ms": w - b, "rounds": rounds}


def measure(cfg: Any, peers: dict[str, Any]) -> dict[str, Any]:
    rounds = 7 if cfg.quick else 21
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    with tempfile.TemporaryDirectory(prefix="tx-bench-pyc-") as cache:
        env["PYTHONPYCACHEPREFIX"] = cache
        _time(_WITH, env)  # writes the cached bytecode of numpy and exchange
        cached = _added(rounds, env)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPYCACHEPREFIX", None)
    with tempfile.TemporaryDirectory(prefix="tx-bench-nopyc-") as empty:
        env["PYTHONPYCACHEPREFIX"] = empty  # nothing cached there, and nothing written
        compiled = _added(max(3, rounds // 3), env)
    return {"keys": {"import_added_ms": cached["added_ms"]},
            "details": {"cached_bytecode": cached, "no_bytecode": compiled}}


def format(section: dict[str, Any]) -> list[str]:
    d = section["details"]
    c, n = d["cached_bytecode"], d["no_bytecode"]
    added = section["keys"]["import_added_ms"]
    mark = "ok" if added <= TARGETS["import_added_ms"] else "MISSED"
    return ["import exchange, after import numpy (new interpreters, medians):",
            f"  bytecode cached: {c['numpy_ms']:.1f} ms -> {c['numpy_and_exchange_ms']:.1f} ms, "
            f"import_added_ms = {added:.1f} ({mark}, target <= {TARGETS['import_added_ms']:g}; {c['rounds']} rounds)",
            f"  nothing cached (every module compiled): +{n['added_ms']:.1f} ms ({n['rounds']} rounds)"]
