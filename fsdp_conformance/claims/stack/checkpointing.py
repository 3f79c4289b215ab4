"""``stack.checkpointing``: activation checkpointing through torch's public APIs, applied as
users apply it, trained against the single-process reference, with what torch did observed.

The settings (:data:`SETTINGS`), each on its own sharded ``odd`` model, beside ``none`` (the same
model sharded without checkpointing, the baseline of the keys and collectives):

* FSDP1 ``after_wrap <impl>``: ``FullyShardedDataParallel`` first, then
  ``apply_activation_checkpointing(model, checkpoint_wrapper_fn=partial(checkpoint_wrapper,
  checkpoint_impl=...), check_fn=isinstance(m, <block classes>))`` on the blocks inside the units
  (accelerate's and torchtitan's order: FSDP's hooks outside the checkpointed region).
* FSDP1 ``before_wrap <impl>``: ``apply_activation_checkpointing`` first, then the auto-wrap
  policy. ``transformer_auto_wrap_policy`` finds the block inside the ``CheckpointWrapper``
  (``layers.0._checkpoint_wrapped_module``) and wraps it, so the checkpointed region holds the
  unit's hooks: the recompute runs FSDP's forward again.
* FSDP2 ``before_shard <impl>``: ``checkpoint_wrapper`` on each block, then ``fully_shard`` on
  each wrapper (torchtitan's order), then on the root.

``<impl>`` is ``CheckpointImpl.NO_REENTRANT`` or ``REENTRANT``. Observed per setting, per step:
the update against the reference's (parity), the collectives per unit per phase, the forwards
of the blocks' modules during backward (the recompute: once per block, never outside the blocks);
after training, the model's state-dict keys (FSDP1 full and sharded, FSDP2
``get_model_state_dict`` with options unset) and the optimizer's FQNs
(``get_optimizer_state_dict``), against the plain model's and the ``none`` setting's.

The user's code is this module's :func:`apply_checkpointing`, which :data:`FAULTS` patch, with
torch's ``apply_activation_checkpointing`` and the state-dict API's prefix.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from fsdp_conformance import _compat
from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import Fault, FaultTable, patched, patched_attr
from fsdp_conformance.claims.stack.common import (
    LR,
    PER_RANK,
    STEPS,
    Side,
    build_side,
    parity_problems,
    per_unit,
)
from fsdp_conformance.fsdp.collectives import UnitSizes, record_collectives, unit_sizes
from fsdp_conformance.fsdp.reference_step import (
    TensorComparison,
    full_params,
    model_loss,
    observe_update,
    reference_params,
    reported_dtype,
    sgd_step,
)
from fsdp_conformance.fsdp.sharding import check_fsdp_version, shard_fsdp1, shard_fsdp2_modules
from fsdp_conformance.fsdp.state_dict_kinds import get_state
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.models.model_spec import BuiltModel, ModelSpec, call_model
from fsdp_conformance.models.units import clean_fqn, planned_unit_modules

#: The settings each check trains, beside ``none`` (no checkpointing: the baseline).
#: ``stack.checkpointing.reentrant_outside_unit`` is FSDP1's reentrant checkpoint around the unit
#: (``before_wrap REENTRANT``), kept apart: on torch 2.13 it all-gathers each block twice in
#: backward (docs/stack/checkpointing.md), a known behaviour that must not hide the others.
SETTINGS: dict[tuple[str, str], tuple[str, ...]] = {
    ("fsdp1", "main"): (
        "after_wrap NO_REENTRANT",
        "after_wrap REENTRANT",
        "before_wrap NO_REENTRANT",
    ),
    ("fsdp1", "reentrant_outside_unit"): ("before_wrap REENTRANT",),
    ("fsdp2", "main"): ("before_shard NO_REENTRANT", "before_shard REENTRANT"),
}
BASELINE = "none"


def settings_of(version: str, part: str) -> tuple[str, ...]:
    """``none`` and the settings of (``version``, ``part``); an unknown pair raises naming the
    known ones."""
    if (version, part) not in SETTINGS:
        raise ValueError(
            f"no checkpointing settings for {(version, part)}; choose {list(SETTINGS)}"
        )
    return (BASELINE, *SETTINGS[(version, part)])


def strip_wrapper(name: str) -> str:
    """``name`` without the ``_checkpoint_wrapped_module`` components (and FSDP1's)."""
    inserted = _compat.checkpoint_wrapped_prefix()
    return clean_fqn(".".join(p for p in name.split(".") if p != inserted))


# --------------------------------------------------------------------------------------------
# The user's code
# --------------------------------------------------------------------------------------------


def apply_checkpointing(
    model: nn.Module,
    blocks: tuple[type[nn.Module], ...],
    impl: str,
    left_out: Collection[int] = (),
) -> None:
    """``apply_activation_checkpointing`` on every module of ``blocks`` but those in
    ``left_out`` (identities), as users write it."""
    module = _compat.checkpoint_wrapper_module()
    wrapper = functools.partial(
        module.checkpoint_wrapper, checkpoint_impl=module.CheckpointImpl[impl]
    )
    module.apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=wrapper,
        check_fn=lambda m: isinstance(m, blocks) and id(m) not in left_out,
    )


