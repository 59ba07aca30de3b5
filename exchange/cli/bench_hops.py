"""``tensor-exchange bench`` section "hops": one DLPack hop through tx against the peers'
own, 1 KiB of float32 (256 elements), each result dropped at once.

* ``export_hop_ratio``: ``np.from_dlpack(t)`` for a tx Tensor ``t`` over
  ``np.from_dlpack(a)`` for the NumPy array ``a`` it wraps;
* ``import_hop_ratio``: ``tx.from_dlpack(a)`` over ``np.from_dlpack(a)``; ``details``
  also gives ``torch.from_dlpack(a)`` where PyTorch is installed, and the loop's own
  overhead per call (``id(a)`` in the same loop), which stays in every median.

On ``--device cuda`` the array is CuPy's and CuPy is the peer (its figures under the
``numpy`` keys, so the JSON keeps one shape); PyTorch joins where it has CUDA. The
details sit in ``details`` itself (``export_hop``, ``import_hop``,
``loop_overhead_ns``), where they have been since before sections had modules.
"""

from __future__ import annotations

from typing import Any

from .bench import Candidate, Config, array, compare, consumer, hop_row

__all__ = ["KEYS", "TARGETS", "DETAILS", "measure", "format"]

KEYS = ("export_hop_ratio", "import_hop_ratio")
#: Upper bounds on a 2-core machine: what a hop through tx may cost over the peer's.
TARGETS = {"export_hop_ratio": 1.3, "import_hop_ratio": 2.0}
#: The entries of ``details`` this section fills.
DETAILS = ("export_hop", "import_hop", "loop_overhead_ns")


def measure(cfg: Config, peers: dict[str, Any]) -> dict[str, Any]:
    hops = measure_hops(cfg, peers)
    return {"keys": {"export_hop_ratio": float(hops["export"]["ratio"]),
                     "import_hop_ratio": float(hops["import"]["ratio"])},
            "details": {"export_hop": hops["export"], "import_hop": hops["import"],
                        "loop_overhead_ns": hops["loop_overhead_ns"]}}


def measure_hops(cfg: Config, peers: dict[str, Any]) -> dict[str, Any]:
    import exchange as tx

    # On CUDA the array is CuPy's and CuPy is the peer (the "numpy" keys then hold CuPy's
    # figures, so the JSON keeps one shape); PyTorch joins where it has CUDA.
    a = array(peers, cfg, 256)  # 1 KiB
    name, take = consumer(peers, cfg)
    kind = "cupy.ndarray" if cfg.device == "cuda" else "ndarray"
    t = tx.from_dlpack(a)
    export_cands = [Candidate("tx", take, t), Candidate("numpy", take, a)]
    if cfg.device == "cuda" and "torch" in peers:
        export_cands.append(Candidate("torch", peers["torch"].from_dlpack, t))
    export = compare(export_cands, cfg.samples, cfg.sample_ns)
    cands = [Candidate("tx", tx.from_dlpack, a), Candidate("numpy", take, a)]
    if "torch" in peers:
        cands.append(Candidate("torch", peers["torch"].from_dlpack, a))
    imp = compare(cands, cfg.samples, cfg.sample_ns)
    loop = compare([Candidate("loop", id, a)], max(5, cfg.samples // 4), cfg.sample_ns)["loop"]
    out = {
        "export": {"ours": f"{name}.from_dlpack(tx_tensor)", "peer": f"{name}.from_dlpack({kind})",
                   "elements": a.size, "dtype": "float32", "device": cfg.device,
                   **{f"{k}_ns": v["median_ns"] for k, v in export.items()}, "samples": export},
        "import": {"ours": f"tx.from_dlpack({kind})", "peer": f"{name}.from_dlpack({kind})", "elements": a.size,
                   "dtype": "float32", "device": cfg.device,
                   **{f"{k}_ns": v["median_ns"] for k, v in imp.items()}, "samples": imp},
        "loop_overhead_ns": loop["median_ns"],
    }
    out["export"]["ratio"] = export["tx"]["median_ns"] / export["numpy"]["median_ns"]
    out["import"]["ratio"] = imp["tx"]["median_ns"] / imp["numpy"]["median_ns"]
    if "torch" in imp:
        out["import"]["ratio_vs_torch"] = imp["tx"]["median_ns"] / imp["torch"]["median_ns"]
    del t
    return out


def format(section: dict[str, Any]) -> list[str]:
    """The hop table: each tx hop's median beside the peer's, the ratio and its target."""
    d = section["details"]
    ex, im = d["export_hop"], d["import_hop"]
    device = ex.get("device", "cpu")
    lines = [f"{'hop (1 KiB float32 on ' + device + ', result dropped)':44} {'median':>10} {'peer':>10} "
             f"{'ratio':>7}  target"]
    peer = ex.get("peer", "np.from_dlpack(ndarray)").split(".", 1)[0]
    obj = "cupy" if device == "cuda" else "ndarray"
    lines.append(hop_row(f"export  {peer}.from_dlpack(tx) vs ({obj})", ex["tx_ns"], ex["numpy_ns"],
                         TARGETS["export_hop_ratio"]))
    if "torch_ns" in ex:
        lines.append(hop_row("export  torch.from_dlpack(tx) vs (cupy)", ex["torch_ns"], ex["numpy_ns"], None))
    lines.append(hop_row(f"import  tx.from_dlpack vs {peer}.from_dlpack", im["tx_ns"], im["numpy_ns"],
                         TARGETS["import_hop_ratio"]))
    if "torch_ns" in im:
        lines.append(hop_row("import  tx.from_dlpack vs torch.from_dlpack", im["tx_ns"], im["torch_ns"], None))
    lines.append(f"(loop overhead per call {d['loop_overhead_ns']:.0f} ns, included in every median)")
    return lines
