"""What the state claim's families share: the model built and sharded under a seed, the state
dicts of each kind got and set as torch hands them to a user, what a getter returned and the
digests of every tensor, the checkpoint files every rank writes and reads, and the verdicts'
comparison of digests against the reference (docs/state.md).

The kinds and their getters (``KINDS``, ``get_state``, ``set_state``, the optimizer's
``get_optim_state`` and ``set_optim_state``, a model's and optimizer's ``whole_state``) live in
the block :mod:`fsdp_conformance.fsdp.state_dict_kinds`, which the loop claim reads too; they are
re-exported here for the state claim's modules.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from fsdp_conformance.claims.faults import Fault, patched, patched_attr
from fsdp_conformance.fsdp import capabilities
from fsdp_conformance.fsdp.reference_step import TensorComparison
from fsdp_conformance.fsdp.sharding import shard
from fsdp_conformance.fsdp.state_dict_kinds import (
    get_state,
    set_optim_state,
    set_state,
)
from fsdp_conformance.fsdp.tensors import local_tensor, sha256_of, total
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.reference_models import ModelConfig

#: Kinds whose dict holds full tensors: compared with the reference as got, before any load.
FULL = frozenset({"full", "full_rank0_only", "full_rank0"})
#: The model of the check: the memory checks' shape, small.
DEFAULT_SPEC = ModelSpec(reference="massive", config=ModelConfig(num_layers=2, dim=64))
#: Where a checkpoint saved by ``version`` is loaded: each FSDP version at the same world size,
#: and an unsharded model in one process (``no_dist``: resharded to world size 1).
DCP_TARGETS = ("fsdp1", "fsdp2", "unsharded")

#: One tensor's digest: dtype, shape, SHA-256 of its bytes, and its sum.
Digest = list[Any]
#: A state dict's digests, by key.
Digests = dict[str, Digest]


# ============================================================================================
# Building, getting and setting (rank side)
# ============================================================================================


def build(spec: ModelSpec, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """The model built under ``seed``: the reference (on the CPU) or a rank's, before sharding."""
    torch.manual_seed(seed)
    return spec.build(device)


def build_sharded(
    ctx: RankContext, spec: ModelSpec, version: str, seed: int, **options: Any
) -> nn.Module:
    """The model built under ``seed`` on the compute device and sharded as a user shards it
    (``options``: :func:`~fsdp_conformance.fsdp.sharding.shard`'s, a process group or mesh say)."""
    torch.manual_seed(seed)
    built = spec.instantiate(ctx.device)
    return shard(built.model, ctx, version, built.policy("recommended"), **options)


def digests(state: Mapping[str, Any]) -> Digests:
    """Per tensor of a full state dict: dtype, shape, SHA-256 of its bytes, and its sum."""
    out = {}
    for key, value in state.items():
        t = value.detach().to("cpu", copy=True).contiguous()  # the sum as the reference's
        out[key] = [
            str(t.dtype),
            list(t.shape),
            sha256_of(t),
            total(t),
        ]
    return out


