"""``stack.loss_scaling``: fp16 mixed precision with loss scaling, as users write it, skips a
step with an inf or nan gradient on every rank, updates the scale identically everywhere, and
otherwise equals a single-process scaler.

FSDP1: ``MixedPrecision(param_dtype=torch.float16)`` and
``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``; FSDP2:
``MixedPrecisionPolicy(param_dtype=torch.float16)`` and ``torch.amp.GradScaler``. Both on the
rank's device (``"cpu"`` on gloo), with ``torch.optim.SGD``: per step ``scaler.scale(loss)
.backward()``, ``scaler.step(optimizer)``, ``scaler.update()``, ``optimizer.zero_grad()``.

``STEPS`` steps; two of them carry a non-finite gradient on ONE rank (:data:`INF_RANK`):

* ``loss`` (:data:`INF_LOSS_STEP`): that rank's loss times inf (an overflowed loss): every
  gradient of that rank is non-finite, and the reduction carries it into every rank's shard.
* ``shard`` (:data:`INF_SHARD_STEP`): one element of that rank's reduced gradient shard set to
  inf after the backward (what a local overflow becomes when the elements it hit are reduced
  into one rank's shard): only that rank finds it, so every other rank skips the step only
  because the scaler synchronises its found-inf (FSDP1 ``ShardedGradScaler.unscale_``'s
  all-reduce; FSDP2 DTensor's handler of ``_amp_foreach_non_finite_check_and_unscale_``, an
  all-reduce of the found-inf over the mesh).

Observed per rank and step: whether this rank's local shards changed (bitwise), the scale
after ``update()``, each finite step's update (full parameters) against the reference's. The
reference: the same model in one process under ``torch.autocast(float16)`` (fp16 compute, fp32
parameters) with a ``torch.amp.GradScaler`` of the same settings, each rank's slice's loss
divided by the world size, the same two steps poisoned. The user's code is this module's steps
(:func:`make_scaler`, :func:`scaled_backward`, :func:`scaler_update`), which the faults of
:data:`FAULTS` patch.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from fsdp_conformance import _compat
from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import Fault, FaultTable, patched, patched_attr
from fsdp_conformance.claims.stack.common import build_side
from fsdp_conformance.fsdp.reference_step import (
    RankBuffers,
    TensorComparison,
    compare_tensors,
    full_params,
    model_loss,
    observe_update,
    reference_params,
)
from fsdp_conformance.fsdp.sharding import (
    InputCasts,
    check_fsdp_version,
    input_casts_note,
    param_dtype_kwargs,
    shard,
    with_known_fix,
)
from fsdp_conformance.harness import CheckSkipped, RankContext, skip_rank
from fsdp_conformance.models.model_spec import ModelSpec

#: Optimizer steps per run (each rank's rows per step: ``stack.common.PER_RANK``).
STEPS = 6
#: The steps whose gradient is non-finite on one rank (``"loss"``: that rank's loss times inf;
#: ``"shard"``: inf in one element of that rank's reduced gradient shard).
INF_LOSS_STEP = 2
INF_SHARD_STEP = 4
POISONED = {INF_LOSS_STEP: "loss", INF_SHARD_STEP: "shard"}
#: The scaler's settings (both sides): a scale small enough that no finite step overflows fp16
#: on the reference models, growth every second finite step so a run shows growth and backoff.
INIT_SCALE = 2.0**10
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2
LR = 0.1
#: A finite step's update against the reference's: the worst tensor's ``max |update -
#: reference update|`` over its own largest reference update, floored at :data:`FLOOR_SHARE`
#: of the set's largest. The two sides compute in fp16 differently (FSDP casts each unit's
#: parameters and reduces in fp16; the reference autocasts matmuls and accumulates the slices'
#: gradients in fp32), so they agree to fp16's rounding (eps 9.8e-4) amplified by the model,
#: not bitwise; measured in docs/stack/loss_scaling.md. A tensor whose true gradient is zero
#: (a bias right before batch norm) is fp16 rounding on both sides: the floor.
UPDATE_RTOL = 2e-2
FLOOR_SHARE = 1.0
#: A rank's loss of its slice against the reference's (fp16 forward against autocast).
LOSS_RTOL = 1e-2
#: The model's own fp16 noise, measured in one process at every finite step: the reference's
#: fp16 update (and each slice's loss) against an fp32 step of the same model from the same
#: parameters on the same slices (:class:`_Reference`). The sharded fp16 step and the
#: reference's are two fp16 computations of one step, each about that far from fp32; the
#: tolerance is :data:`NOISE_FACTOR` times the measured noise where that exceeds the fixed
#: tolerances above (a top-k router that sends a token elsewhere in fp16, a deep convolution's
#: rounding), never below them. Measured, sharded difference over noise: 2.8 on the Llama
#: reference model, 1.5 on a top-2 mixture of experts (docs/stack/loss_scaling.md).
NOISE_FACTOR = 5.0
#: The largest tolerance a measured noise may set: a fault moves an update by its whole size or
#: more (the loss scale not applied: 1.0 of it; the gradients not unscaled: the scale, 1023x),
#: so a model whose fp16 noise needs more than this cannot be judged in fp16 at all, and the
#: verdict says so rather than passing it.
NOISE_CAP = 0.25


def inf_rank(world_size: int) -> int:
    """The one rank whose gradient is non-finite on the poisoned steps: the last."""
    return world_size - 1


# --------------------------------------------------------------------------------------------
# The user's code
# --------------------------------------------------------------------------------------------


def make_scaler(version: str, device_type: str) -> Any:
    """The scaler users make for each FSDP version: FSDP1 ``ShardedGradScaler``, FSDP2
    ``torch.amp.GradScaler``, on the rank's device."""
    settings: dict[str, Any] = {
        "init_scale": INIT_SCALE,
        "growth_factor": GROWTH_FACTOR,
        "backoff_factor": BACKOFF_FACTOR,
        "growth_interval": GROWTH_INTERVAL,
    }
    if version == "fsdp1":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device_type, **settings)
    return torch.amp.GradScaler(device_type, **settings)


