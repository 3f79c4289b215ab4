"""``state.checkpoint.optimizer`` and ``state.checkpoint.torch_save``: training state (model and
AdamW) saved by one run (``run --save-checkpoint DIR``) and loaded by another, maybe on another
torch and world size (``--load-checkpoint DIR``), as users save and load it; the loaded values
against the saved ones, bitwise, and the next step against the unbroken run (docs/state.md).

Two families, one procedure:

* ``optimizer``: ``get_state_dict`` and ``torch.distributed.checkpoint`` (``dcp.save``), loaded
  with ``dcp.load`` and ``set_state_dict`` (options unset) into the variant's FSDP version at
  the loader's world size (resharded by DCP) and into one unsharded process (``no_dist``);
* ``torch_save`` (FSDP1): the full, sharded and local state dicts (model and optimizer:
  ``FSDP.optim_state_dict`` under each ``state_dict_type``, the local one the optimizer's own)
  written with ``torch.save`` and read with ``torch.load(path)``, its defaults left unset, so a
  change of ``weights_only``'s default (torch 2.6, pytorch/pytorch#137602) shows. Only the full
  dict can be loaded at another world size; the sharded and local files are per rank.

The saver records in a manifest the digests of every value it saved and of the state after
its own next step (the unbroken run). A load that torch refuses is a failure of one line
(:func:`~fsdp_conformance.claims.state.state_dicts.unreadable_line`), never an error.
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.state import resume
from fsdp_conformance.claims.state.checkpoint import checkpoint_folder, prepare_folder
from fsdp_conformance.claims.state.faults import FAULTS
from fsdp_conformance.claims.state.state_dicts import (
    DEFAULT_SPEC,
    Digests,
    build,
    build_sharded,
    differences,
    digests,
    files_in,
    get_state,
    refusal_reason,
    require_dcp_targets,
    section,
    set_state,
    unreadable_line,
)
from fsdp_conformance.fsdp.reference_step import (
    LOSS_RTOL,
    UPDATE_RTOL,
    TensorComparison,
    compare_tensors,
    comparison_problems,
    full_params,
    loss_problems,
    reference_params,
    update_resolution,
    updates,
)
from fsdp_conformance.fsdp.sharding import check_fsdp_version
from fsdp_conformance.harness import CheckSkipped, RankContext
from fsdp_conformance.models.model_spec import ModelSpec

#: Written beside each saved checkpoint (its own name: a folder of this family is never read as
#: ``state.checkpoint``'s).
MANIFEST = "fsdp-conformance-training-state.json"
#: The families: each a folder of its own under the run's checkpoint folder.
FAMILIES = ("optimizer", "torch_save")
#: The ``torch.save`` artifacts: FSDP1's ``state_dict_type`` kinds.
ARTIFACTS = ("full", "sharded", "local")
#: The artifacts torch can load at another world size (the sharded and local files are one
#: rank's shards of its own ``ShardedTensor`` / ``FlatParameter``).
RESHARDABLE = frozenset({"full"})
#: AdamW's learning rate on both sides (the reference's too).
LR = 1e-2
#: The step trained before the save (so the optimizer holds state) draws from this seed.
TRAIN_SEED = resume.STEP_SEED + 1
#: The call whose refusal is ``torch.load``'s (a weights-only refusal has a fix to name).
TORCH_LOAD = "torch.load"
#: The check that judges the next step of FSDP1's full optimizer state dict loaded into one
#: process, where parameters share one ``step`` tensor (a known torch defect).
SHARED_STEP_CHECK = "state.checkpoint.torch_save.shared_step"
#: The fix for a file ``torch.load`` refuses with its defaults.
WEIGHTS_ONLY_FIX = (
    "torch.load's default weights_only=True (torch 2.6, pytorch/pytorch#137602) refuses "
    "what the file holds: load a file you trust with torch.load(path, weights_only=False), "
    "or allow its classes with torch.serialization.add_safe_globals([...])"
)


class StepDigests(TypedDict):
    """A training step: its loss (and the loss's exact bits) and the digests of the model's and
    the optimizer's whole state after it."""

    loss: float
    loss_hex: str
    digests: Digests


class Manifest(TypedDict):
    """:data:`MANIFEST`'s content: who saved (torch, FSDP version, model, world size), the
    digests of every value saved, and the step after the save (the unbroken run)."""

    torch: str
    version: str
    model: str
    family: str
    world_size: int
    seed: int
    saved: Digests
    unbroken: StepDigests
    #: ``torch_save``: per artifact, "" where the saver's own read-back read it with
    #: ``torch.load``'s defaults, else torch's reason (written after the read-back).
    read_back: dict[str, str]


class _Target(TypedDict):
    #: "" when loaded; else torch's reason for refusing, one line (on the lowest rank that did).
    refused: str


class TargetResult(_Target, total=False):
    """One target of one checkpoint on one rank: the loaded values' digests and the next step,
    or why it could not be loaded."""

    #: The parameters whose AdamW ``step`` the file holds as one tensor shared with another
    #: parameter's (FSDP1's full optimizer state dict): their next step in one process is left
    #: to :data:`SHARED_STEP_CHECK`.
    shared_step: list[str]

    #: The call that raised (``torch.load``, ``dcp.load / set_state_dict``, ...).
    call: str
    #: The traceback of a refused load (the report's data, not the message).
    traceback: str
    loaded: Digests
    step: StepDigests
    #: The reference step on this torch from the same loaded values: its loss, and the target's
    #: update against its own.
    reference_loss: float
    #: AdamW's moments after the step against the reference's (``exp_avg``, ``exp_avg_sq``).
    moments: dict[str, TensorComparison]
    #: AdamW's step counts after the step: this target's, the reference's.
    step_counts: list[list[float]]
    #: The parameters' update against AdamW's rule from the step's own moments.
    update: TensorComparison


class FolderResult(TypedDict):
    """One saved checkpoint (a world size) loaded into every target this run can load it into."""

    path: str
    manifest: Manifest
    files: list[str]
    targets: dict[str, TargetResult]
    #: target -> why it was not tried (torch cannot reshard it).
    not_loaded: dict[str, str]


class _Rank(TypedDict):
    rank: int
    version: str
    family: str
    world_size: int


class AcrossResult(_Rank, total=False):
    """:func:`rank_across_versions`'s result on one rank: ``load`` (every saved world size found)
    and ``save`` (this run's checkpoint, read back as a later run reads it)."""

    load: list[FolderResult]
    save: FolderResult


# ============================================================================================
# The user's steps (module level: a fault replaces them)
# ============================================================================================


def torch_load(path: str) -> Any:
    """A ``torch.save`` file read as a user reads it: ``torch.load(path)``, defaults unset."""
    return torch.load(path)


def next_step(model: nn.Module, optim: torch.optim.Optimizer, batch: Any) -> float:
    """The step a loaded run takes next (the fault ``next_step_perturbed`` changes it)."""
    return resume.train_step(model, optim, batch, resume.STEP_SEED)


def save_dcp(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    """Model and optimizer state saved as torch's recipe does: ``get_state_dict``, ``dcp.save``."""
    resume.save_train_state(model, optim, path)


def load_dcp(
    model: nn.Module, optim: torch.optim.Optimizer, path: str, *, no_dist: bool = False
) -> None:
    """:func:`save_dcp`'s files loaded with ``get_state_dict``, ``dcp.load`` and
    ``set_state_dict``, options unset (``no_dist``: one process, resharded to world size 1)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    model_state, optim_state = get_state_dict(model, optim)
    # dcp.load fills the dicts in place: the same objects go back to set_state_dict.
    load(
        {"model": model_state, "optim": optim_state},
        storage_reader=FileSystemReader(path),
        no_dist=no_dist,
    )
    set_state_dict(model, optim, model_state_dict=model_state, optim_state_dict=optim_state)


def set_optimizer(
    model: nn.Module, optim: torch.optim.Optimizer, kind: str, state: dict[str, Any]
) -> None:
    """An optimizer state dict read from a ``torch.save`` file loaded as a user loads it:
    FSDP1's full or sharded dict with ``FSDP.optim_state_dict_to_load``, the local one (the
    optimizer's own) with ``optim.load_state_dict``, a full one into an unsharded model with
    ``set_optimizer_state_dict``."""
    if kind == "local":
        optim.load_state_dict(state)
    elif kind == "unsharded":
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(model, optim, state)
    else:
        resume.set_optim_state(model, optim, "fsdp1", kind, state)


# ============================================================================================
# Rank side
# ============================================================================================


def family_folder(root: str, family: str, version: str, spec: ModelSpec, world_size: int) -> str:
    """The folder of one variant's checkpoint saved at ``world_size``."""
    return f"{checkpoint_folder(os.path.join(root, family), version, spec)}-ws{world_size}"


def saved_folders(root: str, family: str, version: str, spec: ModelSpec) -> list[str]:
    """Every folder of this variant under ``root`` that holds a manifest: one per saved world
    size, smallest first."""
    found = glob.glob(glob.escape(family_folder(root, family, version, spec, 0)[:-1]) + "*")
    return sorted(
        (p for p in found if os.path.exists(os.path.join(p, MANIFEST))),
        key=lambda p: int(p.rsplit("-ws", 1)[1]) if p.rsplit("-ws", 1)[1].isdigit() else 0,
    )


def targets_of(family: str, version: str) -> tuple[str, ...]:
    """Where a checkpoint of ``family`` is loaded: ``artifact:target`` for ``torch_save``."""
    if family == "optimizer":
        return (version, "unsharded")
    return ("full:fsdp1", "full:unsharded", "sharded:fsdp1", "local:fsdp1")


def rank_across_versions(
    ctx: RankContext,
    spec: ModelSpec = DEFAULT_SPEC,
    version: str = "fsdp2",
    family: str = "optimizer",
    seed: int = 0,
    save_to: str | None = None,
    load_from: str | None = None,
    fault: str | Sequence[str] | None = None,
) -> AcrossResult:
    """``load_from``: every checkpoint of this variant an earlier run saved (each world size),
    loaded into each target (:func:`targets_of`) with the next step taken. ``save_to``: the model
    trained one AdamW step, saved with its optimizer (``family``'s way) and a manifest, then
    read back as a later load reads it. The load runs first. ``fault``: the negative controls
    of :data:`~fsdp_conformance.claims.state.faults.FAULTS` (``optimizer_not_loaded``,
    ``wrong_value_read``, ``torch_load_refused``, ``next_step_perturbed``)."""
    check_fsdp_version(version)
    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: expected one of {', '.join(FAMILIES)}")
    if family == "optimizer":
        require_dcp_targets(ctx)
    out: AcrossResult = {
        "rank": ctx.rank,
        "version": version,
        "family": family,
        "world_size": ctx.world_size,
    }
    with FAULTS.inject(fault, ctx):
        if load_from is not None:
            folders = saved_folders(load_from, family, version, spec)
            if not folders:
                raise CheckSkipped(
                    f"no {family} checkpoint of {version} {spec.name} in {load_from} (no "
                    f"{family_folder(load_from, family, version, spec, ctx.world_size)} or other "
                    f"world size with a {MANIFEST}): run `fsdp-conformance run --save-checkpoint "
                    f"{load_from}` with the same model on the torch to load from first"
                )
            out["load"] = [_load_folder(ctx, spec, version, family, seed, p) for p in folders]
        if save_to is not None:
            path = family_folder(save_to, family, version, spec, ctx.world_size)
            _save(ctx, spec, version, family, seed, path)
            out["save"] = _load_folder(ctx, spec, version, family, seed, path)
            _record_read_back(ctx, out["save"])
    return out


def _record_read_back(ctx: RankContext, saved: FolderResult) -> None:
    """Rank 0 adds to the manifest whether this torch's ``torch.load`` read each artifact
    with its defaults (every rank agreed on a refusal in :func:`_load_target`)."""
    import torch.distributed as dist

    read_back: dict[str, str] = {}
    for target, result in saved["targets"].items():
        artifact = target.split(":")[0]
        refused = result["refused"] if result.get("call") == TORCH_LOAD else ""
        read_back[artifact] = read_back.get(artifact) or refused
    saved["manifest"]["read_back"] = read_back
    if ctx.rank == 0:
        with open(os.path.join(saved["path"], MANIFEST), "w", encoding="utf-8") as f:
            json.dump(saved["manifest"], f, indent=1)
    dist.barrier()


def _whole_state(
    model: nn.Module, optim: torch.optim.Optimizer, target: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model's and the optimizer's whole state, as copies (collectives on a sharded
    ``target``): ``state_dict()`` and ``get_optimizer_state_dict`` (keyed by parameter name)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    if target == "unsharded":
        model_state = dict(model.state_dict())
        optim_state = get_optimizer_state_dict(model, optim)
    else:
        model_state = get_state(model, target, "full")
        optim_state = get_optimizer_state_dict(
            model, optim, options=StateDictOptions(full_state_dict=True)
        )
    # Copies: a state dict shares tensors with the live model and optimizer (AdamW's step).
    return {k: v.detach().clone() for k, v in model_state.items()}, _copied(dict(optim_state))


def _copied(value: Any) -> Any:
    """``value`` with every tensor cloned on its own: unlike ``copy.deepcopy``, two entries
    holding one tensor (FSDP1 hands every parameter of a flat parameter one AdamW ``step``)
    get a tensor each, as a fresh optimizer holds them."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return copy.deepcopy(value)


def shared_steps(optim_state: Mapping[str, Any]) -> list[str]:
    """The parameters of an optimizer state dict whose ``step`` is one tensor with another
    parameter's, sorted (observed: FSDP1's full dict hands every parameter of a flat parameter
    the flat parameter's one ``step``, and ``torch.save`` keeps the sharing)."""
    holders: dict[int, list[str]] = {}
    for name, entries in optim_state.get("state", {}).items():
        step = entries.get("step") if isinstance(entries, Mapping) else None
        if isinstance(step, torch.Tensor):
            holders.setdefault(id(step), []).append(str(name))
    return sorted(n for names in holders.values() if len(names) > 1 for n in names)


def train_digests(model_state: Mapping[str, Any], optim_state: Mapping[str, Any]) -> Digests:
    """The digests of a whole model and optimizer state: the model's by key, the optimizer's
    as ``optim/<parameter>/<state>`` (AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``)."""
    flat = dict(model_state)
    for name, entries in optim_state.get("state", {}).items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                flat[f"optim/{name}/{key}"] = value
    return digests(flat)


def _fresh(
    ctx: RankContext, spec: ModelSpec, target: str, seed: int
) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = build(spec, seed, ctx.device) if target == "unsharded" else None
    if model is None:
        model = build_sharded(ctx, spec, target, seed)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _save(
    ctx: RankContext, spec: ModelSpec, version: str, family: str, seed: int, path: str
) -> None:
    """The model trained one AdamW step, saved with its optimizer into ``path``, then its next
    step (the unbroken run); rank 0 writes the manifest."""
    import torch.distributed as dist

    problem = [prepare_folder(path, MANIFEST) if ctx.rank == 0 else None]
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise RuntimeError(problem[0])
    model = build_sharded(ctx, spec, version, seed)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    batch = spec.batch(model, 2, ctx.device)
    resume.train_step(model, optim, batch, TRAIN_SEED)
    saved = train_digests(*_whole_state(model, optim, version))
    if family == "optimizer":
        save_dcp(model, optim, path)
    else:
        for kind in ARTIFACTS:
            model_state = get_state(model, "fsdp1", kind)
            optim_state = (
                optim.state_dict()
                if kind == "local"
                else resume.get_optim_state(model, optim, "fsdp1", kind)
            )
            if kind in RESHARDABLE and ctx.rank != 0:
                continue  # one file of the whole state, rank 0's
            torch.save(
                {"model": model_state, "optim": optim_state},
                os.path.join(path, _artifact_file(kind, ctx.rank)),
            )
    loss = resume.train_step(model, optim, batch, resume.STEP_SEED)
    after = train_digests(*_whole_state(model, optim, version))
    if ctx.rank == 0:
        manifest: Manifest = {
            "torch": torch.__version__,
            "version": version,
            "model": spec.name,
            "family": family,
            "world_size": ctx.world_size,
            "seed": seed,
            "saved": saved,
            "unbroken": {"loss": loss, "loss_hex": loss.hex(), "digests": after},
            "read_back": {},
        }
        with open(os.path.join(path, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
    dist.barrier()


def _artifact_file(kind: str, rank: int) -> str:
    return f"{kind}.pt" if kind in RESHARDABLE else f"{kind}-rank{rank}.pt"


def _load_folder(
    ctx: RankContext, spec: ModelSpec, version: str, family: str, seed: int, path: str
) -> FolderResult:
    """The checkpoint at ``path`` loaded into every target this run can load it into."""
    with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
        manifest: Manifest = json.load(f)
    saved_at = manifest["world_size"]
    result: FolderResult = {
        "path": path,
        "manifest": manifest,
        "files": files_in(path),
        "targets": {},
        "not_loaded": {},
    }
    batch = None
    for target in targets_of(family, version):
        artifact, _, into = target.rpartition(":")
        if artifact and artifact not in RESHARDABLE and saved_at != ctx.world_size:
            result["not_loaded"][target] = (
                f"{artifact} files hold one rank's shards each: loaded only at the saved world "
                f"size ({saved_at})"
            )
            continue
        model, optim = _fresh(ctx, spec, into, seed + 1)
        if batch is None:
            batch = spec.batch(model, 2, ctx.device)
        result["targets"][target] = _load_target(ctx, spec, model, optim, artifact, into, path)
        if not result["targets"][target]["refused"]:
            result["targets"][target].update(_next(ctx, spec, model, optim, into, batch, seed))
    return result


def _load_target(
    ctx: RankContext,
    spec: ModelSpec,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    artifact: str,
    into: str,
    path: str,
) -> TargetResult:
    """Load the checkpoint into ``model`` and ``optim``; a refusal (any rank's) is recorded on
    every rank, so none goes on to a collective the others skip."""
    import traceback

    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    mine: TargetResult = {"refused": ""}
    call = "dcp.load / set_state_dict"
    try:
        if not artifact:
            load_dcp(model, optim, path, no_dist=into == "unsharded")
        else:
            call = TORCH_LOAD
            state = torch_load(os.path.join(path, _artifact_file(artifact, ctx.rank)))
            call = "load_state_dict / optim_state_dict_to_load"
            if into == "unsharded" and shared_steps(state["optim"]):
                mine["shared_step"] = shared_steps(state["optim"])
            if into == "unsharded":
                model.load_state_dict(state["model"])
                set_optimizer(model, optim, "unsharded", state["optim"])
            else:
                set_state(model, "fsdp1", artifact, state["model"])
                set_optimizer(model, optim, artifact, state["optim"])
    # The finding: what torch raised (a CheckpointException is a BaseException).
    except (Exception, CheckpointException) as exc:  # noqa: BLE001
        mine = {"refused": refusal_reason(exc), "call": call, "traceback": traceback.format_exc()}
    every: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(every, (mine["refused"], mine.get("call", "")))
    refused = [(r, reason, c) for r, (reason, c) in enumerate(every) if reason]
    if refused and not mine["refused"]:
        rank, reason, c = refused[0]
        mine = {"refused": reason, "call": c, "traceback": f"(refused on rank {rank})"}
    return mine


def _next(
    ctx: RankContext,
    spec: ModelSpec,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    into: str,
    batch: Any,
    seed: int,
) -> TargetResult:
    """The loaded values' digests, the next step, and what the next step is judged by off the
    saver's torch and world size (:func:`_step_problems`): the same step taken by a
    single-process reference built from the loaded values on this torch (its loss, AdamW's
    moments after it) and the parameters' update against AdamW's rule applied to the step's own
    moments."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    model_state, optim_state = _whole_state(model, optim, into)
    loaded = train_digests(model_state, optim_state)
    reference = build(spec, seed + 2, ctx.device)
    reference.load_state_dict(model_state)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=LR)
    set_optimizer_state_dict(reference, ref_optim, optim_state)
    reference_loss = resume.train_step(reference, ref_optim, batch, resume.STEP_SEED)
    ref_state = _whole_state(reference, ref_optim, "unsharded")[1]["state"]
    before = reference_params(model) if into == "unsharded" else full_params(model, into)
    loss = next_step(model, optim, batch)
    after = reference_params(model) if into == "unsharded" else full_params(model, into)
    after_model, after_optim = _whole_state(model, optim, into)
    state = after_optim["state"]
    moments = {
        key: compare_tensors(
            {n: s[key] for n, s in state.items()}, {n: s[key] for n, s in ref_state.items()}
        )
        for key in ("exp_avg", "exp_avg_sq")
    }
    steps = sorted({float(s["step"]) for s in state.values()})
    ref_steps = sorted({float(s["step"]) for s in ref_state.values()})
    return {
        "refused": "",
        "loaded": loaded,
        "step": {
            "loss": loss,
            "loss_hex": loss.hex(),
            "digests": train_digests(after_model, after_optim),
        },
        "reference_loss": reference_loss,
        "moments": moments,
        "step_counts": [steps, ref_steps],
        "update": compare_tensors(
            updates(after, before),
            expected := updates(_adamw_rule(before, state, optim.param_groups[0]), before),
            names=sorted(expected),
            resolution=update_resolution(after, before),
        ),
    }


def _adamw_rule(
    before: Mapping[str, torch.Tensor], state: Mapping[str, Any], group: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """The parameters AdamW's rule (torch's documentation of ``torch.optim.AdamW``) gives from
    ``before`` with the moments and step count it stepped with (``state``, after the step), in
    float64: an update judged against its own moments, not against another run's gradient.
    Where a gradient is rounding-level (a bias whose true gradient is zero), Adam divides it by
    its own root mean square: its update is as large as any, and its sign is the rounding's, so
    two runs' updates cannot be compared there; their moments can (:func:`_next`)."""
    lr, (beta1, beta2) = float(group["lr"]), group["betas"]
    eps, decay = float(group["eps"]), float(group["weight_decay"])
    out = {}
    for name, p in before.items():
        if name not in state:
            continue  # a tied parameter's other name: its state is under the first
        s = state[name]
        t = float(s["step"])
        m, v = s["exp_avg"].double().cpu(), s["exp_avg_sq"].double().cpu()
        denom = (v / (1 - beta2**t)).sqrt() + eps
        out[name] = p.double().cpu() * (1 - lr * decay) - lr / (1 - beta1**t) * m / denom
    return out


# ============================================================================================
# Parent side
# ============================================================================================


def _label(manifest: Manifest, target: str, world_size: int) -> str:
    to = 1 if target.endswith("unsharded") else world_size
    return f"ws{manifest['world_size']}->ws{to} {target}"


def _bitwise_step(manifest: Manifest, target: str, world_size: int) -> bool:
    """The next step is the unbroken run's, bitwise, where it ran on the saver's torch at the
    saver's world size; elsewhere (another torch's kernels, another world size's reduction
    order) it is judged within fp32 tolerances against the reference step on this torch."""
    to = 1 if target.endswith("unsharded") else world_size
    return manifest["torch"] == torch.__version__ and to == manifest["world_size"]


def _step_problems(
    manifest: Manifest, target: str, world_size: int, result: TargetResult
) -> list[str]:
    step = result["step"]
    if _bitwise_step(manifest, target, world_size):
        unbroken = manifest["unbroken"]
        lines = []
        if step["loss_hex"] != unbroken["loss_hex"]:
            lines.append(
                f"next step's loss: expected {unbroken['loss']:.9g} (the unbroken run), got "
                f"{step['loss']:.9g}"
            )
        return lines + [
            f"after the next step: {d}" for d in differences(unbroken["digests"], step["digests"])
        ]
    rtol = UPDATE_RTOL[torch.float32]
    lines = loss_problems(
        "next step", [step["loss"]], [result["reference_loss"]], LOSS_RTOL[torch.float32]
    )
    for key, comparison in result["moments"].items():
        lines += comparison_problems(f"next step's AdamW {key}", comparison, rtol)
    got, ref = result["step_counts"]
    if got != ref:
        lines.append(f"next step's AdamW step count: {got}, the reference's {ref}")
    return lines + comparison_problems(
        "next step's update (AdamW's rule from its moments)", result["update"], rtol
    )


def verdict_checkpoint_optimizer(
    values: Sequence[AcrossResult], params: Mapping[str, Any]
) -> Verdict:
    """``state.checkpoint.optimizer``: :func:`judge_across_versions`."""
    return judge_across_versions(values, params)


def verdict_checkpoint_torch_save(
    values: Sequence[AcrossResult], params: Mapping[str, Any]
) -> Verdict:
    """``state.checkpoint.torch_save``: :func:`judge_across_versions`."""
    return judge_across_versions(values, params)


def _folders(values: Sequence[AcrossResult]) -> list[tuple[str, list[FolderResult]]]:
    """(side, each rank's result for one checkpoint, rank order) per checkpoint: the loaded
    ones, then this run's read-back."""
    ranked = sorted(values, key=lambda v: v["rank"])
    out = []
    for i in range(len(ranked[0].get("load", []))):
        out.append(("load", [v["load"][i] for v in ranked]))
    if "save" in ranked[0]:
        out.append(("save", [v["save"] for v in ranked]))
    return out


@dataclasses.dataclass
class _Judgement:
    """What :func:`judge_across_versions` gathers over the checkpoints and targets."""

    world_size: int
    tree: list[str] = dataclasses.field(default_factory=list)
    bad: list[str] = dataclasses.field(default_factory=list)
    #: label -> (the saver's torch, torch's reason, the call that raised)
    unreadable: dict[str, tuple[str, str, str]] = dataclasses.field(default_factory=dict)
    tracebacks: dict[str, str] = dataclasses.field(default_factory=dict)
    both_refuse: list[str] = dataclasses.field(default_factory=list)
    not_resharded: list[str] = dataclasses.field(default_factory=list)
    bitwise: list[str] = dataclasses.field(default_factory=list)
    tolerance: list[str] = dataclasses.field(default_factory=list)
    #: label -> the check its next step is left to
    left: dict[str, str] = dataclasses.field(default_factory=dict)
    worst: float = 0.0

    def refused(self, side: str, manifest: Manifest, target: str, first: TargetResult) -> None:
        label = _label(manifest, target, self.world_size)
        artifact = target.split(":")[0]
        # The saver's torch read it with torch.load's defaults (a manifest without the record:
        # it wrote it, so it read it); this run's own read-back is the saver's.
        saver_read = side == "load" and not manifest.get("read_back", {}).get(artifact)
        if first.get("call") == TORCH_LOAD and not saver_read:
            self.both_refuse.append(label)
            why = first["refused"].split(": ", 1)[-1]
            self.tree.append(
                f"  {label}: torch.load with its defaults refuses it on the saver's torch too "
                f"(a figure, not a failure): {why}"
            )
            return
        self.unreadable[label] = (manifest["torch"], first["refused"], first.get("call", ""))
        self.tracebacks[label] = first.get("traceback", "")
        self.bad.append(label)
        self.tree.append(f"  {label}: refused by {first.get('call')}")

    def loaded(self, manifest: Manifest, target: str, folder: Sequence[FolderResult]) -> None:
        label = _label(manifest, target, self.world_size)
        bitwise = _bitwise_step(manifest, target, self.world_size)
        if any(f["targets"][target].get("shared_step") for f in folder):
            self.left[label] = SHARED_STEP_CHECK
        wrong: dict[int, list[str]] = {}
        for rank, per_rank in enumerate(folder):
            result = per_rank["targets"][target]
            lines = [f"loaded: {d}" for d in differences(manifest["saved"], result["loaded"])]
            if label not in self.left:
                lines += _step_problems(manifest, target, self.world_size, result)
                if not bitwise:
                    moments = [c["max_rel"] for c in result["moments"].values()]
                    self.worst = max(self.worst, result["update"]["max_rel"], *moments)
            if lines:
                wrong[rank] = lines
        if label in self.left:
            how = f"left to {SHARED_STEP_CHECK} (parameters share one AdamW step tensor)"
        elif bitwise:
            how = "the unbroken run's, bitwise"
            self.bitwise.append(label)
        else:
            how = "the reference step on this torch from the loaded values, within fp32 tolerances"
            self.tolerance.append(label)
        self.tree += section(label, f"saved values, bitwise; next step {how}", wrong)
        self.bad += [label] if wrong else []


def judge_across_versions(values: Sequence[AcrossResult], params: Mapping[str, Any]) -> Verdict:
    """Per checkpoint (each saved world size, and this run's own read back) and target, on
    every rank: the loaded values equal the saved ones (the manifest's digests), bitwise; the
    next step equals the unbroken run's, bitwise on the saver's torch and world size, else
    within the loop claim's fp32 tolerances of a single-process reference step taken on this
    torch from the same loaded values. A load torch refuses fails in one line
    (:func:`~fsdp_conformance.claims.state.state_dicts.unreadable_line`); ``torch.load``
    refusing a file the saver's torch also refused with its defaults is a figure, not a
    failure (this run's own read-back is the saver's)."""
    spec = params.get("spec", DEFAULT_SPEC)
    version = params.get("version", "fsdp2")
    family = values[0]["family"]
    j = _Judgement(values[0]["world_size"])
    for side, folder in _folders(values):
        manifest = folder[0]["manifest"]
        j.tree.append(
            f"{'loaded' if side == 'load' else 'saved, read back'}: {folder[0]['path']} "
            f"(torch {manifest['torch']}, {manifest['version']}, world size "
            f"{manifest['world_size']}, {len(folder[0]['files'])} files)"
        )
        for target, why in folder[0]["not_loaded"].items():
            j.not_resharded.append(_label(manifest, target, j.world_size))
            j.tree.append(f"  {_label(manifest, target, j.world_size)}: not loaded ({why})")
        for target, first in folder[0]["targets"].items():
            if first["refused"]:
                j.refused(side, manifest, target, first)
            else:
                j.loaded(manifest, target, folder)
    manifests = [f[0]["manifest"] for _, f in _folders(values)]
    # Figures: the same on both sides of an upgrade gate where nothing differs (compare shows
    # only what does); which loads ran, how each next step was judged and the worst relative
    # difference: the data (the save reads back one world size, a load every one).
    figures: dict[str, Any] = {
        "checkpoint_torch": sorted({m["torch"] for m in manifests})[0] if manifests else "",
        # the torch.save artifacts torch.load's defaults refuse on both sides
        "torch_load_refused": sorted({label.split()[1].split(":")[0] for label in j.both_refuse}),
        "failed": sorted(set(j.bad)),
    }
    data: dict[str, Any] = {
        "checkpoint_world_sizes": sorted({m["world_size"] for m in manifests}),
        "next_step_bitwise": j.bitwise,
        "next_step_within_tolerance": j.tolerance,
        "worst_next_step_rel": j.worst,
        "not_resharded": j.not_resharded,
        "torch_load_refused": sorted(j.both_refuse),
        "next_step_left_to_shared_step": sorted(j.left),
    }
    head = (
        f"{version} {spec.name} ({family}): AdamW, one step, model and optimizer state saved "
        f"({_how_saved(family)}) and loaded at world size {j.world_size} and in one process "
        f"on torch {torch.__version__}:\n" + "\n".join(j.tree)
    )
    if not j.unreadable:
        return Verdict(not j.bad, head, figures, data)
    saver, reason, call = next(iter(j.unreadable.values()))
    first_line = unreadable_line(saver, torch.__version__, reason)
    if call == TORCH_LOAD:
        first_line += f"\n{WEIGHTS_ONLY_FIX}"
    figures.update(load_torch=torch.__version__, unreadable=list(j.unreadable))
    data["tracebacks"] = j.tracebacks
    return Verdict(False, first_line + "\n" + head, figures, data)


def _how_saved(family: str) -> str:
    if family == "optimizer":
        return "get_state_dict, dcp.save"
    return "torch.save of FSDP1's full, sharded and local state dicts"


# ============================================================================================
# state.checkpoint.torch_save.shared_step: FSDP1's full optimizer dict in one process
# ============================================================================================


class SharedStepResult(TypedDict):
    """:func:`rank_checkpoint_torch_save_shared_step`'s result on one rank."""

    rank: int
    #: The parameters whose ``step`` the file read back holds as one tensor with another's.
    shared: list[str]
    #: AdamW's step count saved (every parameter's, distinct values).
    saved_steps: list[float]
    #: Per parameter: its step count after the next step in one process.
    steps_after: dict[str, float]
    #: The sharded (unbroken) run's step counts after its next step (distinct values).
    unbroken_steps: list[float]


def rank_checkpoint_torch_save_shared_step(
    ctx: RankContext,
    spec: ModelSpec = DEFAULT_SPEC,
    version: str = "fsdp1",
    seed: int = 0,
    save_to: str | None = None,
    load_from: str | None = None,
    fault: str | Sequence[str] | None = None,
) -> SharedStepResult:
    """FSDP1 trained one AdamW step; its full model and optimizer state dicts (``FSDP.state_dict``
    and ``FSDP.optim_state_dict`` under ``FULL_STATE_DICT``) written with ``torch.save`` (a file
    per rank, a folder of this run's: ``save_to`` and ``load_from`` only opt it in), read with
    ``torch.load``'s defaults and loaded into an unsharded model and AdamW in one process
    (``load_state_dict``, ``set_optimizer_state_dict``); each parameter's step count after the
    next step there, against the sharded run's after its own next step."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from fsdp_conformance.claims.state.state_dicts import shared_folder

    check_fsdp_version(version)
    with FAULTS.inject(fault, ctx), shared_folder(ctx, "fsdp-conformance-shared-step-") as path:
        model = build_sharded(ctx, spec, "fsdp1", seed)
        optim = torch.optim.AdamW(model.parameters(), lr=LR)
        batch = spec.batch(model, 2, ctx.device)
        resume.train_step(model, optim, batch, TRAIN_SEED)
        file = os.path.join(path, f"full-rank{ctx.rank}.pt")
        torch.save(
            {
                "model": get_state(model, "fsdp1", "full"),
                "optim": resume.get_optim_state(model, optim, "fsdp1", "full"),
            },
            file,
        )
        state = torch_load(file)
        plain, plain_optim = _fresh(ctx, spec, "unsharded", seed + 1)
        plain.load_state_dict(state["model"])
        saved_steps = sorted({float(s["step"]) for s in state["optim"]["state"].values()})
        shared = shared_steps(state["optim"])
        set_optimizer(plain, plain_optim, "unsharded", state["optim"])
        next_step(plain, plain_optim, batch)
        after: dict[str, Any] = dict(get_optimizer_state_dict(plain, plain_optim))
        after = after["state"]
        resume.train_step(model, optim, batch, resume.STEP_SEED)
        unbroken = _whole_state(model, optim, "fsdp1")[1]["state"]
    return {
        "rank": ctx.rank,
        "shared": shared,
        "saved_steps": saved_steps,
        "steps_after": {str(n): float(s["step"]) for n, s in after.items()},
        "unbroken_steps": sorted({float(s["step"]) for s in unbroken.values()}),
    }


def verdict_checkpoint_torch_save_shared_step(
    values: Sequence[SharedStepResult], params: Mapping[str, Any]
) -> Verdict:
    """Every parameter's step count after the next step in one process equals the unbroken
    run's (one step more than saved), on every rank; else one line naming torch's behaviour."""
    spec = params.get("spec", DEFAULT_SPEC)
    first = sorted(values, key=lambda v: v["rank"])[0]
    expected = first["unbroken_steps"]
    wrong = {
        v["rank"]: sorted({c for c in v["steps_after"].values() if [c] != expected})
        for v in values
        if sorted(set(v["steps_after"].values())) != expected
    }
    figures = {
        "shared_step_parameters": len(first["shared"]),
        "steps_after": sorted(set(first["steps_after"].values())),
        "unbroken_steps": expected,
    }
    if not wrong:
        return Verdict(
            True,
            f"fsdp1 {spec.name}: FSDP1's full optimizer state dict written with torch.save, "
            "loaded into one unsharded process (set_optimizer_state_dict): every parameter's "
            f"AdamW step count after the next step is the unbroken run's ({expected})",
            figures,
        )
    shared = first["shared"]
    return Verdict(
        False,
        "FSDP1's full optimizer state dict (FSDP.optim_state_dict) gives the parameters of each "
        f"flat parameter one shared AdamW step tensor ({len(shared)} parameters, e.g. "
        f"{', '.join(shared[:2])}) and torch.save keeps the sharing: loaded into one unsharded "
        "process with set_optimizer_state_dict, AdamW advances it once per parameter each "
        f"step: step counts {figures['steps_after']} after one step from "
        f"{first['saved_steps']}, the unbroken run's {expected} (ranks "
        f"{', '.join(map(str, sorted(wrong)))}): torch {torch.__version__}",
        figures,
    )
