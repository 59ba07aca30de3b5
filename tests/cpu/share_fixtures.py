"""The fixtures every cross-process test module uses (test_share*.py): import them by
name (``from share_fixtures import warm_sharing, clean_sharing``) and they apply to
every test of the module.

``warm_sharing`` starts, once per module, what lives for the whole session once started
(this process's share server and thread, multiprocessing's resource tracker and
forkserver), so the per-test descriptor count does not see them. ``clean_sharing``
checks after each test: no named segment in /dev/shm, no shared memory or descriptor
left in this process besides its arenas (kept for reuse: one descriptor and mapping
each), every arena block back, this registry back to where it was and no remote holder
left.
"""

from __future__ import annotations

import gc
import multiprocessing as mp

import pytest

import exchange as tx
from share_helpers import ANSWER_TIMEOUT, dev_shm, fd_count, memfd_count, wait_until

from exchange.devices.cpu import arena_stats

REG = tx.registry()


@pytest.fixture(scope="module", autouse=True)
def warm_sharing():
    from exchange.sharing import serving

    serving.server().ensure()
    for method in ("spawn", "forkserver"):
        ctx = mp.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=int)
        p.start()
        p.join(ANSWER_TIMEOUT)
        q.close()
        q.join_thread()
    yield


@pytest.fixture(autouse=True)
def clean_sharing():
    gc.collect()
    REG.collect(timeout=10)
    shm, fds, live = dev_shm(), fd_count() - arena_stats()["arenas"], REG.stats()["live_records"]
    blocks = arena_stats()["blocks_in_use"]

    def clean() -> bool:
        arenas = arena_stats()  # kept for reuse: one descriptor and one mapping each
        return (REG.stats()["live_records"] == live and REG.stats()["remote_holders"] == 0
                and arenas["blocks_in_use"] == blocks and fd_count() - arenas["arenas"] <= fds
                and memfd_count() == (arenas["arenas"], arenas["arenas"]))

    yield
    ok = wait_until(clean, 10)
    stats = REG.stats()
    assert ok, (f"left behind: {stats}, {arena_stats()} (blocks before {blocks}), descriptors {fd_count()} (before "
                f"{fds} besides arenas), shared memory {memfd_count()}")
    assert dev_shm() == shm, f"named segments appeared in /dev/shm: {dev_shm() - shm}"
