"""Framework adapters for ``tx.Chain``: one module per framework (numpy, torch, cupy, jax,
tvm_ffi, onnxruntime). An adapter turns tx Tensors into the framework's arrays
(zero-copy, through DLPack), runs a stage with the stage's stream current in the
framework, and takes the outputs back with ``tx.from_dlpack``.

Adapters load lazily; asking for a framework that is not installed raises
``tx.BackendUnavailableError`` naming the package to install.
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import Adapter

__all__ = ["Adapter", "get_adapter", "FRAMEWORKS", "IGNORES_READ_ONLY", "mutability"]

#: Framework name -> (adapter module, pip package that provides it).
FRAMEWORKS = {
    "numpy": "numpy",
    "torch": "torch",
    "cupy": "cupy",
    "jax": "jax",
    "tvm_ffi": "tvm_ffi",
    "onnxruntime": "onnxruntime",
}

#: Frameworks that take DLPack's READ_ONLY flag for nothing: their arrays over read-only
#: memory are writable (PyTorch: ``torch.from_dlpack`` of a read-only capsule gives a
#: writable tensor; CuPy arrays have no read-only mode). ``tx.Chain`` gives them a copy of
#: memory whose mutability is ``"readonly"``. (NumPy honours the flag; JAX arrays are
#: immutable; ONNX Runtime sessions and tvm-ffi kernels here only read their inputs.)
IGNORES_READ_ONLY = frozenset({"torch", "cupy"})

#: Producers (type-name prefixes) whose read-only exports are truly read-only: NumPy says
#: READ_ONLY in a versioned capsule only for a read-only array; JAX arrays are immutable.
_READ_ONLY_PRODUCERS = ("numpy.", "jax", "jaxlib.")

_cache: dict[str, Adapter] = {}


def mutability(t: "Any") -> str:
    """``"writable"``, ``"readonly"`` (truly read-only memory: a versioned capsule with
    READ_ONLY from NumPy, a JAX array, Ray's object store, ``tx.borrow(readonly=True)``)
    or ``"unknown"`` (read-only as far as this library knows, from a producer that may
    allow writes: a legacy capsule, e.g. ONNX Runtime's outputs).

    Stand-in for ``tx.Tensor.mutability``: uses that property where the Tensor has it."""
    if hasattr(type(t), "mutability"):
        return t.mutability
    if not t.readonly:
        return "writable"
    record = t.record
    said = record.__dict__.get("mutability")
    if said is not None:
        return said
    if record.kind == "borrowed" or record._origin.startswith(_READ_ONLY_PRODUCERS):
        return "readonly"
    return "unknown"


def get_adapter(name: str) -> Adapter:
    """The adapter for framework ``name``; ValueError for an unknown name,
    BackendUnavailableError when the framework's package is not installed."""
    adapter = _cache.get(name)
    if adapter is not None:
        return adapter
    if name not in FRAMEWORKS:
        raise ValueError(f"unknown framework {name!r}; use one of: {', '.join(FRAMEWORKS)}")
    module = importlib.import_module(f"{__name__}.{FRAMEWORKS[name]}_adapter")
    adapter = module.ADAPTER
    adapter.load()
    _cache[name] = adapter
    return adapter
