"""What the init claim's check families share: the model they run on, the faults their negative
controls inject, the reports their rank functions return, and how those become verdicts.

A failure inside torch never reaches the parent as a traceback: each rank turns it into one line
(:func:`describe_init_error`), the ranks agree on whether to go on (:func:`agree_on_failure`),
and a verdict names each distinct failure once with the ranks it happened on
(:func:`failed_on_ranks`). The weights every family compares come from
:func:`~fsdp_conformance.fsdp.meta_materialize.inspect_sharded`, judged by :func:`judge_no_meta` and
:func:`judge_weights`.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar, cast

import torch

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import Fault, FaultTable, patched
from fsdp_conformance.fsdp import meta_init, meta_materialize
from fsdp_conformance.fsdp.meta_init import (
    RESET_PARAMETERS,
    InitError,
    build_on_meta,
    check_initializable,
    init_contract,
    module_init_for,
    reference_model,
)
from fsdp_conformance.fsdp.meta_materialize import Ranked, ShardedReport
from fsdp_conformance.fsdp.model_init import MODEL_LEVEL
from fsdp_conformance.fsdp.tensors import listing
from fsdp_conformance.harness import RankContext, all_gather_objects
from fsdp_conformance.models.model_spec import ModelSpec, ModelSpecError
from fsdp_conformance.models.reference_models import LlamaConfig

#: A small model with every kind of state (norm weights, a non-persistent rotary buffer).
DEFAULT_SPEC = ModelSpec(
    reference="llama", config=LlamaConfig(num_layers=2, dim=32, num_heads=4, vocab_size=128)
)

#: What torch says when ``sync_module_states=True`` meets CPU tensors (FSDP1, by design).
SYNC_REFUSAL_SNIPPET = "requires them to be on GPU"


# --------------------------------------------------------------------------------------------
# Negative controls: each patches, for the duration, the step a user could get wrong
# --------------------------------------------------------------------------------------------


def _seeded_by_rank(ctx: RankContext) -> contextlib.AbstractContextManager[Any]:
    # meta_init looks module_seed up at call time: every module's init draws from seed + rank.
    return patched(
        meta_init, "module_seed", lambda original: lambda seed, fqn: original(seed + ctx.rank, fqn)
    )


def _on_device(ctx: RankContext) -> Any:
    def make(original: Any) -> Any:
        def build(self: ModelSpec, device: Any = None) -> Any:
            return original(self, ctx.device)

        return build

    return make


@contextlib.contextmanager
def _built_with_storage(ctx: RankContext) -> Iterator[None]:
    # Every ModelSpec.build lands on the compute device, and materialize (which looks
    # build_on_meta up at call time) takes the build as it is: meta_init's would refuse it.
    with (
        patched(ModelSpec, "build", _on_device(ctx)),
        patched(
            meta_materialize, "build_on_meta", lambda _: lambda spec: spec.instantiate(ctx.device)
        ),
    ):
        yield


def _without_sync(original: Any) -> Any:
    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **{**kwargs, "sync_module_states": False})

    return init


def _sync_left_off(ctx: RankContext) -> contextlib.AbstractContextManager[Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return patched(FSDP, "__init__", _without_sync)


def _sends_nothing(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def _broadcast_left_out(ctx: RankContext) -> Iterator[None]:
    # FSDP1's param_init_fn broadcasts with torch.distributed.broadcast; FSDP2 loads rank 0's
    # full state dict with set_model_state_dict: both looked up at call time, both do nothing.
    import torch.distributed.checkpoint.state_dict as dcp_state_dict

    with (
        patched(torch.distributed, "broadcast", lambda _: _sends_nothing),
        patched(dcp_state_dict, "set_model_state_dict", lambda _: _sends_nothing),
    ):
        yield


def _one_tensor_rescaled(ctx: RankContext) -> contextlib.AbstractContextManager[Any]:
    # meta_init looks full_module_state up at call time: the first module whose init draws a
    # random floating tensor gets that tensor at three times its scale (an --init-fn with one
    # std wrong). Every other tensor keeps its values.
    done: list[str] = []

    def make(original: Any) -> Any:
        def full(module: Any, fqn: str, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
            state: dict[str, torch.Tensor] = original(module, fqn, *args, **kwargs)
            for name, t in state.items():
                if not done and t.is_floating_point() and t.numel() > 1 and float(t.std()) > 0:
                    t.mul_(3)
                    done.append(f"{fqn}.{name}")
            return state

        return full

    return patched(meta_init, "full_module_state", make)


#: The init claim's negative controls (``fault=`` of the rank functions that take one).
FAULTS = FaultTable(
    ranks_seeded_differently=Fault(
        "every rank seeds its modules' deterministic init with its own seed (seed + rank)",
        _seeded_by_rank,
    ),
    eager_build=Fault(
        "the model is built with storage on the compute device instead of on meta",
        _built_with_storage,
    ),
    sync_off=Fault("FSDP1 wraps without sync_module_states", _sync_left_off),
    no_broadcast=Fault(
        "rank 0's weights are never sent: the broadcast and set_model_state_dict do nothing",
        _broadcast_left_out,
    ),
    one_tensor_rescaled=Fault(
        "the meta init gives one random tensor (the first it draws) three times its scale",
        _one_tensor_rescaled,
    ),
)


# --------------------------------------------------------------------------------------------
# The reports
# --------------------------------------------------------------------------------------------


class Failure(Ranked, total=False):
    """What a rank reports when the init failed: its one-line finding and every rank's."""

    error: str | None
    errors: list[str | None] | None
    device_type: str


