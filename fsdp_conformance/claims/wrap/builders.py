"""``wrap.builders.<builder>``: torch's auto-wrap policy builders give their documented result
on a small reference model (FSDP1), per-unit overrides included; ``wrap.builders.size_boundary``:
the size rule at its boundary, torch's builder and the suite's recommended policy, FSDP1 and
FSDP2 (through the plan)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from fsdp_conformance import _compat
from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import Fault, FaultTable, patched, patched_attr
from fsdp_conformance.claims.wrap.common import (
    CONTAINERS,
    RankUnits,
    build,
    expected_units,
    fsdp1_strategies,
    units_of,
)
from fsdp_conformance.fsdp.sharding import check_fsdp_version, shard
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models import policies
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.policies import PolicyError
from fsdp_conformance.models.reference_models import BOUNDARY_MIN_PARAMS, SizeBoundaryModel
from fsdp_conformance.models.units import (
    actual_units,
    format_unit_mismatch,
    unit_differences,
    units_for_modules,
)

BUILDERS = ("transformer", "size", "lambda", "or", "module_wrap", "custom")


def builder_policy(
    builder: str,
    model: nn.Module,
    blocks: tuple[type[nn.Module], ...],
    min_params: int,
    head: nn.Module,
) -> Any:
    """The auto-wrap policy ``builder`` makes, as a user calls it (the head by identity)."""
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
    builder: str,
    model: nn.Module,
    blocks: tuple[type[nn.Module], ...],
    min_params: int,
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


def _applied_instead(other: str) -> Any:
    @contextlib.contextmanager
    def effect(ctx: RankContext) -> Iterator[None]:
        with patched_attr(
            __name__,
            "builder_policy",
            lambda made: lambda builder, *args: made(other, *args),
        ):
            yield

    return effect


def _strictly_above(original: Any) -> Any:
    """torch's ``size_based_auto_wrap_policy`` comparing with ``>`` instead of ``>=``: for whole
    numels, ``n > t`` is ``n >= t + 1``. Its own attributes (``FORCE_LEAF_MODULES``, which the
    original reads through its module's name) come along with ``functools.wraps``."""

    @functools.wraps(original)
    def size_policy(
        module: nn.Module,
        recurse: bool,
        nonwrapped_numel: int,
        min_num_params: int = int(1e8),
        force_leaf_modules: Any = None,
        exclude_wrap_modules: Any = None,
    ) -> bool:
        return bool(
            original(
                module,
                recurse,
                nonwrapped_numel,
                min_num_params + 1,
                force_leaf_modules,
                exclude_wrap_modules,
            )
        )

    return size_policy


@contextlib.contextmanager
def _strict_size_policy(ctx: RankContext) -> Iterator[None]:
    from torch.distributed.fsdp import wrap as torch_wrap

    with patched(torch_wrap, "size_based_auto_wrap_policy", _strictly_above):
        yield


@contextlib.contextmanager
def _recommended_off_by_one(ctx: RankContext) -> Iterator[None]:
    with patched(
        policies,
        "recommended_policy",
        lambda made: lambda model, blocks, min_params: made(model, blocks, min_params + 1),
    ):
        yield


#: ``<builder>_applied``: that builder's policy is applied while the named builder's documented
#: result is expected (a verdict that does not read torch's units would pass).
#: ``strict_size_policy``, ``recommended_off_by_one``: the size rule off by one at its boundary,
#: in torch and in the suite's own policy (``wrap.builders.size_boundary``'s controls).
FAULTS = FaultTable(
    **{
        f"{other}_applied": Fault(
            f"torch's {other} builder is applied, whatever builder is named",
            _applied_instead(other),
        )
        for other in BUILDERS
    },
    strict_size_policy=Fault(
        "torch's size_based_auto_wrap_policy compares nonwrapped_numel > min_num_params "
        "instead of >= (a module of exactly the threshold stays unwrapped)",
        _strict_size_policy,
    ),
    recommended_off_by_one=Fault(
        "the suite's recommended policy applies its size rule one parameter above the threshold "
        "(min_params + 1: an off-by-one, > for >=)",
        _recommended_off_by_one,
    ),
)


class BuildersResult(RankUnits):
    """What every rank of ``rank_builders`` reports."""

    builder: str
    documented: list[dict[str, Any]]
    documented_strategies: dict[str, str]
    strategies: dict[str, str]


def rank_builders(
    ctx: RankContext,
    builder: str,
    reference: str = "massive",
    head: str = "head",
    fault: str | Sequence[str] | None = None,
) -> BuildersResult:
    """Shard a small reference model with FSDP1 under one of torch's builders; report its units
    and the ones the builder's documentation gives. ``fault``: names in :data:`FAULTS`."""
    with FAULTS.inject(fault, ctx):
        built = build(ModelSpec(reference=reference), ctx)
        model, blocks, min_params = built.model, built.blocks, built.size_threshold
        head_module = model.get_submodule(head)
        fqns, strategies = documented_unit_modules(builder, model, blocks, min_params, head_module)
        documented = units_for_modules(model, [model.get_submodule(f) for f in fqns])
        sharded = shard(
            model, ctx, "fsdp1", builder_policy(builder, model, blocks, min_params, head_module)
        )
        actual = actual_units(sharded)
        return {
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "builder": builder,
            "documented": [u.to_dict() for u in documented],
            "actual": [u.to_dict() for u in actual],
            "documented_strategies": strategies,
            "strategies": fsdp1_strategies(sharded),
        }


def verdict_builders(values: Sequence[BuildersResult], params: Mapping[str, Any]) -> Verdict:
    """Every rank's units equal the builder's documented result, per-unit overrides included."""
    for v in values:
        documented, actual = units_of(v, "documented"), units_of(v, "actual")
        diffs = unit_differences(documented, actual, ("cls", "numel", "parent"))
        for fqn, want in v["documented_strategies"].items():
            got = v["strategies"].get(fqn)
            if got != want:
                diffs.append(f"~ unit {fqn}: sharding strategy expected {want}, got {got}")
            unit = next((u for u in actual if u.fqn == fqn), None)
            if unit is not None and want == "NO_SHARD" and unit.local_numel != unit.numel:
                diffs.append(
                    f"~ unit {fqn}: NO_SHARD but rank {v['rank']} holds "
                    f"{unit.local_numel:,} of {unit.numel:,}"
                )
        if diffs:
            return Verdict(
                False,
                format_unit_mismatch(
                    f"rank {v['rank']}: builder {v['builder']!r} vs its documented result",
                    documented,
                    actual,
                    diffs,
                ),
                {"units": len(actual)},
                {"actual": v["actual"]},
            )
    return Verdict(
        True,
        f"builder {values[0]['builder']!r}: {len(values[0]['actual'])} units as "
        "documented on every rank",
        {"units": len(values[0]["actual"])},
        {},
    )


# --------------------------------------------------------------------------------------------
# wrap.builders.size_boundary: the size rule at its boundary
# --------------------------------------------------------------------------------------------

#: The two rules judged at the boundary: torch's builder as a user calls it, and the suite's
#: recommended policy (blocks whole, torch's size rule outside them).
BOUNDARY_RULES = ("size", "recommended")
_RULE_NAMES = {
    "size": "torch's size_based_auto_wrap_policy",
    "recommended": "the suite's recommended policy (its size rule outside the blocks)",
}


class RuleUnits(TypedDict):
    """One rule's units on one rank: expected, as torch built them, and what the rule was asked."""

    #: The documented result (``size``: :func:`documented_unit_modules`) or the claim's unit set
    #: (``recommended``: :func:`~fsdp_conformance.claims.wrap.common.expected_units`).
    expected: list[dict[str, Any]]
    actual: list[dict[str, Any]]
    #: Per boundary module, the ``nonwrapped_numel`` torch last passed the policy for it (the
    #: remainder it decided on, or the subtree total when torch did not descend).
    asked: dict[str, int]


class SizeBoundaryResult(RankUnits):
    """What every rank of ``rank_builders_size_boundary`` reports (``actual``: torch's
    builder's units, as in :class:`BuildersResult`)."""

    version: str
    min_params: int
    at: list[str]
    below: list[str]
    rules: dict[str, RuleUnits]


def _asking(policy: Any, names: Mapping[int, str], asked: dict[str, int]) -> Any:
    """``policy``, recording the ``nonwrapped_numel`` torch passes it for the named modules."""

    def ask(module: nn.Module, recurse: bool, nonwrapped_numel: int, **kwargs: Any) -> bool:
        if id(module) in names:
            asked[names[id(module)]] = nonwrapped_numel
        return bool(
            policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel, **kwargs)
        )

    return ask


