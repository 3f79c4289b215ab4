"""What the state claim's families share: the model built and sharded under a seed, the state
dicts of each kind got and set as torch hands them to a user, what a getter returned and the
digests of every tensor, the checkpoint files every rank writes and reads, and the verdicts'
comparison of digests against the reference (docs/state.md).

The kinds and their getters (``KINDS``, ``get_state``, ``set_state``) live in the sharding block
(:mod:`fsdp_conformance.fsdp.sharding`), which the loop claim reads too; they are re-exported here
for the state claim's modules.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from fsdp_conformance.fsdp import capabilities
from fsdp_conformance.fsdp.sharding import shard
from fsdp_conformance.fsdp.state_dict_kinds import GET_ONLY as GET_ONLY
from fsdp_conformance.fsdp.state_dict_kinds import KINDS as KINDS
from fsdp_conformance.fsdp.state_dict_kinds import RANK0_ONLY as RANK0_ONLY
from fsdp_conformance.fsdp.state_dict_kinds import fsdp2_options as fsdp2_options
from fsdp_conformance.fsdp.state_dict_kinds import get_state as get_state
from fsdp_conformance.fsdp.state_dict_kinds import offload_to_cpu as offload_to_cpu
from fsdp_conformance.fsdp.state_dict_kinds import set_state as set_state
from fsdp_conformance.fsdp.tensors import local_tensor, sha256_of
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


class Description(TypedDict):
    """What a getter returned (:func:`describe`)."""

    entries: int
    types: list[str]
    devices: list[str]


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


def describe(state: Mapping[str, Any]) -> Description:
    """What a getter returned: entries, tensor types and devices (observed, for the report)."""
    types = sorted({type(v).__name__ for v in state.values()})
    devices = sorted({str(t.device) for v in state.values() if (t := local_tensor(v)) is not None})
    return {"entries": len(state), "types": types, "devices": devices}


def aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every parameter name of ``model`` -> every name of the same tensor, itself included (a
    tied weight or bias has several: GPT-2's head and embedding, BERT's decoder bias and
    ``cls.predictions.bias``). A check that changes a parameter expects the change under each of
    them: FSDP changes the one tensor, so every alias shows it."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {name: group for group in names.values() for name in group}


def digests(state: Mapping[str, Any]) -> Digests:
    """Per tensor of a full state dict: dtype, shape, SHA-256 of its bytes, and its sum."""
    out = {}
    for key, value in state.items():
        t = value.detach().to("cpu", copy=True).contiguous()  # the sum as the reference's
        out[key] = [
            str(t.dtype),
            list(t.shape),
            sha256_of(t),
            float(t.double().sum()) if t.is_floating_point() else int(t.sum()),
        ]
    return out


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
