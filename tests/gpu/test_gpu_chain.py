"""tx.Chain on CUDA: stages on their own streams, ordered by the DLPack handshake, with
outputs that outlive the chain (issue 5, CUDA paths)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import exchange as tx


def _host(t):
    return tx.from_dlpack(t, device="cpu").numpy()


def test_cupy_torch_chain_on_own_streams(cp, torch_cuda, kernels):
    torch = torch_cuda
    chain = tx.Chain([
        tx.Stage(lambda x: x * 2.0, framework="cupy", name="double", device="cuda:0"),
        tx.Stage(lambda x: torch.softmax(x, dim=-1), framework="torch", name="softmax", device="cuda:0"),
    ], device="cuda:0")
    streams = {s.handle for s in chain._streams}
    assert len(streams) == 2 and 0 not in streams  # each stage its own non-default stream
    xs = [np.random.default_rng(i).standard_normal((64, 32)).astype(np.float32) for i in range(4)]
    run = chain.run([tx.from_dlpack(x, device="cuda:0") for x in xs])
    assert all(h["shared"] for h in run.hops), run.hops
    chain.close()
    del chain
    gc.collect()
    for x, out in zip(xs, run.outputs):
        z = 2.0 * x
        e = np.exp(z - z.max(-1, keepdims=True))
        np.testing.assert_allclose(_host(out), e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_chain_stage_waits_for_slow_producer_stream(cp, kernels):
    # Stage 1 writes after a long spin on its own stream; stage 2 reads on another stream
    # right away: without the handshake it would read the old values.
    from gpu_helpers import BLOCK, GRID, SPIN_NS

    def slow_fill(x):
        out = cp.empty_like(x)  # on the stage's stream: the adapter made it current
        kernels["spin_then_fill"](GRID, BLOCK, (out, np.int64(out.size), np.uint64(SPIN_NS), np.float32(7.0)))
        return out

    chain = tx.Chain([tx.Stage(slow_fill, framework="cupy", device="cuda:0"),
                      tx.Stage(lambda y: y + 1.0, framework="cupy", device="cuda:0")], device="cuda:0")
    n = 1 << 16
    out = chain(tx.from_dlpack(np.zeros(n, dtype=np.float32), device="cuda:0"))
    chain.close()
    np.testing.assert_array_equal(_host(out), 8.0 + np.arange(n, dtype=np.float32))


def test_a_traced_cuda_chain_shows_stages_hops_and_stream_ordered_releases(cp, tmp_path):
    """tx.trace on a CUDA chain (CuPy stages on their own streams): a span per stage per
    batch, the hops, and each intermediate's release on its CUDA stream's track, begun
    before it completed; the file is valid JSON with every begin matched."""
    import json

    from exchange import tracing

    chain = tx.Chain([tx.Stage(lambda x: x * 2.0, framework="cupy", name="double", device="cuda:0"),
                      tx.Stage(lambda x: x + 1.0, framework="cupy", name="inc", device="cuda:0")], device="cuda:0")
    path = tmp_path / "gpu.json"
    with tx.trace(path):
        run = chain.run([cp.ones((256, 256), dtype=cp.float32) for _ in range(3)])
        total = float(cp.from_dlpack(run.outputs[-1]).sum())
        run.outputs.clear()
        chain.close()
        gc.collect()
        tx.registry().collect(timeout=10)
    assert total == 3.0 * 256 * 256
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert sorted(e["name"] for e in spans) == ["double"] * 3 + ["inc"] * 3
    assert len([e for e in events if e["ph"] == "i" and e.get("cat") == "hop"]) == 3 * 3
    releases = [e for e in events if e.get("cat") == "release"]
    assert releases, "CUDA intermediates are released in stream order: their spans must show"
    begins = {e["id2"]["local"]: e["ts"] for e in releases if e["ph"] == "b"}
    ends = {e["id2"]["local"]: e["ts"] for e in releases if e["ph"] == "e"}
    assert begins.keys() == ends.keys() and all(ends[k] >= begins[k] for k in begins)
    assert all(e["name"].startswith("release on ") for e in releases)
    assert tracing.active() is None