def inputs_without_grad(
    model: nn.Module, blocks: tuple[type[nn.Module], ...], batch: Any
) -> dict[int, str]:
    """The modules of ``blocks`` (identity: FQN) none of whose tensor inputs requires grad in a
    forward of ``batch`` (on a copy: running statistics stay as they were): the blocks a user
    leaves out of REENTRANT checkpointing, which would give their parameters no gradient
    (torch: "None of the inputs have requires_grad=True"), as transformers' gradient
    checkpointing checkpoints only the layers that carry the hidden states (ViT's embeddings,
    fed the pixels, are a block class of its ``_no_split_modules`` but never checkpointed)."""
    probe = copy.deepcopy(model)
    names = dict(zip(map(id, probe.modules()), map(id, model.modules()), strict=True))
    seen: dict[int, bool] = {}
    handles = []
    for module in probe.modules():
        if isinstance(module, blocks):

            def hook(m: nn.Module, args: Any, kwargs: Any, key: int = id(module)) -> None:
                tensors = [
                    t for t in _compat.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                ]
                seen[key] = seen.get(key, False) or any(t.requires_grad for t in tensors)

            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    call_model(probe, batch)
    for handle in handles:
        handle.remove()
    fqns = {id(m): strip_wrapper(n) for n, m in model.named_modules()}
    return {names[k]: fqns[names[k]] for k, grad in seen.items() if not grad}


def cache_off(model: nn.Module) -> None:
    """``config.use_cache = False`` on every module that has that setting (transformers: T5's
    encoder and decoder stacks hold copies of the model's config), as users training with
    checkpointing set it and as transformers' own gradient checkpointing does ("use_cache=True is
    incompatible with gradient checkpointing"): a forward appending to a key/value cache gives
    the recompute a cache already holding the first forward's entries (measured: Bloom and
    Falcon raise on the doubled length, Phi-3's reentrant recompute trains wrong weights, T5's
    decoder saves a different number of tensors in the recompute)."""
    for module in model.modules():
        config: Any = getattr(module, "config", None)
        if getattr(config, "use_cache", None):
            config.use_cache = False


def _shard(
    ctx: RankContext, spec: ModelSpec, version: str, setting: str, found: list[Any]
) -> Callable[[nn.Module, Any], nn.Module]:
    """The user's setup of ``setting`` as a function of (model, policy); the block classes
    resolved on the model go into ``found``."""
    order, _, impl = setting.partition(" ")

    def shard(model: nn.Module, policy: Any) -> nn.Module:
        built = BuiltModel(spec, model)
        blocks = built.blocks
        cache_off(model)
        left_out = (
            inputs_without_grad(model, blocks, built.batch(PER_RANK, ctx.device))
            if impl == "REENTRANT"
            else {}
        )
        found.append((blocks, sorted(left_out.values())))
        if version == "fsdp1":
            if order == "before_wrap":
                apply_checkpointing(model, blocks, impl, left_out)
            sharded = shard_fsdp1(model, ctx, policy)
            if order == "after_wrap":
                apply_checkpointing(sharded, blocks, impl, left_out)
            return sharded
        planned = [m for m in planned_unit_modules(model, policy) if m is not model]
        if order == "before_shard":
            apply_checkpointing(model, blocks, impl, left_out)
        # fully_shard each unit: a checkpointed block through its wrapper (torchtitan's order).
        parent = {
            id(child): module
            for module in model.modules()
            for child in module.children()
            if _compat.checkpoint_wrapped_prefix() in dict(module.named_children())
        }
        # Deepest first, whatever the plan's order: a size-rule unit above block units (a
        # container of blocks) is sharded after the blocks inside it.
        return shard_fsdp2_modules(model, ctx, [parent.get(id(unit), unit) for unit in planned])

    return shard


