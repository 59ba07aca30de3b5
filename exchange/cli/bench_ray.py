"""``tensor-exchange bench`` section ``ray``: a tensor handed actor to actor on Ray.

One hop: actor A returns a 1 MiB float32 tensor, actor B takes it and answers with its
size, the driver waits for the answer (``ray.get(b.take.remote(a.give.remote()))``).
Through the library A returns a tx.Tensor (its serializer, ``exchange.ray_objects``) and
B gets a read-only tx.Tensor over the object store; the peer is plain Ray handing the
same NumPy array (NumPy's own pickle-5 path, which Ray reads back zero-copy). Both go
through the node's object store: one write by Ray, no other copy. The candidates are
sampled in turn, in the same run, on one local cluster (started here when Ray is not
running, with 2 CPUs and no dashboard, and shut down after).

``--json`` key: ``ray_hop_ratio`` (library over plain Ray, medians; target 1.2), or
null with ``details.sections.ray.skipped`` saying why (Ray not installed).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator

__all__ = ["KEYS", "TARGETS", "measure", "format"]

KEYS = ("ray_hop_ratio",)
TARGETS = {"ray_hop_ratio": 1.2}
HOP_BYTES = 1 << 20


class _Giver:
    """Actor A: holds the array and a tx.Tensor over it; returns either."""

    def __init__(self, nbytes: int) -> None:
        import numpy as np

        import exchange as tx

        self.array = np.arange(nbytes // 4, dtype=np.float32)
        self.tensor = tx.from_dlpack(self.array)

    def give_numpy(self) -> Any:
        return self.array

    def give_tx(self) -> Any:
        return self.tensor


class _Taker:
    """Actor B: takes what it is handed (over the store's memory) and answers its size."""

    def take_numpy(self, a: Any) -> int:
        return int(a.nbytes)

    def take_tx(self, t: Any) -> int:
        return int(t.nbytes)


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Ray's start-up lines go to stderr: ``--json`` keeps stdout for the JSON object."""
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
        saved = os.dup(fd)
    except (AttributeError, OSError, ValueError):
        yield
        return
    try:
        os.dup2(sys.stderr.fileno(), fd)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, fd)
        os.close(saved)


def measure(cfg: Any, peers: dict[str, Any]) -> dict[str, Any]:
    """The section's result: ``{"keys": {"ray_hop_ratio": float | None}, "details": {...}}``."""
    try:
        from ..ray_objects import require_ray

        ray = require_ray()
    except ImportError as exc:  # BackendUnavailableError is an ImportError
        return {"keys": {"ray_hop_ratio": None}, "details": {"skipped": str(exc)}}
    from .. import ray_objects
    from .bench import Candidate, compare

    started = not ray.is_initialized()
    with _quiet_stdout():
        ray_objects.init(num_cpus=2, object_store_memory=256 << 20)
    try:
        giver = ray.remote(_Giver).remote(HOP_BYTES)
        taker = ray.remote(_Taker).remote()
        timeout = 60

        def hop_tx(_: Any) -> int:
            return ray.get(taker.take_tx.remote(giver.give_tx.remote()), timeout=timeout)

        def hop_numpy(_: Any) -> int:
            return ray.get(taker.take_numpy.remote(giver.give_numpy.remote()), timeout=timeout)

        if hop_tx(None) != HOP_BYTES or hop_numpy(None) != HOP_BYTES:
            raise RuntimeError("the bench actors did not hand over the whole tensor")
        samples = max(5, cfg.samples // 2)
        summary = compare([Candidate("tx", hop_tx, None), Candidate("ray_numpy", hop_numpy, None)],
                          samples, max(cfg.sample_ns, 4_000_000))
        for handle in (giver, taker):
            ray.kill(handle)
    finally:
        if started:
            with _quiet_stdout():
                ray.shutdown()
    tx_ns, np_ns = summary["tx"]["median_ns"], summary["ray_numpy"]["median_ns"]
    return {
        "keys": {"ray_hop_ratio": float(tx_ns / np_ns)},
        "details": {"bytes": HOP_BYTES, "tx_ns": tx_ns, "ray_numpy_ns": np_ns, "samples": samples,
                    "candidates": summary, "ray": ray.__version__, "cluster_started_here": started},
    }


def format(section: dict[str, Any]) -> list[str]:
    """The section's table lines."""
    d = section["details"]
    head = "ray (1 MiB float32 actor -> actor through the object store)"
    if "skipped" in d:
        return [head, f"  skipped: {d['skipped']}"]
    ratio = section["keys"]["ray_hop_ratio"]
    target = TARGETS["ray_hop_ratio"]
    return [head,
            f"  tx.Tensor {d['tx_ns'] / 1e3:9.1f} us   NumPy array (plain Ray) {d['ray_numpy_ns'] / 1e3:9.1f} us   "
            f"ratio {ratio:.3f}  <= {target:g}  {'ok' if ratio <= target else 'MISSED'}  (Ray {d['ray']})"]
