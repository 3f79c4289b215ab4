"""``wrap.mixed``: the second seed's configuration, the embedding its own unit NO_SHARD in fp32
and the blocks FULL_SHARD in bf16, each unit's strategy and dtypes observed on every rank."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from fsdp_conformance import _compat
from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import Fault, FaultTable, patched_attr
from fsdp_conformance.claims.wrap.common import (
    build,
    fsdp1_strategies,
    record_compute_dtypes,
    units_of,
)
from fsdp_conformance.fsdp.sharding import (
    check_fsdp_version,
    device_mesh,
    fsdp1_options,
    shard_fsdp2_modules,
)
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.models.model_spec import ModelSpec, call_model, default_loss
from fsdp_conformance.models.policies import PolicyError
from fsdp_conformance.models.units import (
    actual_units,
    clean_fqn,
    format_unit_tree,
    planned_unit_modules,
)

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
    return patched_attr(__name__, "embedding_options", lambda own: block_options)


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
    """Modules outside ``emb``'s subtree that share a parameter with the embedding's unit, ties
    followed through (a tied output head, and what shares the head's other parameters: BERT's
    ``cls.predictions.decoder`` holds the embedding's weight and ``cls.predictions``'s bias),
    by name, in the model's order."""
    inside = {id(m) for m in emb.modules()}
    held = {id(p) for p in emb.parameters()}
    named: list[tuple[str, nn.Module]] = list(model.named_modules())
    found: set[str] = set()
    grew = True
    while grew:
        grew = False
        for n, m in named:
            if id(m) in inside or n in found:
                continue
            if any(id(p) in held for p in m.parameters(recurse=False)):
                found.add(n)
                held.update(id(p) for p in m.parameters(recurse=False))
                grew = True
    return [n for n, _ in named if n in found]


def tie_groups(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Every tensor held under more than one (module, attribute), as those pairs."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for fqn, m in model.named_modules():
        for attr, p in m.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((fqn, attr))
    return [h for h in holders.values() if len(h) > 1]


def outermost(names: Sequence[str]) -> list[str]:
    """``names`` without those inside another of them (FSDP2 takes a module's subtree)."""
    return [n for n in names if not any(o != n and n.startswith(o + ".") for o in names)]


def output_consumers(
    model: nn.Module, unit: Sequence[nn.Module], blocks: tuple[type[nn.Module], ...], batch: Any
) -> list[str]:
    """Modules outside the blocks and ``unit`` with parameters of their own whose forward takes a
    floating tensor computed from ``unit``'s output without passing through a block (Bloom's
    ``word_embeddings_layernorm``), observed on one forward of ``model``: the autograd graph of
    each such input, walked back, reaches a ``unit`` output before any block output."""
    sources: set[Any] = set()
    stops: set[Any] = set()
    found: dict[str, None] = {}

    def mark(into: set[Any]) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            into.update(t.grad_fn for t in _tensors(out) if t.grad_fn is not None)

        return hook

    def check(name: str) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            inputs = [t for t in _tensors((args, kwargs)) if t.grad_fn is not None]
            if any(_reaches(t.grad_fn, sources, stops) for t in inputs):
                found[name] = None

        return hook

    skip = {
        id(s)
        for m in [*unit, *(b for b in model.modules() if isinstance(b, blocks))]
        for s in m.modules()
    }
    handles = [u.register_forward_hook(mark(sources)) for u in unit]
    handles += [
        b.register_forward_hook(mark(stops)) for b in model.modules() if isinstance(b, blocks)
    ]
    for name, m in model.named_modules():
        if id(m) in skip or not any(True for _ in m.parameters(recurse=False)):
            continue
        if any(id(s) in skip for s in m.modules()):  # a parent of the unit or of a block
            continue
        handles.append(m.register_forward_pre_hook(check(name), with_kwargs=True))
    try:
        with torch.enable_grad():
            call_model(model, batch)
    finally:
        for h in handles:
            h.remove()
    return list(found)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The floating tensors in ``value`` (nested tuples, lists, mappings, model outputs)."""
    if isinstance(value, torch.Tensor):
        return [value] if torch.is_floating_point(value) else []
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _reaches(node: Any, sources: set[Any], stops: set[Any]) -> bool:
    """Whether the autograd graph from ``node`` reaches a node of ``sources`` without passing
    one of ``stops``."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is None or n in seen or n in stops:
            continue
        if n in sources:
            return True
        seen.add(n)
        todo.extend(nxt for nxt, _ in n.next_functions)
    return False


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


def _tie_report(
    sharded: nn.Module, emb: nn.Module, tied: Sequence[str], groups: Sequence[Sequence[Any]]
) -> dict[str, Any]:
    """Per tied module, read from what torch built: whether every tensor it shares is managed by
    the embedding's FSDP2 unit (its state's param groups), and whether each of them is still one
    object under all its holders after sharding."""
    state = _compat.fsdp2_state(emb)
    managed = (
        {id(p) for group in _compat.fsdp2_managed_params(state) for p, _ in group}
        if state is not None
        else set()
    )

    def held(fqn: str, attr: str) -> Any:
        return getattr(sharded.get_submodule(fqn), attr)

    out = {}
    for t in tied:
        mine = [g for g in groups if any(f == t for f, _ in g)]
        out[t] = {
            "same_unit": all(id(held(f, a)) in managed for g in mine for f, a in g if f == t),
            "still_tied": all(len({id(held(f, a)) for f, a in g}) == 1 for g in mine),
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
    consumers: Sequence[str],
    blocks: tuple[type[nn.Module], ...],
) -> nn.Module:
    """FSDP1: ``CustomPolicy`` whose function returns the embedding's overrides for the
    embedding and each consumer of its output. FSDP2: ``fully_shard`` per unit, the embedding
    (with the modules tied to it: FSDP2 takes several modules as one unit) first, then each
    consumer with the embedding's options, then the blocks and the root."""
    fp32 = [model.get_submodule(n) for n in consumers]
    if version == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision
        from torch.distributed.fsdp.wrap import CustomPolicy

        override = embedding_options(ctx, version)
        own = {id(m) for m in [emb, *fp32]}
        policy = CustomPolicy(
            lambda m: (override or True) if id(m) in own else isinstance(m, blocks)
        )
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
            **fsdp1_options(model, planned_unit_modules(model, policy)),
        )
    options = embedding_options(ctx, version)
    emb_unit = [emb, *(model.get_submodule(n) for n in outermost(tied))]
    _compat.fully_shard()(emb_unit if tied else emb, **options)
    for m in fp32:
        _compat.fully_shard()(m, **options)
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
    #: Modules outside the blocks that consume the embedding's fp32 output (own fp32 units).
    consumers: list[str]
    #: The units held to the embedding's expectations: itself, its tied modules' outermost,
    #: and the consumers.
    fp32_units: list[str]
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
        groups = tie_groups(model)
        batch = built.batch(batch_size=2, device=ctx.device)
        unit = [emb, *(model.get_submodule(n) for n in outermost(tied))]
        consumers = output_consumers(model, unit, blocks, batch)
        sharded = _shard_mixed(model, ctx, version, emb, tied, consumers, blocks)
        strategies = (
            fsdp1_strategies(sharded) if version == "fsdp1" else fsdp2_unit_strategies(sharded)
        )
        seen: dict[str, tuple[str, str]] = {}
        with record_compute_dtypes(model, seen, also=consumers):
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
            "tied": _tie_report(sharded, emb, tied, groups),
            "consumers": consumers,
            "fp32_units": [emb_name, *outermost(tied), *consumers],
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