def scaled_backward(scaler: Any, loss: torch.Tensor) -> None:
    """``scaler.scale(loss).backward()``."""
    scaler.scale(loss).backward()


def scaler_step(scaler: Any, optimizer: Any) -> None:
    """``scaler.step(optimizer)``: unscales the gradients, steps unless one is non-finite."""
    scaler.step(optimizer)


def scaler_update(scaler: Any) -> None:
    """``scaler.update()``, after ``scaler.step(optimizer)``."""
    scaler.update()


def poison_shard(model: nn.Module) -> str:
    """inf in the first element of this rank's first non-empty gradient shard (FSDP1 a flat
    parameter's, FSDP2 a DTensor gradient's local tensor); the parameter's name."""
    dtensor = _compat.dtensor_cls()
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if isinstance(grad, dtensor) else grad
        if local.numel():
            with torch.no_grad():
                local.view(-1)[0] = math.inf
            return name
    raise RuntimeError("no gradient shard on this rank to hold the inf")


# --------------------------------------------------------------------------------------------
# Negative controls
# --------------------------------------------------------------------------------------------


def _local_unscale(original: Callable[..., Any]) -> Callable[..., Any]:
    dtensor = _compat.dtensor_cls()

    def unscale(grads: list[torch.Tensor], found_inf: torch.Tensor, inv: torch.Tensor) -> Any:
        local = [g.to_local() if isinstance(g, dtensor) else g for g in grads]
        return original(local, found_inf, inv)

    return unscale


