"""``state.resume``: model and optimizer state saved mid-training, loaded into a fresh model
and optimizer, and one more step against the unbroken run, bitwise (docs/state.md).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import FaultTable
from fsdp_conformance.claims.state.common import (
    DEFAULT_SPEC,
    STEP_SEED,
    Digests,
    build_sharded,
    differences,
    digests,
    optimizer_not_loaded,
    save_train_state,
    section,
    shared_folder,
    train_step,
)
from fsdp_conformance.fsdp.sharding import check_fsdp_version
from fsdp_conformance.fsdp.state_dict_kinds import (
    RANK0_ONLY,
    get_optim_state,
    get_state,
    set_optim_state,
    set_state,
)
from fsdp_conformance.harness import CheckSkipped, RankContext
from fsdp_conformance.models.model_spec import ModelSpec

#: The kinds of model and optimizer state dict a resumed run is loaded from, per version.
RESUME_KINDS: dict[str, tuple[str, ...]] = {
    "fsdp1": ("full", "full_rank0_only", "sharded", "dcp"),
    "fsdp2": ("full_rank0", "full", "sharded", "dcp"),
}
#: The model state dict a resume kind pairs with its optimizer state dict, where they differ:
#: FSDP1 loads a full model dict on every rank only, so its rank-0-only optimizer dict (which
#: ``optim_state_dict_to_load`` broadcasts from rank 0) goes with the every-rank model dict.
RESUME_MODEL_KIND = {"full_rank0_only": "full"}
#: Steps trained before the state is taken; the resumed step is one more.
STEPS_BEFORE = 2


class _Step(TypedDict):
    loss: float
    #: The loss's exact bits (``float.hex``).
    loss_hex: str
    #: The model's full state after the step.
    digests: Digests


class StepResult(_Step, total=False):
    """The step after the save (:func:`_resumed_step`) on one rank: ``loss``, ``loss_hex``,
    ``digests``."""

    #: How much optimizer state the getter handed this rank (a kind loaded from a state dict).
    optim_entries: int


class _Resume(TypedDict):
    rank: int
    version: str
    unbroken: StepResult
    kinds: dict[str, StepResult]


class ResumeResult(_Resume, total=False):
    """:func:`rank_resume`'s result on one rank: ``rank``, ``version``, ``unbroken``, ``kinds``."""

    #: FSDP1: the parameters some rank holds no shard of (:func:`shardless_parameters`).
    shardless: list[str]
    #: ``state.resume.dcp_shardless``: the error ``dcp.load`` raised on this rank, one line.
    dcp_failure: str


#: The check that resumes from ``torch.distributed.checkpoint`` files a model where some rank
#: holds no shard of a parameter (FSDP1): ``state.resume`` leaves its dcp kind to it there.
DCP_SHARDLESS_CHECK = "state.resume.dcp_shardless"


def load_train_state(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    """The state :func:`save_train_state` wrote, loaded into ``model`` and ``optim`` with
    ``dcp.load`` and ``set_state_dict``."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    model_state, optim_state = get_state_dict(model, optim)
    # dcp.load fills the dicts in place: the same objects go back to set_state_dict.
    load({"model": model_state, "optim": optim_state}, storage_reader=FileSystemReader(path))
    set_state_dict(model, optim, model_state_dict=model_state, optim_state_dict=optim_state)


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` written to bytes and read back, as a checkpoint on disk would be.

    torch's state dicts share storage with the live model and optimizer (a sharded dict holds
    the parameters themselves; AdamW's ``step`` is handed over as the same tensor even in a full
    dict): a later step would change a dict that was only referenced, not saved.
    """
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=False)
    return loaded


#: The negative controls of this family: the user's resume (``set_optim_state`` and
#: :func:`load_train_state`, this module's names) done wrong.
FAULTS = FaultTable(
    optimizer_not_loaded=optimizer_not_loaded(__name__, "set_optim_state", "load_train_state")
)


def shardless_parameters(model: nn.Module, version: str) -> list[str]:
    """FSDP1: the parameters that some rank holds no shard of in the sharded state dict that
    ``get_state_dict`` hands DCP (FSDP1 chunks each tensor's first dimension across the ranks:
    one with fewer rows than ranks, a ``Linear(d, 1)`` gate or a ``(1, n, d)`` position
    embedding, leaves a rank a ShardedTensor without local shards), every rank's, sorted. FSDP2
    (DTensors, every rank a shard, maybe empty): none."""
    if version != "fsdp1":
        return []
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    mine = []
    for name, value in get_model_state_dict(model).items():
        local_shards = getattr(value, "local_shards", None)  # a ShardedTensor's
        if callable(local_shards) and not local_shards():
            mine.append(name)
    every: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return sorted({name for names in every for name in names or ()})


