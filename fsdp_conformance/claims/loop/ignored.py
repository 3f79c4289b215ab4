"""``loop.ignored``: a module the user keeps out of FSDP stays the user's: local, unsharded,
its gradients never reduced, its values in the state dict.

The user's code (:func:`ignore_kwargs`, which the fault of :data:`FAULTS` patches): FSDP1
``FullyShardedDataParallel(..., ignored_modules=[module])``, FSDP2 ``fully_shard(...,
ignored_params=set(module.parameters()))`` on every unit and the root. The module ignored is
``ignore`` (the odd model's batch norm, ``norm``: a normalisation layer users keep local, in
full precision or out of the flat parameters); on a model without a module of that name, its
last normalisation layer with parameters.

One optimizer step on one micro-batch, and observed:

* **Local and unsharded**: each ignored parameter is a plain parameter of the sharded model by
  its own name, of its full shape on every rank, and in no FSDP unit (FSDP1: in no flat
  parameter; FSDP2: in no parameter group; read from FSDP's own state,
  :func:`~fsdp_conformance.models.units.actual_units`).
* **Not reduced**: every collective of the step served an FSDP unit (none of them holds an
  ignored parameter), each unit that trains reduced once; the ignored parameters' update on
  rank ``r`` is this rank's own slice's gradient alone, unscaled: ``W * c_r``, where ``c_r`` is
  what the :class:`~fsdp_conformance.fsdp.reference_step.SliceReference` accumulates for slice
  ``r`` (its loss divided by the world size ``W``; :class:`SliceGradients` notes it slice by
  slice). A rank's loss is not divided by ``W`` and nothing averages an ignored gradient, so
  ``W * c_r`` is exactly the gradient of rank ``r``'s loss; the reference's own update of the
  ignored parameters (the mean over slices) is what FSDP would have applied had it reduced
  them. Every other parameter's update equals the reference's (the mean), as in every loop.
  The ranks' ignored parameters therefore differ after the step: synchronising them
  (an all-reduce of their gradients, or keeping them frozen) is the user's business, not
  proven here.
* **In the state dict**: FSDP1's full state dict and FSDP2's ``get_model_state_dict`` carry
  each ignored parameter as a plain tensor of its full shape, equal to this rank's own
  parameter after the step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from fsdp_conformance import _compat
from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import Fault, FaultTable, patched_attr
from fsdp_conformance.claims.loop.common import (
    LR,
    LoopResult,
    Pair,
    apply_sgd,
    build_pair,
    failed_verdict,
    loop_result,
    match_units,
    observe_step,
    parity_figures,
    parity_note,
    parity_problems,
    phases,
    reduced_units,
    snapshot,
    trainable_units,
)
from fsdp_conformance.fsdp import capabilities
from fsdp_conformance.fsdp.collectives import UNKNOWN_UNIT
from fsdp_conformance.fsdp.reference_step import full_params, model_loss
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.units import actual_units, clean_fqn

#: The module the check ignores on the reference model (the odd model's batch norm).
IGNORE = "norm"
#: Below this share, the ranks' own gradients of the ignored parameters are too close to their
#: mean for the update to tell "left local" from "averaged": the check says so.
DISTINGUISHABLE = 1e-3
#: The micro-batch phase whose collectives are judged.
PHASE = "micro 0.0"

# --------------------------------------------------------------------------------------------
# The user's code
# --------------------------------------------------------------------------------------------


def ignore_kwargs(model: nn.Module, version: str, module: nn.Module) -> dict[str, Any]:
    """The user's ignore list for ``module``, as each FSDP version takes it."""
    if version == "fsdp1":
        return {"ignored_modules": [module]}
    return {"ignored_params": set(module.parameters())}