@contextlib.contextmanager
def _unsynchronised(ctx: RankContext) -> Iterator[None]:
    """FSDP1: ``ShardedGradScaler.unscale_`` is ``GradScaler.unscale_`` (its all-reduce of the
    found-inf gone); FSDP2: the fused check-and-unscale op on each gradient's local tensor
    (DTensor's all-reduce of the found-inf bypassed)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    with contextlib.ExitStack() as stack:
        stack.enter_context(
            patched(ShardedGradScaler, "unscale_", lambda original: torch.amp.GradScaler.unscale_)
        )
        name = _compat.amp_unscale_op_name()
        if name is not None:
            stack.enter_context(patched(torch, name, _local_unscale))
        yield


def _frozen_update(scaler: Any) -> None:
    scaler.update(float(scaler.get_scale()))


def _unscaled_backward(scaler: Any, loss: torch.Tensor) -> None:
    scaler.scale(loss)  # computed (the scaler then expects a step), then left unused
    loss.backward()


def _step_on_scaled(scaler: Any, optimizer: Any) -> None:
    # The found-inf is decided as usual (unscale_), then the gradients are scaled back up:
    # the optimizer steps on gradients still multiplied by the scale.
    scaler.unscale_(optimizer)
    scale = float(scaler.get_scale())
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(scale)
    scaler.step(optimizer)


FAULTS = FaultTable(
    found_inf_not_synchronised=Fault(
        "each rank's scaler decides on its own found-inf: FSDP1 ShardedGradScaler.unscale_ "
        "without its all-reduce, FSDP2 the unscale op on local tensors (no DTensor all-reduce)",
        _unsynchronised,
    ),
    scale_frozen=Fault(
        "the user's scaler.update() keeps the scale it had (update(new_scale=get_scale())): "
        "the scale never backs off or grows",
        lambda ctx: patched_attr(__name__, "scaler_update", lambda original: _frozen_update),
    ),
    scale_not_applied=Fault(
        "the user's backward is loss.backward(), not scaler.scale(loss).backward(): the scaler "
        "still divides the gradients by the scale, so every update is 1/scale of the true one",
        lambda ctx: patched_attr(__name__, "scaled_backward", lambda original: _unscaled_backward),
    ),
    not_unscaled=Fault(
        "the optimizer steps on the scaled gradients: the user's step unscales, then multiplies "
        "the gradients by the scale again before scaler.step (every update scale times too big)",
        lambda ctx: patched_attr(__name__, "scaler_step", lambda original: _step_on_scaled),
    ),
)

# --------------------------------------------------------------------------------------------
# The rank function
# --------------------------------------------------------------------------------------------


class StepRecord(TypedDict):
    """One step on one rank and on the reference."""

    #: "" (finite), "loss" or "shard": how the step was poisoned on :func:`inf_rank`.
    poisoned: str
    #: Whether this rank's local shards changed in the step (bitwise).
    changed: bool
    #: Whether the reference's parameters changed.
    ref_changed: bool
    #: The scale after ``update()``: this rank's scaler's and the reference's.
    scale: float
    ref_scale: float
    #: The update against the reference's (finite steps; an empty comparison otherwise).
    update: TensorComparison
    #: This rank's loss of its slice and the reference's (before any poisoning).
    loss: float
    ref_loss: float
    #: The model's own fp16 noise at this step (finite steps; 0.0 otherwise): the reference's
    #: update against an fp32 step's (``max_rel`` as ``update``'s), and the largest relative
    #: difference of a slice's fp16 loss from its fp32 loss.
    noise: float
    loss_noise: float


class LossScalingResult(TypedDict):
    rank: int
    version: str
    world_size: int
    steps: list[StepRecord]
    #: Every full parameter finite after the run.
    finite: bool
    #: The parameter whose gradient shard held the inf at the ``shard`` step ("" elsewhere).
    poisoned_param: str
    input_casts: InputCasts | None


def _local_state(model: nn.Module) -> list[torch.Tensor]:
    dtensor = _compat.dtensor_cls()
    return [
        (p.to_local() if isinstance(p, dtensor) else p).detach().clone() for p in model.parameters()
    ]


def _changed(model: nn.Module, before: Sequence[torch.Tensor]) -> bool:
    return any(not torch.equal(a, b) for a, b in zip(_local_state(model), before))


class _Reference:
    """The single-process scaler: fp32 parameters, fp16 compute under autocast, each slice's
    loss divided by the world size; and beside it the same model stepped in fp32 from the same
    parameters on the same slices, which measures the model's own fp16 noise
    (:data:`NOISE_FACTOR`)."""

    def __init__(self, model: nn.Module, ctx: RankContext) -> None:
        self.model = model
        self.fp32 = copy.deepcopy(model)
        self.ranks = RankBuffers(model)  # each slice with its rank's buffers, as on the ranks
        self.ctx = ctx
        #: Each slice's fp16 loss at the last step.
        self.losses: list[float] = []
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        self.scaler = torch.amp.GradScaler(
            ctx.device_type,
            init_scale=INIT_SCALE,
            growth_factor=GROWTH_FACTOR,
            backoff_factor=BACKOFF_FACTOR,
            growth_interval=GROWTH_INTERVAL,
        )

    def noise(self, slices: Sequence[Any]) -> tuple[dict[str, torch.Tensor], list[float]]:
        """The fp32 step from the reference's current state: each parameter's SGD update and
        each slice's loss (nothing of the reference changes)."""
        self.fp32.load_state_dict(self.model.state_dict())
        self.fp32.zero_grad(set_to_none=True)
        losses = []
        for part in slices:
            loss = model_loss(self.fp32, part)
            (loss / len(slices)).backward()
            losses.append(float(loss))
        update = {
            n: -LR * p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for n, p in self.fp32.named_parameters(remove_duplicate=False)
        }
        return update, losses

    def step(self, slices: Sequence[Any], poisoned: str) -> float:
        """One step; this rank's slice's loss."""
        self.losses = []
        for r, part in enumerate(slices):
            with self.ranks.as_rank(r), torch.autocast(self.ctx.device_type, torch.float16):
                loss = model_loss(self.model, part)
            self.losses.append(float(loss))
            if poisoned == "loss" and r == inf_rank(len(slices)):
                loss = loss * math.inf
            self.scaler.scale(loss / len(slices)).backward()
        if poisoned == "shard":
            poison_shard(self.model)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return self.losses[self.ctx.rank]