def _boundary_rule(ctx: RankContext, version: str, rule: str) -> RuleUnits:
    """A fresh boundary model (seed 0) sharded under ``rule``; its units and what was asked."""
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = SizeBoundaryModel()
    blocks = (type(model.layers[0]),)
    boundary = {*model.AT, *model.BELOW}
    names = {id(m): n for n, m in model.named_modules() if n in boundary}
    if rule == "size":
        fqns, _ = documented_unit_modules(rule, model, blocks, BOUNDARY_MIN_PARAMS, model.head)
        expected = units_for_modules(model, [model.get_submodule(f) for f in fqns])
        made = builder_policy(rule, model, blocks, BOUNDARY_MIN_PARAMS, model.head)
    else:
        expected = expected_units(model, blocks, BOUNDARY_MIN_PARAMS)
        made = policies.policy("recommended", model, blocks, BOUNDARY_MIN_PARAMS)
    asked: dict[str, int] = {}
    sharded = shard(model, ctx, version, _asking(made, names, asked))
    return {
        "expected": [u.to_dict() for u in expected],
        "actual": [u.to_dict() for u in actual_units(sharded)],
        "asked": asked,
    }


def rank_builders_size_boundary(
    ctx: RankContext, version: str = "fsdp1", fault: str | Sequence[str] | None = None
) -> SizeBoundaryResult:
    """Shard :class:`~fsdp_conformance.models.reference_models.SizeBoundaryModel` under torch's size
    builder and under the recommended policy (FSDP1; FSDP2 through the plan, as every FSDP2
    check); report the units torch built and what the size rule was asked at the boundary.
    ``fault``: names in :data:`FAULTS`."""
    with FAULTS.inject(fault, ctx):
        check_fsdp_version(version)
        rules = {rule: _boundary_rule(ctx, version, rule) for rule in BOUNDARY_RULES}
        return {
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "version": version,
            "actual": rules["size"]["actual"],
            "min_params": BOUNDARY_MIN_PARAMS,
            "at": list(SizeBoundaryModel.AT),
            "below": list(SizeBoundaryModel.BELOW),
            "rules": rules,
        }


