"""Wrap-policy conformance: every block is exactly one unit, oversized modules outside blocks
are wrapped by the size rule, nothing else.

The expected unit set is written down here *from the claim itself* (:func:`expected_units`),
not by running a policy: a policy that is wrong in the same way as its own plan is still caught.
Checks follow the contract of :mod:`fsdp_conformance.claims.check`: a rank function (module level,
plain data in and out) and a verdict computed in the parent from every rank's report.

Checks (``CHECKS``):

* ``wrap.units.exact``: the actual units equal :func:`expected_units` (trees on failure).
* ``wrap.units.plan``: the plan (no process group) equals the actual units.
* ``wrap.units.accounting``: unit numels add up to the model's, tied weights in one unit, every
  rank's local shard has the expected size (padding accounted).
* ``wrap.builders``: torch's builders give their documented result on a small model.
* ``wrap.train.fp32`` / ``wrap.train.bf16``: a few steps under FSDP equal a single-process
  reference (bf16: compute really in bf16, parameters kept in fp32, the reference computing as
  FSDP's mixed precision does: :class:`MixedPrecisionReference`).
* ``wrap.mixed``: the second seed's configuration (embedding NO_SHARD fp32, blocks FULL_SHARD
  bf16), each unit's strategy and dtypes.
* ``wrap.prefetch.forward`` / ``.backward`` / ``.coarse``: all-gather order against block
  execution.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fsdp_conformance import _compat, policies
from fsdp_conformance.claims.check import Check, Verdict, variants
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.models import ModelSpec, batch_rows, call_model, default_loss
from fsdp_conformance.policies import PolicyError, PolicyName, shared_parameter_groups
from fsdp_conformance.sharding import (
    check_fsdp_version,
    device_mesh,
    shard,
    shard_fsdp2_modules,
)
from fsdp_conformance.step import DETERMINISM_RTOL, disable_dropout, forward_randomness
from fsdp_conformance.units import (
    ROOT,
    UnitInfo,
    actual_units,
    clean_fqn,
    format_unit_mismatch,
    format_unit_tree,
    fsdp2_management_problems,
    plan_units,
    planned_unit_modules,
    unit_differences,
    unit_set_differences,
)

#: Containers with no forward of their own: FSDP1 cannot gather around them, and torch's size
#: policy never wraps them (``exclude_wrap_modules``), so the claim never expects them as units.
CONTAINERS: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.ModuleDict)

#: Tolerances of the training-parity checks (measured margins in docs/wrapping.md).
FP32_ATOL = 1e-5  # max |param - reference| after the steps; fp32 reduction order only
FP32_LOSS_RTOL = 1e-5
#: fp32: max |param - reference| / max |reference update| per tensor. Measured 3.2e-4 at dim 32
#: (3 SGD steps); a weight left out of gradient reduction measured 0.6.
FP32_UPDATE_RTOL = 1e-2
#: bf16: the reference computes as FSDP's mixed precision does (:class:`MixedPrecisionReference`),
#: so what is left is rounding, counted in bf16 ulps (8 significant bits: one ulp is 2^-8 to
#: 2^-7 of a value). Loss: every output off by at most one rounding moves a mean of squares by
#: at most 2 x 2^-8. Update: two ulps of the tensor's largest gradient element, 2 x 2^-7 of the
#: largest update. Measured (dim 32 and 64, 3 steps): loss 0 and update 0 at world size 2,
#: loss 0 and update <= 1.0e-3 at world size 4; summed gradients 1.0 (ws 2) to 3.0 (ws 4),
#: a skipped reduction 0.72 to 2.0 (docs/wrapping.md).
BF16_ULP = 2.0 ** -8
BF16_LOSS_RTOL = 2 * BF16_ULP
BF16_UPDATE_RTOL = 2 * 2 * BF16_ULP
BF16_PARAM_ATOL = 2e-2


# --------------------------------------------------------------------------------------------
# The claim, as an independent specification
# --------------------------------------------------------------------------------------------


def expected_units(
    model: nn.Module, block_classes: Sequence[type[nn.Module]], min_params: int
) -> list[UnitInfo]:
    """The unit set the claim asks for, derived from the claim (no policy is run).

    1. Every block (an instance of a block class not inside another block) is one unit.
    2. Outside the blocks, a module (not the root, not a container) is a unit when the
       parameters in its subtree that are in no block and no unit below it number at least
       ``min_params``, unless it holds a parameter shared with a module outside its subtree:
       wrapping it would split the tied weight, so that weight stays with the enclosing unit.
    3. Nothing else; everything left belongs to the root.

    Each parameter is counted once, in the innermost unit whose subtree holds every module
    that uses it.
    """
    blocks = tuple(block_classes)
    names = {id(m): n for n, m in model.named_modules()}
    holders: dict[int, set[int]] = {}  # param id -> ids of modules holding it directly
    params: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(id(module))
            params[id(p)] = p
    subtree = {id(m): {id(s) for s in m.modules()} for m in model.modules()}

    unit_ids: list[int] = []  # post-order

    def visit(module: nn.Module, in_block: bool) -> set[int]:
        """Returns ids of params in this subtree not yet taken by a unit (outside blocks)."""
        if module is not model and not in_block and isinstance(module, blocks):
            for child in module.children():
                visit(child, True)
            unit_ids.append(id(module))
            return set()
        free: set[int] = set()
        for child in module.children():
            free |= visit(child, in_block)
        if in_block:
            return set()
        free |= {id(p) for p in module.parameters(recurse=False)}
        splits_tie = any(not holders[pid] <= subtree[id(module)] for pid in free)
        big = sum(params[pid].numel() for pid in free) >= min_params
        if module is not model and big and not splits_tie and not isinstance(module, CONTAINERS):
            unit_ids.append(id(module))
            return set()
        return free

    visit(model, False)
    unit_ids.append(id(model))
    return _assign_params(model, unit_ids, names, holders, params, subtree)


def _assign_params(
    model: nn.Module,
    unit_ids: Sequence[int],
    names: Mapping[int, str],
    holders: Mapping[int, set[int]],
    params: Mapping[int, nn.Parameter],
    subtree: Mapping[int, set[int]],
) -> list[UnitInfo]:
    depth = {uid: (names[uid].count(".") + 1 if names[uid] else 0) for uid in unit_ids}
    first_name: dict[int, str] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(p), fqn)
    owned: dict[int, list[int]] = {uid: [] for uid in unit_ids}
    for pid, mods in holders.items():
        owner = max((u for u in unit_ids if mods <= subtree[u]), key=lambda u: depth[u])
        owned[owner].append(pid)
    units = []
    for uid in unit_ids:
        fqn = names[uid]
        parent = None
        if uid != id(model):
            enclosing = [u for u in unit_ids if u != uid and uid in subtree[u]]
            parent = names[max(enclosing, key=lambda u: depth[u])]
        units.append(
            UnitInfo(
                fqn=fqn,
                cls=type(_module_at(model, fqn)).__name__,
                numel=sum(params[pid].numel() for pid in owned[uid]),
                parent=parent,
                params=tuple(sorted(first_name[pid] for pid in owned[uid])),
            )
        )
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(units, key=lambda u: (u.fqn != ROOT, order.get(u.fqn, 0)))


def _module_at(model: nn.Module, fqn: str) -> nn.Module:
    return model.get_submodule(fqn) if fqn else model


# --------------------------------------------------------------------------------------------
# The plan-level check (no ranks; policies by name: policies.policy)
# --------------------------------------------------------------------------------------------


def verdict_plan(
    model: nn.Module,
    policy: Any,
    block_classes: Sequence[type[nn.Module]],
    min_params: int,
    what: str = "plan",
) -> Verdict:
    """The exact-unit-set claim on a plan (no process group; works on a meta model)."""
    expected = expected_units(model, block_classes, min_params)
    plan = plan_units(model, policy)
    diffs = unit_set_differences(expected, plan)
    figures = _unit_figures(plan)
    data = {"expected": [u.to_dict() for u in expected], "plan": [u.to_dict() for u in plan]}
    if diffs:
        return Verdict(False, format_unit_mismatch(what, expected, plan, diffs), figures, data)
    return Verdict(True, f"{what}: {len(plan)} units as expected", figures, data)


def _unit_figures(units: Sequence[UnitInfo]) -> dict[str, Any]:
    sizes = [u.numel for u in units if u.fqn != ROOT]
    return {
        "units": len(units),
        "largest_unit_numel": max(sizes, default=0),
        "root_numel": sum(u.numel for u in units if u.fqn == ROOT),
    }


# --------------------------------------------------------------------------------------------
# Shared rank-side helpers
# --------------------------------------------------------------------------------------------


def _build(spec: ModelSpec, ctx: RankContext, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return spec.build(ctx.device)


def fsdp1_options(model: nn.Module, unit_modules: Sequence[nn.Module]) -> dict[str, Any]:
    """FSDP1 keyword arguments a plan needs: ``use_orig_params=True`` for mixed requires_grad.

    With ``use_orig_params=False`` FSDP1 refuses to flatten a unit whose parameters mix
    frozen and trainable ones ("Must flatten tensors with uniform requires_grad"), which is the
    normal state of a LoRA block. FSDP2 has no flat parameter and needs nothing.
    """
    claimed: set[int] = set()
    for module in [*unit_modules, model]:
        own = [p for p in module.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        if len({p.requires_grad for p in own}) > 1:
            return {"use_orig_params": True}
    return {}


def _shard_named(
    model: nn.Module, ctx: RankContext, version: str, policy_obj: Any, **kwargs: Any
) -> nn.Module:
    if version == "fsdp1":
        kwargs = {**fsdp1_options(model, planned_unit_modules(model, policy_obj)), **kwargs}
    return shard(model, ctx, version, policy_obj, **kwargs)


def _param_shapes(model: nn.Module) -> dict[str, list[int]]:
    return {n: list(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}


def _unique_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------
# Check: exact unit set / plan equals actual / parameter accounting (one rank function)
# --------------------------------------------------------------------------------------------


def rank_units(
    ctx: RankContext,
    spec: ModelSpec,
    version: str = "fsdp1",
    policy: PolicyName = "recommended",
    apply_policy: PolicyName | None = None,
    unmanaged: str | None = None,
) -> dict[str, Any]:
    """Build, plan, shard and report the units as every rank sees them.

    ``policy`` is planned; ``apply_policy`` (default: the same) is applied, so a negative
    control can show a plan that does not describe what was applied. ``unmanaged`` names a
    parameter FSDP is told to leave alone (FSDP2 ``ignored_params``, FSDP1 ``ignored_states``):
    the negative control that shows the units are read from torch's state, not from the plan.
    FSDP2 ranks also report every parameter that is not a sharded DTensor managed by exactly
    one param group (``management``).
    """
    check_fsdp_version(version)
    model = _build(spec, ctx)
    ignored = _ignored_kwargs(model, version, unmanaged)
    blocks = spec.block_classes(model)
    min_params = spec.size_threshold(model)
    expected = expected_units(model, blocks, min_params)
    plan = plan_units(model, policies.policy(policy, model, blocks, min_params))
    shapes = _param_shapes(model)
    numel = _unique_numel(model)
    shared = shared_parameter_groups(model)
    applied = policies.policy(apply_policy or policy, model, blocks, min_params)
    sharded = _shard_named(model, ctx, version, applied, **ignored)
    actual = actual_units(sharded)
    management = fsdp2_management_problems(sharded) if version == "fsdp2" else []
    strategies = {}
    if version == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        strategies = {
            clean_fqn(n): _compat.fsdp1_sharding_strategy(m)
            for n, m in sharded.named_modules()
            if isinstance(m, FSDP)
        }
    return {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "version": version,
        "expected": [u.to_dict() for u in expected],
        "plan": [u.to_dict() for u in plan],
        "actual": [u.to_dict() for u in actual],
        "model_numel": numel,
        "param_shapes": shapes,
        "shared": shared,
        "strategies": strategies,
        "management": management,
    }


def _ignored_kwargs(model: nn.Module, version: str, fqn: str | None) -> dict[str, Any]:
    """The FSDP keyword arguments that leave the parameter ``fqn`` out of every unit."""
    if fqn is None:
        return {}
    names = dict(model.named_parameters())
    if fqn not in names:
        raise ValueError(f"unmanaged={fqn!r} is not a parameter of {type(model).__name__}; "
                         f"choose one of {', '.join(list(names)[:8])}, ...")
    if version == "fsdp1":
        return {"ignored_states": [names[fqn]]}
    return {"ignored_params": {names[fqn]}}


def _units(value: Mapping[str, Any], key: str) -> list[UnitInfo]:
    return [UnitInfo.from_dict(d) for d in value[key]]


def _rank_disagreement(values: Sequence[Mapping[str, Any]], key: str) -> str | None:
    """Ranks must agree on the unit structure (fqn, class, numel, parent)."""
    shapes = [
        [(u.fqn, u.cls, u.numel, u.parent) for u in _units(v, key)] for v in values
    ]
    for v, s in zip(values[1:], shapes[1:]):
        if s != shapes[0]:
            return (
                f"ranks disagree on the {key} units: rank 0 and rank {v['rank']} differ\n"
                + format_unit_tree(_units(values[0], key), "rank 0:")
                + "\n"
                + format_unit_tree(_units(v, key), f"rank {v['rank']}:")
            )
    return None


def _management_problems(values: Sequence[Mapping[str, Any]]) -> list[str]:
    """Parameters outside every unit (names in no unit's parameters, a tied weight counted by
    any of its names), and FSDP2's own findings (``fsdp2_management_problems``), per rank;
    identical findings from several ranks told once."""
    by_story: dict[str, list[int]] = {}
    for v in values:
        covered = {n for u in _units(v, "actual") for n in u.params}
        tied = {n: set(g) for g in v.get("shared", []) for n in g}
        for name in v.get("param_shapes", {}):
            if name not in covered and not tied.get(name, set()) & covered:
                by_story.setdefault(f"parameter {name} is in no unit ({v['version']} did not "
                                    "take it)", []).append(v["rank"])
        for line in v.get("management", []):
            by_story.setdefault(line, []).append(v["rank"])
    out = []
    for story, ranks in by_story.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        out.append(f"{who}: {story}")
    return out


def verdict_units_exact(values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Verdict:
    """Every rank's actual units equal the claim's expected units."""
    by_story: dict[str, list[int]] = {}  # identical failures from several ranks told once
    for v in values:
        expected, actual = _units(v, "expected"), _units(v, "actual")
        diffs = unit_set_differences(expected, actual)
        if diffs:
            story = format_unit_mismatch(
                f"{v['version']}, policy {params.get('policy')!r}", expected, actual, diffs)
            by_story.setdefault(story, []).append(v["rank"])
    failures = [f"ranks {', '.join(map(str, r))}: {story}" for story, r in by_story.items()]
    managed = _management_problems(values)
    if managed:
        failures.append("parameters not managed as one sharded unit each:\n  "
                        + "\n  ".join(managed))
    disagreement = _rank_disagreement(values, "actual")
    if disagreement:
        failures.append(disagreement)
    actual0 = _units(values[0], "actual")
    data = {"actual": values[0]["actual"], "expected": values[0]["expected"]}
    if failures:
        return Verdict(False, "unit set differs from the claim\n" + "\n\n".join(failures),
                       _unit_figures(actual0), data)
    return Verdict(
        True,
        f"{len(actual0)} units, each block exactly one unit, on all {len(values)} ranks",
        _unit_figures(actual0),
        data,
    )


def verdict_units_plan(
    values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]
) -> Verdict:
    """The plan computed without a process group equals the actual units on every rank."""
    managed = _management_problems(values)
    for v in values:
        plan, actual = _units(v, "plan"), _units(v, "actual")
        diffs = unit_differences(plan, actual, ("cls", "numel", "parent"))
        if diffs or managed:
            diffs += [f"! {line}" for line in managed]
            what = f"rank {v['rank']}: plan vs actual ({v['version']})"
            return Verdict(False, format_unit_mismatch(what, plan, actual, diffs),
                           {"units": len(actual)}, {"plan": v["plan"], "actual": v["actual"]})
    return Verdict(True, f"plan equals actual ({len(values[0]['plan'])} units) on every rank",
                   {"units": len(values[0]["plan"])}, {"plan": values[0]["plan"]})


def expected_local_numel(
    unit: UnitInfo, rank: int, world_size: int, version: str, strategy: str,
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


def _unit_count_problems(values: Sequence[Mapping[str, Any]]) -> list[str]:
    # Every rank's own units: a rank that miscounts or splits a tied weight fails the check
    # even when rank 0 is right (identical findings from several ranks are told once).
    problems: list[str] = []
    by_story: dict[str, list[int]] = {}
    for v in values:
        units = _units(v, "actual")
        rank_total = sum(u.numel for u in units)
        if rank_total != v["model_numel"]:
            why = ("more: a weight is counted in two units" if rank_total > v["model_numel"]
                   else "fewer: parameters are outside every unit")
            by_story.setdefault(
                f"units hold {rank_total:,} parameters, the model has {v['model_numel']:,} "
                f"({why})", []).append(v["rank"])
        for group in v["shared"]:
            holding = sorted({u.fqn or "(root)" for u in units if set(u.params) & set(group)})
            if len(holding) != 1:
                by_story.setdefault(
                    f"tied weight {' = '.join(group)} is in {len(holding)} units "
                    f"({', '.join(holding) or 'none'}): it must be in exactly one", []
                ).append(v["rank"])
    for story, ranks in by_story.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        problems.append(f"{who}: {story}")
    return problems


def verdict_units_accounting(
    values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]
) -> Verdict:
    """Numels add up; each tied weight in one unit; every rank's shard sizes as expected."""
    problems: list[str] = []
    v0 = values[0]
    actual0 = _units(v0, "actual")
    total = sum(u.numel for u in actual0)
    problems += _unit_count_problems(values)
    problems += _management_problems(values)
    shard_rows: list[tuple[int, str, int]] = []
    for v in values:
        for u in _units(v, "actual"):
            strategy = v["strategies"].get(u.fqn, "FULL_SHARD")
            want = expected_local_numel(u, v["rank"], v["world_size"], v["version"], strategy,
                                        v["param_shapes"])
            if u.local_numel != want:
                problems.append(
                    f"rank {v['rank']}: unit {u.fqn or '(root)'} holds a local shard of "
                    f"{u.local_numel:,} elements, expected {want:,} "
                    f"({u.numel:,} params over {v['world_size']} ranks, {v['version']})"
                )
            if u.local_numel is None:  # unreachable: formatting None above already raised
                raise TypeError(f"unit {u.fqn or '(root)'} has no local shard numel")
            shard_rows.append((v["rank"], u.fqn, u.local_numel))
    for u in actual0:
        held = sum(n for _, fqn, n in shard_rows if fqn == u.fqn)
        if held < u.numel and not problems:
            problems.append(f"unit {u.fqn or '(root)'}: the ranks' shards hold {held:,} < "
                            f"{u.numel:,} elements")
    padding = sum(n for *_, n in shard_rows) - total
    figures = {"model_numel": v0["model_numel"], "units_numel": total, "padding": padding}
    if problems:
        return Verdict(False, "parameter accounting failed:\n  " + "\n  ".join(problems)
                       + "\n\n" + format_unit_tree(actual0, "actual units (rank 0):"), figures,
                       {"actual": v0["actual"]})
    return Verdict(True, f"{total:,} parameters in {len(actual0)} units; shards on every rank "
                   f"as expected ({padding:,} padding elements in all)", figures, {})