def ignored_module(model: nn.Module, name: str) -> tuple[str, nn.Module]:
    """The module named ``name`` when the model has one with parameters; else the model's last
    normalisation layer with parameters of its own (a user's model); none: the check skips."""
    modules = {clean_fqn(n): m for n, m in model.named_modules()}
    found = modules.get(name)
    if found is not None and any(True for _ in found.parameters()):
        return name, found
    norms = [
        (n, m)
        for n, m in modules.items()
        if "norm" in type(m).__name__.lower() and any(True for _ in m.parameters(recurse=False))
    ]
    if not norms:
        skip_rank(
            f"does not apply to {type(model).__name__}: it has no module {name!r} with "
            "parameters and no normalisation layer with parameters, which the check keeps out of "
            "FSDP as users keep a small replicated module"
        )
    return norms[-1]


# --------------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------------


FAULTS = FaultTable(
    ignored_sharded=Fault(
        "the ignore list is not passed (no ignored_modules / ignored_params): FSDP shards the "
        "module the user meant to keep local and averages its gradients",
        lambda ctx: patched_attr(__name__, "ignore_kwargs", lambda original: lambda *a: {}),
    ),
)

# --------------------------------------------------------------------------------------------
# The per-rank reference
# --------------------------------------------------------------------------------------------


class SliceGradients:
    """The reference's loss (:func:`~fsdp_conformance.fsdp.reference_step.model_loss`) that notes,
    as each slice starts, the gradients accumulated so far of ``names``: consecutive notes
    differ by one slice's gradient (its loss divided by the world size, as the reference
    scales it)."""

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        params = dict(model.named_parameters())
        self.params = {n: params[n] for n in names}
        self.notes: list[dict[str, torch.Tensor]] = []

    def _now(self) -> dict[str, torch.Tensor]:
        return {
            n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            for n, p in self.params.items()
        }

    def __call__(self, model: nn.Module, part: Any) -> torch.Tensor:
        self.notes.append(self._now())
        return model_loss(model, part)

    def per_slice(self) -> list[dict[str, torch.Tensor]]:
        """Each slice's gradient of the named parameters (call after the micro-batch)."""
        marks = [*self.notes, self._now()]
        return [{n: b[n] - a[n] for n in a} for a, b in zip(marks, marks[1:])]


def _local_vs_mean(mine: Mapping[str, torch.Tensor], mean: Mapping[str, torch.Tensor]) -> float:
    """How far this rank's own gradient is from the mean over slices (its scale)."""
    out = 0.0
    for name, own in mine.items():
        scale = max(float(mean[name].abs().max()), 1e-30)
        out = max(out, float((own - mean[name]).abs().max()) / scale)
    return out


# --------------------------------------------------------------------------------------------
# The rank function
# --------------------------------------------------------------------------------------------


class IgnoredParam(TypedDict):
    """One ignored parameter on one rank, as FSDP left it."""

    #: Its type among the sharded model's parameters by its own name ("Parameter", "DTensor");
    #: "" when the sharded model lists no parameter of that name (FSDP1's flat parameter).
    type: str
    local_shape: list[int]
    shape: list[int]
    #: The FSDP unit whose state holds it (None: no unit).
    unit: str | None
    #: The state dict's entry: its type ("" missing), shape, and whether it is bitwise this
    #: rank's parameter after the step.
    state_dict_type: str
    state_dict_shape: list[int]
    state_dict_is_param: bool


class IgnoredResult(LoopResult):
    """A rank's step with a module ignored."""

    ignored_module: str
    params: dict[str, IgnoredParam]
    #: The units the step's reductions served, the units that train, and collectives of a size
    #: no unit has ("op bytes").
    reduced: list[str]
    trainable_units: list[str]
    unmatched: list[str]
    #: This rank's own gradient of the ignored parameters against the mean over slices.
    local_vs_mean: float


