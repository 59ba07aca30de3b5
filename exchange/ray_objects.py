"""Kept for one release: the code moved to :mod:`exchange.ray.objects` (exchange/ray/objects.py).
Import it from there; this name is the same module object (an alias in ``sys.modules``)."""

import sys

from .ray import objects as _moved

sys.modules[__name__] = _moved