# --------------------------------------------------------------------------------------------
# Check: torch's builders give their documented result
# --------------------------------------------------------------------------------------------

BUILDERS = ("transformer", "size", "lambda", "or", "module_wrap", "custom")


def _builder_policy(builder: str, model: nn.Module, blocks: tuple[type[nn.Module], ...],
                    min_params: int, head: nn.Module) -> Any:
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import (
        CustomPolicy,
        ModuleWrapPolicy,
        lambda_auto_wrap_policy,
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    def is_head(m: nn.Module) -> bool:
        return m is head

    if builder == "transformer":
        return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=set(blocks))
    if builder == "size":
        return functools.partial(size_based_auto_wrap_policy, min_num_params=min_params)
    if builder == "lambda":
        return functools.partial(lambda_auto_wrap_policy, lambda_fn=is_head)
    if builder == "or":
        return functools.partial(
            _compat.or_policy(),
            policies=[
                functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=set(blocks)),
                functools.partial(lambda_auto_wrap_policy, lambda_fn=is_head),
            ],
        )
    if builder == "module_wrap":
        return ModuleWrapPolicy({nn.Linear})
    if builder == "custom":
        no_shard = {"sharding_strategy": ShardingStrategy.NO_SHARD}
        return CustomPolicy(lambda m: no_shard if m is head else isinstance(m, blocks))
    raise PolicyError(f"unknown builder {builder!r}; choose one of {', '.join(BUILDERS)}")