_Report = TypeVar("_Report", bound=Failure)


def preflight_failure(report: type[_Report], ctx: RankContext, error: str) -> _Report:
    """What a rank reports, as a ``report`` (a :class:`Failure` with optional keys only), when
    the preflight stopped the check before any build: the same finding for every rank (each rank
    ran the same preflight on the same spec)."""
    return report(
        rank=ctx.rank, error=error, errors=[error] * ctx.world_size, device_type=ctx.device_type
    )


class InitReport(ShardedReport, Failure, total=False):
    """A sharded, materialized model inspected against the reference (or the failure)."""

    method: str
    version: str
    #: sync_module_states: torch's refusal on CPU; whether the option was given.
    refusal: str | None
    sync: bool
    #: broadcast_rank0: whether rank 0's full state dict was changed in place (FSDP2).
    broadcast: bool
    dict_mutated: bool | None
    #: A model-level init, in words ("the model's init_weights()"), when it is the model's.
    model_init: str | None


def init_report(sharded: ShardedReport) -> InitReport:
    """The inspection as the start of a family's report (the same dict, its keys to be added)."""
    # An InitReport is a ShardedReport plus keys that are all optional: mypy cannot widen a
    # TypedDict to a subtype, but every ShardedReport already is a valid InitReport.
    return cast(InitReport, sharded)


# --------------------------------------------------------------------------------------------
# Findings: what torch raised, in one line
# --------------------------------------------------------------------------------------------


_FINDINGS = (
    (
        ("Inconsistent compute device", "meta"),
        "the param_init_fn left the module's parameters on meta, so FSDP1 refused it ({msg}); "
        "the param_init_fn must call module.to_empty(device=..., recurse=False) before "
        "initializing (the seeds' materialization_fn never does)",
    ),
    (
        ("should be materialized from meta device",),
        "the sharded parameters were still on meta at the first forward ({msg}); call "
        "model.to_empty(device=...) after fully_shard, then initialize",
    ),
    (
        ("Cannot copy out of meta tensor",),
        "a tensor (often a buffer) was left on meta and failed at forward ({msg}); materialize "
        "buffers too (to_empty covers them)",
    ),
    (
        (SYNC_REFUSAL_SNIPPET,),
        "torch refuses sync_module_states=True with CPU tensors ({msg}); on CPU broadcast from "
        "rank 0 explicitly instead",
    ),
)


def describe_init_error(exc: BaseException) -> str:
    """One line a person can act on, instead of a traceback from inside torch."""
    if isinstance(exc, (InitError, ModelSpecError)):
        return str(exc)  # ours: already names the module (or the factory) and the fix
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    msg = f"{type(exc).__name__}: {first}"
    for needles, text in _FINDINGS:
        if all(n in str(exc) for n in needles):
            return text.format(msg=msg)
    return msg


def model_level(spec: ModelSpec) -> bool:
    """Whether ``spec``'s model is initialized by a model-level init (``init_weights()``, or
    ``--model-init``) rather than per module."""
    return init_contract(spec, build_on_meta(spec).model) in MODEL_LEVEL


def preflight(spec: ModelSpec) -> str | None:
    """Why ``spec``'s model cannot be meta-initialized at all (None: it can): one finding
    instead of a traceback, the same on every rank.

    The reset_parameters() contract is checked by looking at the modules; an init function,
    a model-level init or transformers' ``_init_weights`` only by running it, on the
    reference, so that the finding names every tensor it leaves uninitialized (FSDP1's
    param_init_fn stops at the first).
    """
    try:
        model = build_on_meta(spec).model
        if init_contract(spec, model) in MODEL_LEVEL:
            reference_model(spec, 0)
            return None
        init = module_init_for(spec, model)
        check_initializable(model, init)
        if init is not RESET_PARAMETERS:
            reference_model(spec, 0)
    except ValueError as exc:  # InitError, ModelSpecError, PolicyError: messages say the fix
        return str(exc)
    return None


def agree_on_failure(ctx: RankContext, error: str | None) -> list[str | None]:
    """Every rank's error (or None): all ranks decide together whether to go on."""
    if ctx.world_size == 1:
        return [error]
    return all_gather_objects(error, ctx.device_type)


def rank_errors(values: Sequence[Failure]) -> str | None:
    """One line per distinct failure, with the ranks it happened on (None: no failure)."""
    errors = next((v["errors"] for v in values if v.get("errors")), None)
    if not errors or not any(errors):
        return None
    by_message: dict[str, list[int]] = {}
    for rank, error in enumerate(errors):
        if error:
            # "on rank 1" inside torch's message would split one finding into N.
            by_message.setdefault(re.sub(r"rank \d+", "rank N", error), []).append(rank)
    return "; ".join(
        f"{'all ranks' if len(r) == len(errors) else 'ranks ' + str(r)}: {m}"
        for m, r in by_message.items()
    )


