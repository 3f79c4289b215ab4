"""``state.checkpoint``: a checkpoint saved by one run (``run --save-checkpoint DIR``) loaded by
another, maybe on another torch (``--load-checkpoint DIR``), into both FSDP versions and one
process: the values it saved, bitwise (docs/state.md).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import torch

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import FaultTable
from fsdp_conformance.claims.state.common import (
    DCP_TARGETS,
    DEFAULT_SPEC,
    WRONG_SHARDS_WRITTEN,
    Digests,
    build_sharded,
    checkpoint_folder,
    digests,
    files_in,
    judge_targets,
    load_checkpoint,
    prepare_folder,
    reference_digests,
    refusal_reason,
    require_dcp_targets,
    save_checkpoint,
    unreadable_line,
    where,
    wrong_value_read,
)
from fsdp_conformance.fsdp.sharding import check_fsdp_version
from fsdp_conformance.fsdp.state_dict_kinds import (
    get_state,
)
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models.model_spec import ModelSpec

#: Written beside each saved checkpoint: who saved it (torch, FSDP version, model, world size)
#: and the digests of every value saved, which a later run's load must give back.
MANIFEST = "fsdp-conformance-checkpoint.json"


class Manifest(TypedDict):
    """:data:`MANIFEST`'s content."""

    torch: str
    version: str
    model: str
    world_size: int
    seed: int
    digests: Digests


class _Loaded(TypedDict):
    manifest: Manifest
    loaded: dict[str, Digests]


class Loaded(_Loaded, total=False):
    """An earlier run's checkpoint, loaded: its manifest and each target's digests; ``refused``:
    the targets this torch refused to load it into (torch's reason, one line), their
    tracebacks in ``tracebacks``."""

    refused: dict[str, str]
    tracebacks: dict[str, str]


class Saved(TypedDict):
    """This run's checkpoint: its folder, its files and each target's digests read back."""

    path: str
    files: list[str]
    read_back: dict[str, Digests]


class _Rank(TypedDict):
    rank: int
    version: str


class CheckpointResult(_Rank, total=False):
    """:func:`rank_checkpoint`'s result on one rank (``load``, ``save``: the folders given)."""

    load: Loaded
    save: Saved


#: The negative controls of this family: torch's DCP save and load (looked up at call time).
FAULTS = FaultTable(wrong_shards_written=WRONG_SHARDS_WRITTEN, wrong_value_read=wrong_value_read())


def _read_manifest(path: str, root: str, version: str, spec: ModelSpec) -> Manifest:
    import json

    from fsdp_conformance.harness import CheckSkipped

    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            manifest: Manifest = json.load(f)
    except FileNotFoundError:
        raise CheckSkipped(
            f"no checkpoint of {version} {spec.name} in {root} ({path} has no {MANIFEST}): "
            f"run `fsdp-conformance run --save-checkpoint {root}` with the same model on the "
            "torch to load from first"
        ) from None
    return manifest


def rank_checkpoint(
    ctx: RankContext,
    spec: ModelSpec = DEFAULT_SPEC,
    version: str = "fsdp2",
    seed: int = 0,
    save_to: str | None = None,
    load_from: str | None = None,
    fault: str | Sequence[str] | None = None,
) -> CheckpointResult:
    """``load_from``: the checkpoint an earlier run (another torch, maybe another world size)
    saved for this variant, loaded into each of :data:`DCP_TARGETS`; the digests of each and
    the saver's manifest. ``save_to``: the sharded model saved with
    ``torch.distributed.checkpoint`` into this variant's folder with a manifest (rank 0), then
    read back into a fresh model of ``version``. The load runs first, so one run can load an
    older torch's checkpoint and save its own. ``fault``: the negative controls of
    :data:`FAULTS` (``wrong_value_read`` for the load,
    ``wrong_shards_written`` for the save)."""
    check_fsdp_version(version)
    require_dcp_targets(ctx)
    out: CheckpointResult = {"rank": ctx.rank, "version": version}
    with FAULTS.inject(fault, ctx):
        if load_from is not None:
            path = checkpoint_folder(load_from, version, spec)
            manifest = _read_manifest(path, load_from, version, spec)
            out["load"] = _load(ctx, spec, path, manifest, seed + 1)
        if save_to is not None:
            out["save"] = _save(ctx, spec, version, seed, checkpoint_folder(save_to, version, spec))
    return out


