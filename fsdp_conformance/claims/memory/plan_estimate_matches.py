"""``memory.plan_estimate_matches``: trust in the planner, its estimate against measured peaks of
real steps at small scale.

The check runs training steps on the rank pools through the memory checks'
:func:`~fsdp_conformance.measure.step.measure_step` and judges every rank's peak against
:func:`fsdp_conformance.plan.estimate.plan_model`'s estimate for the same model, policy, world
size, optimizer, compute dtype and batch (docs/planning.md, "Trust"). Part of the memory claim:
it runs in ``fsdp-conformance run``, reported after the other memory checks, with its per-case
figures in the report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.fsdp.sharding import (
    InputCasts,
    full_precision_units_note,
    input_casts_note,
    known_fix_figure,
)
from fsdp_conformance.harness import CheckSkipped, RankContext
from fsdp_conformance.measure.bound import (
    BOUND_TOLERANCE,
    Bound,
    BoundTerm,
    with_full_precision_units,
)
from fsdp_conformance.measure.step import measure_step
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.policies import wrapping_label
from fsdp_conformance.models.reference_models import LlamaConfig, ModelConfig
from fsdp_conformance.plan.estimate import plan_model
from fsdp_conformance.plan.model import (
    POLICIES,
    MetaForwardError,
    ModelChoice,
    PlanError,
    PlanSettings,
    checkpoint_every,
    checkpoint_ops,
)
from fsdp_conformance.sizes import format_bytes

# step is imported at module top, as in the memory claim's measurement module: a parent that
# loaded this module has its ranks' fork server preload step (and torch's memory trackers with
# it), instead of every rank importing them at its first case.

#: Trust: the estimate is an upper bound, checked with the memory checks' tolerance above it
#: (a measured peak may exceed it by at most 10%)...
TRUST_MAX_RATIO = 1 + BOUND_TOLERANCE
#: ...and it must not be loose beyond what was measured for each policy (docs/planning.md):
#: per-layer plans measured 0.49 to 1.08 of the estimate; monolithic 0.32 to 0.78 (its one
#: unit's forward products and both collective buffers are counted at full model size).
TRUST_MIN_RATIO = {"recommended": 0.45, "monolithic": 0.25}
#: The sequence length of measure_step's batch (models.make_batch) unless a case names one.
MEASURED_SEQ_LEN = 8
#: The reference model of the trust check (the memory checks' shape, smaller).
TRUST_SPEC = ModelSpec(reference="massive", config=ModelConfig(num_layers=4, dim=128))
#: Activation checkpointing is measured where activations dominate: the seeds' model, 8
#: narrow blocks, batch 128 (its estimate measured 0.985 to 0.995 of the peak with AC on every
#: block or every second one, FSDP1 and FSDP2, docs/planning.md "Trust").
AC_SPEC = ModelSpec(reference="massive", config=ModelConfig(num_layers=8, dim=32))
AC_BATCH = 128


def default_cases(spec: ModelSpec, version: str) -> list[dict[str, Any]]:
    """Per-layer with and without AdamW, fp32; per-layer in bf16 mixed precision (only
    ``param_dtype`` named, as a user writes it); on reference models also monolithic (it fits
    there) and activation checkpointing on every block (:data:`AC_SPEC`; every second block is
    in the tests' cases)."""
    cases = [
        {"spec": spec, "version": version, "policy": "recommended", "optimizer": "none"},
        {"spec": spec, "version": version, "policy": "recommended", "optimizer": "adamw"},
        {
            "spec": spec,
            "version": version,
            "policy": "recommended",
            "optimizer": "none",
            "compute_dtype": "bf16",
        },
    ]
    if spec.reference is not None:
        cases.append(
            {"spec": spec, "version": version, "policy": "monolithic", "optimizer": "none"}
        )
        cases.append(
            {
                "spec": AC_SPEC,
                "version": version,
                "policy": "recommended",
                "optimizer": "none",
                "batch_size": AC_BATCH,
                "checkpointing": "full",
            }
        )
    return cases


class MeasuredPeak(TypedDict):
    """One case's measured peak on one rank and the meter that read it."""

    peak: int
    source: str
    #: None: the case ran as users write it. Else torch's defaults raised the version's known
    #: error and the peak is of the step with its fix (``step.measure_step``).
    input_casts: InputCasts | None
    #: The fix's fp32 units (FSDP2's ``_BatchNorm`` units) by FQN with their numel: the
    #: estimate of that run counts them apart (``bound.with_full_precision_units``).
    full_units: dict[str, int]
    #: The meter's categories at the peak (FSDPMemTracker: FSDP2's states, activations,
    #: temporaries), empty where the meter has none (MemTracker on FSDP1, the OS figure).
    breakdown: dict[str, int]
    #: Each category's own peak over the step (whenever it was), empty as ``breakdown``.
    category_peaks: dict[str, int]


class TrustResult(TypedDict):
    """One rank's measured peak per case, in case order."""

    rank: int
    peaks: list[MeasuredPeak]


def rank_plan_estimate_matches(
    ctx: RankContext,
    spec: ModelSpec = TRUST_SPEC,
    version: str = "fsdp2",
    cases: Sequence[Mapping[str, Any]] | None = None,
    batch_size: int = 2,
) -> TrustResult:
    """The measured peak of one training step per case on this rank (step.measure_step)."""
    # The planner's policies that step.measure_step can measure, as its wrapping labels.
    measured = {p: label for p in POLICIES if (label := wrapping_label(p))}
    peaks: list[MeasuredPeak] = []
    for case in cases if cases is not None else default_cases(spec, version):
        policy = case["policy"]
        if policy not in measured:
            raise PlanError(
                f"policy {policy!r} cannot be measured; choose one of {', '.join(measured)}"
            )
        opt = case.get("optimizer", "none")
        m = measure_step(
            ctx,
            case["spec"],
            case["version"],
            measured[policy],
            optimizer=None if opt == "none" else opt,
            batch_size=case.get("batch_size", batch_size),
            timeline=False,
            param_dtype=_mixed_param_dtype(case),
            reduce_dtype=case.get("reduce_dtype"),
            checkpoint_every=checkpoint_every(case.get("checkpointing", "none")),
            checkpoint_ops=checkpoint_ops(case.get("checkpointing", "none")),
            shard_group=case.get("shard_group"),
            seq_len=case.get("seq_len", MEASURED_SEQ_LEN),
            offload=bool(case.get("offload")),
        )
        peaks.append(
            {
                "peak": m["meters"][0]["peak"],
                "source": m["meters"][0]["source"],
                "input_casts": m["input_casts"],
                "full_units": m["full_precision_units"],
                "breakdown": dict(m["meters"][0].get("breakdown") or {}),
                "category_peaks": dict(m["meters"][0].get("category_peaks") or {}),
            }
        )
    return {"rank": ctx.rank, "peaks": peaks}


def _mixed_param_dtype(case: Mapping[str, Any]) -> str | None:
    """The ``param_dtype`` of the case's mixed precision; None for plain fp32 (no policy)."""
    compute = case.get("compute_dtype", "fp32")
    return None if compute == "fp32" else compute


def trust_settings(case: Mapping[str, Any], batch_size: int = 2) -> PlanSettings:
    """The plan settings of what measure_step runs: fp32 sharded state, the case's compute
    dtype (fp32 by default; bf16: mixed precision with only ``param_dtype`` named), its batch,
    seq 8."""
    return PlanSettings(
        policy=case["policy"],
        version=case["version"],
        param_dtype="fp32",
        compute_dtype=case.get("compute_dtype", "fp32"),
        reduce_dtype=case.get("reduce_dtype"),
        optimizer=case.get("optimizer", "none"),
        batch_size=case.get("batch_size", batch_size),
        seq_len=case.get("seq_len", MEASURED_SEQ_LEN),
        attention="flash",
        checkpointing=case.get("checkpointing", "none"),
        shard_group_size=case.get("shard_group"),
        cpu_offload=bool(case.get("offload")),
    )


#: The term a CPU-offload case's estimate gets on a CPU device, where host and device are one
#: memory: the sharded state the plan moved to the host (``ModelPlan.host_bytes``).
HOST_TERM = "host: offloaded sharded state"


def estimate_for_case(case: Mapping[str, Any], world_size: int, batch_size: int = 2) -> Bound:
    """The planner's estimate for what the case measures. With CPU offload it is the device's
    estimate plus the host's figure as one more term: the trust check measures on CPU, where
    the offloaded state and the device's working set are the same memory (telling them apart
    needs a GPU: docs/planning.md, "CPU offload")."""
    spec: ModelSpec = case["spec"]
    plan = plan_model(ModelChoice(spec, spec.name), trust_settings(case, batch_size))
    bound = plan.estimate(world_size)
    if not case.get("offload"):
        return bound
    host = plan.host_bytes(world_size)
    return Bound(
        (
            *bound.terms,
            BoundTerm(
                HOST_TERM,
                host,
                f"sharded params, grads and optimizer state per rank, "
                f"{format_bytes(host, 'decimal')}, in the same memory as the device's on CPU",
                scales_with_depth=True,
            ),
        ),
        bound.tolerance,
    )


def compare_to_measurement(
    estimate: Bound,
    peaks_by_rank: Mapping[int, int],
    *,
    min_ratio: float,
    max_ratio: float = TRUST_MAX_RATIO,
    label: str = "",
) -> tuple[bool, list[str]]:
    """Every rank's measured peak within ``[min_ratio, max_ratio] x estimate``.

    Above: the estimate misses something (a term too small or absent): planning would call a
    device big enough when it is not. Below: it counts something that is not there. Returns
    (ok, one line per rank).
    """
    lines, ok = [], True
    for rank, peak in sorted(peaks_by_rank.items()):
        ratio = peak / estimate.total if estimate.total else float("inf")
        if ratio > max_ratio:
            ok = False
            verdict = (
                f"ABOVE {max_ratio:.2f} x the estimate: the estimate misses "
                f"{format_bytes(peak - estimate.total, 'decimal')}"
            )
        elif ratio < min_ratio:
            ok = False
            verdict = f"BELOW {min_ratio:.2f} x the estimate: the estimate is too loose"
        else:
            verdict = "ok"
        lines.append(
            f"{label}rank {rank}: measured {format_bytes(peak, 'decimal')}, estimate "
            f"{format_bytes(estimate.total, 'decimal')}, ratio {ratio:.3f}: {verdict}"
        )
    return ok, lines


def _case_label(case: Mapping[str, Any]) -> str:
    spec: ModelSpec = case["spec"]
    cfg = spec.config
    shape = f" {cfg.num_layers}L d{cfg.dim}" if isinstance(cfg, (ModelConfig, LlamaConfig)) else ""
    ac = case.get("checkpointing", "none")
    return (
        f"{spec.name}{shape} {case['version']} {case['policy']} "
        f"opt={case.get('optimizer', 'none')}"
        + (f" b{case['batch_size']}" if "batch_size" in case else "")
        + (f" s{case['seq_len']}" if "seq_len" in case else "")
        + ("" if ac == "none" else f" ac={ac}")
        + (f" hsdp={case['shard_group']}" if case.get("shard_group") else "")
        + (" offload" if case.get("offload") else "")
        + (f" reduce={case['reduce_dtype']}" if case.get("reduce_dtype") else "")
        + f" {case.get('compute_dtype', 'fp32')}: "
    )


#: The estimate's terms by the tracker category that holds them at the peak (FSDPMemTracker's
#: names): a group's ratio is the category's bytes at the step's peak over the terms' sum.
TERM_CATEGORIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "sharded params": (("sharded params",), ("Sharded Param",)),
    "sharded grads": (("sharded grads",), ("Sharded Grad",)),
    "optimizer state": (("optimizer state",), ("OptState",)),
    "unsharded params": (("unsharded params",), ("Unsharded Param",)),
    "unsharded grads": (("unsharded grads",), ("Unsharded Grad",)),
    "all-gather buffers": (("all-gather buffers",), ("All Gather",)),
    "reduce-scatter buffers": (("reduce-scatter buffers",), ("Reduce Scatter",)),
    "input batch": (("input batch",), ("Inputs",)),
    # Forward's tensors (Activation) and backward's and the recompute's (Temp) together.
    "activations": (
        ("saved activations", "recomputed unit", "activation working set"),
        ("Activation", "Temp"),
    ),
}