def documented_unit_modules(
    builder: str, model: nn.Module, blocks: tuple[type[nn.Module], ...], min_params: int,
    head: nn.Module,
) -> tuple[list[str], dict[str, str]]:
    """What torch's documentation says each builder wraps (FQNs), and per-unit strategies.

    * transformer: every instance of the given classes (nested ones too);
    * size: bottom-up, a non-container module whose not-yet-wrapped parameters reach the
      threshold; * lambda: modules for which the function is true; * or: the union;
    * ModuleWrapPolicy({Linear}): every Linear; * CustomPolicy: modules for which the function
      is truthy, a dict return overriding that unit's FSDP arguments (here NO_SHARD).
    """
    names = {id(m): n for n, m in model.named_modules()}
    head_name = names[id(head)]
    block_names = [names[id(m)] for m in model.modules() if isinstance(m, blocks)]
    if builder == "transformer":
        return block_names, {}
    if builder == "lambda":
        return [head_name], {}
    if builder == "or":
        return sorted({*block_names, head_name}), {}
    if builder == "module_wrap":
        return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)], {}
    if builder == "custom":
        return [*block_names, head_name], {head_name: "NO_SHARD"}
    if builder == "size":
        chosen: list[str] = []

        def visit(module: nn.Module) -> int:  # returns not-yet-wrapped numel in the subtree
            free = sum(visit(c) for c in module.children())
            free += sum(p.numel() for p in module.parameters(recurse=False))
            if module is not model and free >= min_params and not isinstance(module, CONTAINERS):
                chosen.append(names[id(module)])
                return 0
            return free

        visit(model)
        return chosen, {}
    raise PolicyError(f"unknown builder {builder!r}; choose one of {', '.join(BUILDERS)}")


