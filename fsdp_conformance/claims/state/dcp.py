"""``state.dcp``: a sharded model saved with ``torch.distributed.checkpoint`` (real files),
loaded into both FSDP versions and into one unsharded process, against the single-process
reference, bitwise (docs/state.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import FaultTable
from fsdp_conformance.claims.state.common import (
    DCP_TARGETS,
    DEFAULT_SPEC,
    WRONG_SHARDS_WRITTEN,
    Digests,
    build_sharded,
    files_in,
    judge_targets,
    load_checkpoint,
    reference_digests,
    require_dcp_targets,
    save_checkpoint,
    shared_folder,
    where,
)
from fsdp_conformance.fsdp.sharding import check_fsdp_version
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models.model_spec import ModelSpec


class DcpResult(TypedDict):
    """:func:`rank_dcp`'s result on one rank."""

    rank: int
    version: str
    #: The checkpoint's files.
    files: list[str]
    #: The full state's digests of the model loaded into each target.
    loaded: dict[str, Digests]


#: The negative controls of this family: torch's DCP save writing wrong shards.
FAULTS = FaultTable(wrong_shards_written=WRONG_SHARDS_WRITTEN)


def rank_dcp(
    ctx: RankContext,
    spec: ModelSpec = DEFAULT_SPEC,
    version: str = "fsdp2",
    seed: int = 0,
    fault: str | Sequence[str] | None = None,
) -> DcpResult:
    """Save the sharded model with ``torch.distributed.checkpoint`` into a folder every rank
    writes to, then load it into each of :data:`DCP_TARGETS`; every target's digests.
    ``fault``: the negative controls of :data:`FAULTS`
    (``wrong_shards_written``)."""
    check_fsdp_version(version)
    require_dcp_targets(ctx)
    with FAULTS.inject(fault, ctx), shared_folder(ctx, "fsdp-conformance-dcp-") as path:
        source = build_sharded(ctx, spec, version, seed)
        save_checkpoint(source, version, path)
        files = files_in(path)
        loaded = {
            target: load_checkpoint(ctx, spec, target, path, seed + 1) for target in DCP_TARGETS
        }
    return {"rank": ctx.rank, "version": version, "files": files, "loaded": loaded}


def verdict_dcp(values: Sequence[DcpResult], params: Mapping[str, Any]) -> Verdict:
    """Every target, on every rank: the model loaded from the checkpoint equals the reference,
    tensor by tensor, bitwise."""
    spec = params.get("spec", DEFAULT_SPEC)
    version = params.get("version", "fsdp2")
    expected = reference_digests(spec, params.get("seed", 0))
    one_process = "one process, no_dist: world size 1"
    tree, bad = judge_targets(
        expected,
        [(v["rank"], v["loaded"]) for v in values],
        DCP_TARGETS,
        lambda t: f"loaded into {t} ({where(t, len(values), one_process)})",
    )
    files = values[0]["files"]
    figures = {
        "targets": list(DCP_TARGETS),
        "files": len(files),
        "tensors": len(expected),
        "failed_targets": sorted(set(bad)),
    }
    head = (
        f"{version} {spec.name}: sharded state saved with torch.distributed.checkpoint at "
        f"world size {len(values)} ({len(files)} files), loaded into each target, against "
        "the single-process reference, bitwise"
    )
    return Verdict(not bad, head + ":\n" + "\n".join(tree), figures, {"files": files})