#: The same per term, read at each category's own peak over the step (``term_peaks``): every
#: term but the activations' as in :data:`TERM_CATEGORIES`; the activations in two. Forward's
#: tensors (``Activation``) against saved activations and the working set. Backward's
#: (``Temp``: activations' gradients, backward's transients and, with torch's
#: ``checkpoint``, the recomputed unit) against the working set and the recomputed unit: the
#: estimate's backward peak of the unit where their sum is largest. ``Temp`` also holds a
#: parameter's gradient as autograd makes it, before FSDP2 takes it as ``Unsharded Grad``
#: (counted in unsharded grads): in parameter-heavy steps it reads above 1 (docs/planning.md).
TERM_PEAK_CATEGORIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    **{k: v for k, v in TERM_CATEGORIES.items() if k != "activations"},
    "activations in forward": (("saved activations", "activation working set"), ("Activation",)),
    "backward: working set + recomputed unit": (
        ("activation working set", "recomputed unit"),
        ("Temp",),
    ),
}


def term_ratios(
    bound: Bound,
    breakdown: Mapping[str, int],
    groups: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] = TERM_CATEGORIES,
) -> dict[str, float | None]:
    """Per group of ``groups`` (:data:`TERM_CATEGORIES`): the measured category bytes (at
    the peak, or each category's own peak with :data:`TERM_PEAK_CATEGORIES`) over the
    estimate's terms (None where the estimate has none); empty without a breakdown (a meter
    without categories)."""
    if not breakdown:
        return {}
    out: dict[str, float | None] = {}
    for group, (terms, categories) in groups.items():
        estimated = sum(t.bytes for t in bound.terms if t.name in terms)
        measured = sum(breakdown.get(c, 0) for c in categories)
        if estimated or measured:
            out[group] = round(measured / estimated, 3) if estimated else None
    return out


