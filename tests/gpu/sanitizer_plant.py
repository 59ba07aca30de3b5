"""The planted premature frees that compute-sanitizer must catch (ci/gpu_sanitizer.py runs
this under ``compute-sanitizer --tool memcheck``, so the check is known to bite before
its "0 errors" on the real tests is believed).

    python tests/gpu/sanitizer_plant.py [--mode unordered|after-free]

Memory this library allocated (``tx.empty`` on CUDA: the driver's stream-ordered pool,
whose allocations and frees memcheck tracks, where a sub-allocation inside CuPy's or
PyTorch's own pool would be invisible to it) is read on stream b by a kernel that
first spins for SPIN_NS.

``unordered`` (the default; needs the test-only switch
``EXCHANGE_TEST_UNORDERED_FREE=1``, ``exchange.devices.cuda.UNORDERED_FREE_ENV``): the
last holder goes while the reader still spins, and the switch makes the library's own
release free the memory on the allocation stream a at once, ordered after nothing on
b: the read races the free, which ``--track-stream-ordered-races all`` should report.
Whether the read comes after the free in time depends on launches running at once: a
sanitizer that runs them one after another lets the reader finish first.

``after-free`` (no switch): the last holder goes before the reader is launched (the
library frees on a), then b is made to wait for a's work, the free included, and the
reader is launched on b over the freed address: a use after free in stream order
whatever the timing, an ordering bug of the kind a wrong wait would make.

With EXCHANGE_DEBUG_POISON=1 every free first fills the memory with a pattern on its
stream, so the reader's copy shows, even without the sanitizer, whether the free came
first.

Prints one line, ``plant <mode>: unordered free <on|off>; the reader saw <its data|freed
memory (the poison pattern)|other values>``; exits 0 when it ran, 2 when it cannot run
here.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

N = 1 << 20
SPIN_NS = 200_000_000
MODES = ("unordered", "after-free")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES, default="unordered")
    mode = parser.parse_args(argv).mode
    try:
        import cupy as cp
        import numpy as np

        import exchange as tx
        from exchange.devices.cuda import POISON_BYTE, UNORDERED_FREE_ENV
        from gpu_helpers import BLOCK, GRID, KERNELS, cupy_stream, raw_view

        a, b = tx.create_stream("cuda:0"), tx.create_stream("cuda:0")
    except Exception as exc:  # no GPU, no CuPy: nothing to plant
        print(f"plant {mode}: cannot run here: {type(exc).__name__}: {exc}")
        return 2
    spin_then_copy = cp.RawModule(code=KERNELS).get_function("spin_then_copy")
    t = tx.empty((N,), "float32", device="cuda:0", stream=a)
    out = tx.empty((N,), "float32", device="cuda:0", stream=b)
    with cupy_stream(cp, a):
        raw_view(cp, t)[...] = cp.float32(7.0)
    if mode == "unordered":
        v = tx.from_dlpack(t, stream=b)  # b waits for the fill; b joins the record's streams
        with cupy_stream(cp, b):
            spin_then_copy(GRID, BLOCK, (raw_view(cp, v), raw_view(cp, out), np.int64(N), np.uint64(SPIN_NS)))
        del t, v  # the last holders go while the reader on b still spins
        gc.collect()
    else:
        address = t.data_ptr
        del t  # freed on a (nothing else used it)
        gc.collect()
        b.wait(a.record())  # the ordering bug: b's reader comes after the free
        freed = cp.ndarray((N,), dtype=cp.float32, memptr=cp.cuda.MemoryPointer(
            cp.cuda.UnownedMemory(address, N * 4, None, 0), 0))
        with cupy_stream(cp, b):
            spin_then_copy(GRID, BLOCK, (freed, raw_view(cp, out), np.int64(N), np.uint64(0)))
        del freed
    b.synchronize()
    got = cp.asnumpy(raw_view(cp, out))
    poison = np.frombuffer(bytes([POISON_BYTE]) * 4, dtype=np.float32)[0]
    if (got == 7.0).all():
        seen = "its data"
    elif (got == poison).any():
        seen = "freed memory (the poison pattern)"
    else:
        seen = "other values"
    planted = os.environ.get(UNORDERED_FREE_ENV, "") not in ("", "0")
    print(f"plant {mode}: unordered free {'on' if planted else 'off'}; the reader saw {seen}", flush=True)
    del out
    gc.collect()
    tx.registry().collect(timeout=10)
    cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