def rank_builders(
    ctx: RankContext, builder: str, reference: str = "massive", head: str = "head",
    claimed_builder: str | None = None,
) -> dict[str, Any]:
    """Shard a small reference model with FSDP1 under one of torch's builders.

    ``claimed_builder`` (default: ``builder``) names the builder whose documented result is
    expected, so a negative control can apply one builder and claim another.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    spec = ModelSpec(reference=reference)
    model = _build(spec, ctx)
    blocks = spec.block_classes(model)
    min_params = spec.size_threshold(model)
    head_module = model.get_submodule(head)
    fqns, strategies = documented_unit_modules(
        claimed_builder or builder, model, blocks, min_params, head_module
    )
    from fsdp_conformance.units import units_for_modules

    documented = units_for_modules(model, [model.get_submodule(f) for f in fqns])
    sharded = shard(model, ctx, "fsdp1",
                    _builder_policy(builder, model, blocks, min_params, head_module))
    actual = actual_units(sharded)
    actual_strategies = {
        clean_fqn(n): _compat.fsdp1_sharding_strategy(m)
        for n, m in sharded.named_modules() if isinstance(m, FSDP)
    }
    return {
        "rank": ctx.rank, "world_size": ctx.world_size, "builder": claimed_builder or builder,
        "documented": [u.to_dict() for u in documented], "actual": [u.to_dict() for u in actual],
        "documented_strategies": strategies, "strategies": actual_strategies,
    }


def verdict_builders(values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Verdict:
    """Every rank's units equal the builder's documented result, per-unit overrides included."""
    for v in values:
        documented, actual = _units(v, "documented"), _units(v, "actual")
        diffs = unit_differences(documented, actual, ("cls", "numel", "parent"))
        for fqn, want in v["documented_strategies"].items():
            got = v["strategies"].get(fqn)
            if got != want:
                diffs.append(f"~ unit {fqn}: sharding strategy expected {want}, got {got}")
            unit = next((u for u in actual if u.fqn == fqn), None)
            if unit is not None and want == "NO_SHARD" and unit.local_numel != unit.numel:
                diffs.append(f"~ unit {fqn}: NO_SHARD but rank {v['rank']} holds "
                             f"{unit.local_numel:,} of {unit.numel:,}")
        if diffs:
            return Verdict(False, format_unit_mismatch(
                f"rank {v['rank']}: builder {v['builder']!r} vs its documented result",
                documented, actual, diffs), {"units": len(actual)}, {"actual": v["actual"]})
    return Verdict(True, f"builder {values[0]['builder']!r}: {len(values[0]['actual'])} units as "
                   "documented on every rank", {"units": len(values[0]["actual"])}, {})


# --------------------------------------------------------------------------------------------
# Check: training steps under FSDP equal a single-process reference
# --------------------------------------------------------------------------------------------

#: Deliberate misconfigurations for negative controls (plain-data switch on the rank function).
FAULTS = {
    "unsynced_root": "parameters outside the planned units are left out of FSDP (FSDP1 "
    "ignored_modules, FSDP2 no fully_shard on the root): their gradients are never reduced",
    "params_bf16": "the model is cast to bf16 before wrapping: parameters are no longer fp32",
    "no_mixed_precision": "bf16 is claimed but no mixed-precision policy is passed",
    "uniform": "every unit FULL_SHARD bf16 (the seeds' configuration), no per-unit override",
    "summed_grads": "each rank applies the sum of the ranks' gradients instead of their mean "
    "(every gradient multiplied by the world size after FSDP reduced it)",
    "permuted_shard": "the last rank's local shard of the largest parameter is permuted after "
    "sharding (its elements rolled by one)",
    "skipped_reduction": "every gradient reduce-scatter is skipped: each rank keeps its own "
    "chunk of its own gradient, divided as FSDP divides the reduced one",
}


@contextlib.contextmanager
def _skip_reduce_scatter(world_size: int, rank: int) -> Iterator[None]:
    """The ``skipped_reduction`` fault: ``torch.distributed``'s reduce-scatters (looked up at
    call time by FSDP1 and FSDP2, as in ``step.collectives_release_in_order``) copy this rank's
    chunk of the input instead of reducing across ranks; an AVG (FSDP2) divides by nothing."""
    import torch.distributed as dist

    def local(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        output.copy_(input.reshape(world_size, -1)[rank].view_as(output))

    names = ("reduce_scatter_single", "reduce_scatter_tensor")
    originals = {n: getattr(dist, n) for n in names if hasattr(dist, n)}
    try:
        for n in originals:
            setattr(dist, n, local)
        yield
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)


def _mp_kwargs(version: str, precision: str) -> dict[str, Any]:
    if precision != "bf16":
        return {}
    if version == "fsdp1":
        from torch.distributed.fsdp import MixedPrecision

        return {"mixed_precision": MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)}
    mp = _compat.mixed_precision_policy_cls()
    return {"mp_policy": mp(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)}


@contextlib.contextmanager
def record_compute_dtypes(model: nn.Module, seen: dict[str, tuple[str, str]]) -> Iterator[None]:
    """Record, per module with a matrix ``weight`` of its own (Linear, Embedding, and the like:
    GPT-2's ``Conv1D``), the (input, weight) dtypes its forward actually sees.

    Registered on the original modules: under FSDP their ``weight`` during forward is the
    unsharded (and, with mixed precision, cast) parameter, so this is the compute dtype.
    """
    handles = []
    for raw_name, module in model.named_modules():
        weight = dict(module.named_parameters(recurse=False)).get("weight")
        if isinstance(module, (nn.Linear, nn.Embedding)) or (
                weight is not None and weight.dim() >= 2):
            name = clean_fqn(raw_name)  # FSDP1 inserts its wrapper into the module names

            def pre(mod: nn.Module, args: tuple[Any, ...], name: str = name) -> None:
                if name not in seen and args and isinstance(args[0], torch.Tensor):
                    seen[name] = (str(args[0].dtype), str(mod.weight.dtype))
            handles.append(module.register_forward_pre_hook(pre))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _full_params(sharded: nn.Module, version: str) -> dict[str, torch.Tensor]:
    if version == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(sharded, writeback=False):
            return {clean_fqn(n): p.detach().float().clone() for n, p in sharded.named_parameters()}
    dtensor = _compat.dtensor_cls()
    return {
        n: (p.full_tensor() if isinstance(p, dtensor) else p).detach().float().clone()
        for n, p in sharded.named_parameters()
    }


def _sgd_step(model: nn.Module, lr: float, grad_factor: float = 1) -> None:
    """Plain SGD, written out: the same arithmetic on sharded (DTensor / flat) and full
    parameters, without torch.optim's first-use import cost on every rank. ``grad_factor``
    (the world size) turns FSDP's averaged gradient into the sum: the ``summed_grads`` fault."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr * grad_factor)
                p.grad = None


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """Floating tensors in ``value`` (nested tuples, lists, mappings) cast to ``dtype``: what
    FSDP's ``_cast_forward_inputs`` does to a unit's arguments."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if torch.is_floating_point(value) else value
    if isinstance(value, Mapping):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    return value


def gradient_divide_factors(version: str, world_size: int) -> tuple[float, float]:
    """(pre, post) division of the gradient around the bf16 reduction, as torch 2.13 does it.

    FSDP1 (``_init_utils``, ``DefaultState._get_gradient_predivide_factor``): the gradient is
    divided by the smallest power of two ``f`` with ``f >= world_size / f`` before the
    reduce-scatter (a sum) and by ``world_size / f`` after it. FSDP2
    (``_fsdp_collectives._get_gradient_divide_factors``): for a bf16 or fp32 reduce dtype and no
    ``gradient_divide_factor``, one ``ReduceOp.AVG`` reduce-scatter: the sum divided by the
    world size.
    """
    if version == "fsdp2":
        return 1.0, float(world_size)
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return float(pre), world_size / pre


class MixedPrecisionReference:
    """The single-process reference computing as FSDP's bf16 mixed precision does.

    FSDP (both versions, torch 2.13; docs/wrapping.md, "bf16 parity") keeps fp32 master
    weights, casts a bf16 copy for forward and backward, casts floating inputs to bf16 at the
    root (FSDP1, ``cast_root_forward_inputs``) or at every unit (FSDP2, ``cast_forward_inputs``),
    FSDP1 also casts floating buffers (``buffer_dtype``), reduces each rank's bf16 gradient in
    bf16 divided by :func:`gradient_divide_factors`, casts the reduced gradient to fp32 and
    steps on the fp32 master. The reference repeats each of these steps for every rank's slice
    of the batch in this one process. The ranks' bf16 gradients are summed in the order gloo's
    ring reduce-scatter sums them (measured on torch 2.13: the chunk that rank ``k`` receives is
    ``((g[k-1] + g[k-2]) + ...) + g[k]``, ranks modulo the world size, rounded to bf16 after
    each addition), element by element according to ``owners`` (:func:`element_owners`).
    """

    def __init__(self, master: nn.Module, version: str, unit_names: Sequence[str],
                 owners: Mapping[str, torch.Tensor]) -> None:
        self.master, self.version, self.owners = master, version, owners
        self.low = copy.deepcopy(master)
        for p in self.low.parameters():
            p.data = p.data.to(torch.bfloat16)
        if version == "fsdp1":
            for b in self.low.buffers():
                if torch.is_floating_point(b):
                    b.data = b.data.to(torch.bfloat16)
        modules = dict(self.low.named_modules())
        casting = [""] if version == "fsdp1" else ["", *unit_names]
        for name in dict.fromkeys(casting):
            modules[name].register_forward_pre_hook(self._cast_inputs, with_kwargs=True)

    @staticmethod
    def _cast_inputs(module: nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[Any, Any]:
        return _cast_floats(args, torch.bfloat16), _cast_floats(kwargs, torch.bfloat16)

    def step(self, slices: Sequence[Any], lr: float) -> float:
        """One step on the ranks' ``slices``; returns the mean of their losses (what the
        FSDP side reports)."""
        with torch.no_grad():
            for low, master in zip(self.low.parameters(), self.master.parameters()):
                low.copy_(master)
        grads: list[list[torch.Tensor | None]] = []
        losses = []
        for rows in slices:
            loss = default_loss(call_model(self.low, rows))
            loss.backward()
            losses.append(float(loss))
            grads.append([p.grad for p in self.low.parameters()])
            self.low.zero_grad(set_to_none=True)
        world = len(slices)
        pre, post = gradient_divide_factors(self.version, world)
        with torch.no_grad():
            for i, (name, master) in enumerate(self.master.named_parameters()):
                if any(g[i] is None for g in grads):
                    continue
                owner = self.owners[name]
                reduced = torch.zeros_like(master, dtype=torch.bfloat16)
                for k in owner.unique().tolist():
                    order = [(k - 1 - j) % world for j in range(world)]  # k-1, k-2, ..., k
                    total = grads[order[0]][i] / pre
                    for r in order[1:]:
                        total = total + grads[r][i] / pre
                    reduced = torch.where(owner == k, total, reduced)
                master.add_((reduced / post).float(), alpha=-lr)
        return sum(losses) / len(losses)


def _reference_step(reference: nn.Module, mixed: MixedPrecisionReference | None, batch: Any,
                    per_rank_batch: int, world_size: int, lr: float) -> float:
    """One step of the reference: fp32 on the whole batch, or as FSDP's mixed precision does on
    each rank's slice."""
    if mixed is not None:
        return mixed.step([batch_rows(batch, r * per_rank_batch, (r + 1) * per_rank_batch)
                           for r in range(world_size)], lr)
    loss = default_loss(call_model(reference, batch))
    loss.backward()
    _sgd_step(reference, lr)
    return float(loss)


def _backward_fault(ctx: RankContext, fault: str | None) -> contextlib.AbstractContextManager[Any]:
    if fault == "skipped_reduction":
        return _skip_reduce_scatter(ctx.world_size, ctx.rank)
    return contextlib.nullcontext()


def element_owners(sharded: nn.Module, version: str, rank: int) -> dict[str, torch.Tensor]:
    """The rank holding each element of each parameter (the rank that receives its reduced
    gradient), observed: every rank fills its local shard with its rank, the gathered full
    parameters then hold the owners; the shards are restored."""
    shards = [_local(p) for p in sharded.parameters()]
    with torch.no_grad():
        saved = [t.clone() for t in shards]
        for t in shards:
            t.fill_(rank)
    owners = {n: v.round().long() for n, v in _full_params(sharded, version).items()}
    with torch.no_grad():
        for t, s in zip(shards, saved):
            t.copy_(s)
    return owners


