"""The state claim: what a sharded model's state dicts hold, and that loading one gives the
model back, bitwise equal to the single-process reference (docs/state.md).

Four checks: ``state.round_trip``, ``state.resume`` (model and optimizer state, a resumed step
against the unbroken run), ``state.dcp`` (``torch.distributed.checkpoint`` files loaded into
both FSDP versions and one process) and, FSDP1 only, ``state.summon``
(``summon_full_params``).

``state.round_trip``'s rank function builds the model twice under different seeds and shards
both the way a user does (``sharding.shard`` with the recommended policy). For each state-dict
kind torch offers it takes the first model's state dict, loads it into the second, and reports a
digest of every tensor of the second model's full state dict afterwards; for the full kinds,
also of the dict it got. The parent builds the reference (the same seed, one process,
``state_dict()``) and compares every tensor bitwise: a kind whose load leaves any value other
than the reference's fails, naming the tensor. Observed, not configured: what each getter
returned (how many entries, which tensor types, on which device) is recorded per rank, and a
rank-0-only getter that hands a non-zero rank a state dict fails.

Kinds (``KINDS``): FSDP1 ``FULL_STATE_DICT`` (``offload_to_cpu`` on GPU, ``rank0_only`` off),
``FULL_STATE_DICT`` with ``rank0_only`` (getter only: FSDP1 loads a full state dict on every
rank), ``SHARDED_STATE_DICT``, ``LOCAL_STATE_DICT``; FSDP2 ``get_model_state_dict`` /
``set_model_state_dict`` with ``StateDictOptions`` full (``cpu_offload`` on, so rank 0 alone
holds it, loaded with ``broadcast_from_rank0``), full on every rank, and sharded (DTensors).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fsdp_conformance import capabilities
from fsdp_conformance.claims.check import Check, Verdict, variants
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models import BuiltModel, ModelSpec
from fsdp_conformance.reference_models import ModelConfig
from fsdp_conformance.sharding import check_fsdp_version, shard
from fsdp_conformance.units import clean_fqn

#: The state-dict kinds of each FSDP version, in the order they run.
KINDS: dict[str, tuple[str, ...]] = {
    "fsdp1": ("full", "full_rank0_only", "sharded", "local"),
    "fsdp2": ("full_rank0", "full", "sharded"),
}
#: Kinds whose getter hands rank 0 alone a state dict (the others get an empty one).
RANK0_ONLY = frozenset({"full_rank0_only", "full_rank0"})
#: Kinds only read, not loaded (FSDP1 loads a full state dict on every rank, not rank 0's).
GET_ONLY = frozenset({"full_rank0_only"})
#: Kinds whose dict holds full tensors: compared with the reference as got, before any load.
FULL = frozenset({"full", "full_rank0_only", "full_rank0"})
#: The model of the check: the memory checks' shape, small.
DEFAULT_SPEC = ModelSpec(reference="massive", config=ModelConfig(num_layers=2, dim=64))
#: Added to one value of the dict before it is loaded (the negative control's wrong shard).
PERTURBATION = 1e-3


# ============================================================================================
# Rank side
# ============================================================================================


def build(spec: ModelSpec, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """The model built under ``seed``: the reference (on the CPU) or a rank's, before sharding."""
    torch.manual_seed(seed)
    return spec.build(device)


def build_sharded(ctx: RankContext, spec: ModelSpec, version: str, seed: int) -> nn.Module:
    """The model built under ``seed`` on the compute device and sharded as a user shards it."""
    model = build(spec, seed, ctx.device)
    return shard(model, ctx, version, BuiltModel(spec, model).policy("recommended"))


def _offload_to_cpu(model: nn.Module) -> bool:
    """FSDP1's ``offload_to_cpu``: on where the parameters are on a GPU, as users save. On the
    CPU they are there already, and torch 2.13's FSDP1 cannot unshard CPU parameters with it
    ("setStorage: ... out of bounds for storage of size 0")."""
    return next(model.parameters()).device.type != "cpu"


@contextlib.contextmanager
def _fsdp1_type(model: nn.Module, kind: str) -> Iterator[None]:
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if kind in ("full", "full_rank0_only"):
        config = FullStateDictConfig(offload_to_cpu=_offload_to_cpu(model),
                                     rank0_only=kind == "full_rank0_only")
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            yield
    else:
        which = {"sharded": StateDictType.SHARDED_STATE_DICT,
                 "local": StateDictType.LOCAL_STATE_DICT}[kind]
        with FSDP.state_dict_type(model, which):
            yield


def _fsdp2_options(kind: str, *, loading: bool = False) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if kind == "full_rank0":
        return StateDictOptions(full_state_dict=True, cpu_offload=True,
                                broadcast_from_rank0=loading)
    if kind == "full":
        return StateDictOptions(full_state_dict=True)
    return StateDictOptions()


def get_state(model: nn.Module, version: str, kind: str) -> dict[str, Any]:
    """The model's state dict of ``kind``, as torch hands it to a user."""
    if version == "fsdp1":
        with _fsdp1_type(model, kind):
            return dict(model.state_dict())
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return dict(get_model_state_dict(model, options=_fsdp2_options(kind)))


def set_state(model: nn.Module, version: str, kind: str, state: dict[str, Any]) -> None:
    """Load ``state`` (of ``kind``) into ``model``, strictly (every key must match)."""
    if version == "fsdp1":
        with _fsdp1_type(model, kind):
            model.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_fsdp2_options(kind, loading=True))


def _local(value: Any) -> torch.Tensor | None:
    """The tensor of this rank's own data: a DTensor's or ShardedTensor's local shard."""
    found: Any = value
    if hasattr(value, "to_local"):  # DTensor
        found = value.to_local()
    elif hasattr(value, "local_shards"):  # FSDP1's ShardedTensor
        shards = value.local_shards()
        found = shards[0].tensor if shards else None
    return found if isinstance(found, torch.Tensor) else None


