"""exchange.metrics: the registry as Prometheus metrics, scraped over HTTP on localhost
from a real prometheus_client server and read back with prometheus_client's own parser."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import exchange as tx
import exchange._core

prometheus_client = pytest.importorskip("prometheus_client")  # the metrics extra (in the test environment)
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import exchange.metrics as metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
P = metrics.PREFIX

GAUGES = ("live_records", "pending_releases", "exports_outstanding", "imports_outstanding", "remote_holders",
          "leases_in_transit")


@pytest.fixture
def scrape():
    """A fresh CollectorRegistry holding the collector, served by prometheus_client's own
    HTTP server on 127.0.0.1 (a free port); yields a function that scrapes and parses it."""
    registry = prometheus_client.CollectorRegistry()
    collector = metrics.register(registry)
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
    url = f"http://127.0.0.1:{server.server_port}/metrics"

    def get() -> dict[str, tuple[str, str, float]]:
        with urllib.request.urlopen(url, timeout=30) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain")
            text = response.read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = sample.name + "".join(f"|{k}={v}" for k, v in sorted(sample.labels.items()))
                out[key] = (family.type, family.documentation, sample.value)
        return out

    try:
        yield get
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
        registry.unregister(collector)


def _settled() -> dict:
    gc.collect()
    assert tx.registry().collect(timeout=30)
    return tx.registry().stats()


def _check_equal(scraped: dict, stats: dict) -> None:
    for key in GAUGES:
        kind, doc, value = scraped[f"{P}_{key}"]
        assert kind == "gauge" and doc and value == stats[key], (key, value, stats[key])
    for key, name in (("created_total", "records_created_total"), ("released_total", "releases_total")):
        kind, doc, value = scraped[f"{P}_{name}"]
        assert kind == "counter" and doc and value == stats[key], (name, value, stats[key])
    for key in ("live_bytes", "pending_bytes"):
        series = {k.split("|device=")[1]: v for k, (_, _, v) in scraped.items() if k.startswith(f"{P}_{key}|")}
        assert "cpu" in series, series  # always there, 0 when nothing is held
        assert {d: v for d, v in series.items() if v} == stats[key], (key, series, stats[key])


def test_scraped_over_http_equals_stats_and_follows_the_records(scrape):
    before = _settled()
    sizes = (1000, 4096, 1 << 20)
    held = [tx.empty(n, "uint8") for n in sizes]
    source = np.arange(256, dtype=np.float32)
    held.append(tx.from_dlpack(source))  # an import: imports_outstanding counts it
    now = tx.registry().stats()
    scraped = scrape()
    _check_equal(scraped, now)
    assert now == tx.registry().stats()  # nothing moved while the scrape ran
    grew = sum(sizes) + source.nbytes
    assert scraped[f"{P}_live_bytes|device=cpu"][2] == before["live_bytes"].get("cpu", 0) + grew
    assert scraped[f"{P}_live_records"][2] == before["live_records"] + 4
    assert scraped[f"{P}_imports_outstanding"][2] == before["imports_outstanding"] + 1
    assert scraped[f"{P}_records_created_total"][2] == before["created_total"] + 4

    del held
    after = _settled()
    scraped = scrape()
    _check_equal(scraped, after)
    assert scraped[f"{P}_live_records"][2] == before["live_records"]
    assert scraped[f"{P}_live_bytes|device=cpu"][2] == before["live_bytes"].get("cpu", 0)
    assert scraped[f"{P}_imports_outstanding"][2] == before["imports_outstanding"]
    assert scraped[f"{P}_releases_total"][2] == before["released_total"] + 4  # the counter rose
    assert scraped[f"{P}_records_created_total"][2] == before["created_total"] + 4  # and this one stayed
    core = "compiled" if exchange._core.compiled() else "pure"
    assert scraped[f"{P}_info|core={core}|version={tx.__version__}"][2] == 1


def test_a_device_seen_once_keeps_its_series_at_zero(monkeypatch):
    """stats() names only devices holding bytes; the collector keeps a device's series at
    0 once it has seen it (a vanished series reads as stale, not as empty)."""
    module = sys.modules["exchange.registry"]  # (tx.registry names the function)
    base = dict(tx.registry().stats(), live_bytes={"cuda:0": 512}, pending_bytes={"cuda:0": 256})
    box = [base]

    class Fake:
        def stats(self):
            return box[0]

    monkeypatch.setattr(module, "registry", lambda: Fake())
    collector = metrics.RegistryCollector()

    def series(name):
        family = next(f for f in collector.collect() if f.name == f"{P}_{name}")
        return {s.labels["device"]: s.value for s in family.samples}

    assert series("live_bytes") == {"cpu": 0, "cuda:0": 512}
    assert series("pending_bytes") == {"cpu": 0, "cuda:0": 256}
    box[0] = dict(base, live_bytes={}, pending_bytes={})
    assert series("live_bytes") == {"cpu": 0, "cuda:0": 0}
    assert series("pending_bytes") == {"cpu": 0, "cuda:0": 0}


def test_names_types_units_and_one_registration_per_registry():
    registry = prometheus_client.CollectorRegistry()
    collector = metrics.register(registry)
    with pytest.raises(ValueError, match="Duplicated"):
        metrics.register(registry)  # describe() lets the registry see the names
    families = {f.name: f for f in collector.collect()}
    assert {name for name, f in families.items() if f.type == "counter"} == {
        f"{P}_records_created", f"{P}_releases", f"{P}_set_versions"}  # exposed with _total
    for name in ("live_bytes", "pending_bytes"):
        assert families[f"{P}_{name}"].unit == "bytes" and families[f"{P}_{name}"].type == "gauge"
    for family in families.values():
        assert family.name.startswith(P + "_") and family.documentation.endswith(".")
    text = prometheus_client.generate_latest(registry).decode()
    assert f"{P}_releases_total " in text and f'{P}_live_bytes{{device="cpu"}}' in text
    registry.unregister(collector)


def test_sets_are_counted_per_set_from_a_real_publisher(scrape):
    """A set this process publishes (tx.publish, twice) shows as its versions, bytes,
    readers and live versions, labelled by set and role, equal to exchange.sets.stats()."""
    import numpy as np

    name = f"tx-metrics-{os.getpid()}"
    tensors = {"w": np.arange(1024, dtype=np.float32), "b": np.ones(16, dtype=np.float32)}
    tx.publish(name, tensors)
    version = tx.publish(name, tensors)
    try:
        import exchange.sets

        row = next(r for r in exchange.sets.stats() if r["name"] == name and r["role"] == "publisher")
        scraped = scrape()
        labels = f"|role=publisher|set={name}"
        assert scraped[f"{P}_set_versions_total{labels}"][2] == version.number == 2
        assert scraped[f"{P}_set_bytes{labels}"][2] == version.nbytes == row["nbytes"] >= 4160
        assert scraped[f"{P}_set_live_versions{labels}"][2] == _count(row["live_versions"]) >= 1
        assert scraped[f"{P}_set_readers{labels}"][2] == _count(row["readers"])
        assert scraped[f"{P}_set_versions_total{labels}"][0] == "counter"
    finally:
        tx.unpublish(name)


def _count(value) -> int:
    return len(value) if isinstance(value, (list, tuple, set, dict)) else value


@pytest.mark.once_per_ci  # does not depend on the capsule path
def test_a_scrape_never_imports_the_sets_package():
    code = ("import sys, prometheus_client, exchange.metrics as m\n"
            "before = 'exchange.sets' in sys.modules\n"
            "r = prometheus_client.CollectorRegistry(); m.register(r); prometheus_client.generate_latest(r)\n"
            "assert ('exchange.sets' in sys.modules) == before, 'a scrape imported exchange.sets'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


BLOCKED = r"""
import sys
sys.modules["prometheus_client"] = None   # as if it were not installed
import exchange as tx
import exchange.metrics                     # importing the module needs nothing
for call in (exchange.metrics.RegistryCollector, exchange.metrics.register):
    try:
        call()
    except ImportError as exc:
        assert isinstance(exc, tx.BackendUnavailableError), type(exc)
        print("ERROR:" + str(exc))
    else:
        raise SystemExit("no error")
"""


@pytest.mark.once_per_ci  # does not depend on the capsule path
def test_without_prometheus_client_the_error_names_the_extra():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-c", BLOCKED], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    errors = [ln[6:] for ln in proc.stdout.splitlines() if ln.startswith("ERROR:")]
    assert len(errors) == 2, proc.stdout
    for message in errors:
        assert "prometheus_client" in message and 'pip install "tensor-exchange[metrics]"' in message, message