def rank_train(
    ctx: RankContext,
    spec: ModelSpec,
    version: str = "fsdp1",
    policy: PolicyName = "recommended",
    precision: str = "fp32",
    steps: int = 3,
    lr: float = 0.05,
    per_rank_batch: int = 2,
    fault: str | None = None,
) -> dict[str, Any]:
    """Train ``steps`` SGD steps under FSDP and on a single-process reference; report both.

    Each rank trains on its slice of one global batch; the reference trains on the whole
    batch. FSDP averages gradients over ranks, so with equal slices the two see the same
    gradient. Every rank builds the same reference from the same seed.
    """
    check_fsdp_version(version)
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; choose one of {', '.join(FAULTS)}")
    reference = _build(spec, ctx)
    # Like with like: both sides without dropout (step.disable_dropout says why not eval()).
    dropout = disable_dropout(reference)
    model = copy.deepcopy(reference)
    initial = {n: p.detach().float().clone() for n, p in reference.named_parameters()}
    batch = _comparable_batch(spec, reference, per_rank_batch * ctx.world_size, ctx, dropout)
    mine = batch_rows(batch, ctx.rank * per_rank_batch, (ctx.rank + 1) * per_rank_batch)
    blocks = spec.block_classes(model)
    policy_obj = policies.policy(policy, model, blocks, spec.size_threshold(model))

    kwargs = {} if fault == "no_mixed_precision" else _mp_kwargs(version, precision)
    if fault == "params_bf16":
        model = model.to(torch.bfloat16)
    units = planned_unit_modules(model, policy_obj)
    module_names = {id(m): n for n, m in model.named_modules()}
    unit_names = [module_names[id(u)] for u in units]
    if fault == "unsynced_root":
        covered = {id(m) for u in units for m in u.modules()}
        outside = [m for m in model.modules() if id(m) not in covered and m is not model
                   and any(True for _ in m.parameters(recurse=False))]
        if version == "fsdp1":
            sharded = _shard_named(model, ctx, version, policy_obj, ignored_modules=outside,
                                   **kwargs)
        else:  # blocks sharded, the root (and what only it holds) left as plain tensors
            fully_shard = _compat.fully_shard()
            mesh = device_mesh(ctx)
            for u in sorted(units, key=lambda m: -len([*m.modules()])):
                fully_shard(u, mesh=mesh, **kwargs)
            sharded = model
    else:
        sharded = _shard_named(model, ctx, version, policy_obj, **kwargs)
    mixed = (MixedPrecisionReference(reference, version, unit_names,
                                     element_owners(sharded, version, ctx.rank))
             if precision == "bf16" else None)
    if fault == "permuted_shard":
        _permute_largest_shard(sharded, ctx)

    seen: dict[str, tuple[str, str]] = {}
    losses, ref_losses = [], []
    for _ in range(steps):
        with record_compute_dtypes(model, seen):
            loss = default_loss(call_model(sharded, mine))
        with _backward_fault(ctx, fault):
            loss.backward()
        _sgd_step(sharded, lr, ctx.world_size if fault == "summed_grads" else 1)
        losses.append(float(loss))
        ref_losses.append(_reference_step(reference, mixed, batch, per_rank_batch,
                                          ctx.world_size, lr))
    stored = sorted({str(p.dtype) for p in sharded.parameters()})
    full = _full_params(sharded, version)
    ref_params = dict(reference.named_parameters())
    # Absolute difference, and difference relative to the reference's own update: a weight
    # that missed its gradient reduction is off by a fraction of its (maybe tiny) update.
    worst, worst_name, worst_rel, worst_rel_name = 0.0, "", 0.0, ""
    along, ref_norm = 0.0, 0.0  # the sharded update projected on the reference's, and its norm
    for name, value in full.items():
        if not value.numel():
            continue
        target = ref_params[name].detach().float()
        diff = float((value - target).abs().max())
        ref_update = target - initial[name]
        along += float(((value - initial[name]) * ref_update).sum())
        ref_norm += float((ref_update * ref_update).sum())
        update = float(ref_update.abs().max())
        rel = diff / update if update > 0 else 0.0
        if diff > worst:
            worst, worst_name = diff, name
        if rel > worst_rel:
            worst_rel, worst_rel_name = rel, name
    return {
        "rank": ctx.rank, "version": version, "precision": precision, "losses": losses,
        "ref_losses": ref_losses, "max_param_diff": worst, "worst_param": worst_name,
        "max_update_rel_diff": worst_rel, "worst_update_param": worst_rel_name,
        # The scale that best maps the reference's update onto the sharded one (least squares
        # over every parameter): 1 when they agree, the world size when gradients were summed.
        "update_factor": along / ref_norm if ref_norm > 0 else None,
        "stored_dtypes": stored, "compute_dtypes": seen, "dropout_disabled": dropout,
        "backend": ctx.backend,
    }


def _local(p: torch.Tensor) -> torch.Tensor:
    dtensor = _compat.dtensor_cls()
    return p.to_local() if isinstance(p, dtensor) else p


def _comparable_batch(spec: ModelSpec, reference: nn.Module, batch_size: int, ctx: RankContext,
                      dropout: Sequence[str]) -> Any:
    """The global batch, once the reference is known to compute the same thing twice."""
    batch = spec.batch(reference, batch_size=batch_size, device=ctx.device)
    randomness = forward_randomness(reference, batch)
    if randomness > DETERMINISM_RTOL:
        # The same model and seeds on every rank: every rank observes this alike and skips.
        skip_rank(
            f"{type(reference).__name__}'s forward in training mode still draws random numbers "
            f"after dropout was disabled ({len(dropout)} modules): two calls on the same input "
            f"differ by {randomness:.1e} (relative), so a sharded step cannot be compared with "
            "the single-process reference. Make the randomness switchable: an nn.Dropout "
            "module, or a float attribute named like '*dropout*' read when self.training")
    return batch


def _permute_largest_shard(sharded: nn.Module, ctx: RankContext) -> None:
    if ctx.rank != ctx.world_size - 1:
        return
    with torch.no_grad():
        largest = max(sharded.parameters(), key=lambda p: _local(p).numel())
        local = _local(largest)
        local.copy_(local.flatten().roll(1).view_as(local))


#: How close (relative) the update factor must be to a named cause for the message to name it.
FACTOR_MATCH_RTOL = 0.02


def update_diagnosis(factor: float | None, world_size: int) -> str:
    """What the scale between the sharded and the reference update says, in words.

    Summed instead of averaged gradients scale every update by the world size; averaged twice,
    by its inverse; a gradient never applied, by 0. Any other factor is named as measured.
    """
    if factor is None:
        return "the reference made no update to compare with"
    causes = [(float(world_size), f"= the world size ({world_size}): gradients summed across "
               "ranks, not averaged"),
              (1.0 / world_size, f"= 1 / the world size ({world_size}): gradients averaged "
               "twice"),
              (1.0, "the same scale: the difference is in the direction (a permuted shard, a "
               "gradient reduced over the wrong ranks or elements)")]
    head = f"the sharded update is {factor:.2f}x the reference's (least squares over all weights)"
    if abs(factor) < FACTOR_MATCH_RTOL:
        return f"{head}: no update reached the weights (gradients lost or never applied)"
    for value, cause in causes:
        if abs(factor - value) <= FACTOR_MATCH_RTOL * value:
            return f"{head} {cause}" if cause.startswith("=") else f"{head}: {cause}"
    return head