def _computes_through_a_tie(
    fqn: str, fp32: Sequence[str], compute_of: Callable[[str], set[str]]
) -> bool:
    """An fp32 unit whose modules never run a forward of their own (T5's ``shared``: its weight
    is tied to ``encoder.embed_tokens`` and ``decoder.embed_tokens``, which run instead)
    computes nothing to observe: its weight computes through the tied units, which are judged
    themselves. Only when another fp32 unit was observed computing, and only in fp32."""
    if compute_of(fqn):
        return False
    ran = [compute_of(u) for u in fp32 if u != fqn and compute_of(u)]
    return bool(ran) and all(seen == {"torch.float32"} for seen in ran)


def _rank_problems(v: MixedResult) -> list[str]:
    """One rank's units against what the configuration wants of each."""
    problems = _tie_problems(v)
    units = {u.fqn: u for u in units_of(v, "units")}
    rank = v["rank"]

    def compute_of(unit: str, seen: Mapping[str, Any] = v["compute_dtypes"]) -> set[str]:
        return {w for n, (_, w) in seen.items() if n == unit or n.startswith(unit + ".")}

    fp32 = v.get("fp32_units", [v["embedding"], *v.get("tied", {})])
    want = {u: ("NO_SHARD", "torch.float32") for u in fp32}
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
        if compute_of(fqn) != {dtype} and not _computes_through_a_tie(fqn, fp32, compute_of):
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
    consumers = values[0].get("consumers", [])
    if consumers:
        with_tied += f", the consumers of its output ({', '.join(consumers)}) fp32 units too,"
    return Verdict(
        True,
        f"embedding {values[0]['embedding']}{with_tied} NO_SHARD fp32, "
        f"{len(values[0]['blocks'])} blocks FULL_SHARD bf16, on every rank",
        {"units": len(values[0]["units"])},
        {},
    )
