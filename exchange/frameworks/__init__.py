"""Framework adapters for ``tx.Chain``: one module per framework (numpy, torch, cupy, jax,
tvm_ffi, onnxruntime). An adapter turns tx Tensors into the framework's arrays
(zero-copy, through DLPack), runs a stage with the stage's stream current in the
framework, and takes the outputs back with ``tx.from_dlpack``.

Adapters load lazily; asking for a framework that is not installed raises
``tx.BackendUnavailableError`` naming the package to install.
"""

from __future__ import annotations

import importlib

from .base import Adapter

__all__ = ["Adapter", "get_adapter", "FRAMEWORKS"]

#: Framework name -> (adapter module, pip package that provides it).
FRAMEWORKS = {
    "numpy": "numpy",
    "torch": "torch",
    "cupy": "cupy",
    "jax": "jax",
    "tvm_ffi": "tvm_ffi",
    "onnxruntime": "onnxruntime",
}

_cache: dict[str, Adapter] = {}


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
