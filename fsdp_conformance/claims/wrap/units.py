"""``wrap.units.exact`` / ``.plan`` / ``.accounting``: the units torch built, against the unit
set written down from the claim itself (:func:`expected_units`), against the plan, and against
the model's parameters, on every rank.

The expected unit set is derived *from the claim*, not by running a policy: a policy that is
wrong in the same way as its own plan is still caught.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import Fault, FaultTable, patched_attr
from fsdp_conformance.claims.wrap.common import (
    RankUnits,
    build,
    expected_units,
    fsdp1_strategies,
    shard_with_policy,
    units_of,
)
from fsdp_conformance.fsdp.sharding import check_fsdp_version
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models import policies
from fsdp_conformance.models.model_spec import BuiltModel, ModelSpec
from fsdp_conformance.models.policies import Policy, PolicyName, shared_parameter_groups
from fsdp_conformance.models.units import (
    ROOT,
    UnitInfo,
    actual_units,
    format_unit_mismatch,
    format_unit_tree,
    fsdp2_management_problems,
    plan_units,
    planned_unit_modules,
    unit_differences,
    unit_set_differences,
)

# --------------------------------------------------------------------------------------------
# A plan judged against the claim (no ranks; policies by name: policies.policy)
# --------------------------------------------------------------------------------------------


def judge_plan(
    model: nn.Module,
    policy_obj: Any,
    block_classes: Sequence[type[nn.Module]],
    min_params: int,
    what: str = "plan",
) -> Verdict:
    """The plan of ``policy_obj`` judged against the expected units (no process group; works on
    a meta model)."""
    expected = expected_units(model, block_classes, min_params)
    plan = plan_units(model, policy_obj)
    diffs = unit_set_differences(expected, plan)
    figures = unit_figures(plan)
    data = {"expected": [u.to_dict() for u in expected], "plan": [u.to_dict() for u in plan]}
    if diffs:
        return Verdict(False, format_unit_mismatch(what, expected, plan, diffs), figures, data)
    return Verdict(True, f"{what}: {len(plan)} units as expected", figures, data)


def seeds_full_scale_plan(
    policy: PolicyName = "seeds_verbatim",
) -> tuple[list[UnitInfo], Verdict]:
    """The plan of a policy on the seeds' full-scale MassiveModel (meta, no allocation)."""
    from fsdp_conformance.models.policies import SEED_MIN_PARAMS
    from fsdp_conformance.models.reference_models import DecoderLayer, MassiveModel, ModelConfig

    with torch.device("meta"):
        model = MassiveModel(ModelConfig.seeds_full_scale())
    blocks = (DecoderLayer,)
    policy_obj = policies.policy(policy, model, blocks, SEED_MIN_PARAMS)
    verdict = judge_plan(
        model,
        policy_obj,
        blocks,
        SEED_MIN_PARAMS,
        f"policy {policy!r} at dim 4096, 8 layers, threshold 2e7",
    )
    return plan_units(model, policy_obj), verdict


def unit_figures(units: Sequence[UnitInfo]) -> dict[str, Any]:
    sizes = [u.numel for u in units if u.fqn != ROOT]
    return {
        "units": len(units),
        "largest_unit_numel": max(sizes, default=0),
        "root_numel": sum(u.numel for u in units if u.fqn == ROOT),
    }


# --------------------------------------------------------------------------------------------
# Faults (negative controls): how a user's wrapping can differ from their plan
# --------------------------------------------------------------------------------------------


def applied_policy(built: BuiltModel, name: PolicyName) -> Policy:
    """The policy the user wraps with: the one they planned."""
    return built.policy(name)


@contextlib.contextmanager
def _seeds_applied(ctx: RankContext) -> Iterator[None]:
    with patched_attr(
        __name__,
        "applied_policy",
        lambda applied: lambda built, name: applied(built, "seeds"),
    ):
        yield


