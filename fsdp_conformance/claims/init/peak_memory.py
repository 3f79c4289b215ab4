"""``init.peak_memory``: peak memory while building on meta, sharding and materializing stays
within this rank's shards plus one unit (plus FSDP1's flat copy of it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.init.common import (
    FAULTS,
    Failure,
    failed_on_ranks,
    model_level,
    preflight,
    preflight_failure,
)
from fsdp_conformance.fsdp.meta_init import build_on_meta
from fsdp_conformance.fsdp.meta_materialize import materialize
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.measure.bound import init_peak_bound
from fsdp_conformance.measure.meters import host_or_cuda_peak
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.policies import PolicyName
from fsdp_conformance.models.reference_models import ModelConfig
from fsdp_conformance.models.units import plan_units
from fsdp_conformance.sizes import MiB

#: Peak while materializing: tolerance on the bound (allocator rounding, gloo and Python
#: objects; peaks vary up to ~8% run to run: docs/memory.md, "Facts about measuring memory on
#: CPU").
PEAK_TOLERANCE_FRACTION = 0.10
PEAK_TOLERANCE_FIXED_MIB = 4.0

#: Large enough (45.5 MiB fp32, 5.1 MiB per block) that the peak bound is meaningful against
#: noise (~1 MiB with MALLOC_MMAP_THRESHOLD_), small enough for a 2-core CPU lane.
MEMORY_SPEC = ModelSpec(reference="massive", config=ModelConfig(num_layers=8, dim=384))


class PeakReport(Failure, total=False):
    """One rank's peak while materializing, with the sizes its bound is made of."""

    version: str
    meter: str
    peak_bytes: int
    kept_bytes: int
    mmap_threshold: str | None
    model_bytes: int
    largest_unit_bytes: int
    largest_param_bytes: int
    sharded_bytes: int


