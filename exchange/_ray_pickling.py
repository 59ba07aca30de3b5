"""Ray pickles a ``tx.Tensor`` under the user's own ``ray.init()``, with no call first,
and ``import exchange`` pays nothing for it (Ray is never imported here).

``Tensor.__reduce__`` asks the one hook ``exchange.tensor.set_pickle_hook`` sets,
which ``import exchange`` sets to :func:`reduce` below: once Ray is loaded in the
process, ``exchange.ray.objects.reduce_under_ray`` decides whether the pickling is
Ray's own and, if so, registers Ray's serializer for tx.Tensor and gives Ray its
reduction. The hook is set from this side so that ``exchange.tensor`` (the layer
below) never imports the Ray integration (the layer above)."""

from __future__ import annotations

import sys
from typing import Any


def reduce(tensor: Any) -> Any:
    """The reduction Ray's own pickling takes for ``tensor``, or None (any other pickling)."""
    if "ray" not in sys.modules:
        return None
    from .ray.objects import reduce_under_ray

    return reduce_under_ray(tensor)


def install() -> None:
    from . import tensor

    tensor.set_pickle_hook(reduce)
