"""The registry as Prometheus metrics: a ``prometheus_client`` collector for your own
registry and HTTP server.

prometheus_client is optional (``pip install "tensor-exchange[metrics]"``); this module
imports it only when a collector is made, and ``import exchange`` never imports this
module. Three lines expose the registry on an HTTP port::

    import prometheus_client, exchange.metrics
    exchange.metrics.register()                    # into prometheus_client.REGISTRY
    prometheus_client.start_http_server(9100)      # http://localhost:9100/metrics

Each scrape calls ``tx.registry().stats()`` once (O(1) in the records alive: maintained
counters, no walk of the records) on the scraping thread, so a scrape never waits for
an exchange and costs the process a few microseconds. The figures are the moment's view
that ``stats()`` gives (exchanges on other threads take no lock).

Metrics (names and units by Prometheus' conventions; the ``device`` label is
``str(tx.Device)``: ``cpu``, ``cuda:0``, ``cuda_host``, ...):

* gauges: ``tensor_exchange_live_records`` (records live or releasing),
  ``tensor_exchange_live_bytes{device}`` (bytes held by live records),
  ``tensor_exchange_pending_bytes{device}`` (the part waiting for a stream-ordered
  release), ``tensor_exchange_pending_releases`` (releases waiting on stream events),
  ``tensor_exchange_exports_outstanding`` (capsules made whose deleter has not run),
  ``tensor_exchange_imports_outstanding`` (imports whose producer's deleter has not run),
  ``tensor_exchange_remote_holders`` (other processes holding records, tx.share),
  ``tensor_exchange_leases_in_transit`` (share handles sent, not yet attached or closed);
* counters: ``tensor_exchange_records_created_total`` and
  ``tensor_exchange_releases_total`` (records made and released since the process
  started);
* ``tensor_exchange_info{version, core}``: always 1; ``core`` is ``compiled`` or ``pure``;
* per tensor set this process publishes or reads (``tx.publish`` / ``tx.subscribe``;
  labels ``set`` and ``role``, ``publisher`` or ``reader``; from ``exchange.sets.stats()``,
  only where the sets package is loaded: a scrape never imports it):
  ``tensor_exchange_set_versions_total`` (the newest version's number: versions
  published, or the newest a reader has seen), ``tensor_exchange_set_bytes`` (that
  version's bytes), ``tensor_exchange_set_readers`` (processes holding a version) and
  ``tensor_exchange_set_live_versions`` (versions whose memory is still held).

A device keeps its ``live_bytes`` and ``pending_bytes`` series, at 0, once this
collector has seen it (``stats()`` names only devices holding bytes), and ``cpu`` is
always there: a series that vanished would read as stale, not as empty.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

from .errors import require_module

__all__ = ["EXTRA", "PREFIX", "RegistryCollector", "register", "require_prometheus_client"]

EXTRA = 'pip install "tensor-exchange[metrics]"'
#: Every metric's name starts with this.
PREFIX = "tensor_exchange"

#: The unlabelled gauges: stats() key (the metric's name after the prefix), help text.
_GAUGES = (
    ("live_records", "Records in the tensor-exchange registry, live or releasing."),
    ("pending_releases", "Releases waiting for the work queued on their streams to finish."),
    ("exports_outstanding", "DLPack capsules made by tensor-exchange whose deleter has not run."),
    ("imports_outstanding", "Imported DLPack tensors whose producer's deleter has not run."),
    ("remote_holders", "Other processes holding records of this one (tx.share)."),
    ("leases_in_transit", "Share handles sent and not yet attached or closed, holding records."),
)
#: The gauges per device, in bytes: stats() key (the metric's name after the prefix), help text.
_DEVICE_BYTES = (
    ("live_bytes", "Bytes of memory held by live records, per device."),
    ("pending_bytes", "Bytes per device waiting for their stream-ordered release."),
)
#: stats() key -> (counter name without _total, help text).
_COUNTERS = (
    ("created_total", "records_created", "Records the registry has made since the process started."),
    ("released_total", "releases", "Records released (their memory handed back) since the process started."),
)


def require_prometheus_client() -> Any:
    """The ``prometheus_client`` module; ``tx.BackendUnavailableError`` (an ImportError)
    naming the extra where it is not installed."""
    return require_module("prometheus_client", "exchange.metrics", EXTRA)


class RegistryCollector:
    """A prometheus_client collector (``collect()`` yields metric families) over
    ``tx.registry().stats()``; see the module docstring for the metrics.

    Register it in any ``prometheus_client.CollectorRegistry``
    (``registry.register(RegistryCollector())``) or use :func:`register`. Scrapes may
    come from any thread, several at once.

    Raises
    ------
    tx.BackendUnavailableError
        (an ImportError) prometheus_client is not installed; the message names the extra.
    """

    def __init__(self) -> None:
        require_prometheus_client()
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self._gauge, self._counter = GaugeMetricFamily, CounterMetricFamily
        self._lock = threading.Lock()
        self._devices: dict[str, None] = {"cpu": None}  # every device seen, in order

    def _families(self, stats: dict[str, Any] | None) -> Iterator[Any]:
        Gauge, Counter = self._gauge, self._counter
        if stats is not None:
            with self._lock:
                for key, _ in _DEVICE_BYTES:
                    for device in stats[key]:
                        self._devices.setdefault(device, None)
                devices = list(self._devices)
        for key, text in _GAUGES:
            yield Gauge(f"{PREFIX}_{key}", text, value=None if stats is None else stats[key])
        for key, text in _DEVICE_BYTES:
            family = Gauge(f"{PREFIX}_{key}", text, labels=["device"], unit="bytes")
            if stats is not None:
                for device in devices:
                    family.add_metric([device], stats[key].get(device, 0))
            yield family
        for key, name, text in _COUNTERS:
            yield Counter(f"{PREFIX}_{name}_total", text, value=None if stats is None else stats[key])
        info = Gauge(f"{PREFIX}_info", "tensor-exchange's version and core (compiled or pure Python); always 1.",
                     labels=["version", "core"])
        if stats is not None:
            from . import _core
            from ._version import __version__

            info.add_metric([__version__, "compiled" if _core.compiled() else "pure"], 1)
        yield info
        yield from self._set_families(stats is not None)

    def _set_families(self, values: bool) -> Iterator[Any]:
        """The per-set metrics (see the module docstring); rows only where ``values`` and
        the sets package is loaded."""
        import sys

        sets = sys.modules.get("exchange.sets") if values else None
        rows = sets.stats() if sets is not None else []
        labels = ["set", "role"]
        for key, family in ((("version", self._counter(f"{PREFIX}_set_versions", "Versions of a tensor set: the "
                                                      "newest one's number (published, or seen by a reader).",
                                                      labels=labels)),
                             ("nbytes", self._gauge(f"{PREFIX}_set_bytes", "Bytes of a tensor set's newest version.",
                                                    labels=labels, unit="bytes")),
                             ("readers", self._gauge(f"{PREFIX}_set_readers", "Processes holding a version of a "
                                                     "tensor set.", labels=labels)),
                             ("live_versions", self._gauge(f"{PREFIX}_set_live_versions", "Versions of a tensor set "
                                                           "whose memory is still held.", labels=labels)))):
            for row in rows:
                value = row[key]
                family.add_metric([str(row["name"]), str(row["role"])],
                                  len(value) if isinstance(value, (list, tuple, set, dict)) else value)
            yield family

    def collect(self) -> Iterator[Any]:
        """The metric families with this moment's values (one ``stats()`` call)."""
        from .registry import registry

        return self._families(registry().stats())

    def describe(self) -> Iterator[Any]:
        """The metric families without values: a registry checks names against them when
        the collector is registered (a second one in the same registry is refused)."""
        return self._families(None)


def register(registry: Any = None) -> RegistryCollector:
    """Make a :class:`RegistryCollector` and register it in ``registry`` (a
    ``prometheus_client.CollectorRegistry``; None: prometheus_client's default
    ``REGISTRY``, which its ``start_http_server`` serves). Returns the collector
    (``registry.unregister(collector)`` removes it).

    Raises
    ------
    tx.BackendUnavailableError
        (an ImportError) prometheus_client is not installed; the message names the extra.
    ValueError
        ``registry`` already holds these metrics (prometheus_client's duplicate check).
    """
    collector = RegistryCollector()
    if registry is None:
        registry = require_prometheus_client().REGISTRY
    registry.register(collector)
    return collector
