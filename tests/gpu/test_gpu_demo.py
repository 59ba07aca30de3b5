"""The demo's chain on CUDA (``tensor-exchange demo --device cuda``): accuracy, no
record left alive, and every hop shared except the hops that copy by design, each of
which carries its reason (the GPU machine's ONNX Runtime is the CPU build: the model
stage then runs on the CPU). A copy without a reason, or a record left, fails."""

from __future__ import annotations

import pytest

for _name in ("sklearn", "onnx", "onnxruntime"):
    pytest.importorskip(_name, reason=f"the demo needs {_name} (pip install -e '.[demo]')")


def test_demo_chain_on_cuda(cp, torch_cuda, jax_gpu):
    from exchange.cli import demo

    reason = demo.cuda_unusable_reason()
    assert reason is None, f"the demo cannot run on CUDA here: {reason}"
    result = demo.run_demo(device="cuda", batches=4)
    report = demo.report_json(result)
    assert result.live_records_end == 0, result.records_end
    assert result.accuracy >= demo.MIN_ACCURACY
    copies = [h for h in report["hops"] if not h["shared"]]
    assert all(h.get("reason") for h in copies), f"hops copied without a reason: {copies}"
    if demo.ort_has_cuda():
        assert copies == [], copies
    else:
        assert [(h["from"], h["to"]) for h in copies] == [("cupy", "onnxruntime"), ("onnxruntime", "torch")]
    assert [s["framework"] for s in report["stages"]] == ["cupy", "onnxruntime", "torch", "jax"]
    assert result.ok
