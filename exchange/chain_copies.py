"""The copies a chain makes where a stage cannot take its input as it is, and the
refusals of ``strict=True`` instead of them.

Owns: the guards that copy a stage's input (``_read_only_copies``: truly read-only memory
for a framework that ignores DLPack's READ_ONLY flag; ``_aligned_copies``: memory not
aligned as the framework needs) and the reasons their hops give (``_joined``); the
errors of a strict chain (``_refused``, ``_refusal``) and where it refuses: when the chain
is made (``_refuse_planned_copies``: a change of device, a framework that always copies)
and per batch, before the stage's function runs (``_refuse_taken_copies``,
``_refuse_given_copies``: a framework that copied on its own). Raises ValueError for a
refused copy and BufferError where no aligned memory is to be had. exchange/chain.py
calls them; the hop reports are exchange/chain_hops.py's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .tensor import from_dlpack

if TYPE_CHECKING:
    from .chain import Stage, _Plan
    from .device import Device
    from .frameworks.base import Adapter
    from .tensor import Tensor


def _read_only_copies(plan: _Plan, tensors: list[Tensor]) -> list[str | None] | None:
    """Replace, in ``tensors``, each truly read-only one by a copy (the stage's framework
    ignores READ_ONLY and could write into it); the reasons for the hops, or None.
    Strict: ValueError instead of the first copy."""
    reasons: list[str | None] | None = None
    framework = plan.framework
    for i, t in enumerate(tensors):
        if t.mutability == "readonly":
            if plan.strict:
                raise _refused(plan, f"its input is read-only memory ({t.record.origin}) and {framework} ignores "
                                     "DLPack's READ_ONLY flag, so it would get a copy it may write")
            tensors[i] = from_dlpack(t, copy=True, stream=plan.work_stream)
            if reasons is None:
                reasons = [None] * len(tensors)
            reasons[i] = (f"read-only memory ({t.record.origin}) copied for {framework}, which ignores "
                          "DLPack's READ_ONLY flag")
    return reasons


def _aligned_copies(plan: _Plan, tensors: list[Tensor], reasons: list[str | None] | None) -> list[str | None] | None:
    """Replace, in ``tensors``, each one whose first byte is not ``plan.align``-byte
    aligned by an aligned copy (tx.empty's memory: 64-byte aligned on the CPU, more on
    CUDA); the reasons for the hops, or None. Strict: ValueError instead of the copy."""
    align = plan.align
    for i, t in enumerate(tensors):
        off = t.data_ptr % align
        if not off or not t.nbytes:
            continue
        why = f"its input is not {align}-byte aligned ({off} bytes past), which {plan.framework} needs"
        if plan.strict:
            raise _refused(plan, why)
        copy = from_dlpack(t, copy=True, stream=plan.work_stream)
        if copy.data_ptr % align:
            raise BufferError(f"stage {plan.index} {plan.name!r} ({plan.framework}) needs {align}-byte aligned "
                              f"memory, more than tx.empty gives on {copy.device}")
        tensors[i] = copy
        if reasons is None:
            reasons = [None] * len(tensors)
        reasons[i] = _joined(reasons[i], f"{why}: copied into aligned memory")
    return reasons


def _joined(reason: str | None, more: str) -> str:
    return more if reason is None else f"{reason}; {more}"


def _refused(plan: _Plan, reason: str, out: bool = False) -> ValueError:
    """strict=True: the error for a hop into (or, ``out``, out of) ``plan``'s stage that
    would copy, naming the hop and why."""
    return _refusal(plan.index, plan.name, plan.framework, plan.before, reason, plan.after if out else None)


def _refusal(k: int, name: str, framework: str, before: str, reason: str, after: str | None = None) -> ValueError:
    if after is None:
        hop = f"the hop {before} -> {framework} into stage {k} {name!r}"
    else:
        hop = f"the hop {framework} -> {after} out of stage {k} {name!r}"
    return ValueError(f"strict chain: {hop} would copy: {reason}. strict=True refuses copies; hand it memory it "
                      "can take as it is, or leave strict off to let the chain copy and report the hop")


def _refuse_planned_copies(stages: list[Stage], adapters: list[Adapter], device: Device) -> None:
    """strict=True, when the chain is made: ValueError for the first hop that copies
    whatever the batches are (a change of device between stages, a framework that always
    copies on import)."""
    where = [s.device or device for s in stages]
    for k, (stage, adapter) in enumerate(zip(stages, adapters)):
        before = stages[k - 1].framework if k else "input"
        if k and where[k] != where[k - 1]:
            raise _refusal(k, stage.name, stage.framework, before,
                           f"stage {k - 1} runs on {where[k - 1]} and stage {k} on {where[k]}, so its input would "
                           "be copied across devices")
        if adapter.import_copies is not None:
            raise _refusal(k, stage.name, stage.framework, before,
                           f"{stage.framework} copies every input it takes: {adapter.import_copies}")


def _refuse_taken_copies(plan: _Plan, tensors: list[Tensor], arrays: list[Any]) -> None:
    """strict=True, before the stage's function runs: ValueError when the framework's
    array of an input is not over the tx Tensor's memory (the framework copied it)."""
    ptr = plan.ptr
    for t, a in zip(tensors, arrays):
        p = ptr(a)  # type: ignore[misc]
        if p is not None and p != t.data_ptr and t.nbytes:
            raise _refused(plan, f"{plan.framework} copied the data when it took it (its array is at another "
                                 "address than the tx Tensor)")


def _refuse_given_copies(plan: _Plan, values: list[Any], outs: list[Tensor]) -> None:
    """strict=True, before the next stage runs: ValueError when a stage's output came
    into tx as a copy (the tx Tensor is at another address than the framework's array)."""
    ptr = plan.ptr
    for value, t in zip(values, outs):
        p = ptr(value)  # type: ignore[misc]
        if p is not None and p != t.data_ptr and t.nbytes:
            raise _refused(plan, f"the output of {plan.framework} was copied on its way into tx", out=True)
