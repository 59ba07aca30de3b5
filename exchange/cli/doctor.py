"""``tensor-exchange doctor``: what this machine offers for exchange.

Prints which capsule path is in use (the compiled core or the pure-Python one), why
(where this package's build could not compile the core: the reason that build recorded,
exchange/_core/choice.py), and what an import hop costs on it, measured here (on the pure path,
a note with the way to the compiled core: a printed line, never an ExchangeWarning of
doctor's own); the devices found (CPU always; CUDA when its backend loads, else why
not); the frameworks of ``exchange.frameworks.FRAMEWORKS`` with their versions and how each speaks DLPack (as a
producer: which keywords its ``__dlpack__`` accepts and whether it gives versioned
capsules; as a consumer: which ``max_version`` and ``stream`` it passes to ours); and
runs a quick self-check (NumPy -> tx -> NumPy shares memory, the registry empties).
``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import sys
import warnings
from typing import Any

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _devices() -> list[dict[str, Any]]:
    from exchange.devices.base import get_backend

    from ..device import DeviceType
    from ..errors import BackendUnavailableError

    found: list[dict[str, Any]] = [{"device": "cpu", "available": True}]
    try:
        backend = get_backend(DeviceType.kDLCUDA)
    except BackendUnavailableError as exc:
        found.append({"device": "cuda", "available": False, "reason": str(exc)})
        return found
    for i in range(int(backend.device_count)):
        entry: dict[str, Any] = {"device": f"cuda:{i}", "available": True}
        try:
            entry["name"] = backend.describe(i)
        except Exception as exc:  # a driver call failed: say so, keep going
            entry["name"] = f"(cannot describe: {type(exc).__name__}: {exc})"
        found.append(entry)
    return found


def _cuda_hint(devices: list[dict[str, Any]], frameworks: list[dict[str, Any]]) -> str | None:
    """The one install hint for CUDA support: only where an NVIDIA driver is present and
    the CUDA backend or CuPy is missing (exchange.devices.cuda.install_hint names the extra that
    matches the driver)."""
    cuda_ok = any(d["available"] for d in devices if d["device"] != "cpu")
    cupy_ok = any(f["framework"] == "cupy" and f["installed"] for f in frameworks)
    if cuda_ok and cupy_ok:
        return None
    from exchange.devices.cuda import install_hint

    return install_hint()


def _path() -> dict[str, Any]:
    """Which capsule path is in use, the compiled core or the pure-Python one; why;
    what an import hop costs here (``cost``); on the pure path, how to get the compiled
    one (``fix``). Where the build of this package could not compile the core, ``why``
    and ``fix`` are what that build recorded (exchange/_core/choice.py)."""
    import importlib.util
    import os

    from .. import _core

    cost = _import_hop()
    if _core.compiled():
        return {"native": True, "why": "the compiled core exchange._native is built and loaded", "cost": cost}
    if os.environ.get("EXCHANGE_PURE_PYTHON", "") not in ("", "0"):
        why = "EXCHANGE_PURE_PYTHON is set, which asks for the pure-Python path"
        fix = "unset EXCHANGE_PURE_PYTHON"
    elif _core.NOT_BUILT is None and importlib.util.find_spec("exchange._native") is not None:
        try:
            importlib.import_module("exchange._native")
            why = "the compiled core imports now but did not when exchange was first imported"
            fix = "restart the process"
        except ImportError:
            why, fix = _core.WHY_PURE, _core.FIX_PURE
    else:
        why, fix = _core.WHY_PURE, _core.FIX_PURE
    return {"native": False, "why": why, "cost": cost, "fix": fix}


#: The compiled core's import hop over NumPy's, as measured for docs/performance.md.
COMPILED_IMPORT_HOP_RATIO = 1.4


def _import_hop(rounds: int = 7, calls: int = 200) -> dict[str, float]:
    """The import hop on this machine, on the path in use: ``tx.from_dlpack`` of a 1 KiB
    float32 NumPy array against ``np.from_dlpack`` of it, result dropped. Per call in
    microseconds, the best of interleaved rounds (the least disturbed by other work on
    the machine); ``ratio`` is ours over NumPy's.
    About 50 ms on the pure path."""
    import time

    import numpy as np

    from ..tensor import from_dlpack

    a = np.arange(256, dtype=np.float32)

    def per_call(take: Any) -> float:
        start = time.perf_counter_ns()
        for _ in range(calls):
            take(a)
        return (time.perf_counter_ns() - start) / calls / 1e3

    per_call(from_dlpack), per_call(np.from_dlpack)  # warm up
    ours, numpy_ = zip(*[(per_call(from_dlpack), per_call(np.from_dlpack)) for _ in range(rounds)])
    tx_us, np_us = min(ours), min(numpy_)
    return {"tx_us": round(tx_us, 3), "numpy_us": round(np_us, 3), "ratio": round(tx_us / np_us, 1)}


def _path_lines(path: dict[str, Any]) -> list[str]:
    """The path, why and what it costs, as doctor prints them (a note, not a warning)."""
    cost = path["cost"]
    hop = (f"an import hop (tx.from_dlpack of a 1 KiB NumPy array) takes {cost['tx_us']:.2f} us here, "
           f"{cost['ratio']:g}x np.from_dlpack ({cost['numpy_us']:.2f} us)")
    if path["native"]:
        return [f"path: compiled core: {path['why']}; {hop}"]
    return [f"path: pure Python (ctypes): {path['why']}",
            f"  note: {hop}; with the compiled core it is about {COMPILED_IMPORT_HOP_RATIO:g}x (exports cost "
            "alike). Results are the same on both paths.",
            f"  for the compiled core: {path['fix']}"]


def _sample(adapter: Any, device: str = "cpu") -> Any:
    """An array of the framework's own over four float32 on ``device``, made through its
    adapter (so a framework added to ``FRAMEWORKS`` is probed with no edit here); None
    where the framework cannot hold memory of that device (CuPy on the CPU)."""
    import numpy as np

    import exchange as tx

    t = tx.from_dlpack(np.arange(4, dtype=np.float32)) if device == "cpu" else tx.empty((4,), "float32",
                                                                                       device=device)
    try:
        return adapter.to_framework(t, None)
    except Exception:  # not this framework's memory: it has no sample here
        return None


def _producer(x: Any) -> dict[str, Any]:
    """Which keywords ``x.__dlpack__`` accepts, tried one at a time on the CPU."""
    out: dict[str, Any] = {}
    trials = {"max_version": {"max_version": (1, 3)}, "stream": {"stream": None},
              "dl_device": {"dl_device": (1, 0)}, "copy": {"copy": False}}
    for key, kwargs in trials.items():
        try:
            with warnings.catch_warnings():
                # asked without max_version on purpose: a framework that warns that legacy
                # capsules are deprecated (PyTorch) answers all the same
                warnings.simplefilter("ignore", DeprecationWarning)
                cap = x.__dlpack__(**kwargs)
        except TypeError:
            out[key] = False
            continue
        except Exception as exc:  # accepted the keyword, refused the value
            out[key] = f"accepted ({type(exc).__name__})"
            continue
        out[key] = True
        if key == "max_version":
            out["versioned"] = "versioned" in repr(cap)
        del cap
    return out


class _Spy:
    """A DLPack producer that records what a consumer asks for, then hands out a tx
    export. The attributes adapters read before importing (``readonly``, ``strides``,
    ``shape``, ``dtype``, ``device``, ``ndim``, ``size``, ``nbytes``, ``is_contiguous``,
    ``mutability``, ``data_ptr``) are the tensor's; no other, so that a framework
    finds no faster protocol than ``__dlpack__`` on it (tvm-ffi's C exchange API)."""

    _FORWARDED = frozenset({"readonly", "strides", "shape", "dtype", "device", "ndim", "size", "nbytes",
                            "is_contiguous", "mutability", "data_ptr"})

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        self.asked: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        if name in _Spy._FORWARDED:
            return getattr(self.tensor, name)
        raise AttributeError(name)

    def __dlpack_device__(self) -> Any:
        return self.tensor.__dlpack_device__()

    def __dlpack__(self, **kwargs: Any) -> Any:
        self.asked = dict(kwargs)
        return self.tensor.__dlpack__(**kwargs)


def _consumer(adapter: Any, tensor: Any) -> dict[str, Any]:
    """What the framework's DLPack import (its adapter's ``to_framework``) passes to a
    producer of ``tensor``: ``{"passes": {keyword: value}}``, or ``{"error": ...}`` where
    it asked and then failed; empty where it refused before asking (not its memory)."""
    spy = _Spy(tensor)
    try:
        result = adapter.to_framework(spy, None)
        del result
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"} if spy.asked else {}
    return {"passes": {k: (list(v) if isinstance(v, tuple) else v) for k, v in spy.asked.items()}}


def _cuda_probe(adapter: Any, row: dict[str, Any]) -> None:
    """On a GPU: what the framework's import passes for CUDA memory (the stream, above
    all), and its producer side where it had none on the CPU (CuPy). Adds nothing where
    the framework takes no CUDA memory."""
    import exchange as tx

    if "producer" not in row:
        sample = _sample(adapter, "cuda:0")
        if sample is not None:
            row["producer"] = _producer(sample)
    consumer = _consumer(adapter, tx.empty((4,), "float32", device="cuda:0"))
    if consumer:
        row["consumer_cuda"] = consumer


def _frameworks(cuda: bool = False) -> list[dict[str, Any]]:
    """One row per framework of ``exchange.frameworks.FRAMEWORKS``: installed or why not,
    its version, how it speaks DLPack as a producer and as a consumer."""
    import numpy as np

    from ..errors import BackendUnavailableError
    from ..frameworks import FRAMEWORKS, get_adapter
    from ..tensor import from_dlpack

    rows = []
    for name in FRAMEWORKS:
        try:
            adapter = get_adapter(name)
            module = importlib.import_module(adapter.module)
        except (BackendUnavailableError, ImportError) as exc:
            rows.append({"framework": name, "installed": False, "reason": f"{type(exc).__name__}: {exc}"})
            continue
        row: dict[str, Any] = {"framework": name, "installed": True,
                               "version": str(getattr(module, "__version__", "unknown"))}
        try:
            sample = _sample(adapter)
            if sample is not None:
                row["producer"] = _producer(sample)
            row["consumer"] = _consumer(adapter, from_dlpack(np.arange(4, dtype=np.float32)))
            if cuda:
                _cuda_probe(adapter, row)
        except Exception as exc:
            row["probe_error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    return rows


def _self_check() -> dict[str, Any]:
    import numpy as np

    import exchange as tx

    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = tx.from_dlpack(a)
    b = np.from_dlpack(t)
    shared = b.ctypes.data == a.ctypes.data and t.data_ptr == a.ctypes.data
    equal = bool((b == a).all())
    del t, b
    gc.collect()
    tx.registry().collect(timeout=5)
    stats = tx.registry().stats()
    from .. import _core

    return {"shared": shared, "values_equal": equal, "registry_empty": stats["live_records"] == 0,
            "compiled_core": _core.compiled(), "ok": shared and equal}


def report() -> dict[str, Any]:
    import exchange

    devices = _devices()
    frameworks = _frameworks(cuda=any(d["available"] for d in devices if d["device"] != "cpu"))
    return {"tensor_exchange": exchange.__version__, "python": sys.version.split()[0],
            "devices": devices, "cuda_install_hint": _cuda_hint(devices, frameworks), "path": _path(),
            "frameworks": frameworks, "self_check": _self_check()}


def _asks(f: dict[str, Any], key: str = "consumer") -> str:
    consumer = f.get(key, {})
    if "error" in consumer:
        return consumer["error"]
    passes = consumer.get("passes")
    if passes is None:
        return "-"
    return ", ".join(f"{k}={tuple(v) if isinstance(v, list) else v}" for k, v in passes.items()) or "no keywords"


def main(args: argparse.Namespace) -> int:
    """Print the report (``--json``: one JSON object); exit status 0 when the self-check
    holds, 1 otherwise, also when the reader of stdout has left early (``| head``)."""
    from . import write_report

    data = report()
    if args.json:
        write_report(lambda: print(json.dumps(data, indent=2, default=str)))
    else:
        write_report(lambda: _print_text(data))
    return 0 if data["self_check"]["ok"] else 1


def _print_text(data: dict[str, Any]) -> None:
    print(f"tensor-exchange {data['tensor_exchange']} on Python {data['python']}")
    for line in _path_lines(data["path"]):
        print(line)
    print("devices:")
    for d in data["devices"]:
        state = "available" if d["available"] else f"unavailable: {d.get('reason')}"
        print(f"  {d['device']:<8} {state}{' (' + d['name'] + ')' if d.get('name') else ''}")
    if data["cuda_install_hint"]:
        print(f"  hint: {data['cuda_install_hint']}")
    print("frameworks (exports: the capsules its __dlpack__ gives; takes: the __dlpack__ keywords it accepts; "
          "asks: what its from_dlpack passes to a producer):")
    print(f"  {'framework':<12} {'version':<14} {'exports':<9} {'takes':<37} asks")
    for f in data["frameworks"]:
        if not f["installed"]:
            print(f"  {f['framework']:<12} {'-':<14} not installed")
            continue
        prod = f.get("producer", {})
        keys = [k for k in ("max_version", "stream", "dl_device", "copy") if prod.get(k)]
        kind = "versioned" if prod.get("versioned") else ("legacy" if prod else "-")
        print(f"  {f['framework']:<12} {f['version']:<14} {kind:<9} {', '.join(keys) or '-':<37} {_asks(f)}")
        if "consumer_cuda" in f:
            print(f"  {'':<12} {'':<14} {'':<9} {'(CUDA memory)':<37} {_asks(f, 'consumer_cuda')}")
    check = data["self_check"]
    print(f"self-check: {'ok' if check['ok'] else 'FAILED'} (shared={check['shared']}, values={check['values_equal']}, "
          f"registry empty={check['registry_empty']})")
