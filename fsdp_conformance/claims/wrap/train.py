"""``wrap.train.fp32`` / ``wrap.train.bf16``: a few SGD steps under FSDP equal a single-process
reference (bf16: compute really in bf16, parameters kept in fp32, the reference computing as
FSDP's mixed precision does: :class:`parity.MixedPrecisionReference`).

The user's code is the module-level steps :func:`rank_train` calls by name: sharding
(``shard_with_policy``), the mixed-precision options (:func:`mixed_precision_kwargs`) and the
optimizer step (:func:`optimizer_step`); the faults of :data:`FAULTS` patch those, or
``torch.distributed``'s reduce-scatters, for the duration of one rank function.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from fsdp_conformance import _compat
from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import Fault, FaultTable, patched, patched_attr
from fsdp_conformance.claims.wrap.common import (
    MixedPrecisionReference,
    build,
    compare_updates,
    record_compute_dtypes,
    shard_with_policy,
    tensor_diagnosis,
    update_diagnosis,
    update_lost,
)
from fsdp_conformance.fsdp.determinism import disable_dropout, require_deterministic
from fsdp_conformance.fsdp.reference_step import SliceReference, full_params, sgd_step
from fsdp_conformance.fsdp.sharding import (
    InputCasts,
    batch_norm_modules,
    check_fsdp_version,
    device_mesh,
    fsdp1_full_precision_units,
    full_precision_units_note,
    input_casts_note,
    known_fix_figure,
    with_known_fix,
)
from fsdp_conformance.fsdp.tensors import listing, local_shard
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models.model_spec import (
    BuiltModel,
    ModelSpec,
    batch_rows,
    call_model,
    default_loss,
)
from fsdp_conformance.models.policies import PolicyName
from fsdp_conformance.models.units import planned_unit_modules

#: Tolerances of the training-parity checks (measured margins in docs/wrapping.md).
FP32_ATOL = 1e-5  # max |param - reference| after the steps; fp32 reduction order only
FP32_LOSS_RTOL = 1e-5
#: fp32: max |param - reference| / max |reference update| per tensor. Measured 3.2e-4 at dim 32
#: (3 SGD steps); a weight left out of gradient reduction measured 0.6.
FP32_UPDATE_RTOL = 1e-2
#: bf16: the reference computes as FSDP's mixed precision does (:class:`MixedPrecisionReference`),
#: so what is left is rounding, counted in bf16 ulps (8 significant bits: one ulp is 2^-8 to
#: 2^-7 of a value). Loss: every output off by at most one rounding moves a mean of squares by
#: at most 2 x 2^-8. Update: two ulps of the tensor's largest gradient element, 2 x 2^-7 of the
#: largest update. Measured (dim 32 and 64, 3 steps): loss 0 and update 0 at world size 2,
#: loss 0 and update <= 1.0e-3 at world size 4; summed gradients 1.0 (ws 2) to 3.0 (ws 4),
#: a skipped reduction 0.72 to 2.0 (docs/wrapping.md).
BF16_ULP = 2.0**-8
BF16_LOSS_RTOL = 2 * BF16_ULP
BF16_UPDATE_RTOL = 2 * 2 * BF16_ULP
BF16_PARAM_ATOL = 2e-2
#: Below this share of the model's largest update, a tensor's update is rounding and is judged
#: against that floor, not against itself (``parity.compare_updates``). fp32: one rounding is
#: 2^-24 of a term, and a gradient element sums up to ~1e2 products at these sizes (batch x
#: sequence rows, the width), so 1e-5 of the largest is what rounding alone can reach. Measured
#: on ViT and BERT (hidden 64): the attention key bias, whose true gradient is zero, at 2e-10
#: of the largest update; the smallest real one at 7e-4 (docs/wrapping.md). The same for bf16:
#: its reference repeats FSDP's bf16 arithmetic, so what differs is the fp32 step; one bf16 ulp
#: (2^-8) of the largest was measured too generous: on the massive model (dim 32, one step) it
#: took the embedding's and the first block's real updates for rounding, and a skipped
#: reduce-scatter then measured 0.22 instead of 0.72.
NEGLIGIBLE_UPDATE = 1e-5

# --------------------------------------------------------------------------------------------
# The user's steps
# --------------------------------------------------------------------------------------------


def mixed_precision_kwargs(version: str, precision: str, known_fix: bool = False) -> dict[str, Any]:
    """The FSDP keyword arguments of ``precision``: bf16 parameters, reduction (and FSDP1
    buffers); none for fp32. ``known_fix``: the version's fix of its known mixed-precision
    error, asked for only after torch's defaults raised it (``sharding.with_known_fix``):
    FSDP1's per-unit input casts, FSDP2's ``_BatchNorm`` modules as fp32 units."""
    if precision != "bf16":
        return {}
    if version == "fsdp1":
        from torch.distributed.fsdp import MixedPrecision

        mp1 = MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16
        )
        if known_fix:  # MixedPrecision's other fields as users leave them
            mp1 = dataclasses.replace(mp1, cast_forward_inputs=True)
        return {"mixed_precision": mp1}
    mp = _compat.mixed_precision_policy_cls()
    fix = {"fp32_batch_norm": True} if known_fix else {}
    return {"mp_policy": mp(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16), **fix}


def optimizer_step(model: nn.Module, lr: float) -> None:
    """The user's optimizer on the sharded model (the reference steps with :func:`sgd_step`)."""
    sgd_step(model, lr)


