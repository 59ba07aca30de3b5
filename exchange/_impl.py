"""The core's path as tests and tools read it before the seam (exchange/_core/) owned
it: re-exported from ``exchange._core.choice``. Library code asks
``exchange._core.compiled()``."""

from ._core.choice import FIX_PURE, IGNORE_MISSING_CORE, NATIVE, NOT_BUILT, NOT_BUILT_NOTE, WHY_PURE, impl

__all__ = ["FIX_PURE", "IGNORE_MISSING_CORE", "NATIVE", "NOT_BUILT", "NOT_BUILT_NOTE", "WHY_PURE", "impl"]