def _unmanaged_first_param(shard: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    def shard_leaving_one(
        model: nn.Module, ctx: RankContext, version: str, policy_obj: Any, **kwargs: Any
    ) -> nn.Module:
        first = next(planned_unit_modules(model, policy_obj)[0].parameters())
        ignored = {"ignored_states": [first]} if version == "fsdp1" else {"ignored_params": {first}}
        return shard(model, ctx, version, policy_obj, **ignored, **kwargs)

    return shard_leaving_one


@contextlib.contextmanager
def _unmanaged_parameter(ctx: RankContext) -> Iterator[None]:
    with patched_attr(__name__, "shard_with_policy", _unmanaged_first_param):
        yield


#: The units are read from torch's state, not from the plan or the modules the suite sharded.
FAULTS = FaultTable(
    seeds_applied=Fault(
        "the seeds' policy is applied while the planned one is reported as the plan", _seeds_applied
    ),
    unmanaged_parameter=Fault(
        "FSDP is told to leave the first planned unit's first parameter alone (FSDP2 "
        "ignored_params, FSDP1 ignored_states): it stays plain and replicated, in no unit",
        _unmanaged_parameter,
    ),
)


# --------------------------------------------------------------------------------------------
# The rank function (one for the three checks)
# --------------------------------------------------------------------------------------------


class UnitsResult(RankUnits):
    """What every rank of ``rank_units`` reports."""

    version: str
    expected: list[dict[str, Any]]
    plan: list[dict[str, Any]]
    model_numel: int
    param_shapes: dict[str, list[int]]
    shared: list[list[str]]
    strategies: dict[str, str]
    management: list[str]


def rank_units(
    ctx: RankContext,
    spec: ModelSpec,
    version: str = "fsdp1",
    policy: PolicyName = "recommended",
    fault: str | Sequence[str] | None = None,
) -> UnitsResult:
    """Build, plan, shard and report the units as every rank sees them.

    FSDP2 ranks also report every parameter that is not a sharded DTensor managed by exactly
    one param group (``management``). ``fault``: names in :data:`FAULTS`.
    """
    with FAULTS.inject(fault, ctx):
        check_fsdp_version(version)
        built = build(spec, ctx)
        model = built.model
        expected = expected_units(model, built.blocks, built.size_threshold)
        plan = plan_units(model, built.policy(policy))
        shapes = {n: list(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
        numel = sum(p.numel() for p in model.parameters())
        shared = shared_parameter_groups(model)
        sharded = shard_with_policy(model, ctx, version, applied_policy(built, policy))
        return {
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "version": version,
            "expected": [u.to_dict() for u in expected],
            "plan": [u.to_dict() for u in plan],
            "actual": [u.to_dict() for u in actual_units(sharded)],
            "model_numel": numel,
            "param_shapes": shapes,
            "shared": shared,
            "strategies": fsdp1_strategies(sharded) if version == "fsdp1" else {},
            "management": fsdp2_management_problems(sharded) if version == "fsdp2" else [],
        }


# --------------------------------------------------------------------------------------------
# Verdicts
# --------------------------------------------------------------------------------------------


def _told_once(by_story: Mapping[str, Sequence[int]]) -> list[str]:
    """Each story once, with the ranks that told it."""
    out = []
    for story, ranks in by_story.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        out.append(f"{who}: {story}")
    return out


def _rank_disagreement(values: Sequence[UnitsResult], key: str) -> str | None:
    """Ranks must agree on the unit structure (fqn, class, numel, parent)."""
    shapes = [[(u.fqn, u.cls, u.numel, u.parent) for u in units_of(v, key)] for v in values]
    for v, s in zip(values[1:], shapes[1:]):
        if s != shapes[0]:
            return (
                f"ranks disagree on the {key} units: rank 0 and rank {v['rank']} differ\n"
                + format_unit_tree(units_of(values[0], key), "rank 0:")
                + "\n"
                + format_unit_tree(units_of(v, key), f"rank {v['rank']}:")
            )
    return None


def _management_problems(values: Sequence[UnitsResult]) -> list[str]:
    """Parameters outside every unit (names in no unit's parameters, a tied weight counted by
    any of its names), and FSDP2's own findings (``fsdp2_management_problems``), per rank;
    identical findings from several ranks told once."""
    by_story: dict[str, list[int]] = {}
    for v in values:
        covered = {n for u in units_of(v, "actual") for n in u.params}
        tied = {n: set(g) for g in v.get("shared", []) for n in g}
        for name in v.get("param_shapes", {}):
            if name not in covered and not tied.get(name, set()) & covered:
                by_story.setdefault(
                    f"parameter {name} is in no unit ({v['version']} did not take it)", []
                ).append(v["rank"])
        for line in v.get("management", []):
            by_story.setdefault(line, []).append(v["rank"])
    return _told_once(by_story)


def verdict_units_exact(values: Sequence[UnitsResult], params: Mapping[str, Any]) -> Verdict:
    """Every rank's actual units equal the claim's expected units."""
    by_story: dict[str, list[int]] = {}  # identical failures from several ranks told once
    for v in values:
        expected, actual = units_of(v, "expected"), units_of(v, "actual")
        diffs = unit_set_differences(expected, actual)
        if diffs:
            story = format_unit_mismatch(
                f"{v['version']}, policy {params.get('policy')!r}", expected, actual, diffs
            )
            by_story.setdefault(story, []).append(v["rank"])
    failures = [f"ranks {', '.join(map(str, r))}: {story}" for story, r in by_story.items()]
    managed = _management_problems(values)
    if managed:
        failures.append(
            "parameters not managed as one sharded unit each:\n  " + "\n  ".join(managed)
        )
    disagreement = _rank_disagreement(values, "actual")
    if disagreement:
        failures.append(disagreement)
    actual0 = units_of(values[0], "actual")
    data = {"actual": values[0]["actual"], "expected": values[0]["expected"]}
    if failures:
        return Verdict(
            False,
            "unit set differs from the claim\n" + "\n\n".join(failures),
            unit_figures(actual0),
            data,
        )
    return Verdict(
        True,
        f"{len(actual0)} units, each block exactly one unit, on all {len(values)} ranks",
        unit_figures(actual0),
        data,
    )


def verdict_units_plan(values: Sequence[UnitsResult], params: Mapping[str, Any]) -> Verdict:
    """The plan computed without a process group equals the actual units on every rank."""
    managed = _management_problems(values)
    for v in values:
        plan, actual = units_of(v, "plan"), units_of(v, "actual")
        diffs = unit_differences(plan, actual, ("cls", "numel", "parent"))
        if diffs or managed:
            diffs += [f"! {line}" for line in managed]
            what = f"rank {v['rank']}: plan vs actual ({v['version']})"
            return Verdict(
                False,
                format_unit_mismatch(what, plan, actual, diffs),
                {"units": len(actual)},
                {"plan": v["plan"], "actual": v["actual"]},
            )
    return Verdict(
        True,
        f"plan equals actual ({len(values[0]['plan'])} units) on every rank",
        {"units": len(values[0]["plan"])},
        {"plan": values[0]["plan"]},
    )


def expected_local_numel(
    unit: UnitInfo,
    rank: int,
    world_size: int,
    version: str,
    strategy: str,
    shapes: Mapping[str, Sequence[int]],
) -> int:
    """The local shard numel a unit should have on ``rank``.

    FSDP1: one FlatParameter padded to a multiple of the world size, ``ceil(flat / ws)`` on every
    rank (the flat size includes alignment padding with ``use_orig_params=True``); NO_SHARD
    keeps it whole. FSDP2: each parameter is chunked along dim 0 like ``torch.chunk`` (chunks
    of ``ceil(rows / ws)`` rows, the last ones shorter or empty); padding is internal.
    """
    if version == "fsdp1":
        flat = unit.flat_numel if unit.flat_numel is not None else unit.numel
        if strategy == "NO_SHARD" or flat == 0:
            return flat
        return math.ceil(flat / world_size)
    total = 0
    for name in unit.params:
        shape = list(shapes[name])
        if not shape:
            total += 1 if rank == 0 else 0  # a scalar is not split; FSDP2 treats it as dim 0
            continue
        rows, per_row = shape[0], math.prod(shape[1:])
        chunk = math.ceil(rows / world_size)
        total += max(0, min(chunk, rows - rank * chunk)) * per_row
    return total


def _unit_count_problems(values: Sequence[UnitsResult]) -> list[str]:
    # Every rank's own units: a rank that miscounts or splits a tied weight fails the check
    # even when rank 0 is right (identical findings from several ranks are told once).
    by_story: dict[str, list[int]] = {}
    for v in values:
        units = units_of(v, "actual")
        rank_total = sum(u.numel for u in units)
        if rank_total != v["model_numel"]:
            why = (
                "more: a weight is counted in two units"
                if rank_total > v["model_numel"]
                else "fewer: parameters are outside every unit"
            )
            by_story.setdefault(
                f"units hold {rank_total:,} parameters, the model has {v['model_numel']:,} ({why})",
                [],
            ).append(v["rank"])
        for group in v["shared"]:
            holding = sorted({u.fqn or "(root)" for u in units if set(u.params) & set(group)})
            if len(holding) != 1:
                by_story.setdefault(
                    f"tied weight {' = '.join(group)} is in {len(holding)} units "
                    f"({', '.join(holding) or 'none'}): it must be in exactly one",
                    [],
                ).append(v["rank"])
    return _told_once(by_story)


def _shard_problems(
    values: Sequence[UnitsResult], shard_rows: list[tuple[int, str, int]]
) -> list[str]:
    """Every rank's local shard of every unit against :func:`expected_local_numel`; fills
    ``shard_rows`` with (rank, unit, local numel)."""
    problems = []
    for v in values:
        for u in units_of(v, "actual"):
            strategy = v["strategies"].get(u.fqn, "FULL_SHARD")
            want = expected_local_numel(
                u, v["rank"], v["world_size"], v["version"], strategy, v["param_shapes"]
            )
            if u.local_numel != want:
                problems.append(
                    f"rank {v['rank']}: unit {u.fqn or '(root)'} holds a local shard of "
                    f"{u.local_numel:,} elements, expected {want:,} "
                    f"({u.numel:,} params over {v['world_size']} ranks, {v['version']})"
                )
            if u.local_numel is None:  # unreachable: formatting None above already raised
                raise TypeError(f"unit {u.fqn or '(root)'} has no local shard numel")
            shard_rows.append((v["rank"], u.fqn, u.local_numel))
    return problems


def verdict_units_accounting(values: Sequence[UnitsResult], params: Mapping[str, Any]) -> Verdict:
    """Numels add up; each tied weight in one unit; every rank's shard sizes as expected."""
    v0 = values[0]
    actual0 = units_of(v0, "actual")
    total = sum(u.numel for u in actual0)
    problems = _unit_count_problems(values) + _management_problems(values)
    shard_rows: list[tuple[int, str, int]] = []
    problems += _shard_problems(values, shard_rows)
    for u in actual0:
        held = sum(n for _, fqn, n in shard_rows if fqn == u.fqn)
        if held < u.numel and not problems:
            problems.append(
                f"unit {u.fqn or '(root)'}: the ranks' shards hold {held:,} < {u.numel:,} elements"
            )
    padding = sum(n for *_, n in shard_rows) - total
    figures = {"model_numel": v0["model_numel"], "units_numel": total, "padding": padding}
    if problems:
        return Verdict(
            False,
            "parameter accounting failed:\n  "
            + "\n  ".join(problems)
            + "\n\n"
            + format_unit_tree(actual0, "actual units (rank 0):"),
            figures,
            {"actual": v0["actual"]},
        )
    return Verdict(
        True,
        f"{total:,} parameters in {len(actual0)} units; shards on every rank "
        f"as expected ({padding:,} padding elements in all)",
        figures,
        {},
    )
