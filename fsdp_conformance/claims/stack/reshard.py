"""``stack.reshard.after_forward`` / ``stack.reshard.strategies``: the resharding options users
pass explicitly, trained against the single-process reference, with what torch did observed.

* ``after_forward`` (FSDP2): ``fully_shard(..., reshard_after_forward=...)`` with ``True``,
  ``False`` and integers, on the root and on the blocks (every non-root unit the recommended
  policy chooses), one sharded model per setting of :func:`after_forward_settings`. Observed per
  unit: the group its registered parameters are sharded over once the root's forward returned
  (1: unsharded, the world size: fully sharded, an integer between: the smaller mesh), and the
  all-gathers it issued in each backward.
* ``strategies`` (FSDP1): ``sharding_strategy=`` ``FULL_SHARD`` (spelled out), ``SHARD_GRAD_OP``
  and ``NO_SHARD``: the same observations, and the gradient reductions (``NO_SHARD``
  all-reduces instead of reduce-scattering).

Each setting trains :data:`STEPS` SGD steps on the ``odd`` model; every step's update is
compared with the reference's (:class:`~fsdp_conformance.fsdp.reference_step.SliceReference`, both
sides starting each step from the same parameters). What a setting must do is its documented
meaning (:func:`expected_after_forward`, :data:`STRATEGY_MEANING`); a release that changes the
meaning of an explicit option fails here, naming the unit and the option.

The user's code is this module's :func:`fully_shard_unit` (FSDP2's call per unit) and
:func:`wrap_fsdp1` (FSDP1's constructor call), which :data:`FAULTS` patch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from fsdp_conformance import _compat
from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import Fault, FaultTable, patched_attr
from fsdp_conformance.claims.stack.common import (
    LR,
    STEPS,
    Side,
    build_side,
    parity_problems,
    per_unit,
)
from fsdp_conformance.fsdp.collectives import CollectiveRecorder, record_collectives, unit_sizes
from fsdp_conformance.fsdp.reference_step import (
    TensorComparison,
    full_params,
    model_loss,
    observe_update,
    reference_params,
    reported_dtype,
    sgd_step,
)
from fsdp_conformance.fsdp.sharding import check_fsdp_version, device_mesh, shard_fsdp1
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.units import clean_fqn, planned_unit_modules

#: FSDP1's strategies as the check passes them, and what each must do: (the units kept
#: unsharded after forward, "all" or only the "root"; the collective that reduces each unit's
#: gradients in backward). A unit resharded after forward all-gathers again in backward.
STRATEGY_MEANING: dict[str, tuple[str, str]] = {
    # FSDP1 keeps the root's parameters gathered after forward under every strategy
    "FULL_SHARD": ("root", "reduce_scatter"),
    "SHARD_GRAD_OP": ("all", "reduce_scatter"),
    "NO_SHARD": ("all", "all_reduce"),
}

#: One setting of ``reshard_after_forward``: (root's, blocks'); None: not passed.
Setting = tuple[bool | int | None, bool | int | None]


def after_forward_settings(world_size: int, only: Sequence[str] = ()) -> list[Setting]:
    """``True`` and ``False`` on both, each on the root alone, and every divisor of the world
    size as an integer on both (1 and the world size are the boundary cases torch maps to
    ``False`` and ``True``); ``only``: those of these names (:func:`setting_name`)."""
    divisors = [k for k in range(1, world_size + 1) if world_size % k == 0]
    every: list[Setting] = [(True, True), (False, False), (True, None), (False, None)]
    every += [(k, k) for k in divisors]
    return [s for s in every if not only or setting_name(s) in only]


def expected_after_forward(value: bool | int | None, root: bool, world_size: int) -> int:
    """The group a unit's parameters are sharded over after forward, as ``fully_shard``
    documents ``reshard_after_forward``: ``True`` the world, ``False`` 1 (unsharded), an integer
    that size (1: unsharded), not passed (None) ``True`` for a block and ``False`` for the root."""
    if value is None:
        return 1 if root else world_size
    if isinstance(value, bool):
        return world_size if value else 1
    return value


def setting_name(setting: Setting) -> str:
    root, blocks = setting
    return f"root={root} blocks={blocks}"


# --------------------------------------------------------------------------------------------
# The user's code
# --------------------------------------------------------------------------------------------


def fully_shard_unit(
    module: nn.Module, mesh: Any, reshard_after_forward: bool | int | None
) -> None:
    """The user's ``fully_shard`` call on one unit, the option passed only when given."""
    kwargs = (
        {} if reshard_after_forward is None else {"reshard_after_forward": reshard_after_forward}
    )
    _compat.fully_shard()(module, mesh=mesh, **kwargs)


