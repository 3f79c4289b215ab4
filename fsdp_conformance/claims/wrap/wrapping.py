"""What every wrap check family does to its model: build it from the seed, wrap it under a
policy, read back the units and strategies torch built, and record the dtypes it computes in.

The family modules call these by their module-level names, so a fault of a family
(:mod:`fsdp_conformance.claims.faults`) can patch, in that family's module only, the step it breaks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from fsdp_conformance import _compat
from fsdp_conformance.fsdp.sharding import fsdp1_options, shard
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models.model_spec import BuiltModel, ModelSpec
from fsdp_conformance.models.units import UnitInfo, clean_fqn, planned_unit_modules

#: Containers with no forward of their own: FSDP1 cannot gather around them, and torch's size
#: policy never wraps them (``exclude_wrap_modules``), so the claim never expects them as units.
CONTAINERS: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.ModuleDict)


class RankUnits(TypedDict):
    """What a rank reports of the units torch built (``UnitInfo.to_dict`` each), with its rank
    and world size; each family's result adds its own fields."""

    rank: int
    world_size: int
    actual: list[dict[str, Any]]


def build(spec: ModelSpec, ctx: RankContext, seed: int = 0) -> BuiltModel:
    """``spec``'s model from ``seed``: the same model on every rank."""
    torch.manual_seed(seed)
    return spec.instantiate(ctx.device)


def shard_with_policy(
    model: nn.Module, ctx: RankContext, version: str, policy_obj: Any, **kwargs: Any
) -> nn.Module:
    """``model`` sharded under ``policy_obj`` as a user writes it (FSDP1 with the options its
    plan needs, :func:`fsdp1_options`)."""
    if version == "fsdp1":
        kwargs = {**fsdp1_options(model, planned_unit_modules(model, policy_obj)), **kwargs}
    return shard(model, ctx, version, policy_obj, **kwargs)


def fsdp1_strategies(sharded: nn.Module) -> dict[str, str]:
    """Each FSDP1 unit's sharding strategy, by unit name."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return {
        clean_fqn(n): _compat.fsdp1_sharding_strategy(m)
        for n, m in sharded.named_modules()
        if isinstance(m, FSDP)
    }


def units_of(value: Mapping[str, Any], key: str) -> list[UnitInfo]:
    """The units a rank reported under ``key``, as :class:`UnitInfo`."""
    return [UnitInfo.from_dict(d) for d in value[key]]


@contextlib.contextmanager
def record_compute_dtypes(
    model: nn.Module, seen: dict[str, tuple[str, str]], also: Sequence[str] = ()
) -> Iterator[None]:
    """Record, per module with a matrix ``weight`` of its own (Linear, Embedding, and the like:
    GPT-2's ``Conv1D``), the (input, weight) dtypes its forward actually sees; and for the
    modules named in ``also`` (a LayerNorm the mixed configuration puts in an fp32 unit), the
    (input, first own parameter) dtypes.

    Registered on the original modules: under FSDP their ``weight`` during forward is the
    unsharded (and, with mixed precision, cast) parameter, so this is the compute dtype.
    """
    handles = []
    for raw_name, module in model.named_modules():
        name = clean_fqn(raw_name)  # FSDP1 inserts its wrapper into the module names
        own = dict(module.named_parameters(recurse=False))
        weight = own.get("weight")
        if isinstance(module, (nn.Linear, nn.Embedding)) or (
            weight is not None and weight.dim() >= 2
        ):
            attr = "weight"
        elif name in also and own:
            attr = next(iter(own))
        else:
            continue

        def pre(mod: nn.Module, args: tuple[Any, ...], name: str = name, attr: str = attr) -> None:
            if name not in seen and args and isinstance(args[0], torch.Tensor):
                seen[name] = (str(args[0].dtype), str(getattr(mod, attr).dtype))

        handles.append(module.register_forward_pre_hook(pre))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
