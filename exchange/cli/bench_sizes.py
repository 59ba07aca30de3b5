"""``tensor-exchange bench`` section "sizes": a zero-copy hop costs the same at every size.

The import hop ``tx.from_dlpack(a)`` and the export hop ``np.from_dlpack(t)`` at sizes
from 1 KiB to ``--max-size`` (1 GiB; ``--quick``: 64 MiB), one array held at a time, each
sampled in the same rounds as the same hop at 1 KiB. ``size_flatness``: the worse of the
two hops' median at the largest size over the same hop at 1 KiB. The details sit in
``details["sizes"]``.
"""

from __future__ import annotations

from typing import Any

from .bench import KiB, Candidate, Config, array, compare, consumer, format_bytes

__all__ = ["KEYS", "TARGETS", "DETAILS", "measure", "format"]

KEYS = ("size_flatness",)
#: Upper bound on a 2-core machine: the largest size's hop over the 1 KiB one.
TARGETS = {"size_flatness": 1.5}
#: The entries of ``details`` this section fills.
DETAILS = ("sizes",)


def measure(cfg: Config, peers: dict[str, Any]) -> dict[str, Any]:
    sizes = measure_sizes(cfg, peers)
    return {"keys": {"size_flatness": float(sizes["flatness"])}, "details": {"sizes": sizes}}


def _sizes(cfg: Config) -> list[int]:
    sizes, n = [], KiB
    while n < cfg.max_size:
        sizes.append(n)
        n *= cfg.size_step
    sizes.append(cfg.max_size)
    return sizes


def measure_sizes(cfg: Config, peers: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each size is sampled in the same rounds as the 1 KiB reference, so the ratio
    (size over reference) does not move with the machine's drift. One big array at a
    time; it is filled first so its pages exist."""
    import exchange as tx

    peers = peers or {}
    _, take = consumer(peers, cfg)
    ref = array(peers, cfg, KiB // 4, fill=1.0)
    ref_t = tx.from_dlpack(ref)
    rows = []
    for size in _sizes(cfg):
        a = array(peers, cfg, size // 4, fill=1.0)
        t = tx.from_dlpack(a)
        res = compare([Candidate("import", tx.from_dlpack, a), Candidate("import_ref", tx.from_dlpack, ref),
                       Candidate("export", take, t), Candidate("export_ref", take, ref_t),
                       Candidate("numpy", take, a)],
                      cfg.size_samples, cfg.sample_ns)
        rows.append({
            "bytes": size,
            "import_ns": res["import"]["median_ns"],
            "export_ns": res["export"]["median_ns"],
            "numpy_ns": res["numpy"]["median_ns"],
            "import_vs_1k": res["import"]["median_ns"] / res["import_ref"]["median_ns"],
            "export_vs_1k": res["export"]["median_ns"] / res["export_ref"]["median_ns"],
        })
        del t, a
    last = rows[-1]
    return {"rows": rows, "largest_bytes": last["bytes"], "import_flatness": last["import_vs_1k"],
            "export_flatness": last["export_vs_1k"],
            "flatness": max(last["import_vs_1k"], last["export_vs_1k"])}


def format(section: dict[str, Any]) -> list[str]:
    lines = [f"{'size':>10} {'import':>10} {'export':>10} {'numpy':>10} {'imp/1KiB':>9} {'exp/1KiB':>9}"]
    for r in section["details"]["sizes"]["rows"]:
        lines.append(f"{format_bytes(r['bytes']):>10} {r['import_ns'] / 1e3:8.3f}us {r['export_ns'] / 1e3:8.3f}us "
                     f"{r['numpy_ns'] / 1e3:8.3f}us {r['import_vs_1k']:9.2f} {r['export_vs_1k']:9.2f}")
    lines.append(f"size_flatness {section['keys']['size_flatness']:.2f}  "
                 f"(target <= {TARGETS['size_flatness']:g})")
    return lines
