"""``loop.buffers``: a model's persistent buffers through training and every state-dict kind.

FSDP never shards a buffer and never synchronises one: each rank's batch norm statistics follow
its own slices. After ``STEPS`` plain optimizer steps, observed on every rank:

* the rank's buffers against the reference's slice buffers of this rank
  (:meth:`~fsdp_conformance.fsdp.reference_step.SliceReference.buffers`), and how far they lie from
  rank 0's (the ranks differ, as the reference's slices do);
* every state-dict kind (``sharding.KINDS``: FSDP1 ``FULL_STATE_DICT`` on every rank and rank 0
  only, ``SHARDED_STATE_DICT``, ``LOCAL_STATE_DICT``; FSDP2 ``get_model_state_dict`` full, full
  on rank 0 with ``cpu_offload``, sharded): each persistent buffer in it with this rank's value,
  no non-persistent one (torch's ``state_dict`` excludes them; which buffers are persistent is
  read from the reference model's own ``state_dict``);
* each kind that is loaded (all but FSDP1's rank-0-only full dict, which FSDP1 does not load)
  loaded into a fresh sharded model whose buffers hold a sentinel (:data:`SENTINEL`), so a
  buffer the load does not restore shows: its buffers against this rank's (FSDP2's rank-0 full
  dict is broadcast from rank 0 on loading, so every rank gets rank 0's).

The user's code is this module's :func:`get_state_dict` and :func:`load_state_dict`, which the
fault of :data:`FAULTS` patches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict

import torch
import torch.distributed as dist
from torch import nn

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import Fault, FaultTable, patched_attr
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
    full_buffers,
)
from fsdp_conformance.fsdp.state_dict_kinds import GET_ONLY, KINDS, RANK0_ONLY, get_state, set_state
from fsdp_conformance.fsdp.tensors import listing, local_tensor, max_abs_diff, real_view
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.units import clean_fqn

#: Optimizer steps per run (one micro-batch each).
STEPS = 2
#: What a fresh model's buffers hold before a load: a value no buffer of the reference models
#: takes, that every dtype holds (uint8 and bool included).
SENTINEL = 77
#: Kinds whose load broadcasts rank 0's dict: every rank gets rank 0's buffers (FSDP2
#: ``broadcast_from_rank0=True``; observed on torch 2.13.0).
BROADCAST_ON_LOAD = frozenset({"full_rank0"})

# --------------------------------------------------------------------------------------------
# The user's code
# --------------------------------------------------------------------------------------------


def get_state_dict(model: nn.Module, version: str, kind: str) -> dict[str, Any]:
    """The user's state-dict getter of ``kind``, torch's API as users call it."""
    return get_state(model, version, kind)


def load_state_dict(model: nn.Module, version: str, kind: str, state: dict[str, Any]) -> None:
    """The user's load of a state dict of ``kind`` (strict, torch's default)."""
    set_state(model, version, kind, state)


# --------------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------------


def _dropping(getter: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """The getter with the model's first persistent buffer popped from every dict."""

    def get_without_a_buffer(model: nn.Module, version: str, kind: str) -> dict[str, Any]:
        state = getter(model, version, kind)
        names = [clean_fqn(n) for n, _ in model.named_buffers()]
        dropped = next((n for n in names if n in state), None)
        if dropped is not None:
            state.pop(dropped)
        return state

    return get_without_a_buffer


def _corrupting(train: Callable[..., Any]) -> Callable[..., Any]:
    """The training with the last rank's first buffer changed after it: a bool flipped, an
    integer or a float plus one (one rank's buffer the others and the reference lack)."""

    def train_then_corrupt(pair: Pair, steps: int) -> Any:
        out = train(pair, steps)
        if pair.ctx.rank == pair.ctx.world_size - 1:
            buffer = next(b for _, b in pair.sharded.named_buffers() if b.numel())
            with torch.no_grad():
                if buffer.dtype == torch.bool:
                    buffer.logical_not_()
                else:
                    buffer.add_(1)
        return out

    return train_then_corrupt


FAULTS = FaultTable(
    buffer_corrupted=Fault(
        "after training, the last rank's first buffer is changed (a bool flipped, a number plus "
        "one): that rank's buffer no longer follows its slices",
        lambda ctx: patched_attr(__name__, "train_plain", _corrupting),
    ),
    buffer_dropped=Fault(
        "the user's state-dict getter pops the model's first persistent buffer from every kind's "
        "dict: the dict lacks it, and a load leaves it unrestored (or refuses the dict)",
        lambda ctx: patched_attr(__name__, "get_state_dict", _dropping),
    ),
)

# --------------------------------------------------------------------------------------------
# The rank function
# --------------------------------------------------------------------------------------------