# --------------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------------


def _perturbing_recompute(original: Callable[..., None]) -> Callable[..., None]:
    """Checkpointing applied, and every second forward of each block's first module (the
    recompute, when checkpointing is in effect) off by 0.01."""

    def call(
        model: nn.Module, blocks: tuple[type[nn.Module], ...], impl: str, left_out: Any = ()
    ) -> None:
        original(model, blocks, impl, left_out)
        for module in model.modules():
            if isinstance(module, blocks):
                first = next(module.children())
                calls = [0]

                def perturb(m: nn.Module, args: Any, out: Any, calls: list[int] = calls) -> Any:
                    calls[0] += 1
                    return out + 0.01 if calls[0] % 2 == 0 else out

                first.register_forward_hook(perturb)

    return call


def _unstripped_optimizer(ctx: RankContext) -> Any:
    owner, name = _compat.dcp_checkpoint_prefix_owner()
    return patched(owner, name, lambda original: "\0never a module name\0")


@contextlib.contextmanager
def _unstripped_model(ctx: RankContext) -> Iterator[None]:
    """The wrapper's state-dict post hook (a static method, registered when a wrapper is built)
    leaves the keys as they are."""
    owner, name = _compat.checkpoint_state_dict_hook_owner()
    original = vars(owner)[name]
    setattr(owner, name, staticmethod(lambda module, state_dict, prefix, *args: state_dict))
    try:
        yield
    finally:
        setattr(owner, name, original)


FAULTS = FaultTable(
    reentrant_on_inputs_without_grad=Fault(
        "REENTRANT checkpointing applied to every block, those whose inputs need no gradient "
        "too (ViT's embeddings, fed the pixels): their parameters get no gradient",
        lambda ctx: patched_attr(
            __name__, "inputs_without_grad", lambda original: lambda *args: {}
        ),
    ),
    checkpoint_dropped=Fault(
        "torch's apply_activation_checkpointing does nothing: every number agrees, no block is "
        "recomputed in backward",
        lambda ctx: patched(
            _compat.checkpoint_wrapper_module(),
            "apply_activation_checkpointing",
            lambda original: lambda *args, **kwargs: None,
        ),
    ),
    recompute_perturbed=Fault(
        "the recomputed forward of each block differs from its first forward (its first "
        "module's output off by 0.01): the gradients are taken on other activations",
        lambda ctx: patched_attr(__name__, "apply_checkpointing", _perturbing_recompute),
    ),
    keys_prefixed=Fault(
        "checkpoint_wrapper's state-dict hook no longer strips _checkpoint_wrapped_module: the "
        "model's state-dict keys keep it",
        _unstripped_model,
    ),
    optimizer_fqns_prefixed=Fault(
        "torch.distributed.checkpoint.state_dict no longer strips _checkpoint_wrapped_module "
        "from the optimizer's FQNs (pytorch/pytorch#124546's kind)",
        _unstripped_optimizer,
    ),
)

# --------------------------------------------------------------------------------------------
# Observing
# --------------------------------------------------------------------------------------------


class _Forwards:
    """Calls per phase: of each block (clean FQN; the block module's own forward pre-hook, the
    first thing a recompute runs: non-reentrant checkpointing stops a recompute once it has
    what backward needs, so a block's last modules may not run again), and ``""`` of the leaf
    modules outside every block."""

    def __init__(self, model: nn.Module, blocks: tuple[type[nn.Module], ...]) -> None:
        self.phase = ""
        self.counts: dict[str, collections.Counter[str]] = {}
        inside: set[int] = set()
        for name, module in model.named_modules():
            if isinstance(module, blocks):
                key = strip_wrapper(name)
                module.register_forward_pre_hook(lambda m, a, key=key: self._count(key))
                inside.update(id(inner) for inner in module.modules())
        for module in model.modules():
            if id(module) not in inside and next(module.children(), None) is None:
                module.register_forward_pre_hook(lambda m, a: self._count(""))

    def _count(self, key: str) -> None:
        self.counts.setdefault(self.phase, collections.Counter())[key] += 1

    def take(self) -> dict[str, dict[str, int]]:
        out = {phase: dict(c) for phase, c in self.counts.items()}
        self.counts = {}
        return out