def _load(ctx: RankContext, spec: ModelSpec, path: str, manifest: Manifest, seed: int) -> Loaded:
    """The checkpoint at ``path`` loaded into each of :data:`DCP_TARGETS`; a target this torch
    refuses to load it into (``dcp.load`` raised: another torch's files, say) is recorded with
    torch's reason, not raised, so the verdict reports it in one line."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    loaded: Loaded = {"manifest": manifest, "loaded": {}}
    for target in DCP_TARGETS:
        try:
            loaded["loaded"][target] = load_checkpoint(ctx, spec, target, path, seed)
        # The finding: what torch raised (a CheckpointException is a BaseException).
        except (Exception, CheckpointException) as exc:  # noqa: BLE001
            loaded.setdefault("refused", {})[target] = refusal_reason(exc)
            loaded.setdefault("tracebacks", {})[target] = traceback.format_exc()
    return loaded


def _save(ctx: RankContext, spec: ModelSpec, version: str, seed: int, path: str) -> Saved:
    """The sharded model saved into ``path`` with its manifest, and read back."""
    import json

    import torch.distributed as dist

    problem = [prepare_folder(path, MANIFEST) if ctx.rank == 0 else None]
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise RuntimeError(problem[0])
    source = build_sharded(ctx, spec, version, seed)
    saved = digests(get_state(source, version, "full"))
    save_checkpoint(source, version, path)
    if ctx.rank == 0:
        manifest: Manifest = {
            "torch": torch.__version__,
            "version": version,
            "model": spec.name,
            "world_size": ctx.world_size,
            "seed": seed,
            "digests": saved,
        }
        with open(os.path.join(path, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
    dist.barrier()
    # Read back into every target a later load uses: the same work (and warnings) on both
    # sides of an upgrade gate, so compare shows only what differs.
    return {
        "path": path,
        "files": files_in(path),
        "read_back": {t: load_checkpoint(ctx, spec, t, path, seed + 1) for t in DCP_TARGETS},
    }


def verdict_checkpoint(values: Sequence[CheckpointResult], params: Mapping[str, Any]) -> Verdict:
    """Load: every target, on every rank, equals the values the saving run recorded, bitwise.
    Save: the checkpoint read back into every target on every rank equals the single-process
    reference. The figures are the checkpoint's torch and world size, the same on both sides of
    an upgrade gate (the save's own; the load's from the manifest)."""
    spec = params.get("spec", DEFAULT_SPEC)
    version = params.get("version", "fsdp2")
    tree: list[str] = []
    bad: list[str] = []
    heads: list[str] = []
    figures: dict[str, Any] = {}
    if "load" in values[0]:
        manifest = values[0]["load"]["manifest"]
        refused = _refused(values)
        if refused:
            return _unreadable(values, manifest, refused, version, spec)
        expected = {k: list(d) for k, d in manifest["digests"].items()}
        lines, failed = judge_targets(
            expected,
            [(v["rank"], v["load"]["loaded"]) for v in values],
            DCP_TARGETS,
            lambda t: f"loaded into {t} ({where(t, len(values), 'one process, no_dist')})",
        )
        tree += lines
        bad += [f"load:{t}" for t in failed]
        heads.append(
            f"loaded the checkpoint torch {manifest['torch']} saved at world size "
            f"{manifest['world_size']} under {manifest['version']}, on torch "
            f"{torch.__version__}, against the values it saved, bitwise"
        )
        figures.update(
            checkpoint_torch=manifest["torch"], checkpoint_world_size=manifest["world_size"]
        )
    if "save" in values[0]:
        lines, failed = judge_targets(
            reference_digests(spec, params.get("seed", 0)),
            [(v["rank"], v["save"]["read_back"]) for v in values],
            DCP_TARGETS,
            lambda t: f"saved, read back into {t}",
        )
        tree += lines
        bad += [f"save:{t}" for t in failed]
        files = values[0]["save"]["files"]
        heads.append(
            f"saved to {values[0]['save']['path']} ({len(files)} files) at world size "
            f"{len(values)} on torch {torch.__version__}, read back against the "
            "reference, bitwise"
        )
        figures.setdefault("checkpoint_torch", torch.__version__)
        figures.setdefault("checkpoint_world_size", len(values))
    figures["failed"] = sorted(set(bad))
    head = f"{version} {spec.name}: " + "; ".join(heads)
    return Verdict(not bad, head + ":\n" + "\n".join(tree), figures)


def _refused(values: Sequence[CheckpointResult]) -> dict[str, str]:
    """The targets any rank could not load the checkpoint into: torch's reason (the lowest
    rank's), by target in :data:`DCP_TARGETS` order."""
    out: dict[str, str] = {}
    for target in DCP_TARGETS:
        for value in sorted(values, key=lambda v: v["rank"]):
            reason = value["load"].get("refused", {}).get(target)
            if reason is not None:
                out[target] = reason
                break
    return out


def _unreadable(
    values: Sequence[CheckpointResult],
    manifest: Manifest,
    refused: Mapping[str, str],
    version: str,
    spec: ModelSpec,
) -> Verdict:
    """A load torch refused: a failure whose first line says which torch wrote the checkpoint,
    which cannot read it and torch's reason; the tracebacks in the data, not the message."""
    reason = next(iter(refused.values()))
    first = sorted(values, key=lambda v: v["rank"])[0]["load"]
    lines = [unreadable_line(manifest["torch"], torch.__version__, reason)]
    lines.append(
        f"{version} {spec.name}: the checkpoint saved at world size {manifest['world_size']} "
        f"under {manifest['version']}, loaded with dcp.load (options unset):"
    )
    lines += [
        f"  into {t} ({where(t, len(values), 'one process, no_dist')}): refused"
        + (" (the reason above)" if r == reason else f": {r}")
        for t, r in refused.items()
    ]
    figures = {
        "checkpoint_torch": manifest["torch"],
        "checkpoint_world_size": manifest["world_size"],
        "load_torch": torch.__version__,
        "unreadable": list(refused),
        "failed": sorted(f"load:{t}" for t in refused),
    }
    return Verdict(False, "\n".join(lines), figures, {"tracebacks": first.get("tracebacks", {})})
