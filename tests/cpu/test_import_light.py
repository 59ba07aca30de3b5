"""``import exchange`` and CPU use load no CUDA module and no framework: the package
works on a machine with no GPU driver and pays for no import it does not use."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent

CHILD = r"""
import sys
import numpy as np
import exchange as tx

t = tx.empty((3, 4), "float32")
a = np.from_dlpack(t)
a[...] = 1
u = tx.from_dlpack(np.arange(6.0).reshape(2, 3))
c = tx.from_dlpack(u, copy=True)
cap = u.__dlpack__(max_version=(1, 3))
v = tx.from_dlpack(cap)
s = tx.create_stream("cpu")
tx.record_stream(t, s)
s.record().synchronize()
with tx.track(strict=False):
    w = tx.empty(2)
    del w
tx.registry().stats(); tx.registry().snapshot()
shared = tx.attach(tx.share(tx.empty(4, shared=True)))  # the host memory channel alone
del a, t, u, c, cap, v, shared
tx.registry().collect(timeout=10)
assert tx.RayExecutor.__name__ == "RayExecutor"  # naming it imports no Ray
forbidden = ("cupy", "cupy_backends", "cuda", "torch", "jax", "jaxlib", "tvm_ffi", "onnxruntime", "ray",
             "prometheus_client", "matplotlib", "exchange.devices.cuda", "exchange.devices.cuda_driver",
             "exchange.devices.cuda_streams", "exchange.channels.cuda")
loaded = sorted(m for m in sys.modules if m in forbidden or m.split(".")[0] in forbidden[:-4])
print("LOADED:" + ",".join(loaded))
"""


def test_import_and_cpu_use_load_no_cuda_or_framework_module():
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("LOADED:")][-1]
    assert line == "LOADED:", f"modules loaded by import exchange / CPU use: {line[7:]}"
