"""``loop.uneven``: parameters whose dimension 0 does not divide by the world size train as the
single-process reference does, and every way a user reads them back sees them whole and in place.

On the odd model every width (13, 27, 31) is odd and the one-element ``gain`` is held by one rank
only under FSDP2. Observed on every rank, for ``STEPS`` plain optimizer steps:

* the local shards' sizes against what the world size implies: FSDP2 each parameter's
  ``to_local()`` shape (dimension 0 cut as ``torch.chunk`` cuts it: ``ceil(rows / world)`` rows
  per rank, the last ranks fewer or none); FSDP1 each unit's flat parameter (``ceil(numel /
  world)`` elements per rank, the shortfall padded);
* the parameters unsharded the way users unshard them (FSDP2 ``unshard()`` on every FSDP module,
  the module's parameters then plain tensors, then ``reshard()``; FSDP1 ``summon_full_params``):
  bitwise the reference's before training, the reference's after it;
* each forward's loss and each step's update against the reference's (``parity_problems``);
* the full state dict (FSDP1 ``FULL_STATE_DICT``, FSDP2 ``get_model_state_dict(
  full_state_dict=True)``, every other option left to torch) against the reference's parameters,
  and the sharded state dict's local pieces: the uneven sizes, and the reference's rows of this
  rank.

The user's sharding call is the loop's :func:`~fsdp_conformance.claims.loop.common.shard_model`,
which the fault of :data:`FAULTS` patches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fsdp_conformance import _compat
from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import Fault, FaultTable, patched
from fsdp_conformance.claims.loop import common
from fsdp_conformance.claims.loop.common import (
    LoopResult,
    Pair,
    build_pair,
    failed_verdict,
    loop_result,
    parity_figures,
    parity_note,
    parity_problems,
    tolerances,
    train_plain,
)
from fsdp_conformance.fsdp.reference_step import (
    TensorComparison,
    compare_tensors,
    comparison_problems,
    full_params,
    reference_params,
)
from fsdp_conformance.fsdp.state_dict_kinds import get_state
from fsdp_conformance.fsdp.tensors import listing, local_shard, local_tensor
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.units import clean_fqn

#: Optimizer steps per run (one micro-batch each).
STEPS = 2

# --------------------------------------------------------------------------------------------
# What the world size implies (parent side too)
# --------------------------------------------------------------------------------------------


def rows_held(rows: int, world_size: int, rank: int) -> int:
    """The rows (or elements) of ``rows`` that rank ``rank`` holds when they are cut as
    ``torch.chunk`` cuts them: ``ceil(rows / world_size)`` each, the last ranks fewer or none."""
    chunk = -(-rows // world_size)
    return max(0, min(chunk, rows - rank * chunk))


def expected_local(shape: Sequence[int], world_size: int, rank: int) -> list[int]:
    """A parameter's local shard shape on ``rank``, dimension 0 cut (a 0-d tensor: whole)."""
    if not shape:
        return []
    return [rows_held(shape[0], world_size, rank), *shape[1:]]


