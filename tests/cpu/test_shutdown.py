"""Interpreter shutdown: a process that exits while other frameworks still hold our
exports, with capsules never consumed, with releases still pending on a host stream,
or with a thread still exchanging, exits with status 0 and no crash, with the compiled
core and with the pure-Python path (EXCHANGE_PURE_PYTHON=1).

Each program runs in its own interpreter; its last line prints "done" just before the
interpreter starts finalising, so a crash in teardown shows as a bad status or a
message on stderr after that.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from process_helpers import NEEDS_NATIVE

REPO = Path(__file__).resolve().parents[2]

PROGRAMS = {
    # numpy and torch arrays made from our capsules, kept in globals (and in a cycle)
    "framework-exports": """
        import numpy as np, torch, exchange as tx
        owned = tx.empty((64, 64), "float32")
        imported = tx.from_dlpack(np.arange(100, dtype=np.float64))
        from_torch = tx.from_dlpack(torch.arange(10, dtype=torch.float32))
        arrays = [np.from_dlpack(owned), np.from_dlpack(imported), np.from_dlpack(from_torch)]
        tensors = [torch.from_dlpack(owned), torch.from_dlpack(imported), torch.from_dlpack(from_torch)]
        class Holder: pass
        cycle = Holder(); cycle.me = cycle; cycle.arrays = [np.from_dlpack(owned), torch.from_dlpack(imported)]
        del owned, imported, from_torch   # only the other frameworks hold the memory now
        assert tx.registry().stats()["exports_outstanding"] == 8
    """,
    # capsules nobody consumed, versioned and legacy, in globals
    "unconsumed-capsules": """
        import numpy as np, exchange as tx
        t = tx.empty(1000, "uint8")
        u = tx.from_dlpack(np.ones(10))
        capsules = [t.__dlpack__(max_version=(1, 3)), t.__dlpack__(), u.__dlpack__(max_version=(1, 0)),
                    u.__dlpack__()]
        del t
    """,
    # the last holder went while a host stream still works on the memory
    "pending-releases": """
        import time, numpy as np, exchange as tx
        s = tx.create_stream()
        keep_stream_busy = s.submit(time.sleep, 30)
        for i in range(5):
            t = tx.empty(1 << 16, "uint8", stream=s)
            u = tx.from_dlpack(np.zeros(1000))
            tx.record_stream(u, s)
            del t, u
        assert tx.registry().stats()["pending_releases"] == 10
    """,
    # everything at once, plus a daemon thread still exchanging as the process exits
    "busy-thread": """
        import threading, time, numpy as np, exchange as tx
        def churn():
            a = np.arange(16.0)
            s = tx.create_stream()
            while True:
                t = tx.from_dlpack(a)
                b = np.from_dlpack(t)
                v = tx.from_dlpack(t)
                tx.record_stream(v, s)
                s.submit(time.sleep, 0.001)
                c = t.__dlpack__(max_version=(1, 3))
                del t, b, v, c
        for _ in range(2):
            threading.Thread(target=churn, daemon=True).start()
        s = tx.create_stream()
        s.submit(time.sleep, 30)
        kept = tx.empty(10)
        tx.record_stream(kept, s)
        held = [np.from_dlpack(tx.empty(4)), tx.empty(3).__dlpack__(max_version=(1, 3))]
        time.sleep(0.2)
    """,
}


@pytest.mark.parametrize("pure", [pytest.param(False, marks=NEEDS_NATIVE, id="compiled"),
                                  pytest.param(True, id="pure-python")])
@pytest.mark.parametrize("scenario", list(PROGRAMS))
@pytest.mark.once_per_ci  # both paths are its parameters, each in a child of its own
def test_process_exits_cleanly(scenario, pure):
    if scenario == "framework-exports":
        pytest.importorskip("torch")
    code = textwrap.dedent(PROGRAMS[scenario]) + textwrap.dedent(f"""
        import exchange._core
        assert exchange._core.compiled() is {not pure}, exchange._core.compiled()
        print("done", flush=True)
    """)
    # The exit hook gives queued host-stream work EXCHANGE_EXIT_TIMEOUT seconds (a sleep
    # of 30 s is queued in some programs): keep that short here.
    env = dict(os.environ, EXCHANGE_PURE_PYTHON="1" if pure else "0", EXCHANGE_EXIT_TIMEOUT="0.5")
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, f"exit status {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert r.stdout.strip().endswith("done")
    for bad in ("Fatal Python error", "Segmentation fault", "Traceback", "Exception ignored"):
        assert bad not in r.stderr, r.stderr
