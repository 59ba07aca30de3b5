"""``tx.Chain(..., strict=True)`` and ``copy=False`` on a CUDA device: a CUDA chain whose
hops all share runs under strict; a change of device is refused when the chain is made;
the device copies ``copy=None`` makes are refused under ``copy=False``
(tests/cpu/test_strict.py has the same on the fake CUDA backend)."""

from __future__ import annotations

import numpy as np
import pytest

import exchange as tx


def test_strict_cuda_chain_shares_every_hop(torch_cuda):
    torch = torch_cuda
    chain = tx.Chain([tx.Stage(lambda x: x * 2.0, framework="torch", name="double", device="cuda:0"),
                      tx.Stage(lambda x: x + 1.0, framework="torch", name="inc", device="cuda:0")],
                     device="cuda:0", strict=True)
    x = tx.from_dlpack(np.arange(64, dtype=np.float32), device="cuda:0")
    try:
        run = chain.run([x])
    finally:
        chain.close()
    assert all(h["shared"] for h in run.hops), run.hops
    torch.cuda.synchronize()
    np.testing.assert_array_equal(tx.from_dlpack(run.outputs[0], device="cpu").numpy(), np.arange(64) * 2.0 + 1.0)


def test_strict_refuses_a_change_of_device(torch_cuda):
    with pytest.raises(ValueError, match=r"the hop torch -> numpy into stage 1 'host' would copy: stage 0 runs on "
                                         r"cuda:0 and stage 1 on cpu"):
        tx.Chain([tx.Stage(lambda x: x, framework="torch", device="cuda:0"),
                  tx.Stage(lambda x: x, framework="numpy", name="host", device="cpu")], device="cuda:0", strict=True)


def test_copy_false_refuses_device_copies(torch_cuda):
    a = np.arange(4, dtype=np.float32)
    d = tx.from_dlpack(a, device="cuda:0")  # copy=None: a copy to the device
    assert str(d.device) == "cuda:0"
    with pytest.raises(BufferError, match="copy=False"):
        tx.from_dlpack(a, device="cuda:0", copy=False)
    with pytest.raises(BufferError, match="copy=False"):
        tx.from_dlpack(d, device="cpu", copy=False)
    with pytest.raises(BufferError, match="copy=False"):
        d.__dlpack__(dl_device=(1, 0), copy=False, max_version=(1, 3))
    np.testing.assert_array_equal(tx.from_dlpack(d, device="cpu").numpy(), a)