def verdict_train(values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Verdict:
    """Losses (mean over ranks) and final full weights match the reference within tolerance;
    under bf16, every Linear computed in bf16 and every stored parameter stayed fp32."""
    precision = params.get("precision", "fp32")
    loss_rtol = BF16_LOSS_RTOL if precision == "bf16" else FP32_LOSS_RTOL
    param_atol = BF16_PARAM_ATOL if precision == "bf16" else FP32_ATOL
    problems = []
    steps = len(values[0]["losses"])
    worst_loss = 0.0
    for step in range(steps):
        fsdp = sum(v["losses"][step] for v in values) / len(values)
        ref = values[0]["ref_losses"][step]
        rel = abs(fsdp - ref) / max(abs(ref), 1e-12)
        worst_loss = max(worst_loss, rel)
        if rel > loss_rtol:
            problems.append(f"step {step}: loss {fsdp:.6g} (mean over ranks) vs reference "
                            f"{ref:.6g}: relative difference {rel:.2e} > {loss_rtol:.1e}")
    worst_param = max(v["max_param_diff"] for v in values)
    worst_update = max(v["max_update_rel_diff"] for v in values)
    update_rtol = BF16_UPDATE_RTOL if precision == "bf16" else FP32_UPDATE_RTOL
    for v in values:
        if v["max_update_rel_diff"] > update_rtol:
            problems.append(
                f"rank {v['rank']}: {v['worst_update_param']}'s update differs from the "
                f"reference's by {v['max_update_rel_diff']:.2e} of the update > "
                f"{update_rtol:.1e}; {update_diagnosis(v.get('update_factor'), len(values))}")
        if v["max_param_diff"] > param_atol:
            problems.append(f"rank {v['rank']}: after {steps} steps {v['worst_param']} differs "
                            f"from the reference by {v['max_param_diff']:.2e} > {param_atol:.0e}")
        if v["stored_dtypes"] != ["torch.float32"]:
            problems.append(f"rank {v['rank']}: stored parameters are {v['stored_dtypes']}, "
                            "expected float32 only")
        if precision == "bf16":
            # Integer inputs (token ids into an embedding) have no compute dtype of their own.
            bad = sorted(
                n for n, (inp, weight) in v["compute_dtypes"].items()
                if weight != "torch.bfloat16"
                or (inp.startswith(("torch.float", "torch.bfloat")) and inp != "torch.bfloat16")
            )
            if bad:
                problems.append(f"rank {v['rank']}: compute did not run in bf16 in "
                                f"{len(bad)} module(s), e.g. {bad[0]}: input/weight "
                                f"{v['compute_dtypes'][bad[0]]}")
    if (precision == "bf16" and worst_update > update_rtol and len(values) > 2
            and values[0].get("backend", "gloo") != "gloo"):
        problems.append(f"note: the reference sums the ranks' bf16 gradients in gloo's ring "
                        f"order; {values[0]['backend']}'s order at world size {len(values)} is "
                        "not modelled and may alone account for the update difference")
    dropout = values[0].get("dropout_disabled", [])
    figures = {"loss_rel_diff": worst_loss, "max_param_diff": worst_param,
               "update_rel_diff": worst_update, "steps": steps, "dropout_disabled": len(dropout)}
    # Said in both outcomes: the comparison was of the model without its dropout.
    note = (f"; dropout disabled for the comparison: {len(dropout)} modules "
            f"({_listing(dropout)})" if dropout else "")
    if problems:
        return Verdict(False, f"{precision} training under FSDP differs from the reference"
                       f"{note}:\n  " + "\n  ".join(dict.fromkeys(problems)), figures,
                       {"dropout_disabled": dropout})
    return Verdict(True, f"{steps} {precision} steps match the reference (loss rel {worst_loss:.1e}"
                   f" <= {loss_rtol:.1e}, params {worst_param:.1e} <= {param_atol:.0e}, update "
                   f"rel {worst_update:.1e} <= {update_rtol:.1e}){note}",
                   figures, {"dropout_disabled": dropout})


def _listing(names: Sequence[str], shown: int = 3) -> str:
    more = f", and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


# --------------------------------------------------------------------------------------------
# Check: the second seed's mixed configuration
# --------------------------------------------------------------------------------------------


def _embedding_fqn(model: nn.Module, blocks: tuple[type[nn.Module], ...]) -> str:
    inside = {id(s) for m in model.modules() if isinstance(m, blocks) for s in m.modules()}
    named: Iterable[tuple[str, nn.Module]] = model.named_modules()  # torch leaves it untyped
    for name, module in named:
        if isinstance(module, nn.Embedding) and id(module) not in inside:
            return name
    raise PolicyError(f"{type(model).__name__} has no nn.Embedding outside its blocks: the "
                      "mixed configuration needs an embedding table (pass embedding=<fqn>)")


def fsdp2_unit_strategies(sharded: nn.Module) -> dict[str, str]:
    """Per FSDP2 unit: "NO_SHARD" when every parameter is whole on each rank (replicated, or
    sharded over a mesh dimension of size 1), else "FULL_SHARD"; read from DTensor placements."""
    dtensor = _compat.dtensor_cls()
    # Every name of a tied parameter: each module of a multi-module unit reports its own.
    placements = {n: p for n, p in sharded.named_parameters(remove_duplicate=False)
                  if isinstance(p, dtensor)}
    out = {}
    for u in actual_units(sharded):
        whole = [
            all(type(pl).__name__ == "Replicate" or size == 1
                for pl, size in zip(placements[n].placements, placements[n].device_mesh.shape))
            for n in u.params if n in placements
        ]
        if whole:
            out[u.fqn] = "NO_SHARD" if all(whole) else "FULL_SHARD"
    return out


def rank_mixed(
    ctx: RankContext,
    spec: ModelSpec,
    version: str = "fsdp1",
    embedding: str | None = None,
    fault: str | None = None,
) -> dict[str, Any]:
    """The embedding its own unit, NO_SHARD in fp32; blocks FULL_SHARD in bf16; one step.

    FSDP1: ``CustomPolicy`` whose function returns per-unit overrides for the embedding.
    FSDP2: ``fully_shard`` per unit; the embedding on a (world, 1) mesh (replicated across
    ranks, "sharded" over one: FSDP2's NO_SHARD), with no mixed precision.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import CustomPolicy

    check_fsdp_version(version)
    if ctx.world_size == 1:  # every rank alike: the world size is the same everywhere
        skip_rank("the mixed configuration needs world size >= 2: at one rank FULL_SHARD and "
                  "NO_SHARD are the same layout (FSDP1 switches every unit to NO_SHARD; FSDP2's "
                  "shards over a mesh of one are whole), so the per-unit strategies cannot differ")
    model = _build(spec, ctx)
    blocks = spec.block_classes(model)
    try:
        emb_name = embedding or _embedding_fqn(model, blocks)
    except PolicyError as exc:  # every rank builds the same model: all ranks skip alike
        skip_rank(f"the second seed's mixed configuration does not apply: {exc}")
    emb = model.get_submodule(emb_name)
    block_names = [n for n, m in model.named_modules() if isinstance(m, blocks)]
    tied = tied_partners(model, emb)
    _skip_untiable(model, emb_name, tied, blocks, version)
    uniform = fault == "uniform"
    sharded: nn.Module  # FSDP1 wrapper or the fully_shard-ed model
    if version == "fsdp1":
        override = {} if uniform else {"sharding_strategy": ShardingStrategy.NO_SHARD,
                                       "mixed_precision": None}
        policy = CustomPolicy(
            lambda m: (override or True) if m is emb else isinstance(m, blocks))
        sharded = FSDP(model, auto_wrap_policy=policy, device_id=ctx.device,
                       mixed_precision=MixedPrecision(
                           param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                           buffer_dtype=torch.bfloat16, cast_forward_inputs=True))
        strategies = {clean_fqn(n): _compat.fsdp1_sharding_strategy(m)
                      for n, m in sharded.named_modules() if isinstance(m, FSDP)}
    else:
        from torch.distributed.device_mesh import init_device_mesh

        mp = _compat.mixed_precision_policy_cls()
        bf16 = {"mp_policy": mp(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)}
        # fp32 named, not left unset: a tied head receives the blocks' bf16 activations, and
        # only a set param_dtype makes FSDP2 cast a unit's forward inputs to it.
        emb_kwargs: dict[str, Any] = {**bf16, "mesh": device_mesh(ctx)} if uniform else {
            "mp_policy": mp(param_dtype=torch.float32),
            "mesh": init_device_mesh(ctx.device_type, (ctx.world_size, 1),
                                     mesh_dim_names=("replicate", "shard"))}
        # Tied modules share the embedding's unit: FSDP2 takes several modules as one unit.
        emb_unit = [emb, *(model.get_submodule(n) for n in tied)]
        _compat.fully_shard()(emb_unit if tied else emb, **emb_kwargs)
        sharded = shard_fsdp2_modules(
            model, ctx, [m for m in model.modules() if isinstance(m, blocks)], **bf16)
        strategies = fsdp2_unit_strategies(sharded)
    seen: dict[str, tuple[str, str]] = {}
    batch = spec.batch(model, batch_size=2, device=ctx.device)
    with record_compute_dtypes(model, seen):
        default_loss(call_model(sharded, batch)).backward()
    stored = {}
    for u in actual_units(sharded):
        stored[u.fqn] = sorted({str(p.dtype) for n, p in sharded.named_parameters()
                                if clean_fqn(n) in u.params})
    return {
        "rank": ctx.rank, "world_size": ctx.world_size, "version": version,
        "embedding": emb_name, "blocks": block_names, "tied": _tie_report(sharded, emb, tied),
        "units": [u.to_dict() for u in actual_units(sharded)], "strategies": strategies,
        "compute_dtypes": seen, "stored_dtypes": stored,
    }


def tied_partners(model: nn.Module, emb: nn.Module) -> list[str]:
    """Modules outside ``emb``'s subtree that hold one of its parameters directly (a tied
    output head), by name."""
    own = {id(p) for p in emb.parameters()}
    inside = {id(m) for m in emb.modules()}
    return [n for n, m in model.named_modules() if id(m) not in inside
            and any(id(p) in own for p in m.parameters(recurse=False))]


def _skip_untiable(model: nn.Module, emb_name: str, tied: Sequence[str],
                   blocks: tuple[type[nn.Module], ...], version: str) -> None:
    """Skip (every rank alike: one model) when tied modules cannot share the embedding's unit."""
    if not tied:
        return
    names = {id(m): n for n, m in model.named_modules()}
    tie = f"{emb_name}'s weight is tied to {', '.join(t or '(root)' for t in tied)}"
    for t in tied:
        partner = model.get_submodule(t)
        holder = next((names[id(m)] for m in model.modules() if isinstance(m, blocks)
                       and (partner in m.modules() or m in partner.modules())), None)
        if partner is model or holder is not None:
            where = "the root" if partner is model else f"block {holder}"
            skip_rank(f"the second seed's mixed configuration does not apply: {tie}, which "
                      f"shares a unit with {where}: the embedding's fp32 NO_SHARD unit cannot "
                      "hold it without taking that unit's parameters too")
    if version == "fsdp1":
        common = _common_ancestor([emb_name, *tied])
        where = (f"{common} ({type(model.get_submodule(common)).__name__})" if common
                 else f"the root ({type(model).__name__})")
        skip_rank(f"the second seed's mixed configuration does not apply on FSDP1: {tie}. "
                  "FSDP1 units follow the module tree: a tied weight belongs to the unit of "
                  f"the smallest module holding all its users, here {where}, so the embedding "
                  "cannot be a NO_SHARD unit of its own: wrapped alone, FSDP1 flattens a second "
                  "copy of the weight into the enclosing unit and the tie is split. FSDP2 runs "
                  "this check with the tied modules in one unit (fully_shard([...]))")


