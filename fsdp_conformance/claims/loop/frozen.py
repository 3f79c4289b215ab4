"""``loop.frozen`` / ``loop.frozen.unused``: frozen parameters stay bitwise unchanged and their
units issue no gradient reduction; parameters a step leaves unused get no gradient (or a zero
one) and the update equals the single-process reference's.

FSDP1 runs with ``use_orig_params=True`` (what Lightning and accelerate turn on; without it
FSDP1 refuses a unit that mixes frozen and trainable parameters), FSDP2 as it comes.

* ``loop.frozen``: the user's freeze list (:func:`freeze_list`: every parameter of the first
  block, and the first parameter of the second, so that one block's units are wholly frozen and
  another's unit mixes) applied before wrapping, as users do (``build_pair(prepare=...)``), then
  ``STEPS`` optimizer steps with an optimizer over every parameter (``SGD(model.parameters())``).
  Observed: each frozen parameter bitwise unchanged on the full view on every rank and without a
  gradient; every step's update equal to the reference's; in each backward, one reduction per
  unit holding a parameter that trains and none for a unit holding only frozen ones.
* ``loop.frozen.unused``: the ``branch`` reference model, whose input chooses its branches
  (:class:`~fsdp_conformance.models.reference_models.BranchModel`), over :data:`UNUSED_PLAN`: every
  branch taken; rank 0 alone taking the adapter (a parameter in the root unit, used on one rank
  and not the others); no branch taken (the adapter unused inside a unit that runs, and the
  ``extra`` block's units not run at all). FSDP2 needs ``set_reduce_scatter_unused_params(True)``
  when ranks use different parameters (:func:`enable_unused`). Observed: each parameter the
  reference gives no gradient has none or a zero one on every rank (which, per version, is
  reported); every update equals the reference's; every unit holding a used parameter reduced.

The user's code is this module's functions (:func:`freeze`, :func:`optimizer_params`,
:func:`optimizer_step`, :func:`zero_grad`, :func:`enable_unused`), which :data:`FAULTS` patches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fsdp_conformance import _compat
from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import Fault, FaultTable, patched, patched_attr
from fsdp_conformance.claims.loop import common
from fsdp_conformance.claims.loop.common import (
    LR,
    LoopResult,
    Pair,
    build_pair,
    ensure_phases,
    failed_verdict,
    loop_result,
    match_units,
    observe_step,
    parity_figures,
    parity_problems,
    reduced_units,
    snapshot,
    unreduced,
)
from fsdp_conformance.fsdp import capabilities
from fsdp_conformance.fsdp.collectives import record_collectives
from fsdp_conformance.fsdp.reference_step import (
    full_params,
    model_loss,
    reference_grads,
    sgd_update,
)
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.reference_models import ADAPTER_FEATURE, EXTRA_FEATURE
from fsdp_conformance.models.units import clean_fqn

#: Optimizer steps of ``loop.frozen`` (one micro-batch each).
STEPS = 2
#: ``loop.frozen.unused``'s steps: which ranks take the adapter, and whether every rank runs
#: ``extra`` (a unit's forward must run on every rank or on none: FSDP gathers it collectively).
UNUSED_PLAN: tuple[tuple[str, bool], ...] = (("every", True), ("rank 0", True), ("none", False))
#: The reference model ``loop.frozen.unused`` needs (its input chooses its branches).
BRANCH_MODEL = "branch"

# --------------------------------------------------------------------------------------------
# The user's code
# --------------------------------------------------------------------------------------------


def freeze_list(model: nn.Module, blocks: Sequence[type[nn.Module]]) -> list[str]:
    """The parameters the user freezes (clean FQNs): every one of the first block, and the first
    of the second (its unit then mixes frozen and trainable parameters); empty for a model of
    fewer than two blocks."""
    classes: tuple[type[nn.Module], ...] = tuple(blocks)
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, classes)]
    if len(found) < 2:
        return []
    (first, whole), (second, part) = found[:2]
    names = [f"{first}.{n}" for n, _ in whole.named_parameters()]
    names += [f"{second}.{n}" for n, _ in list(part.named_parameters())[:1]]
    return [clean_fqn(n) for n in names]


def declared_frozen(model: nn.Module) -> list[str]:
    """The parameters the model itself declares frozen (``requires_grad=False``), clean FQNs."""
    return [clean_fqn(n) for n, p in model.named_parameters() if not p.requires_grad]


def freeze(model: nn.Module, names: Collection[str]) -> None:
    """The user's freeze: ``requires_grad_(False)`` on each named parameter."""
    for name, param in model.named_parameters():
        if clean_fqn(name) in names:
            param.requires_grad_(False)


