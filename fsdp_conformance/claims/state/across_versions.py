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
(:func:`~fsdp_conformance.claims.state.common.unreadable_line`), never an error.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import FaultTable
from fsdp_conformance.claims.state.common import (
    DEFAULT_SPEC,
    LR,
    STEP_SEED,
    TRAIN_SEED,
    WRONG_SHARDS_WRITTEN,
    AcrossResult,
    Digests,
    FolderResult,
    Manifest,
    TargetResult,
    build,
    build_sharded,
    checkpoint_folder,
    differences,
    digests,
    files_in,
    fresh_pair,
    next_step,
    next_step_perturbed,
    optimizer_not_loaded,
    prepare_folder,
    refusal_reason,
    require_dcp_targets,
    save_train_state,
    section,
    set_optimizer,
    torch_load,
    torch_load_refused,
    train_step,
    unreadable_line,
    wrong_value_read,
)
from fsdp_conformance.fsdp.reference_step import (
    LOSS_RTOL,
    UPDATE_RTOL,
    compare_tensors,
    comparison_problems,
    full_params,
    loss_problems,
    reference_params,
    update_resolution,
    updates,
)
from fsdp_conformance.fsdp.sharding import check_fsdp_version
from fsdp_conformance.fsdp.state_dict_kinds import (
    get_optim_state,
    get_state,
    set_state,
    shared_steps,
    whole_state,
)
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


# ============================================================================================
# The user's steps (module level: a fault replaces them)
# ============================================================================================


def save_dcp(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    """Model and optimizer state saved as torch's recipe does: ``get_state_dict``, ``dcp.save``."""
    save_train_state(model, optim, path)


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


#: The negative controls of both families: the user's steps above done wrong, or torch's DCP
#: save and load (a save's read-back) patched.
FAULTS = FaultTable(
    optimizer_not_loaded=optimizer_not_loaded(__name__, "set_optimizer", "load_dcp"),
    wrong_shards_written=WRONG_SHARDS_WRITTEN,
    wrong_value_read=wrong_value_read(__name__),
    torch_load_refused=torch_load_refused(__name__),
    next_step_perturbed=next_step_perturbed(__name__),
)


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
    of :data:`FAULTS` (``optimizer_not_loaded``,
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


def train_digests(model_state: Mapping[str, Any], optim_state: Mapping[str, Any]) -> Digests:
    """The digests of a whole model and optimizer state: the model's by key, the optimizer's
    as ``optim/<parameter>/<state>`` (AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``)."""
    flat = dict(model_state)
    for name, entries in optim_state.get("state", {}).items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                flat[f"optim/{name}/{key}"] = value
    return digests(flat)


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
    train_step(model, optim, batch, TRAIN_SEED)
    saved = train_digests(*whole_state(model, optim, version))
    if family == "optimizer":
        save_dcp(model, optim, path)
    else:
        for kind in ARTIFACTS:
            model_state = get_state(model, "fsdp1", kind)
            optim_state = (
                optim.state_dict()
                if kind == "local"
                else get_optim_state(model, optim, "fsdp1", kind)
            )
            if kind in RESHARDABLE and ctx.rank != 0:
                continue  # one file of the whole state, rank 0's
            torch.save(
                {"model": model_state, "optim": optim_state},
                os.path.join(path, _artifact_file(kind, ctx.rank)),
            )
    loss = train_step(model, optim, batch, STEP_SEED)
    after = train_digests(*whole_state(model, optim, version))
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
        model, optim = fresh_pair(ctx, spec, into, seed + 1)
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

    model_state, optim_state = whole_state(model, optim, into)
    loaded = train_digests(model_state, optim_state)
    reference = build(spec, seed + 2, ctx.device)
    reference.load_state_dict(model_state)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=LR)
    set_optimizer_state_dict(reference, ref_optim, optim_state)
    reference_loss = train_step(reference, ref_optim, batch, STEP_SEED)
    ref_state = whole_state(reference, ref_optim, "unsharded")[1]["state"]
    before = reference_params(model) if into == "unsharded" else full_params(model, into)
    loss = next_step(model, optim, batch)
    after = reference_params(model) if into == "unsharded" else full_params(model, into)
    after_model, after_optim = whole_state(model, optim, into)
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
    (:func:`~fsdp_conformance.claims.state.common.unreadable_line`); ``torch.load``
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