def _common_ancestor(fqns: Sequence[str]) -> str:
    parts = [f.split(".") if f else [] for f in fqns]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _tie_report(sharded: nn.Module, emb: nn.Module, tied: Sequence[str]) -> dict[str, Any]:
    """Per tied module, read from what torch built: whether it is in the embedding's FSDP2
    unit (the same param group) and still holds the embedding's parameter object."""
    group = _compat.fsdp2_param_group(emb)
    own = {id(p) for p in emb.parameters()}
    out = {}
    for t in tied:
        partner = sharded.get_submodule(t)
        out[t] = {
            "same_unit": group is not None and _compat.fsdp2_param_group(partner) is group,
            "still_tied": any(id(p) in own for p in partner.parameters(recurse=False)),
        }
    return out


def _tie_problems(v: Mapping[str, Any]) -> list[str]:
    problems = []
    for fqn, seen in v.get("tied", {}).items():
        if not seen["same_unit"]:
            problems.append(f"rank {v['rank']}: {fqn} shares {v['embedding']}'s weight but is "
                            "not in its unit")
        if not seen["still_tied"]:
            problems.append(f"rank {v['rank']}: after sharding, {fqn} no longer holds "
                            f"{v['embedding']}'s parameter (the tie was split)")
    return problems


def verdict_mixed(values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Verdict:
    """Per unit on every rank: the embedding NO_SHARD, whole, fp32 compute; blocks FULL_SHARD,
    sharded, bf16 compute; every stored parameter fp32."""
    problems = []
    for v in values:
        units = {u.fqn: u for u in _units(v, "units")}
        rank = v["rank"]

        def compute_of(unit: str, seen: Mapping[str, Any] = v["compute_dtypes"]) -> set[str]:
            return {w for n, (_, w) in seen.items() if n == unit or n.startswith(unit + ".")}

        want = {u: ("NO_SHARD", "torch.float32") for u in (v["embedding"], *v.get("tied", {}))}
        want.update({b: ("FULL_SHARD", "torch.bfloat16") for b in v["blocks"]})
        problems += _tie_problems(v)
        for fqn, (strategy, dtype) in want.items():
            u = units.get(fqn)
            if u is None:
                problems.append(f"rank {rank}: {fqn} is not a unit")
                continue
            got = v["strategies"].get(fqn)
            if got != strategy:
                problems.append(f"rank {rank}: unit {fqn} is {got}, expected {strategy}")
            whole = u.local_numel == u.numel
            if whole != (strategy == "NO_SHARD") and v["world_size"] > 1:
                problems.append(f"rank {rank}: unit {fqn} holds {u.local_numel:,} of "
                                f"{u.numel:,} elements locally ({strategy} expected)")
            if compute_of(fqn) != {dtype}:
                problems.append(f"rank {rank}: unit {fqn} computed with weights in "
                                f"{sorted(compute_of(fqn))}, expected {dtype}")
        for fqn, dtypes in v["stored_dtypes"].items():
            if dtypes and dtypes != ["torch.float32"]:
                problems.append(f"rank {rank}: unit {fqn or '(root)'} stores {dtypes}, "
                                "expected float32")
    if problems:
        tree = format_unit_tree(_units(values[0], "units"), "units (rank 0):")
        return Verdict(False, "mixed configuration not in effect:\n  "
                       + "\n  ".join(problems) + "\n\n" + tree, {}, {})
    tied = values[0].get("tied", {})
    with_tied = f" (one unit with the tied {', '.join(tied)})" if tied else ""
    return Verdict(True, f"embedding {values[0]['embedding']}{with_tied} NO_SHARD fp32, "
                   f"{len(values[0]['blocks'])} blocks FULL_SHARD bf16, on every rank",
                   {"units": len(values[0]["units"])}, {})


# --------------------------------------------------------------------------------------------
# Check: prefetch (all-gather order against block execution)
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def record_unshards(events: list[tuple[str, Any]]) -> Iterator[None]:
    """Append ``("gather", key)`` whenever FSDP1 or FSDP2 issues a unit's all-gather.

    Wraps ``FlatParamHandle.unshard`` (FSDP1; recorded only when it really gathers) and
    ``FSDPParamGroup.unshard`` (FSDP2; recorded when it starts an all-gather). ``key`` is the
    handle or param group id, mapped to the unit by the caller.
    """
    handle_cls = _compat.fsdp1_flat_param_handle_cls()
    group_cls = _compat.fsdp2_param_group_cls()
    orig1, orig2 = handle_cls.unshard, group_cls.unshard

    def unshard1(self: Any) -> Any:
        if self.needs_unshard():
            events.append(("gather", id(self)))
        return orig1(self)

    def unshard2(self: Any, *args: Any, **kwargs: Any) -> Any:
        idle = self._all_gather_result is None and not self.is_unsharded
        out = orig2(self, *args, **kwargs)
        if idle and self._all_gather_result is not None:
            events.append(("gather", id(self)))
        return out

    handle_cls.unshard, group_cls.unshard = unshard1, unshard2
    try:
        yield
    finally:
        handle_cls.unshard, group_cls.unshard = orig1, orig2


class _BackwardMark(torch.autograd.Function):
    """Identity whose backward calls a callback: the point where a block's backward ends."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, callback: Any) -> torch.Tensor:
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.callback()
        return grad, None


def rank_prefetch(
    ctx: RankContext,
    spec: ModelSpec,
    version: str = "fsdp1",
    policy: PolicyName = "recommended",
    forward_prefetch: bool = True,
    backward_prefetch: bool = True,
    iterations: int = 2,
) -> dict[str, Any]:
    """Record all-gathers and block forward/backward start and end, per iteration.

    FSDP1: ``forward_prefetch`` and ``backward_prefetch=BACKWARD_PRE`` (or None). FSDP2:
    forward prefetch only when asked explicitly (``set_modules_to_forward_prefetch`` on each
    block with the next); its backward prefetch is on by default and has no public switch,
    so ``backward_prefetch=False`` is refused there.
    """
    from torch.distributed.fsdp import BackwardPrefetch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    check_fsdp_version(version)
    if version == "fsdp1" and ctx.world_size == 1:
        skip_rank("FSDP1 runs NO_SHARD at world size 1 (torch switches any sharding strategy to "
                  "NO_SHARD): units are never gathered, so there is no prefetch to observe; run "
                  "at world size >= 2 (FSDP2 still gathers at one rank)")
    model = _build(spec, ctx)
    block_classes = spec.block_classes(model)
    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, block_classes)]
    if len(blocks) < 2:
        # Same model on every rank, so every rank skips alike; with one block there is no
        # next unit, and the order verdicts would have nothing to examine.
        skip_rank(f"prefetch needs at least two blocks to observe an order; the model has "
                  f"{len(blocks)}: use a config with two or more blocks")
    events: list[tuple[str, Any]] = []
    for i, (_, block) in enumerate(blocks):
        def pre(mod: nn.Module, args: tuple[Any, ...], i: int = i) -> Any:
            events.append(("fwd_start", i))
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.requires_grad:
                # Marks the end of the block's backward *inside* its graph: a hook on the input
                # tensor itself would fire after FSDP's pre-backward hook of the previous unit
                # (registered on the same tensor), which gathers that unit prefetch or not.
                mark = functools.partial(events.append, ("bwd_end", i))
                return (_BackwardMark.apply(x, mark), *args[1:])  # type: ignore[no-untyped-call]
            return None

        def post(mod: nn.Module, args: tuple[Any, ...], out: Any, i: int = i) -> None:
            events.append(("fwd_end", i))
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g, i=i: events.append(("bwd_start", i)))

        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)
    policy_obj = policies.policy(policy, model, block_classes, spec.size_threshold(model))
    if version == "fsdp1":
        sharded = _shard_named(
            model, ctx, version, policy_obj, forward_prefetch=forward_prefetch,
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE if backward_prefetch else None)
        keys = {id(_compat.fsdp1_handle(m)): clean_fqn(n) for n, m in sharded.named_modules()
                if isinstance(m, FSDP) and _compat.fsdp1_handle(m) is not None}
    else:
        if not backward_prefetch:
            raise ValueError("FSDP2 has no public switch to turn backward prefetch off; "
                             "use version='fsdp1' for that control")
        sharded = shard(model, ctx, version, policy_obj)
        fsdp_cls = _compat.fsdp_module_cls()
        unit_blocks = [m for _, m in blocks if isinstance(m, fsdp_cls)]
        if forward_prefetch:
            for current, following in itertools.pairwise(unit_blocks):
                current.set_modules_to_forward_prefetch([following])
        keys = _fsdp2_group_keys(sharded)
    batch = spec.batch(model, batch_size=2, device=ctx.device)
    runs = _record_runs(sharded, batch, events, keys, iterations)
    units = actual_units(sharded)
    return {
        "rank": ctx.rank, "version": version, "blocks": [n for n, _ in blocks],
        "units": [u.fqn for u in units if u.numel > 0], "runs": runs,
    }


def _fsdp2_group_keys(sharded: nn.Module) -> dict[int, str]:
    """FSDP2 unit names by the identity of their param group (what ``record_unshards`` sees)."""
    keys = {}
    for n, m in sharded.named_modules():
        group = _compat.fsdp2_param_group(m)
        if group is not None:
            keys[id(group)] = n
    return keys


def _record_runs(sharded: nn.Module, batch: Any, events: list[tuple[str, Any]],
                 keys: Mapping[int, str], iterations: int) -> list[list[tuple[str, Any]]]:
    """One event list per training iteration, gathers named by their unit."""
    runs = []
    for _ in range(iterations):
        events.clear()
        with record_unshards(events):
            out = call_model(sharded, batch)
            events.append(("fwd_done", None))
            default_loss(out).backward()
        runs.append([(kind, keys.get(key, "?") if kind == "gather" else key)
                     for kind, key in events])
    return runs


def _block_unit(block: str, units: Sequence[str]) -> str:
    """The innermost unit holding a block (the block itself with one unit per block)."""
    holders = [u for u in units if u == block or u == ROOT or block.startswith(u + ".")]
    return max(holders, key=len)


def _timeline(run: Sequence[tuple[str, Any]]) -> str:
    return " ".join(f"{k}:{v}" if v is not None else k for k, v in run)


def verdict_prefetch_forward(
    values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]
) -> Verdict:
    """In the last iteration, the unit of block k+1 is gathered before block k's forward ends."""
    return _prefetch_verdict(values, "forward")


def verdict_prefetch_backward(
    values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]
) -> Verdict:
    """In backward, the unit of block k-1 is gathered before block k's backward ends."""
    return _prefetch_verdict(values, "backward")


