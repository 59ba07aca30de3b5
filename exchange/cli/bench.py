"""``tensor-exchange bench``: what a DLPack hop through this library costs, next to the
peers' own hops, measured in one run.

Sections (each a median over many timing samples, after a warm-up):

* export hop: ``np.from_dlpack(t)`` for a tx Tensor ``t`` against ``np.from_dlpack(a)``
  for the NumPy array ``a`` it wraps;
* import hop: ``tx.from_dlpack(a)`` against ``np.from_dlpack(a)`` (and
  ``torch.from_dlpack(a)`` where PyTorch is installed);
* size sweep, 1 KiB to 1 GiB (``--quick``: to 64 MiB), one array held at a time: a
  zero-copy hop costs the same at every size;
* threads 1, 2, 4, 8 doing exchanges (NumPy -> tx -> NumPy) at once: exchanges per
  second;
* one chain hop: NumPy -> tx -> PyTorch against ``torch.from_dlpack`` of the NumPy array
  (NumPy -> tx -> NumPy against ``np.from_dlpack`` without PyTorch); ``--chain chain``
  measures a two-stage ``tx.Chain`` against the same stages glued by hand instead;
* stream-ordered release: time from the last holder going to the producer's deleter
  having run, on host streams, and on CUDA where a device and its backend are present;
* further sections (``SECTIONS``, one module each): release at scale, sharing across
  processes, Ray, the compiled core, what serving ``tensor-exchange top`` costs the
  watched process (exchange/cli/bench_top.py), and with ``--device cuda`` the host's
  side of the CUDA hot path (exchange/cli/bench_cuda.py: host time per hop and per
  release, CUDA events created, host syncs per 100 chain hops).

``--device cuda`` puts the data on the GPU: CuPy arrays, with CuPy's ``from_dlpack`` as
the peer (its figures under the ``numpy`` keys, so the JSON keeps one shape) and
PyTorch's beside it, for the hop, size, chain and release sections (the release section
then also times the release after a 2 ms kernel ends); the thread section stays on the
CPU. It exits 2 with the reason where CUDA or CuPy cannot run.

Every hop includes dropping its result (so a hop's cost includes the release it starts).
Timing: ``time.perf_counter_ns`` around a batch of calls (the batch sized so a sample
lasts a few milliseconds), the candidates of a comparison sampled in turn (so drift on a
noisy machine hits all of them), the garbage collector off while sampling.

``--json`` prints one JSON object on stdout (the table then goes to stderr)::

    {"export_hop_ratio": float, "import_hop_ratio": float, "size_flatness": float,
     "thread_scaling": {"1": float, "2": float, "4": float, "8": float},
     "chain_hop_ratio": float, "details": {...}}

Ratios are ours over the peer's median; ``size_flatness`` is the worse of the import and
export hops' median at the largest size over the same hop at the smallest (1 KiB),
sampled in the same rounds; ``thread_scaling`` holds exchanges per second.
The command never fails on a slow result; ``--check`` makes it exit 1 when a target
(``TARGETS``, upper bounds; a section's ``FLOORS``, lower bounds) is missed. ``--plot DIR`` also writes PNG figures of the result
(exchange/cli/bench_plot.py; needs matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Sequence

__all__ = ["KEYS", "TARGETS", "add_arguments", "run", "main", "measure"]

#: The top-level keys of the ``--json`` object.
KEYS = ("export_hop_ratio", "import_hop_ratio", "size_flatness", "thread_scaling", "chain_hop_ratio", "details")

#: Targets on a 2-core machine (issue 6; the hop ratios of issue 10); ``--check`` exits 1
#: when one is missed.
TARGETS = {"export_hop_ratio": 1.3, "import_hop_ratio": 2.0, "size_flatness": 1.5, "chain_hop_ratio": 1.2}

#: Further sections, each in a module of its own (``exchange.cli.bench_<name>``), run
#: after the core ones in this order. A section module provides ``KEYS`` (the top-level
#: ``--json`` keys it adds), ``TARGETS`` (key -> upper bound), optionally ``FLOORS``
#: (key -> lower bound: a rate that must reach it), ``measure(cfg, peers) ->
#: {"keys": {key: value}, "details": {...}}`` and ``format(section) -> list[str]`` (its
#: table lines; ``section`` is what ``measure`` returned).
SECTIONS: tuple[str, ...] = ("release", "share", "ray", "core", "cuda", "import", "trace", "top", "pipeline")

THREAD_COUNTS = (1, 2, 4, 8)
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
_ns = time.perf_counter_ns


class Config:
    """How long each section measures; ``--quick`` takes about 30 s on a 2-core VM (every section)."""

    def __init__(self, quick: bool, samples: int | None = None, max_size: int | None = None,
                 device: str = "cpu") -> None:
        self.quick = quick
        self.device = device                                       # "cpu" or "cuda": where the hops' data lives
        self.samples = samples or (21 if quick else 101)          # hop comparisons
        self.chain_samples = max(21, self.samples // 3)            # chain rounds (paired ratios, see measure_chain)
        self.size_samples = max(5, self.samples // 2) if quick else max(9, self.samples // 3)
        self.sample_ns = 2_000_000 if quick else 5_000_000         # one timing sample lasts about this
        self.max_size = max_size or (64 * MiB if quick else GiB)
        self.size_step = 16 if quick else 4                        # 1 KiB * step**k
        self.thread_seconds = 0.25 if quick else 1.0
        self.release_samples = 30 if quick else 200
        self.busy_samples = 8 if quick else 40

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


# -- timing primitives ------------------------------------------------------------------
def _loop1(f: Callable[[Any], Any], x: Any, n: int) -> int:
    """Nanoseconds for ``n`` calls of ``f(x)`` (the result dropped at once)."""
    rep = itertools.repeat(None, n)
    t0 = _ns()
    for _ in rep:
        f(x)
    return _ns() - t0


def _loop2(f: Callable[[Any], Any], g: Callable[[Any], Any], x: Any, n: int) -> int:
    """Nanoseconds for ``n`` calls of ``f(g(x))``: two hops glued as a user writes them."""
    rep = itertools.repeat(None, n)
    t0 = _ns()
    for _ in rep:
        f(g(x))
    return _ns() - t0


class Candidate:
    """One timed thing: ``f(x)``, or ``f(g(x))`` when ``g`` is given."""

    def __init__(self, name: str, f: Callable[[Any], Any], x: Any, g: Callable[[Any], Any] | None = None) -> None:
        self.name, self.f, self.x, self.g = name, f, x, g
        self.batch = 1
        self.samples: list[float] = []

    def time(self, n: int) -> int:
        if self.g is None:
            return _loop1(self.f, self.x, n)
        return _loop2(self.f, self.g, self.x, n)

    def calibrate(self, sample_ns: int) -> None:
        """Pick the batch so one sample lasts about ``sample_ns``; also the warm-up."""
        self.time(16)  # first calls may initialise things (PyTorch does): not timed
        n = 8
        while True:
            elapsed = min(self.time(n), self.time(n))
            if elapsed >= sample_ns // 4 or n >= 1 << 22:
                break
            n *= 4
        self.batch = max(1, min(1 << 24, int(n * sample_ns / max(elapsed, 1))))
        self.time(self.batch)  # warm-up at the final batch size

    def sample(self) -> None:
        self.samples.append(self.time(self.batch) / self.batch)

    def summary(self) -> dict[str, Any]:
        s = sorted(self.samples)
        return {
            "median_ns": statistics.median(s),
            "p10_ns": s[len(s) // 10],
            "p90_ns": s[(len(s) * 9) // 10],
            "batch": self.batch,
            "samples": len(s),
        }

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def round_median(self, samples: int) -> float:
        """Take ``samples`` samples and return their median, keeping none: one round of
        a comparison whose rounds the caller interleaves with other work."""
        for _ in range(samples):
            self.sample()
        value = statistics.median(self.samples)
        self.samples.clear()
        return value


@contextlib.contextmanager
def _gc_off() -> Iterator[None]:
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def compare(candidates: Sequence[Candidate], samples: int, sample_ns: int) -> dict[str, dict[str, Any]]:
    """Sample the candidates in turn (rotating the order every round) and summarise."""
    with _gc_off():
        for c in candidates:
            c.calibrate(sample_ns)
        k = len(candidates)
        for i in range(samples):
            for j in range(k):
                candidates[(i + j) % k].sample()
    return {c.name: c.summary() for c in candidates}


# -- sections --------------------------------------------------------------------------
def _peers(device: str = "cpu") -> dict[str, Any]:
    """The peers measured beside us: PyTorch where installed (with CUDA for
    ``device="cuda"``), and CuPy on CUDA (there the producer of the hops' data)."""
    peers: dict[str, Any] = {}
    try:
        import torch

        if device == "cpu" or torch.cuda.is_available():
            peers["torch"] = torch
    except Exception:  # not installed, or broken: the torch columns are skipped
        pass
    if device == "cuda":
        import cupy

        peers["cupy"] = cupy
    return peers


def cuda_unusable_reason() -> str | None:
    """Why ``--device cuda`` cannot run here (the CUDA backend must load and CuPy must
    run a kernel), or None when it can."""
    from exchange.devices.base import get_backend

    from ..device import DeviceType
    from ..errors import BackendUnavailableError

    try:
        get_backend(DeviceType.kDLCUDA)
    except BackendUnavailableError as exc:
        return f"the CUDA backend cannot load: {exc}"
    try:
        import cupy

        int((cupy.arange(4) + 1).sum())
    except Exception as exc:  # not installed, or no device for it
        return f"CuPy cannot run a kernel here ({type(exc).__name__}: {exc}); --device cuda measures CuPy data"
    return None


def _array(peers: dict[str, Any], cfg: Config, n: int, fill: float | None = None) -> Any:
    """A float32 array of ``n`` elements where ``cfg.device`` says: NumPy, or CuPy on
    CUDA (written and synchronised, so its pages exist and no work is pending)."""
    if cfg.device == "cuda":
        cp = peers["cupy"]
        a = cp.arange(n, dtype=cp.float32) if fill is None else cp.full(n, fill, dtype=cp.float32)
        cp.cuda.Stream.null.synchronize()
        return a
    import numpy as np

    return np.arange(n, dtype=np.float32) if fill is None else np.full(n, fill, dtype=np.float32)


def _consumer(peers: dict[str, Any], cfg: Config) -> tuple[str, Callable[[Any], Any]]:
    """The framework whose ``from_dlpack`` takes our exports: NumPy, or CuPy on CUDA."""
    if cfg.device == "cuda":
        return "cupy", peers["cupy"].from_dlpack
    import numpy as np

    return "np", np.from_dlpack


def measure_hops(cfg: Config, peers: dict[str, Any]) -> dict[str, Any]:
    import exchange as tx

    # On CUDA the array is CuPy's and CuPy is the peer (the "numpy" keys then hold CuPy's
    # figures, so the JSON keeps one shape); PyTorch joins where it has CUDA.
    a = _array(peers, cfg, 256)  # 1 KiB
    name, take = _consumer(peers, cfg)
    kind = "cupy.ndarray" if cfg.device == "cuda" else "ndarray"
    t = tx.from_dlpack(a)
    export_cands = [Candidate("tx", take, t), Candidate("numpy", take, a)]
    if cfg.device == "cuda" and "torch" in peers:
        export_cands.append(Candidate("torch", peers["torch"].from_dlpack, t))
    export = compare(export_cands, cfg.samples, cfg.sample_ns)
    cands = [Candidate("tx", tx.from_dlpack, a), Candidate("numpy", take, a)]
    if "torch" in peers:
        cands.append(Candidate("torch", peers["torch"].from_dlpack, a))
    imp = compare(cands, cfg.samples, cfg.sample_ns)
    loop = compare([Candidate("loop", id, a)], max(5, cfg.samples // 4), cfg.sample_ns)["loop"]
    out = {
        "export": {"ours": f"{name}.from_dlpack(tx_tensor)", "peer": f"{name}.from_dlpack({kind})",
                   "elements": a.size, "dtype": "float32", "device": cfg.device,
                   **{f"{k}_ns": v["median_ns"] for k, v in export.items()}, "samples": export},
        "import": {"ours": f"tx.from_dlpack({kind})", "peer": f"{name}.from_dlpack({kind})", "elements": a.size,
                   "dtype": "float32", "device": cfg.device,
                   **{f"{k}_ns": v["median_ns"] for k, v in imp.items()}, "samples": imp},
        "loop_overhead_ns": loop["median_ns"],
    }
    out["export"]["ratio"] = export["tx"]["median_ns"] / export["numpy"]["median_ns"]
    out["import"]["ratio"] = imp["tx"]["median_ns"] / imp["numpy"]["median_ns"]
    if "torch" in imp:
        out["import"]["ratio_vs_torch"] = imp["tx"]["median_ns"] / imp["torch"]["median_ns"]
    del t
    return out


def _sizes(cfg: Config) -> list[int]:
    sizes, n = [], KiB
    while n < cfg.max_size:
        sizes.append(n)
        n *= cfg.size_step
    sizes.append(cfg.max_size)
    return sizes


def measure_sizes(cfg: Config, peers: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each size is sampled in the same rounds as the 1 KiB reference, so the ratio
    (size over reference) does not move with the machine's drift. One big array at a
    time; it is filled first so its pages exist."""
    import exchange as tx

    peers = peers or {}
    _, take = _consumer(peers, cfg)
    ref = _array(peers, cfg, KiB // 4, fill=1.0)
    ref_t = tx.from_dlpack(ref)
    rows = []
    for size in _sizes(cfg):
        a = _array(peers, cfg, size // 4, fill=1.0)
        t = tx.from_dlpack(a)
        res = compare([Candidate("import", tx.from_dlpack, a), Candidate("import_ref", tx.from_dlpack, ref),
                       Candidate("export", take, t), Candidate("export_ref", take, ref_t),
                       Candidate("numpy", take, a)],
                      cfg.size_samples, cfg.sample_ns)
        rows.append({
            "bytes": size,
            "import_ns": res["import"]["median_ns"],
            "export_ns": res["export"]["median_ns"],
            "numpy_ns": res["numpy"]["median_ns"],
            "import_vs_1k": res["import"]["median_ns"] / res["import_ref"]["median_ns"],
            "export_vs_1k": res["export"]["median_ns"] / res["export_ref"]["median_ns"],
        })
        del t, a
    last = rows[-1]
    return {"rows": rows, "largest_bytes": last["bytes"], "import_flatness": last["import_vs_1k"],
            "export_flatness": last["export_vs_1k"],
            "flatness": max(last["import_vs_1k"], last["export_vs_1k"])}


def _rate(f: Callable[[Any], Any], g: Callable[[Any], Any] | None, threads: int, seconds: float) -> dict[str, Any]:
    import numpy as np

    arrays = [np.ones(256, dtype=np.float32) for _ in range(threads)]
    counts = [0] * threads
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)
    stop = threading.Event()

    def work(i: int) -> None:
        a, n = arrays[i], 0
        try:
            start.wait()
            while not stop.is_set():
                if g is None:
                    _loop1(f, a, 64)
                else:
                    _loop2(f, g, a, 64)
                n += 64
        except BaseException as exc:  # reported in details; the count stays what it was
            errors.append(exc)
        counts[i] = n

    pool = [threading.Thread(target=work, args=(i,), name=f"tx-bench-{i}") for i in range(threads)]
    for th in pool:
        th.start()
    start.wait()
    t0 = _ns()
    time.sleep(seconds)
    stop.set()
    for th in pool:
        th.join()
    elapsed = (_ns() - t0) / 1e9
    return {"per_s": sum(counts) / elapsed, "per_thread": counts, "errors": [repr(e) for e in errors]}


def measure_threads(cfg: Config) -> dict[str, Any]:
    """One exchange is NumPy -> tx -> NumPy (import and export, both registry paths)."""
    import numpy as np

    import exchange as tx

    reg = tx.registry()
    before = reg.stats()
    ours, peer = {}, {}
    with _gc_off():
        for n in THREAD_COUNTS:
            ours[str(n)] = _rate(np.from_dlpack, tx.from_dlpack, n, cfg.thread_seconds)
            peer[str(n)] = _rate(np.from_dlpack, np.from_dlpack, n, cfg.thread_seconds)
    after = reg.stats()
    one = ours["1"]["per_s"] or 1.0
    return {
        "exchange": "np.from_dlpack(tx.from_dlpack(ndarray))",
        "peer": "np.from_dlpack(np.from_dlpack(ndarray))",
        "exchanges_per_s": {k: v["per_s"] for k, v in ours.items()},
        "speedup_vs_1": {k: v["per_s"] / one for k, v in ours.items()},
        "peer_exchanges_per_s": {k: v["per_s"] for k, v in peer.items()},
        "per_thread_counts": {k: v["per_thread"] for k, v in ours.items()},
        "errors": [e for v in ours.values() for e in v["errors"]],
        "registry_balanced": (after["live_records"] == before["live_records"]
                              and after["exports_outstanding"] == before["exports_outstanding"]),
        "seconds_each": cfg.thread_seconds,
    }


def _chain_pair_hop(peers: dict[str, Any], cfg: Config | None = None) -> tuple[list[Candidate], dict[str, Any]]:
    """A tx hop between two frameworks, against the same two glued by their own
    from_dlpack: NumPy -> tx -> PyTorch vs ``torch.from_dlpack(ndarray)`` (on CUDA: CuPy
    -> tx -> PyTorch vs ``torch.from_dlpack(cupy.ndarray)``)."""
    import exchange as tx

    cfg = cfg or Config(True)
    a = _array(peers, cfg, 256)
    src = "cupy" if cfg.device == "cuda" else "numpy"
    if "torch" in peers:
        dst, name = peers["torch"].from_dlpack, "torch"
    else:
        name, dst = _consumer(peers, cfg)
    cands = [Candidate("tx", dst, a, g=tx.from_dlpack), Candidate("glued", dst, a)]
    return cands, {"method": "hop", "ours": f"{name}.from_dlpack(tx.from_dlpack({src}))",
                   "peer": f"{name}.from_dlpack({src})", "frameworks": [src, name], "device": cfg.device}


def _chain_pair_chain(peers: dict[str, Any], cfg: Config | None = None) -> tuple[list[Candidate], dict[str, Any]]:
    """One chain hop between two small model stages: a two-stage ``tx.Chain`` (NumPy
    ``x * 2``, then a PyTorch linear layer with ReLU, 1024 -> 1024; NumPy's matmul
    without PyTorch) on a 256 x 1024 float32 batch (1 MiB), against the same two stages
    glued by hand with the consumer's own ``from_dlpack``. The chain runs inline
    (``max_in_flight=1``), so both sides do the same work on one thread; the ratio is
    what the chain adds per batch, also given in microseconds (``overhead_us``).
    On CUDA (``cfg.device``) the stages are CuPy and PyTorch on the GPU, the chain's
    on streams of their own, and each call ends with ``torch.cuda.synchronize()`` on
    both sides, so the GPU work is in the time and does not pile up."""
    import numpy as np

    import exchange as tx

    cfg = cfg or Config(True)
    cuda = cfg.device == "cuda"
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 1024)).astype(np.float32)
    w = (rng.standard_normal((1024, 1024)) / 32).astype(np.float32)
    first_fw = "cupy" if cuda else "numpy"
    if cuda:
        x = peers["cupy"].asarray(x)
    if "torch" in peers:
        torch = peers["torch"]
        name, dst = "torch", torch.from_dlpack
        wt = torch.from_numpy(w).to("cuda") if cuda else torch.from_numpy(w)

        def second(y: Any) -> Any:
            return torch.relu(y @ wt)
    else:
        name, dst = _consumer(peers, cfg)
        name = "cupy" if cuda else "numpy"
        wx = peers["cupy"].asarray(w) if cuda else w
        xp = peers["cupy"] if cuda else np

        def second(y: Any) -> Any:
            return xp.maximum(y @ wx, 0)

    def first(y: Any) -> Any:
        return y * np.float32(2.0)

    device = "cuda:0" if cuda else "cpu"
    chain = tx.Chain([tx.Stage(first, framework=first_fw, name="scale", device=device),
                      tx.Stage(second, framework=name, name="linear_relu", device=device)],
                     max_in_flight=1, device=device)
    if cuda:
        sync = peers["torch"].cuda.synchronize if "torch" in peers else peers["cupy"].cuda.Device().synchronize
    else:
        def sync() -> None:
            return None

    def via_chain(y: Any) -> Any:
        out = chain(y)
        sync()
        return out

    def glued(y: Any) -> Any:
        out = second(dst(first(y)))
        sync()
        return out

    cands = [Candidate("tx", via_chain, x), Candidate("glued", glued, x)]
    return cands, {"method": "chain", "ours": f"tx.Chain([{first_fw}, {name}])(x), 256x1024",
                   "peer": f"{name} linear(from_dlpack({first_fw} scale(x)))", "device": cfg.device,
                   "frameworks": [first_fw, name], "batch_bytes": int(x.nbytes), "_close": chain.close}


def measure_chain(cfg: Config, peers: dict[str, Any], method: str = "chain") -> dict[str, Any]:
    """``chain_hop_ratio``: the median over rounds of (ours / glued) within each round.
    The two are sampled back to back in every round, so a machine busy with other work
    slows both alike and the per-round ratio stays put where a ratio of the two medians
    swings (on a shared 2-core VM a batch took 2.5 to 24 ms from one run to the next).
    The chain method times whole batches: ``cfg.chain_samples`` rounds of samples of at
    least 20 ms each."""
    cands, info = (_chain_pair_chain if method == "chain" else _chain_pair_hop)(peers, cfg)
    close = info.pop("_close", None)
    try:
        if method == "hop":
            res = compare(cands, cfg.samples, cfg.sample_ns)
        else:
            res = compare(cands, cfg.chain_samples, max(cfg.sample_ns, 20_000_000))
    finally:
        if close is not None:
            close()
    paired = statistics.median(t / g for t, g in zip(cands[0].samples, cands[1].samples))
    info.update({"tx_ns": res["tx"]["median_ns"], "glued_ns": res["glued"]["median_ns"],
                 "overhead_us": (res["tx"]["median_ns"] - res["glued"]["median_ns"]) / 1e3,
                 "ratio": paired, "ratio_of_medians": res["tx"]["median_ns"] / res["glued"]["median_ns"],
                 "samples": res})
    return info


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


# -- machine -----------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    import numpy as np

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
    }
    with contextlib.suppress(Exception):
        info["affinity"] = len(os.sched_getaffinity(0))
    with contextlib.suppress(Exception):
        import torch

        info["torch"] = torch.__version__
    return info


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# -- the whole run -----------------------------------------------------------------------
def _section(name: str) -> Any:
    import importlib

    return importlib.import_module(f"{__package__}.bench_{name}")


def all_keys() -> tuple[str, ...]:
    """Every top-level key of the ``--json`` object: the core ones, then each section's."""
    extra = tuple(k for name in SECTIONS for k in _section(name).KEYS)
    return KEYS[:-1] + extra + KEYS[-1:]


def all_targets() -> dict[str, float]:
    """Every target (key -> upper bound), the core ones and each section's."""
    out = dict(TARGETS)
    for name in SECTIONS:
        out.update(_section(name).TARGETS)
    return out


def all_floors() -> dict[str, float]:
    """Every lower bound (key -> the least it may be), from the sections' ``FLOORS``."""
    out: dict[str, float] = {}
    for name in SECTIONS:
        out.update(getattr(_section(name), "FLOORS", {}))
    return out


def measure(quick: bool = False, *, samples: int | None = None, max_size: int | None = None,
            chain: str = "chain", progress: Callable[[str], None] | None = None,
            device: str = "cpu") -> dict[str, Any]:
    """Run every section and return the result object (see the module docstring).
    ``device="cuda"``: the hop, size, chain and release sections measure CUDA data (CuPy
    arrays; see :func:`cuda_unusable_reason`); the thread section stays on the CPU."""
    from .. import capsule

    say = progress or (lambda _msg: None)
    cfg = Config(quick, samples, max_size, device=device)
    started = time.perf_counter()
    peers = _peers(device)
    say("hops")
    hops = measure_hops(cfg, peers)
    say("sizes")
    sizes = measure_sizes(cfg, peers)
    say("threads")
    threads = measure_threads(cfg)
    say("chain")
    chain_res = measure_chain(cfg, peers, chain)
    say("release")
    release = measure_release(cfg)
    result = {
        "export_hop_ratio": float(hops["export"]["ratio"]),
        "import_hop_ratio": float(hops["import"]["ratio"]),
        "size_flatness": float(sizes["flatness"]),
        "thread_scaling": {k: float(v) for k, v in threads["exchanges_per_s"].items()},
        "chain_hop_ratio": float(chain_res["ratio"]),
        "details": {
            "native": bool(capsule.NATIVE),
            "pure_python_env": os.environ.get("EXCHANGE_PURE_PYTHON", ""),
            "device": device,
            "peers": ["numpy", *peers],
            "machine": machine(),
            "config": cfg.as_dict(),
            "targets": TARGETS,
            "export_hop": hops["export"],
            "import_hop": hops["import"],
            "loop_overhead_ns": hops["loop_overhead_ns"],
            "sizes": sizes,
            "threads": threads,
            "chain": chain_res,
            "release": release,
        },
    }
    sections = {}
    for name in SECTIONS:
        say(f"section {name}")
        section = sections[name] = _section(name).measure(cfg, peers)
        result.update(section["keys"])
    result["details"]["sections"] = sections
    result["details"]["targets"] = all_targets()
    result["details"]["floors"] = all_floors()
    details = result.pop("details")
    result["details"] = details  # last, as KEYS lists it
    result["details"]["missed_targets"] = missed(result)
    result["details"]["elapsed_s"] = time.perf_counter() - started
    return result


def missed(result: dict[str, Any]) -> list[str]:
    """The targets this result misses, as readable lines."""
    def number(k: str) -> bool:
        return isinstance(result.get(k), (int, float))

    return ([f"{k} = {result[k]:.2f} > {limit}" for k, limit in all_targets().items() if number(k) and result[k] > limit]
            + [f"{k} = {result[k]:.2f} < {least}" for k, least in all_floors().items() if number(k) and result[k] < least])


# -- output ------------------------------------------------------------------------------
def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def _fmt_ns(ns: float) -> str:
    """A median in the unit that keeps it short: ``0.412 us``, ``18.3 us``, ``2.51 ms``."""
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e4:
        return f"{ns / 1e3:.1f} us"
    return f"{ns / 1e3:.3f} us"


def format_table(result: dict[str, Any]) -> str:
    d = result["details"]
    m = d["machine"]
    lines = [
        f"tensor-exchange bench ({'quick' if d['config']['quick'] else 'full'}; "
        f"{'compiled core' if d['native'] else 'pure Python (ctypes)'})",
        f"machine: {m['cpu_model']}, {m['cpu_count']} CPUs; Python {m['python']}, NumPy {m['numpy']}"
        + (f", PyTorch {m['torch']}" if "torch" in m else ""),
        "",
        f"{'hop (1 KiB float32 on ' + d.get('device', 'cpu') + ', result dropped)':44} {'median':>10} {'peer':>10} "
        f"{'ratio':>7}  target",
    ]

    def row(label: str, ours: float, peer: float, target: float | None) -> None:
        ratio = ours / peer
        mark = "" if target is None else (f"<= {target:g}  " + ("ok" if ratio <= target else "MISSED"))
        lines.append(f"{label[:44]:44} {_fmt_ns(ours):>10} {_fmt_ns(peer):>10} {ratio:7.2f}  {mark}")

    ex, im = d["export_hop"], d["import_hop"]
    peer = ex.get("peer", "np.from_dlpack(ndarray)").split(".", 1)[0]
    obj = "cupy" if d.get("device") == "cuda" else "ndarray"
    row(f"export  {peer}.from_dlpack(tx) vs ({obj})", ex["tx_ns"], ex["numpy_ns"], TARGETS["export_hop_ratio"])
    if "torch_ns" in ex:
        row("export  torch.from_dlpack(tx) vs (cupy)", ex["torch_ns"], ex["numpy_ns"], None)
    row(f"import  tx.from_dlpack vs {peer}.from_dlpack", im["tx_ns"], im["numpy_ns"], TARGETS["import_hop_ratio"])
    if "torch_ns" in im:
        row("import  tx.from_dlpack vs torch.from_dlpack", im["tx_ns"], im["torch_ns"], None)
    ch = d["chain"]
    row(f"chain   {ch.get('method', 'hop')}: through tx vs glued by hand", ch["tx_ns"], ch["glued_ns"],
        TARGETS["chain_hop_ratio"])
    lines.append(f"        ours: {ch['ours']}; peer: {ch.get('peer', '')}")
    lines.append(f"(loop overhead per call {d['loop_overhead_ns']:.0f} ns, included in every median)")
    lines += ["", f"{'size':>10} {'import':>10} {'export':>10} {'numpy':>10} {'imp/1KiB':>9} {'exp/1KiB':>9}"]
    for r in d["sizes"]["rows"]:
        lines.append(f"{_fmt_bytes(r['bytes']):>10} {r['import_ns'] / 1e3:8.3f}us {r['export_ns'] / 1e3:8.3f}us "
                     f"{r['numpy_ns'] / 1e3:8.3f}us {r['import_vs_1k']:9.2f} {r['export_vs_1k']:9.2f}")
    lines.append(f"size_flatness {result['size_flatness']:.2f}  (target <= {TARGETS['size_flatness']:g})")
    th = d["threads"]
    lines += ["", f"{'threads':>7} {'exchanges/s':>12} {'vs 1':>6} {'numpy peer/s':>13}"]
    for k, v in th["exchanges_per_s"].items():
        lines.append(f"{k:>7} {v:12,.0f} {th['speedup_vs_1'][k]:6.2f} {th['peer_exchanges_per_s'][k]:13,.0f}")
    if th["errors"]:
        lines.append(f"thread errors: {th['errors'][:3]}")
    if not th["registry_balanced"]:
        lines.append("registry NOT balanced after the thread runs")
    lines += ["", "stream-ordered release (last holder dropped -> producer's deleter ran)"]
    for name, r in d["release"].items():
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
                lines.append(f"  {'  after a ' + format(after['busy_ms'], 'g') + ' ms kernel':24} median "
                             f"{after['after_kernel_median_us']:9.1f} us after the kernel ended, "
                             f"{'ordered' if after['ordered'] else 'NOT ORDERED'}")
        else:
            lines.append(f"  {name:24} no sample completed ({r['timeouts']} timeouts)")
    for name, section in d.get("sections", {}).items():
        lines += ["", *_section(name).format(section)]
    miss = d["missed_targets"]
    lines += ["", "targets: " + ("all met" if not miss else "missed: " + "; ".join(miss)),
              f"({d['elapsed_s']:.1f} s)"]
    return "\n".join(lines)


# -- command line ------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` options. Every default the help names is read from the parser or
    from :class:`Config` (what the run uses), never written out twice."""
    from .arguments import byte_size, positive, size_text

    full, quick = Config(False), Config(True)
    parser.add_argument("--quick", action="store_true",
                        help=f"shorter run (about 30 s on 2 cores with every section), sizes up to "
                             f"{size_text(quick.max_size)}")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object on stdout (the table goes to stderr)")
    parser.add_argument("--max-size", type=byte_size, default=None, metavar="SIZE",
                        help=f"largest array of the size sweep, 1K..1G (default {size_text(full.max_size)}, "
                             f"--quick {size_text(quick.max_size)})")
    parser.add_argument("--samples", type=positive, default=None, metavar="N",
                        help=f"timing samples per hop comparison, 1 or more (default {full.samples}, "
                             f"--quick {quick.samples})")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the hops' data lives (default %(default)s); cuda measures CuPy arrays on the GPU "
                             "against CuPy's and PyTorch's own from_dlpack, and fails with the reason where it cannot")
    parser.add_argument("--chain", choices=("hop", "chain"), default="chain",
                        help="what chain_hop_ratio measures: chain, a two-stage tx.Chain against the same stages "
                             "glued by hand; hop, one tx hop between two frameworks (default %(default)s)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--plot", metavar="DIR", default=None,
                        help="also write PNG figures of the results into DIR (made if missing): hop cost against "
                             "size, against live records and pending releases, and the process and Ray hand-offs; "
                             "needs matplotlib (the plot extra)")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark for parsed ``args``; returns the exit status (2 when ``--device
    cuda`` cannot run here, or ``--plot`` has no matplotlib: the reason on stderr, before
    anything is measured)."""
    device = getattr(args, "device", "cpu")
    plot_dir = getattr(args, "plot", None)
    if plot_dir is not None:  # before the run, not after it
        from .bench_plot import require_matplotlib

        try:
            require_matplotlib()
            _plot_dir_ready(plot_dir)
        except (ImportError, OSError) as exc:
            print(f"tensor-exchange bench: --plot: {exc}", file=sys.stderr)
            return 2
    if device == "cuda":
        reason = cuda_unusable_reason()
        if reason is not None:
            print(f"tensor-exchange bench: --device cuda cannot run here: {reason}", file=sys.stderr)
            return 2
    result = measure(args.quick, samples=args.samples, max_size=args.max_size, chain=args.chain, device=device,
                     progress=lambda msg: print(f"bench: {msg} ...", file=sys.stderr, flush=True))
    table = format_table(result)
    if args.json:
        print(table, file=sys.stderr)
        print(json.dumps(result))
    else:
        print(table)
    if plot_dir is not None:
        from .bench_plot import write

        for path in write(result, plot_dir):
            print(f"bench: wrote {path}", file=sys.stderr)
    return 1 if args.check and result["details"]["missed_targets"] else 0


def _plot_dir_ready(path: str) -> None:
    """Make ``--plot``'s folder (and its parents) and check a file can be written there,
    before anything is measured; OSError naming it otherwise."""
    if not path:
        raise FileNotFoundError(2, "give a folder for the figures (it is made if missing)")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".tx-bench-", suffix=".png"):
            pass
    except OSError as exc:
        raise type(exc)(exc.errno, f"cannot write figures into {path!r}: {exc.strerror}; "
                                   "give a folder you can write (it is made if missing)") from None


def main(argv: Sequence[str] | argparse.Namespace | None = None) -> int:
    """``python -m exchange.cli.bench [options]``; also the CLI's entry (which passes the
    parsed Namespace)."""
    if isinstance(argv, argparse.Namespace):
        return run(argv)
    parser = argparse.ArgumentParser(prog="tensor-exchange bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
