"""A hostile review of a pipelined chain's plain-stage task (exchange/native/stagetask.c,
``_core.plain_task``, and the Python task of exchange/chain_pipeline.py it falls back to
and that the pure twin runs): each case runs a real chain in a child process on both
paths, with a timeout (the failures found hang), and asks the pipelined run for what the
same chain gives inline (``max_in_flight=1``), where no task of either kind runs."""

from __future__ import annotations

import json

import pytest

from process_helpers import NEEDS_NATIVE, run_python

PATHS = [pytest.param("0", marks=NEEDS_NATIVE, id="compiled"), pytest.param("1", id="pure")]

# Runs each case named in NAMES pipelined and inline; prints {case: [pipelined, inline]}
# and whether every registry record made was released.
CASES = """
    import gc, json
    import numpy as np
    import exchange as tx

    def outcome(fns, max_in_flight):
        chain = tx.Chain([tx.Stage(f, framework="numpy", name=f"s{k}") for k, f in enumerate(fns)],
                         max_in_flight=max_in_flight)
        try:
            r = chain.run([np.arange(4, dtype=np.float32) + k for k in range(3)])
            return ["ok", [[np.from_dlpack(v).tolist() for v in (o if isinstance(o, tuple) else (o,))]
                           for o in r.outputs], [[h["from"], h["to"]] for h in r.hops]]
        except BaseException as exc:
            return ["raised"] + [[type(e).__name__, text(e)] if e is not None else None
                                 for e in (exc, exc.__cause__, exc.__context__)]
        finally:
            chain.close()

    def text(e):
        try:
            return str(e)
        except Exception as again:
            return f"<str() raised {type(again).__name__}>"

    class NoStr(Exception):
        def __str__(self):
            raise RuntimeError("no str() for this error")

    def raise_nostr(x):
        raise NoStr()

    class LookupRaises:  # hasattr(out, "__dlpack__") raises, not only give(out)
        @property
        def __dlpack__(self):
            raise ValueError("no __dlpack__ here")

    class TupleProxy:  # a proxy of a tuple: isinstance(proxy, tuple) is True
        def __init__(self, items):
            self._items = items

        @property
        def __class__(self):
            return tuple

        def __iter__(self):
            return iter(self._items)

        def __len__(self):
            return len(self._items)

    class ClassRaises:
        @property
        def __class__(self):
            raise ValueError("no class")

    ident = lambda x: x
    cases = {
        "str_raises_last": (ident, raise_nostr),
        "str_raises_first": (raise_nostr, ident),
        "dlpack_lookup_raises": (ident, lambda x: LookupRaises()),
        "tuple_proxy_last": (ident, lambda x: TupleProxy((x, x + 1))),
        "tuple_proxy_first": (lambda x: TupleProxy((x, x * 2)), lambda a, b: a + b),
        "class_raises": (ident, lambda x: ClassRaises()),
    }
    gc.collect()
    live = tx.registry().stats()["live_records"]
    out = {name: [outcome(fns, 2), outcome(fns, 1)] for name, fns in cases.items() if name in NAMES}
    gc.collect()
    out["released"] = tx.registry().stats()["live_records"] == live
    print(json.dumps(out))
"""


def _cases(pure: str, *names: str) -> dict:
    r = run_python(f"\n    NAMES = {list(names)!r}\n" + CASES, timeout=60, EXCHANGE_PURE_PYTHON=pure)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("pure", PATHS)
def test_an_error_whose_message_cannot_be_made_ends_the_batch_not_the_run(pure):
    # fail() wraps a stage's error in a message naming the stage; where making that
    # message raised (the error's str(), an output's __dlpack__ lookup), the error left
    # the task, the batch was never done and the run waited for ever. Inline, the error
    # from making the message is what the run raises; pipelined it must be the same.
    r = _cases(pure, "str_raises_last", "str_raises_first", "dlpack_lookup_raises")
    for name in ("str_raises_last", "str_raises_first", "dlpack_lookup_raises"):
        pipelined, inline = r[name]
        assert pipelined == inline, name
    assert r["str_raises_last"][0] == ["raised", ["RuntimeError", "no str() for this error"], None,
                                       ["NoStr", "<str() raised RuntimeError>"]]
    assert r["dlpack_lookup_raises"][0][1] == ["ValueError", "no __dlpack__ here"]
    assert r["released"]


@pytest.mark.parametrize("pure", PATHS)
def test_an_output_that_isinstance_takes_for_a_tuple_is_regrouped_as_inline(pure):
    # The Python task asks isinstance(raw, (dict, tuple, list)), which believes an
    # object's __class__ (a proxy's); the compiled task asked the type alone and gave a
    # proxy of a tuple to give() as one output. An isinstance that raises is not the
    # stage's call failing: inline it is not wrapped as a StageError, nor pipelined.
    r = _cases(pure, "tuple_proxy_last", "tuple_proxy_first", "class_raises")
    for name in ("tuple_proxy_last", "tuple_proxy_first", "class_raises"):
        pipelined, inline = r[name]
        assert pipelined == inline, name
    assert r["tuple_proxy_last"][0][1][0] == [[0.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]]  # two outputs
    assert r["tuple_proxy_first"][0][1][0] == [[0.0, 3.0, 6.0, 9.0]]
    assert r["class_raises"][0] == ["raised", ["ValueError", "no class"], None, None]
    assert r["released"]


SLOT_TYPES = """
    import contextvars, json
    from exchange import _core

    FIELDS = ("kind", "values", "ptrs", "hops", "done")

    class Slot:
        __slots__ = FIELDS

    class Inherits(Slot):  # the fields are its base's slots, at the same offsets
        __slots__ = ()

    class Replaced:
        __slots__ = FIELDS

    Replaced.kind = "one"  # the descriptor gone: the field can no longer be read as a slot

    f = lambda *a: None

    def made(slot_type):
        try:
            _core.plain_task(slot_type, f, f, f, None, None, [0.0], 0, None, None, contextvars.copy_context(), f,
                             f, f, f)
        except TypeError as exc:
            return str(exc)
        return "made"

    print(json.dumps([made(Slot), made(Inherits), made(Replaced)]))
"""


@pytest.mark.parametrize("pure", PATHS)
def test_plain_task_takes_the_slot_types_whose_fields_are_slot_descriptors(pure):
    # The compiled core reads each field at its member descriptor's offset; the twin
    # looked for the name in the class's own __slots__, refusing a subclass that
    # inherits them and taking a class whose slot was replaced.
    r = run_python(SLOT_TYPES, timeout=60, EXCHANGE_PURE_PYTHON=pure)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout) == ["made", "made", "plain_task: Replaced.kind must be a __slots__ field"]