def perturb_values(state: dict[str, Any], *, every: bool = False) -> list[str]:
    """Add :data:`PERTURBATION` to the first value of the first floating tensor this rank holds
    (by key order), or with ``every`` of each; returns their keys (none where it holds none).

    ``every`` is for a checkpoint: tied entries (GPT-2's head and embedding) are separate
    copies once written, and a loader takes either, so a wrong shard in one of them alone would
    go unnoticed by the loaders that read the other."""
    changed = []
    for key in sorted(state):
        t = _local(state[key])
        if t is not None and t.is_floating_point() and t.numel():
            with torch.no_grad():
                t.view(-1)[0] += PERTURBATION
            changed.append(key)
            if not every:
                break
    return changed


def describe(state: Mapping[str, Any]) -> dict[str, Any]:
    """What a getter returned: entries, tensor types and devices (observed, for the report)."""
    types = sorted({type(v).__name__ for v in state.values()})
    devices = sorted({str(t.device) for v in state.values() if (t := _local(v)) is not None})
    return {"entries": len(state), "types": types, "devices": devices}


def digests(state: Mapping[str, Any]) -> dict[str, list[Any]]:
    """Per tensor of a full state dict: dtype, shape, SHA-256 of its bytes, and its sum."""
    out = {}
    for key, value in state.items():
        # A copy: a numpy view of the model's own storage would pin it (FSDP1 then cannot free
        # its unsharded parameters when summon_full_params ends: "Trying to resize storage
        # that is not resizable").
        t = value.detach().to("cpu", copy=True).contiguous()
        raw = t.reshape(-1).view(torch.uint8)
        out[key] = [str(t.dtype), list(t.shape),
                    hashlib.sha256(raw.numpy().tobytes()).hexdigest(),
                    float(t.double().sum()) if t.is_floating_point() else int(t.sum())]
    return out


def rank_state_round_trip(ctx: RankContext, spec: ModelSpec = DEFAULT_SPEC,
                          version: str = "fsdp2", seed: int = 0,
                          perturb: bool = False) -> dict[str, Any]:
    """Every state-dict kind of ``version``: got from one sharded model, loaded into another.

    ``perturb``: one value of each dict is changed before it is loaded (the negative control):
    in a full dict on every rank that holds one, in a sharded or local dict in rank 0's shard.
    """
    check_fsdp_version(version)
    source = build_sharded(ctx, spec, version, seed)
    kinds: dict[str, Any] = {}
    for kind in KINDS[version]:
        state = get_state(source, version, kind)
        entry: dict[str, Any] = {"got": describe(state)}
        if kind in FULL and state:
            entry["got_digests"] = digests(state)
        if kind not in GET_ONLY:
            # A full dict is the checkpoint itself: wrong on every rank that holds one. A sharded
            # or local dict: rank 0's shard alone is wrong.
            if perturb and (kind in FULL or ctx.rank == 0):
                entry["perturbed"] = perturb_values(state)
            target = build_sharded(ctx, spec, version, seed + 1)
            set_state(target, version, kind, state)
            entry["loaded_digests"] = digests(get_state(target, version, "full"))
        kinds[kind] = entry
    return {"rank": ctx.rank, "version": version, "kinds": kinds}


# ============================================================================================
# Verdict (parent side)
# ============================================================================================


def reference_digests(spec: ModelSpec, seed: int) -> dict[str, list[Any]]:
    """The single-process reference: the same build under the same seed, ``state_dict()``."""
    return digests(build(spec, seed).state_dict())


def _differences(expected: Mapping[str, list[Any]], actual: Mapping[str, list[Any]]) -> list[str]:
    lines = []
    for key in sorted(set(expected) | set(actual)):
        if key not in actual:
            lines.append(f"{key}: missing (expected {expected[key][0]} {expected[key][1]})")
        elif key not in expected:
            lines.append(f"{key}: not in the reference's state dict")
        elif actual[key][:3] != expected[key][:3]:
            e, a = expected[key], actual[key]
            lines.append(f"{key}: expected {e[0]} {e[1]} sum {e[3]:.9g}, "
                         f"got {a[0]} {a[1]} sum {a[3]:.9g}")
    return lines


def _section(label: str, ok: str, wrong: Mapping[int, Sequence[str]],
             limit: int = 8) -> list[str]:
    """One line per kind (``ok`` or the ranks it is wrong on), then each wrong rank's lines."""
    ranks = ", ".join(map(str, sorted(wrong)))
    lines = [f"  {label}: " + (ok if not wrong else f"WRONG on rank(s) {ranks}")]
    for rank, problems in sorted(wrong.items()):
        lines += [f"      rank {rank}: {p}" for p in problems[:limit]]
        if len(problems) > limit:
            lines.append(f"      rank {rank}: ... {len(problems) - limit} more")
    return lines


def _judge_targets(expected: Mapping[str, list[Any]],
                   loaded: Sequence[tuple[int, Mapping[str, Any]]], targets: Sequence[str],
                   label: Callable[[str], str]) -> tuple[list[str], list[str]]:
    """Per target, every rank's digests of the model loaded into it (``loaded``: (rank, digests
    by target)) against ``expected``: the tree's section per target and the targets wrong on
    any rank."""
    tree: list[str] = []
    bad: list[str] = []
    for target in targets:
        wrong = {rank: d for rank, by_target in loaded
                 if (d := _differences(expected, by_target[target]))}
        tree += _section(label(target), "ok", wrong)
        bad += [target] if wrong else []
    return tree, bad


def _judge_rank(value: Mapping[str, Any],
                expected: Mapping[str, list[Any]]) -> dict[str, list[str]]:
    """Per kind, what differs from the reference on this rank (empty: the kind is right)."""
    rank = value["rank"]
    problems: dict[str, list[str]] = {}
    for kind, entry in value["kinds"].items():
        lines = []
        if kind in RANK0_ONLY and rank != 0 and entry["got"]["entries"]:
            lines.append(f"rank {rank} got {entry['got']['entries']} entries from a rank-0-only "
                         "getter (expected none)")
        if "got_digests" in entry:
            lines += [f"as got: {d}" for d in _differences(expected, entry["got_digests"])]
        elif kind in FULL and (kind not in RANK0_ONLY or rank == 0):
            lines.append(f"rank {rank} got an empty full state dict")
        if "loaded_digests" in entry:
            lines += [f"after loading: {d}"
                      for d in _differences(expected, entry["loaded_digests"])]
        problems[kind] = lines
    return problems


