"""The smoke test of one installed wheel (ci/wheel-smoke.sh runs it in a fresh environment
of the wheel's Python that holds the wheel and NumPy alone, from outside the checkout):

    python smoke.py native    the compiled core is in use (and doctor says so)
    python smoke.py pure      EXCHANGE_PURE_PYTHON=1 is set: the pure-Python path is

Either way: the package is the installed one; importing it warns of nothing;
``tensor-exchange doctor --json`` reports the path and passes its self-check; a NumPy
array goes in and back out sharing its memory, and the registry empties after; a
``shared=True`` tensor goes through a spawn Queue to a child that reads it and writes
into it, and the parent sees the write. Exit status 0, and one line saying so.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import sysconfig
import time
import warnings
from pathlib import Path


def child(inbox, outbox) -> None:
    import numpy as np

    t = inbox.get(timeout=60)
    a = np.from_dlpack(t)
    outbox.put(float(a.sum()))
    a[0] = 42.0  # the parent's memory: it checks the write
    del a, t


def check(want_native: bool) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import numpy as np

        import exchange as tx
        from exchange import _core
    ours = [str(w.message) for w in caught if "exchange" in w.filename]
    assert not ours, f"importing exchange warned: {ours}"
    site = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    assert Path(tx.__file__).resolve().parent.parent in site, f"exchange from {tx.__file__}, not this environment"
    assert _core.compiled() is want_native, f"native={_core.compiled()}: {_core.WHY_PURE}"

    # doctor, as the console script, with only the environment's bin/ on PATH (no compiler)
    bin_dir = Path(sys.executable).parent
    proc = subprocess.run([str(bin_dir / "tensor-exchange"), "doctor", "--json"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PATH": str(bin_dir)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["path"]["native"] is want_native, report["path"]
    assert report["self_check"]["ok"] and report["self_check"]["registry_empty"], report["self_check"]
    assert not proc.stderr.strip(), proc.stderr[-3000:]

    # NumPy -> tx -> NumPy, zero-copy; the registry empties after
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = tx.from_dlpack(a)
    b = np.from_dlpack(t)
    assert t.data_ptr == a.ctypes.data == b.ctypes.data and (b == a).all()
    del t, b
    tx.registry().collect(timeout=10)
    assert tx.registry().stats()["live_records"] == 0, tx.registry().stats()

    # a hand-off through a spawn Queue: the child maps the same memory
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(inbox, outbox))
    p.start()
    t = tx.empty((1024,), "float32", shared=True)
    np.from_dlpack(t)[:] = 1.0
    inbox.put(t)
    total = outbox.get(timeout=120)
    p.join(60)
    assert p.exitcode == 0, f"the spawn child exited with {p.exitcode}"
    assert total == 1024.0, total
    assert np.from_dlpack(t)[0] == 42.0, "the child's write did not reach the parent's memory"
    return report["path"]["why"]


def main() -> int:
    want = sys.argv[1] if len(sys.argv) > 1 else "native"
    if want not in ("native", "pure"):
        print(__doc__)
        return 2
    pure_env = os.environ.get("EXCHANGE_PURE_PYTHON", "") not in ("", "0")
    if pure_env != (want == "pure"):
        print(f"smoke.py {want}: EXCHANGE_PURE_PYTHON must be {'1' if want == 'pure' else 'unset'}")
        return 2
    start = time.perf_counter()
    why = check(want == "native")
    print(f"smoke {want}: Python {sys.version.split()[0]}: ok in {time.perf_counter() - start:.1f} s ({why})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