def optimizer_params(model: nn.Module, frozen: Collection[str]) -> list[nn.Parameter]:
    """The parameters the user's optimizer holds: all of them (``SGD(model.parameters())``); a
    frozen one has no gradient, so the step leaves it (``frozen`` is what the user froze)."""
    return list(model.parameters())


def optimizer_step(params: Sequence[nn.Parameter], lr: float = LR) -> None:
    """The user's optimizer step: SGD on each parameter that has a gradient."""
    sgd_update(params, lr)


def zero_grad(model: nn.Module) -> None:
    """The user's ``zero_grad`` after each step."""
    model.zero_grad(set_to_none=True)


def enable_unused(model: nn.Module, version: str) -> None:
    """FSDP2: reduce a zero gradient for a parameter this rank did not use, as torch's docs
    require when ranks use different parameters (FSDP1's flat parameter always reduces whole).
    A torch whose FSDP2 lacks the switch skips the check by capability, naming why."""
    if version != "fsdp2":
        return
    capabilities.require(capabilities.FSDP2_REDUCE_SCATTER_UNUSED_PARAMS)
    _compat.fsdp_module_cls().set_reduce_scatter_unused_params(model, True)


def shard_kwargs(version: str) -> dict[str, Any]:
    """FSDP1 with ``use_orig_params=True`` (a unit may then mix frozen and trainable
    parameters); FSDP2's parameters are its originals already."""
    return {"use_orig_params": True} if version == "fsdp1" else {}


# --------------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------------


