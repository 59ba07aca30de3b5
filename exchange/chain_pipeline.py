"""The pipelined chain's tasks (``tx.Chain`` with ``max_in_flight`` > 1 on the CPU):
what each stage's host stream runs per batch, and how a batch goes on to the next.

``Chain._stage_tasks`` (exchange/chain.py) makes one task per stream and run, from the
last to the first, each holding the next one: ``stage_task`` (the stream's stages, one
``step_of`` each), or ``plain_task`` where the stream runs one plain stage of a
framework that never copies by its contract (``Chain._run_one`` written out, with the
stage's call, hop and time one call into the core: ``call_stage``; the compiled core
runs that task's taken path itself, with no Python frame: ``_core.plain_task``,
exchange/native/stagetask.c). ``first_of`` queues
a batch on the first stream. A task hands the batch on with ``poster(stream)``'s
``put``, one call into the host stream's queue; where that refuses (a closed stream),
the stream's ``post_in`` says why. Everything a task reads is bound when it is made:
on the stages' own threads every frame, lookup and object made costs about twice what
it does inline.

An error (a stage's, or the next stream refusing the batch) goes on the batch, which
runs no further stage and drops its intermediates there (their release is
stream-ordered); the task then releases the batch's ``done`` lock, as it does when the
batch has left its last stage.
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any, Callable, NoReturn

from . import _core
from .chain_errors import _output_error, _stage_failed, _take_failed

if TYPE_CHECKING:
    from .chain import _Plan, _Slot

__all__ = ["poster", "plain_task", "stage_task", "step_of", "first_of", "refused_with_reason"]

_GROUPS = (dict, tuple, list)  # a stage's outputs as a group (Chain._outputs takes them)


def poster(stream: Any) -> tuple[Callable[..., bool], Callable[..., None] | None]:
    """How a pipelined run queues ``fn(*args)`` on ``stream`` in a context of its own:
    ``(put, refused)``. ``put(context, fn, *args) -> bool`` is the host stream's
    ``poster()`` (one call into its queue: no Future or frame, which cost more than the
    hand-off itself), False when the stream refuses (closed); ``refused(context, fn,
    *args)``, its ``post_in``, then raises why. A stream with no ``poster`` gets the work
    through its ``submit`` (in a copy of the context it is called in). The functions
    queued handle their own errors (the tasks made here put them on the batch)."""
    made = getattr(stream, "poster", None)
    if made is not None:
        return made(), stream.post_in
    submit = stream.submit

    def put(context: Any, fn: Callable[..., Any], *args: Any) -> bool:
        submit(fn, *args)
        return True

    return put, None


# What plain_task's fail() does with an error, by the step that raised it: the take, the
# stage's call and the give name the stage (StageError, or the output that could not be
# taken); anything else goes on the batch as it is.
_TAKE, _CALL, _GIVE, _AS_IS = 0, 1, 2, 3


def plain_task(plan: _Plan, acc: list[float], run_one: Callable[..., None], run_stage: Callable[..., None],
               outputs: Callable[..., tuple[str, Any]], then: Callable[[_Slot], None] | None,
               post: Callable[..., bool] | None, refused: Callable[..., None] | None,
               slot_type: type) -> Callable[[_Slot], None]:
    """The task of a stream that runs one plain stage of a framework that never copies by
    its contract (``_Plan.plain``, no ``ptr``: NumPy), as ``stage_task`` would make it
    with ``Chain._run_one`` written out in it and what it reads bound: taken while the
    batch is one tensor whose producer's pointer is not to be compared, else it calls
    ``run_one``/``run_stage``; ``outputs``: ``Chain._outputs``, for a stage that returns
    a tuple or dict. This runs on the stage's worker per batch, where every frame and
    lookup costs about twice what it does inline: the core's ``plain_task`` runs the
    taken path of a ``slot_type`` batch with no Python frame (the compiled core; the pure
    twin gives back this function's task as it is), and ``fail``, ``regroup`` and
    ``refuse`` below are what both call where the batch leaves that path."""
    take, fn, give, index, last = plan.take, plan.fn, plan.give, plan.index, plan.last
    shared_in, shared_out = plan.shared_in, plan.shared_out
    call_stage = _core.call_stage
    context = contextvars.copy_context()

    def fail(slot: _Slot, step: int, exc: BaseException, raw: Any) -> None:
        """The batch ends with ``exc`` (as ``raise ... from exc`` would wrap it, for the
        take, the call and the give); it runs no further stage, and is done."""
        if step != _AS_IS and isinstance(exc, Exception):
            try:
                wrapped = (_take_failed(plan, exc) if step == _TAKE else _stage_failed(plan, exc) if step == _CALL
                           else _output_error(plan, raw, None, [raw], exc))
            except BaseException as again:
                # The message could not be made (an error whose str() raises, an output
                # whose __dlpack__ lookup raises): that error ends the batch, as it would
                # inline. Raised out of here, it would leave the batch never done and
                # its run waiting for ever. Its context is set here because the compiled
                # task calls fail() with no exception being handled.
                if again.__context__ is None and again is not exc:
                    again.__context__ = exc
                exc = again
            else:
                wrapped.__cause__ = wrapped.__context__ = exc
                exc = wrapped
        slot.error, slot.values = exc, None
        slot.done.release()

    def regroup(slot: _Slot, raw: Any) -> None:
        """A stage that returned a tuple, list or dict: its outputs taken as a group."""
        slot.kind, slot.values = outputs(plan, raw, slot)

    def refuse(slot: _Slot) -> NoReturn:
        refused_with_reason(refused, context, then, slot)  # type: ignore[arg-type]

    # The tail below (hand-off, done) is stage_task's, written out here rather than shared:
    # a shared helper would be one more frame per stage and batch on this thread (an
    # error, off that path, goes to fail()).
    def plain_task(slot: _Slot) -> None:
        step, raw = _AS_IS, None
        try:
            if slot.kind != "one" or slot.ptrs is not None:
                run_one(plan, slot, acc) if slot.kind == "one" else run_stage(plan, slot, acc)
            else:
                t = slot.values[0]
                step = _TAKE
                a = take(t)
                step = _CALL  # the hop noted, fn(a) called and timed: one call into the core
                raw = call_stage(fn, a, t, slot.hops, shared_in, acc, index)
                # Nothing of the batch stays in this frame once it is handed on or done:
                # the run may have returned (its intermediates released) while this
                # worker is still leaving the frame.
                del a, t
                # isinstance may raise (an output whose __class__ raises): not the stage's
                # call failing, so not wrapped as its StageError (inline it is not either)
                step = _AS_IS
                if isinstance(raw, _GROUPS):
                    regroup(slot, raw)
                else:
                    step = _GIVE
                    out = give(raw)
                    step = _AS_IS
                    slot.values[0] = out  # the slot's own list (no new one per hop)
                    if last:  # _hops_out's shared hop: no producer's pointer to compare
                        slot.hops.append((shared_out, out._nbytes))  # type: ignore[union-attr]
                    del out
                raw = None
            if then is not None:
                if not post(context, then, slot):  # type: ignore[misc]
                    refuse(slot)
                return
        except BaseException as exc:
            fail(slot, step, exc, raw)
            return
        slot.done.release()

    return _core.plain_task(slot_type, take, fn, give, shared_in, shared_out if last else None, acc, index, then,
                            post, context, plain_task, fail, regroup, refuse)


def step_of(plan: _Plan, acc: list[float], run_one: Callable[..., None],
            run_stage: Callable[..., None]) -> Callable[[_Slot], None]:
    """``step(slot)``: stage ``plan`` on one batch in a pipelined run, its milliseconds
    into ``acc``."""
    def step(slot: _Slot) -> None:
        if plan.plain and slot.kind == "one":
            run_one(plan, slot, acc)
        else:
            run_stage(plan, slot, acc)
    return step


def stage_task(steps: list[Callable[[_Slot], None]], then: Callable[[_Slot], None] | None,
               post: Callable[..., bool] | None, refused: Callable[..., None] | None) -> Callable[[_Slot], None]:
    """One stream's task in a pipelined run (``Chain._stage_tasks``): its stages'
    ``steps`` on the batch, then ``then(slot)`` queued with ``post`` on the next stream
    in a copy of this thread's context, made now (``then`` None: the batch is done;
    ``post`` refusing: ``refused`` raises why)."""
    context = contextvars.copy_context()

    def task(slot: _Slot) -> None:
        try:
            for step in steps:
                step(slot)
            if then is not None:
                if not post(context, then, slot):  # type: ignore[misc]
                    refused_with_reason(refused, context, then, slot)
                return
        except BaseException as exc:
            slot.error, slot.values = exc, None
        slot.done.release()

    return task


def refused_with_reason(refused: Callable[..., None] | None, context: Any, fn: Callable[..., Any],
                        slot: _Slot) -> NoReturn:
    """A stream refused a batch's task: raise why (``refused``, its ``post_in``, says),
    also where it says nothing (a host stream closed by the exit hook drops work
    quietly): the batch must end with an error, never wait for a task that will not run."""
    if refused is not None:
        refused(context, fn, slot)
    raise RuntimeError("a host stream of this chain refused a batch: it was closed (by the exit hook, at "
                       "interpreter exit)")


def first_of(put: Callable[..., bool], refused: Callable[..., None] | None, context: Any,
             task: Callable[[_Slot], None]) -> Callable[[_Slot], None]:
    """``first(slot)``: a batch queued on the first stage's stream, in ``context``;
    raises why the stream refuses it."""
    def first(slot: _Slot) -> None:
        if not put(context, task, slot):
            refused_with_reason(refused, context, task, slot)
    return first
