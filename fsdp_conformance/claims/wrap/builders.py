"""``wrap.builders.<builder>``: torch's auto-wrap policy builders give their documented result
on a small reference model (FSDP1), per-unit overrides included."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch import nn

from fsdp_conformance import _compat
from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.wrap.wrapping import (
    CONTAINERS,
    RankUnits,
    build,
    fsdp1_strategies,
    units_of,
)
from fsdp_conformance.faults import Fault, FaultTable, patched
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models import ModelSpec
from fsdp_conformance.policies import PolicyError
from fsdp_conformance.sharding import shard
from fsdp_conformance.units import actual_units, format_unit_mismatch, unit_differences

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
        with patched(
            sys.modules[__name__],
            "builder_policy",
            lambda made: lambda builder, *args: made(other, *args),
        ):
            yield

    return effect


#: ``<builder>_applied``: that builder's policy is applied while the named builder's documented
#: result is expected (a verdict that does not read torch's units would pass).
FAULTS = FaultTable(
    **{
        f"{other}_applied": Fault(
            f"torch's {other} builder is applied, whatever builder is named",
            _applied_instead(other),
        )
        for other in BUILDERS
    }
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
    from fsdp_conformance.units import units_for_modules

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
