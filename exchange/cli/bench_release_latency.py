"""``tensor-exchange bench`` section "release_latency": stream-ordered release, the time
from the last holder going to the producer's deleter having run (a weakref callback on
the producer's array), on the default host path, on an idle and a busy host stream (2 ms
of queued work, which the release must wait for), and on a CUDA stream where a device
and its backend are present (on ``--device cuda`` also after a 2 ms kernel that reads
the memory). No key, no target: the figures are in ``details["release"]``.
"""

from __future__ import annotations

import statistics
import threading
import time
import weakref
from typing import Any, Callable

from .bench import Config

__all__ = ["KEYS", "TARGETS", "DETAILS", "measure", "format"]

KEYS: tuple[str, ...] = ()
TARGETS: dict[str, float] = {}
#: The entries of ``details`` this section fills.
DETAILS = ("release",)
_ns = time.perf_counter_ns


def measure(cfg: Config, peers: dict[str, Any]) -> dict[str, Any]:
    return {"keys": {}, "details": {"release": measure_release(cfg)}}


def _latencies(make: Callable[[], tuple[Any, Any]], samples: int, busy: float = 0.0,
               stream: Any = None, timeout: float = 5.0) -> dict[str, Any]:
    """``make()`` returns (producer array, our tensor over it), the caller holding no
    other reference to the array; the array's weakref callback runs when the producer's
    deleter frees it. Latency: from dropping the tensor to that callback."""
    lat, after_work, late = [], [], 0
    for _ in range(samples):
        done = threading.Event()
        box = [0, 0]

        def freed(box: list[int] = box, done: threading.Event = done) -> None:
            box[0] = _ns()
            done.set()

        arr, t = make()
        weakref.finalize(arr, freed)
        del arr
        if busy:
            def work(box: list[int] = box) -> None:
                time.sleep(busy)
                box[1] = _ns()
            stream.submit(work)
        t0 = _ns()
        del t
        if not done.wait(timeout):
            late += 1
            continue
        lat.append(box[0] - t0)
        if busy:
            after_work.append(box[0] - box[1])
    out: dict[str, Any] = {"samples": len(lat), "timeouts": late}
    if lat:
        out.update(median_us=statistics.median(lat) / 1e3, max_us=max(lat) / 1e3, min_us=min(lat) / 1e3)
    if busy and after_work:
        out.update(busy_ms=busy * 1e3, after_work_median_us=statistics.median(after_work) / 1e3,
                   ordered=all(d >= 0 for d in after_work))
    return out


def measure_release(cfg: Config) -> dict[str, Any]:
    import numpy as np

    import exchange as tx

    out: dict[str, Any] = {}

    def host_default() -> tuple[Any, Any]:
        a = np.ones(256, dtype=np.float32)
        return a, tx.from_dlpack(a)

    out["cpu_default_stream"] = _latencies(host_default, cfg.release_samples)
    s = tx.create_stream("cpu")
    try:
        def host_stream() -> tuple[Any, Any]:
            a = np.ones(256, dtype=np.float32)
            return a, tx.from_dlpack(a, stream=s)

        s.synchronize()
        out["cpu_host_stream_idle"] = _latencies(host_stream, cfg.release_samples)
        out["cpu_host_stream_busy"] = _latencies(host_stream, cfg.busy_samples, busy=0.002, stream=s)
    finally:
        close = getattr(s, "close", None)
        if close is not None:
            close()
    out["cuda"] = _release_cuda(cfg)
    return out


def _release_cuda(cfg: Config) -> dict[str, Any]:
    """The same on a CUDA stream, producer CuPy (or PyTorch); skipped with the reason."""
    import exchange as tx

    try:
        s = tx.create_stream("cuda")
    except Exception as exc:
        return {"skipped": f"{type(exc).__name__}: {exc}"}
    make: Callable[[], tuple[Any, Any]] | None = None
    try:
        import cupy

        def make_cupy() -> tuple[Any, Any]:
            x = cupy.ones(256, dtype=cupy.float32)
            return x, tx.from_dlpack(x, stream=s)

        make = make_cupy
        producer = "cupy"
    except Exception:
        try:
            import torch

            if not torch.cuda.is_available():
                raise ImportError("torch has no CUDA here")

            def make_torch() -> tuple[Any, Any]:
                x = torch.ones(256, dtype=torch.float32, device="cuda")
                return x, tx.from_dlpack(x, stream=s)

            make = make_torch
            producer = "torch"
        except Exception as exc:
            return {"skipped": f"no CUDA array producer (cupy or torch with CUDA): {exc}"}
    try:
        x, t = make()
        weakref.ref(x)
        del x, t
    except TypeError:
        return {"skipped": f"{producer} arrays take no weak references, so the deleter cannot be observed"}
    result = _latencies(make, cfg.release_samples)
    result["producer"] = producer
    if cfg.device == "cuda" and producer == "cupy":
        result["after_kernel"] = _release_after_kernel(cfg, s)
    return result


