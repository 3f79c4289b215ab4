"""The timeline: memory sampled at every FSDP unit's forward and backward hooks."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from fsdp_conformance._compat import tree_leaves
from fsdp_conformance.measure.meters import Meter

#: Phases in the order a unit goes through them. ``gather``/``release`` samples are taken just
#: before FSDP's own pre-/post-forward hooks and ``forward``/``forward_done`` just after, so a
#: unit's gather is the difference between ``pre_forward`` and ``forward``.
PHASES = ("pre_forward", "forward", "forward_done", "post_forward", "pre_backward", "post_backward")


@dataclasses.dataclass
class Timeline:
    """Memory samples ``(unit, phase, bytes)`` in the order the hooks fired during one step."""

    events: list[tuple[str, str, int]] = dataclasses.field(default_factory=list)

    def to_data(self) -> list[dict[str, Any]]:
        return [
            {"i": i, "unit": u, "phase": p, "bytes": b} for i, (u, p, b) in enumerate(self.events)
        ]


def _units_with_modules(model: torch.nn.Module) -> list[tuple[str, Any, Any]]:
    """(fqn, outer, inner) per FSDP unit: FSDP1's wrapper and wrapped module; FSDP2's module."""

    from fsdp_conformance import _compat
    from fsdp_conformance.models.units import clean_fqn

    fsdp2 = _compat.fsdp_module_cls()
    found = []
    for name, m in model.named_modules():
        if isinstance(m, FSDP):
            found.append((clean_fqn(name), m, m.module))
        elif isinstance(m, fsdp2):
            found.append((name, m, m))
    return found


@contextlib.contextmanager
def record_timeline(model: torch.nn.Module, meter: Meter) -> Iterator[Timeline]:
    """Sample ``meter.current()`` at every unit's forward and backward hooks while inside."""

    timeline = Timeline()
    handles: list[Any] = []

    def sample(unit: str, phase: str) -> None:
        timeline.events.append((unit, phase, meter.current()))

    def tensors(obj: Any) -> list[Any]:
        return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor) and t.requires_grad]

    for fqn, outer, inner in _units_with_modules(model):
        same = outer is inner

        def pre_forward(_m: Any, _a: Any, fqn: str = fqn) -> None:
            sample(fqn, "pre_forward")

        def forward(_m: Any, args: Any, fqn: str = fqn) -> None:
            sample(fqn, "forward")
            inputs = tensors(args)
            if inputs:  # fires once the gradients w.r.t. the unit's inputs exist
                torch.autograd.graph.register_multi_grad_hook(
                    inputs, lambda _g, fqn=fqn: sample(fqn, "post_backward"), mode="any"
                )

        def forward_done(_m: Any, _a: Any, _o: Any, fqn: str = fqn) -> None:
            sample(fqn, "forward_done")

        def post_forward(_m: Any, _a: Any, out: Any, fqn: str = fqn) -> None:
            sample(fqn, "post_forward")
            outputs = tensors(out)
            if outputs:  # registered after FSDP's own: fires once the unit is gathered again
                torch.autograd.graph.register_multi_grad_hook(
                    outputs, lambda _g, fqn=fqn: sample(fqn, "pre_backward"), mode="any"
                )

        # FSDP2 registers its pre-forward with prepend=True and its post-forward appended;
        # FSDP1 works inside the wrapper's forward. Either way these land on the right side.
        handles.append(outer.register_forward_pre_hook(pre_forward, prepend=True))
        handles.append(inner.register_forward_pre_hook(forward))
        handles.append(inner.register_forward_hook(forward_done, prepend=same))
        handles.append(outer.register_forward_hook(post_forward))
    try:
        yield timeline
    finally:
        for h in handles:
            h.remove()
