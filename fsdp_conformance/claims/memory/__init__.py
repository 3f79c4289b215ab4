"""Memory conformance: peak within the per-layer bound, the sawtooth, depth invariance, meters,
the mixed-precision peak, and the planner's estimate against measured peaks.

The claim only: one module per check family (rank function, verdict, what they share in
:mod:`~fsdp_conformance.claims.memory.common`) and ``CHECKS`` here. Its building blocks are
modules of their own, shared with init's peak check and the planner:

* **The bound** (:mod:`~fsdp_conformance.measure.bound`):
:func:`~fsdp_conformance.measure.bound.per_layer_bound`,
  a pure function of a unit plan and a :class:`~fsdp_conformance.measure.bound.StepConfig`;
  docs/memory.md derives every term. :mod:`~fsdp_conformance.measure.profile` gets its inputs from a
  model on meta.
* **Measurement** (:mod:`~fsdp_conformance.measure.meters`,
:mod:`~fsdp_conformance.measure.timeline`,
  :mod:`~fsdp_conformance.measure.step`): torch's trackers, the OS high-water mark as ground truth,
  the CUDA allocator on GPU, a timeline sampled at every unit's hooks, and one measured step.
* **Checks** (``CHECKS``): peak within the bound on every rank, the sawtooth, depth invariance,
  the meter's agreement with ground truth, the bf16 peak under the bound of the observed dtypes,
  and the planning estimate against measured peaks. Each fails on its negative controls
  (:data:`~fsdp_conformance.claims.memory.common.FAULTS`: the seeds' naive wrappings, a
  per-layer wrapping that never reshards, a tracker entered too late).
"""

from __future__ import annotations

from fsdp_conformance.claims.check import Check, variants
from fsdp_conformance.claims.memory.common import DEFAULT_SPEC
from fsdp_conformance.claims.memory.depth_invariance import (
    rank_depth_invariance,
    verdict_depth_invariance,
)
from fsdp_conformance.claims.memory.meter_agrees import rank_meter_agrees, verdict_meter_agrees
from fsdp_conformance.claims.memory.mixed_precision_peak import (
    rank_mixed_precision_peak,
    verdict_mixed_precision_peak,
)
from fsdp_conformance.claims.memory.peak_within_bound import (
    rank_peak_within_bound,
    verdict_peak_within_bound,
)
from fsdp_conformance.claims.memory.plan_estimate_matches import (
    TRUST_SPEC,
    rank_plan_estimate_matches,
    verdict_plan_estimate_matches,
)
from fsdp_conformance.claims.memory.sawtooth import rank_sawtooth, verdict_sawtooth
from fsdp_conformance.measure.meters import MALLOC_ENV

#: Each check once per FSDP version on its reference model, in report order.
CHECKS: tuple[Check, ...] = (
    variants(
        "memory.peak_within_bound",
        "per-layer wrapping: every rank's peak at or under the term-by-term per-layer bound",
        rank_peak_within_bound,
        verdict_peak_within_bound,
        specs=(DEFAULT_SPEC,),
    )
    + variants(
        "memory.sawtooth",
        "the timeline rises by about one unit at each gather and falls back at each release",
        rank_sawtooth,
        verdict_sawtooth,
        specs=(DEFAULT_SPEC,),
        # Monolithic wrapping measured too, for the picture (reference models only).
        compare_with="monolithic",
    )
    + variants(
        "memory.depth_invariance",
        "more layers add only sharded state per rank (per-layer); monolithic adds the full layers",
        rank_depth_invariance,
        verdict_depth_invariance,
        specs=(DEFAULT_SPEC,),
    )
    + variants(
        "memory.meter_agrees",
        "torch's tracker agrees with ground truth (OS high-water mark / CUDA allocator) on a step",
        rank_meter_agrees,
        verdict_meter_agrees,
        specs=(DEFAULT_SPEC,),
        # The OS figure is valid only with the allocator setting: fresh ranks with it.
        env=MALLOC_ENV,
    )
    + variants(
        "memory.mixed_precision_peak",
        "bf16 param_dtype (reduce dtype unset, and fp32): every rank's peak at or under the "
        "per-layer bound of the dtypes its collectives were observed to have",
        rank_mixed_precision_peak,
        verdict_mixed_precision_peak,
        specs=(DEFAULT_SPEC,),
    )
    + variants(
        "memory.plan_estimate_matches",
        "the planning estimate (per-layer bound on meta) against every rank's measured peak of "
        "a real step: at most 10% above it, and not too loose",
        rank_plan_estimate_matches,
        verdict_plan_estimate_matches,
        specs=(TRUST_SPEC,),
        # The CUDA allocator adds cuBLAS workspaces and block rounding, which the estimate
        # does not model; at the small sizes this check runs they would dominate.
        lanes=("cpu",),
    )
)

__all__ = ["CHECKS"]
