"""Our exports dropped while an exception is pending, on whichever path this pass runs
(the compiled core, or EXCHANGE_PURE_PYTHON=1).

A consumer that refuses a capsule drops it with its own error set; a capsule or an
array made from one that is only a temporary on the interpreter's stack is destroyed
while the exception raised next to it unwinds. Either way our capsule destructor and
our deleter run with that exception pending: it must arrive unchanged (not a
SystemError, not lost), the export must be released, and nothing may crash (the pure
path once ended such a loop with SIGSEGV: docs/design.md, "Capsules").
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import exchange as tx
import exchange._core
from exchange import capsule as _capsule
from dlpack_fixtures import Baseline

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is needed for bfloat16")

REPO = Path(__file__).resolve().parents[2]

# -- stack temporaries, in a child: a regression kills the process --------------------------------
STACK_TEMPORARIES = textwrap.dedent("""
    import sys
    import numpy as np
    import exchange as tx
    import exchange._core
    from exchange import capsule
    assert exchange._core.compiled() is (sys.argv[1] == "True"), exchange._core.compiled()

    own = tx.empty((6,), "float32")                      # our allocation
    imported = tx.from_dlpack(np.arange(6.0))            # NumPy's memory, re-exported by us
    a = np.arange(6.0)
    groups = {
        # our exports: the capsule, or NumPy's array over it, dies while the error unwinds
        "exports": {
            "capsule legacy": lambda t: [t.__dlpack__(), 1 / 0],
            "capsule versioned": lambda t: [t.__dlpack__(max_version=(1, 0)), 1 / 0],
            "numpy array": lambda t: [np.from_dlpack(t), 1 / 0],
        },
        # our imports: the Tensor dies while the error unwinds and calls the producer's deleter
        "imports": {
            "tx from numpy": lambda t: [tx.from_dlpack(a), 1 / 0],
            "tx from a numpy capsule": lambda t: [tx.from_dlpack(a.__dlpack__(max_version=(1, 0))), 1 / 0],
            "tx from tx": lambda t: [tx.from_dlpack(t), 1 / 0],
        },
        # a capsule of ours coming back: the Tensor shares the export's record
        "own capsule back": {
            "legacy": lambda t: [tx.from_dlpack(t.__dlpack__()), 1 / 0],
            "versioned": lambda t: [tx.from_dlpack(t.__dlpack__(max_version=(1, 3))), 1 / 0],
        },
    }
    try:
        import torch
        groups["exports"]["torch tensor"] = lambda t: [torch.from_dlpack(t), 1 / 0]
        tt = torch.arange(6.0)
        groups["imports"]["tx from torch"] = lambda t: [tx.from_dlpack(tt), 1 / 0]
    except ImportError:
        pass
    for name, case in groups[sys.argv[2]].items():
        for t in (own, imported):
            caught = 0
            for _ in range(20):
                try:
                    case(t)
                except ZeroDivisionError as exc:
                    caught += exc.__context__ is None   # nothing of ours got chained in
            s = tx.registry().stats()
            print(name.replace(" ", "_"), caught, s["exports_outstanding"], flush=True)
    del own, imported, t   # t: the loop variable
    s = tx.registry().stats()
    print("end", s["live_records"], s["exports_outstanding"], s["imports_outstanding"], flush=True)
""")

# "own capsule back": a Tensor holding its record beyond the inline holder slots; the
# compiled core's record_remove_holder once cleared the pending exception there.
@pytest.mark.parametrize("group", ["exports", "imports", "own capsule back"])
def test_stack_temporaries_dropped_while_an_exception_unwinds(group):
    r = subprocess.run([sys.executable, "-c", STACK_TEMPORARIES, str(exchange._core.compiled()), group], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert r.returncode == 0, f"exit status {r.returncode} (-11: SIGSEGV)\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    lines = r.stdout.splitlines()
    assert lines[-1] == "end 0 0 0", r.stdout
    cases = lines[:-1]
    assert len(cases) >= 4, r.stdout  # two cases or more, each over two tensors
    for line in cases:
        name, caught, outstanding = line.split()
        assert caught == "20", f"{name}: the ZeroDivisionError did not arrive unchanged every time"
        assert outstanding == "0", f"{name}: exports leaked"
    for bad in ("SystemError", "Exception ignored", "Traceback"):
        assert bad not in r.stderr, r.stderr


# -- real consumers refusing our capsules ----------------------------------------------------------
class LegacyOnly:
    """A producer that answers every ``__dlpack__`` with a legacy capsule."""

    def __init__(self, t: tx.Tensor) -> None:
        self.t = t

    def __dlpack__(self, **kwargs):
        return self.t.__dlpack__()

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


class VersionedOnly(LegacyOnly):
    """A producer that answers every ``__dlpack__`` with a versioned capsule."""

    def __dlpack__(self, **kwargs):
        return self.t.__dlpack__(max_version=(1, 3))


def _strided() -> tx.Tensor:
    return tx.from_dlpack(np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2])


def _numpy(versioned: bool):
    t = tx.empty((4,), "bfloat16")  # NumPy 2.4 has no bfloat16 DLPack code
    wrap = VersionedOnly if versioned else LegacyOnly
    return t, lambda: np.from_dlpack(wrap(t)), (BufferError, RuntimeError), "dtype"


def _tvm_ffi(versioned: bool):
    tvm_ffi = pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed")
    t = _strided()
    kw = {"max_version": (1, 3)} if versioned else {}
    return t, lambda: tvm_ffi.from_dlpack(t.__dlpack__(**kw), require_contiguous=True), RuntimeError, "contiguous"


def _onnxruntime(versioned: bool):
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
    from onnxruntime.capi import _pybind_state as C

    t = _strided()
    if versioned:  # ONNX Runtime takes legacy capsules only
        return t, lambda: C.OrtValue.from_dlpack(t.__dlpack__(max_version=(1, 3))), TypeError, "named 'dltensor'"
    return t, lambda: C.OrtValue.from_dlpack(t.__dlpack__()), RuntimeError, "contiguous"


def _jax(versioned: bool):
    jax = pytest.importorskip("jax", reason="JAX is not installed")
    import jax.dlpack  # noqa: F401

    t = _strided()
    if versioned:  # JAX asks for a legacy capsule and refuses a versioned one
        return t, lambda: jax.dlpack.from_dlpack(VersionedOnly(t)), Exception, "dltensor"
    return t, lambda: jax.dlpack.from_dlpack(t), Exception, "striding"


CONSUMERS = {"numpy": _numpy, "tvm_ffi": _tvm_ffi, "onnxruntime": _onnxruntime, "jax": _jax}


@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
@pytest.mark.parametrize("consumer", list(CONSUMERS))
def test_a_consumers_refusal_arrives_unchanged_and_releases_the_export(consumer, versioned):
    base = Baseline()
    t, take, expected, words = CONSUMERS[consumer](versioned)
    exports = tx.registry().stats()["exports_outstanding"]
    for _ in range(3):  # once is not luck
        with pytest.raises(expected) as info:
            take()
        assert not isinstance(info.value, SystemError), f"{consumer}'s exception was lost: {info.value!r}"
        assert words in str(info.value), f"not {consumer}'s own message: {info.value!r}"
        assert info.value.__context__ is None, f"something of ours got chained in: {info.value.__context__!r}"
        del info
        assert tx.registry().stats()["exports_outstanding"] == exports, "the refused export was not released"
    del t, take
    base.assert_clean()
