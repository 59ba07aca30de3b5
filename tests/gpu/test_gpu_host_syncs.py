"""No host blocking: the CUDA backend counts its own host-blocking calls
(``CUDABackend.host_syncs``: stream and event ``synchronize()``, the syncs before freeing
pinned or managed memory), and the exchange paths make none: hops, releases and a
chain of more than 100 CUDA hops run in stream order only. Nor do they create CUDA
events once warm (``CUDABackend.events_created``): events come from the device's pool
(creating them on the hot path stalled the host in sglang#39960)."""

from __future__ import annotations

import gc


import exchange as tx
from gpu_helpers import host_syncs


def test_the_counter_counts(cuda):
    s = tx.create_stream("cuda:0")
    before = cuda.host_syncs
    s.synchronize()
    s.record().synchronize()
    assert cuda.host_syncs == before + 2


def test_hops_and_releases_make_no_host_sync(cp, torch_cuda):
    torch = torch_cuda
    s = tx.create_stream("cuda:0")
    x = cp.arange(1 << 16, dtype=cp.float32)
    y = torch.arange(1 << 16, dtype=torch.float32, device="cuda:0")
    own = tx.empty((1 << 16,), "float32", device="cuda:0", stream=s)
    cp.cuda.Stream.null.synchronize()
    before = host_syncs()
    for _ in range(50):  # 200 hops, each result dropped at once (a release each)
        t = tx.from_dlpack(x, stream=s)
        u = tx.from_dlpack(y)
        a = torch.from_dlpack(t)
        b = cp.from_dlpack(own)
        del t, u, a, b
    v = tx.empty((1 << 16,), "float32", device="cuda:0", stream=s)  # allocated and freed in stream order
    del v
    gc.collect()
    assert host_syncs() == before, f"{host_syncs() - before} host-blocking calls in 200 hops and their releases"
    assert tx.registry().collect(timeout=10)


def test_chain_of_more_than_100_cuda_hops_makes_no_host_sync(cp, torch_cuda):
    torch = torch_cuda
    chain = tx.Chain([tx.Stage(lambda x: x * 2.0, framework="cupy", name="double", device="cuda:0"),
                      tx.Stage(lambda x: torch.relu(x), framework="torch", name="relu", device="cuda:0")],
                     device="cuda:0")
    inputs = [cp.full((64, 64), float(i - 20), dtype=cp.float32) for i in range(40)]
    cp.cuda.Stream.null.synchronize()
    before = host_syncs()
    run = chain.run(inputs)  # 3 hops a batch: into each stage, and out of the last
    hops = sum(len(b) for b in run.batch_hops)
    del inputs  # their records are released too
    gc.collect()
    syncs = host_syncs() - before
    assert hops >= 100 and all(h["shared"] for b in run.batch_hops for h in b)
    assert syncs == 0, f"{syncs} host-blocking calls in a chain of {hops} CUDA hops"
    got = [float(tx.from_dlpack(out, device="cpu").numpy()[0, 0]) for out in run.outputs]
    assert got == [max(0.0, 2.0 * (i - 20)) for i in range(40)]
    chain.close()
    del run
    assert tx.registry().collect(timeout=10)


def test_hops_and_releases_create_no_event_once_warm(cuda, cp):
    s, b = tx.create_stream("cuda:0"), tx.create_stream("cuda:0")
    x = cp.arange(1 << 12, dtype=cp.float32)
    cp.cuda.Stream.null.synchronize()

    def hops_and_releases(n: int) -> None:
        for _ in range(n):
            t = tx.from_dlpack(x, stream=s)  # an import: its release waits in the reaper on s's event
            own = tx.empty((1 << 12,), "float32", device="cuda:0", stream=s)
            v = tx.from_dlpack(own, stream=b)  # a hop: b waits on an event of s
            del t, v, own  # own's release: s waits on an event of b, then cuMemFreeAsync
        gc.collect()
        assert tx.registry().collect(timeout=10)

    held = [s.record() for _ in range(64)]  # more than this test ever has alive at once
    del held
    hops_and_releases(10)
    before = cuda.events_created
    hops_and_releases(200)
    assert cuda.events_created == before, f"{cuda.events_created - before} CUDA events created by 600 hot-path calls"

