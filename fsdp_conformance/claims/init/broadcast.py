"""``init.sync_module_states`` and ``init.broadcast_rank0``: rank 0's weights on every rank.

Ranks first initialize with different seeds (``rank_seed_offset``), so only a working
synchronization gives every rank the reference built from ``seed`` (rank 0's). FSDP1's
``sync_module_states=True`` is refused on CPU (a conformance fact); its CPU-capable equivalents
are an explicit broadcast in FSDP1's ``param_init_fn`` and FSDP2's ``set_model_state_dict`` with
``broadcast_from_rank0=True``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.init.common import (
    DEFAULT_SPEC,
    FAULTS,
    SYNC_REFUSAL_SNIPPET,
    InitReport,
    agree_on_failure,
    describe_init_error,
    init_report,
    judge_weights,
    model_level,
    preflight,
    preflight_failure,
    rank_errors,
)
from fsdp_conformance.fsdp.meta_init import (
    DeterministicParamInit,
    build_on_meta,
    module_init_for,
    reference_model,
)
from fsdp_conformance.fsdp.meta_materialize import inspect_sharded, materialize
from fsdp_conformance.fsdp.sharding import shard_fsdp1
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.models.model_spec import ModelSpec

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import ValueType


def require_a_receiver(ctx: RankContext, what: str) -> None:
    """Skip (on every rank alike) where rank 0 has no one to send its weights to.

    At world size 1 rank 0's weights are every rank's weights with or without ``what``: the
    check would pass without proving anything (a one-GPU machine runs the GPU lane at world
    size 1). On CPU FSDP1's refusal of ``sync_module_states`` is still a fact at any size.
    """
    if ctx.world_size == 1:
        skip_rank(
            f"at world size 1 there is no other rank to receive rank 0's weights: "
            f"{what} cannot be told from its absence; run at world size >= 2 (two "
            "devices on the GPU lane)"
        )


# --------------------------------------------------------------------------------------------
# init.sync_module_states
# --------------------------------------------------------------------------------------------


def rank_sync_module_states(
    ctx: RankContext,
    spec: ModelSpec = DEFAULT_SPEC,
    seed: int = 0,
    rank_seed_offset: int = 1000,
    fault: str | Sequence[str] | None = None,
) -> InitReport:
    """FSDP1 ``sync_module_states``: ranks initialize differently; rank 0 should win.

    On CPU torch refuses the option; the refusal is returned as data. ``fault``: a negative
    control applied to the sharding (``sync_off``: the option left off).
    """
    if ctx.device_type != "cpu":
        require_a_receiver(ctx, "sync_module_states")
    skip_if_model_level(spec, "FSDP1's sync_module_states")
    failed = preflight(spec)
    if failed:
        return preflight_failure(InitReport, ctx, failed)
    my_seed = seed + ctx.rank * rank_seed_offset
    built = build_on_meta(spec)
    init = DeterministicParamInit(
        built.model, ctx.device, my_seed, init=module_init_for(spec, built.model)
    )
    error, refusal = None, None
    with FAULTS.inject(fault, ctx) as injected:
        try:
            model = shard_fsdp1(
                built.model,
                ctx,
                built.policy("recommended"),
                param_init_fn=init,
                sync_module_states=True,
            )
        except ValueError as exc:
            if SYNC_REFUSAL_SNIPPET in str(exc):
                refusal = str(exc)
            else:
                error = describe_init_error(exc)
    errors = agree_on_failure(ctx, error or refusal)
    if any(errors):
        return {
            "rank": ctx.rank,
            "device_type": ctx.device_type,
            "refusal": refusal,
            "error": error,
            "errors": errors if error else None,
        }
    report = init_report(inspect_sharded(model, reference_model(spec, seed), ctx, "fsdp1"))
    report.update(
        {
            "device_type": ctx.device_type,
            "refusal": None,
            "error": None,
            "sync": "sync_off" not in injected,
        }
    )
    return report


def verdict_sync_module_states(values: Sequence[InitReport], params: Mapping[str, Any]) -> Verdict:
    """CPU: torch's refusal, on every rank, is the expected fact. GPU: rank 0's weights win."""
    if any(v.get("error") for v in values):
        error = rank_errors(values) or "a rank failed"
        return Verdict(False, error, {"error": error})
    if values[0]["device_type"] == "cpu":
        return _judge_on_cpu(values)
    verdict = judge_weights(values)
    if not verdict.passed:
        return Verdict(
            False,
            "rank 0's weights did not reach every rank: " + verdict.message,
            verdict.figures,
            verdict.data,
        )
    return Verdict(
        True,
        "sync_module_states=True: rank 0's weights reached every rank; " + verdict.message,
        verdict.figures,
        verdict.data,
    )


def _judge_on_cpu(values: Sequence[InitReport]) -> Verdict:
    refused = [v for v in values if v.get("refusal")]
    if len(refused) == len(values):
        message = cast(str, refused[0]["refusal"]).splitlines()[0]
        return Verdict(
            True,
            f"conformance fact: torch refuses sync_module_states=True on CPU on all "
            f"{len(values)} ranks: {message!r}",
            {"refused": True},
            {"refusal": message},
        )
    weights = judge_weights(values)
    if not values[0].get("sync", True):
        return Verdict(
            False,
            "sync_module_states was off: nothing refused and nothing "
            f"synchronized; the weights: {weights.message}",
            {"refused": False},
        )
    return Verdict(
        False,
        "torch no longer refuses sync_module_states=True on CPU (a change since 2.13: "
        f"update the conformance fact); the weights then: {weights.message}",
        {"refused": False},
    )


# --------------------------------------------------------------------------------------------
# init.broadcast_rank0
# --------------------------------------------------------------------------------------------


def rank_broadcast_rank0(
    ctx: RankContext,
    spec: ModelSpec = DEFAULT_SPEC,
    version: str = "fsdp2",
    seed: int = 0,
    rank_seed_offset: int = 1000,
    fault: str | Sequence[str] | None = None,
) -> InitReport:
    """The CPU-capable equivalents of ``sync_module_states``: rank 0's weights to every rank.

    FSDP2: ``set_model_state_dict(..., StateDictOptions(full_state_dict=True,
    broadcast_from_rank0=True))`` with rank 0's full state dict (the others pass ``{}``).
    FSDP1: a ``param_init_fn`` that broadcasts each module's state from rank 0 before FSDP1
    shards it. Ranks first initialize with different seeds, so only a working broadcast gives
    every rank the reference (built from ``seed``, rank 0's). ``fault``: a negative control
    applied to the build and the broadcast (``no_broadcast``: nothing is sent).
    """
    require_a_receiver(ctx, "the broadcast from rank 0")
    if version == "fsdp1":
        skip_if_model_level(spec, "FSDP1's broadcast from rank 0 in param_init_fn")
    failed = preflight(spec)
    if failed:
        return preflight_failure(InitReport, ctx, failed)
    my_seed = seed + ctx.rank * rank_seed_offset
    mutated = None
    with FAULTS.inject(fault, ctx) as injected:
        if version == "fsdp1":
            model = _fsdp1_broadcasting(ctx, spec, my_seed)
        else:
            model = materialize(ctx, spec, "fsdp2", "deterministic", my_seed)
            mutated = _load_rank0_state(ctx, spec, seed, model)
    report = init_report(inspect_sharded(model, reference_model(spec, seed), ctx, version))
    report.update(
        {
            "error": None,
            "version": version,
            "broadcast": "no_broadcast" not in injected,
            "dict_mutated": mutated,
        }
    )
    return report


def skip_if_model_level(spec: ModelSpec, what: str) -> None:
    """Skip (every rank alike) a check of FSDP1's per-module ``param_init_fn`` on a model whose
    init runs once on the whole model after wrapping."""
    if model_level(spec):
        skip_rank(
            f"{what} sends rank 0's values module by module from FSDP1's param_init_fn, and "
            f"{spec.name} is initialized by a model-level init after wrapping: rank 0's weights "
            "reach every rank there with set_model_state_dict(broadcast_from_rank0=True), which "
            "init.broadcast_rank0 checks on FSDP2"
        )


def _fsdp1_broadcasting(ctx: RankContext, spec: ModelSpec, seed: int) -> torch.nn.Module:
    """FSDP1 with a ``param_init_fn`` that broadcasts each module's state from rank 0."""
    built = build_on_meta(spec)
    init = DeterministicParamInit(
        built.model, ctx.device, seed, broadcast_from=0, init=module_init_for(spec, built.model)
    )
    return shard_fsdp1(built.model, ctx, built.policy("recommended"), param_init_fn=init)


def _load_rank0_state(ctx: RankContext, spec: ModelSpec, seed: int, model: torch.nn.Module) -> bool:
    """FSDP2: rank 0's full state dict, broadcast by ``set_model_state_dict``; whether rank 0's
    dict was changed in place."""
    # Looked up at call time: the no_broadcast fault replaces it.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full: dict[str, torch.Tensor] = {}
    if ctx.rank == 0:
        full = {k: v.to(ctx.device) for k, v in reference_model(spec, seed).state_dict().items()}
    before = {k: (id(v), v.data_ptr()) for k, v in full.items()}
    set_model_state_dict(
        model,
        cast("dict[str, ValueType]", full),  # dict is invariant in its values
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    # Rank 0's dict is mutated in place (its values replaced by the model's own
    # tensors): a caller must not reuse it as "the checkpoint". Recorded per rank.
    return set(before) != set(full) or any(
        (id(v), v.data_ptr()) != before[k] for k, v in full.items()
    )


def verdict_broadcast_rank0(values: Sequence[InitReport], params: Mapping[str, Any]) -> Verdict:
    """Every rank holds rank 0's weights: its shards and the gathered weights equal the
    reference built from rank 0's seed."""
    return judge_weights(values)
