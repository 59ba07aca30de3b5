"""``tensor-exchange bench`` section "chain": ``chain_hop_ratio``, what a chain hop costs
over the same work glued by hand, the median over rounds of the two sampled back to back.

``--chain chain`` (the default): a two-stage ``tx.Chain`` (NumPy ``x * 2``, then a
PyTorch linear layer with ReLU) on a 1 MiB batch against the same stages glued with the
consumer's own ``from_dlpack``; ``--chain hop``: one tx hop between two frameworks
(NumPy -> tx -> PyTorch) against ``torch.from_dlpack`` of the NumPy array. The details
sit in ``details["chain"]``.
"""

from __future__ import annotations

import statistics
from typing import Any

from .bench import Candidate, Config, array, compare, consumer, hop_row

__all__ = ["KEYS", "TARGETS", "DETAILS", "measure", "format"]

KEYS = ("chain_hop_ratio",)
#: Upper bound on a 2-core machine: a chain hop over the same stages glued by hand.
TARGETS = {"chain_hop_ratio": 1.2}
#: The entries of ``details`` this section fills.
DETAILS = ("chain",)


def measure(cfg: Config, peers: dict[str, Any]) -> dict[str, Any]:
    res = measure_chain(cfg, peers, cfg.chain)
    return {"keys": {"chain_hop_ratio": float(res["ratio"])}, "details": {"chain": res}}


def _chain_pair_hop(peers: dict[str, Any], cfg: Config | None = None) -> tuple[list[Candidate], dict[str, Any]]:
    """A tx hop between two frameworks, against the same two glued by their own
    from_dlpack: NumPy -> tx -> PyTorch vs ``torch.from_dlpack(ndarray)`` (on CUDA: CuPy
    -> tx -> PyTorch vs ``torch.from_dlpack(cupy.ndarray)``)."""
    import exchange as tx

    cfg = cfg or Config(True)
    a = array(peers, cfg, 256)
    src = "cupy" if cfg.device == "cuda" else "numpy"
    if "torch" in peers:
        dst, name = peers["torch"].from_dlpack, "torch"
    else:
        name, dst = consumer(peers, cfg)
    cands = [Candidate("tx", dst, a, g=tx.from_dlpack), Candidate("glued", dst, a)]
    return cands, {"method": "hop", "ours": f"{name}.from_dlpack(tx.from_dlpack({src}))",
                   "peer": f"{name}.from_dlpack({src})", "frameworks": [src, name], "device": cfg.device}


def _chain_pair_chain(peers: dict[str, Any], cfg: Config | None = None) -> tuple[list[Candidate], dict[str, Any]]:
    """One chain hop between two small model stages: a two-stage ``tx.Chain`` (NumPy
    ``x * 2``, then a PyTorch linear layer with ReLU, 1024 -> 1024; NumPy's matmul
    without PyTorch) on a 256 x 1024 float32 batch (1 MiB), against the same two stages
    glued by hand with the consumer's own ``from_dlpack``. The chain runs inline
    (``max_in_flight=1``), so both sides do the same work on one thread; the ratio is
    what the chain adds per batch, also given in microseconds (``overhead_us``).
    On CUDA (``cfg.device``) the stages are CuPy and PyTorch on the GPU, the chain's
    on streams of their own, and each call ends with ``torch.cuda.synchronize()`` on
    both sides, so the GPU work is in the time and does not pile up."""
    import numpy as np

    import exchange as tx

    cfg = cfg or Config(True)
    cuda = cfg.device == "cuda"
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 1024)).astype(np.float32)
    w = (rng.standard_normal((1024, 1024)) / 32).astype(np.float32)
    first_fw = "cupy" if cuda else "numpy"
    if cuda:
        x = peers["cupy"].asarray(x)
    if "torch" in peers:
        torch = peers["torch"]
        name, dst = "torch", torch.from_dlpack
        wt = torch.from_numpy(w).to("cuda") if cuda else torch.from_numpy(w)

        def second(y: Any) -> Any:
            return torch.relu(y @ wt)
    else:
        name, dst = consumer(peers, cfg)
        name = "cupy" if cuda else "numpy"
        wx = peers["cupy"].asarray(w) if cuda else w
        xp = peers["cupy"] if cuda else np

        def second(y: Any) -> Any:
            return xp.maximum(y @ wx, 0)

    def first(y: Any) -> Any:
        return y * np.float32(2.0)

    device = "cuda:0" if cuda else "cpu"
    chain = tx.Chain([tx.Stage(first, framework=first_fw, name="scale", device=device),
                      tx.Stage(second, framework=name, name="linear_relu", device=device)],
                     max_in_flight=1, device=device)
    if cuda:
        sync = peers["torch"].cuda.synchronize if "torch" in peers else peers["cupy"].cuda.Device().synchronize
    else:
        def sync() -> None:
            return None

    def via_chain(y: Any) -> Any:
        out = chain(y)
        sync()
        return out

    def glued(y: Any) -> Any:
        out = second(dst(first(y)))
        sync()
        return out

    cands = [Candidate("tx", via_chain, x), Candidate("glued", glued, x)]
    return cands, {"method": "chain", "ours": f"tx.Chain([{first_fw}, {name}])(x), 256x1024",
                   "peer": f"{name} linear(from_dlpack({first_fw} scale(x)))", "device": cfg.device,
                   "frameworks": [first_fw, name], "batch_bytes": int(x.nbytes), "_close": chain.close}


def measure_chain(cfg: Config, peers: dict[str, Any], method: str = "chain") -> dict[str, Any]:
    """``chain_hop_ratio``: the median over rounds of (ours / glued) within each round.
    The two are sampled back to back in every round, so a machine busy with other work
    slows both alike and the per-round ratio stays put where a ratio of the two medians
    swings (on a shared 2-core VM a batch took 2.5 to 24 ms from one run to the next).
    The chain method times whole batches: ``cfg.chain_samples`` rounds of samples of at
    least 20 ms each."""
    cands, info = (_chain_pair_chain if method == "chain" else _chain_pair_hop)(peers, cfg)
    close = info.pop("_close", None)
    try:
        if method == "hop":
            res = compare(cands, cfg.samples, cfg.sample_ns)
        else:
            res = compare(cands, cfg.chain_samples, max(cfg.sample_ns, 20_000_000))
    finally:
        if close is not None:
            close()
    paired = statistics.median(t / g for t, g in zip(cands[0].samples, cands[1].samples))
    info.update({"tx_ns": res["tx"]["median_ns"], "glued_ns": res["glued"]["median_ns"],
                 "overhead_us": (res["tx"]["median_ns"] - res["glued"]["median_ns"]) / 1e3,
                 "ratio": paired, "ratio_of_medians": res["tx"]["median_ns"] / res["glued"]["median_ns"],
                 "samples": res})
    return info


def format(section: dict[str, Any]) -> list[str]:
    ch = section["details"]["chain"]
    return [f"{'chain hop (' + ch.get('device', 'cpu') + ')':44} {'median':>10} {'peer':>10} {'ratio':>7}  target",
            hop_row(f"chain   {ch.get('method', 'hop')}: through tx vs glued by hand", ch["tx_ns"], ch["glued_ns"],
                    TARGETS["chain_hop_ratio"]),
            f"        ours: {ch['ours']}; peer: {ch.get('peer', '')}"]
