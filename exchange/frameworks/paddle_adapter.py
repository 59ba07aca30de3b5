"""PaddlePaddle stages: ``paddle.from_dlpack`` over tx Tensors (zero-copy, versioned
capsules); Paddle tensors come back through ``tx.from_dlpack``, which takes them through
Paddle's own DLPack C exchange table (``paddle.Tensor.__dlpack_c_exchange_api__``) on
the compiled core, as it does PyTorch's, and through ``__dlpack__`` on the pure path.

Paddle's quirks, as of paddlepaddle 3.3 on the CPU:

- it ignores DLPack's READ_ONLY flag: a Paddle tensor over read-only memory is writable
  (seen writing into a pyarrow buffer). ``tx.Chain`` gives a Paddle stage a copy of truly
  read-only memory (``IGNORES_READ_ONLY``), and so does ``to_framework`` used directly.
- it misreads negative strides (its importer asks for about 2**64 bytes and fails with
  MemoryError): such input is handed over as a compact copy, and the hop says copied.
- ``__dlpack_device__()`` answers ``(kDLCPU, None)`` on the CPU; ``tx.from_dlpack`` reads
  that None as device 0.
- a tensor with ``stop_gradient=False`` (``requires_grad``) is refused by its
  ``__dlpack__`` with BufferError ("requires gradients"): return ``x.detach()``.
- on import Paddle installs C-level handlers for SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL
  and SIGTERM (crash reports); ``paddle.disable_signal_handler()`` puts the defaults
  back. tx leaves them as Paddle sets them.

Tested on the CPU; on CUDA the stage's stream is not made current in Paddle.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from ..tensor import Tensor, from_dlpack
from .base import Adapter


class PaddleAdapter(Adapter):
    name = "paddle"
    module = "paddle"
    pip = "paddlepaddle"

    def load(self) -> Any:
        # Paddle's import warns that ccache is missing (for building C++ extensions,
        # which tx never does): not the user's concern here.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)
            return super().load()

    def to_framework(self, t: Any, stream: Any) -> Any:
        paddle = sys.modules.get("paddle") or self.load()
        if t.readonly and t.mutability == "readonly":
            t = from_dlpack(t, copy=True)  # Paddle would write through READ_ONLY
        elif any(s < 0 for s in t.strides):
            t = from_dlpack(t, copy=True)  # Paddle misreads negative strides (see above)
        return paddle.from_dlpack(t)

    def data_ptr(self, x: Any) -> int | None:
        if isinstance(x, Tensor):  # a stage may return a tx Tensor: data_ptr is an int there
            return x.data_ptr
        try:
            return int(x.data_ptr())
        except (AttributeError, RuntimeError, ValueError):  # not a Paddle tensor
            return None


ADAPTER = PaddleAdapter()
