"""Framework adapters for ``tx.Chain``: one module per framework (numpy, torch, cupy, jax,
tvm_ffi, onnxruntime, paddle, pyarrow, tensorflow, mlx). An adapter turns tx Tensors into the framework's arrays
(zero-copy, through DLPack), runs a stage with the stage's stream current in the
framework, and takes the outputs back with ``tx.from_dlpack``.

Adapters load lazily; asking for a framework that is not installed raises
``tx.BackendUnavailableError`` naming the package to install.
"""

from __future__ import annotations

import importlib

from .base import Adapter

__all__ = ["Adapter", "get_adapter", "get_adapters", "FRAMEWORKS", "IGNORES_READ_ONLY"]

#: Framework name -> adapter module (``<value>_adapter``); the adapter names the pip
#: package (``Adapter.pip``).
FRAMEWORKS = {
    "numpy": "numpy",
    "torch": "torch",
    "cupy": "cupy",
    "jax": "jax",
    "tvm_ffi": "tvm_ffi",
    "onnxruntime": "onnxruntime",
    "paddle": "paddle",
    "pyarrow": "pyarrow",
    "tensorflow": "tensorflow",
    "mlx": "mlx",
}

#: Frameworks that take DLPack's READ_ONLY flag for nothing: their arrays over read-only
#: memory are writable (PyTorch: ``torch.from_dlpack`` of a read-only capsule gives a
#: writable tensor; CuPy arrays have no read-only mode; tvm-ffi tensors are writable, and
#: its C exchange API has no flag at all; PaddlePaddle's ``from_dlpack`` ignores the flag). ``tx.Chain`` gives them a copy of memory whose
#: ``Tensor.mutability`` is ``"readonly"`` (docs/scaling.md, "Read-only memory and PyTorch").
#: (NumPy and pyarrow honour the flag; JAX and TensorFlow tensors are immutable; MLX
#: copies what it imports; ONNX Runtime sessions here only read their inputs.)
IGNORES_READ_ONLY = frozenset({"torch", "cupy", "tvm_ffi", "paddle"})

#: Frameworks to import before the others when a chain uses several: PaddlePaddle 3.3
#: imported after TensorFlow 2.21 in one process crashes it (SIGSEGV inside Paddle's
#: import); the other order works.
LOAD_FIRST = ("paddle",)

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


def get_adapters(names: list[str]) -> list[Adapter]:
    """The adapters for ``names``, in that order, their frameworks imported in an order
    that works (``LOAD_FIRST`` first); errors as ``get_adapter``."""
    for name in sorted(set(names), key=lambda n: n not in LOAD_FIRST):
        get_adapter(name)
    return [get_adapter(name) for name in names]