def expected_flat(unpadded: int, world_size: int, rank: int) -> tuple[int, int]:
    """An FSDP1 flat parameter's (local numel, padding) on ``rank``."""
    chunk = -(-unpadded // world_size)
    return chunk, chunk - rows_held(unpadded, world_size, rank)


# --------------------------------------------------------------------------------------------
# Observing the shards (rank side)
# --------------------------------------------------------------------------------------------


def local_shapes(model: nn.Module, version: str) -> dict[str, list[int]]:
    """FSDP2: each parameter's ``to_local()`` shape; FSDP1 (flat parameters): none."""
    if version == "fsdp1":
        return {}
    return {clean_fqn(n): list(local_shard(p).shape) for n, p in model.named_parameters()}


def flat_shards(model: nn.Module, version: str) -> dict[str, list[int]]:
    """FSDP1: each unit's flat parameter as ``[local numel, padding, unpadded numel]`` (padding
    -1 where this torch does not say); FSDP2: none."""
    if version == "fsdp2":
        return {}
    out = {}
    for name, module in model.named_modules():
        flat = _compat.fsdp1_flat_param(module)
        if flat is not None:
            padding = _compat.fsdp1_shard_padding(flat)
            out[clean_fqn(name)] = [
                flat.numel(),
                -1 if padding is None else padding,
                _compat.fsdp1_unsharded_numel(flat),
            ]
    return out


def unsharded_params(
    model: nn.Module, version: str, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every parameter (every alias of a tied one) read while unsharded as users unshard it,
    ``dtype`` copies, and the names still sharded then: FSDP1 ``summon_full_params``; FSDP2
    ``unshard()`` on every FSDP module, the module's parameters read as they then are,
    ``reshard()``."""
    if version == "fsdp1":
        return full_params(model, version, dtype), []
    units = [m for m in model.modules() if isinstance(m, _compat.fsdp_module_cls())]
    for unit in units:
        unit.unshard()
    try:
        dtensor = _compat.dtensor_cls()
        params = dict(model.named_parameters(remove_duplicate=False))
        still = [clean_fqn(n) for n, p in params.items() if isinstance(p, dtensor)]
        got = {
            clean_fqn(n): p.detach().to(dtype, copy=True)
            for n, p in params.items()
            if not isinstance(p, dtensor)
        }
        return got, still
    finally:
        for unit in units:
            unit.reshard()


def sharded_pieces(
    model: nn.Module, version: str, reference: Mapping[str, torch.Tensor], ctx: RankContext
) -> tuple[dict[str, list[int]], TensorComparison]:
    """The sharded state dict's local piece of each parameter: its shape, and the pieces against
    the reference's rows of this rank (a piece a rank holds none of counts as zero rows)."""
    state = get_state(model, version, "sharded")
    shapes: dict[str, list[int]] = {}
    pieces: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    for name, ref in reference.items():
        if name not in state:
            continue
        piece = local_tensor(state[name])
        if piece is None:
            piece = ref.new_empty((0, *ref.shape[1:]))
        shapes[name] = list(piece.shape)
        pieces[name] = piece.detach().to(ref.dtype, copy=True)
        chunk = -(-ref.shape[0] // ctx.world_size) if ref.dim() else 0
        start = ctx.rank * chunk
        held = rows_held(ref.shape[0], ctx.world_size, ctx.rank) if ref.dim() else 0
        expected[name] = ref[start : start + held] if ref.dim() else ref
    return shapes, compare_tensors(pieces, expected, names=sorted(reference))


# --------------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------------


def _shifted_after(shard_fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """The last rank's local shard of its largest parameter read one element off: shifted by
    one, after sharding."""

    def shard_shifted(model: nn.Module, ctx: RankContext, *args: Any, **kwargs: Any) -> nn.Module:
        out = shard_fn(model, ctx, *args, **kwargs)
        if ctx.rank + 1 == ctx.world_size:
            last = max((local_shard(p) for p in out.parameters()), key=lambda t: t.numel())
            with torch.no_grad():
                last.view(-1).copy_(torch.roll(last.reshape(-1), 1))
        return out

    return shard_shifted


FAULTS = FaultTable(
    wrong_offset=Fault(
        "the last rank's local shard of its largest parameter is read one element off (shifted "
        "by one after sharding): every element of it sits at the wrong offset",
        lambda ctx: patched(common, "shard_model", _shifted_after),
    ),
)

# --------------------------------------------------------------------------------------------
# The rank function
# --------------------------------------------------------------------------------------------


class UnevenResult(LoopResult):
    """A rank's uneven-shard run: the shared fields, the local shards observed, and every way of
    reading the parameters back against the reference."""

    #: The reference's parameter shapes, by name.
    global_shapes: dict[str, list[int]]
    #: FSDP2: each parameter's local shard shape; FSDP1: empty.
    local_shapes: dict[str, list[int]]
    #: FSDP1: each unit's ``[local numel, padding, unpadded numel]``; FSDP2: empty.
    flat_shards: dict[str, list[int]]
    #: How the parameters were unsharded ("unshard()" or "summon_full_params").
    unsharded_by: str
    #: Parameters still sharded (DTensors) after FSDP2's ``unshard()``.
    still_sharded: list[str]
    #: Unsharded before any step against the reference (bitwise expected), and after the steps.
    unsharded_init: TensorComparison
    unsharded: TensorComparison
    #: The full state dict's parameters after the steps against the reference's.
    full_state: TensorComparison
    #: The sharded state dict's local pieces: shapes, and against the reference's rows.
    sharded_state_shapes: dict[str, list[int]]
    sharded_state: TensorComparison


def rank_uneven(
    ctx: RankContext,
    spec: ModelSpec,
    version: str = "fsdp1",
    fault: str | Sequence[str] | None = None,
) -> UnevenResult:
    """``STEPS`` plain steps with the shards observed before and the parameters read back after."""
    with FAULTS.inject(fault, ctx):
        pair: Pair = build_pair(ctx, spec, version, micro=STEPS)
        reference = reference_params(pair.reference.model, pair.dtype)
        init, _ = unsharded_params(pair.sharded, version, pair.dtype)
        unsharded_init = compare_tensors(init, reference)
        losses, ref_losses, observed = train_plain(pair, STEPS)
        reference = reference_params(pair.reference.model, pair.dtype)
        after, still = unsharded_params(pair.sharded, version, pair.dtype)
        full = {
            k: v.detach().to(pair.dtype, copy=True)
            for k, v in get_state(pair.sharded, version, "full").items()
        }
        shapes, pieces = sharded_pieces(pair.sharded, version, reference, ctx)
        return {
            **loop_result(pair, losses, ref_losses, observed),
            "global_shapes": {k: list(v.shape) for k, v in reference.items()},
            "local_shapes": local_shapes(pair.sharded, version),
            "flat_shards": flat_shards(pair.sharded, version),
            "unsharded_by": "summon_full_params" if version == "fsdp1" else "unshard()",
            "still_sharded": still,
            "unsharded_init": unsharded_init,
            "unsharded": compare_tensors(after, reference),
            "full_state": compare_tensors(full, reference, names=sorted(reference)),
            "sharded_state_shapes": shapes,
            "sharded_state": pieces,
        }


# --------------------------------------------------------------------------------------------
# The verdict
# --------------------------------------------------------------------------------------------


def _size_problems(v: UnevenResult) -> list[str]:
    world, rank = v["world_size"], v["rank"]
    problems = []
    for label, shapes in (
        ("local shard", v["local_shapes"]),
        ("sharded state dict's local piece", v["sharded_state_shapes"]),
    ):
        for name, got in shapes.items():
            shape = v["global_shapes"].get(name, [])
            want = expected_local(shape, world, rank)
            if got != want:
                problems.append(
                    f"rank {rank}: {name} {shape}: {label} {got}, expected {want} (dimension 0 "
                    f"cut in ceil({shape[0] if shape else 0} / {world}) rows per rank)"
                )
    for unit, (numel, padding, unpadded) in v["flat_shards"].items():
        want_numel, want_padding = expected_flat(unpadded, world, rank)
        if numel != want_numel or padding not in (-1, want_padding):
            problems.append(
                f"rank {rank}: unit {unit!r}: flat parameter of {unpadded} elements held as "
                f"{numel} with {padding} padding, expected {want_numel} with {want_padding}"
            )
    return problems


def _value_problems(v: UnevenResult, rtol: float) -> list[str]:
    rank, how = v["rank"], v["unsharded_by"]
    problems = []
    init = v["unsharded_init"]
    if init["not_bitwise"] or init["missing"] or init["shape_mismatch"]:
        wrong = init["not_bitwise"] + init["shape_mismatch"] + init["missing"]
        problems.append(
            f"rank {rank}: before training, read after {how}: {listing(wrong, 4)} not the "
            "reference's (bitwise: nothing has run yet), a shard gathered from the wrong offset"
        )
    if v["still_sharded"]:
        problems.append(
            f"rank {rank}: still DTensors after unshard(): {listing(v['still_sharded'], 4)}"
        )
    for label, comparison in _read_back(v):
        problems += comparison_problems(f"rank {rank}: {label}", comparison, rtol)
    return problems


def _read_back(v: UnevenResult) -> list[tuple[str, TensorComparison]]:
    """The parameters after training, each way they were read back."""
    return [
        (f"after training, read after {v['unsharded_by']}", v["unsharded"]),
        ("the full state dict", v["full_state"]),
        ("the sharded state dict's local pieces (this rank's rows)", v["sharded_state"]),
    ]


def _uneven_figures(values: Sequence[UnevenResult]) -> tuple[dict[str, Any], dict[str, Any]]:
    world = values[0]["world_size"]
    shapes = values[0]["global_shapes"]
    uneven = sorted(n for n, s in shapes.items() if s and s[0] % world)
    empty = sorted(
        {
            name
            for v in values
            for name, s in (*v["local_shapes"].items(), *v["sharded_state_shapes"].items())
            if s and s[0] == 0
        }
    )
    figures = {
        **parity_figures(values),
        "world_size": world,
        "parameters": len(shapes),
        "uneven_parameters": len(uneven),
        "empty_on_some_rank": len(empty),
        "read_back_rel_diff": max(c["max_rel"] for v in values for _, c in _read_back(v)),
    }
    data = {
        "uneven": uneven,
        "empty_on_some_rank": empty,
        "local_shapes": {v["rank"]: v["local_shapes"] for v in values},
        "flat_shards": {v["rank"]: v["flat_shards"] for v in values},
    }
    return figures, data


def verdict_uneven(values: Sequence[UnevenResult], params: Mapping[str, Any]) -> Verdict:
    """On every rank: the local shards have the sizes the world size implies, the parameters
    read unsharded, through the full state dict and through the sharded state dict's pieces are
    the reference's, and every loss and update equals the reference's."""
    problems = parity_problems(values)
    rtol = tolerances(values)[0]
    for v in values:
        problems += _size_problems(v) + _value_problems(v, rtol)
    figures, data = _uneven_figures(values)
    world, how = figures["world_size"], values[0]["unsharded_by"]
    what = (
        f"{figures['parameters']} parameters at world size {world}, "
        f"{figures['uneven_parameters']} with dimension 0 not divisible by {world}"
    )
    if problems:
        return failed_verdict(
            values,
            f"uneven shards ({what}) differ from the reference",
            problems,
            figures,
            data,
        )
    empty = data["empty_on_some_rank"]
    return Verdict(
        True,
        f"{what}; "
        + (f"{listing(empty)} held by no shard on some rank; " if empty else "")
        + f"every rank's shards have the sizes the world size implies; after {STEPS} steps the "
        f"parameters read after {how}, the full state dict and the sharded state dict's pieces "
        f"equal the reference's (worst {figures['read_back_rel_diff']:.1e}), every update too "
        f"(worst {figures['update_rel_diff']:.1e})" + parity_note(values),
        figures,
        data,
    )
