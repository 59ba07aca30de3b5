"""The chain's errors and the messages that explain them: ``StageError`` (re-exported by
exchange.chain and exchange), a stage that could not take its input or failed, what a
stage's output or a batch was and what to return or pass instead."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import ExchangeError
from .tensor import Tensor

if TYPE_CHECKING:
    from .chain import _Plan


class StageError(ExchangeError):
    """A stage's function raised; the message names the stage, ``__cause__`` is the error."""


#: How to make one array of a framework from Python values, for the messages.
_MAKE_ARRAY = {"numpy": "np.asarray(value)", "torch": "torch.as_tensor(value)", "jax": "jnp.asarray(value)",
               "cupy": "cupy.asarray(value)"}


def _take_failed(plan: _Plan, exc: Exception) -> StageError:
    return StageError(f"stage {plan.index} {plan.name!r} ({plan.framework}) could not take its input "
                      f"from {plan.before}: {type(exc).__name__}: {exc}")


def _stage_failed(plan: _Plan, exc: Exception) -> StageError:
    return StageError(f"stage {plan.index} {plan.name!r} ({plan.framework}) failed: {type(exc).__name__}: {exc}")


def _output_error(plan: _Plan, raw: Any, keys: list[Any] | None, values: list[Any], exc: Exception) -> Exception:
    """Why the stage's outputs (``raw``, as its function returned them) could not be
    taken, naming the output that failed."""
    i = 0
    for i, value in enumerate(values):  # the first output that cannot be taken
        if not hasattr(value, "__dlpack__") and not isinstance(value, Tensor):
            break
        try:
            plan.give(value)
        except Exception as again:
            exc = again
            break
    key = keys[i] if keys else i
    value = values[i]
    stage = f"stage {plan.index} {plan.name!r} ({plan.framework})"
    if not hasattr(value, "__dlpack__") and not isinstance(value, Tensor):
        make = _MAKE_ARRAY.get(plan.framework, "the framework's array of them")
        what = "None" if value is None else _a(type(value).__name__)
        if isinstance(raw, dict):
            return TypeError(f"{stage} returned a dict whose output {key!r} is {what}, which has no __dlpack__; "
                             f"a dict's values must be arrays ({make})")
        if isinstance(raw, (tuple, list)):
            kind = type(raw).__name__
            return TypeError(
                f"{stage} returned {_a(kind)} of {len(values)} items, which a chain takes as {len(values)} outputs, "
                f"one per item; item {key} is {what}, which has no __dlpack__. Return one array ({make} makes one "
                f"of the {kind}), or one array per output"
            )
        return TypeError(f"{stage} returned {what}, which has no __dlpack__; return an array ({make}), a tuple "
                         "of arrays or a dict of arrays")
    # e.g. PyTorch refusing a tensor that requires grad
    return StageError(f"{stage} returned output {key!r} that could not be taken: {type(exc).__name__}: {exc}")


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _check_batches(batches: Any) -> None:
    """TypeError when ``Chain.run`` is given one batch instead of an iterable of batches:
    a dict, string or tx.Tensor, or an array of at most one dimension, whose items (keys,
    characters, scalars) would go to the stages one by one and fail there with a message
    about them. (An array of more dimensions is an iterable of its rows: a batch each.)"""
    cls = type(batches)
    if isinstance(batches, (Tensor, dict, str, bytes)) or (hasattr(cls, "__dlpack__")
                                                            and getattr(batches, "ndim", 1) <= 1):
        one = f"one batch ({cls.__module__}.{cls.__qualname__}), whose items are not batches"
    else:
        try:
            iter(batches)  # an iterator gives itself: nothing is taken from it
            return
        except TypeError:
            one = f"{cls.__module__}.{cls.__qualname__}, which is not iterable"
    raise TypeError(f"Chain.run takes an iterable of batches (a list, a generator), got {one}; to run one batch x, "
                    "call chain(x) or chain.run([x])")


def _input_error(batch: Any, exc: TypeError) -> TypeError:
    """A batch holding something with no ``__dlpack__``: say what a batch is."""
    if isinstance(batch, dict):
        values = list(batch.items())
    elif isinstance(batch, (tuple, list)):
        values = list(enumerate(batch))
    else:
        values = [(None, batch)]
    for key, value in values:
        if not isinstance(value, Tensor) and not hasattr(value, "__dlpack__"):
            where = "the batch" if key is None else f"the batch's input {key!r}"
            return TypeError(
                f"{where} is {_a(type(value).__module__ + '.' + type(value).__qualname__)}, which has no __dlpack__; "
                "a batch is an array (anything with __dlpack__: NumPy, PyTorch, JAX, CuPy...), a tuple or a dict of "
                "arrays, and Chain.run takes an iterable of batches"
            )
    return exc
