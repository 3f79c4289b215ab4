"""Plan at full scale in one process: the wrap plan and the memory estimate, nothing allocated.

``fsdp-conformance plan`` answers "what does this policy do to my real model, and how many
devices of this size does it need?" before anyone books GPUs:

* **The plan**: the model is built on ``meta`` and the policy's units are computed with
  :func:`~fsdp_conformance.models.units.plan_units` (torch's own FSDP1 auto-wrap decisions, no
  process group).
* **The estimate**: the documented per-layer bound of :mod:`~fsdp_conformance.measure.bound`
  (:func:`~fsdp_conformance.measure.bound.per_layer_bound`, term by term, docs/memory.md), with the
  activations profiled by a forward on meta
  (:func:`~fsdp_conformance.measure.profile.profile_activations`). There is no second formula here:
  this package only chooses the inputs (policy, dtypes, optimizer, batch) and searches world sizes.
* **The cross-check**: FSDP2 applied for real to the meta model on a fake process group of the
  requested world size (``fully_shard`` per unit, then the root), reading each unit's actual
  local shard on rank 0 and comparing it with the analytic ``ceil(dim0 / W)`` padding.
* **Trust** (:mod:`fsdp_conformance.claims.memory.plan_estimate_matches`): the estimate
  against measured peaks of real training steps at small scale (the memory checks'
  :func:`~fsdp_conformance.measure.step.measure_step`), on every rank, fp32 and bf16; part of
  ``fsdp-conformance run`` (``memory.plan_estimate_matches``).

Modules, each importing only those before it: :mod:`.model` (settings, the model on meta,
:class:`~.model.PlanError`), :mod:`.estimate` (units, activations, the bound per world size,
devices needed), :mod:`.verify` (the FSDP2 cross-check), :mod:`.report` (tables and JSON).
docs/planning.md has the defaults, the 70B tables and the benchmark.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fsdp_conformance.plan.estimate import (
    CLAIM_WORLD_SIZES,
    DEFAULT_RESERVE,
    MAX_WORLD_SIZE,
    DeviceReserve,
    compare_policies,
    plan_model,
)
from fsdp_conformance.plan.model import ModelChoice, PlanSettings, build_meta_model
from fsdp_conformance.plan.report import format_comparison, format_plan, plan_report
from fsdp_conformance.plan.verify import verify_fsdp2_shards


def plan_command(
    choice: ModelChoice,
    settings: PlanSettings,
    world_size: int,
    devices: Sequence[int],
    *,
    verify: bool = True,
    compare: bool = False,
    world_sizes: Sequence[int] = CLAIM_WORLD_SIZES,
    max_world_size: int = MAX_WORLD_SIZE,
    full_tree: bool = False,
    reserve: DeviceReserve = DEFAULT_RESERVE,
) -> tuple[str, dict[str, Any]]:
    """What ``fsdp-conformance plan`` prints: (text for people, data for tools: the ``--json``).

    ``compare``: the policies side by side at ``world_sizes``; otherwise the plan at
    ``world_size``, with the FSDP2 cross-check when ``verify`` and the version is fsdp2.
    """
    if compare:
        data = compare_policies(
            choice, settings, world_sizes, devices, max_world_size=max_world_size, reserve=reserve
        )
        return format_comparison(data), data
    model = build_meta_model(choice)
    plan = plan_model(choice, settings, model)
    verification = None
    if verify and settings.version == "fsdp2":
        verification = verify_fsdp2_shards(plan, world_size, model)
    report = plan_report(plan, world_size, devices, verification, max_world_size, reserve)
    return format_plan(plan, report, collapse=not full_tree), report