class SettingRun(TypedDict):
    """One setting trained on one rank."""

    setting: str
    #: Per step: per phase (forward, backward), per collective kind, records per unit name.
    collectives: list[dict[str, dict[str, dict[str, int]]]]
    #: Per step: per phase, forwards of the leaf modules per block ("": outside every block).
    forwards: list[dict[str, dict[str, int]]]
    losses: list[float]
    ref_losses: list[float]
    steps: list[TensorComparison]
    #: The blocks left out of checkpointing (REENTRANT: their inputs need no gradient).
    not_checkpointed: list[str]
    #: torch's warnings in the forwards that say gradients will be lost (reentrant
    #: checkpointing of a block none of whose inputs requires grad), distinct.
    lost_gradients: list[str]
    #: The model's state-dict keys per kind as torch returned them, sorted.
    model_keys: dict[str, list[str]]
    #: ``get_optimizer_state_dict``'s FQNs: its "state" keys and its first group's "params".
    optim_state: list[str]
    optim_params: list[str]


class CheckpointingResult(TypedDict):
    rank: int
    version: str
    world_size: int
    dtype: str
    #: The units (clean FQNs, "" the root), the plain model's state-dict keys and parameters.
    units: list[str]
    plain_keys: list[str]
    plain_params: list[str]
    runs: list[SettingRun]


def _unit_sizes(model: nn.Module, version: str, world_size: int) -> UnitSizes:
    # FSDP1: a CheckpointWrapper forwards attribute reads to the unit it wraps, so it reads as
    # that unit too; one name per unit.
    found = unit_sizes(model, version, world_size)
    out = UnitSizes(owners={key: strip_wrapper(name) for key, name in found.owners.items()})
    for name, sizes in found.items():
        out.setdefault(strip_wrapper(name), sizes)
    return out