def _boundary_problems(v: SizeBoundaryResult, rule: str) -> list[str]:
    """What in one rank's ``rule`` misses the boundary: the model off it, the expectation or
    torch's units on the wrong side of it (``>=``: the exact size wrapped, one fewer not)."""
    found = v["rules"][rule]
    threshold = v["min_params"]
    sides = [(m, threshold, True) for m in v["at"]] + [
        (m, threshold - 1, False) for m in v["below"]
    ]
    problems = []
    for key, what in (("expected", "expected"), ("actual", "torch built")):
        fqns = {u.fqn for u in units_of(found, key)}
        for module, numel, wrapped in sides:
            if (module in fqns) != wrapped:
                side = "exactly" if wrapped else "one fewer than"
                problems.append(
                    f"boundary module {module} ({numel:,} parameters not yet wrapped, {side} "
                    f"min_num_params {threshold:,}) is {'not ' if wrapped else ''}a unit as "
                    f"{what}: the size rule wraps when nonwrapped_numel >= min_num_params"
                )
    for module, numel, _ in sides:
        got = found["asked"].get(module)
        if got != numel:
            problems.append(
                f"torch asked the size rule about {module} with nonwrapped_numel {got}, not "
                f"{numel:,}: the model no longer sits at the boundary (fix SizeBoundaryModel's "
                "sizes)"
            )
    return problems


def _boundary_failure(v: SizeBoundaryResult, rule: str, who: str) -> str | None:
    """One rank's ``rule`` against its expectation, trees and all (without shard sizes, so ranks
    that agree read alike); None when they agree. ``who``: the ranks it is told for."""
    found = v["rules"][rule]
    expected = units_of(found, "expected")
    actual = [dataclasses.replace(u, local_numel=None) for u in units_of(found, "actual")]
    problems = _boundary_problems(v, rule)
    diffs = unit_differences(expected, actual, ("cls", "numel", "parent"))
    if not problems and not diffs:
        return None
    head = (
        f"{who} ({v['version']}): {_RULE_NAMES[rule]}, min_num_params {v['min_params']:,}, "
        f"vs its {'documented result' if rule == 'size' else 'claim'}"
    )
    return "\n".join(
        [*(f"! {p}" for p in problems), format_unit_mismatch(head, expected, actual, diffs)]
    )


def _boundary_failures(values: Sequence[SizeBoundaryResult]) -> list[tuple[str, str]]:
    """(rule, text) per rule and distinct failure, told once for the ranks that share it."""
    failures = []
    for rule in BOUNDARY_RULES:
        ranks: dict[str, list[int]] = {}
        for v in values:
            text = _boundary_failure(v, rule, "{who}")
            if text is not None:
                ranks.setdefault(text, []).append(v["rank"])
        for text, told in ranks.items():
            who = f"rank {told[0]}" if len(told) == 1 else f"ranks {', '.join(map(str, told))}"
            failures.append((rule, text.replace("{who}", who, 1)))
    return failures


def verdict_builders_size_boundary(
    values: Sequence[SizeBoundaryResult], params: Mapping[str, Any]
) -> Verdict:
    """On every rank and under both rules, the module of exactly ``min_num_params`` not yet
    wrapped is a unit, its sibling of one fewer is not, and the units equal the expected ones."""
    failures = _boundary_failures(values)
    first = values[0]
    figures = {
        "min_params": first["min_params"],
        **{f"{rule}_units": len(first["rules"][rule]["actual"]) for rule in BOUNDARY_RULES},
    }
    # ``actual`` (torch's builder's units) is the unit list compare follows.
    data = {"actual": first["actual"], "recommended": first["rules"]["recommended"]["actual"]}
    if failures:
        rules = ", ".join(dict.fromkeys(rule for rule, _ in failures))
        return Verdict(
            False,
            f"the size rule misses its boundary ({rules}):\n"
            + "\n\n".join(text for _, text in failures),
            figures,
            data,
        )
    at, below = ", ".join(first["at"]), ", ".join(first["below"])
    return Verdict(
        True,
        f"at min_num_params {first['min_params']:,}: {at} (exactly the threshold not yet "
        f"wrapped) wrapped, {below} (one fewer) not, under torch's size builder and the "
        f"recommended policy, on every rank",
        figures,
        data,
    )
