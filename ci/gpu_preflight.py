"""Preflight of the GPU check (ci/gpu-check.sh): prints the versions, then checks in a
few seconds what the GPU suite needs.

    python ci/gpu_preflight.py [--json PATH]

Fatal checks (FATAL): pytest imports; an NVIDIA driver is installed; cuda.core's
Device(0) is usable (set_current). Without a driver the remaining checks are not tried
(each would only say the same after seconds of its own start-up). Peer checks (PEERS):
a CuPy kernel runs, ``torch.cuda.is_available()``, ``jax.devices("gpu")`` is not empty;
a peer that fails only skips its own tests (tests/gpu/conftest.py skips them with
``peer unusable: <peer>: ...``, which ci/check_gpu_results.py accepts for the peers
failed here), and the table says so. The demo's packages (scikit-learn, onnx,
onnxruntime) are reported the same way.

``--json PATH`` writes, after every check (so a preflight stopped half way still says
how far it got): ``{"versions": str, "checks": {name: {"ok": bool, "detail": str,
"seconds": float}}, "running": name or null, "fatal": [names failed]}``.

Exits 1 when a fatal check failed (the reason printed), 0 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

#: (import name, distributions that provide it): versions come from the installed
#: metadata, so printing them imports nothing (torch or JAX would take seconds).
PACKAGES = (("numpy", ("numpy",)), ("pytest", ("pytest",)), ("cuda.core", ("cuda-core",)),
            ("cuda.bindings", ("cuda-bindings",)), ("cupy", ("cupy-cuda13x", "cupy-cuda12x", "cupy")),
            ("torch", ("torch",)), ("jax", ("jax",)), ("jaxlib", ("jaxlib",)),
            ("jax_plugins", ("jax-cuda13-plugin", "jax-cuda12-plugin")), ("ml_dtypes", ("ml_dtypes", "ml-dtypes")),
            ("onnxruntime", ("onnxruntime-gpu", "onnxruntime")), ("sklearn", ("scikit-learn",)), ("onnx", ("onnx",)),
            ("tvm_ffi", ("apache-tvm-ffi",)), ("pytest_timeout", ("pytest-timeout",)),
            ("xdist", ("pytest-xdist",)), ("nvtx", ("nvtx",)),
            ("nvidia.nvtx", ("nvidia-nvtx", "nvidia-nvtx-cu13", "nvidia-nvtx-cu12")))


def _line(cmd: list[str], first: bool = False, timeout: float = 15) -> str:
    """The last (or first) line a command prints (stdout, else stderr)."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"failed ({exc})"
    lines = (out.stdout.strip() or out.stderr.strip()).splitlines()
    return (lines[0] if first else lines[-1]) if lines else ""


def versions() -> str:
    """One line: Python, every package of PACKAGES, the GPU and driver, the tools."""
    from importlib import metadata
    from importlib.util import find_spec

    found = [f"python {platform.python_version()}"]
    for name, dists in PACKAGES:
        version = None
        for dist in dists:  # installed metadata first: nvidia-nvtx, say, may hold no importable module
            try:
                version = f"{metadata.version(dist)}" + ("" if dist.replace("-", "_") == name else f" ({dist})")
                break
            except metadata.PackageNotFoundError:
                continue
        if version is None:
            try:
                spec = find_spec(name)
            except (ImportError, ValueError):
                spec = None
            version = "?" if spec is not None else "-"
        found.append(f"{name} {version}")
    if shutil.which("nvidia-smi"):
        found.append("gpu " + _line(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                    "--format=csv,noheader"]))
    else:
        found.append("nvidia-smi -")
    for tool, first in (("nvcc", False), ("compute-sanitizer", False), ("gcc", True)):
        path = shutil.which(tool)
        found.append(f"{tool} " + (_line([path, "--version"], first).strip() if path else "-"))
    return "; ".join(found)