#: CUDA C for the release-after-a-kernel figure: thread 0 of block 0 spins ``ns``
#: nanoseconds of %globaltimer (wall-clock time), then reads the data.
_SPIN_KERNEL = r"""
extern "C" __global__ void spin_read(const float* x, float* out, unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
    out[0] = x[0];
}
"""


def _release_after_kernel(cfg: Config, s: Any, busy_ms: float = 2.0) -> dict[str, Any]:
    """CUDA: the last holder of an imported CuPy array goes while a 2 ms kernel on our
    stream ``s`` still reads it. ``after_kernel_median_us``: from the host seeing the
    kernel end (an event recorded after it, synchronised) to CuPy's deleter having run
    (negative when the reaper saw the end first); ``ordered``: the deleter never ran
    before that event completed."""
    import cupy

    import exchange as tx

    kernel = cupy.RawKernel(_SPIN_KERNEL, "spin_read")
    out = cupy.zeros(1, dtype=cupy.float32)
    from ..frameworks.cupy_adapter import cupy_stream

    lat, ordered, late = [], True, 0
    for _ in range(cfg.busy_samples):
        x = cupy.ones(256, dtype=cupy.float32)
        cupy.cuda.Stream.null.synchronize()
        t = tx.from_dlpack(x, stream=s)
        with cupy_stream(cupy, s):
            kernel((1,), (1,), (x, out, cupy.uint64(int(busy_ms * 1e6))))
        end = s.record()
        done = threading.Event()
        box = [0, True]

        def freed(box: list[Any] = box, done: threading.Event = done, end: Any = end) -> None:
            box[0] = _ns()
            box[1] = end.query()
            done.set()

        weakref.finalize(x, freed)
        del x
        del t
        end.synchronize()
        seen = _ns()
        if not done.wait(5.0):
            late += 1
            continue
        lat.append(box[0] - seen)
        ordered = ordered and bool(box[1])
    out_info: dict[str, Any] = {"busy_ms": busy_ms, "samples": len(lat), "timeouts": late, "ordered": ordered}
    if lat:
        out_info["after_kernel_median_us"] = statistics.median(lat) / 1e3
    return out_info


def format(section: dict[str, Any]) -> list[str]:
    lines = ["stream-ordered release (last holder dropped -> producer's deleter ran)"]
    for name, r in section["details"]["release"].items():
        if "skipped" in r:
            lines.append(f"  {name:24} skipped: {r['skipped']}")
        elif r.get("samples"):
            text = f"  {name:24} median {r['median_us']:9.1f} us  max {r['max_us']:9.1f} us"
            if "after_work_median_us" in r:
                text += (f"  ({r['busy_ms']:g} ms of queued work; after it: {r['after_work_median_us']:.1f} us, "
                         f"{'ordered' if r['ordered'] else 'NOT ORDERED'})")
            if r["timeouts"]:
                text += f"  {r['timeouts']} timeouts"
            lines.append(text)
            after = r.get("after_kernel")
            if after and after.get("samples"):
                lines.append(f"  {'  after a ' + _g(after['busy_ms']) + ' ms kernel':24} median "
                             f"{after['after_kernel_median_us']:9.1f} us after the kernel ended, "
                             f"{'ordered' if after['ordered'] else 'NOT ORDERED'}")
        else:
            lines.append(f"  {name:24} no sample completed ({r['timeouts']} timeouts)")
    return lines


def _g(x: float) -> str:
    """``x`` as the ``g`` format gives it (this module's ``format`` shadows the builtin)."""
    return f"{x:g}"