def _prefetch_verdict(values: Sequence[Mapping[str, Any]], direction: str) -> Verdict:
    problems = []
    for v in values:
        run = [tuple(e) for e in v["runs"][-1]]
        blocks, units = v["blocks"], v["units"]
        owners = [_block_unit(b, units) for b in blocks]
        if len(set(owners)) < len(blocks):
            problems.append(f"rank {v['rank']}: blocks share units ({len(set(owners))} units for "
                            f"{len(blocks)} blocks): there is no next unit to prefetch")
            continue
        if len(blocks) < 2:
            # No block pair to examine: passing here would prove nothing.
            problems.append(f"rank {v['rank']}: fewer than two blocks ({len(blocks)}): no next "
                            "unit whose gather order could be checked")
            continue
        done = run.index(("fwd_done", None))
        pairs = (
            [(k, k + 1, ("fwd_end", k)) for k in range(len(blocks) - 1)] if direction == "forward"
            else [(k, k - 1, ("bwd_end", k)) for k in range(len(blocks) - 1, 0, -1)]
        )
        for k, nxt, end_event in pairs:
            if end_event not in run:
                problems.append(
                    f"rank {v['rank']}: block {blocks[k]} never reported {end_event[0]}")
                continue
            end = run.index(end_event)
            window = run[:end] if direction == "forward" else run[done:end]
            if ("gather", owners[nxt]) not in window:
                problems.append(f"rank {v['rank']}: unit {owners[nxt]} was not gathered before "
                                f"block {blocks[k]} finished its {direction}")
    if problems:
        return Verdict(False, f"{direction} prefetch not in effect ({values[0]['version']}):\n  "
                       + "\n  ".join(problems[:6]) + "\n  timeline (rank 0, last iteration): "
                       + _timeline(values[0]["runs"][-1]), {}, {"runs": values[0]["runs"]})
    return Verdict(True, f"{direction} prefetch in effect on every rank: each next block's unit "
                   f"gathered before the current block finished", {},
                   {"runs": values[0]["runs"]})


def verdict_prefetch_coarse(
    values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]
) -> Verdict:
    """With one coarse unit, one all-gather per iteration and none while blocks run."""
    problems = []
    for v in values:
        for it, run in enumerate(v["runs"]):
            gathers = [u for kind, u in run if kind == "gather"]
            if len(v["units"]) != 1 or len(set(gathers)) != 1:
                problems.append(f"rank {v['rank']}, iteration {it}: {len(v['units'])} units, "
                                f"gathered {sorted(set(gathers))}: not a single coarse unit")
                break
    if problems:
        return Verdict(False, "expected one coarse unit with nothing to prefetch:\n  "
                       + "\n  ".join(problems[:4]), {}, {})
    return Verdict(True, "one coarse unit: a single all-gather per iteration, nothing to "
                   "prefetch", {}, {})


# --------------------------------------------------------------------------------------------
# The seeds' policy at full scale (plan only)
# --------------------------------------------------------------------------------------------


def seeds_full_scale_plan(policy: PolicyName = "seeds_verbatim") -> tuple[list[UnitInfo], Verdict]:
    """The plan of a policy on the seeds' full-scale MassiveModel (meta, no allocation)."""
    from fsdp_conformance.policies import SEED_MIN_PARAMS
    from fsdp_conformance.reference_models import DecoderLayer, MassiveModel, ModelConfig

    with torch.device("meta"):
        model = MassiveModel(ModelConfig.seeds_full_scale())
    blocks = (DecoderLayer,)
    policy_obj = policies.policy(policy, model, blocks, SEED_MIN_PARAMS)
    verdict = verdict_plan(model, policy_obj, blocks, SEED_MIN_PARAMS,
                           f"policy {policy!r} at dim 4096, 8 layers, threshold 2e7")
    return plan_units(model, policy_obj), verdict


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

_REF = ModelSpec(reference="massive")
_TIED = ModelSpec(reference="tied")
_EMB = ModelSpec(reference="embedding_classifier")


#: A row of a check table: name, rank function, verdict, extra params, description.
_Row = tuple[str, Callable[..., Any], Callable[..., Verdict], dict[str, Any], str]

#: The unit checks, run on each reference model with the recommended policy.
_UNIT_ROWS: tuple[_Row, ...] = (
    ("wrap.units.exact", rank_units, verdict_units_exact, {},
     "each block exactly one unit, oversized modules outside blocks wrapped, nothing else"),
    ("wrap.units.plan", rank_units, verdict_units_plan, {},
     "the plan (no process group) equals the actual units on every rank"),
    ("wrap.units.accounting", rank_units, verdict_units_accounting, {},
     "unit numels add up, tied weights in one unit, shard sizes on every rank"),
)
#: The checks after them, each on one model (``spec`` in the extra params).
_VERSION_ROWS: tuple[_Row, ...] = (
    ("wrap.train.fp32", rank_train, verdict_train, {"spec": _REF, "precision": "fp32"},
     "fp32 training steps under FSDP equal a single-process reference"),
    ("wrap.train.bf16", rank_train, verdict_train, {"spec": _REF, "precision": "bf16"},
     "bf16 training steps under FSDP equal a single-process reference"),
    ("wrap.mixed", rank_mixed, verdict_mixed, {"spec": _EMB},
     "embedding NO_SHARD fp32, blocks FULL_SHARD bf16 (second seed)"),
    ("wrap.prefetch.forward", rank_prefetch, verdict_prefetch_forward, {"spec": _REF},
     "with one unit per block, unit k+1 is gathered before block k ends"),
    ("wrap.prefetch.backward", rank_prefetch, verdict_prefetch_backward, {"spec": _REF},
     "in backward, unit k-1 is gathered before block k's backward ends"),
    ("wrap.prefetch.coarse", rank_prefetch, verdict_prefetch_coarse,
     {"spec": _REF, "policy": "monolithic"},
     "with a single coarse unit there is nothing to prefetch"),
)


def _version_checks(version: str) -> tuple[Check, ...]:
    # Version-major, the unit checks per model first: the order reports and ``run --list``
    # have always listed the wrap checks in.
    units = (
        variants(name, text, rank_fn, verdict, versions=(version,), specs=(spec,),
                 policy="recommended", **extra)
        for spec in (_REF, _TIED)
        for name, rank_fn, verdict, extra, text in _UNIT_ROWS
    )
    others = (
        variants(name, text, rank_fn, verdict, versions=(version,), specs=(extra["spec"],),
                 **{k: v for k, v in extra.items() if k != "spec"})
        for name, rank_fn, verdict, extra, text in _VERSION_ROWS
    )
    return sum(units, ()) + sum(others, ())


#: Every wrap check with its reference parameters (the CLI swaps in the user's spec).
CHECKS: tuple[Check, ...] = (
    _version_checks("fsdp1") + _version_checks("fsdp2")
    + sum((variants(f"wrap.builders.{builder}",
                    f"torch's {builder} policy builder gives its documented units",
                    rank_builders, verdict_builders, versions=None, builder=builder)
           for builder in BUILDERS), ())
)

__all__ = [
    "BUILDERS",
    "CHECKS",
    "FAULTS",
    "documented_unit_modules",
    "expected_local_numel",
    "expected_units",
    "fsdp1_options",
    "rank_builders",
    "rank_mixed",
    "rank_prefetch",
    "rank_train",
    "rank_units",
    "record_compute_dtypes",
    "record_unshards",
    "seeds_full_scale_plan",
    "verdict_builders",
    "verdict_mixed",
    "verdict_plan",
    "verdict_prefetch_backward",
    "verdict_prefetch_coarse",
    "verdict_prefetch_forward",
    "verdict_train",
    "verdict_units_accounting",
    "verdict_units_exact",
    "verdict_units_plan",
]
