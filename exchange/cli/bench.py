"""``tensor-exchange bench``: what a DLPack hop through this library costs, next to the
peers' own hops, measured in one run.

Sections, one module each (``exchange/cli/bench_<name>.py``, listed in
``CORE_SECTIONS`` and ``SECTIONS``), each a median over many timing samples, after a
warm-up. The core ones:

* ``hops``: the export hop ``np.from_dlpack(t)`` for a tx Tensor ``t`` against
  ``np.from_dlpack(a)`` for the NumPy array ``a`` it wraps; the import hop
  ``tx.from_dlpack(a)`` against ``np.from_dlpack(a)`` (and ``torch.from_dlpack(a)``
  where PyTorch is installed);
* ``sizes``: a size sweep, 1 KiB to 1 GiB (``--quick``: to 64 MiB), one array held at a
  time: a zero-copy hop costs the same at every size;
* ``threads``: 1, 2, 4, 8 threads doing exchanges (NumPy -> tx -> NumPy) at once:
  exchanges per second;
* ``chain``: one chain hop: a two-stage ``tx.Chain`` against the same stages glued by
  hand (``--chain hop``: NumPy -> tx -> PyTorch against ``torch.from_dlpack`` of the
  NumPy array instead);
* ``release_latency``: stream-ordered release, the time from the last holder going to
  the producer's deleter having run, on host streams, and on CUDA where a device and its
  backend are present;

then release at scale, sharing across processes, Ray, the compiled core, CUDA's host
side (``--device cuda``), ``import exchange``, tracing, what serving ``tensor-exchange
top`` costs the watched process, the pipelined chain's hand-off, and tensor sets
(``tx.publish`` to reader processes: exchange/cli/bench_publish.py).

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
     "chain_hop_ratio": float, <the further sections' keys>, "details": {...}}

Ratios are ours over the peer's median; ``size_flatness`` is the worse of the import and
export hops' median at the largest size over the same hop at the smallest (1 KiB),
sampled in the same rounds; ``thread_scaling`` holds exchanges per second.
The command never fails on a slow result; ``--check`` makes it exit 1 when a target
(the sections' ``TARGETS``, upper bounds, and ``FLOORS``, lower bounds) is missed.
``--plot DIR`` also writes PNG figures of the result (exchange/cli/bench_plot.py; needs
matplotlib).
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
import time
from typing import Any, Callable, Iterator, Sequence

__all__ = ["KEYS", "TARGETS", "CORE_SECTIONS", "SECTIONS", "add_arguments", "run", "main", "measure"]

#: The sections, each a module of its own (``exchange.cli.bench_<name>``), run in this
#: order, the core ones first. A section module provides ``KEYS`` (the top-level
#: ``--json`` keys it adds), ``TARGETS`` (key -> upper bound), optionally ``FLOORS``
#: (key -> lower bound: a rate that must reach it), ``measure(cfg, peers) ->
#: {"keys": {key: value}, "details": {...}}`` and ``format(section) -> list[str]`` (its
#: table lines; ``section`` is what ``measure`` returned).
#:
#: The core sections' details sit in ``details`` itself, under the names their module's
#: ``DETAILS`` lists (the JSON's shape from before sections had modules); the further
#: sections' in ``details["sections"][name]``.
CORE_SECTIONS: tuple[str, ...] = ("hops", "sizes", "threads", "chain", "release_latency")
SECTIONS: tuple[str, ...] = ("release", "share", "ray", "core", "cuda", "import", "trace", "top", "pipeline",
                             "publish")

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
_ns = time.perf_counter_ns


class Config:
    """How long each section measures; ``--quick`` takes about 30 s on a 2-core VM (every section)."""

    def __init__(self, quick: bool, samples: int | None = None, max_size: int | None = None,
                 device: str = "cpu", chain: str = "chain") -> None:
        self.quick = quick
        self.device = device                                       # "cpu" or "cuda": where the hops' data lives
        self.samples = samples or (21 if quick else 101)          # hop comparisons
        self.chain_samples = max(21, self.samples // 3)            # chain rounds (paired ratios: bench_chain.py)
        self.size_samples = max(5, self.samples // 2) if quick else max(9, self.samples // 3)
        self.sample_ns = 2_000_000 if quick else 5_000_000         # one timing sample lasts about this
        self.max_size = max_size or (64 * MiB if quick else GiB)
        self.size_step = 16 if quick else 4                        # 1 KiB * step**k
        self.thread_seconds = 0.25 if quick else 1.0
        self.release_samples = 30 if quick else 200
        self.busy_samples = 8 if quick else 40
        self.chain = chain                                         # --chain: "chain" or "hop"

    def as_dict(self) -> dict[str, Any]:
        """The settings as ``details["config"]`` gives them (``chain`` is given as
        ``details["chain"]["method"]``)."""
        return {k: v for k, v in vars(self).items() if k != "chain"}


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


# -- what the sections share ------------------------------------------------------------
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


def array(peers: dict[str, Any], cfg: Config, n: int, fill: float | None = None) -> Any:
    """A float32 array of ``n`` elements where ``cfg.device`` says: NumPy, or CuPy on
    CUDA (written and synchronised, so its pages exist and no work is pending)."""
    if cfg.device == "cuda":
        cp = peers["cupy"]
        a = cp.arange(n, dtype=cp.float32) if fill is None else cp.full(n, fill, dtype=cp.float32)
        cp.cuda.Stream.null.synchronize()
        return a
    import numpy as np

    return np.arange(n, dtype=np.float32) if fill is None else np.full(n, fill, dtype=np.float32)


def consumer(peers: dict[str, Any], cfg: Config) -> tuple[str, Callable[[Any], Any]]:
    """The framework whose ``from_dlpack`` takes our exports: NumPy, or CuPy on CUDA."""
    if cfg.device == "cuda":
        return "cupy", peers["cupy"].from_dlpack
    import numpy as np

    return "np", np.from_dlpack


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


def _all_sections() -> tuple[str, ...]:
    return CORE_SECTIONS + SECTIONS


def all_keys() -> tuple[str, ...]:
    """Every top-level key of the ``--json`` object: each section's, then ``details``."""
    return tuple(k for name in _all_sections() for k in _section(name).KEYS) + ("details",)


