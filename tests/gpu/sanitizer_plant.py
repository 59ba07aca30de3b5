"""The planted premature free that compute-sanitizer must catch (ci/gpu-check.sh's
sanitizer step runs it under ``compute-sanitizer --tool memcheck``, so the check is
known to bite before its "0 errors" on the real tests is believed).

    EXCHANGE_TEST_UNORDERED_FREE=1 python tests/gpu/sanitizer_plant.py

Memory this library allocated (``tx.empty`` on CUDA: the driver's stream-ordered pool,
whose allocations and frees memcheck tracks, where a sub-allocation inside CuPy's or
PyTorch's own pool would be invisible to it) is read on stream b by a kernel that
first spins for SPIN_NS; its last holder goes while that kernel still spins. With the
test-only switch (``exchange.devices.cuda.UNORDERED_FREE_ENV``) the free goes on the
allocation stream a at once, ordered after nothing on b: the read is a use after free
in stream order, which ``--track-stream-ordered-races all`` reports whatever the
timing. Without the switch the free waits for b and nothing is reported.

With EXCHANGE_DEBUG_POISON=1 the free first fills the memory with a pattern on a, so
even without the sanitizer the reader's copy shows whether the free came first.

Prints one line, ``plant: unordered free <on|off>; the reader saw <its data|freed memory
(the poison pattern)|other values>``; exits 0 when it ran, 2 when it cannot run here.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

N = 1 << 20
SPIN_NS = 200_000_000


def main() -> int:
    try:
        import cupy as cp
        import numpy as np

        import exchange as tx
        from exchange.devices.cuda import POISON_BYTE, UNORDERED_FREE_ENV
        from gpu_helpers import BLOCK, GRID, KERNELS, cupy_stream, raw_view

        a, b = tx.create_stream("cuda:0"), tx.create_stream("cuda:0")
    except Exception as exc:  # no GPU, no CuPy: nothing to plant
        print(f"plant: cannot run here: {type(exc).__name__}: {exc}")
        return 2
    spin_then_copy = cp.RawModule(code=KERNELS).get_function("spin_then_copy")
    t = tx.empty((N,), "float32", device="cuda:0", stream=a)
    out = tx.empty((N,), "float32", device="cuda:0", stream=b)
    with cupy_stream(cp, a):
        raw_view(cp, t)[...] = cp.float32(7.0)
    v = tx.from_dlpack(t, stream=b)  # b waits for the fill; b joins the record's streams
    with cupy_stream(cp, b):
        spin_then_copy(GRID, BLOCK, (raw_view(cp, v), raw_view(cp, out), np.int64(N), np.uint64(SPIN_NS)))
    del t, v  # the last holders go while the reader on b still spins
    gc.collect()
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
    print(f"plant: unordered free {'on' if planted else 'off'}; the reader saw {seen}", flush=True)
    del out
    gc.collect()
    tx.registry().collect(timeout=10)
    cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