def fp16_overflow(model: nn.Module, slices: Sequence[Any]) -> list[str]:
    """The parameters whose gradient is not finite when a copy of ``model`` computes wholly in
    fp16, as FSDP's ``param_dtype=float16`` makes it compute (LayerNorm and softmax included;
    batch norm kept in fp32, as FSDP1 keeps it and the suite's FSDP2 fix does), at the
    scaler's initial scale. The reference autocasts, which keeps those ops in fp32: a model
    whose gradients overflow only in whole-fp16 compute (a zero-initialized token through a
    LayerNorm of eps 1e-12: an inverse deviation of 1e6) makes every sharded step skip while
    the reference's are finite, and cannot be judged against it."""
    probe = copy.deepcopy(model).half()
    for module in probe.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.float()
            module.register_forward_pre_hook(
                lambda _m, args: _compat.tree_map(_cast(torch.float32), args)
            )
            module.register_forward_hook(
                lambda _m, _a, out: _compat.tree_map(_cast(torch.float16), out)
            )
    for part in slices:
        loss = model_loss(probe, _compat.tree_map(_cast(torch.float16), part))
        (loss.float() * INIT_SCALE / len(slices)).backward()
    return [
        n
        for n, p in probe.named_parameters()
        if p.grad is not None and not bool(p.grad.isfinite().all())
    ]


