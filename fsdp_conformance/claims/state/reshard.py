"""``state.reshard``: a checkpoint saved by fewer ranks (a process group or mesh of their
own), loaded by the whole world into both FSDP versions, against the single-process reference,
bitwise (docs/state.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import FaultTable
from fsdp_conformance.claims.state.common import (
    DEFAULT_SPEC,
    WRONG_SHARDS_WRITTEN,
    Digests,
    build_sharded,
    files_in,
    judge_targets,
    load_checkpoint,
    reference_digests,
    save_checkpoint,
    shared_folder,
)
from fsdp_conformance.fsdp import capabilities
from fsdp_conformance.fsdp.sharding import check_fsdp_version
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models.model_spec import ModelSpec

#: Where a checkpoint saved at the smaller world size is loaded: both FSDP versions, at the
#: whole world size.
RESHARD_TARGETS = ("fsdp1", "fsdp2")


class ReshardResult(TypedDict):
    """:func:`rank_reshard`'s result on one rank."""

    rank: int
    version: str
    #: How many ranks saved the checkpoint (:func:`saving_ranks`).
    saved_by: int
    files: list[str]
    #: The full state's digests of the model loaded into each target.
    loaded: dict[str, Digests]


#: The negative controls of this family: torch's DCP save writing wrong shards.
FAULTS = FaultTable(wrong_shards_written=WRONG_SHARDS_WRITTEN)


def saving_ranks(world_size: int) -> int:
    """How many ranks save the checkpoint that the whole world loads: half of them (at least
    one), so that the load reshards (world size 2 saves at 1, world size 4 at 2)."""
    return max(1, world_size // 2)


def rank_reshard(
    ctx: RankContext,
    spec: ModelSpec = DEFAULT_SPEC,
    version: str = "fsdp2",
    seed: int = 0,
    fault: str | Sequence[str] | None = None,
) -> ReshardResult:
    """The first :func:`saving_ranks` ranks shard the model on a process group of their own and
    save it with ``torch.distributed.checkpoint`` (that group's world size); then every rank
    loads it into each of :data:`RESHARD_TARGETS` at the whole world size; every target's
    digests. ``fault``: the negative controls of
    :data:`FAULTS` (``wrong_shards_written``)."""
    import torch.distributed as dist

    check_fsdp_version(version)
    capabilities.require(capabilities.FSDP2_ON_CPU, ctx.device_type)  # loads into FSDP2
    savers = saving_ranks(ctx.world_size)
    group = dist.new_group(ranks=list(range(savers)))  # every rank calls it, as c10d requires
    try:
        with FAULTS.inject(fault, ctx), shared_folder(ctx, "fsdp-conformance-reshard-") as path:
            files, loaded = _save_on_group_and_load(ctx, spec, version, seed, group, savers, path)
    finally:
        dist.destroy_process_group(group)
    return {
        "rank": ctx.rank,
        "version": version,
        "saved_by": savers,
        "files": files,
        "loaded": loaded,
    }


def _save_on_group_and_load(
    ctx: RankContext, spec: ModelSpec, version: str, seed: int, group: Any, savers: int, path: str
) -> tuple[list[str], dict[str, Digests]]:
    import torch.distributed as dist

    if ctx.rank < savers:
        if version == "fsdp1":
            on_group: dict[str, Any] = {"process_group": group}
        else:
            from torch.distributed.device_mesh import DeviceMesh

            on_group = {"mesh": DeviceMesh.from_group(group, ctx.device_type)}
        source = build_sharded(ctx, spec, version, seed, **on_group)
        save_checkpoint(source, version, path, process_group=group)
    dist.barrier()
    files = files_in(path)
    return files, {
        target: load_checkpoint(ctx, spec, target, path, seed + 1) for target in RESHARD_TARGETS
    }


def verdict_reshard(values: Sequence[ReshardResult], params: Mapping[str, Any]) -> Verdict:
    """Every target, on every rank: the model loaded at the whole world size from the checkpoint
    the smaller world saved equals the reference, tensor by tensor, bitwise."""
    spec = params.get("spec", DEFAULT_SPEC)
    version = params.get("version", "fsdp2")
    expected = reference_digests(spec, params.get("seed", 0))
    saved_by = values[0]["saved_by"]
    tree, bad = judge_targets(
        expected,
        [(v["rank"], v["loaded"]) for v in values],
        RESHARD_TARGETS,
        lambda t: f"loaded into {t} at world size {len(values)}",
    )
    files = values[0]["files"]
    figures = {
        "saved_world_size": saved_by,
        "loaded_world_size": len(values),
        "targets": list(RESHARD_TARGETS),
        "failed_targets": sorted(set(bad)),
    }
    head = (
        f"{version} {spec.name}: sharded state saved with torch.distributed.checkpoint by "
        f"{saved_by} rank(s) on a group of their own ({len(files)} files), loaded at world "
        f"size {len(values)} into each FSDP version, against the single-process reference, "
        "bitwise"
    )
    return Verdict(not bad, head + ":\n" + "\n".join(tree), figures, {"files": files})