def wrap_fsdp1(model: nn.Module, ctx: RankContext, policy: Any, strategy: str) -> nn.Module:
    """The user's FSDP1 call with ``sharding_strategy=ShardingStrategy.<strategy>``."""
    from torch.distributed.fsdp import ShardingStrategy

    return shard_fsdp1(model, ctx, policy, sharding_strategy=ShardingStrategy[strategy])


def _shard_fsdp2(model: nn.Module, ctx: RankContext, policy: Any, setting: Setting) -> nn.Module:
    mesh = device_mesh(ctx)
    depth = {id(m): n.count(".") + 1 for n, m in model.named_modules() if n}
    blocks = [m for m in planned_unit_modules(model, policy) if m is not model]
    for module in sorted(blocks, key=lambda m: -depth.get(id(m), 0)):
        fully_shard_unit(module, mesh, setting[1])
    fully_shard_unit(model, mesh, setting[0])
    return model


# --------------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------------


def _dropping_option(original: Callable[..., None]) -> Callable[..., None]:
    def call(module: nn.Module, mesh: Any, reshard_after_forward: bool | int | None) -> None:
        original(module, mesh, None)

    return call


def _dropping_strategy(original: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    def call(model: nn.Module, ctx: RankContext, policy: Any, strategy: str) -> nn.Module:
        return shard_fsdp1(model, ctx, policy)

    return call


def _perturbed_after_reshard(original: Callable[..., None]) -> Callable[..., None]:
    """Each unit's forward hook, run after FSDP2's own post-forward reshard: a parameter it
    left sharded comes back off by 0.05 in every element of this rank's shard."""

    def perturb(module: nn.Module, args: Any, output: Any) -> None:
        dtensor = _compat.dtensor_cls()
        with torch.no_grad():
            for param in module.parameters(recurse=False):
                if isinstance(param, dtensor):
                    param.to_local().add_(0.05)

    def call(module: nn.Module, mesh: Any, reshard_after_forward: bool | int | None) -> None:
        original(module, mesh, reshard_after_forward)
        for sub in module.modules():
            sub.register_forward_hook(perturb)

    return call


FAULTS = FaultTable(
    option_dropped=Fault(
        "the user's reshard_after_forward never reaches fully_shard (every unit gets torch's "
        "default): the numbers still agree; what stays gathered and the backward all-gathers show it",
        lambda ctx: patched_attr(__name__, "fully_shard_unit", _dropping_option),
    ),
    strategy_dropped=Fault(
        "the user's sharding_strategy never reaches FullyShardedDataParallel (FULL_SHARD, its "
        "default, instead): the numbers agree; the collectives show it",
        lambda ctx: patched_attr(__name__, "wrap_fsdp1", _dropping_strategy),
    ),
    wrong_after_reshard=Fault(
        "a parameter resharded after forward comes back wrong (this rank's shard off by 0.05): "
        "the backward and the step run on it",
        lambda ctx: patched_attr(__name__, "fully_shard_unit", _perturbed_after_reshard),
    ),
)

# --------------------------------------------------------------------------------------------
# Observing
# --------------------------------------------------------------------------------------------


def _shard_group(param: Any, dtensor: type[Any]) -> int:
    """The number of ranks ``param`` is sharded over (1: a plain, unsharded tensor)."""
    if not isinstance(param, dtensor):
        return 1
    mesh = param.device_mesh
    return math.prod(mesh.size(i) for i, p in enumerate(param.placements) if p.is_shard())


def held_after_forward(model: nn.Module, version: str, world_size: int) -> dict[str, int]:
    """Per unit (clean FQN, ``""`` the root): the group its parameters are sharded over now, as
    registered on the modules (FSDP2: DTensor shards or plain unsharded tensors; FSDP1: the flat
    parameter at its unsharded size (NO_SHARD) or the gathered flat parameter's storage still
    allocated: FSDP1 points the flat parameter back at its shard after every forward and frees
    the gathered storage only where it reshards))."""
    out: dict[str, int] = {}
    if version == "fsdp1":
        for name, module in model.named_modules():
            flat = _compat.fsdp1_flat_param(module)
            if flat is not None:
                whole = flat.numel() >= _compat.fsdp1_unsharded_numel(flat)
                kept = whole or bool(_compat.fsdp1_unsharded_allocated(flat))
                out[clean_fqn(name)] = 1 if kept else world_size
        return out
    dtensor = _compat.dtensor_cls()
    for name, module in model.named_modules():
        state = _compat.fsdp2_state(module)
        if state is None:
            continue
        groups = {
            _shard_group(getattr(owner, attr), dtensor)
            for group in _compat.fsdp2_managed_params(state)
            for _, owners in group
            for owner, attr in owners[:1]
        }
        if groups:
            out[name] = max(groups)
    return out


def gather_groups(recorder: CollectiveRecorder, phase: str) -> dict[str, list[int]]:
    """Per unit name, the ranks each all-gather of ``phase`` spanned (its output's bytes over
    its input's: FSDP gathers equal shards), sorted and distinct."""
    out: dict[str, set[int]] = {}
    for r in recorder.records:
        if r["phase"] == phase and r["op"] == "all_gather" and r["in_bytes"]:
            out.setdefault(r["unit"], set()).add(r["out_bytes"] // r["in_bytes"])
    return {unit: sorted(groups) for unit, groups in out.items()}


class SettingRun(TypedDict):
    """One setting trained on one rank."""

    setting: str
    #: Per unit, the group its parameters were sharded over after each step's forward.
    held: list[dict[str, int]]
    #: Per step's backward: per collective kind, the records per unit name.
    backward: list[dict[str, dict[str, int]]]
    #: Per step's backward: per unit name, the ranks its all-gathers spanned.
    gather_groups: list[dict[str, list[int]]]
    losses: list[float]
    ref_losses: list[float]
    steps: list[TensorComparison]


class ReshardResult(TypedDict):
    rank: int
    version: str
    world_size: int
    dtype: str
    #: The units (clean FQNs, "" the root) with parameters.
    units: list[str]
    runs: list[SettingRun]


def _train(ctx: RankContext, side: Side, version: str, name: str) -> SettingRun:
    run: SettingRun = {
        "setting": name,
        "held": [],
        "backward": [],
        "gather_groups": [],
        "losses": [],
        "ref_losses": [],
        "steps": [],
    }
    with record_collectives(unit_sizes(side.sharded, version, ctx.world_size)) as recorder:
        for step in range(STEPS):
            recorder.phase = "observe"
            before = full_params(side.sharded, version, side.dtype)
            ref_before = reference_params(side.reference.model, side.dtype)
            recorder.phase = "forward"
            loss = model_loss(side.sharded, side.batches[step][ctx.rank])
            run["held"].append(held_after_forward(side.sharded, version, ctx.world_size))
            recorder.phase = f"backward {step}"
            loss.backward()
            run["losses"].append(float(loss))
            recorder.phase = "reference"
            run["ref_losses"].append(side.reference.forward_backward(side.batches[step])[ctx.rank])
            sgd_step(side.sharded, LR)
            sgd_step(side.reference.model, LR)
            recorder.phase = "observe"
            after = full_params(side.sharded, version, side.dtype)
            seen = observe_update(after, before, side.reference.model, ref_before, side.dtype)
            run["steps"].append(seen["comparison"])
        run["backward"] = [per_unit(recorder, f"backward {s}") for s in range(STEPS)]
        run["gather_groups"] = [gather_groups(recorder, f"backward {s}") for s in range(STEPS)]
    return run


def _result(ctx: RankContext, version: str, runs: list[SettingRun], side: Side) -> ReshardResult:
    return {
        "rank": ctx.rank,
        "version": version,
        "world_size": ctx.world_size,
        "dtype": str(side.dtype),
        "units": sorted(unit_sizes(side.sharded, version, ctx.world_size)),
        "runs": runs,
    }


# --------------------------------------------------------------------------------------------
# The rank functions
# --------------------------------------------------------------------------------------------


def _needs_two_ranks(ctx: RankContext) -> None:
    if ctx.world_size < 2:
        skip_rank(
            "resharding has nothing to observe at world size 1 (every unit is whole on its one "
            "rank, and FSDP1 runs NO_SHARD whatever the strategy); run at world size >= 2"
        )


def rank_reshard_after_forward(
    ctx: RankContext,
    spec: ModelSpec,
    version: str = "fsdp2",
    only: Sequence[str] = (),
    fault: str | Sequence[str] | None = None,
) -> ReshardResult:
    """Every setting of :func:`after_forward_settings` (``only``: those named), each on its own
    sharded model."""
    if check_fsdp_version(version) != "fsdp2":
        raise ValueError("reshard_after_forward is FSDP2's option; FSDP1's is sharding_strategy")
    _needs_two_ranks(ctx)
    with FAULTS.inject(fault, ctx):
        runs = []
        for setting in after_forward_settings(ctx.world_size, only):

            def fsdp2(model: nn.Module, policy: Any, s: Setting = setting) -> nn.Module:
                return _shard_fsdp2(model, ctx, policy, s)

            side = build_side(ctx, spec, fsdp2)
            runs.append(_train(ctx, side, version, setting_name(setting)))
        return _result(ctx, version, runs, side)


def rank_reshard_strategies(
    ctx: RankContext,
    spec: ModelSpec,
    version: str = "fsdp1",
    fault: str | Sequence[str] | None = None,
) -> ReshardResult:
    """Every strategy of :data:`STRATEGY_MEANING`, each on its own sharded model."""
    if check_fsdp_version(version) != "fsdp1":
        raise ValueError("sharding_strategy is FSDP1's option; FSDP2's is reshard_after_forward")
    _needs_two_ranks(ctx)
    with FAULTS.inject(fault, ctx):
        runs = []
        for strategy in STRATEGY_MEANING:

            def fsdp1(model: nn.Module, policy: Any, s: str = strategy) -> nn.Module:
                return wrap_fsdp1(model, ctx, policy, s)

            side = build_side(ctx, spec, fsdp1)
            runs.append(_train(ctx, side, version, strategy))
        return _result(ctx, version, runs, side)


# --------------------------------------------------------------------------------------------
# The verdicts
# --------------------------------------------------------------------------------------------


def _parity_problems(v: ReshardResult, run: SettingRun) -> list[str]:
    label = f"rank {v['rank']}: {run['setting']}"
    steps = run["steps"]
    return parity_problems(
        label, run["losses"], run["ref_losses"], steps, reported_dtype(v["dtype"])
    )


def _expected(counts: Mapping[str, int], unit: str, per_unit: Mapping[str, int]) -> int:
    """The records of ``counts`` that name ``unit`` there must be: a name ``a|b`` (units of
    equal size, which a record cannot tell apart) counts each of their records, so its
    expectation is the sum of theirs."""
    name = next((n for n in counts if unit in n.split("|")), unit)
    return sum(per_unit.get(u, 0) for u in name.split("|"))


def _count(counts: Mapping[str, int], unit: str) -> int:
    return sum(n for name, n in counts.items() if unit in name.split("|"))


def _held_problems(label: str, run: SettingRun, held: Mapping[str, int]) -> list[str]:
    problems = []
    for step, got in enumerate(run["held"]):
        for unit, want in held.items():
            if got.get(unit) != want:
                problems.append(
                    f"{label}: after forward {step}, unit {unit!r} is sharded over "
                    f"{got.get(unit)} rank(s), not {want} (1: kept unsharded)"
                )
    return problems


def _backward_problems(
    label: str, run: SettingRun, held: Mapping[str, int], reduction: Mapping[str, str]
) -> list[str]:
    """Each unit resharded after forward (``held`` > 1) all-gathers once in each backward, a
    unit kept unsharded never; each reduces its gradients once with ``reduction[unit]``, and
    never with the other."""
    expected = {
        "all_gather": {u: int(h > 1) for u, h in held.items()},
        "reduce_scatter": {u: int(reduction[u] == "reduce_scatter") for u in held},
        "all_reduce": {u: int(reduction[u] == "all_reduce") for u in held},
    }
    problems = []
    for step, ops in enumerate(run["backward"]):
        for op, per_unit_want in expected.items():
            counts = ops.get(op, {})
            for unit in held:
                got, want = _count(counts, unit), _expected(counts, unit, per_unit_want)
                if got != want:
                    problems.append(
                        f"{label}: backward {step}: {got} {op}(s) for unit {unit!r}, "
                        f"expected {want}"
                    )
    return problems + _group_problems(label, run, held)


def _group_problems(label: str, run: SettingRun, held: Mapping[str, int]) -> list[str]:
    """A unit resharded after forward to a group of k ranks is all-gathered in backward over
    those k (an integer ``reshard_after_forward`` below the world size: the smaller mesh)."""
    problems = []
    for step, groups in enumerate(run["gather_groups"]):
        for name, spans in groups.items():
            want = {held.get(u, 0) for u in name.split("|")}
            if set(spans) - want:
                problems.append(
                    f"{label}: backward {step}: unit {name!r} all-gathered over {spans} rank(s), "
                    f"not the {sorted(want)} it was resharded to after forward"
                )
    return problems


def _verdict(
    values: Sequence[ReshardResult],
    meanings: Sequence[tuple[str, dict[str, int], dict[str, str]]],
    what: str,
) -> Verdict:
    """``meanings``: per setting, its name, the group each unit must be sharded over after
    forward, and each unit's gradient reduction."""
    problems: list[str] = []
    for v in values:
        if [r["setting"] for r in v["runs"]] != [m[0] for m in meanings]:
            problems.append(f"rank {v['rank']}: ran {[r['setting'] for r in v['runs']]}")
            continue
        for run, (name, held, reduction) in zip(v["runs"], meanings):
            label = f"rank {v['rank']}: {name}"
            problems += _parity_problems(v, run)
            problems += _held_problems(label, run, held)
            problems += _backward_problems(label, run, held, reduction)
    runs = values[0]["runs"]
    figures = {
        "update_rel_diff": max(
            (s["max_rel"] for v in values for r in v["runs"] for s in r["steps"]), default=0.0
        ),
        "settings": len(runs),
        "steps": STEPS,
    }
    data = {
        r["setting"]: {
            "held_after_forward": r["held"][0],
            "backward_all_gathers": r["backward"][0].get("all_gather", {}),
            "backward_gather_groups": r["gather_groups"][0],
            "backward_reductions": {
                op: r["backward"][0].get(op, {}) for op in ("reduce_scatter", "all_reduce")
            },
        }
        for r in runs
    }
    if problems:
        return Verdict(
            False,
            f"{what}: torch did not do what the options say:\n  "
            + "\n  ".join(dict.fromkeys(problems)),
            figures,
            data,
        )
    return Verdict(
        True,
        f"{what}: {len(runs)} settings, each trained {STEPS} steps equal to the reference (worst "
        f"{figures['update_rel_diff']:.1e}); every unit sharded after forward as its option "
        "says, all-gathered in backward only where resharded, reduced as its strategy says",
        figures,
        data,
    )


def verdict_reshard_after_forward(
    values: Sequence[ReshardResult], params: Mapping[str, Any]
) -> Verdict:
    """Per setting: parity with the reference, each unit sharded after forward over the group
    its ``reshard_after_forward`` documents (:func:`expected_after_forward`), all-gathered once
    in backward where resharded and never where kept, one reduce-scatter per unit."""
    world = values[0]["world_size"]
    units = values[0]["units"]
    meanings = []
    for setting in after_forward_settings(world, params.get("only", ())):
        held = {
            u: expected_after_forward(setting[0] if u == "" else setting[1], u == "", world)
            for u in units
        }
        meanings.append((setting_name(setting), held, dict.fromkeys(units, "reduce_scatter")))
    return _verdict(values, meanings, "fully_shard(reshard_after_forward=...) on root and blocks")


def verdict_reshard_strategies(
    values: Sequence[ReshardResult], params: Mapping[str, Any]
) -> Verdict:
    """Per strategy: parity with the reference, the units kept unsharded after forward and the
    gradient reduction of :data:`STRATEGY_MEANING`, all-gathers in backward only where a unit
    was resharded."""
    world = values[0]["world_size"]
    units = values[0]["units"]
    meanings = []
    for strategy, (kept, reduction) in STRATEGY_MEANING.items():
        held = {u: 1 if kept == "all" or u == "" else world for u in units}
        meanings.append((strategy, held, dict.fromkeys(units, reduction)))
    return _verdict(values, meanings, "FullyShardedDataParallel(sharding_strategy=...)")