class KindBuffers(TypedDict):
    """One state-dict kind's buffers on one rank."""

    entries: int
    #: False for a rank-0-only kind on another rank (its dict is empty by design).
    judged: bool
    #: The dict's buffers against this rank's reference buffers (persistent ones only).
    got: TensorComparison
    #: Non-persistent buffers the dict carries (torch's ``state_dict`` excludes them).
    non_persistent: list[str]
    #: Loaded into a fresh sharded model: its buffers against ``loaded_from``'s reference
    #: buffers; None for a kind only got.
    loaded: TensorComparison | None
    loaded_from: int
    #: The load's error, one line ("" when it loaded).
    load_error: str


class BuffersResult(LoopResult):
    """A rank's buffer run: the shared fields, the buffers after training, each kind's."""

    persistent: list[str]
    non_persistent: list[str]
    #: This rank's buffers after the steps against the reference's slice buffers of this rank.
    live: TensorComparison
    #: Per persistent buffer, ``max |this rank's - rank 0's|``: FSDP's, and the reference's.
    spread: dict[str, float]
    ref_spread: dict[str, float]
    kinds: dict[str, KindBuffers]


def _persistence(model: nn.Module) -> tuple[list[str], list[str]]:
    """The reference's buffers its own ``state_dict`` carries (persistent), and the others."""
    keys = set(model.state_dict())
    names = [n for n, _ in model.named_buffers()]
    return [n for n in names if n in keys], [n for n in names if n not in keys]


def _spread(buffers: Mapping[str, torch.Tensor], names: Sequence[str]) -> dict[str, float]:
    """``max |buffer - rank 0's|`` per name (a broadcast from rank 0: call on every rank)."""
    out = {}
    for name in names:
        mine = real_view(buffers[name])  # fp64 reals: what gloo and NCCL carry of every kind
        first = mine.to(buffers[name].device, copy=True)
        dist.broadcast(first, src=0)
        out[name] = max_abs_diff(mine, first.cpu())
    return out


def _fresh(pair: Pair, spec: ModelSpec, persistent: Sequence[str]) -> nn.Module:
    """A fresh sharded model of ``spec``, built and wrapped as the trained one was (a LOCAL state
    dict loads only into the same units), its persistent buffers set to :data:`SENTINEL`."""
    model = build_pair(pair.ctx, spec, pair.version).sharded
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if clean_fqn(name) in persistent:
                buffer.fill_(SENTINEL)
    return model


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]


def _kind(
    pair: Pair, spec: ModelSpec, kind: str, persistent: list[str], non_persistent: list[str]
) -> KindBuffers:
    """One kind got from the trained model, and loaded into a fresh one where it loads."""
    rank = pair.ctx.rank
    state = get_state_dict(pair.sharded, pair.version, kind)
    judged = kind not in RANK0_ONLY or rank == 0
    got = {k: t for k in persistent if k in state and (t := local_tensor(state[k])) is not None}
    entry: KindBuffers = {
        "entries": len(state),
        "judged": judged,
        "got": compare_tensors(got, pair.reference.buffers(rank), persistent if judged else []),
        "non_persistent": [n for n in non_persistent if n in state],
        "loaded": None,
        "loaded_from": 0 if kind in BROADCAST_ON_LOAD else rank,
        "load_error": "",
    }
    if kind in GET_ONLY:
        return entry
    fresh = _fresh(pair, spec, persistent)
    try:
        load_state_dict(fresh, pair.version, kind, state)
    except (RuntimeError, ValueError, KeyError) as exc:  # every rank alike: reported, judged
        entry["load_error"] = _one_line(exc)
    expected = pair.reference.buffers(entry["loaded_from"])
    entry["loaded"] = compare_tensors(full_buffers(fresh), expected, persistent)
    return entry


def rank_buffers(
    ctx: RankContext,
    spec: ModelSpec,
    version: str = "fsdp1",
    fault: str | Sequence[str] | None = None,
) -> BuffersResult:
    """``STEPS`` plain steps; the buffers, then every kind got and loaded."""
    with FAULTS.inject(fault, ctx):
        pair = build_pair(ctx, spec, version, micro=STEPS)
        losses, ref_losses, observed = train_plain(pair, STEPS)
        persistent, non_persistent = _persistence(pair.reference.model)
        mine = pair.reference.buffers(ctx.rank)
        first = pair.reference.buffers(0)
        live = full_buffers(pair.sharded)
        return {
            **loop_result(pair, losses, ref_losses, observed),
            "persistent": persistent,
            "non_persistent": non_persistent,
            "live": compare_tensors(live, mine),
            "spread": _spread(live, [n for n in persistent if n in live]),
            "ref_spread": {n: max_abs_diff(mine[n], first[n]) for n in persistent},
            "kinds": {
                kind: _kind(pair, spec, kind, persistent, non_persistent) for kind in KINDS[version]
            },
        }