def _dcp_failure(exc: BaseException) -> str:
    """The error ``dcp.load`` raised, one line: the planner's missing key where it says one."""
    import re

    missing = re.search(r"Missing key in checkpoint state_dict: ([\w.]*\w)", str(exc))
    if missing:
        return f"RuntimeError: Missing key in checkpoint state_dict: {missing[1]}"
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def _resumed_step(
    model: nn.Module, optim: torch.optim.Optimizer, batch: Any, version: str
) -> StepResult:
    """The step after the save, under :data:`STEP_SEED`: its loss (and its exact bits) and the
    digests of the model's full state after it."""
    loss = train_step(model, optim, batch, STEP_SEED)
    return {
        "loss": loss,
        "loss_hex": loss.hex(),
        "digests": digests(get_state(model, version, "full")),
    }


def rank_resume(
    ctx: RankContext,
    spec: ModelSpec = DEFAULT_SPEC,
    version: str = "fsdp2",
    seed: int = 0,
    fault: str | Sequence[str] | None = None,
    dcp_shardless: bool = False,
) -> ResumeResult:
    """Train :data:`STEPS_BEFORE` AdamW steps, take the model's and the optimizer's state dicts
    of each kind, load them into a model and optimizer built under another seed, and take one
    more step on both: the resumed run must equal the unbroken one (loss and every tensor,
    bitwise). ``fault``: the negative controls of
    :data:`FAULTS` (``optimizer_not_loaded``).

    FSDP1, a model where some rank holds no shard of a parameter (:func:`shardless_parameters`):
    the dcp kind is left to :data:`DCP_SHARDLESS_CHECK` (``dcp_shardless``), which resumes from
    the files alone and records the error ``dcp.load`` raises (torch 2.13: its planner, missing
    those parameters' keys on that rank, reads the files as a pre-2.4 checkpoint and asks for
    ``optim.param_groups`` whole); it skips a model without such a parameter.
    """
    check_fsdp_version(version)
    with FAULTS.inject(fault, ctx):
        return _resume(ctx, spec, version, seed, dcp_shardless)


def _resume(
    ctx: RankContext, spec: ModelSpec, version: str, seed: int, dcp_shardless: bool
) -> ResumeResult:
    source = build_sharded(ctx, spec, version, seed)
    shardless = shardless_parameters(source, version)
    if dcp_shardless and not shardless:
        raise CheckSkipped(
            f"every rank holds a shard of every parameter of {spec.name} under {version}, so "
            "this check does not apply (it needs a parameter with fewer rows than ranks); "
            "state.resume's dcp kind resumed this model"
        )
    run = (
        ["dcp"]
        if dcp_shardless
        else [k for k in RESUME_KINDS[version] if k != "dcp" or not shardless]
    )
    optim = torch.optim.AdamW(source.parameters(), lr=1e-2)
    batch = spec.batch(source, 2, ctx.device)
    for step in range(STEPS_BEFORE):
        train_step(source, optim, batch, STEP_SEED + 1 + step)
    saved = {
        kind: (
            snapshot(get_state(source, version, RESUME_MODEL_KIND.get(kind, kind))),
            snapshot(get_optim_state(source, optim, version, kind)),
        )
        for kind in run
        if kind != "dcp"
    }
    kinds: dict[str, StepResult] = {}
    failure: dict[str, str] = {}
    with shared_folder(ctx, "fsdp-conformance-resume-") as path:
        if "dcp" in run:
            save_train_state(source, optim, path)  # files: the dcp kind's snapshot
        unbroken = _resumed_step(source, optim, batch, version)
        for kind in run:
            target = build_sharded(ctx, spec, version, seed + 1)
            target_optim = torch.optim.AdamW(target.parameters(), lr=1e-2)
            # The user's resume: load_train_state and set_optim_state are a fault's steps.
            if kind == "dcp" and dcp_shardless:
                from torch.distributed.checkpoint.api import CheckpointException

                try:
                    load_train_state(target, target_optim, path)
                # The finding: what dcp.load raised (a CheckpointException is a BaseException).
                except (Exception, CheckpointException) as exc:  # noqa: BLE001
                    failure["dcp_failure"] = _dcp_failure(exc)
                    continue
            elif kind == "dcp":
                load_train_state(target, target_optim, path)
            else:
                model_state, optim_state = saved[kind]
                set_state(target, version, RESUME_MODEL_KIND.get(kind, kind), model_state)
                set_optim_state(target, target_optim, version, kind, optim_state)
            kinds[kind] = _resumed_step(target, target_optim, batch, version)
            if kind in saved:  # observed: how much optimizer state the getter handed this rank
                kinds[kind]["optim_entries"] = len(saved[kind][1].get("state", {}))
    result: ResumeResult = {
        "rank": ctx.rank,
        "version": version,
        "unbroken": unbroken,
        "kinds": kinds,
        "shardless": shardless,
    }
    if failure:
        result["dcp_failure"] = failure["dcp_failure"]
    return result