def verdict_state_round_trip(values: Sequence[Mapping[str, Any]],
                             params: Mapping[str, Any]) -> Verdict:
    """Every kind, on every rank: the dict got and the model loaded from it equal the reference,
    tensor by tensor, bitwise."""
    spec = params.get("spec", DEFAULT_SPEC)
    version = params.get("version", "fsdp2")
    expected = reference_digests(spec, params.get("seed", 0))
    per_rank = {v["rank"]: _judge_rank(v, expected) for v in values}
    kinds = list(values[0]["kinds"])
    tree, bad = [], []
    for kind in kinds:
        wrong = {r: p[kind] for r, p in per_rank.items() if p.get(kind)}
        loaded = "loaded" if kind not in GET_ONLY else "got only"
        tree += _section(f"{kind} ({loaded})", "ok", wrong)
        bad += [kind] if wrong else []
    got = {kind: values[0]["kinds"][kind]["got"] for kind in kinds}
    figures = {"kinds": kinds, "tensors": len(expected), "failed_kinds": sorted(set(bad))}
    head = (f"{version} {spec.name}: {len(kinds)} state-dict kind(s), {len(expected)} tensors, "
            f"against the single-process reference, bitwise, on all {len(values)} ranks")
    return Verdict(not bad, head + ":\n" + "\n".join(tree), figures, {"got_rank0": got})


# ============================================================================================
# Resuming: model and optimizer state saved mid-training, loaded into a fresh model
# ============================================================================================

#: The kinds of model and optimizer state dict a resumed run is loaded from, per version.
RESUME_KINDS: dict[str, tuple[str, ...]] = {"fsdp1": ("full", "full_rank0_only", "sharded", "dcp"),
                                            "fsdp2": ("full_rank0", "full", "sharded", "dcp")}
#: The model state dict a resume kind pairs with its optimizer state dict, where they differ:
#: FSDP1 loads a full model dict on every rank only, so its rank-0-only optimizer dict (which
#: ``optim_state_dict_to_load`` broadcasts from rank 0) goes with the every-rank model dict.
RESUME_MODEL_KIND = {"full_rank0_only": "full"}
#: Steps trained before the state is taken; the resumed step is one more.
STEPS_BEFORE = 2
#: The RNG seed both runs draw from in the resumed step (dropout masks alike).
STEP_SEED = 1234


@contextlib.contextmanager
def _fsdp1_optim_type(model: nn.Module, kind: str) -> Iterator[None]:
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if kind in ("full", "full_rank0_only"):
        offload = _offload_to_cpu(model)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=offload),
                                  FullOptimStateDictConfig(
                                      offload_to_cpu=offload,
                                      rank0_only=kind == "full_rank0_only")):
            yield
    else:
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            yield


def get_optim_state(model: nn.Module, optim: torch.optim.Optimizer, version: str,
                    kind: str) -> dict[str, Any]:
    """The optimizer's state dict of ``kind``, as torch hands it to a user."""
    if version == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with _fsdp1_optim_type(model, kind):
            return dict(FSDP.optim_state_dict(model, optim))
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return dict(get_optimizer_state_dict(model, optim, options=_fsdp2_options(kind)))


def set_optim_state(model: nn.Module, optim: torch.optim.Optimizer, version: str, kind: str,
                    state: dict[str, Any]) -> None:
    """Load an optimizer state dict of ``kind`` into ``optim``."""
    if version == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with _fsdp1_optim_type(model, kind):
            optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, state))
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optim, state, options=_fsdp2_options(kind, loading=True))


