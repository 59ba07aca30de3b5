"""Device backends for tensor-exchange: one module per backend (``cpu``, ``cuda``) and the
protocols they implement (``base``). Backends load lazily through ``devices.base.get_backend``."""

from .base import Backend, Event, Stream, get_backend, register_backend

__all__ = ["Backend", "Event", "Stream", "get_backend", "register_backend"]
