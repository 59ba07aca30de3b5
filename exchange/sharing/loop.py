"""Sharing's background thread: the process's one runtime thread (exchange/runtime.py).

The serving side (serving.py) and the receiving side (receiving.py) register their
sockets, pidfds and timers on ``loop()``; inspection registers its own there too. Kept
as a module so that ``exchange.sharing.loop.loop()`` goes on naming it.
"""

from __future__ import annotations

from ..runtime import Loop, loop

__all__ = ["Loop", "loop"]