@contextlib.contextmanager
def shared_folder(ctx: RankContext, prefix: str) -> Iterator[str]:
    """A temporary folder every rank writes to: rank 0 makes it, every rank gets its path, and
    rank 0 removes it once every rank is done (a barrier)."""
    import shutil
    import tempfile

    import torch.distributed as dist

    holder = [tempfile.mkdtemp(prefix=prefix) if ctx.rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    try:
        yield str(holder[0])
    finally:
        dist.barrier()
        if ctx.rank == 0:
            shutil.rmtree(str(holder[0]), ignore_errors=True)


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


def save_train_state(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    """Model and optimizer state saved with ``torch.distributed.checkpoint`` into ``path``, as
    torch's recipe does it for either FSDP version (``get_state_dict``, ``dcp.save``)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    model_state, optim_state = get_state_dict(model, optim)
    save({"model": model_state, "optim": optim_state}, storage_writer=FileSystemWriter(path))


def load_train_state(model: nn.Module, optim: torch.optim.Optimizer, path: str, *,
                     optimizer: bool = True) -> None:
    """The state :func:`save_train_state` wrote, loaded into ``model`` (and ``optim``, unless
    ``optimizer`` is False: the negative control) with ``dcp.load`` and ``set_state_dict``."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict import (
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import load

    model_state, optim_state = get_state_dict(model, optim)
    # dcp.load fills the dicts in place: the same objects go back to set_*_state_dict.
    state: dict[str, Any] = {"model": model_state}
    if optimizer:
        state["optim"] = optim_state
    load(state, storage_reader=FileSystemReader(path))
    if optimizer:
        set_state_dict(model, optim, model_state_dict=model_state, optim_state_dict=optim_state)
    else:
        set_model_state_dict(model, model_state)


def _train_step(model: nn.Module, optim: torch.optim.Optimizer, batch: Any,
                seed: int) -> float:
    """One AdamW step drawing from ``seed`` (dropout masks alike on both runs); its loss."""
    from fsdp_conformance.models import call_model, default_loss

    torch.manual_seed(seed)
    loss = default_loss(call_model(model, batch))
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return float(loss.detach())


def _resumed_step(model: nn.Module, optim: torch.optim.Optimizer, batch: Any,
                  version: str) -> dict[str, Any]:
    """The step after the save, under :data:`STEP_SEED`: its loss (and its exact bits) and the
    digests of the model's full state after it."""
    loss = _train_step(model, optim, batch, STEP_SEED)
    return {"loss": loss, "loss_hex": loss.hex(),
            "digests": digests(get_state(model, version, "full"))}


def rank_state_resume(ctx: RankContext, spec: ModelSpec = DEFAULT_SPEC,
                      version: str = "fsdp2", seed: int = 0,
                      drop_optimizer: bool = False) -> dict[str, Any]:
    """Train :data:`STEPS_BEFORE` AdamW steps, take the model's and the optimizer's state dicts
    of each kind, load them into a model and optimizer built under another seed, and take one
    more step on both: the resumed run must equal the unbroken one (loss and every tensor,
    bitwise). ``drop_optimizer``: the optimizer's state is not loaded (the negative control).
    """
    check_fsdp_version(version)
    source = build_sharded(ctx, spec, version, seed)
    optim = torch.optim.AdamW(source.parameters(), lr=1e-2)
    batch = spec.batch(source, 2, ctx.device)
    for step in range(STEPS_BEFORE):
        _train_step(source, optim, batch, STEP_SEED + 1 + step)
    saved = {kind: (snapshot(get_state(source, version, RESUME_MODEL_KIND.get(kind, kind))),
                    snapshot(get_optim_state(source, optim, version, kind)))
             for kind in RESUME_KINDS[version] if kind != "dcp"}
    kinds = {}
    with shared_folder(ctx, "fsdp-conformance-resume-") as path:
        save_train_state(source, optim, path)  # files: the dcp kind's snapshot
        unbroken = _resumed_step(source, optim, batch, version)
        for kind in RESUME_KINDS[version]:
            target = build_sharded(ctx, spec, version, seed + 1)
            target_optim = torch.optim.AdamW(target.parameters(), lr=1e-2)
            if kind == "dcp":
                load_train_state(target, target_optim, path, optimizer=not drop_optimizer)
            else:
                model_state, optim_state = saved[kind]
                set_state(target, version, RESUME_MODEL_KIND.get(kind, kind), model_state)
                if not drop_optimizer:
                    set_optim_state(target, target_optim, version, kind, optim_state)
            kinds[kind] = _resumed_step(target, target_optim, batch, version)
            if kind in saved:  # observed: how much optimizer state the getter handed this rank
                kinds[kind]["optim_entries"] = len(saved[kind][1].get("state", {}))
    return {"rank": ctx.rank, "version": version, "unbroken": unbroken, "kinds": kinds}


def verdict_state_resume(values: Sequence[Mapping[str, Any]],
                         params: Mapping[str, Any]) -> Verdict:
    """Per kind, on every rank: the resumed step's loss and the model after it equal the
    unbroken run's, bitwise; a rank-0-only optimizer getter handed rank 0 alone its state."""
    spec = params.get("spec", DEFAULT_SPEC)
    version = params.get("version", "fsdp2")
    kinds = list(values[0]["kinds"])
    tree, bad = [], []
    for kind in kinds:
        wrong: dict[int, list[str]] = {}
        for value in values:
            unbroken, resumed = value["unbroken"], value["kinds"][kind]
            lines = []
            if resumed["loss_hex"] != unbroken["loss_hex"]:
                lines.append(f"loss of the resumed step: expected {unbroken['loss']:.9g} "
                             f"(unbroken run), got {resumed['loss']:.9g}")
            lines += [f"after the resumed step: {d}"
                      for d in _differences(unbroken["digests"], resumed["digests"])]
            entries = resumed.get("optim_entries")
            if kind in RANK0_ONLY and entries is not None and (
                    (entries > 0) != (value["rank"] == 0)):
                lines.append(f"the rank-0-only optimizer getter handed this rank state for "
                             f"{entries} parameter(s)" + (" (expected some)" if value["rank"] == 0
                                                         else " (expected none)"))
            if lines:
                wrong[value["rank"]] = lines
        tree += _section(kind, "resumed run equals the unbroken one", wrong)
        bad += [kind] if wrong else []
    losses = {str(v["rank"]): v["unbroken"]["loss"] for v in values}
    figures = {"kinds": kinds, "steps_before": STEPS_BEFORE, "failed_kinds": sorted(set(bad))}
    head = (f"{version} {spec.name}: AdamW, {STEPS_BEFORE} steps, model and optimizer state "
            f"saved ({', '.join(kinds)}), loaded into a fresh model, one more step against the "
            f"unbroken run, bitwise, on all {len(values)} ranks")
    return Verdict(not bad, head + ":\n" + "\n".join(tree), figures, {"unbroken_loss": losses})


# ============================================================================================
# Distributed checkpoints: real files, loaded into the other FSDP version and into one process
# ============================================================================================

#: Where a checkpoint saved by ``version`` is loaded: each FSDP version at the same world size,
#: and an unsharded model in one process (``no_dist``: resharded to world size 1).
DCP_TARGETS = ("fsdp1", "fsdp2", "unsharded")


def save_checkpoint(model: nn.Module, version: str, path: str, *, perturb: bool,
                    rank: int) -> None:
    """The model's sharded state dict written with ``torch.distributed.checkpoint`` to ``path``
    (``FileSystemWriter``: real files). ``perturb``: rank 0's shards are written with one value
    of each changed (the negative control: a checkpoint with wrong shards)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    state = get_state(model, version, "sharded")
    if perturb and rank == 0:
        state = snapshot(state)  # not the live parameters
        perturb_values(state, every=True)
    save(state, storage_writer=FileSystemWriter(path))


def load_checkpoint(ctx: RankContext, spec: ModelSpec, target: str, path: str,
                    seed: int, *, perturb: bool = False) -> dict[str, list[Any]]:
    """A model built under another seed, loaded from the checkpoint at ``path``: sharded with
    ``target`` ("fsdp1", "fsdp2"), or unsharded in this process alone; its full state's
    digests. ``perturb``: one value read is changed before it reaches the model (the negative
    control: a loader that reads a wrong value)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load

    reader = FileSystemReader(path)
    if target == "unsharded":
        plain = build(spec, seed)
        state = plain.state_dict()
        load(state, storage_reader=reader, no_dist=True)
        if perturb:
            perturb_values(state)
        plain.load_state_dict(state)
        return digests(plain.state_dict())
    model = build_sharded(ctx, spec, target, seed)
    state = get_state(model, target, "sharded")
    load(state, storage_reader=reader)
    if perturb:
        perturb_values(state)
    set_state(model, target, "sharded", state)
    return digests(get_state(model, target, "full"))


def require_dcp_targets(ctx: RankContext) -> None:
    """Skip (every rank alike, before any collective) where this torch cannot load into every
    target of :data:`DCP_TARGETS`: the unsharded one needs ``dcp.load(no_dist=True)``, the
    FSDP2 one (and an FSDP2 source) FSDP2 on this device."""
    capabilities.require(capabilities.DCP_NO_DIST)
    capabilities.require(capabilities.FSDP2_ON_CPU, ctx.device_type)


def rank_state_dcp(ctx: RankContext, spec: ModelSpec = DEFAULT_SPEC, version: str = "fsdp2",
                   seed: int = 0, perturb: bool = False) -> dict[str, Any]:
    """Save the sharded model with ``torch.distributed.checkpoint`` into a folder every rank
    writes to, then load it into each of :data:`DCP_TARGETS`; every target's digests."""
    check_fsdp_version(version)
    require_dcp_targets(ctx)
    with shared_folder(ctx, "fsdp-conformance-dcp-") as path:
        source = build_sharded(ctx, spec, version, seed)
        save_checkpoint(source, version, path, perturb=perturb, rank=ctx.rank)
        files = sorted(os.listdir(path))
        loaded = {target: load_checkpoint(ctx, spec, target, path, seed + 1)
                  for target in DCP_TARGETS}
    return {"rank": ctx.rank, "version": version, "files": files, "loaded": loaded}


def _where(target: str, world_size: int, one_process: str) -> str:
    """Where a checkpoint was loaded into ``target``, for a verdict's line."""
    return one_process if target == "unsharded" else f"{target} at world size {world_size}"


def verdict_state_dcp(values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Verdict:
    """Every target, on every rank: the model loaded from the checkpoint equals the reference,
    tensor by tensor, bitwise."""
    spec = params.get("spec", DEFAULT_SPEC)
    version = params.get("version", "fsdp2")
    expected = reference_digests(spec, params.get("seed", 0))
    one_process = "one process, no_dist: world size 1"
    tree, bad = _judge_targets(
        expected, [(v["rank"], v["loaded"]) for v in values], DCP_TARGETS,
        lambda t: f"loaded into {t} ({_where(t, len(values), one_process)})")
    files = values[0]["files"]
    figures = {"targets": list(DCP_TARGETS), "files": len(files), "tensors": len(expected),
               "failed_targets": sorted(set(bad))}
    head = (f"{version} {spec.name}: sharded state saved with torch.distributed.checkpoint at "
            f"world size {len(values)} ({len(files)} files), loaded into each target, against "
            "the single-process reference, bitwise")
    return Verdict(not bad, head + ":\n" + "\n".join(tree), figures, {"files": files})


# ============================================================================================
# Resharding: a checkpoint saved by fewer ranks, loaded by the whole world
# ============================================================================================

#: Where a checkpoint saved at the smaller world size is loaded: both FSDP versions, at the
#: whole world size.
RESHARD_TARGETS = ("fsdp1", "fsdp2")


def saving_ranks(world_size: int) -> int:
    """How many ranks save the checkpoint that the whole world loads: half of them (at least
    one), so that the load reshards (world size 2 saves at 1, world size 4 at 2)."""
    return max(1, world_size // 2)


def rank_state_reshard(ctx: RankContext, spec: ModelSpec = DEFAULT_SPEC, version: str = "fsdp2",
                       seed: int = 0, perturb: bool = False) -> dict[str, Any]:
    """The first :func:`saving_ranks` ranks shard the model on a process group of their own and
    save it with ``torch.distributed.checkpoint`` (that group's world size); then every rank
    loads it into each of :data:`RESHARD_TARGETS` at the whole world size; every target's
    digests. ``perturb``: rank 0 writes its shards with every tensor changed."""
    import torch.distributed as dist

    check_fsdp_version(version)
    capabilities.require(capabilities.FSDP2_ON_CPU, ctx.device_type)  # loads into FSDP2
    savers = saving_ranks(ctx.world_size)
    group = dist.new_group(ranks=list(range(savers)))  # every rank calls it, as c10d requires
    try:
        with shared_folder(ctx, "fsdp-conformance-reshard-") as path:
            files, loaded = _save_on_group_and_load(ctx, spec, version, seed, perturb, group,
                                                    savers, path)
    finally:
        dist.destroy_process_group(group)
    return {"rank": ctx.rank, "version": version, "saved_by": savers, "files": files,
            "loaded": loaded}


def _save_on_group_and_load(ctx: RankContext, spec: ModelSpec, version: str, seed: int,
                            perturb: bool, group: Any, savers: int,
                            path: str) -> tuple[list[str], dict[str, Any]]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    if ctx.rank < savers:
        model = build(spec, seed, ctx.device)
        if version == "fsdp1":
            on_group: dict[str, Any] = {"process_group": group}
        else:
            from torch.distributed.device_mesh import DeviceMesh

            on_group = {"mesh": DeviceMesh.from_group(group, ctx.device_type)}
        source = shard(model, ctx, version, BuiltModel(spec, model).policy("recommended"),
                       **on_group)
        saved = get_state(source, version, "sharded")
        if perturb and ctx.rank == 0:
            # In place: the source is not used again. Not a snapshot: a ShardedTensor read
            # back belongs to the default group, no longer to the savers' (DCP then waits
            # for ranks that do not save).
            perturb_values(saved, every=True)
        save(saved, storage_writer=FileSystemWriter(path), process_group=group)
    dist.barrier()
    files = sorted(os.listdir(path))
    return files, {target: load_checkpoint(ctx, spec, target, path, seed + 1)
                   for target in RESHARD_TARGETS}


def verdict_state_reshard(values: Sequence[Mapping[str, Any]],
                          params: Mapping[str, Any]) -> Verdict:
    """Every target, on every rank: the model loaded at the whole world size from the checkpoint
    the smaller world saved equals the reference, tensor by tensor, bitwise."""
    spec = params.get("spec", DEFAULT_SPEC)
    version = params.get("version", "fsdp2")
    expected = reference_digests(spec, params.get("seed", 0))
    saved_by = values[0]["saved_by"]
    tree, bad = _judge_targets(expected, [(v["rank"], v["loaded"]) for v in values],
                               RESHARD_TARGETS,
                               lambda t: f"loaded into {t} at world size {len(values)}")
    files = values[0]["files"]
    figures = {"saved_world_size": saved_by, "loaded_world_size": len(values),
               "targets": list(RESHARD_TARGETS), "failed_targets": sorted(set(bad))}
    head = (f"{version} {spec.name}: sharded state saved with torch.distributed.checkpoint by "
            f"{saved_by} rank(s) on a group of their own ({len(files)} files), loaded at world "
            f"size {len(values)} into each FSDP version, against the single-process reference, "
            "bitwise")
    return Verdict(not bad, head + ":\n" + "\n".join(tree), figures, {"files": files})


# ============================================================================================
# Across runs (and torch versions): run --save-checkpoint DIR, then --load-checkpoint DIR
# ============================================================================================

#: Written beside each saved checkpoint: who saved it (torch, FSDP version, model, world size)
#: and the digests of every value saved, which a later run's load must give back.
MANIFEST = "fsdp-conformance-checkpoint.json"


def checkpoint_folder(root: str, version: str, spec: ModelSpec) -> str:
    """The folder of one variant's checkpoint under ``root``."""
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in spec.name)
    return os.path.join(root, f"{version}-{name}")


def _prepare_folder(path: str) -> str:
    """Rank 0 empties ``path`` for a new save: "" when ready, else why not (a folder of
    someone else's files is never removed)."""
    import shutil

    if os.path.isdir(path) and os.listdir(path):
        if not os.path.exists(os.path.join(path, MANIFEST)):
            return (f"{path} holds files that are not a checkpoint of this suite; give "
                    "--save-checkpoint an empty folder or one an earlier save wrote")
        shutil.rmtree(path)
    os.makedirs(path, exist_ok=True)
    return ""


def _read_manifest(path: str, root: str, version: str, spec: ModelSpec) -> dict[str, Any]:
    import json

    from fsdp_conformance.harness import CheckSkipped

    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            manifest: dict[str, Any] = json.load(f)
    except FileNotFoundError:
        raise CheckSkipped(
            f"no checkpoint of {version} {spec.name} in {root} ({path} has no {MANIFEST}): "
            f"run `fsdp-conformance run --save-checkpoint {root}` with the same model on the "
            "torch to load from first") from None
    return manifest


def rank_state_checkpoint(ctx: RankContext, spec: ModelSpec = DEFAULT_SPEC,
                          version: str = "fsdp2", seed: int = 0, save_to: str | None = None,
                          load_from: str | None = None, perturb: bool = False) -> dict[str, Any]:
    """``load_from``: the checkpoint an earlier run (another torch, maybe another world size)
    saved for this variant, loaded into each of :data:`DCP_TARGETS`; the digests of each and
    the saver's manifest. ``save_to``: the sharded model saved with
    ``torch.distributed.checkpoint`` into this variant's folder with a manifest (rank 0), then
    read back into a fresh model of ``version``. The load runs first, so one run can load an
    older torch's checkpoint and save its own. ``perturb``: rank 0's loader reads one wrong
    value (load) or writes its shards changed (save): the negative controls."""
    import json

    import torch.distributed as dist

    check_fsdp_version(version)
    require_dcp_targets(ctx)
    out: dict[str, Any] = {"rank": ctx.rank, "version": version}
    if load_from is not None:
        path = checkpoint_folder(load_from, version, spec)
        manifest = _read_manifest(path, load_from, version, spec)
        out["load"] = {
            "manifest": manifest,
            "loaded": {t: load_checkpoint(ctx, spec, t, path, seed + 1,
                                          perturb=perturb and ctx.rank == 0)
                       for t in DCP_TARGETS},
        }
    if save_to is not None:
        path = checkpoint_folder(save_to, version, spec)
        problem = [_prepare_folder(path) if ctx.rank == 0 else None]
        dist.broadcast_object_list(problem, src=0)
        if problem[0]:
            raise RuntimeError(problem[0])
        source = build_sharded(ctx, spec, version, seed)
        saved = digests(get_state(source, version, "full"))
        save_checkpoint(source, version, path, perturb=perturb, rank=ctx.rank)
        if ctx.rank == 0:
            manifest = {"torch": torch.__version__, "version": version, "model": spec.name,
                        "world_size": ctx.world_size, "seed": seed, "digests": saved}
            with open(os.path.join(path, MANIFEST), "w", encoding="utf-8") as f:
                json.dump(manifest, f, indent=1)
        dist.barrier()
        # Read back into every target a later load uses: the same work (and warnings) on both
        # sides of an upgrade gate, so compare shows only what differs.
        out["save"] = {"path": path, "files": sorted(os.listdir(path)),
                       "read_back": {t: load_checkpoint(ctx, spec, t, path, seed + 1)
                                     for t in DCP_TARGETS}}
    return out


def verdict_state_checkpoint(values: Sequence[Mapping[str, Any]],
                             params: Mapping[str, Any]) -> Verdict:
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
        expected = {k: list(d) for k, d in manifest["digests"].items()}
        lines, failed = _judge_targets(
            expected, [(v["rank"], v["load"]["loaded"]) for v in values], DCP_TARGETS,
            lambda t: f"loaded into {t} ({_where(t, len(values), 'one process, no_dist')})")
        tree += lines
        bad += [f"load:{t}" for t in failed]
        heads.append(f"loaded the checkpoint torch {manifest['torch']} saved at world size "
                     f"{manifest['world_size']} under {manifest['version']}, on torch "
                     f"{torch.__version__}, against the values it saved, bitwise")
        figures.update(checkpoint_torch=manifest["torch"],
                       checkpoint_world_size=manifest["world_size"])
    if "save" in values[0]:
        lines, failed = _judge_targets(
            reference_digests(spec, params.get("seed", 0)),
            [(v["rank"], v["save"]["read_back"]) for v in values], DCP_TARGETS,
            lambda t: f"saved, read back into {t}")
        tree += lines
        bad += [f"save:{t}" for t in failed]
        files = values[0]["save"]["files"]
        heads.append(f"saved to {values[0]['save']['path']} ({len(files)} files) at world size "
                     f"{len(values)} on torch {torch.__version__}, read back against the "
                     "reference, bitwise")
        figures.setdefault("checkpoint_torch", torch.__version__)
        figures.setdefault("checkpoint_world_size", len(values))
    figures["failed"] = sorted(set(bad))
    head = f"{version} {spec.name}: " + "; ".join(heads)
    return Verdict(not bad, head + ":\n" + "\n".join(tree), figures)


# ============================================================================================
# FSDP1's summon_full_params: what a rank sees inside, and what writeback keeps
# ============================================================================================

#: Added inside ``summon_full_params`` to every value of the first parameter (by name).
WRITE_DELTA = 1.0
#: The options of each case: label -> (writeback, rank0_only, whether a parameter is changed
#: inside).
SUMMON_CASES: dict[str, tuple[bool, bool, bool]] = {
    "writeback": (True, False, True),
    "no_writeback": (False, False, True),
    "rank0_only": (False, True, False),
    "rank0_only_write": (False, True, True),
}
#: ``summon_full_params(with_grads=True)`` after a backward: each parameter's gradient inside,
#: whole, against a single-process backward of the same batch (a case of ``state.summon``).
SUMMON_GRADS = "with_grads"
#: ``state.summon``'s cases; ``rank0_only_write`` is ``state.summon.rank0_discard``'s alone: a
#: known torch defect (``expectations.toml``) must not hide a failure of the others.
SUMMON_DEFAULT_CASES = ("writeback", "no_writeback", "rank0_only", SUMMON_GRADS)
#: How far (relative to the largest reference gradient) a summoned gradient may be from the
#: reference's: the reduce-scatter averages every rank's gradient of the same batch, which is
#: exact at world size 2 (each half summed) and may round in the last bit beyond it.
SUMMON_GRAD_RTOL = 1e-6


def rank_state_summon(ctx: RankContext, spec: ModelSpec = DEFAULT_SPEC, version: str = "fsdp1",
                      seed: int = 0, broken_writeback: bool = False,
                      cases: Sequence[str] = SUMMON_DEFAULT_CASES,
                      broken_grads: bool = False) -> dict[str, Any]:
    """Per case of :data:`SUMMON_CASES` in ``cases``: the full parameters a rank sees inside
    ``FSDP.summon_full_params`` (their digests, where it holds them whole), then, where the
    case writes, one parameter changed inside on every rank, and the model's full state after
    the context. ``offload_to_cpu`` where the parameters are on a GPU, as users call it.

    With ``rank0_only`` the other ranks hold their shards inside: ``rank0_only_write`` changes
    the first parameter every rank holds (whole on rank 0, a shard elsewhere), and
    ``writeback=False`` says the change is discarded (measured otherwise: docs/state.md).
    ``broken_writeback``: the writeback case runs with ``writeback=False`` (the negative
    control). :data:`SUMMON_GRADS`: the gradients inside after a backward
    (:func:`_summoned_grads`); ``broken_grads`` summons them without ``with_grads=True``."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    check_fsdp_version(version)
    if version != "fsdp1":
        raise ValueError("summon_full_params is FSDP1's; FSDP2 has no such context")
    out: dict[str, Any] = {}
    for label in cases:
        if label == SUMMON_GRADS:
            out[label] = _summoned_grads(ctx, spec, seed, with_grads=not broken_grads)
            continue
        writeback, rank0_only, write = SUMMON_CASES[label]
        model = build_sharded(ctx, spec, version, seed)
        with FSDP.summon_full_params(model, writeback=writeback and not broken_writeback,
                                     rank0_only=rank0_only, offload_to_cpu=_offload_to_cpu(model)):
            inside = dict(model.named_parameters())
            seen = digests(inside)
            changed = sorted(inside)[0] if write else None
            if changed is not None:
                with torch.no_grad():
                    inside[changed].add_(WRITE_DELTA)
        after = digests(get_state(model, version, "full"))
        out[label] = {"inside": seen, "after": after, "changed": changed}
    return {"rank": ctx.rank, "cases": out}


def _summoned_grads(ctx: RankContext, spec: ModelSpec, seed: int,
                    with_grads: bool = True) -> dict[str, Any]:
    """One backward of the same batch on every rank under FSDP1 (``use_orig_params=True``, which
    ``with_grads`` needs) and on this rank's single-process copy of the model; inside
    ``summon_full_params(with_grads=...)`` each parameter's gradient against the copy's: the
    largest absolute difference, the reference's largest gradient, and the names with none."""
    import copy

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from fsdp_conformance.models import call_model, default_loss
    from fsdp_conformance.step import disable_dropout

    model = build(spec, seed, ctx.device)
    disable_dropout(model)  # the two backwards must compute the same function (docs/state.md)
    reference = copy.deepcopy(model)
    sharded = shard(model, ctx, "fsdp1", BuiltModel(spec, model).policy("recommended"),
                    use_orig_params=True)
    batch = spec.batch(reference, 2, ctx.device)
    default_loss(call_model(sharded, batch)).backward()
    default_loss(call_model(reference, batch)).backward()
    want = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    diffs, missing = {}, []
    with FSDP.summon_full_params(sharded, with_grads=with_grads, writeback=False):
        for name, p in sharded.named_parameters():
            key, grad = clean_fqn(name), p.grad
            if grad is None or key not in want or grad.shape != want[key].shape:
                missing.append(key)
                continue
            diffs[key] = float((grad.detach().float() - want[key].float()).abs().max())
    scale = max((float(g.abs().max()) for g in want.values()), default=0.0)
    return {"grad_diffs": diffs, "missing": sorted(missing), "scale": scale,
            "with_grads": with_grads}


def _judge_summoned_grads(
    values: Sequence[Mapping[str, Any]],
) -> tuple[dict[int, list[str]], str]:
    """The :data:`SUMMON_GRADS` case: each rank's problems, and the line for none."""
    wrong: dict[int, list[str]] = {}
    for value in values:
        case = value["cases"][SUMMON_GRADS]
        limit = SUMMON_GRAD_RTOL * case["scale"]
        lines = [f"{name}: no whole gradient inside the context" for name in case["missing"]]
        lines += [f"{name}: gradient differs from the reference's by {d:.3g} > {limit:.3g}"
                  for name, d in sorted(case["grad_diffs"].items()) if d > limit]
        if not case["with_grads"]:
            lines.insert(0, "summoned without with_grads=True (the negative control)")
        if lines:
            wrong[value["rank"]] = lines
    worst = max((max(v["cases"][SUMMON_GRADS]["grad_diffs"].values(), default=0.0)
                 for v in values), default=0.0)
    ok = (f"every gradient whole inside and equal to a single-process backward of the same "
          f"batch (largest difference {worst:.3g}, allowed {SUMMON_GRAD_RTOL:g} of the largest "
          "gradient)")
    return wrong, ok


def _judge_summon_case(label: str, values: Sequence[Mapping[str, Any]], reference: nn.Module,
                       expected: Mapping[str, Any]) -> tuple[dict[int, list[str]], str]:
    """A :data:`SUMMON_CASES` case: each rank's problems, and the line for none."""
    writeback, rank0_only, _ = SUMMON_CASES[label]
    wrong: dict[int, list[str]] = {}
    for value in values:
        case = value["cases"][label]
        lines = []
        inside = {clean_fqn(k): d for k, d in case["inside"].items()}
        if not rank0_only or value["rank"] == 0:
            params_only = {k: d for k, d in expected.items() if k in inside}
            lines += [f"inside: {d}" for d in _differences(params_only, inside)]
            if not params_only:
                lines.append("inside: no parameter of the reference seen")
        want = dict(expected)
        name = case["changed"]
        if writeback and name is not None:
            with torch.no_grad():
                changed = dict(reference.named_parameters())[clean_fqn(name)].detach() \
                    + WRITE_DELTA
            want[clean_fqn(name)] = digests({"x": changed})["x"]
        lines += [f"after the context: {d}" for d in _differences(want, case["after"])]
        if lines:
            wrong[value["rank"]] = lines
    return wrong, ("the change kept" if writeback else "the model unchanged") + " after the context"


def verdict_state_summon(values: Sequence[Mapping[str, Any]],
                         params: Mapping[str, Any]) -> Verdict:
    """Inside: every parameter whole and equal to the reference (on rank 0 alone with
    ``rank0_only``). After: with writeback the change is in the model, without it the model is
    the reference again; bitwise."""
    spec = params.get("spec", DEFAULT_SPEC)
    reference = build(spec, params.get("seed", 0))
    expected = digests(reference.state_dict())
    tree, bad = [], []
    cases = list(values[0]["cases"])
    for label in cases:
        wrong, ok = (_judge_summoned_grads(values) if label == SUMMON_GRADS
                     else _judge_summon_case(label, values, reference, expected))
        tree += _section(label, ok, wrong)
        bad += [label] if wrong else []
    figures = {"cases": cases, "failed_cases": bad}
    head = (f"fsdp1 {spec.name}: summon_full_params, {len(cases)} case(s), against the "
            f"single-process reference, bitwise, on all {len(values)} ranks")
    return Verdict(not bad, head + ":\n" + "\n".join(tree), figures)


CHECKS: tuple[Check, ...] = variants(
    "state.round_trip",
    {"fsdp1": "FULL (rank 0 only and not), SHARDED and LOCAL state dicts: got and loaded into "
              "another sharded model, equal to the reference bitwise",
     "fsdp2": "get/set_model_state_dict full (rank 0 with broadcast, every rank) and sharded: "
              "got and loaded into another sharded model, equal to the reference bitwise"},
    rank_state_round_trip, verdict_state_round_trip, specs=(DEFAULT_SPEC,),
) + variants(
    "state.resume",
    {"fsdp1": "FSDP.optim_state_dict / optim_state_dict_to_load with FULL and SHARDED model "
              "state after two AdamW steps: the resumed step equals the unbroken run bitwise",
     "fsdp2": "get/set_optimizer_state_dict and get/set_model_state_dict, full and sharded, "
              "after two AdamW steps: the resumed step equals the unbroken run bitwise"},
    rank_state_resume, verdict_state_resume, specs=(DEFAULT_SPEC,),
) + variants(
    "state.dcp",
    {"fsdp1": "SHARDED_STATE_DICT saved with torch.distributed.checkpoint (real files), loaded "
              "into FSDP1, FSDP2 and one unsharded process: equal to the reference bitwise",
     "fsdp2": "get_model_state_dict saved with torch.distributed.checkpoint (real files), "
              "loaded into FSDP2, FSDP1 and one unsharded process: equal to the reference "
              "bitwise"},
    rank_state_dcp, verdict_state_dcp, specs=(DEFAULT_SPEC,),
) + variants(
    "state.reshard",
    {"fsdp1": "SHARDED_STATE_DICT saved with torch.distributed.checkpoint by half the ranks (a "
              "process group of their own), loaded by every rank into FSDP1 and FSDP2: equal "
              "to the reference bitwise",
     "fsdp2": "get_model_state_dict saved with torch.distributed.checkpoint by half the ranks "
              "(a mesh of their own), loaded by every rank into FSDP2 and FSDP1: equal to the "
              "reference bitwise"},
    rank_state_reshard, verdict_state_reshard, specs=(DEFAULT_SPEC,),
) + variants(
    "state.checkpoint",
    "a checkpoint saved by one run (run --save-checkpoint DIR) loaded by another, on another "
    "torch (--load-checkpoint DIR) into FSDP1, FSDP2 and one process: the saved values, bitwise "
    "(only in runs given one of the two flags)",
    rank_state_checkpoint, verdict_state_checkpoint, specs=(DEFAULT_SPEC,),
    opt_in=("save_to", "load_from"), save_to=None, load_from=None,
) + variants(
    "state.summon",
    "FSDP1 summon_full_params (writeback on and off, rank0_only, with_grads): whole parameters "
    "equal to the reference inside, a change inside kept only with writeback, whole gradients "
    "equal to a single-process backward",
    rank_state_summon, verdict_state_summon, versions=("fsdp1",), specs=(DEFAULT_SPEC,),
) + variants(
    "state.summon.rank0_discard",
    "FSDP1 summon_full_params(rank0_only=True, writeback=False): a change made inside on every "
    "rank is discarded after the context, as the docstring says (a known defect on the torch "
    "versions in expectations.toml)",
    rank_state_summon, verdict_state_summon, versions=("fsdp1",), specs=(DEFAULT_SPEC,),
    cases=("rank0_only_write",),
)
