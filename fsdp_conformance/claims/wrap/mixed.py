"""``wrap.mixed``: the second seed's configuration, the embedding its own unit NO_SHARD in fp32
and the blocks FULL_SHARD in bf16, each unit's strategy and dtypes observed on every rank."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from fsdp_conformance import _compat
from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.wrap.wrapping import (
    build,
    fsdp1_strategies,
    record_compute_dtypes,
    units_of,
)
from fsdp_conformance.faults import Fault, FaultTable, patched
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.models import ModelSpec, call_model, default_loss
from fsdp_conformance.policies import PolicyError
from fsdp_conformance.sharding import check_fsdp_version, device_mesh, shard_fsdp2_modules
from fsdp_conformance.units import actual_units, clean_fqn, format_unit_tree

# --------------------------------------------------------------------------------------------
# The user's per-unit options
# --------------------------------------------------------------------------------------------


def _bf16_fsdp2() -> dict[str, Any]:
    mp = _compat.mixed_precision_policy_cls()
    return {"mp_policy": mp(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)}


def block_options(ctx: RankContext, version: str) -> dict[str, Any]:
    """The blocks' unit options beyond the model-wide ones: none on FSDP1 (the wrapper's bf16
    mixed precision and FULL_SHARD apply); FSDP2 bf16 on the 1-D mesh."""
    if version == "fsdp1":
        return {}
    return {**_bf16_fsdp2(), "mesh": device_mesh(ctx)}


def embedding_options(ctx: RankContext, version: str) -> dict[str, Any]:
    """The embedding unit's overrides: FSDP1 NO_SHARD without mixed precision; FSDP2 fp32 on a
    (world, 1) mesh (replicated across ranks, "sharded" over one: FSDP2's NO_SHARD)."""
    if version == "fsdp1":
        from torch.distributed.fsdp import ShardingStrategy

        return {"sharding_strategy": ShardingStrategy.NO_SHARD, "mixed_precision": None}
    from torch.distributed.device_mesh import init_device_mesh

    mp = _compat.mixed_precision_policy_cls()
    # fp32 named, not left unset: a tied head receives the blocks' bf16 activations, and
    # only a set param_dtype makes FSDP2 cast a unit's forward inputs to it.
    return {
        "mp_policy": mp(param_dtype=torch.float32),
        "mesh": init_device_mesh(
            ctx.device_type, (ctx.world_size, 1), mesh_dim_names=("replicate", "shard")
        ),
    }


def _uniform(ctx: RankContext) -> contextlib.AbstractContextManager[None]:
    return patched(sys.modules[__name__], "embedding_options", lambda own: block_options)


FAULTS = FaultTable(
    uniform=Fault(
        "every unit FULL_SHARD bf16 (the seeds' configuration), no per-unit override", _uniform
    ),
)

# --------------------------------------------------------------------------------------------
# The embedding and what is tied to it
# --------------------------------------------------------------------------------------------


def _embedding_fqn(model: nn.Module, blocks: tuple[type[nn.Module], ...]) -> str:
    inside = {id(s) for m in model.modules() if isinstance(m, blocks) for s in m.modules()}
    named: Iterable[tuple[str, nn.Module]] = model.named_modules()  # torch leaves it untyped
    for name, module in named:
        if isinstance(module, nn.Embedding) and id(module) not in inside:
            return name
    raise PolicyError(
        f"{type(model).__name__} has no nn.Embedding outside its blocks: the "
        "mixed configuration needs an embedding table (pass embedding=<fqn>)"
    )


def tied_partners(model: nn.Module, emb: nn.Module) -> list[str]:
    """Modules outside ``emb``'s subtree that hold one of its parameters directly (a tied
    output head), by name."""
    own = {id(p) for p in emb.parameters()}
    inside = {id(m) for m in emb.modules()}
    return [
        n
        for n, m in model.named_modules()
        if id(m) not in inside and any(id(p) in own for p in m.parameters(recurse=False))
    ]


def _skip_untiable(
    model: nn.Module,
    emb_name: str,
    tied: Sequence[str],
    blocks: tuple[type[nn.Module], ...],
    version: str,
) -> None:
    """Skip (every rank alike: one model) when tied modules cannot share the embedding's unit."""
    if not tied:
        return
    names = {id(m): n for n, m in model.named_modules()}
    tie = f"{emb_name}'s weight is tied to {', '.join(t or '(root)' for t in tied)}"
    for t in tied:
        partner = model.get_submodule(t)
        holder = next(
            (
                names[id(m)]
                for m in model.modules()
                if isinstance(m, blocks) and (partner in m.modules() or m in partner.modules())
            ),
            None,
        )
        if partner is model or holder is not None:
            where = "the root" if partner is model else f"block {holder}"
            skip_rank(
                f"the second seed's mixed configuration does not apply: {tie}, which "
                f"shares a unit with {where}: the embedding's fp32 NO_SHARD unit cannot "
                "hold it without taking that unit's parameters too"
            )
    if version == "fsdp1":
        common = _common_ancestor([emb_name, *tied])
        where = (
            f"{common} ({type(model.get_submodule(common)).__name__})"
            if common
            else f"the root ({type(model).__name__})"
        )
        skip_rank(
            f"the second seed's mixed configuration does not apply on FSDP1: {tie}. "
            "FSDP1 units follow the module tree: a tied weight belongs to the unit of "
            f"the smallest module holding all its users, here {where}, so the embedding "
            "cannot be a NO_SHARD unit of its own: wrapped alone, FSDP1 flattens a second "
            "copy of the weight into the enclosing unit and the tie is split. FSDP2 runs "
            "this check with the tied modules in one unit (fully_shard([...]))"
        )


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


# --------------------------------------------------------------------------------------------
# The rank function
# --------------------------------------------------------------------------------------------


def fsdp2_unit_strategies(sharded: nn.Module) -> dict[str, str]:
    """Per FSDP2 unit: "NO_SHARD" when every parameter is whole on each rank (replicated, or
    sharded over a mesh dimension of size 1), else "FULL_SHARD"; read from DTensor placements."""
    dtensor = _compat.dtensor_cls()
    # Every name of a tied parameter: each module of a multi-module unit reports its own.
    placements = {
        n: p for n, p in sharded.named_parameters(remove_duplicate=False) if isinstance(p, dtensor)
    }
    out = {}
    for u in actual_units(sharded):
        whole = [
            all(
                type(pl).__name__ == "Replicate" or size == 1
                for pl, size in zip(placements[n].placements, placements[n].device_mesh.shape)
            )
            for n in u.params
            if n in placements
        ]
        if whole:
            out[u.fqn] = "NO_SHARD" if all(whole) else "FULL_SHARD"
    return out


def _shard_mixed(
    model: nn.Module,
    ctx: RankContext,
    version: str,
    emb: nn.Module,
    tied: Sequence[str],
    blocks: tuple[type[nn.Module], ...],
) -> nn.Module:
    """FSDP1: ``CustomPolicy`` whose function returns the embedding's overrides. FSDP2:
    ``fully_shard`` per unit, the embedding (with the modules tied to it: FSDP2 takes several
    modules as one unit) first."""
    if version == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision
        from torch.distributed.fsdp.wrap import CustomPolicy

        override = embedding_options(ctx, version)
        policy = CustomPolicy(lambda m: (override or True) if m is emb else isinstance(m, blocks))
        return FSDP(
            model,
            auto_wrap_policy=policy,
            device_id=ctx.device,
            mixed_precision=MixedPrecision(
                param_dtype=torch.bfloat16,
                reduce_dtype=torch.bfloat16,
                buffer_dtype=torch.bfloat16,
                cast_forward_inputs=True,
            ),
        )
    emb_unit = [emb, *(model.get_submodule(n) for n in tied)]
    _compat.fully_shard()(emb_unit if tied else emb, **embedding_options(ctx, version))
    return shard_fsdp2_modules(
        model, ctx, [m for m in model.modules() if isinstance(m, blocks)], **_bf16_fsdp2()
    )


class MixedResult(TypedDict):
    """What every rank of ``rank_mixed`` reports."""

    rank: int
    world_size: int
    version: str
    embedding: str
    blocks: list[str]
    tied: dict[str, dict[str, bool]]
    units: list[dict[str, Any]]
    strategies: dict[str, str]
    compute_dtypes: dict[str, tuple[str, str]]
    stored_dtypes: dict[str, list[str]]


def rank_mixed(
    ctx: RankContext,
    spec: ModelSpec,
    version: str = "fsdp1",
    embedding: str | None = None,
    fault: str | Sequence[str] | None = None,
) -> MixedResult:
    """The embedding its own unit, NO_SHARD in fp32; blocks FULL_SHARD in bf16; one step.

    ``embedding``: the embedding's FQN (default: the one ``nn.Embedding`` outside the blocks).
    ``fault``: names in :data:`FAULTS`.
    """
    with FAULTS.inject(fault, ctx):
        check_fsdp_version(version)
        if ctx.world_size == 1:  # every rank alike: the world size is the same everywhere
            skip_rank(
                "the mixed configuration needs world size >= 2: at one rank FULL_SHARD "
                "and NO_SHARD are the same layout (FSDP1 switches every unit to NO_SHARD; "
                "FSDP2's shards over a mesh of one are whole), so the per-unit strategies "
                "cannot differ"
            )
        built = build(spec, ctx)
        model, blocks = built.model, built.blocks
        try:
            emb_name = embedding or _embedding_fqn(model, blocks)
        except PolicyError as exc:  # every rank builds the same model: all ranks skip alike
            skip_rank(f"the second seed's mixed configuration does not apply: {exc}")
        emb = model.get_submodule(emb_name)
        block_names = [n for n, m in model.named_modules() if isinstance(m, blocks)]
        tied = tied_partners(model, emb)
        _skip_untiable(model, emb_name, tied, blocks, version)
        sharded = _shard_mixed(model, ctx, version, emb, tied, blocks)
        strategies = (
            fsdp1_strategies(sharded) if version == "fsdp1" else fsdp2_unit_strategies(sharded)
        )
        seen: dict[str, tuple[str, str]] = {}
        batch = built.batch(batch_size=2, device=ctx.device)
        with record_compute_dtypes(model, seen):
            default_loss(call_model(sharded, batch)).backward()
        stored = {}
        for u in actual_units(sharded):
            stored[u.fqn] = sorted(
                {str(p.dtype) for n, p in sharded.named_parameters() if clean_fqn(n) in u.params}
            )
        return {
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "version": version,
            "embedding": emb_name,
            "blocks": block_names,
            "tied": _tie_report(sharded, emb, tied),
            "units": [u.to_dict() for u in actual_units(sharded)],
            "strategies": strategies,
            "compute_dtypes": seen,
            "stored_dtypes": stored,
        }


# --------------------------------------------------------------------------------------------
# The verdict
# --------------------------------------------------------------------------------------------


def _tie_problems(v: MixedResult) -> list[str]:
    problems = []
    for fqn, seen in v.get("tied", {}).items():
        if not seen["same_unit"]:
            problems.append(
                f"rank {v['rank']}: {fqn} shares {v['embedding']}'s weight but is not in its unit"
            )
        if not seen["still_tied"]:
            problems.append(
                f"rank {v['rank']}: after sharding, {fqn} no longer holds "
                f"{v['embedding']}'s parameter (the tie was split)"
            )
    return problems


def _rank_problems(v: MixedResult) -> list[str]:
    """One rank's units against what the configuration wants of each."""
    problems = _tie_problems(v)
    units = {u.fqn: u for u in units_of(v, "units")}
    rank = v["rank"]

    def compute_of(unit: str, seen: Mapping[str, Any] = v["compute_dtypes"]) -> set[str]:
        return {w for n, (_, w) in seen.items() if n == unit or n.startswith(unit + ".")}

    want = {u: ("NO_SHARD", "torch.float32") for u in (v["embedding"], *v.get("tied", {}))}
    want.update({b: ("FULL_SHARD", "torch.bfloat16") for b in v["blocks"]})
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
            problems.append(
                f"rank {rank}: unit {fqn} holds {u.local_numel:,} of "
                f"{u.numel:,} elements locally ({strategy} expected)"
            )
        if compute_of(fqn) != {dtype}:
            problems.append(
                f"rank {rank}: unit {fqn} computed with weights in "
                f"{sorted(compute_of(fqn))}, expected {dtype}"
            )
    for fqn, dtypes in v["stored_dtypes"].items():
        if dtypes and dtypes != ["torch.float32"]:
            problems.append(
                f"rank {rank}: unit {fqn or '(root)'} stores {dtypes}, expected float32"
            )
    return problems


def verdict_mixed(values: Sequence[MixedResult], params: Mapping[str, Any]) -> Verdict:
    """Per unit on every rank: the embedding NO_SHARD, whole, fp32 compute; blocks FULL_SHARD,
    sharded, bf16 compute; every stored parameter fp32."""
    problems = [line for v in values for line in _rank_problems(v)]
    if problems:
        tree = format_unit_tree(units_of(values[0], "units"), "units (rank 0):")
        return Verdict(
            False,
            "mixed configuration not in effect:\n  " + "\n  ".join(problems) + "\n\n" + tree,
            {},
            {},
        )
    tied = values[0].get("tied", {})
    with_tied = f" (one unit with the tied {', '.join(tied)})" if tied else ""
    return Verdict(
        True,
        f"embedding {values[0]['embedding']}{with_tied} NO_SHARD fp32, "
        f"{len(values[0]['blocks'])} blocks FULL_SHARD bf16, on every rank",
        {"units": len(values[0]["units"])},
        {},
    )