def _cast(dtype: torch.dtype) -> Callable[[Any], Any]:
    def cast(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return cast


def _fp32_only(model: nn.Module) -> None:
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes != {torch.float32}:
        skip_rank(
            f"fp16 loss scaling trains fp32 parameters in fp16 compute; {type(model).__name__} "
            f"builds its parameters in {', '.join(sorted(map(str, dtypes)))}: pass a factory "
            "that builds it in fp32"
        )


def _build(ctx: RankContext, spec: ModelSpec, version: str, casts: bool) -> tuple[Any, ...]:
    def fp16(model: nn.Module, policy: Any) -> nn.Module:
        _fp32_only(model)
        mixed = param_dtype_kwargs(version, "fp16", known_fix=casts)
        return shard(model, ctx, version, policy, **mixed)

    side = build_side(ctx, spec, fp16, steps=STEPS)
    return side.sharded, _Reference(side.reference.model, ctx), side.batches


def _sharded_step(
    ctx: RankContext, sharded: nn.Module, scaler: Any, optimizer: Any, part: Any, poisoned: str
) -> tuple[float, str]:
    loss = model_loss(sharded, part)
    value = float(loss)
    mine = ctx.rank == inf_rank(ctx.world_size)
    if poisoned == "loss" and mine:
        loss = loss * math.inf
    scaled_backward(scaler, loss)
    name = poison_shard(sharded) if poisoned == "shard" and mine else ""
    scaler_step(scaler, optimizer)
    scaler_update(scaler)
    optimizer.zero_grad(set_to_none=True)
    return value, name


def _train(ctx: RankContext, spec: ModelSpec, version: str, casts: bool) -> LossScalingResult:
    sharded, ref, batches = _build(ctx, spec, version, casts)
    overflow = fp16_overflow(ref.model, batches[0])
    if overflow:
        skip_rank(
            f"{type(ref.model).__name__}'s gradients overflow fp16 when it computes wholly in "
            f"fp16, as FSDP's param_dtype=float16 makes it (at scale {INIT_SCALE:g}: "
            f"{', '.join(overflow[:4])}{' ...' if len(overflow) > 4 else ''}), where the "
            "single-process reference autocasts (LayerNorm and softmax in fp32): the scaler "
            "would skip every step, so fp16 loss scaling cannot be judged on this model (a "
            "finding about the model in fp16: train it in bf16, or keep its norms in fp32)"
        )
    scaler = make_scaler(version, ctx.device_type)
    optimizer = torch.optim.SGD(sharded.parameters(), lr=LR)
    records: list[StepRecord] = []
    poisoned_param = ""
    for step in range(STEPS):
        poisoned = POISONED.get(step, "")
        before = full_params(sharded, version)
        ref_before = reference_params(ref.model)
        local = _local_state(sharded)
        loss, name = _sharded_step(
            ctx, sharded, scaler, optimizer, batches[step][ctx.rank], poisoned
        )
        poisoned_param = poisoned_param or name
        fp32_update, fp32_losses = ref.noise(batches[step]) if not poisoned else ({}, [])
        ref_loss = ref.step(batches[step], poisoned)
        after = full_params(sharded, version)
        seen = observe_update(
            after, before, ref.model, ref_before, torch.float32, floor_share=FLOOR_SHARE
        )
        noise = compare_tensors(seen["ref"], fp32_update, floor_share=FLOOR_SHARE)["max_rel"]
        loss_noise = max(
            (abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ref.losses, fp32_losses)),
            default=0.0,
        )
        records.append(
            {
                "poisoned": poisoned,
                "changed": _changed(sharded, local),
                "ref_changed": any(bool(t.any()) for t in seen["ref"].values()),
                "scale": float(scaler.get_scale()),
                "ref_scale": float(ref.scaler.get_scale()),
                "update": seen["comparison"],
                "loss": loss,
                "ref_loss": ref_loss,
                "noise": noise if fp32_update else 0.0,
                "loss_noise": loss_noise,
            }
        )
    final = full_params(sharded, version)
    return {
        "rank": ctx.rank,
        "version": version,
        "world_size": ctx.world_size,
        "steps": records,
        "finite": all(bool(t.isfinite().all()) for t in final.values()),
        "poisoned_param": poisoned_param,
        "input_casts": None,
    }


def rank_loss_scaling(
    ctx: RankContext,
    spec: ModelSpec,
    version: str = "fsdp1",
    fault: str | Sequence[str] | None = None,
) -> LossScalingResult:
    """``STEPS`` fp16 steps with the version's scaler, two of them poisoned on one rank."""
    check_fsdp_version(version)
    if ctx.world_size < 2:
        skip_rank("loss scaling across ranks needs at least 2 ranks")
    with FAULTS.inject(fault, ctx):
        result, casts = with_known_fix(version, True, lambda cast: _train(ctx, spec, version, cast))
    return {**result, "input_casts": casts}


# --------------------------------------------------------------------------------------------
# The verdict
# --------------------------------------------------------------------------------------------