def _fsdp_categories(peak: MeasuredPeak, field: str = "breakdown") -> Mapping[str, int]:
    """FSDPMemTracker's categories (FSDP2's states) at the peak, or with ``field=
    "category_peaks"`` each at its own peak; none from other meters, whose categories
    (MemTracker's parameters, gradients, temporaries) do not separate FSDP's buffers."""
    found: Mapping[str, int] = peak.get(field) or {}  # type: ignore[assignment]
    return found if peak.get("source") == "FSDPMemTracker" else {}


def _highest(values: Sequence[TrustResult], i: int) -> MeasuredPeak:
    return max((v["peaks"][i] for v in values), key=lambda p: p["peak"])


def verdict_plan_estimate_matches(
    values: Sequence[TrustResult], params: Mapping[str, Any]
) -> Verdict:
    """The planning estimate of each case within the tolerance of every rank's measured peak."""
    cases = params.get("cases") or default_cases(
        params.get("spec", TRUST_SPEC), params.get("version", "fsdp2")
    )
    try:
        estimates = [estimate_for_case(c, len(values), params.get("batch_size", 2)) for c in cases]
    except MetaForwardError as exc:
        # The planner plans at full scale on meta; a forward that needs real values (.item())
        # cannot be planned, so there is no estimate to judge: the model's limit, said.
        raise CheckSkipped(f"the planner cannot plan this model: {exc}") from None
    return judge_estimates(values, cases, estimates)