# --------------------------------------------------------------------------------------------
# The verdict
# --------------------------------------------------------------------------------------------


def _kind_problems(rank: int, kind: str, entry: KindBuffers, rtol: float) -> list[str]:
    label = f"rank {rank}: {kind} state dict"
    problems = []
    if not entry["judged"] and entry["entries"]:
        problems.append(f"{label}: {entry['entries']} entries from a rank-0-only getter")
    if entry["got"]["missing"]:
        problems.append(f"{label}: lacks persistent buffer(s) {listing(entry['got']['missing'])}")
    problems += comparison_problems(f"{label}'s buffers", {**entry["got"], "missing": []}, rtol)
    if entry["non_persistent"]:
        problems.append(
            f"{label}: carries non-persistent buffer(s) {listing(entry['non_persistent'])}, "
            "which torch's state_dict excludes"
        )
    if entry["load_error"]:
        problems.append(
            f"rank {rank}: loading the {kind} state dict into a fresh sharded model raised "
            f"{entry['load_error']}"
        )
    if entry["loaded"] is not None:
        problems += comparison_problems(
            f"rank {rank}: after loading the {kind} state dict into a fresh sharded model, its "
            f"buffers (expected rank {entry['loaded_from']}'s; {SENTINEL} where not restored)",
            entry["loaded"],
            rtol,
        )
    return problems


def _buffer_figures(values: Sequence[BuffersResult]) -> dict[str, Any]:
    first = values[0]
    spread = {n: max(v["spread"].get(n, 0.0) for v in values) for n in first["persistent"]}
    ref_spread = {n: max(v["ref_spread"].get(n, 0.0) for v in values) for n in first["persistent"]}
    return {
        **parity_figures(values),
        "persistent": len(first["persistent"]),
        "non_persistent": first["non_persistent"],
        "kinds": list(first["kinds"]),
        "rank_spread": max(spread.values(), default=0.0),
        "reference_spread": max(ref_spread.values(), default=0.0),
        "differ_between_ranks": sorted(n for n, s in spread.items() if s > 0),
        "buffer_rel_diff": max(v["live"]["max_rel"] for v in values),
        "broadcast_on_load": sorted(
            {k for v in values for k, e in v["kinds"].items() if e["loaded_from"] != v["rank"]}
        ),
    }


def verdict_buffers(values: Sequence[BuffersResult], params: Mapping[str, Any]) -> Verdict:
    """On every rank: the buffers after training are the reference's of that rank, every kind
    carries each persistent buffer with that value and no non-persistent one, and each loaded
    kind restores them in a fresh sharded model."""
    problems = parity_problems(values)
    rtol = tolerances(values)[0]
    failed: set[str] = set()
    for v in values:
        problems += comparison_problems(
            f"rank {v['rank']}: buffers after {STEPS} steps (against the reference's slice "
            f"{v['rank']})",
            v["live"],
            rtol,
        )
        for kind, entry in v["kinds"].items():
            found = _kind_problems(v["rank"], kind, entry, rtol)
            failed |= {kind} if found else set()
            problems += found
    figures = _buffer_figures(values)
    figures["failed_kinds"] = sorted(failed)
    data = {
        "persistent": values[0]["persistent"],
        "spread": {v["rank"]: v["spread"] for v in values},
    }
    what = (
        f"{figures['persistent']} persistent buffer(s) after {STEPS} steps, "
        f"{len(figures['kinds'])} state-dict kinds ({', '.join(figures['kinds'])})"
    )
    if problems:
        return failed_verdict(
            values,
            f"buffers ({what}) differ from the reference",
            problems,
            figures,
            data,
        )
    differ = figures["differ_between_ranks"]
    return Verdict(
        True,
        f"{what}: each rank's buffers equal the reference's slice buffers (worst "
        f"{figures['buffer_rel_diff']:.1e}); "
        + (
            f"never synchronised: {listing(differ)} differ between ranks by up to "
            f"{figures['rank_spread']:.2e} (the reference's slices: "
            f"{figures['reference_spread']:.2e}); "
            if differ
            else "the same on every rank; "
        )
        + "every kind carries every persistent buffer with its rank's value"
        + (
            f", none of the non-persistent {listing(figures['non_persistent'])}"
            if figures["non_persistent"]
            else ""
        )
        + "; loading each loaded kind into a fresh sharded model restores them"
        + (
            f" ({listing(figures['broadcast_on_load'])}: rank 0's on every rank, broadcast)"
            if figures["broadcast_on_load"]
            else ""
        )
        + parity_note(values),
        figures,
        data,
    )