def all_targets() -> dict[str, float]:
    """Every target (key -> upper bound), from the sections' ``TARGETS``."""
    out: dict[str, float] = {}
    for name in _all_sections():
        out.update(_section(name).TARGETS)
    return out


def all_floors() -> dict[str, float]:
    """Every lower bound (key -> the least it may be), from the sections' ``FLOORS``."""
    out: dict[str, float] = {}
    for name in _all_sections():
        out.update(getattr(_section(name), "FLOORS", {}))
    return out


def __getattr__(name: str) -> Any:
    # KEYS and TARGETS are the core sections' (read from their modules, which import
    # this one: computed on first use, not at import)
    if name == "KEYS":
        return tuple(k for section in CORE_SECTIONS for k in _section(section).KEYS) + ("details",)
    if name == "TARGETS":
        return {k: v for section in CORE_SECTIONS for k, v in _section(section).TARGETS.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def measure(quick: bool = False, *, samples: int | None = None, max_size: int | None = None,
            chain: str = "chain", progress: Callable[[str], None] | None = None,
            device: str = "cpu") -> dict[str, Any]:
    """Run every section and return the result object (see the module docstring).
    ``device="cuda"``: the hop, size, chain and release sections measure CUDA data (CuPy
    arrays; see :func:`cuda_unusable_reason`); the thread section stays on the CPU."""
    from .. import _core

    say = progress or (lambda _msg: None)
    cfg = Config(quick, samples, max_size, device=device, chain=chain)
    started = time.perf_counter()
    peers = _peers(device)
    result: dict[str, Any] = {}
    details: dict[str, Any] = {
        "native": _core.compiled(),
        "pure_python_env": os.environ.get("EXCHANGE_PURE_PYTHON", ""),
        "device": device,
        "peers": ["numpy", *peers],
        "machine": machine(),
        "config": cfg.as_dict(),
        "targets": all_targets(),
    }
    for name in CORE_SECTIONS:
        say(name)
        section = _section(name).measure(cfg, peers)
        result.update(section["keys"])
        details.update(section["details"])
    sections = {}
    for name in SECTIONS:
        say(f"section {name}")
        section = sections[name] = _section(name).measure(cfg, peers)
        result.update(section["keys"])
    details["sections"] = sections
    details["floors"] = all_floors()
    result["details"] = details  # last, as all_keys() lists it
    details["missed_targets"] = missed(result)
    details["elapsed_s"] = time.perf_counter() - started
    return result


def missed(result: dict[str, Any]) -> list[str]:
    """The targets this result misses, as readable lines."""
    def number(k: str) -> bool:
        return isinstance(result.get(k), (int, float))

    return ([f"{k} = {result[k]:.2f} > {limit}" for k, limit in all_targets().items() if number(k) and result[k] > limit]
            + [f"{k} = {result[k]:.2f} < {least}" for k, least in all_floors().items() if number(k) and result[k] < least])


# -- output ------------------------------------------------------------------------------
def format_bytes(n: int) -> str:
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


def hop_row(label: str, ours: float, peer: float, target: float | None) -> str:
    """One row of the hop table: the label, ours and the peer's median, the ratio and,
    where there is one, the target and whether it was met."""
    ratio = ours / peer
    mark = "" if target is None else (f"<= {target:g}  " + ("ok" if ratio <= target else "MISSED"))
    return f"{label[:44]:44} {_fmt_ns(ours):>10} {_fmt_ns(peer):>10} {ratio:7.2f}  {mark}"


def _core_section(name: str, result: dict[str, Any]) -> dict[str, Any]:
    """A core section as its ``measure`` returned it, read back from the result."""
    module = _section(name)
    return {"keys": {k: result.get(k) for k in module.KEYS},
            "details": {k: result["details"][k] for k in module.DETAILS}}


def format_table(result: dict[str, Any]) -> str:
    d = result["details"]
    m = d["machine"]
    lines = [
        f"tensor-exchange bench ({'quick' if d['config']['quick'] else 'full'}; "
        f"{'compiled core' if d['native'] else 'pure Python (ctypes)'})",
        f"machine: {m['cpu_model']}, {m['cpu_count']} CPUs; Python {m['python']}, NumPy {m['numpy']}"
        + (f", PyTorch {m['torch']}" if "torch" in m else ""),
    ]
    for name in CORE_SECTIONS:
        lines += ["", *_section(name).format(_core_section(name, result))]
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
