"""A chain's hops: a batch's tensors into the chain and the reports of each hop.

Owns: taking a batch's input as a tx Tensor (``_take_one``), the hop reports a run makes
(``_hops_in`` for the hops into a stage, ``_hops_out`` for the last stage's hops into tx,
``_hop`` and ``_not_shared_because`` for one hop and why it is not shared, ``hop_dicts``
for a batch's report as the dicts ``ChainResult`` gives), and the check that a stage
with output buffers wrote into them (``_check_out``).

While a batch runs, a shared hop is kept as ``(template, bytes)``: its plan's template
dict and its size. The dict is made once the run is over (``hop_dicts``), off the path
a batch takes from stage to stage, where every object made costs the more when the
stages run on threads of their own (pipelined). ``Chain``
(exchange/chain.py) calls them per batch; what a hop report holds is ``ChainResult``'s
docstring there. The copies a chain makes, or strict refuses: exchange/chain_copies.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .tensor import Tensor, from_dlpack, record_stream

if TYPE_CHECKING:
    from .chain import _Plan, _Slot


def hop_dict(hop: Any) -> dict[str, Any]:
    """One entry of a batch's hops as its dict (a new one for a compact shared hop)."""
    if type(hop) is tuple:
        made = hop[0].copy()
        made["bytes"] = hop[1]
        return made
    return hop


def hop_dicts(hops: list[Any]) -> list[dict[str, Any]]:
    """A batch's hops with every compact entry made its dict, in place; returns ``hops``."""
    for i, hop in enumerate(hops):
        if type(hop) is tuple:
            hops[i] = hop_dict(hop)
    return hops


def _hops_in(plan: _Plan, slot: _Slot, tensors: list[Tensor], arrays: list[Any],
             reasons: list[str | None] | None) -> None:
    """The hops into ``plan``'s stage, one per input, on ``slot.hops``: a shared one is a
    copy of the plan's template with its bytes; why one is not is worked out only then."""
    hops, ptr, ptrs = slot.hops, plan.ptr, slot.ptrs
    for i, t in enumerate(tensors):
        p = t.data_ptr
        consumer = p if ptr is None else ptr(arrays[i])
        producer = None if ptrs is None else ptrs[i]
        reason = None if reasons is None else reasons[i]
        if consumer == p and (producer is None or producer == p) and reason is None:
            hops.append((plan.shared_in, t._nbytes))  # type: ignore[union-attr]
        else:
            hops.append(_hop(plan.before, plan.framework, t, consumer, producer, reason))  # type: ignore[union-attr]


def _hops_out(plan: _Plan, slot: _Slot, outs: list[Tensor]) -> None:
    """The last stage's hops into tx: its outputs as tx Tensors."""
    hops, ptrs = slot.hops, slot.ptrs
    for i, t in enumerate(outs):
        if ptrs is None or ptrs[i] == t.data_ptr:  # None: no producer's pointer to compare
            hops.append((plan.shared_out, t._nbytes))  # type: ignore[union-attr]
        else:
            hops.append(_hop(plan.framework, "tx", t, ptrs[i]))  # type: ignore[union-attr]


def _check_out(plan: _Plan, keys: list[Any] | None, values: list[Any]) -> list[Tensor]:
    """A stage with output buffers: its outputs must be those buffers (ValueError)."""
    stage, adapter, stream = plan.stage, plan.adapter, plan.stream
    out = stage.out or []
    if len(values) != len(out):
        raise ValueError(f"stage {stage.name!r} returned {len(values)} outputs for {len(out)} out buffers")
    for i, (value, buf) in enumerate(zip(values, out)):
        if value is not buf and adapter.data_ptr(value) != buf.data_ptr:
            key = keys[i] if keys else i
            raise ValueError(f"stage {stage.name!r} did not write into the out buffer given for output {key!r}")
        if stream is not None:
            record_stream(buf, stream)
    return list(out)


def _take_one(x: Any, stream: Any) -> Tensor:
    if isinstance(x, Tensor):
        return x
    return from_dlpack(x, stream=stream)


def _hop(src: str, dst: str, t: Tensor, ptr: int | None, producer_ptr: int | None = None,
         reason: str | None = None) -> dict[str, Any]:
    shared = (reason is None and ptr is not None and ptr == t.data_ptr
              and (producer_ptr is None or producer_ptr == t.data_ptr))
    hop = {"from": src, "to": dst, "bytes": t.nbytes, "shared": shared, "transport": "in-process"}
    if not shared:
        hop["reason"] = reason or _not_shared_because(src, dst, t, ptr, producer_ptr)
    return hop


def _not_shared_because(src: str, dst: str, t: Tensor, ptr: int | None, producer_ptr: int | None) -> str:
    if producer_ptr is not None and producer_ptr != t.data_ptr:
        return f"the output of {src} was copied on its way into tx"
    if ptr is None:
        return f"{dst} does not say where its data is, so sharing cannot be checked"
    return f"{dst} copied the data when it took it"