def rank_peak_memory(
    ctx: RankContext,
    spec: ModelSpec = MEMORY_SPEC,
    version: str = "fsdp2",
    seed: int = 0,
    policy: PolicyName = "recommended",
    fault: str | Sequence[str] | None = None,
) -> PeakReport:
    """Peak memory while building on meta, sharding and materializing, against the bound.

    CPU lane: the host's ``VmHWM``, meaningful in fresh rank processes started with
    ``MALLOC_MMAP_THRESHOLD_=65536`` (every large tensor its own mmap, so freed memory leaves
    RSS; docs/memory.md, "Facts about measuring memory on CPU"). GPU lane: the CUDA
    allocator's peak, where the parameters live. ``fault``: a negative control applied to the
    measured materialization (``eager_build``: the model is built with storage first).
    """
    if version == "fsdp1" and model_level(spec):
        skip_rank(
            f"{spec.name} is initialized by a model-level init, which FSDP1 can run only on "
            "the gathered model (summon_full_params: every rank holds the whole model while "
            "it runs), so the per-unit bound does not apply; FSDP2 runs it on the shards "
            "(init.peak_memory on FSDP2 measures that)"
        )
    failed = preflight(spec)
    if failed:
        return preflight_failure(PeakReport, ctx, failed)
    built = build_on_meta(spec)
    meta = built.model
    units = plan_units(meta, built.policy(policy))
    element = next(meta.parameters()).element_size()
    total = sum(p.numel() for p in meta.parameters()) * element
    largest_unit = max(u.numel for u in units) * element
    largest_param = max(p.numel() for p in meta.parameters()) * element
    # Sharded model on this rank: each unit's flat/padded (FSDP1) or per-parameter (FSDP2)
    # shard, rounded up: what the rank keeps after materializing.
    if version == "fsdp1":
        sharded = sum(math.ceil(u.numel / ctx.world_size) for u in units) * element
    else:
        sharded = (
            sum(
                math.ceil(p.shape[0] / ctx.world_size) * (p.numel() // max(p.shape[0], 1))
                if p.dim()
                else p.numel()
                for p in meta.parameters()
            )
            * element
        )
    del meta, built
    # Warm-up on a tiny model: imports, the device mesh, gloo's buffers, the CUDA context and
    # first-call caches are the process's fixed costs, not the model's.
    materialize(
        ctx,
        ModelSpec(reference="massive", config=ModelConfig(num_layers=1, dim=8)),
        version,
        "deterministic",
        seed,
    )
    with FAULTS.inject(fault, ctx), host_or_cuda_peak(ctx) as reading:
        model = materialize(ctx, spec, version, "deterministic", seed, policy=policy)
    del model
    return {
        "rank": ctx.rank,
        "version": version,
        "device_type": ctx.device_type,
        "meter": reading["meter"],
        "peak_bytes": reading["peak"],
        "kept_bytes": reading["kept"],
        "mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "model_bytes": total,
        "largest_unit_bytes": largest_unit,
        "largest_param_bytes": largest_param,
        "sharded_bytes": sharded,
    }


def peak_memory_bound(value: PeakReport) -> tuple[float, str]:
    """The bound term by term (bytes, explanation).

    - the sharded model this rank keeps;
    - one unit's unsharded parameters: FSDP1 materializes a whole unit before sharding it;
      FSDP2 materializes only shards, and our init generates one full *parameter* at a time
      (at most one unit);
    - FSDP1 only: one more unit, the flat parameter FSDP1 concatenates the unit into while the
      materialized originals still exist (then it keeps only the shard);
    - a tolerance of PEAK_TOLERANCE_FRACTION of that plus PEAK_TOLERANCE_FIXED_MIB.
    """
    unit = value["largest_unit_bytes"]
    bound, flatten = init_peak_bound(
        value["sharded_bytes"],
        unit,
        value["version"],
        PEAK_TOLERANCE_FRACTION,
        PEAK_TOLERANCE_FIXED_MIB * MiB,
    )
    terms = (
        f"sharded {value['sharded_bytes'] / MiB:.1f} + unit {unit / MiB:.1f}"
        + (f" + flat copy {flatten / MiB:.1f}" if flatten else "")
        + f" MiB, +{PEAK_TOLERANCE_FRACTION:.0%} +{PEAK_TOLERANCE_FIXED_MIB:.0f} MiB"
    )
    return bound, terms


def verdict_peak_memory(values: Sequence[PeakReport], params: Mapping[str, Any]) -> Verdict:
    failed = failed_on_ranks(values)
    if failed:
        return failed
    rows, over = [], []
    for v in values:
        bound, terms = peak_memory_bound(v)
        rows.append(
            f"rank {v['rank']}: peak {v['peak_bytes'] / MiB:.1f} MiB ({v['meter']}), "
            f"bound {bound / MiB:.1f} MiB ({terms}), full model {v['model_bytes'] / MiB:.1f} MiB"
        )
        if v["peak_bytes"] > bound:
            over.append(v["rank"])
    worst = max(values, key=lambda v: v["peak_bytes"])
    bound, _ = peak_memory_bound(worst)
    figures = {
        "peak_MiB": round(worst["peak_bytes"] / MiB, 1),
        "bound_MiB": round(bound / MiB, 1),
        "model_MiB": round(worst["model_bytes"] / MiB, 1),
    }
    note = ""
    if values[0]["device_type"] == "cpu" and not values[0]["mmap_threshold"]:
        note = (
            "\n  (MALLOC_MMAP_THRESHOLD_ was not set in the rank processes: freed heap is "
            "reused and the high-water mark is noise; run with the check's env)"
        )
    if over:
        return Verdict(
            False,
            f"peak memory while materializing exceeds the bound on ranks "
            f"{over}: a rank held more than its shards plus one unit\n  "
            + "\n  ".join(rows)
            + note,
            figures,
            {"ranks": list(values)},
        )
    return Verdict(
        True,
        "peak memory while materializing within the bound on every rank:\n  "
        + "\n  ".join(rows)
        + note,
        figures,
        {"ranks": list(values)},
    )
