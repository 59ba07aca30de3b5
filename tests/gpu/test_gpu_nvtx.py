"""NVTX ranges on CUDA (issue 31 item 10): with ``EXCHANGE_NVTX=1`` a CUDA chain's stages
push NVTX ranges ("stage K: NAME") on the threads that run them, and its stream-ordered
releases start and end process-wide ranges ("release #ID on STREAMS").

The ranges are seen through the ``nvtx`` Python package (exchange/tracing.py), whose
calls a child process records as they return (no Nsight here: what NVTX would hand a
profiler is what exchange asked of it). The machine may have only ``nvidia-nvtx``
(NVTX's C library, which exchange does not call): then the test skips saying so. Either
way it notes what it found (packages, ranges) in the results file, for the GPU check's
table (ci/check_gpu_results.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_helpers import note_result, nvtx_packages

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import gc, json
import nvtx
seen = []

def recorded(name):
    real = getattr(nvtx, name)
    def call(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append([name, args[0] if args and isinstance(args[0], str) else ""])
        return out
    return call

for name in ("push_range", "pop_range", "start_range", "end_range"):
    setattr(nvtx, name, recorded(name))

import cupy as cp
import exchange as tx

chain = tx.Chain([tx.Stage(lambda x: x * 2.0, framework="cupy", name="double", device="cuda:0"),
                  tx.Stage(lambda x: x + 1.0, framework="cupy", name="inc", device="cuda:0")], device="cuda:0")
run = chain.run([cp.ones((64, 64), dtype=cp.float32) for _ in range(2)])
total = float(cp.from_dlpack(run.outputs[-1]).sum())
run.outputs.clear()
chain.close()
gc.collect()
tx.registry().collect(timeout=10)
print(json.dumps({"total": total, "seen": seen}))
"""


def test_nvtx_ranges_of_a_cuda_chain_and_its_releases(cp):
    packages = nvtx_packages()
    if packages["nvtx"] is None:
        why = ("the nvtx Python package is not installed (nvidia-nvtx "
               + (f"{packages['nvidia-nvtx']} is: NVTX's C library alone, which exchange does not call)"
                  if packages["nvidia-nvtx"] else "is not either)"))
        note_result({"kind": "nvtx", "packages": packages, "ranges": None, "why": why})
        pytest.skip(why)
    env = {**os.environ, "EXCHANGE_NVTX": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    seen = report["seen"]
    stages = sorted({name for kind, name in seen if kind == "push_range"})
    releases = [name for kind, name in seen if kind == "start_range"]
    count = {kind: sum(1 for k, _ in seen if k == kind) for kind in ("push_range", "pop_range", "start_range",
                                                                     "end_range")}
    note_result({"kind": "nvtx", "packages": packages, "ranges": {"stages": stages, "releases": len(releases),
                                                                  "release_example": releases[0] if releases else "",
                                                                  "calls": count}, "why": ""})
    assert report["total"] == 3.0 * 64 * 64
    assert stages == ["stage 0: double", "stage 1: inc"], seen
    assert count["push_range"] == count["pop_range"] == 4  # two stages, two batches
    assert releases and all(name.startswith("release #") for name in releases), seen
    assert count["start_range"] == count["end_range"], "a release's NVTX range was never ended"