def judge_estimates(
    values: Sequence[TrustResult], cases: Sequence[Mapping[str, Any]], estimates: Sequence[Bound]
) -> Verdict:
    """Every rank's measured peak of each case against ``estimates`` (one per case, in order).

    The verdict gives the planner's estimates; a negative control gives others (a term left
    out) to show a peak above them fails.
    """
    world_size = len(values)
    all_ok, lines, ratios, rows = True, [], [], []
    for i, (case, planned) in enumerate(zip(cases, estimates, strict=True)):
        bound = with_full_precision_units(planned, values[0]["peaks"][i].get("full_units") or {})
        peaks = {v["rank"]: v["peaks"][i]["peak"] for v in values}
        ok, case_lines = compare_to_measurement(
            bound, peaks, min_ratio=TRUST_MIN_RATIO[case["policy"]], label=_case_label(case)
        )
        all_ok &= ok
        lines += case_lines
        ratios.append(round(max(peaks.values()) / bound.total, 3))
        rows.append(
            {
                "case": _case_label(case).rstrip(": "),
                "estimate": bound.total,
                "peaks": peaks,
                "terms": bound.to_dict()["terms"],
                # The highest rank's categories at its peak against the estimate's terms.
                "term_ratios": term_ratios(bound, _fsdp_categories(_highest(values, i))),
                # Each category's own peak over the step (the highest rank's) against the
                # terms that hold it: every transient term is the most it can be.
                "term_peaks": term_ratios(
                    bound,
                    _fsdp_categories(_highest(values, i), "category_peaks"),
                    TERM_PEAK_CATEGORIES,
                ),
            }
        )
    # Per case, in case order: what the report keeps and compare reads (the byte lists as
    # memory, the ratios as measurements the verdict judged, the labels and limits exactly).
    figures = {
        "cases": len(cases),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
        "source": values[0]["peaks"][0]["source"],
        "case_labels": [r["case"] for r in rows],
        "estimate_bytes": [r["estimate"] for r in rows],
        "peak_bytes": [max(r["peaks"].values()) for r in rows],
        "ratios": ratios,
        "min_allowed_ratios": [TRUST_MIN_RATIO[c["policy"]] for c in cases],
        "max_allowed_ratio": TRUST_MAX_RATIO,
    }
    data: dict[str, Any] = {"rows": rows}
    # The cases whose step needed the version's fix (step.measure_step): said, not hidden.
    casts = {
        r["case"]: c
        for i, r in enumerate(rows)
        if (c := values[0]["peaks"][i].get("input_casts")) is not None
    }
    for c in casts.values():
        figures[known_fix_figure(c)] = True
    if casts:
        data["input_casts"] = casts
    note = (
        f"; case(s) {', '.join(casts)}: {input_casts_note(next(iter(casts.values())))[2:]}"
        if casts
        else ""
    )
    # torch's own fp32 units (FSDP1's MixedPrecision default), counted apart: said too.
    full = [
        (c["version"], u) for c, p in zip(cases, values[0]["peaks"]) if (u := p.get("full_units"))
    ]
    if full:
        data["full_precision_units"] = full[0][1]
        note += full_precision_units_note(*full[0])
    head = (
        f"planning estimate vs measured peak ({values[0]['peaks'][0]['source']}), "
        f"{len(cases)} case(s) x {world_size} ranks; allowed ratio peak/estimate: "
        f"{', '.join(f'{p} {r:.2f}' for p, r in TRUST_MIN_RATIO.items())} to "
        f"{TRUST_MAX_RATIO:.2f} (above: the estimate misses a term, beyond the memory "
        "checks' tolerance; below: it counts what is not there, beyond the loosest ratio "
        "measured for the policy)"
    )
    if all_ok:
        per_case = "; ".join(
            f"{r['case']}: estimate {format_bytes(r['estimate'], 'decimal')}, measured "
            f"{format_bytes(max(r['peaks'].values()), 'decimal')}, ratio {q:.3f}"
            for r, q in zip(rows, ratios)
        )
        return Verdict(
            True,
            f"{head}: all within (ratios {min(ratios):.3f} to {max(ratios):.3f}): {per_case}{note}",
            figures,
            data,
        )
    bad = [ln for ln in lines if not ln.endswith(": ok")]
    return Verdict(
        False,
        f"{head}{note}: {len(bad)} outside:\n"
        + "\n".join(bad)
        + "\nall cases:\n"
        + "\n".join(lines),
        figures,
        data,
    )