def failed_on_ranks(values: Sequence[Failure]) -> Verdict | None:
    """The failed verdict when a rank reported errors instead of values (None when none did)."""
    error = rank_errors(values)
    return Verdict(False, error, {"error": error}) if error else None


# --------------------------------------------------------------------------------------------
# Judging the inspected weights (init.no_meta, init.weights and the checks built on them)
# --------------------------------------------------------------------------------------------


def _no_meta_problems(v: InitReport) -> list[str]:
    """One rank's tensors left on meta, on another device, uninitialized or wrong."""
    r = v["rank"]
    problems = []
    if v["on_meta"]:
        problems.append(f"rank {r}: still on meta: {listing(v['on_meta'], 6)}")
    if v["wrong_device"]:
        problems.append(f"rank {r}: not on {v['device']}: {listing(v['wrong_device'], 6)}")
    if v.get("uninitialized"):
        problems.append(
            f"rank {r}: never initialized by the init (to_empty memory): "
            f"{listing(v['uninitialized'], 6)}"
        )
    if v.get("full_mismatch"):
        problems.append(
            f"rank {r}: values differ from the reference: {listing(v['full_mismatch'], 6)}"
        )
    if v.get("missing"):
        problems.append(f"rank {r}: missing from the model: {listing(v['missing'], 6)}")
    return problems


def judge_no_meta(values: Sequence[InitReport]) -> Verdict:
    """Every tensor on the compute device, with values (= the reference's), on every rank."""
    failed = failed_on_ranks(values)
    if failed:
        return failed
    problems = [p for v in values for p in _no_meta_problems(v)]
    figures = {"ranks": len(values)}
    if problems:
        return Verdict(
            False,
            "not every tensor is materialized and initialized:\n  " + "\n  ".join(problems),
            figures,
            {"ranks": list(values)},
        )
    return Verdict(
        True,
        f"every parameter and buffer on {values[0]['device'].split(':')[0]} and equal to the "
        f"reference on all {len(values)} ranks",
        figures,
    )


def _weights_problems(v: InitReport) -> list[str]:
    """One rank's shards or gathered weights that differ from the reference."""
    r = v["rank"]
    if v["on_meta"]:
        # Nothing to compare on meta: the values below would only repeat the finding.
        return [f"rank {r}: still on meta: {listing(v['on_meta'], 6)}"]
    problems = []
    if v["local_mismatch"]:
        problems.append(
            f"rank {r}: local shards differ from the reference's slices: "
            f"{listing(v['local_mismatch'], 6)}"
        )
    bad = v["full_mismatch"] + v["uninitialized"]
    if bad:
        problems.append(f"rank {r}: gathered weights differ from the reference: {listing(bad, 6)}")
    return problems


def _reference_differs(values: Sequence[InitReport]) -> list[str]:
    """The init, run unsharded from the same seed on every rank, must give one model: a rank
    whose reference differs draws from a rank-dependent seed or generator."""
    digests = {v["rank"]: (v.get("reference_digest") or "")[:16] for v in values}
    if len(set(digests.values())) < 2:
        return []
    each = ", ".join(f"rank {r} {d}" for r, d in sorted(digests.items()))
    return [
        f"the init gives a different model on each rank (run unsharded from the same seed on "
        f"every rank, digests {each}): it draws from a rank-dependent seed or generator; seed "
        "it the same on every rank"
    ]


def judge_weights(values: Sequence[InitReport]) -> Verdict:
    """Local shards = slices of the reference; gathered = the reference; on every rank; and
    the reference itself (the init run unsharded) the same on every rank."""
    failed = failed_on_ranks(values)
    if failed:
        return failed
    problems = _reference_differs(values) + [p for v in values for p in _weights_problems(v)]
    digests: list[str] = sorted({v["digest"] for v in values if v.get("digest")})
    figures = {
        "digest": digests[0][:16] if len(digests) == 1 else "differs",
        "reference_digest": (values[0].get("reference_digest") or "")[:16],
        "ranks": len(values),
    }
    if problems:
        return Verdict(
            False,
            "weights do not match the single-process reference built from the same seed:\n  "
            + "\n  ".join(problems),
            figures,
            {"ranks": list(values)},
        )
    drawn = values[0].get("by_distribution") or 0
    how = (
        f"; {drawn} tensor(s) the init draws at random match its distribution instead, which "
        "FSDP2 draws per shard (no offset RNG on a CPU mesh), the others equal it"
        if drawn
        else ""
    )
    init = values[0].get("model_init")
    return Verdict(
        True,
        f"every rank's shards and the gathered weights equal the reference "
        f"(digest {figures['digest']}) on {len(values)} ranks"
        + (f" (the model-level init, {init}, run after sharding)" if init else "")
        + how,
        figures,
        {"digest": digests[0]},
    )
