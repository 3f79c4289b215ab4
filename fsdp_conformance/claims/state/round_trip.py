"""``state.round_trip``: every state-dict kind torch offers, got from one sharded model and
loaded into another, against the single-process reference, bitwise (docs/state.md).

The rank function builds the model twice under different seeds and shards both the way a user
does (``sharding.shard`` with the recommended policy). For each kind it takes the first model's
state dict, loads it into the second, and reports a digest of every tensor of the second model's
full state dict afterwards; for the full kinds, also of the dict it got. The parent builds the
reference (the same seed, one process, ``state_dict()``) and compares every tensor bitwise: a
kind whose load leaves any value other than the reference's fails, naming the tensor. Observed,
not configured: what each getter returned (how many entries, which tensor types, on which
device) is recorded per rank, and a rank-0-only getter that hands a non-zero rank a state dict
fails.

Kinds (``KINDS``): FSDP1 ``FULL_STATE_DICT`` (``offload_to_cpu`` on GPU, ``rank0_only`` off),
``FULL_STATE_DICT`` with ``rank0_only`` (getter only: FSDP1 loads a full state dict on every
rank), ``SHARDED_STATE_DICT``, ``LOCAL_STATE_DICT``; FSDP2 ``get_model_state_dict`` /
``set_model_state_dict`` with ``StateDictOptions`` full (``cpu_offload`` on, so rank 0 alone
holds it, loaded with ``broadcast_from_rank0``), full on every rank, and sharded (DTensors).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict

from torch import nn

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import Fault, FaultTable, patched_attr
from fsdp_conformance.claims.state.common import (
    DEFAULT_SPEC,
    FULL,
    Digests,
    build_sharded,
    differences,
    digests,
    perturb_values,
    reference_digests,
    section,
)
from fsdp_conformance.fsdp.sharding import check_fsdp_version
from fsdp_conformance.fsdp.state_dict_kinds import (
    GET_ONLY,
    KINDS,
    RANK0_ONLY,
    get_state,
    set_state,
)
from fsdp_conformance.fsdp.tensors import local_tensor
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models.model_spec import ModelSpec


class Description(TypedDict):
    """What a getter returned (:func:`describe`)."""

    entries: int
    types: list[str]
    devices: list[str]


def describe(state: Mapping[str, Any]) -> Description:
    """What a getter returned: entries, tensor types and devices (observed, for the report)."""
    types = sorted({type(v).__name__ for v in state.values()})
    devices = sorted({str(t.device) for v in state.values() if (t := local_tensor(v)) is not None})
    return {"entries": len(state), "types": types, "devices": devices}


class _Got(TypedDict):
    got: Description


class KindResult(_Got, total=False):
    """One kind on one rank: what its getter returned (``got``), and the digests taken."""

    #: The dict as got (a full kind, where this rank got one).
    got_digests: Digests
    #: The full state of the model the dict was loaded into (a kind that is loaded).
    loaded_digests: Digests


class RoundTripResult(TypedDict):
    """:func:`rank_round_trip`'s result on one rank."""

    rank: int
    version: str
    kinds: dict[str, KindResult]


def _value_changed_before_loading(ctx: RankContext) -> contextlib.AbstractContextManager[Any]:
    def make(load: Callable[..., None]) -> Callable[..., None]:
        def changed(model: nn.Module, version: str, kind: str, state: dict[str, Any]) -> None:
            # A full dict is the checkpoint itself: wrong on every rank that holds one. A sharded
            # or local dict: rank 0's shard alone is wrong.
            if kind in FULL or ctx.rank == 0:
                perturb_values(state)
            load(model, version, kind, state)

        return changed

    return patched_attr(__name__, "set_state", make)


#: The negative controls of this family: the user's load (``set_state``, this module's name).
FAULTS = FaultTable(
    value_changed_before_loading=Fault(
        "one value of each state dict changed before it is loaded: in a full dict on every rank "
        "that holds one, in a sharded or local dict in rank 0's shard (state.round_trip)",
        _value_changed_before_loading,
    ),
)


def rank_round_trip(
    ctx: RankContext,
    spec: ModelSpec = DEFAULT_SPEC,
    version: str = "fsdp2",
    seed: int = 0,
    fault: str | Sequence[str] | None = None,
) -> RoundTripResult:
    """Every state-dict kind of ``version``: got from one sharded model, loaded into another.

    ``fault``: the negative controls of :data:`FAULTS`
    (``value_changed_before_loading``)."""
    check_fsdp_version(version)
    with FAULTS.inject(fault, ctx):
        source = build_sharded(ctx, spec, version, seed)
        kinds: dict[str, KindResult] = {}
        for kind in KINDS[version]:
            state = get_state(source, version, kind)
            entry: KindResult = {"got": describe(state)}
            if kind in FULL and state:
                entry["got_digests"] = digests(state)
            if kind not in GET_ONLY:
                target = build_sharded(ctx, spec, version, seed + 1)
                set_state(target, version, kind, state)  # the user's load: a fault's step
                entry["loaded_digests"] = digests(get_state(target, version, "full"))
            kinds[kind] = entry
    return {"rank": ctx.rank, "version": version, "kinds": kinds}


def _judge_rank(value: RoundTripResult, expected: Digests) -> dict[str, list[str]]:
    """Per kind, what differs from the reference on this rank (empty: the kind is right)."""
    rank = value["rank"]
    problems: dict[str, list[str]] = {}
    for kind, entry in value["kinds"].items():
        lines = []
        if kind in RANK0_ONLY and rank != 0 and entry["got"]["entries"]:
            lines.append(
                f"rank {rank} got {entry['got']['entries']} entries from a rank-0-only "
                "getter (expected none)"
            )
        if "got_digests" in entry:
            lines += [f"as got: {d}" for d in differences(expected, entry["got_digests"])]
        elif kind in FULL and (kind not in RANK0_ONLY or rank == 0):
            lines.append(f"rank {rank} got an empty full state dict")
        if "loaded_digests" in entry:
            lines += [f"after loading: {d}" for d in differences(expected, entry["loaded_digests"])]
        problems[kind] = lines
    return problems


def verdict_round_trip(values: Sequence[RoundTripResult], params: Mapping[str, Any]) -> Verdict:
    """Every kind, on every rank: the dict got and the model loaded from it equal the reference,
    tensor by tensor, bitwise."""
    spec = params.get("spec", DEFAULT_SPEC)
    version = params.get("version", "fsdp2")
    expected = reference_digests(spec, params.get("seed", 0))
    per_rank = {v["rank"]: _judge_rank(v, expected) for v in values}
    kinds = list(values[0]["kinds"])
    tree: list[str] = []
    bad: list[str] = []
    for kind in kinds:
        wrong = {r: p[kind] for r, p in per_rank.items() if p.get(kind)}
        loaded = "loaded" if kind not in GET_ONLY else "got only"
        tree += section(f"{kind} ({loaded})", "ok", wrong)
        bad += [kind] if wrong else []
    got = {kind: values[0]["kinds"][kind]["got"] for kind in kinds}
    figures = {"kinds": kinds, "tensors": len(expected), "failed_kinds": sorted(set(bad))}
    head = (
        f"{version} {spec.name}: {len(kinds)} state-dict kind(s), {len(expected)} tensors, "
        f"against the single-process reference, bitwise, on all {len(values)} ranks"
    )
    return Verdict(not bad, head + ":\n" + "\n".join(tree), figures, {"got_rank0": got})