def _unfreezing(shard: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    def unfreeze_after(*args: Any, **kwargs: Any) -> nn.Module:
        model = shard(*args, **kwargs)
        model.requires_grad_(True)
        return model

    return unfreeze_after


def _without_frozen(model: nn.Module, frozen: Collection[str]) -> list[nn.Parameter]:
    return [p for n, p in model.named_parameters() if clean_fqn(n) not in frozen]


@contextlib.contextmanager
def _frozen_in_optimizer_only(ctx: RankContext) -> Iterator[None]:
    with (
        patched_attr(__name__, "freeze", lambda original: lambda model, names: None),
        patched_attr(__name__, "optimizer_params", lambda original: _without_frozen),
    ):
        yield


FAULTS = FaultTable(
    frozen_updated=Fault(
        "the user's code turns requires_grad back on after wrapping (model.requires_grad_(True)):"
        " the frozen parameters train",
        lambda ctx: patched(common, "shard_model", _unfreezing),
    ),
    frozen_unit_reduced=Fault(
        "the freeze list is applied to the optimizer's parameters instead of requires_grad: the "
        "frozen parameters do not move (the numbers agree), but their gradients are computed "
        "and every frozen unit reduce-scatters",
        _frozen_in_optimizer_only,
    ),
    stale_gradients=Fault(
        "the user's zero_grad does nothing: each step applies every earlier step's gradients "
        "again, and a parameter unused in a step still carries the last one's",
        lambda ctx: patched_attr(__name__, "zero_grad", lambda original: lambda model: None),
    ),
)

# --------------------------------------------------------------------------------------------
# Observing
# --------------------------------------------------------------------------------------------


def unit_of(name: str, units: Collection[str]) -> str:
    """The unit holding parameter ``name``: the longest unit FQN it lies under (``""`` the
    root), the same rule for FSDP1's flat parameters and FSDP2's units."""
    owners = [u for u in units if not u or name == u or name.startswith(u + ".")]
    return max(owners, key=len, default="")


def units_holding(names: Collection[str], units: Collection[str]) -> list[str]:
    return sorted({unit_of(n, units) for n in names})


def grad_states(model: nn.Module) -> dict[str, str]:
    """Each parameter's gradient on this rank: ``none``, ``empty`` (this rank holds none of
    it), ``zero`` or ``nonzero``."""
    dtensor = _compat.dtensor_cls()
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            out[clean_fqn(name)] = "none"
            continue
        local = grad.to_local() if isinstance(grad, dtensor) else grad
        out[clean_fqn(name)] = (
            "empty" if not local.numel() else "nonzero" if bool(local.any()) else "zero"
        )
    return out


# --------------------------------------------------------------------------------------------
# loop.frozen
# --------------------------------------------------------------------------------------------


class FrozenResult(LoopResult):
    """A rank's loop with a freeze list: the shared fields, the freeze list and the units by
    what they hold, the units reduced per backward, and per step the frozen parameters that
    changed (full view) or had a gradient on this rank."""

    frozen: list[str]
    frozen_units: list[str]
    mixed_units: list[str]
    training_units: list[str]
    reduced: dict[str, list[str]]
    frozen_changed: list[list[str]]
    frozen_grads: list[dict[str, str]]


def _frozen_pair(ctx: RankContext, spec: ModelSpec, version: str) -> tuple[Pair, list[str]]:
    frozen: list[str] = []

    def prepare(model: nn.Module) -> None:
        # A model that declares frozen parameters (requires_grad=False, as a LoRA setup does)
        # is trained as it declares them; one that declares none gets the freeze list.
        declared = declared_frozen(model)
        frozen.extend(declared or freeze_list(model, spec.block_classes(model)))
        if not frozen:
            skip_rank(
                "does not apply to this model: loop.frozen trains the parameters a model "
                "declares frozen (requires_grad=False), or else freezes the first block and part "
                "of the second; the model declares none and has fewer than two blocks of its "
                "block classes"
            )
        freeze(model, frozen)

    pair = build_pair(ctx, spec, version, micro=STEPS, prepare=prepare, **shard_kwargs(version))
    return pair, frozen


def units_by_content(pair: Pair, frozen: Collection[str]) -> tuple[list[str], ...]:
    """The units holding only frozen parameters, both kinds, and a trainable one."""
    units = pair.sizes()
    names = [clean_fqn(n) for n, _ in pair.sharded.named_parameters()]
    with_frozen = set(units_holding([n for n in names if n in frozen], units))
    trains = set(units_holding([n for n in names if n not in frozen], units))
    return sorted(with_frozen - trains), sorted(with_frozen & trains), sorted(trains)


def rank_frozen(
    ctx: RankContext,
    spec: ModelSpec,
    version: str = "fsdp1",
    fault: str | Sequence[str] | None = None,
) -> FrozenResult:
    """``STEPS`` optimizer steps with the user's freeze list, sharded and on the reference."""
    with FAULTS.inject(fault, ctx):
        pair, frozen = _frozen_pair(ctx, spec, version)
        params = optimizer_params(pair.sharded, frozen)
        ref_params = optimizer_params(pair.reference.model, frozen)
        losses, ref_losses, observed, changed, grads = [], [], [], [], []
        with record_collectives(pair.sizes()) as recorder:
            for step in range(STEPS):
                before, ref_before = snapshot(pair)
                recorder.phase = f"micro {step}.0"
                loss = model_loss(pair.sharded, pair.mine[step])
                loss.backward()
                losses.append(float(loss))
                ref_losses.append(pair.reference.forward_backward(pair.batches[step])[ctx.rank])
                recorder.phase = f"optimizer {step}"
                states = grad_states(pair.sharded)
                grads.append({n: states[n] for n in frozen if states.get(n, "none") != "none"})
                optimizer_step(params)
                optimizer_step(ref_params)
                recorder.phase = f"observe {step}"
                observed.append(observe_step(pair, before, ref_before))
                after = full_params(pair.sharded, version, pair.dtype)
                changed.append([n for n in frozen if not torch.equal(after[n], before[n])])
                zero_grad(pair.sharded)
                pair.reference.model.zero_grad(set_to_none=True)
        frozen_units, mixed_units, training_units = units_by_content(pair, frozen)
        return {
            **loop_result(pair, losses, ref_losses, observed),
            "frozen": frozen,
            "frozen_units": frozen_units,
            "mixed_units": mixed_units,
            "training_units": training_units,
            "reduced": ensure_phases(
                reduced_units(recorder), [f"micro {s}.0" for s in range(STEPS)]
            ),
            "frozen_changed": changed,
            "frozen_grads": grads,
        }


def _frozen_collective_problems(v: FrozenResult) -> list[str]:
    problems = []
    for phase, units in v["reduced"].items():
        missing, unexpected = match_units(units, v["training_units"])
        if missing:
            problems.append(unreduced(v["rank"], phase, missing))
        if unexpected:
            problems.append(
                f"rank {v['rank']}: {phase}: {len(unexpected)} gradient reduction(s) beyond one "
                f"per unit that trains ({', '.join(repr(u) for u in unexpected[:4])}): a unit "
                f"holding only frozen parameters ({', '.join(v['frozen_units'][:4])}) "
                "reduce-scatters; freeze with requires_grad_(False) before the backward"
            )
    return problems


def _frozen_problems(v: FrozenResult) -> list[str]:
    problems = []
    for step, names in enumerate(v["frozen_changed"]):
        if names:
            problems.append(
                f"rank {v['rank']}: step {step}: {len(names)} frozen parameter(s) changed (a "
                f"frozen parameter must stay bitwise equal): {', '.join(names[:4])}"
            )
    for step, grads in enumerate(v["frozen_grads"]):
        if grads:
            shown = ", ".join(f"{n} ({s})" for n, s in list(grads.items())[:4])
            problems.append(
                f"rank {v['rank']}: step {step}: {len(grads)} frozen parameter(s) hold a "
                f"gradient (an optimizer with weight decay or momentum would move them): {shown}"
            )
    return problems


def verdict_frozen(values: Sequence[FrozenResult], params: Mapping[str, Any]) -> Verdict:
    """Frozen parameters unchanged and without gradients on every rank, every update equal to
    the reference's, no reduction for a wholly frozen unit, one for each unit that trains."""
    problems = parity_problems(values)
    for v in values:
        problems += _frozen_problems(v) + _frozen_collective_problems(v)
    first = values[0]
    figures = {
        **parity_figures(values),
        "frozen_params": len(first["frozen"]),
        "frozen_units": len(first["frozen_units"]),
        "mixed_units": len(first["mixed_units"]),
        "reduced_per_step": sum(len(u) for u in first["reduced"].values()) // STEPS,
    }
    data = {
        "frozen": first["frozen"],
        "frozen_units": first["frozen_units"],
        "mixed_units": first["mixed_units"],
        "training_units": first["training_units"],
        "reduced": first["reduced"],
    }
    if problems:
        return failed_verdict(
            values,
            "training with frozen parameters differs from the reference or from a freeze",
            problems,
            figures,
            data,
        )
    return Verdict(
        True,
        f"{len(first['frozen'])} frozen parameters bitwise unchanged and without gradients over "
        f"{STEPS} steps on every rank; {figures['frozen_units']} wholly frozen unit(s) never "
        f"reduced, {figures['mixed_units']} mixed; every update equals the reference's "
        f"(worst {figures['update_rel_diff']:.1e})",
        figures,
        data,
    )


# --------------------------------------------------------------------------------------------
# loop.frozen.unused
# --------------------------------------------------------------------------------------------


class UnusedResult(LoopResult):
    """A rank's loop over :data:`UNUSED_PLAN`: per step, the parameters the reference gave no
    gradient (unused on every rank) and this rank's gradient state of each, the units holding a
    used parameter, and the units reduced per backward."""

    plan: list[str]
    unused: list[list[str]]
    unused_grads: list[dict[str, str]]
    used_units: list[list[str]]
    reduced: dict[str, list[str]]


def plan_words(step: int) -> str:
    """Step ``step`` of :data:`UNUSED_PLAN` in words."""
    adapter, extra = UNUSED_PLAN[step]
    takes = {"every": "every rank takes", "rank 0": "rank 0 alone takes", "none": "no rank takes"}
    return f"{takes[adapter]} the adapter, {'every' if extra else 'no'} rank runs extra"


def branch_slices(slices: Sequence[torch.Tensor], step: int) -> list[torch.Tensor]:
    """The step's slices with the branch features set: positive takes the branch."""
    adapter, extra = UNUSED_PLAN[step]
    out = []
    for rank, part in enumerate(slices):
        part = part.clone()
        takes = adapter == "every" or (adapter == "rank 0" and rank == 0)
        for feature, on in ((ADAPTER_FEATURE, takes), (EXTRA_FEATURE, extra)):
            part[..., feature] = part[..., feature].abs() * (1.0 if on else -1.0)
        out.append(part)
    return out


def rank_frozen_unused(
    ctx: RankContext,
    spec: ModelSpec,
    version: str = "fsdp1",
    fault: str | Sequence[str] | None = None,
) -> UnusedResult:
    """:data:`UNUSED_PLAN`'s steps on the branch model, sharded and on the reference."""
    if spec.reference != BRANCH_MODEL:
        skip_rank(
            "does not apply to this model: loop.frozen.unused needs a model whose input chooses "
            f"its branches (the reference model {BRANCH_MODEL!r}); another model cannot be made "
            "to leave a parameter unused from outside"
        )
    with FAULTS.inject(fault, ctx):
        steps = len(UNUSED_PLAN)
        pair = build_pair(ctx, spec, version, micro=steps, **shard_kwargs(version))
        enable_unused(pair.sharded, version)
        params = optimizer_params(pair.sharded, ())
        ref_params = optimizer_params(pair.reference.model, ())
        units = pair.sizes()
        losses, ref_losses, observed = [], [], []
        unused, states, used_units = [], [], []
        with common.phases(pair) as recorder:
            for step in range(steps):
                before, ref_before = snapshot(pair)
                recorder.phase = f"micro {step}.0"
                slices = branch_slices(pair.batches[step], step)
                loss = model_loss(pair.sharded, slices[ctx.rank])
                loss.backward()
                losses.append(float(loss))
                ref_losses.append(pair.reference.forward_backward(slices)[ctx.rank])
                recorder.phase = f"optimizer {step}"
                ref = reference_grads(pair.reference.model)
                unused.append(sorted(n for n, g in ref.items() if g is None))
                mine = grad_states(pair.sharded)
                states.append({n: mine[n] for n in unused[-1]})
                used_units.append(
                    units_holding([n for n, g in ref.items() if g is not None], units)
                )
                optimizer_step(params)
                optimizer_step(ref_params)
                recorder.phase = f"observe {step}"
                observed.append(observe_step(pair, before, ref_before))
                zero_grad(pair.sharded)
                pair.reference.model.zero_grad(set_to_none=True)
        return {
            **loop_result(pair, losses, ref_losses, observed),
            "plan": [plan_words(s) for s in range(steps)],
            "unused": unused,
            "unused_grads": states,
            "used_units": used_units,
            "reduced": ensure_phases(
                reduced_units(recorder), [f"micro {s}.0" for s in range(steps)]
            ),
        }


def _unused_problems(v: UnusedResult) -> list[str]:
    problems = []
    for step, grads in enumerate(v["unused_grads"]):
        bad = [n for n, state in grads.items() if state == "nonzero"]
        if bad:
            problems.append(
                f"rank {v['rank']}: step {step} ({v['plan'][step]}): {len(bad)} parameter(s) no "
                f"rank used hold a nonzero gradient (expected none or zero): {', '.join(bad[:4])}"
            )
    for step, (phase, units) in enumerate(v["reduced"].items()):
        missing, _ = match_units(units, v["used_units"][step])
        if missing:
            where = f"{phase} ({v['plan'][step]})"
            problems.append(unreduced(v["rank"], where, missing, "holding a used parameter"))
    return problems


def unused_grad_kinds(values: Sequence[UnusedResult]) -> dict[str, list[str]]:
    """Per parameter unused in some step, the gradient states seen on any rank in such steps
    (what each FSDP version gives an unused parameter)."""
    kinds: dict[str, set[str]] = {}
    for v in values:
        for grads in v["unused_grads"]:
            for name, state in grads.items():
                kinds.setdefault(name, set()).add(state)
    return {name: sorted(states) for name, states in sorted(kinds.items())}


def verdict_frozen_unused(values: Sequence[UnusedResult], params: Mapping[str, Any]) -> Verdict:
    """Every update equals the reference's, parameters no rank used have no gradient or a zero
    one on every rank, and every unit holding a used parameter is reduced."""
    problems = parity_problems(values)
    for v in values:
        problems += _unused_problems(v)
    first = values[0]
    kinds = unused_grad_kinds(values)
    reduced_unused = [
        match_units(units, used)[1]
        for units, used in zip(first["reduced"].values(), first["used_units"])
    ]
    figures = {**parity_figures(values), "unused_params": len(kinds)}
    data = {
        "plan": first["plan"],
        "unused_grad_kinds": kinds,
        "reduced": first["reduced"],
        "used_units": first["used_units"],
        "reduced_without_use": reduced_unused,
    }
    if problems:
        return failed_verdict(
            values,
            "training with parameters unused in some steps differs from the reference",
            problems,
            figures,
            data,
        )
    seen = sorted({state for states in kinds.values() for state in states})
    return Verdict(
        True,
        f"{len(UNUSED_PLAN)} steps ({'; '.join(first['plan'])}): every update equals the "
        f"reference's (worst {figures['update_rel_diff']:.1e}); {len(kinds)} parameters unused "
        f"in some step got gradients {'/'.join(seen)} and never a nonzero one",
        figures,
        data,
    )
