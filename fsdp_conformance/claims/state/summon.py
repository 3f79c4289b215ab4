"""``state.summon`` and ``state.summon.rank0_discard``: FSDP1's ``summon_full_params``, what a
rank sees inside and what writeback keeps, against the single-process reference, bitwise
(docs/state.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict, cast

import torch
from torch import nn

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import Fault, FaultEffect, FaultTable, patched_attr
from fsdp_conformance.claims.state.common import (
    DEFAULT_SPEC,
    Digests,
    build,
    build_sharded,
    differences,
    digests,
    section,
)
from fsdp_conformance.fsdp.sharding import check_fsdp_version, shard
from fsdp_conformance.fsdp.state_dict_kinds import (
    get_state,
    offload_to_cpu,
)
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.units import clean_fqn

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


class SummonCase(TypedDict):
    """A :data:`SUMMON_CASES` case on one rank."""

    #: The parameters' digests inside the context (by parameter name).
    inside: Digests
    #: The model's full state after the context.
    after: Digests
    #: The parameter changed inside (None: the case changes none).
    changed: str | None


class SummonedGrads(TypedDict):
    """The :data:`SUMMON_GRADS` case on one rank (:func:`_summoned_grads`)."""

    #: Per parameter, the largest absolute difference from the reference's gradient.
    grad_diffs: dict[str, float]
    #: Parameters without a whole gradient inside the context.
    missing: list[str]
    #: The reference's largest gradient (absolute).
    scale: float
    #: Whether the context was entered with ``with_grads=True``.
    with_grads: bool


class SummonResult(TypedDict):
    """:func:`rank_summon`'s result on one rank: each case's, in the order run."""

    rank: int
    cases: dict[str, SummonCase | SummonedGrads]


def aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every parameter name of ``model`` -> every name of the same tensor, itself included (a
    tied weight or bias has several: GPT-2's head and embedding, BERT's decoder bias and
    ``cls.predictions.bias``). A check that changes a parameter expects the change under each of
    them: FSDP changes the one tensor, so every alias shows it."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {name: group for group in names.values() for name in group}


def summon_options(case: str, model: nn.Module) -> dict[str, Any]:
    """The options the user passes to ``FSDP.summon_full_params`` in ``case`` (a fault's step):
    ``offload_to_cpu`` where the parameters are on a GPU, as users call it; the gradients' case
    after a backward, ``with_grads=True`` (which needs ``use_orig_params=True``)."""
    if case == SUMMON_GRADS:
        return {"with_grads": True, "writeback": False}
    writeback, rank0_only, _ = SUMMON_CASES[case]
    return {
        "writeback": writeback,
        "rank0_only": rank0_only,
        "offload_to_cpu": offload_to_cpu(model),
    }


def _summoned_with(option: str) -> FaultEffect:
    """An effect: :func:`summon_options` with ``option`` False in every case that sets it."""

    def effect(ctx: RankContext) -> contextlib.AbstractContextManager[Any]:
        def make(
            options: Callable[[str, nn.Module], dict[str, Any]],
        ) -> Callable[[str, nn.Module], dict[str, Any]]:
            def without(case: str, model: nn.Module) -> dict[str, Any]:
                given = options(case, model)
                return {**given, option: False} if option in given else given

            return without

        return patched_attr(__name__, "summon_options", make)

    return effect


#: The negative controls of this family: the user's options (:func:`summon_options`) wrong.
FAULTS = FaultTable(
    writeback_ignored=Fault(
        "summon_full_params called with writeback=False in the case that asks for writeback "
        "(state.summon)",
        _summoned_with("writeback"),
    ),
    grads_not_summoned=Fault(
        "summon_full_params called without with_grads=True after the backward (state.summon)",
        _summoned_with("with_grads"),
    ),
)


def rank_summon(
    ctx: RankContext,
    spec: ModelSpec = DEFAULT_SPEC,
    version: str = "fsdp1",
    seed: int = 0,
    cases: Sequence[str] = SUMMON_DEFAULT_CASES,
    fault: str | Sequence[str] | None = None,
) -> SummonResult:
    """Per case of :data:`SUMMON_CASES` in ``cases``: the full parameters a rank sees inside
    ``FSDP.summon_full_params`` (their digests, where it holds them whole), then, where the
    case writes, one parameter changed inside on every rank, and the model's full state after
    the context (the options: :func:`summon_options`).

    With ``rank0_only`` the other ranks hold their shards inside: ``rank0_only_write`` changes
    the first parameter every rank holds (whole on rank 0, a shard elsewhere), and
    ``writeback=False`` says the change is discarded (measured otherwise: docs/state.md).
    :data:`SUMMON_GRADS`: the gradients inside after a backward (:func:`_summoned_grads`).
    ``fault``: the negative controls of :data:`FAULTS`
    (``writeback_ignored``, ``grads_not_summoned``)."""
    check_fsdp_version(version)
    if version != "fsdp1":
        raise ValueError("summon_full_params is FSDP1's; FSDP2 has no such context")
    out: dict[str, SummonCase | SummonedGrads] = {}
    with FAULTS.inject(fault, ctx):
        for label in cases:
            out[label] = (
                _summoned_grads(ctx, spec, seed)
                if label == SUMMON_GRADS
                else _summoned_params(ctx, spec, seed, label)
            )
    return {"rank": ctx.rank, "cases": out}


def _summoned_params(ctx: RankContext, spec: ModelSpec, seed: int, label: str) -> SummonCase:
    """A :data:`SUMMON_CASES` case: the parameters inside, a change, the state after."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    _, _, write = SUMMON_CASES[label]
    model = build_sharded(ctx, spec, "fsdp1", seed)
    with FSDP.summon_full_params(model, **summon_options(label, model)):
        inside = dict(model.named_parameters())  # one name per tensor: a tie is changed once
        seen = digests(inside)
        changed = sorted(inside)[0] if write else None
        if changed is not None:
            with torch.no_grad():
                inside[changed].add_(WRITE_DELTA)
    after = digests(get_state(model, "fsdp1", "full"))
    return {"inside": seen, "after": after, "changed": changed}


def _summoned_grads(ctx: RankContext, spec: ModelSpec, seed: int) -> SummonedGrads:
    """One backward of the same batch on every rank under FSDP1 (``use_orig_params=True``, which
    ``with_grads`` needs) and on this rank's single-process copy of the model; inside
    ``summon_full_params`` each parameter's gradient against the copy's: the largest absolute
    difference, the reference's largest gradient, and the names with none."""
    import copy

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from fsdp_conformance.fsdp.determinism import disable_dropout
    from fsdp_conformance.models.model_spec import call_model, default_loss

    torch.manual_seed(seed)
    built = spec.instantiate(ctx.device)
    model = built.model
    disable_dropout(model)  # the two backwards must compute the same function (docs/state.md)
    reference = copy.deepcopy(model)
    sharded = shard(model, ctx, "fsdp1", built.policy("recommended"), use_orig_params=True)
    batch = spec.batch(reference, 2, ctx.device)
    default_loss(call_model(sharded, batch)).backward()
    default_loss(call_model(reference, batch)).backward()
    want = {  # under every alias: the sharded model may name a tied tensor by another one
        n: p.grad
        for n, p in reference.named_parameters(remove_duplicate=False)
        if p.grad is not None
    }
    diffs, missing = {}, []
    options = summon_options(SUMMON_GRADS, sharded)
    with FSDP.summon_full_params(sharded, **options):
        for name, p in sharded.named_parameters():
            key, grad = clean_fqn(name), p.grad
            if key not in want and (grad is None or not bool(grad.any())):
                continue  # a frozen parameter: none in the reference, none or zeros here
            if grad is None or key not in want or grad.shape != want[key].shape:
                missing.append(key)
                continue
            diffs[key] = float((grad.detach().float() - want[key].float()).abs().max())
    scale = max((float(g.abs().max()) for g in want.values()), default=0.0)
    return {
        "grad_diffs": diffs,
        "missing": sorted(missing),
        "scale": scale,
        "with_grads": bool(options.get("with_grads", False)),
    }


def _judge_summoned_grads(values: Sequence[SummonResult]) -> tuple[dict[int, list[str]], str]:
    """The :data:`SUMMON_GRADS` case: each rank's problems, and the line for none."""
    wrong: dict[int, list[str]] = {}
    grads = [(v["rank"], cast(SummonedGrads, v["cases"][SUMMON_GRADS])) for v in values]
    for rank, case in grads:
        limit = SUMMON_GRAD_RTOL * case["scale"]
        lines = [f"{name}: no whole gradient inside the context" for name in case["missing"]]
        lines += [
            f"{name}: gradient differs from the reference's by {d:.3g} > {limit:.3g}"
            for name, d in sorted(case["grad_diffs"].items())
            if d > limit
        ]
        if not case["with_grads"]:
            lines.insert(0, "summoned without with_grads=True (the negative control)")
        if lines:
            wrong[rank] = lines
    worst = max((max(case["grad_diffs"].values(), default=0.0) for _, case in grads), default=0.0)
    ok = (
        f"every gradient whole inside and equal to a single-process backward of the same "
        f"batch (largest difference {worst:.3g}, allowed {SUMMON_GRAD_RTOL:g} of the largest "
        "gradient)"
    )
    return wrong, ok


def _judge_summon_case(
    label: str, values: Sequence[SummonResult], reference: nn.Module, expected: Digests
) -> tuple[dict[int, list[str]], str]:
    """A :data:`SUMMON_CASES` case: each rank's problems, and the line for none."""
    writeback, rank0_only, _ = SUMMON_CASES[label]
    params = dict(reference.named_parameters(remove_duplicate=False))
    tied = aliases(reference)
    wrong: dict[int, list[str]] = {}
    for value in values:
        case = cast(SummonCase, value["cases"][label])
        lines = []
        inside = {clean_fqn(k): d for k, d in case["inside"].items()}
        if not rank0_only or value["rank"] == 0:
            params_only = {k: d for k, d in expected.items() if k in inside}
            lines += [f"inside: {d}" for d in differences(params_only, inside)]
            if not params_only:
                lines.append("inside: no parameter of the reference seen")
        want = dict(expected)
        name = case["changed"]
        if writeback and name is not None:
            with torch.no_grad():
                changed = params[clean_fqn(name)].detach() + WRITE_DELTA
            # Every alias of a tied parameter is the one tensor: FSDP1 changes them all (a
            # tied Llama once failed: "lm_head.weight: expected sum -7.66, got 127992.3").
            for alias in tied[clean_fqn(name)]:
                want[alias] = digests({"x": changed})["x"]
        lines += [f"after the context: {d}" for d in differences(want, case["after"])]
        if lines:
            wrong[value["rank"]] = lines
    return wrong, ("the change kept" if writeback else "the model unchanged") + " after the context"


def verdict_summon(values: Sequence[SummonResult], params: Mapping[str, Any]) -> Verdict:
    """Inside: every parameter whole and equal to the reference (on rank 0 alone with
    ``rank0_only``). After: with writeback the change is in the model, without it the model is
    the reference again; bitwise."""
    spec = params.get("spec", DEFAULT_SPEC)
    reference = build(spec, params.get("seed", 0))
    expected = digests(reference.state_dict())
    tree: list[str] = []
    bad: list[str] = []
    cases = list(values[0]["cases"])
    for label in cases:
        wrong, ok = (
            _judge_summoned_grads(values)
            if label == SUMMON_GRADS
            else _judge_summon_case(label, values, reference, expected)
        )
        tree += section(label, ok, wrong)
        bad += [label] if wrong else []
    figures = {"cases": cases, "failed_cases": bad}
    head = (
        f"fsdp1 {spec.name}: summon_full_params, {len(cases)} case(s), against the "
        f"single-process reference, bitwise, on all {len(values)} ranks"
    )
    return Verdict(not bad, head + ":\n" + "\n".join(tree), figures)