def expected_scales(poisoned: Sequence[str]) -> list[float]:
    """The scale after each step's ``update()``: times ``BACKOFF_FACTOR`` after a step with a
    non-finite gradient, times ``GROWTH_FACTOR`` after ``GROWTH_INTERVAL`` finite steps in a row."""
    scale, run, out = INIT_SCALE, 0, []
    for p in poisoned:
        if p:
            scale, run = scale * BACKOFF_FACTOR, 0
        else:
            run += 1
            if run == GROWTH_INTERVAL:
                scale, run = scale * GROWTH_FACTOR, 0
        out.append(scale)
    return out


def _skip_problems(values: Sequence[LossScalingResult]) -> list[str]:
    problems = []
    for i, step in enumerate(values[0]["steps"]):
        expect_skip = bool(step["poisoned"])
        applied = [v["rank"] for v in values if v["steps"][i]["changed"]]
        skipped = [v["rank"] for v in values if not v["steps"][i]["changed"]]
        what = f"step {i} ({step['poisoned'] or 'finite'})"
        if applied and skipped:
            problems.append(
                f"{what}: ranks disagree on skipping it: rank(s) {applied} applied their update, "
                f"rank(s) {skipped} skipped it: the found-inf is not synchronised across ranks"
            )
        elif expect_skip and applied:
            problems.append(
                f"{what}: a non-finite gradient on rank {inf_rank(len(values))} and every rank "
                "applied the step (it must be skipped everywhere)"
            )
        elif not expect_skip and skipped:
            problems.append(f"{what}: finite gradients and every rank skipped the step")
        if step["ref_changed"] == expect_skip:
            problems.append(f"{what}: the reference scaler did not do what it must (harness bug)")
    return problems


def _scale_problems(values: Sequence[LossScalingResult]) -> list[str]:
    problems = []
    expected = expected_scales([s["poisoned"] for s in values[0]["steps"]])
    for i, want in enumerate(expected):
        scales = {v["rank"]: v["steps"][i]["scale"] for v in values}
        ref = values[0]["steps"][i]["ref_scale"]
        if len(set(scales.values())) > 1:
            problems.append(f"step {i}: the scale differs across ranks after update(): {scales}")
        elif next(iter(scales.values())) != want or ref != want:
            problems.append(
                f"step {i}: scale {next(iter(scales.values()))} after update() (the reference "
                f"scaler's {ref}), expected {want} (init {INIT_SCALE}, x{BACKOFF_FACTOR} after a "
                f"non-finite step, x{GROWTH_FACTOR} after {GROWTH_INTERVAL} finite steps)"
            )
    return problems


class Tolerances(TypedDict):
    """The parity tolerances of one run, from the model's measured fp16 noise."""

    update: float
    loss: float
    #: The largest measured noise over every finite step and rank: update, loss.
    noise: float
    loss_noise: float
    #: Whether a tolerance the noise asks for exceeds :data:`NOISE_CAP` (then capped).
    too_noisy: bool


def tolerances(values: Sequence[LossScalingResult]) -> Tolerances:
    """:data:`NOISE_FACTOR` times the measured noise, never below the fixed tolerances, never
    above :data:`NOISE_CAP`."""
    finite = [s for v in values for s in v["steps"] if not s["poisoned"]]
    noise = max((s.get("noise", 0.0) for s in finite), default=0.0)
    loss_noise = max((s.get("loss_noise", 0.0) for s in finite), default=0.0)
    update, loss = max(UPDATE_RTOL, NOISE_FACTOR * noise), max(LOSS_RTOL, NOISE_FACTOR * loss_noise)
    return {
        "update": min(update, NOISE_CAP),
        "loss": min(loss, NOISE_CAP),
        "noise": noise,
        "loss_noise": loss_noise,
        "too_noisy": max(update, loss) > NOISE_CAP,
    }