@contextlib.contextmanager
def shared_folder(ctx: RankContext, prefix: str) -> Iterator[str]:
    """A temporary folder every rank writes to: rank 0 makes it, every rank gets its path, and
    rank 0 removes it once every rank is done (a barrier). A rank leaving with an exception
    does not wait: the other ranks may be inside a collective it never joins (torch's
    ``set_optimizer_state_dict`` raising on rank 0 while rank 1 waits in its broadcast), and a
    barrier would turn that rank's error, which the harness resolves in seconds, into a hang of
    every rank until the check's timeout."""
    import shutil
    import tempfile

    import torch.distributed as dist

    holder = [tempfile.mkdtemp(prefix=prefix) if ctx.rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    try:
        yield str(holder[0])
    except BaseException:
        if ctx.rank == 0:
            shutil.rmtree(str(holder[0]), ignore_errors=True)
        raise
    dist.barrier()
    if ctx.rank == 0:
        shutil.rmtree(str(holder[0]), ignore_errors=True)


# ============================================================================================
# Checkpoint files: torch.distributed.checkpoint, as a user saves and loads a sharded model
# ============================================================================================


def save_checkpoint(
    model: nn.Module, version: str, path: str, *, process_group: Any = None
) -> None:
    """The model's sharded state dict written with ``torch.distributed.checkpoint`` to ``path``
    (``FileSystemWriter``: real files), by ``process_group``'s ranks (default: every rank)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    save(
        get_state(model, version, "sharded"),
        storage_writer=FileSystemWriter(path),
        process_group=process_group,
    )


def load_checkpoint(
    ctx: RankContext, spec: ModelSpec, target: str, path: str, seed: int
) -> Digests:
    """A model built under another seed, loaded from the checkpoint at ``path``: sharded with
    ``target`` ("fsdp1", "fsdp2"), or unsharded in this process alone; its full state's
    digests."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load

    reader = FileSystemReader(path)
    if target == "unsharded":
        plain = build(spec, seed)
        state = plain.state_dict()
        load(state, storage_reader=reader, no_dist=True)
        plain.load_state_dict(state)
        return digests(plain.state_dict())
    model = build_sharded(ctx, spec, target, seed)
    state = get_state(model, target, "sharded")
    load(state, storage_reader=reader)
    set_state(model, target, "sharded", state)
    return digests(get_state(model, target, "full"))


def require_dcp_targets(ctx: RankContext) -> None:
    """Skip (every rank alike, before any collective) where this torch cannot load into every
    target of :data:`DCP_TARGETS`: the unsharded one needs ``dcp.load(no_dist=True)``, the
    FSDP2 one (and an FSDP2 source) FSDP2 on this device."""
    capabilities.require(capabilities.DCP_NO_DIST)
    capabilities.require(capabilities.FSDP2_ON_CPU, ctx.device_type)


def files_in(path: str) -> list[str]:
    """The files a checkpoint folder holds, sorted (observed, for the report)."""
    return sorted(os.listdir(path))


# ============================================================================================
# Judging digests (parent side)
# ============================================================================================


def reference_digests(spec: ModelSpec, seed: int) -> Digests:
    """The single-process reference: the same build under the same seed, ``state_dict()``."""
    return digests(build(spec, seed).state_dict())


def differences(expected: Mapping[str, Digest], actual: Mapping[str, Digest]) -> list[str]:
    """One line per tensor of ``actual`` that is not ``expected``'s, bitwise."""
    lines = []
    for key in sorted(set(expected) | set(actual)):
        if key not in actual:
            lines.append(f"{key}: missing (expected {expected[key][0]} {expected[key][1]})")
        elif key not in expected:
            lines.append(f"{key}: not in the reference's state dict")
        elif actual[key][:3] != expected[key][:3]:
            e, a = expected[key], actual[key]
            lines.append(
                f"{key}: expected {e[0]} {e[1]} sum {e[3]:.9g}, got {a[0]} {a[1]} sum {a[3]:.9g}"
            )
    return lines


def section(label: str, ok: str, wrong: Mapping[int, Sequence[str]], limit: int = 8) -> list[str]:
    """One line per kind (``ok`` or the ranks it is wrong on), then each wrong rank's lines."""
    ranks = ", ".join(map(str, sorted(wrong)))
    lines = [f"  {label}: " + (ok if not wrong else f"WRONG on rank(s) {ranks}")]
    for rank, problems in sorted(wrong.items()):
        lines += [f"      rank {rank}: {p}" for p in problems[:limit]]
        if len(problems) > limit:
            lines.append(f"      rank {rank}: ... {len(problems) - limit} more")
    return lines


def judge_targets(
    expected: Mapping[str, Digest],
    loaded: Sequence[tuple[int, Mapping[str, Digests]]],
    targets: Sequence[str],
    label: Callable[[str], str],
) -> tuple[list[str], list[str]]:
    """Per target, every rank's digests of the model loaded into it (``loaded``: (rank, digests
    by target)) against ``expected``: the tree's section per target and the targets wrong on
    any rank."""
    tree: list[str] = []
    bad: list[str] = []
    for target in targets:
        wrong = {
            rank: d for rank, by_target in loaded if (d := differences(expected, by_target[target]))
        }
        tree += section(label(target), "ok", wrong)
        bad += [target] if wrong else []
    return tree, bad


def where(target: str, world_size: int, one_process: str) -> str:
    """Where a checkpoint was loaded into ``target``, for a verdict's line."""
    return one_process if target == "unsharded" else f"{target} at world size {world_size}"


# ============================================================================================
# A load that torch refuses (a checkpoint of another torch): one line, not a traceback
# ============================================================================================


def refusal_reason(exc: BaseException) -> str:
    """Torch's reason for refusing a load, one line: the first failure a
    ``CheckpointException`` wraps (``dcp.load`` gathers every rank's), else ``exc`` itself, as
    ``Type: first line of its message``; for a metadata file ``dcp.load`` cannot read, its
    global read's clause (torch 2.13 on 2.15's files: "global metadata read failed: too many
    values to unpack (expected 5)"); for ``torch.load``'s weights-only refusal, the global it
    does not allow."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, Mapping) and failures:
        first = failures[sorted(failures)[0]]
        if isinstance(first, tuple) and first and isinstance(first[0], BaseException):
            exc = first[0]
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # torch.load's bold
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # torch.load's weights-only refusal opens with a paragraph of advice: its reason is the
    # unpickler's line (the global it does not allow).
    # dcp.load's metadata read: "metadata is None; global metadata read failed: <why>; rank
    # local metadata read failed: <why>": the global read is the checkpoint's (the local one
    # only says no per-rank metadata file exists).
    found = re.search(r"global metadata read failed: [^;\n]*", text)
    if found:
        return found[0].strip()
    unpickler = [ln for ln in lines if ln.startswith("WeightsUnpickler error:")]
    if unpickler:
        why = unpickler[0].removeprefix("WeightsUnpickler error:").strip().split(". Please")[0]
        return f"{type(exc).__name__}: weights-only load failed: {why}"
    return f"{type(exc).__name__}: {lines[0] if lines else '(no message)'}"


def unreadable_line(saver_torch: str, loader_torch: str, reason: str) -> str:
    """The one line a refused load is reported as (rollback: the newer torch's checkpoint on
    the older torch, or an upgrade's in the other direction)."""
    return f"checkpoints written by torch {saver_torch} cannot be read by torch {loader_torch}: {reason}"


# ============================================================================================
# Training state: the optimizer's state dicts, a step, checkpoint folders
# ============================================================================================


#: The RNG seed both runs draw from in the resumed step (dropout masks alike).
STEP_SEED = 1234
#: The step trained before the save (so the optimizer holds state) draws from this seed.
TRAIN_SEED = STEP_SEED + 1
#: AdamW's learning rate on both sides (the reference's too).
LR = 1e-2


def save_train_state(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    """Model and optimizer state saved with ``torch.distributed.checkpoint`` into ``path``, as
    torch's recipe does it for either FSDP version (``get_state_dict``, ``dcp.save``)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    model_state, optim_state = get_state_dict(model, optim)
    save({"model": model_state, "optim": optim_state}, storage_writer=FileSystemWriter(path))


def train_step(model: nn.Module, optim: torch.optim.Optimizer, batch: Any, seed: int) -> float:
    """One AdamW step drawing from ``seed`` (dropout masks alike on both runs: every generator
    a forward may draw from, NumPy's included); its loss."""
    from fsdp_conformance.fsdp.determinism import seed_everything
    from fsdp_conformance.models.model_spec import call_model, default_loss

    seed_everything(seed)
    loss = default_loss(call_model(model, batch))
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return float(loss.detach())


def checkpoint_folder(root: str, version: str, spec: ModelSpec) -> str:
    """The folder of one variant's checkpoint under ``root``."""
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in spec.name)
    return os.path.join(root, f"{version}-{name}")


def prepare_folder(path: str, manifest: str) -> str:
    """Rank 0 empties ``path`` for a new save: "" when ready, else why not (a folder of
    someone else's files, without ``manifest``, is never removed)."""
    import shutil

    if os.path.isdir(path) and os.listdir(path):
        if not os.path.exists(os.path.join(path, manifest)):
            return (
                f"{path} holds files that are not a checkpoint of this suite; give "
                "--save-checkpoint an empty folder or one an earlier save wrote"
            )
        shutil.rmtree(path)
    os.makedirs(path, exist_ok=True)
    return ""


# ============================================================================================
# A training-state checkpoint across runs: its manifest, and what the ranks load from it
# ============================================================================================


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
# The user's steps of a loaded run (each family's own name: its faults patch them there)
# ============================================================================================


def torch_load(path: str) -> Any:
    """A ``torch.save`` file read as a user reads it: ``torch.load(path)``, defaults unset."""
    return torch.load(path)


def next_step(model: nn.Module, optim: torch.optim.Optimizer, batch: Any) -> float:
    """The step a loaded run takes next (the fault ``next_step_perturbed`` changes it)."""
    return train_step(model, optim, batch, STEP_SEED)


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
        set_optim_state(model, optim, "fsdp1", kind, state)


def fresh_pair(
    ctx: RankContext, spec: ModelSpec, target: str, seed: int
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model (unsharded, or sharded as ``target``) and its AdamW, built from ``seed``."""
    model = build(spec, seed, ctx.device) if target == "unsharded" else None
    if model is None:
        model = build_sharded(ctx, spec, target, seed)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


# ============================================================================================
# Negative controls every family shares: a value perturbed, torch's DCP save and load patched
# ============================================================================================


#: Added to one value of a dict (the wrong shard or value a fault puts in).
PERTURBATION = 1e-3


def perturb_values(state: dict[str, Any], *, every: bool = False) -> list[str]:
    """Add :data:`PERTURBATION` to the first value of the first floating tensor this rank holds
    (by key order), or with ``every`` of each; returns their keys (none where it holds none).

    ``every`` is for a checkpoint: tied entries (GPT-2's head and embedding) are separate
    copies once written, and a loader takes either, so a wrong shard in one of them alone would
    go unnoticed by the loaders that read the other."""
    changed = []
    for key in sorted(state):
        t = local_tensor(state[key])
        if t is not None and t.is_floating_point() and t.numel():
            with torch.no_grad():
                t.view(-1)[0] += PERTURBATION
            changed.append(key)
            if not every:
                break
    return changed


def perturb_first(value: Any, every: bool = False) -> bool:
    """Add :data:`PERTURBATION` to the first element of the first floating tensor (this rank's
    own data) found depth-first in ``value`` (mappings by sorted key), or with ``every`` of
    each; whether one was found."""
    if isinstance(value, (dict, list, tuple)):
        parts = [value[k] for k in sorted(value, key=str)] if isinstance(value, dict) else value
        found = [perturb_first(v, every) for v in (parts if every else ())]
        return any(found) if every else any(perturb_first(v) for v in parts)
    t = local_tensor(value)
    if t is None or not t.is_floating_point() or not t.numel():
        return False
    with torch.no_grad():
        t.view(-1)[0] += PERTURBATION
    return True


def perturb_read(state: dict[str, Any], every: bool = False) -> None:
    """A read's wrong value: :func:`perturb_values` for a flat state dict; for one of parts
    (``{"model": ..., "optim": ...}``, as training state is saved) one value of each part.
    ``every``: of each tensor (a full dict read by every rank, where each loads its own part)."""
    if any(local_tensor(v) is not None for v in state.values()):
        perturb_values(state, every=every)
        return
    for key in sorted(state):
        perturb_first(state[key], every)


def load_nothing(*args: Any, **kwargs: Any) -> None:
    """An optimizer state dict's load that loads nothing (the fault ``optimizer_not_loaded``)."""


def load_model_only(
    model: nn.Module, optim: torch.optim.Optimizer, path: str, *, no_dist: bool = False
) -> None:
    """:func:`save_train_state`'s files loaded without the optimizer: the model's state alone read
    from the files and set (the optimizer's state dict is still got, as the user's code gets
    both; ``no_dist``: one process)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    model_state, _ = get_state_dict(model, optim)
    load({"model": model_state}, storage_reader=FileSystemReader(path), no_dist=no_dist)
    set_model_state_dict(model, model_state)


def _wrong_shards_written(ctx: RankContext) -> contextlib.AbstractContextManager[Any]:
    from torch.distributed.checkpoint import state_dict_saver

    def make(save: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(save)
        def written(state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            if ctx.rank == 0:
                # In place: the saved model is not used again. Not a snapshot: a ShardedTensor
                # read back belongs to the default group, no longer to a saving group of its
                # own (DCP then waits for ranks that do not save).
                perturb_values(state_dict, every=True)
            return save(state_dict, *args, **kwargs)

        return written

    return patched(state_dict_saver, "save", make)


#: rank 0's shards of a DCP save written wrong: torch's ``dcp.save``, looked up at call time,
#: patched (every family that writes DCP files puts it in its ``FAULTS``).
WRONG_SHARDS_WRITTEN = Fault(
    "rank 0 writes its shards of a torch.distributed.checkpoint with one value of each "
    "tensor changed (state.dcp, state.reshard, state.checkpoint's save)",
    _wrong_shards_written,
)


def wrong_value_read(module_name: str | None = None) -> Fault:
    """rank 0's ``dcp.load`` reads one wrong value; with ``module_name``, that family's
    ``torch_load`` too (:func:`~fsdp_conformance.claims.faults.patched_attr`)."""

    @contextlib.contextmanager
    def effect(ctx: RankContext) -> Iterator[None]:
        from torch.distributed.checkpoint import state_dict_loader

        def make(load: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(load)
            def read(state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
                out = load(state_dict, *args, **kwargs)
                if ctx.rank == 0:
                    perturb_read(state_dict)
                return out

            return read

        def make_torch_load(load: Callable[[str], Any]) -> Callable[[str], Any]:
            def read(path: str) -> Any:
                out = load(path)
                if ctx.rank == 0:
                    # Every tensor: FSDP1 loads each rank's part of a full dict from its own copy.
                    perturb_read(out, every=True)
                return out

            return read

        with contextlib.ExitStack() as stack:
            stack.enter_context(patched(state_dict_loader, "load", make))
            if module_name is not None:
                stack.enter_context(patched_attr(module_name, "torch_load", make_torch_load))
            yield

    return Fault(
        "rank 0's torch.distributed.checkpoint load, or torch.load, reads one wrong value (of "
        "the model and of the optimizer where both are read: state.checkpoint's load and "
        "state.checkpoint.optimizer and .torch_save's)",
        effect,
    )


def torch_load_refused(module_name: str) -> Fault:
    """``torch_load`` of the family ``module_name`` refuses every file."""

    def refuse(path: str) -> Any:
        raise pickle.UnpicklingError(
            "Weights only load failed. This file can still be loaded, to do so you have two "
            "options (simulated by the fault torch_load_refused)"
        )

    return Fault(
        "torch.load refuses every file, as weights_only=True refuses a file holding classes "
        "it does not allow (state.checkpoint.torch_save's load)",
        lambda ctx: patched_attr(module_name, "torch_load", lambda _: refuse),
    )


def next_step_perturbed(module_name: str) -> Fault:
    """rank 0's ``next_step`` of the family ``module_name`` changes one parameter after it."""

    def effect(ctx: RankContext) -> contextlib.AbstractContextManager[Any]:
        def make(step: Callable[..., float]) -> Callable[..., float]:
            def perturbed(model: nn.Module, optim: torch.optim.Optimizer, batch: Any) -> float:
                loss = step(model, optim, batch)
                if ctx.rank == 0:
                    perturb_first([p for _, p in sorted(model.named_parameters())])
                return loss

            return perturbed

        return patched_attr(module_name, "next_step", make)

    return Fault(
        "rank 0's next step after a load changes one value of its parameters "
        "(state.checkpoint.optimizer and .torch_save)",
        effect,
    )


#: The description of the fault ``optimizer_not_loaded`` (each family patches its own load).
OPTIMIZER_NOT_LOADED = (
    "the optimizer's state not loaded into the resumed run, from a state dict or from the "
    "checkpoint files (state.resume, state.checkpoint.optimizer and .torch_save's load)"
)


def optimizer_not_loaded(
    module_name: str, set_optimizer: str, load_files: str | None = None
) -> Fault:
    """The fault ``optimizer_not_loaded`` of the family ``module_name``: its ``set_optimizer``
    step loads nothing and, where it reads checkpoint files, its ``load_files`` step reads the
    model alone (:func:`load_model_only`)."""

    @contextlib.contextmanager
    def effect(ctx: RankContext) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(patched_attr(module_name, set_optimizer, lambda _: load_nothing))
            if load_files is not None:
                stack.enter_context(
                    patched_attr(module_name, load_files, lambda _: load_model_only)
                )
            yield

    return Fault(OPTIMIZER_NOT_LOADED, effect)
