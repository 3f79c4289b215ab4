"""``memory.meter_agrees``: torch's tracker agrees with ground truth on the same step.

The tracker is the meter the other memory checks read on this lane (CPU: ``FSDPMemTracker`` for
FSDP2, ``MemTracker`` for FSDP1; GPU: ``MemTracker``); ground truth is the OS high-water mark on
CPU (fresh ranks with the allocator setting, ``meters.MALLOC_ENV``) and the CUDA allocator on
GPU (:mod:`fsdp_conformance.measure.meters`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.memory import common
from fsdp_conformance.claims.memory.common import (
    DEFAULT_SPEC,
    FAULTS,
    PER_LAYER,
    Scaling,
    StepResult,
    check_label,
    describe,
    for_meter,
    mb,
    measured_at,
)
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.measure.meters import (
    METER_RESOLUTION_BYTES,
    choose_meter,
    meter_floor_problems,
    torch_version_string,
)
from fsdp_conformance.models.model_spec import ModelSpec

#: Tracker vs OS (or CUDA allocator) step increase, relative.
METER_TOLERANCE = 0.05


class MeterResult(StepResult):
    """One step read by the tracker (``meters[0]``) and by the ground truth (``meters[1]``)."""

    #: None: the model as configured; else what was scaled (:func:`~.common.for_meter`) to resolve.
    scaled: Scaling | None


def rank_meter_agrees(
    ctx: RankContext,
    spec: ModelSpec = DEFAULT_SPEC,
    version: str = "fsdp2",
    batch_size: int = 2,
    fault: str | Sequence[str] | None = None,
) -> MeterResult:
    """The tracker and the ground truth (OS on CPU, CUDA allocator on GPU) on the same step.

    The tracker is the meter the other checks read on this lane: on CPU ``FSDPMemTracker``
    for FSDP2 (the source of its figures), ``MemTracker`` for FSDP1; on GPU, where the
    allocator itself is the figure, ``MemTracker``. ``fault``: negative controls of
    :data:`~fsdp_conformance.claims.memory.common.FAULTS`. A user's model whose step is
    estimated below the meters' resolution is measured at its smallest width (else batch
    size) that resolves (:func:`~.common.for_meter`).
    """
    with FAULTS.inject(fault, ctx):
        truth = "cuda" if ctx.device_type == "cuda" else "os"
        meter = "auto" if truth == "os" else "tracker"
        if meter == "auto" and choose_meter(ctx, "auto", version) == truth:
            skip_rank(
                f"torch {torch_version_string()} moved its memory trackers: the {truth} "
                "figure is the only meter, there is no tracker to cross-check"
            )
        spec, batch_size, scaled = for_meter(ctx, spec, version, batch_size)
        step = common.per_layer_step(
            ctx, spec, version, meter=meter, also=truth, batch_size=batch_size, timeline=False
        )
        result: MeterResult = {**step, "scaled": scaled}
        # A step the ground truth cannot resolve makes any tracker figure "agree": skip it, on
        # every rank alike (the smallest rank's step decides, so no rank skips alone).
        import torch
        import torch.distributed as dist

        seen = result["meters"][1]["peak"] - result["meters"][1]["start"]
        smallest = torch.tensor([int(seen)], dtype=torch.int64, device=ctx.device)
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
        if smallest.item() <= METER_RESOLUTION_BYTES:
            skip_rank(
                f"the step of {spec.name} adds {mb(smallest.item())} by the "
                f"{truth} figure, within the meters' resolution "
                f"({mb(METER_RESOLUTION_BYTES)}): tracker and truth cannot be compared; "
                "use a larger config of the model or batch"
                + (f" (it was {describe(scaled)})" if scaled else "")
            )
        return result


def verdict_meter_agrees(values: Sequence[MeterResult], params: Mapping[str, Any]) -> Verdict:
    """The tracker's step increase (peak - start) within the tolerance of the ground truth's."""
    t = params.get("tolerance", METER_TOLERANCE)
    label = check_label(params, values[0].get("wrapping", PER_LAYER))
    scaled = values[0].get("scaled")
    if scaled:  # the same on every rank: chosen from the spec and the ranks' agreed memory
        label = f"{label} ({describe(scaled)})"
    problems, ratios = [], []
    for v in values:
        tracker, truth = v["meters"][0], v["meters"][1]
        got, want = tracker["peak"] - tracker["start"], truth["peak"] - truth["start"]
        ratio = got / want if want else float("inf")
        ratios.append(round(ratio, 3))
        if want <= METER_RESOLUTION_BYTES:
            # Within the resolution any tracker figure, 0 included, would "agree": no verdict.
            problems.append(
                f"rank {v['rank']}: {truth['source']} saw the step add only "
                f"{mb(want)}, below the meters' resolution "
                f"({mb(METER_RESOLUTION_BYTES)}): the tracker's {mb(got)} cannot "
                "be judged; use a larger config of the model or batch"
            )
        elif abs(got - want) > max(t * want, METER_RESOLUTION_BYTES):
            problems.append(
                f"rank {v['rank']}: {tracker['source']} saw the step add {mb(got)}, "
                f"{truth['source']} {mb(want)} (ratio {ratio:.3f}, tolerance {t:.0%} "
                f"or {mb(METER_RESOLUTION_BYTES)}, whichever is larger)"
            )
        problems += meter_floor_problems(v["rank"], v["meters"], v.get("param_bytes"))
    truth_src = values[0]["meters"][1]["source"]
    figures: dict[str, Any] = {
        **measured_at(scaled),
        "tracker_over_truth": ratios,
        "truth": truth_src,
        "tracker": values[0]["meters"][0]["source"],
    }
    data = {"scaled": scaled} if scaled else {}
    if problems:
        return Verdict(
            False,
            f"{label}: the tracker disagrees with the {truth_src} figure:\n" + "\n".join(problems),
            figures,
            data,
        )
    return Verdict(
        True,
        f"{label}: {figures['tracker']} within {t:.0%} or {mb(METER_RESOLUTION_BYTES)} "
        f"(whichever is larger) of the {truth_src} figure, and every meter at least the parameter shards, on "
        f"all ranks (ratios {ratios})",
        figures,
        data,
    )