def _whole(model: nn.Module, version: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {strip_wrapper(k): v for k, v in full_params(model, version, dtype).items()}


def _keys(model: nn.Module, version: str) -> dict[str, list[str]]:
    if version == "fsdp1":
        return {kind: sorted(get_state(model, version, kind)) for kind in ("full", "sharded")}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {"get_model_state_dict": sorted(get_model_state_dict(model))}


def _optimizer_fqns(model: nn.Module) -> tuple[list[str], list[str]]:
    """An Adam with learning rate 0 stepped once on zero gradients (its state exists, the
    parameters do not move), read back with ``get_optimizer_state_dict``."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    opt = torch.optim.Adam(model.parameters(), lr=0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    state: Any = get_optimizer_state_dict(model, opt)
    for p in model.parameters():
        p.grad = None
    params = [str(n) for group in state["param_groups"] for n in group["params"]]
    return sorted(map(str, state["state"])), sorted(params)


def _train(
    ctx: RankContext,
    side: Side,
    version: str,
    setting: str,
    found: tuple[tuple[type[nn.Module], ...], list[str]],
) -> SettingRun:
    blocks, left_out = found
    forwards = _Forwards(side.sharded, blocks)
    run: SettingRun = {
        "setting": setting,
        "not_checkpointed": left_out,
        "collectives": [],
        "forwards": [],
        "losses": [],
        "ref_losses": [],
        "steps": [],
        "lost_gradients": [],
        "model_keys": {},
        "optim_state": [],
        "optim_params": [],
    }
    with record_collectives(_unit_sizes(side.sharded, version, ctx.world_size)) as recorder:
        for step in range(STEPS):
            recorder.phase = forwards.phase = ""
            before = _whole(side.sharded, version, side.dtype)
            ref_before = reference_params(side.reference.model, side.dtype)
            recorder.phase = forwards.phase = "forward"
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss = model_loss(side.sharded, side.batches[step][ctx.rank])
            for w in caught:
                text = str(w.message).strip()
                if "requires_grad=True" in text and text not in run["lost_gradients"]:
                    run["lost_gradients"].append(text)
            recorder.phase = forwards.phase = "backward"
            loss.backward()
            recorder.phase = forwards.phase = ""
            run["collectives"].append({p: per_unit(recorder, p) for p in ("forward", "backward")})
            recorder.records.clear()
            run["forwards"].append(forwards.take())
            run["losses"].append(float(loss))
            run["ref_losses"].append(side.reference.forward_backward(side.batches[step])[ctx.rank])
            sgd_step(side.sharded, LR)
            sgd_step(side.reference.model, LR)
            after = _whole(side.sharded, version, side.dtype)
            seen = observe_update(after, before, side.reference.model, ref_before, side.dtype)
            run["steps"].append(seen["comparison"])
    run["model_keys"] = _keys(side.sharded, version)
    run["optim_state"], run["optim_params"] = _optimizer_fqns(side.sharded)
    return run


# --------------------------------------------------------------------------------------------
# The rank function
# --------------------------------------------------------------------------------------------


def rank_checkpointing(
    ctx: RankContext,
    spec: ModelSpec,
    version: str = "fsdp1",
    part: str = "main",
    settings: Sequence[str] = (),
    fault: str | Sequence[str] | None = None,
) -> CheckpointingResult:
    """``none`` and every setting of (``version``, ``part``) (``settings``: these instead), each
    on its own sharded model."""
    check_fsdp_version(version)
    if ctx.world_size < 2:
        skip_rank(
            "checkpointing under FSDP needs at least 2 ranks to shard anything (FSDP1 runs "
            "NO_SHARD at world size 1); run at world size >= 2"
        )
    chosen = tuple(settings) or settings_of(version, part)
    with FAULTS.inject(fault, ctx):
        runs = []
        for setting in chosen:
            found: list[Any] = []
            side = build_side(ctx, spec, _shard(ctx, spec, version, setting, found))
            runs.append(_train(ctx, side, version, setting, found[0]))
        plain = side.reference.model
        return {
            "rank": ctx.rank,
            "version": version,
            "world_size": ctx.world_size,
            "dtype": str(side.dtype),
            "units": sorted(_unit_sizes(side.sharded, version, ctx.world_size)),
            "plain_keys": sorted(plain.state_dict()),
            "plain_params": sorted(n for n, _ in plain.named_parameters()),
            "runs": runs,
        }


# --------------------------------------------------------------------------------------------
# The verdicts
# --------------------------------------------------------------------------------------------


def _key_problems(
    label: str, run: SettingRun, v: CheckpointingResult, base: SettingRun
) -> list[str]:
    out = []
    wanted = {
        **{
            f"model {k}": (got, v["plain_keys"], base["model_keys"].get(k))
            for k, got in run["model_keys"].items()
        },
        "optimizer state": (run["optim_state"], v["plain_params"], base["optim_state"]),
        "optimizer param_groups": (run["optim_params"], v["plain_params"], base["optim_params"]),
    }
    for what, (got, plain, baseline) in wanted.items():
        for name, want in (
            ("the plain model's", plain),
            ("the unwrapped sharded model's", baseline),
        ):
            if got != want:
                odd = sorted(set(got) ^ set(want or []))[:3]
                out.append(f"{label}: {what} keys differ from {name} (e.g. {odd})")
    return out


def _recompute_problems(label: str, run: SettingRun) -> list[str]:
    """Checkpointed: in each backward every block runs forward again exactly as many times as in
    the forward, and no module outside the blocks does; ``none``: nothing runs forward in
    backward."""
    out = []
    checkpointed = run["setting"] != BASELINE
    for i, phases in enumerate(run["forwards"]):
        fwd, bwd = phases.get("forward", {}), phases.get("backward", {})
        for block in sorted(set(fwd) | set(bwd)):
            recomputed = checkpointed and block and block not in run.get("not_checkpointed", [])
            want = fwd.get(block, 0) if recomputed else 0
            if bwd.get(block, 0) != want:
                where = f"block {block!r}" if block else "outside the blocks"
                out.append(
                    f"{label}: backward {i}: {bwd.get(block, 0)} forward(s) {where}, "
                    f"expected {want} ({'one recompute per block' if checkpointed else 'no recompute'})"
                )
    return out


def _gather_problems(label: str, run: SettingRun, units: Sequence[str]) -> list[str]:
    """One all-gather per unit in forward; in backward one per non-root unit (FSDP1 keeps the
    root gathered after forward, as FSDP2 does with the root's option not passed), none for
    the root, and one reduce-scatter per unit. Units of equal size (``a|b``) are counted
    together against the sum of their expectations."""
    want = {
        ("forward", "all_gather"): dict.fromkeys(units, 1),
        ("backward", "all_gather"): {u: int(u != "") for u in units},
        ("backward", "reduce_scatter"): dict.fromkeys(units, 1),
    }
    out = []
    for i, step in enumerate(run["collectives"]):
        for (phase, op), per in want.items():
            counts = step.get(phase, {}).get(op, {})
            for unit in units:
                name = next((n for n in counts if unit in n.split("|")), unit)
                got = sum(n for nm, n in counts.items() if unit in nm.split("|"))
                expected = sum(per.get(u, 0) for u in name.split("|"))
                if got != expected:
                    out.append(
                        f"{label}: {phase} {i}: {got} {op}(s) for unit {name!r}, "
                        f"expected {expected}"
                    )
    return out


def verdict_checkpointing(
    values: Sequence[CheckpointingResult], params: Mapping[str, Any]
) -> Verdict:
    """Per setting: parity with the reference; the blocks recomputed once in each backward
    (none without checkpointing); one all-gather per unit per phase (the root's none in
    backward), no duplicates from the recompute; the model's and the optimizer's state-dict
    keys those of the plain model and of the same model sharded without checkpointing."""
    version = params.get("version", "fsdp1")
    expected = tuple(params.get("settings", ())) or settings_of(version, params.get("part", "main"))
    problems: list[str] = []
    for v in values:
        ran = {r["setting"]: r for r in v["runs"]}
        if BASELINE not in ran or any(s not in ran for s in expected):
            problems.append(f"rank {v['rank']}: ran {sorted(ran)}, not {list(expected)}")
            continue
        dtype = reported_dtype(v["dtype"])
        for setting in expected:
            run, label = ran[setting], f"rank {v['rank']}: {setting}"
            problems += [
                f"{label}: torch warned in forward: {text!r}: a block checkpointed with "
                "REENTRANT whose inputs do not require grad is left out of backward (its "
                "parameters get no gradient); use CheckpointImpl.NO_REENTRANT for it"
                for text in run["lost_gradients"]
            ]
            problems += parity_problems(
                label, run["losses"], run["ref_losses"], run["steps"], dtype
            )
            problems += _recompute_problems(label, run)
            problems += _gather_problems(label, run, v["units"])
            problems += _key_problems(label, run, v, ran[BASELINE])
    runs = {r["setting"]: r for r in values[0]["runs"] if r["setting"] in expected}
    figures: dict[str, Any] = {
        "update_rel_diff": max(
            (s["max_rel"] for v in values for r in v["runs"] for s in r["steps"]), default=0.0
        ),
        "settings": len(expected) - 1,
        "steps": STEPS,
    }
    for setting, r in runs.items():
        tag = setting.replace(" ", "_").lower()
        for phase in ("forward", "backward"):
            gathers = r["collectives"][0].get(phase, {}).get("all_gather", {})
            figures[f"{tag}.{phase}_all_gathers"] = sum(gathers.values())
        figures[f"{tag}.recomputed_forwards"] = sum(r["forwards"][0].get("backward", {}).values())
    data = {
        s: {
            "all_gathers_per_unit": {
                p: r["collectives"][0].get(p, {}).get("all_gather", {})
                for p in ("forward", "backward")
            },
            "module_forwards": r["forwards"][0],
            "model_keys": {k: len(ks) for k, ks in r["model_keys"].items()},
        }
        for s, r in runs.items()
    }
    what = f"activation checkpointing ({', '.join(s for s in expected if s != BASELINE)})"
    if problems:
        return Verdict(
            False,
            f"{what}: "
            + "\n  ".join(
                ["torch did not do what checkpointing should:", *dict.fromkeys(problems)]
            ),
            figures,
            data,
        )
    left_out = sorted({b for r in runs.values() for b in r.get("not_checkpointed", [])})
    note = (
        f"; REENTRANT left out {len(left_out)} block(s) whose inputs need no gradient, as users "
        f"leave them out ({', '.join(repr(b) for b in left_out[:4])}: a reentrant checkpoint "
        "there gives their parameters no gradient)"
        if left_out
        else ""
    )
    return Verdict(
        True,
        f"{what}: each trained {STEPS} steps equal to the reference (worst "
        f"{figures['update_rel_diff']:.1e}); every checkpointed block recomputed once per "
        "backward; one all-gather per unit per phase; state-dict and optimizer FQNs those of the "
        f"plain model{note}",
        figures,
        data,
    )
