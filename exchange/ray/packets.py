"""A batch as it travels between a Ray chain's actors (``_Packet``), and the hops it
reports: which transport carried each tensor, and whether any copy was made on the way
(``exchange.ray.executor``'s module docstring says what each field means).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..tensor import Tensor, from_dlpack


@dataclasses.dataclass
class _Packet:
    """One batch between actors: its tensors (``values``; ``names`` for a dict batch),
    what the producer side said of each (``pending``: from, shared, reason), the hops so
    far, and each stage's milliseconds and peak live bytes for this batch."""

    kind: str
    names: list[str] | None
    values: list[Any]
    pending: list[dict[str, Any]]
    hops: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    ms: dict[str, float] = dataclasses.field(default_factory=dict)
    peaks: dict[str, int] = dataclasses.field(default_factory=dict)
    node: str = ""  # the Ray node its values were made on ("": not known)
    trace_batch: int = -1  # its number in the driver's tx.trace (-1: no trace records)
    hop_stages: list[int] = dataclasses.field(default_factory=list)  # the stage each of ``hops`` went into

    def batch(self) -> Any:
        return _batch_of(self.kind, self.names, self.values)

    outputs = batch


def _batch_of(kind: str, names: list[str] | None, values: list[Any]) -> Any:
    """The batch a stage gets: one tensor, a tuple or a dict of them."""
    if kind == "dict":
        return dict(zip(names or [], values))
    if kind == "tuple":
        return tuple(values)
    return values[0]


def _parts_of(batch: Any) -> tuple[str, list[str] | None, list[Any]]:
    """A batch's form, its names (for a dict) and its values: :func:`_batch_of` undone."""
    if isinstance(batch, dict):
        return "dict", list(batch), list(batch.values())
    if isinstance(batch, (tuple, list)):
        return "tuple", None, list(batch)
    return "one", None, [batch]


def _packet_of(batch: Any) -> _Packet:
    """The driver's packet for one input batch: arrays taken as tx Tensors (zero-copy)."""
    kind, names, values = _parts_of(batch)
    tensors = [v if isinstance(v, Tensor) else from_dlpack(v) for v in values]
    return _Packet(kind, names, tensors, [{"from": "input", "shared": True, "reason": None} for _ in tensors])


def _transport_hop(src: str, dst: str, t: Any, before: dict[str, Any], after: dict[str, Any] | None,
                   nodes: tuple[str, str] = ("", "")) -> dict[str, Any]:
    """One hop across processes: the producer side (``before``), the transport (noted on
    ``t``'s record), and the consumer side (``after``: the in-actor chain's hop; None
    for the driver, which takes the tx Tensor as it came). ``nodes``: the Ray nodes of
    the producer and the consumer; when both are known and differ, the hop crossed
    nodes: Ray copied the object from one node's store to the other's."""
    from .objects import transport, transport_reason

    return _hop(src, dst, int(t.nbytes), transport(t), transport_reason(t), before["shared"], before.get("reason"),
                after, nodes)


def _hop(src: str, dst: str, nbytes: int, how: str, why: str | None, shared_out: bool, reason_out: str | None,
         after: dict[str, Any] | None, nodes: tuple[str, str]) -> dict[str, Any]:
    """:func:`_transport_hop` from what was said of the tensor: its size, its transport
    and the transport's reason to copy, and whether the producer's output left shared."""
    reasons = []
    if nodes[0] and nodes[1] and nodes[0] != nodes[1]:
        where = "object store" if how == "ray-object-store" else "memory"
        reasons.append(f"crossed nodes: Ray copied it from node {nodes[0][:8]}'s {where} to "
                       f"node {nodes[1][:8]}'s")
    if not shared_out:
        reasons.append(reason_out or f"{src}'s output was copied on its way out")
    if how == "host-copy":
        reasons.append(f"copied through host memory by the transport{f' ({why})' if why else ''}")
    elif why:  # a transport that copied says why (exchange.ray.objects.set_transport)
        reasons.append(f"{how}: {why}")
    if after is not None and not after["shared"]:
        reasons.append(after.get("reason") or f"{dst} copied the data when it took it")
    hop = {"from": src, "to": dst, "bytes": nbytes, "shared": not reasons, "transport": how}
    if nodes[0] and nodes[1]:
        hop["nodes"] = [nodes[0][:8], nodes[1][:8]]
    if reasons:
        hop["reason"] = "; ".join(reasons)
    return hop