def verdict_resume(values: Sequence[ResumeResult], params: Mapping[str, Any]) -> Verdict:
    """Per kind, on every rank: the resumed step's loss and the model after it equal the
    unbroken run's, bitwise; a rank-0-only optimizer getter handed rank 0 alone its state."""
    spec = params.get("spec", DEFAULT_SPEC)
    version = params.get("version", "fsdp2")
    kinds = list(values[0]["kinds"])
    tree: list[str] = []
    bad: list[str] = []
    for kind in kinds:
        wrong: dict[int, list[str]] = {}
        for value in values:
            unbroken, resumed = value["unbroken"], value["kinds"][kind]
            lines = []
            if resumed["loss_hex"] != unbroken["loss_hex"]:
                lines.append(
                    f"loss of the resumed step: expected {unbroken['loss']:.9g} "
                    f"(unbroken run), got {resumed['loss']:.9g}"
                )
            lines += [
                f"after the resumed step: {d}"
                for d in differences(unbroken["digests"], resumed["digests"])
            ]
            entries = resumed.get("optim_entries")
            if (
                kind in RANK0_ONLY
                and entries is not None
                and ((entries > 0) != (value["rank"] == 0))
            ):
                lines.append(
                    f"the rank-0-only optimizer getter handed this rank state for "
                    f"{entries} parameter(s)"
                    + (" (expected some)" if value["rank"] == 0 else " (expected none)")
                )
            if lines:
                wrong[value["rank"]] = lines
        tree += section(kind, "resumed run equals the unbroken one", wrong)
        bad += [kind] if wrong else []
    losses = {str(v["rank"]): v["unbroken"]["loss"] for v in values}
    figures: dict[str, Any] = {
        "kinds": kinds,
        "steps_before": STEPS_BEFORE,
        "failed_kinds": sorted(set(bad)),
    }
    head = (
        f"{version} {spec.name}: AdamW, {STEPS_BEFORE} steps, model and optimizer state "
        f"saved ({', '.join(kinds)}), loaded into a fresh model, one more step against the "
        f"unbroken run, bitwise, on all {len(values)} ranks"
    )
    shardless = values[0].get("shardless", [])
    if shardless and "dcp" in RESUME_KINDS[version] and "dcp" not in kinds:
        figures["dcp_left_to"] = DCP_SHARDLESS_CHECK
        head += (
            f" (dcp left to {DCP_SHARDLESS_CHECK}: some rank holds no shard of "
            f"{_names(shardless)}, fewer rows than ranks)"
        )
    return Verdict(not bad, head + ":\n" + "\n".join(tree), figures, {"unbroken_loss": losses})


def _names(names: Sequence[str], most: int = 3) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def verdict_resume_dcp_shardless(
    values: Sequence[ResumeResult], params: Mapping[str, Any]
) -> Verdict:
    """:data:`DCP_SHARDLESS_CHECK`: the resume from the checkpoint files loaded on every rank
    and the resumed step equals the unbroken run's (:func:`verdict_resume`); a load that raised
    fails in one line naming torch's behaviour, the condition and this torch."""
    failed = {v["rank"]: v["dcp_failure"] for v in values if "dcp_failure" in v}
    if not failed:
        return verdict_resume(values, params)
    shardless = values[0].get("shardless", [])
    error = sorted(set(failed.values()))[0]
    planner = "optim.param_groups" in error
    line = (
        "FSDP1 + DCP optimizer resume fails when a rank holds no shard of a parameter "
        f"({_names(shardless)}: fewer rows than ranks): "
        + (
            "dcp.load's planner, missing those keys on that rank, reads the files as a "
            "pre-2.4 checkpoint and asks for 'optim.param_groups' whole"
            if planner
            else "dcp.load raised"
        )
        + f" ({error}, ranks {', '.join(map(str, sorted(failed)))}): torch {torch.__version__}"
    )
    figures = {"shardless": list(shardless), "failed_ranks": sorted(failed), "error": error}
    return Verdict(False, line, figures, {})
