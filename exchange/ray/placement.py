"""Where a Ray chain's stages run: the device a stage's actor uses and whether that is
device memory (asked of the backend, never by device name), the Ray node of this
process, and the resources an actor asks for against what the cluster has (the reason
an actor does not start).
"""

from __future__ import annotations

from typing import Any

from ..chain import Stage
from ..device import Device


def stage_device(stage: Stage, device: Device) -> Device:
    return stage.device or device


def on_device_memory(stage: Stage, device: Device) -> bool:
    """True where ``stage`` runs on memory the host cannot read in place (a GPU's), as
    its backend declared (``exchange.devices.base.MemoryKind``); ``device``: the
    chain's default. Such a stage asks its actor for a share of a GPU and hands its
    tensors over Ray Direct Transport."""
    from exchange.devices.base import memory_kind

    kind = memory_kind(stage_device(stage, device).type)
    return kind is not None and not kind.host_readable


#: Ray's actor options -> the resource names the cluster counts them in.
_RESOURCE_OPTIONS = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}


def _node_id() -> str:
    """This process's Ray node (hex), "" where Ray cannot say."""
    import ray

    try:
        return str(ray.get_runtime_context().get_node_id() or "")
    except Exception:
        return ""


def _asked(options: dict[str, Any]) -> dict[str, float]:
    """The resources an actor with Ray ``options`` asks for, by the cluster's names."""
    asked = {name: float(options[key]) for key, name in _RESOURCE_OPTIONS.items() if options.get(key)}
    asked.update({str(k): float(v) for k, v in (options.get("resources") or {}).items()})
    return asked


def _lacking(ray: Any, options: dict[str, Any]) -> bool:
    """True when the whole cluster has less of a resource than ``options`` ask for."""
    asked = _asked(options)
    if not asked:
        return False
    try:
        total = ray.cluster_resources()
    except Exception:  # the cluster did not answer: the usual wait, and the error says so
        return False
    return any(total.get(k, 0.0) < v for k, v in asked.items())


def _resources_missing(ray: Any, options: dict[str, Any]) -> str:
    """Why an actor with ``options`` may not start: each resource it asks for that the
    cluster lacks in all (``ray.cluster_resources()``) or has but is using
    (``ray.available_resources()``), or that nothing it asks for is short."""
    asked = _asked(options)
    try:
        total, free = ray.cluster_resources(), ray.available_resources()
    except Exception as exc:  # the cluster did not answer: say what was asked
        return f"it asks for {_amounts(asked) or 'no resources'} (the cluster's resources unknown: {exc})"
    lacking = {k: v for k, v in asked.items() if total.get(k, 0.0) < v}
    if lacking:
        return (f"it asks for {_amounts(lacking)}, more than the whole cluster has "
                f"({_amounts({k: total.get(k, 0.0) for k in lacking})}; all it has: {_amounts(total)})")
    busy = {k: v for k, v in asked.items() if free.get(k, 0.0) < v}
    if busy:
        return (f"it asks for {_amounts(busy)}, which the cluster has but other actors or tasks hold "
                f"(free now: {_amounts({k: free.get(k, 0.0) for k in busy})})")
    return f"it asks for {_amounts(asked) or 'no resources'}, which the cluster has free; Ray is slow to start it"


def _amounts(resources: dict[str, float]) -> str:
    """``{"GPU": 1.0, "memory": 2e9}`` as ``GPU 1, memory 2 GB``; Ray's own ``node:`` labels left out."""
    parts = []
    for name, value in sorted(resources.items()):
        if name.startswith("node:"):
            continue
        parts.append(f"{name} {value / 1e9:.3g} GB" if name.endswith("memory") else f"{name} {value:g}")
    return ", ".join(parts)