def _state_dict(pair: Pair) -> dict[str, Any]:
    """FSDP1's full state dict, FSDP2's ``get_model_state_dict`` (its default, sharded)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=pair.version == "fsdp1")
    return {clean_fqn(k): v for k, v in get_model_state_dict(pair.sharded, options=options).items()}


def _local(param: torch.Tensor, dtensor: type[Any]) -> torch.Tensor:
    return param.to_local() if isinstance(param, dtensor) else param


def _facts(pair: Pair, names: Sequence[str]) -> dict[str, IgnoredParam]:
    sharded = {clean_fqn(n): p for n, p in pair.sharded.named_parameters()}
    full = {n: list(p.shape) for n, p in pair.reference.model.named_parameters()}
    holder = {p: u.fqn for u in actual_units(pair.sharded) for p in u.params}
    after = full_params(pair.sharded, pair.version, pair.dtype)
    state = _state_dict(pair)
    dtensor = _compat.dtensor_cls()
    out: dict[str, IgnoredParam] = {}
    for name in names:
        param = sharded.get(name)
        entry = state.get(name)
        plain = isinstance(entry, torch.Tensor) and not isinstance(entry, dtensor)
        same = False
        if isinstance(entry, torch.Tensor) and plain and entry.shape == after[name].shape:
            same = torch.equal(entry.detach().to(pair.dtype), after[name])
        out[name] = {
            "type": "" if param is None else type(param).__name__,
            "local_shape": [] if param is None else list(_local(param, dtensor).shape),
            "shape": full[name],
            "unit": holder.get(name),
            "state_dict_type": "" if entry is None else type(entry).__name__,
            "state_dict_shape": list(getattr(entry, "shape", [])),
            "state_dict_is_param": same,
        }
    return out


def rank_ignored(
    ctx: RankContext,
    spec: ModelSpec,
    version: str = "fsdp1",
    ignore: str = IGNORE,
    fault: str | Sequence[str] | None = None,
) -> IgnoredResult:
    """One optimizer step with ``ignore`` kept out of FSDP, sharded and on the reference."""
    if version == "fsdp2":
        capabilities.require(capabilities.FSDP2_IGNORED_PARAMS)
    with FAULTS.inject(fault, ctx):
        pair = build_pair(
            ctx,
            spec,
            version,
            sharded_kwargs=lambda twin: ignore_kwargs(
                twin, version, ignored_module(twin, ignore)[1]
            ),
        )
        fqn, module = ignored_module(pair.reference.model, ignore)
        names = [f"{fqn}.{n}" if fqn else n for n, _ in module.named_parameters()]
        before, ref_before = snapshot(pair)
        slices = SliceGradients(pair.reference.model, names)
        with phases(pair) as recorder:
            recorder.phase = PHASE
            loss = model_loss(pair.sharded, pair.mine[0])
            loss.backward()
            ref_losses = pair.reference.forward_backward(pair.batches[0], slices)
            recorder.phase = "optimizer 0"
            apply_sgd(pair.sharded, LR)
            apply_sgd(pair.reference.model, LR)
            recorder.phase = "observe 0"
            per_slice = slices.per_slice()
            world = ctx.world_size
            mine = {n: world * g for n, g in per_slice[ctx.rank].items()}
            mean = {n: torch.stack([s[n] for s in per_slice]).sum(0) for n in names}
            expected = {n: -LR * g.to(pair.dtype) for n, g in mine.items()}
            step = observe_step(pair, before, ref_before, expected=expected)
            params = _facts(pair, names)
        unmatched = [
            f"{r['op']} of {r['in_bytes']} bytes ({r['phase']})"
            for r in recorder.records
            if r["unit"] == UNKNOWN_UNIT and not r["phase"].startswith("observe")
        ]
        return {
            **loop_result(pair, [float(loss)], [ref_losses[ctx.rank]], [step]),
            "ignored_module": fqn,
            "params": params,
            "reduced": reduced_units(recorder).get(PHASE, []),
            "trainable_units": trainable_units(pair),
            "unmatched": unmatched,
            "local_vs_mean": _local_vs_mean(mine, mean),
        }


# --------------------------------------------------------------------------------------------
# The verdict
# --------------------------------------------------------------------------------------------


def _param_problems(rank: int, name: str, p: IgnoredParam) -> list[str]:
    problems = []
    where = f"rank {rank}: ignored parameter {name}"
    if p["type"] not in ("Parameter", "Tensor"):
        problems.append(
            f"{where} is sharded: FSDP holds it as a {p['type']}"
            if p["type"]
            else f"{where} is sharded: the sharded model has no parameter of that name "
            "(FSDP1 flattened it into a flat parameter)"
        )
    elif p["local_shape"] != p["shape"]:
        problems.append(f"{where} is sharded: local shape {p['local_shape']} of {p['shape']}")
    if p["unit"] is not None:
        problems.append(
            f"{where} is managed by FSDP unit {p['unit']!r}: its all-gathers and "
            "reduce-scatters carry it (pass the module in ignored_modules / its parameters "
            "in ignored_params)"
        )
    if not p["state_dict_type"]:
        problems.append(f"{where} is missing from the state dict")
    elif p["state_dict_type"] in ("DTensor", "ShardedTensor"):
        problems.append(f"{where}: the state dict carries it as a {p['state_dict_type']}")
    elif p["state_dict_shape"] != p["shape"] or not p["state_dict_is_param"]:
        problems.append(
            f"{where}: the state dict's entry (shape {p['state_dict_shape']}) is not this "
            "rank's parameter after the step"
        )
    return problems


def _collective_problems(v: IgnoredResult) -> list[str]:
    problems = []
    missing, unexpected = match_units(v["reduced"], v["trainable_units"])
    if missing or unexpected:
        problems.append(
            f"rank {v['rank']}: the step's reductions served {sorted(v['reduced'])}, expected "
            f"one per unit that trains {v['trainable_units']}"
        )
    if v["unmatched"]:
        problems.append(
            f"rank {v['rank']}: collectives of a size no FSDP unit has (they may carry the "
            f"ignored parameters): {', '.join(v['unmatched'][:4])}"
        )
    return problems


def verdict_ignored(values: Sequence[IgnoredResult], params: Mapping[str, Any]) -> Verdict:
    """The ignored parameters are local, unsharded, unreduced (each rank's update its own
    slice's gradient) and in the state dict, on every rank; every other update equals the
    reference's."""
    problems = parity_problems(values)
    for v in values:
        for name, p in v["params"].items():
            problems += _param_problems(v["rank"], name, p)
        problems += _collective_problems(v)
        if v["local_vs_mean"] < DISTINGUISHABLE:
            problems.append(
                f"rank {v['rank']}: its own gradient of the ignored parameters is within "
                f"{v['local_vs_mean']:.1e} of the mean over slices: the update cannot tell "
                "local from averaged (the slices are too alike)"
            )
    module = values[0]["ignored_module"]
    figures = {
        **parity_figures(values),
        "ignored_params": len(values[0]["params"]),
        "local_vs_mean": min(v["local_vs_mean"] for v in values),
    }
    data = {
        "ignored_module": module,
        "params": {str(v["rank"]): v["params"] for v in values},
        "reduced": values[0]["reduced"],
        "trainable_units": values[0]["trainable_units"],
    }
    if problems:
        return failed_verdict(
            values,
            f"module {module!r} ignored by FSDP: not left to the user",
            problems,
            figures,
            data,
        )
    return Verdict(
        True,
        f"module {module!r} ignored: its {figures['ignored_params']} parameters local, full "
        "shape, in no unit and no collective, each rank's update its own slice's gradient "
        f"({figures['local_vs_mean']:.2f} from the mean), in the state dict as this rank's "
        f"values; every other update equals the reference's (worst "
        f"{figures['update_rel_diff']:.1e})" + parity_note(values),
        figures,
        data,
    )
