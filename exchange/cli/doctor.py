"""``tensor-exchange doctor``: what this machine offers for exchange.

Prints the devices found (CPU always; CUDA when its backend loads, else why not), the
frameworks found with their versions, how each speaks DLPack (as a producer: which
keywords its ``__dlpack__`` accepts and whether it gives versioned capsules; as a
consumer: which ``max_version`` and ``stream`` it passes to ours), and runs a quick
self-check (NumPy -> tx -> NumPy shares memory, the registry empties). ``--json`` prints
one JSON object instead.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import sys
from typing import Any

FRAMEWORKS = ["numpy", "torch", "jax", "cupy", "tvm_ffi", "onnxruntime"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _devices() -> list[dict[str, Any]]:
    from devices.base import get_backend

    from ..device import DeviceType
    from ..errors import BackendUnavailableError

    found: list[dict[str, Any]] = [{"device": "cpu", "available": True}]
    try:
        backend = get_backend(DeviceType.kDLCUDA)
    except BackendUnavailableError as exc:
        found.append({"device": "cuda", "available": False, "reason": str(exc)})
        return found
    count = getattr(backend, "device_count", lambda: 1)()
    for i in range(count):
        entry: dict[str, Any] = {"device": f"cuda:{i}", "available": True}
        describe = getattr(backend, "describe", None)
        if describe is not None:
            entry["name"] = describe(i)
        found.append(entry)
    return found


def _sample(name: str, module: Any) -> Any:
    import numpy as np

    base = np.arange(4, dtype=np.float32)
    if name == "numpy":
        return base
    if name == "torch":
        return module.arange(4, dtype=module.float32)
    if name == "jax":
        return module.numpy.arange(4, dtype="float32")
    if name == "tvm_ffi":
        return module.from_dlpack(base)
    if name == "onnxruntime":
        return module.OrtValue.ortvalue_from_numpy(base)
    return None  # cupy needs a GPU


def _producer(x: Any) -> dict[str, Any]:
    """Which keywords ``x.__dlpack__`` accepts, tried one at a time on the CPU."""
    out: dict[str, Any] = {}
    trials = {"max_version": {"max_version": (1, 3)}, "stream": {"stream": None},
              "dl_device": {"dl_device": (1, 0)}, "copy": {"copy": False}}
    for key, kwargs in trials.items():
        try:
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
    export."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        self.asked: dict[str, Any] = {}

    def __dlpack_device__(self) -> Any:
        return self.tensor.__dlpack_device__()

    def __dlpack__(self, **kwargs: Any) -> Any:
        self.asked = {k: v for k, v in kwargs.items()}
        return self.tensor.__dlpack__(**kwargs)


def _consumer(name: str, module: Any) -> dict[str, Any]:
    import numpy as np

    from ..tensor import from_dlpack

    spy = _Spy(from_dlpack(np.arange(4, dtype=np.float32)))
    take = {
        "numpy": lambda s: module.from_dlpack(s),
        "torch": lambda s: module.from_dlpack(s),
        "jax": lambda s: importlib.import_module("jax.dlpack").from_dlpack(s),
        "tvm_ffi": lambda s: module.from_dlpack(s),
        "onnxruntime": lambda s: module.OrtValue.from_dlpack(s),
    }.get(name)
    if take is None:
        return {}
    try:
        result = take(spy)
        del result
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    asked = {k: (list(v) if isinstance(v, tuple) else v) for k, v in spy.asked.items()}
    return {"passes": asked}


def _frameworks() -> list[dict[str, Any]]:
    rows = []
    for name in FRAMEWORKS:
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            rows.append({"framework": name, "installed": False, "reason": f"{type(exc).__name__}: {exc}"})
            continue
        row: dict[str, Any] = {"framework": name, "installed": True,
                               "version": str(getattr(module, "__version__", "unknown"))}
        try:
            sample = _sample(name, module)
            if sample is not None:
                row["producer"] = _producer(sample)
            row["consumer"] = _consumer(name, module)
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
    from ..capsule import NATIVE

    return {"shared": shared, "values_equal": equal, "registry_empty": stats["live_records"] == 0
, "native_helper": NATIVE,
            "ok": shared and equal}


def report() -> dict[str, Any]:
    import exchange

    return {"tensor_exchange": exchange.__version__, "python": sys.version.split()[0],
            "devices": _devices(), "frameworks": _frameworks(), "self_check": _self_check()}


def main(args: argparse.Namespace) -> int:
    data = report()
    if args.json:
        print(json.dumps(data, indent=2, default=str))
        return 0 if data["self_check"]["ok"] else 1
    print(f"tensor-exchange {data['tensor_exchange']} on Python {data['python']}")
    print("devices:")
    for d in data["devices"]:
        state = "available" if d["available"] else f"unavailable: {d.get('reason')}"
        print(f"  {d['device']:<8} {state}{' (' + d['name'] + ')' if d.get('name') else ''}")
    print("frameworks:")
    for f in data["frameworks"]:
        if not f["installed"]:
            print(f"  {f['framework']:<12} not installed")
            continue
        prod = f.get("producer", {})
        keys = [k for k in ("max_version", "stream", "dl_device", "copy") if prod.get(k)]
        kind = "versioned" if prod.get("versioned") else ("legacy" if prod else "-")
        passes = f.get("consumer", {}).get("passes")
        print(f"  {f['framework']:<12} {f['version']:<14} exports {kind:<9} takes {', '.join(keys) or '-':<34}"
              f" asks {passes if passes is not None else f.get('consumer', {}).get('error', '-')}")
    check = data["self_check"]
    print(f"self-check: {'ok' if check['ok'] else 'FAILED'} (shared={check['shared']}, values={check['values_equal']}, "
          f"compiled helper={'yes' if check['native_helper'] else 'no, pure-Python path'})")
    return 0 if check["ok"] else 1