def _driver() -> str:
    import ctypes.util

    from exchange.devices.cuda import driver_cuda_major

    major = driver_cuda_major()
    if major is None and ctypes.util.find_library("cuda") is None:
        raise RuntimeError("no usable GPU: no NVIDIA driver on this machine (no /proc/driver/nvidia/version, no libcuda)")
    return f"NVIDIA driver for CUDA {major if major is not None else '(version unknown)'}"


def _pytest() -> str:
    import pytest

    return f"pytest {pytest.__version__}"


def _cuda_core() -> str:
    try:
        import cuda.core as cc
    except ImportError as exc:
        raise RuntimeError(f"cuda.core cannot be imported: {exc}") from exc
    if not hasattr(cc, "Device"):  # cuda.core < 0.5 kept it here
        cc = importlib.import_module("cuda.core.experimental")
    try:
        device = cc.Device(0)
        device.set_current()
    except Exception as exc:  # no driver, or no device: the reason the whole check stops
        raise RuntimeError(f"no usable GPU: cuda.core Device(0) failed: {type(exc).__name__}: {exc}") from exc
    return f"cuda.core Device(0): {device.name}, compute {device.compute_capability.major}.{device.compute_capability.minor}"


def _cupy() -> str:
    import cupy

    value = int((cupy.arange(10) * 2).sum())  # an elementwise and a reduction kernel, compiled and run
    if value != 90:
        raise RuntimeError(f"a CuPy kernel computed {value}, not 90")
    return f"CuPy kernel ran on device {cupy.cuda.Device().id}"


def _torch() -> str:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"torch {torch.__version__}: torch.cuda.is_available() is False (CPU build, or no driver)")
    return f"torch.cuda: {torch.cuda.get_device_name(0)}"


def _jax() -> str:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    devices = jax.devices("gpu")
    if not devices:
        raise RuntimeError("jax.devices('gpu') is empty")
    return f"jax GPU: {devices[0]}"


def _demo() -> str:
    from importlib.util import find_spec

    missing = [m for m in ("sklearn", "onnx", "onnxruntime") if find_spec(m) is None]
    if missing:
        raise RuntimeError(f"the demo needs {' '.join(missing)}, not installed here")
    return "scikit-learn, onnx and onnxruntime are installed"


FATAL: list[tuple[str, Callable[[], str]]] = [("pytest", _pytest), ("driver", _driver), ("cuda.core", _cuda_core)]
PEERS: list[tuple[str, Callable[[], str]]] = [("cupy", _cupy), ("torch", _torch), ("jax", _jax), ("demo", _demo)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="write the results here after every check")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    state: dict = {"versions": versions(), "checks": {}, "running": None, "fatal": []}
    print(f"versions: {state['versions']}", flush=True)

    def save() -> None:
        if args.json is not None:
            args.json.write_text(json.dumps(state))

    stop = False
    for name, check in FATAL + PEERS:
        if stop:
            break
        state["running"] = name
        save()
        t0 = time.perf_counter()
        try:
            detail, ok = check(), True
            print(f"preflight {name}: ok: {detail} ({time.perf_counter() - t0:.1f} s)", flush=True)
        except Exception as exc:  # every failure is reported, with its reason
            detail, ok = f"{type(exc).__name__}: {exc}", False
            fatal = (name, check) in FATAL
            print(f"preflight {name}: {'FAILED' if fatal else 'unusable (its tests skip)'}: {detail}", flush=True)
            if fatal:
                state["fatal"].append(name)
                if "no usable GPU" in str(exc):
                    print("preflight: no usable GPU here, so the remaining checks are not tried", flush=True)
                    stop = True
        state["checks"][name] = {"ok": ok, "detail": detail, "seconds": round(time.perf_counter() - t0, 2)}
    state["running"] = None
    save()
    print(f"preflight: {time.perf_counter() - started:.1f} s")
    if state["fatal"]:
        print(f"GPU CHECK FAILED in preflight: {', '.join(state['fatal'])}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