def _noise_problems(tol: Tolerances) -> list[str]:
    if not tol["too_noisy"]:
        return []
    return [
        f"the model is too noisy in fp16 to judge a sharded step against the reference: an "
        f"fp16 step of it in one process differs from its fp32 step by {tol['noise']:.2e} of "
        f"the update (loss {tol['loss_noise']:.2e}); {NOISE_FACTOR:g} x that exceeds the cap "
        f"{NOISE_CAP:g} below which a fault still shows (not a finding about FSDP: train it in "
        "bf16 or fp32, or check fp16 scaling on a model whose fp16 step is stable)"
    ]


def _parity_problems(values: Sequence[LossScalingResult], tol: Tolerances) -> list[str]:
    problems = []
    for v in values:
        if not v["finite"]:
            problems.append(f"rank {v['rank']}: non-finite parameters after the run")
        for i, step in enumerate(v["steps"]):
            rel = abs(step["loss"] - step["ref_loss"]) / max(abs(step["ref_loss"]), 1e-12)
            if rel > tol["loss"]:
                problems.append(
                    f"rank {v['rank']}: step {i}: loss {step['loss']:.6g} vs the reference's "
                    f"{step['ref_loss']:.6g} (relative {rel:.1e} > {tol['loss']:.1e})"
                )
            c = step["update"]
            if not step["poisoned"] and c["max_rel"] > tol["update"]:
                problems.append(
                    f"rank {v['rank']}: step {i} update: {c['worst']} differs from the "
                    f"reference by {c['max_rel']:.2e} of its scale > {tol['update']:.1e}"
                )
    return problems


def _tolerance_note(tol: Tolerances) -> str:
    return (
        f"tolerance {tol['update']:.1e} of the update, {tol['loss']:.1e} of the loss "
        f"({NOISE_FACTOR:g} x the model's own fp16 noise, measured against an fp32 step: "
        f"{tol['noise']:.1e} and {tol['loss_noise']:.1e}; at least {UPDATE_RTOL:g} and "
        f"{LOSS_RTOL:g}, at most {NOISE_CAP:g})"
    )


def verdict_loss_scaling(values: Sequence[LossScalingResult], params: Mapping[str, Any]) -> Verdict:
    """Every poisoned step skipped on every rank, every finite one applied everywhere; the
    scale identical on every rank, equal to the schedule and the reference scaler's; every
    finite step's update equal to the reference's within fp16's tolerance."""
    tol = tolerances(values)
    problems = _skip_problems(values) + _scale_problems(values) + _parity_problems(values, tol)
    finite = [s["update"]["max_rel"] for v in values for s in v["steps"] if not s["poisoned"]]
    figures = {
        "update_rel_diff": max(finite, default=0.0),
        "update_rtol": tol["update"],
        "fp16_noise": tol["noise"],
        "scales": [s["scale"] for s in values[0]["steps"]],
        "skipped_steps": [i for i, s in enumerate(values[0]["steps"]) if not s["changed"]],
        "steps": STEPS,
    }
    data = {
        "poisoned_param": next((v["poisoned_param"] for v in values if v["poisoned_param"]), ""),
        "tolerances": dict(tol),
    }
    note = input_casts_note(values[0]["input_casts"])
    if problems:
        return Verdict(
            False,
            f"fp16 loss scaling differs from a single-process scaler ({_tolerance_note(tol)}):"
            "\n  " + "\n  ".join(dict.fromkeys(_noise_problems(tol) + problems)),
            figures,
            data,
        )
    if tol["too_noisy"]:
        # Every step skipped and applied as it should, the scales right, every update within
        # the capped tolerance (a fault moves an update by its whole size): what is left, a
        # finer comparison, the model's own fp16 noise does not allow.
        raise CheckSkipped(_noise_problems(tol)[0])
    return Verdict(
        True,
        f"{STEPS} fp16 steps: the steps with an inf gradient on rank {inf_rank(len(values))} "
        f"(its loss, steps {INF_LOSS_STEP}; its reduced shard, step {INF_SHARD_STEP}) skipped "
        f"on every rank; scales {figures['scales']} identical on every rank and equal to the "
        f"reference scaler's; finite updates equal the reference's to "
        f"{figures['update_rel_diff']:.1e} ({_tolerance_note(tol)})" + note,
        figures,
        data,
    )
