"""Regression tests for defects a breaking session found in the compiled core
(exchange/native/*.c), each also run on the pure-Python twin (EXCHANGE_PURE_PYTHON=1).
Cases that can crash a process run in a subprocess with a timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _python(code: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO), **env})


# -- 1. a capsule consumed by someone else while our import of it runs -------------------------
# The import reads the DLTensor, then runs Python code (a first device or dtype
# validation, tx.track, EXCHANGE_DEBUG's creation stack, the garbage collector) before it
# renames the capsule; another thread may consume the same capsule meanwhile and its
# producer free the struct and the shape array. The import must then refuse ("already
# consumed") without reading that memory again. Here the "meanwhile" is EXCHANGE_DEBUG's
# stack capture, and the producer's shape lives on its own page, unmapped by its deleter:
# reading it after that is a segfault, not a quiet stale read.
def test_a_capsule_consumed_meanwhile_is_refused_without_touching_the_freed_struct():
    r = _python("""
        import ctypes, mmap, sys
        sys.path.insert(0, "tests/cpu")
        import numpy as np
        import exchange as tx
        from exchange import _dlpack_abi as abi
        from dlpack_fixtures import HandMadeProducer

        libc = ctypes.CDLL(None)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        page = libc.mmap(None, 4096, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                         -1, 0)
        (ctypes.c_int64 * 2).from_address(page)[:] = [3, 4]
        data = np.zeros((3, 4), np.float32)
        producer = HandMadeProducer(data=data.ctypes.data, shape=None, strides=None, code=2, bits=32, ndim=2,
                                    shape_address=page, keep=data)
        counted = producer._on_delete

        def on_delete(ptr):
            counted(ptr)
            libc.munmap(page, 4096)  # the producer frees its shape array with the struct

        producer._deleter = abi.DLManagedTensorDeleter(on_delete)
        producer.struct.deleter = ctypes.cast(producer._deleter, ctypes.c_void_p).value
        capsule = producer.capsule()
        taken = []

        class Meanwhile:  # stands for another thread taking the GIL during the stack capture
            @staticmethod
            def extract_stack(limit=None):
                if not taken:
                    taken.append("busy")
                    taken[0] = tx.from_dlpack(capsule).shape  # that Tensor goes at once: the page is unmapped
                return []

            @staticmethod
            def format_list(frames):
                return []

        sys.modules["exchange.registry"].traceback = Meanwhile
        tx.registry().debug = True
        try:
            tx.from_dlpack(capsule)
            print("outer import took the capsule")
        except ValueError as e:
            print("outer import refused:", e)
        print("inner", taken[0], "deleter calls", producer.calls, flush=True)
        stats = tx.registry().stats()
        print("live", stats["live_records"], "imports", stats["imports_outstanding"])
    """, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "outer import refused: this DLPack capsule was already consumed" in r.stdout, r.stdout
    assert "inner (3, 4) deleter calls 1" in r.stdout, r.stdout
    assert "live 0 imports 0" in r.stdout, r.stdout
