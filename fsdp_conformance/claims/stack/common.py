"""What the stack families share: the model built once and a copy sharded as the user's setup
does, its reference, the batches, and the parity lines of a trained setting.

Each family trains :data:`STEPS` plain SGD steps (:data:`LR`) on both sides and compares every
update with :func:`~fsdp_conformance.fsdp.reference_step.observe_update` (both sides starting each
step from the same parameters), with the loop claim's tolerances
(``reference_step.UPDATE_RTOL`` / ``LOSS_RTOL``).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fsdp_conformance.fsdp.collectives import CollectiveRecorder
from fsdp_conformance.fsdp.determinism import disable_dropout, require_deterministic
from fsdp_conformance.fsdp.reference_step import (
    LOSS_RTOL,
    UPDATE_RTOL,
    SliceReference,
    TensorComparison,
    loss_problems,
    micro_batches,
    parameter_dtype,
    update_problems,
)
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models.model_spec import BuiltModel, ModelSpec

#: SGD steps per setting, each on its own micro-batch; the learning rate (an update ~1e-2 of the
#: parameters: well above their rounding).
STEPS = 2
LR = 0.1
#: Each rank's rows per step.
PER_RANK = 2


@dataclasses.dataclass
class Side:
    """A sharded model and its single-process reference, with the batches of its steps."""

    sharded: nn.Module
    reference: SliceReference
    #: ``[step][rank]``: each step's slices (the same on every rank).
    batches: list[list[Any]]
    #: The dtype both sides run in (the model's own).
    dtype: torch.dtype


def build_side(
    ctx: RankContext,
    spec: ModelSpec,
    shard_fn: Callable[[nn.Module, Any], nn.Module],
    steps: int = STEPS,
) -> Side:
    """``spec``'s model from seed 0 with dropout off, the batches of ``steps`` steps; a copy
    sharded by ``shard_fn(copy,
    policy)`` (the recommended policy built on the copy: a policy is bound to the modules it
    was built on, ties included); the original is the reference. A model not in fp32 / fp64,
    or whose forward still draws random numbers, skips on every rank, naming why."""
    torch.manual_seed(0)
    built = spec.instantiate(ctx.device)
    model = built.model
    dropout = disable_dropout(model)
    dtype = parameter_dtype(model, "stack checks")
    batch = built.batch(steps * ctx.world_size * PER_RANK, ctx.device)
    require_deterministic(model, batch, dropout, "a sharded step")
    twin = copy.deepcopy(model)
    sharded = shard_fn(twin, BuiltModel(spec, twin).policy("recommended"))
    batches = micro_batches(batch, steps, ctx.world_size, PER_RANK)
    return Side(sharded, SliceReference(model, ctx.world_size), batches, dtype)


def per_unit(recorder: CollectiveRecorder, phase: str) -> dict[str, dict[str, int]]:
    """Per collective kind, the records of ``phase`` per unit name (``a|b``: equal sizes)."""
    out: dict[str, collections.Counter[str]] = {}
    for r in recorder.records:
        if r["phase"] == phase:
            out.setdefault(r["op"], collections.Counter())[r["unit"]] += 1
    return {op: dict(counts) for op, counts in out.items()}


def parity_problems(
    label: str,
    losses: Sequence[float],
    ref_losses: Sequence[float],
    steps: Sequence[TensorComparison],
    dtype: torch.dtype,
) -> list[str]:
    """A rank's losses and each step's update against the reference's, beyond the tolerances
    of ``dtype``, one line each."""
    return loss_problems(label, losses, ref_losses, LOSS_RTOL[dtype]) + update_problems(
        label, steps, UPDATE_RTOL[dtype]
    )
