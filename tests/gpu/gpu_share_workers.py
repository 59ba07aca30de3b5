"""The processes of the CUDA sharing tests (test_gpu_share.py): a producer that fills
shared CUDA memory with a kernel and shares it while the kernel runs, and a consumer
that attaches it and reads it with a kernel of its own. Tensors go from one to the other
on a Queue of their own (``channel``); each answers the test's commands on ``outbox``.
Every wait is bounded by a timeout. Nothing here touches CUDA at import time.
"""

from __future__ import annotations

import gc
import os
import queue
import time
from typing import Any

#: Seconds any one wait of a share test or of its processes may take
#: (EXCHANGE_GPU_SHARE_TIMEOUT, default 20): shorter than a test's own limit
#: (conftest.py), so a worker that fails shows its error before the test is stopped.
TIMEOUT = float(os.environ.get("EXCHANGE_GPU_SHARE_TIMEOUT", "20"))
N = 1 << 20
BASE = 7.0


def _kernels(cp: Any) -> dict:
    from gpu_helpers import KERNELS

    module = cp.RawModule(code=KERNELS)
    return {name: module.get_function(name) for name in ("spin_then_fill", "spin_then_copy")}


def _stats(tx: Any) -> dict:
    gc.collect()
    tx.registry().collect(timeout=30)
    return dict(tx.registry().stats())


def _exit(cp: Any, tx: Any, outbox: Any) -> None:
    """("exit",): under compute-sanitizer (EXCHANGE_GPU_SANITIZER=1) first leave no
    device memory of ours or CuPy's pool, so --leak-check reports only real leaks."""
    if os.environ.get("EXCHANGE_GPU_SANITIZER"):
        _stats(tx)
        cp.get_default_memory_pool().free_all_blocks()
    outbox.put(("ok", None))


def _loop(inbox: Any, outbox: Any, ops: dict) -> None:
    while True:
        try:
            message = inbox.get(timeout=TIMEOUT * 2)
        except queue.Empty:
            return  # the test is gone
        op, args = message[0], message[1:]
        del message
        try:
            ops[op](*args)
        except BaseException as exc:
            outbox.put(("err", type(exc).__name__, str(exc)))
        if op == "exit":
            return


def producer(inbox: Any, outbox: Any, channel: Any, poison: bool) -> None:
    """("share", spin): N floats BASE + i written by a kernel that first spins ``spin`` ns
    on a stream of its own; the tensor goes on ``channel`` while that kernel runs, and
    this process drops its own reference; answers ("ok", kernel still running).
    ("state",): the last shared record's (state, holders). ("stats",), ("exit",)."""
    if poison:
        from exchange.devices.cuda import POISON_ENV

        os.environ[POISON_ENV] = "1"
    import cupy as cp
    import numpy as np

    import exchange as tx
    from gpu_helpers import BLOCK, GRID, cupy_stream, raw_view

    cp.cuda.Device(0).use()
    kernels = _kernels(cp)
    last: list = [None]

    def share(spin: int) -> None:
        s = tx.create_stream("cuda:0")
        t = tx.empty((N,), "float32", device="cuda:0", stream=s, shared=True)
        view = raw_view(cp, t)
        with cupy_stream(cp, s):
            kernels["spin_then_fill"](GRID, BLOCK, (view, np.int64(N), np.uint64(spin), np.float32(BASE)))
        busy = not s.record().query()
        last[0] = t.record
        channel.put(t)  # shared (by the Queue's feeder thread) while the kernel still runs
        del view, t
        outbox.put(("ok", busy))

    _loop(inbox, outbox, {
        "share": share,
        "state": lambda: outbox.put(("ok", (last[0].state, last[0].holders))),
        "stats": lambda: outbox.put(("ok", _stats(tx))),
        "exit": lambda: _exit(cp, tx, outbox),
    })


def consumer(inbox: Any, outbox: Any, channel: Any) -> None:
    """("read", spin): takes a tensor from ``channel`` and copies it with a kernel on a
    stream of its own that first spins ``spin`` ns; drops the tensor while that kernel
    runs and answers ("dropped", local record state, kernel done); then waits for the
    kernel and answers ("ok", the copy holds BASE + i). ("hold",): keeps the next tensor
    of ``channel``. ("use", seconds): polls the held tensor until its use raises
    LifetimeError (answers ("lifetime", message, its repr)) or the time is up (("ok", shape)).
    ("attach_both", h1, h2): attaches two handles, keeps both, answers their data
    pointers, read-only flags and this process's live records. ("sum",), ("drop",),
    ("stats",), ("exit",)."""
    import cupy as cp
    import numpy as np

    import exchange as tx
    from gpu_helpers import BLOCK, GRID

    cp.cuda.Device(0).use()
    kernels = _kernels(cp)
    held: list = [None]

    def read(spin: int) -> None:
        t = channel.get(timeout=TIMEOUT)  # the reducer attaches it here
        c = cp.cuda.Stream(non_blocking=True)
        out = cp.empty(N, dtype=cp.float32)
        with c:
            arr = cp.from_dlpack(t)  # c waits for the data: the producer's kernel
            kernels["spin_then_copy"](GRID, BLOCK, (arr, out, np.int64(N), np.uint64(spin)))
        record = t.record
        del arr, t  # the last holders go while the kernel on c still runs
        gc.collect()
        outbox.put(("dropped", record.state, bool(c.done)))
        c.synchronize()
        expected = cp.arange(N, dtype=cp.float32) + np.float32(BASE)
        outbox.put(("ok", bool((out == expected).all())))

    def hold() -> None:
        held[0] = channel.get(timeout=TIMEOUT)
        outbox.put(("ok", str(held[0].device)))

    def use(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            try:
                shape = held[0].shape
            except tx.LifetimeError as exc:
                outbox.put(("lifetime", str(exc), repr(held[0])))
                return
            if time.monotonic() > deadline:
                outbox.put(("ok", shape))
                return
            time.sleep(0.01)

    def drop() -> None:
        held[0] = None
        outbox.put(("ok", None))

    def attach_both(first: Any, second: Any) -> None:
        # Two handles of one allocation (one says read-only): one mapping here, one record.
        a, b = tx.attach(first), tx.attach(second)
        held[0] = (a, b)
        outbox.put(("ok", (a.data_ptr, b.data_ptr, a.readonly, b.readonly, _stats(tx)["live_records"])))

    _loop(inbox, outbox, {
        "read": read,
        "hold": hold,
        "use": use,
        "sum": lambda: outbox.put(("ok", float(cp.from_dlpack(held[0]).sum()))),
        "drop": drop,
        "attach_both": attach_both,
        "stats": lambda: outbox.put(("ok", _stats(tx))),
        "exit": lambda: _exit(cp, tx, outbox),
    })