# --------------------------------------------------------------------------------------------
# Faults (negative controls): a misconfiguration or a broken reduction, one at a time
# --------------------------------------------------------------------------------------------


def _shard_step(make: Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]) -> Any:
    """A fault that replaces this module's sharding step with ``make(the step)``."""

    def effect(ctx: RankContext) -> contextlib.AbstractContextManager[None]:
        return patched_attr(__name__, "shard_with_policy", make)

    return effect


def _unsynced(shard: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """Parameters outside the planned units left out of FSDP: FSDP1 ``ignored_modules``,
    FSDP2 the units sharded and the root (with what only it holds) left as plain tensors."""

    def shard_units_only(
        model: nn.Module, ctx: RankContext, version: str, policy_obj: Any, **kwargs: Any
    ) -> nn.Module:
        units = planned_unit_modules(model, policy_obj)
        if version == "fsdp1":
            covered = {id(m) for u in units for m in u.modules()}
            outside = [
                m
                for m in model.modules()
                if id(m) not in covered
                and m is not model
                and any(True for _ in m.parameters(recurse=False))
            ]
            return shard(model, ctx, version, policy_obj, ignored_modules=outside, **kwargs)
        fully_shard = _compat.fully_shard()
        mesh = device_mesh(ctx)
        for u in sorted(units, key=lambda m: len([*m.modules()])):  # the innermost first
            fully_shard(u, mesh=mesh, **kwargs)
        return model

    return shard_units_only


def _cast_before(shard: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    def shard_bf16(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        return shard(model.to(torch.bfloat16), *args, **kwargs)

    return shard_bf16


def _permuted_after(shard: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """The last rank's local shard of the largest parameter rolled by one after sharding."""

    def shard_permuted(model: nn.Module, ctx: RankContext, *args: Any, **kwargs: Any) -> nn.Module:
        sharded = shard(model, ctx, *args, **kwargs)
        if ctx.rank == ctx.world_size - 1:
            with torch.no_grad():
                largest = max(sharded.parameters(), key=lambda p: local_shard(p).numel())
                local = local_shard(largest)
                local.copy_(local.flatten().roll(1).view_as(local))
        return sharded

    return shard_permuted


def _smallest_frozen(shard: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """The smallest trainable tensor (fewest elements, the first of them: a bias or a norm's
    gain) frozen before wrapping, as a freeze list would: its update, small but real, is lost."""

    def shard_frozen(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        smallest = min(model.parameters(), key=lambda p: p.numel())
        smallest.requires_grad_(False)
        return shard(model, *args, **kwargs)

    return shard_frozen


def _no_mixed_precision(ctx: RankContext) -> contextlib.AbstractContextManager[None]:
    return patched_attr(
        __name__,
        "mixed_precision_kwargs",
        lambda kwargs: lambda version, precision, cast_forward_inputs=False: {},
    )


def _summed_grads(ctx: RankContext) -> contextlib.AbstractContextManager[None]:
    # Every gradient multiplied by the world size after FSDP averaged it: the sum.
    return patched_attr(
        __name__,
        "optimizer_step",
        lambda step: lambda model, lr: step(model, lr * ctx.world_size),
    )


@contextlib.contextmanager
def _skipped_reduction(ctx: RankContext) -> Iterator[None]:
    """``torch.distributed``'s reduce-scatters (looked up at call time by FSDP1 and FSDP2, as in
    ``step.collectives_release_in_order``) copy this rank's chunk of the input instead of
    reducing across ranks; an AVG (FSDP2) divides by nothing."""
    import torch.distributed as dist

    def local(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        output.copy_(input.reshape(ctx.world_size, -1)[ctx.rank].view_as(output))

    with contextlib.ExitStack() as stack:
        for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
            if hasattr(dist, name):
                stack.enter_context(patched(dist, name, lambda original: local))
        yield


FAULTS = FaultTable(
    unsynced_root=Fault(
        "parameters outside the planned units are left out of FSDP (FSDP1 ignored_modules, "
        "FSDP2 no fully_shard on the root): their gradients are never reduced",
        _shard_step(_unsynced),
    ),
    params_bf16=Fault(
        "the model is cast to bf16 before wrapping: parameters are no longer fp32",
        _shard_step(_cast_before),
    ),
    no_mixed_precision=Fault(
        "bf16 is claimed but no mixed-precision policy is passed", _no_mixed_precision
    ),
    summed_grads=Fault(
        "each rank applies the sum of the ranks' gradients instead of their mean (every "
        "gradient multiplied by the world size after FSDP reduced it)",
        _summed_grads,
    ),
    permuted_shard=Fault(
        "the last rank's local shard of the largest parameter is permuted after sharding (its "
        "elements rolled by one)",
        _shard_step(_permuted_after),
    ),
    small_update_lost=Fault(
        "the smallest trainable tensor is frozen before wrapping: its update, small but above "
        "rounding, never happens while every other tensor trains as the reference does",
        _shard_step(_smallest_frozen),
    ),
    skipped_reduction=Fault(
        "every gradient reduce-scatter is skipped: each rank keeps its own chunk of its own "
        "gradient, divided as FSDP divides the reduced one",
        _skipped_reduction,
    ),
)

# --------------------------------------------------------------------------------------------
# The reference
# --------------------------------------------------------------------------------------------


def _reference_step(
    reference: SliceReference | MixedPrecisionReference,
    batch: Any,
    per_rank_batch: int,
    world_size: int,
    lr: float,
) -> float:
    """One step of the reference on each rank's slice, with that rank's buffers (FSDP never
    synchronises batch statistics): fp32, or as FSDP's mixed precision does; the mean of the
    slices' losses (what the sharded side reports)."""
    slices = [
        batch_rows(batch, r * per_rank_batch, (r + 1) * per_rank_batch) for r in range(world_size)
    ]
    if isinstance(reference, MixedPrecisionReference):
        return reference.step(slices, lr)
    losses = reference.forward_backward(slices)
    sgd_step(reference.model, lr)
    return sum(losses) / len(losses)


def element_owners(sharded: nn.Module, version: str, rank: int) -> dict[str, torch.Tensor]:
    """The rank holding each element of each parameter (the rank that receives its reduced
    gradient), observed: every rank fills its local shard with its rank, the gathered full
    parameters then hold the owners; the shards are restored."""
    shards = [local_shard(p) for p in sharded.parameters()]
    with torch.no_grad():
        saved = [t.clone() for t in shards]
        for t in shards:
            t.fill_(rank)
    owners = {n: v.round().long() for n, v in full_params(sharded, version).items()}
    with torch.no_grad():
        for t, s in zip(shards, saved):
            t.copy_(s)
    return owners


def _comparable_batch(
    spec: ModelSpec, reference: nn.Module, batch_size: int, ctx: RankContext, dropout: Sequence[str]
) -> Any:
    """The global batch, once the reference is known to compute the same thing twice."""
    batch = spec.batch(reference, batch_size=batch_size, device=ctx.device)
    require_deterministic(reference, batch, dropout, "a sharded step")
    return batch


# --------------------------------------------------------------------------------------------
# The rank function
# --------------------------------------------------------------------------------------------


class TrainResult(TypedDict):
    """What every rank of ``rank_train`` reports."""

    rank: int
    version: str
    precision: str
    losses: list[float]
    ref_losses: list[float]
    max_param_diff: float
    worst_param: str
    max_update_rel_diff: float
    worst_update_param: str
    #: The scale that best maps the reference's update onto the sharded one (least squares
    #: over every parameter): 1 when they agree, the world size when gradients were summed.
    update_factor: float | None
    #: The worst tensor's update as a share of the model's largest, and its own update factor
    #: (None when its update is at rounding level).
    worst_update_share: float
    worst_tensor_factor: float | None
    #: The reference's largest update of any tensor (max |after - before|).
    update_scale: float
    #: Tensors whose reference update is rounding (``parity.update_floor``): judged against the
    #: floor, not against their own update.
    below_rounding: list[str]
    stored_dtypes: list[str]
    compute_dtypes: dict[str, tuple[str, str]]
    #: The same modules' output dtypes (``record_compute_dtypes``).
    output_dtypes: dict[str, str]
    dropout_disabled: list[str]
    backend: str
    #: None: the run used mixed precision as users write it. Else torch's defaults raised the
    #: version's known error and the run judged is the one with its fix (``with_known_fix``).
    input_casts: InputCasts | None
    #: The units torch ran in fp32 by its own default under bf16 (FSDP1's ``MixedPrecision``
    #: keeps ``_BatchNorm`` fp32: ``sharding.fsdp1_full_precision_units``), with numels.
    full_precision_units: dict[str, int]


#: What one training run hands back: the sharded model, the compute dtypes seen (input, weight;
#: and output), the losses of the sharded model and of the reference per step, and the units
#: torch ran in fp32 by its own default (FSDP1's ``_BatchNorm``; by FQN, with numels).
_Trained = tuple[
    nn.Module,
    tuple[dict[str, tuple[str, str]], dict[str, str]],
    list[float],
    list[float],
    dict[str, int],
]


def _restore(reference: nn.Module, initial: Mapping[str, torch.Tensor]) -> None:
    """The reference's parameters back to ``initial`` and its gradients cleared."""
    with torch.no_grad():
        for n, p in reference.named_parameters():
            p.copy_(initial[n])
    reference.zero_grad(set_to_none=True)


def _train_steps(
    ctx: RankContext,
    spec: ModelSpec,
    models: tuple[nn.Module, nn.Module],
    batch: Any,
    setup: tuple[str, PolicyName, str, bool],
    schedule: tuple[int, float, int],
) -> _Trained:
    """``models``' second (the reference's copy) sharded as ``setup`` says (version, policy,
    precision, the version's known fix) and trained ``schedule``'s steps (steps, lr,
    per-rank batch) beside the first, the reference."""
    reference, model = models
    version, policy, precision, known_fix = setup
    steps, lr, per_rank_batch = schedule
    mine = batch_rows(batch, ctx.rank * per_rank_batch, (ctx.rank + 1) * per_rank_batch)
    policy_obj = BuiltModel(spec, model).policy(policy)  # the copy's modules: the one sharded
    module_names = {id(m): n for n, m in model.named_modules()}
    unit_names = [module_names[id(u)] for u in planned_unit_modules(model, policy_obj)]
    # FSDP2's fix: each _BatchNorm its own full-precision unit (sharding.with_known_fix).
    full_units = (
        [module_names[id(m)] for m in batch_norm_modules(model)]
        if known_fix and version == "fsdp2"
        else []
    )
    sharded = shard_with_policy(
        model,
        ctx,
        version,
        policy_obj,
        **mixed_precision_kwargs(version, precision, known_fix),
    )
    # FSDP1's MixedPrecision keeps its _module_classes_to_ignore (_BatchNorm) units fp32:
    # observed on the sharded model, the reference does the same.
    torch_full = fsdp1_full_precision_units(sharded) if version == "fsdp1" else {}
    stepper = (
        MixedPrecisionReference(
            reference,
            version,
            unit_names,
            element_owners(sharded, version, ctx.rank),
            cast_forward_inputs=known_fix and version == "fsdp1",
            full_units=[*full_units, *torch_full],
        )
        if precision == "bf16"
        else SliceReference(reference, ctx.world_size)
    )
    seen: dict[str, tuple[str, str]] = {}
    outputs: dict[str, str] = {}
    losses, ref_losses = [], []
    for _ in range(steps):
        with record_compute_dtypes(model, seen, outputs=outputs):
            loss = default_loss(call_model(sharded, mine))
        loss.backward()
        optimizer_step(sharded, lr)
        losses.append(float(loss))
        ref_losses.append(_reference_step(stepper, batch, per_rank_batch, ctx.world_size, lr))
    return sharded, (seen, outputs), losses, ref_losses, torch_full if precision == "bf16" else {}


def rank_train(
    ctx: RankContext,
    spec: ModelSpec,
    version: str = "fsdp1",
    policy: PolicyName = "recommended",
    precision: str = "fp32",
    steps: int = 3,
    lr: float = 0.05,
    per_rank_batch: int = 2,
    fault: str | Sequence[str] | None = None,
) -> TrainResult:
    """Train ``steps`` SGD steps under FSDP and on a single-process reference; report both.

    Each rank trains on its slice of one global batch; the reference trains on the whole
    batch. FSDP averages gradients over ranks, so with equal slices the two see the same
    gradient. Every rank builds the same reference from the same seed. ``fault``: names in
    :data:`FAULTS`.
    """
    with FAULTS.inject(fault, ctx):
        check_fsdp_version(version)
        built = build(spec, ctx)
        reference = built.model
        # Like with like: both sides without dropout (step.disable_dropout says why not eval()).
        dropout = disable_dropout(reference)
        model = copy.deepcopy(reference)
        # bf16 may need a second run (sharding.with_known_fix): its own copy,
        # taken now, as the first.
        spare = copy.deepcopy(model) if precision == "bf16" else None
        initial = {
            n: p.detach().float().clone()
            for n, p in reference.named_parameters(remove_duplicate=False)  # every alias
        }
        batch = _comparable_batch(spec, reference, per_rank_batch * ctx.world_size, ctx, dropout)

        def attempt(known_fix: bool) -> _Trained:
            if known_fix:  # the failed run may have stepped the reference: undo it
                _restore(reference, initial)
            return _train_steps(
                ctx,
                spec,
                (reference, spare if known_fix and spare is not None else model),
                batch,
                (version, policy, precision, known_fix),
                (steps, lr, per_rank_batch),
            )

        (sharded, (seen, outputs), losses, ref_losses, torch_full), casts = with_known_fix(
            version, precision == "bf16", attempt
        )
        stored = sorted({str(p.dtype) for p in sharded.parameters()})
        compared = compare_updates(
            full_params(sharded, version),
            dict(reference.named_parameters(remove_duplicate=False)),
            initial,
            NEGLIGIBLE_UPDATE,
        )
        return {
            "rank": ctx.rank,
            "version": version,
            "precision": precision,
            "losses": losses,
            "ref_losses": ref_losses,
            "max_param_diff": compared["max_param_diff"],
            "worst_param": compared["worst_param"],
            "max_update_rel_diff": compared["max_update_rel_diff"],
            "worst_update_param": compared["worst_update_param"],
            "update_factor": compared["update_factor"],
            "worst_update_share": compared["worst_update_share"],
            "worst_tensor_factor": compared["worst_tensor_factor"],
            "update_scale": compared["update_scale"],
            "below_rounding": compared["below_rounding"],
            "stored_dtypes": stored,
            "compute_dtypes": seen,
            "output_dtypes": outputs,
            "dropout_disabled": dropout,
            "backend": ctx.backend,
            "input_casts": casts,
            "full_precision_units": torch_full,
        }


# --------------------------------------------------------------------------------------------
# The verdict
# --------------------------------------------------------------------------------------------


def _loss_problems(values: Sequence[TrainResult], loss_rtol: float) -> tuple[list[str], float]:
    """Each step's loss (mean over ranks) against the reference's; and the worst difference."""
    problems = []
    worst_loss = 0.0
    for step in range(len(values[0]["losses"])):
        fsdp = sum(v["losses"][step] for v in values) / len(values)
        ref = values[0]["ref_losses"][step]
        rel = abs(fsdp - ref) / max(abs(ref), 1e-12)
        worst_loss = max(worst_loss, rel)
        if rel > loss_rtol:
            problems.append(
                f"step {step}: loss {fsdp:.6g} (mean over ranks) vs reference "
                f"{ref:.6g}: relative difference {rel:.2e} > {loss_rtol:.1e}"
            )
    return problems, worst_loss


def _bf16_compute_problems(v: TrainResult) -> list[str]:
    """Modules whose weight as used is not bf16: what FSDP's mixed precision hands a module.
    Not their input: an embedding's input is indices (token ids, or positions computed as
    floats from an attention mask), and a matrix product whose input and weight differ in dtype
    does not run at all. Not their output: a module whose weight arrived in bf16 and whose own
    code upcasts (a mixture of experts' router computing its logits in fp32, on purpose) did
    get what FSDP promised; :func:`own_upcasts` names it in the verdict."""
    outputs = v.get("output_dtypes", {})
    bad = sorted(n for n, (_, weight) in v["compute_dtypes"].items() if weight != "torch.bfloat16")
    if not bad:
        return []
    name = bad[0]
    return [
        f"rank {v['rank']}: compute did not run in bf16 in {len(bad)} module(s), e.g. "
        f"{name}: weight {v['compute_dtypes'][name][1]}, output "
        f"{outputs.get(name, 'not recorded')} (input {v['compute_dtypes'][name][0]})"
    ]


def own_upcasts(values: Sequence[TrainResult]) -> list[str]:
    """Modules handed bf16 weights whose output is not bf16: their own code upcasts."""
    found: dict[str, None] = {}
    for v in values:
        outputs = v.get("output_dtypes", {})
        for n, (_, weight) in v["compute_dtypes"].items():
            out = outputs.get(n, "torch.bfloat16")
            if weight == "torch.bfloat16" and out != "torch.bfloat16":
                found[f"{n or '(root)'} ({out.removeprefix('torch.')})"] = None
    return list(found)


def _rank_problems(v: TrainResult, precision: str, steps: int, world_size: int) -> list[str]:
    """One rank's weights, update, stored and compute dtypes against the tolerances."""
    problems = []
    update_rtol = BF16_UPDATE_RTOL if precision == "bf16" else FP32_UPDATE_RTOL
    param_atol = BF16_PARAM_ATOL if precision == "bf16" else FP32_ATOL
    if v["max_update_rel_diff"] > update_rtol:
        name, own = v["worst_update_param"], v.get("worst_tensor_factor")
        problems.append(
            f"rank {v['rank']}: {name}'s update differs from the reference's by "
            f"{v['max_update_rel_diff']:.2e} of the update > {update_rtol:.1e}; "
            f"{tensor_diagnosis(name, v.get('worst_update_share', 1.0), own)}; "
            f"{update_diagnosis(v.get('update_factor'), world_size, update_lost(own))}"
        )
    if v["max_param_diff"] > param_atol:
        problems.append(
            f"rank {v['rank']}: after {steps} steps {v['worst_param']} differs "
            f"from the reference by {v['max_param_diff']:.2e} > {param_atol:.0e}"
        )
    if v["stored_dtypes"] != ["torch.float32"]:
        problems.append(
            f"rank {v['rank']}: stored parameters are {v['stored_dtypes']}, expected float32 only"
        )
    if precision == "bf16":
        problems += _bf16_compute_problems(v)
    return problems


def verdict_train(values: Sequence[TrainResult], params: Mapping[str, Any]) -> Verdict:
    """Losses (mean over ranks) and final full weights match the reference within tolerance;
    under bf16, every Linear computed in bf16 and every stored parameter stayed fp32."""
    precision = params.get("precision", "fp32")
    loss_rtol = BF16_LOSS_RTOL if precision == "bf16" else FP32_LOSS_RTOL
    param_atol = BF16_PARAM_ATOL if precision == "bf16" else FP32_ATOL
    update_rtol = BF16_UPDATE_RTOL if precision == "bf16" else FP32_UPDATE_RTOL
    steps = len(values[0]["losses"])
    problems, worst_loss = _loss_problems(values, loss_rtol)
    worst_param = max(v["max_param_diff"] for v in values)
    worst_update = max(v["max_update_rel_diff"] for v in values)
    for v in values:
        problems += _rank_problems(v, precision, steps, len(values))
    if (
        precision == "bf16"
        and worst_update > update_rtol
        and len(values) > 2
        and values[0].get("backend", "gloo") != "gloo"
    ):
        problems.append(
            f"note: the reference sums the ranks' bf16 gradients in gloo's ring "
            f"order; {values[0]['backend']}'s order at world size {len(values)} is "
            "not modelled and may alone account for the update difference"
        )
    dropout = values[0].get("dropout_disabled", [])
    figures = {
        "loss_rel_diff": worst_loss,
        "max_param_diff": worst_param,
        "update_rel_diff": worst_update,
        "steps": steps,
        "dropout_disabled": len(dropout),
        "below_rounding": len(values[0].get("below_rounding", [])),
    }
    data: dict[str, Any] = {"dropout_disabled": dropout}
    casts = values[0].get("input_casts")
    if casts is not None:  # FSDP1's defaults could not run the model: judged with the fix
        figures[known_fix_figure(casts)] = True
        data["input_casts"] = casts
    # Said in both outcomes: the comparison was of the model without its dropout, and of the
    # tensors whose update is rounding against a floor (parity.compare_updates).
    note = (
        f"; dropout disabled for the comparison: {len(dropout)} settings ({listing(dropout)})"
        if dropout
        else ""
    )
    rounding = values[0].get("below_rounding", [])
    if rounding:
        note += (
            f"; {len(rounding)} tensor(s) whose update is at rounding level, judged against "
            f"the floor rather than their own update ({listing(rounding)})"
        )
    note += input_casts_note(casts)
    upcasts = own_upcasts(values) if precision == "bf16" else []
    if upcasts:
        note += (
            f"; handed bf16 weights, {len(upcasts)} module(s) upcast in their own code (their "
            f"output not bf16: the model's numerics, not FSDP's): {listing(upcasts)}"
        )
    full = values[0].get("full_precision_units") or {}
    note += full_precision_units_note(values[0]["version"], full)
    if full:
        data["full_precision_units"] = full
    if problems:
        return Verdict(
            False,
            f"{precision} training under FSDP differs from the reference"
            f"{note}:\n  " + "\n  ".join(dict.fromkeys(problems)),
            figures,
            {"dropout_disabled": dropout},
        )
    return Verdict(
        True,
        f"{steps} {precision} steps match the reference (loss rel {worst_loss:.1e}"
        f" <= {loss_rtol:.1e}, params {worst_param:.1e} <= {param_atol:.0e}, update "
        f"rel {worst_update:.1e} <= {update_rtol:.1e}){note}",
        figures,
        data,
    )
