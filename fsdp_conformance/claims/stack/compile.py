"""``stack.compile``: ``torch.compile`` stacked on FSDP as users write it, trained against the
single-process reference, with the collectives and what Dynamo compiled observed.

* FSDP2: every block (each non-root unit the recommended policy chooses) compiled in place
  after ``fully_shard``, ``block.compile(backend=...)`` (``nn.Module.compile``: the module stays
  where it is, so FQNs and state-dict keys do not change, as ``torch.compile(block)`` assigned
  back would change them with ``_orig_mod.``), the root left eager (``blocks``); and the root
  compiled as well (``blocks and root``: the whole model).
* FSDP1: the wrapped model compiled, ``torch.compile(fsdp_model, backend=...)``, with
  ``use_orig_params=True`` (what Dynamo requires of FSDP1) and with it not passed (what a user
  who forgot gets: recorded, not judged on its compile counts; docs/stack/compile.md).

Each setting trains :data:`STEPS` SGD steps twice, eager and compiled, each sharded the same
way and each against its own :class:`~fsdp_conformance.fsdp.reference_step.SliceReference` (both
sides starting each step from the same parameters). Judged: every loss and update of the
compiled side equal to the reference's; per step, per phase (forward, backward), per unit, the
compiled side's collectives the same as eager's (compile must neither drop nor duplicate a
unit's all-gather or reduce-scatter); Dynamo compiled something (frames and graphs counted from
its counters, ``_compat.dynamo_counters``). The graph breaks, graphs and recompiles are figures,
so ``compare`` shows a change between torch versions.

The user's code is :func:`compile_block` and :func:`compile_model`, which :data:`FAULTS` patch.
"""

from __future__ import annotations

import collections
import contextlib
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from fsdp_conformance import _compat
from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import Fault, FaultTable, patched_attr
from fsdp_conformance.claims.stack.common import (
    LR,
    STEPS,
    build_side,
    parity_problems,
    per_unit,
)
from fsdp_conformance.fsdp.collectives import record_collective_calls, unit_sizes
from fsdp_conformance.fsdp.reference_step import (
    NEGLIGIBLE_SHARE,
    TensorComparison,
    full_params,
    model_loss,
    observe_update,
    reference_params,
    reported_dtype,
    sgd_step,
)
from fsdp_conformance.fsdp.sharding import check_fsdp_version, shard_fsdp1, shard_fsdp2
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.units import planned_unit_modules

# Parity with the reference: the loop claim's tolerances (``reference_step.UPDATE_RTOL`` /
# ``LOSS_RTOL``, docs/loop.md), unchanged: aot_eager runs the same ATen ops as eager (measured:
# 0.0, bit for bit, docs/stack/compile.md).

#: Inductor generates its own kernels and sums in its own order, so a result is known to a few
#: roundings of the values that flow through it, not bit for bit. A tensor whose true gradient is
#: zero (``layers.1.mlp.2.bias`` of the odd model: batch norm follows it and removes any constant
#: it adds) has an update that is rounding alone, 2.2e-5 of the step's largest on torch 2.13.0:
#: inductor's differs from the reference's by 4.1e-8 of the largest update (a third of fp32's
#: eps), 1.9e-3 of its own (docs/stack/compile.md). Under inductor a tensor below this share of
#: the largest update is judged against that floor: 1e-3 x UPDATE_RTOL is 1e-6 of the largest,
#: eight fp32 roundings. aot_eager runs eager's own kernels and keeps the loop's floor.
REORDERED_SHARE = 1e-3

#: Per FSDP version, the settings: (name, figure prefix, whether Dynamo must compile a graph).
SETTINGS: dict[str, tuple[tuple[str, str, bool], ...]] = {
    "fsdp2": (("blocks", "blocks", True), ("blocks and root", "whole", True)),
    "fsdp1": (
        ("use_orig_params=True", "orig_params", True),
        # Dynamo graph-breaks on an FSDP1 module without use_orig_params and runs it eager:
        # recorded (its figures), judged on parity and collectives only.
        ("use_orig_params not passed", "orig_params_unset", False),
    ),
}


# --------------------------------------------------------------------------------------------
# The user's code
# --------------------------------------------------------------------------------------------


def compile_block(module: nn.Module, backend: Any) -> None:
    """The user's in-place compile of one FSDP2 module (``nn.Module.compile``)."""
    module.compile(backend=backend)


def compile_model(model: nn.Module, backend: Any) -> Callable[..., Any]:
    """The user's ``torch.compile(fsdp_model, backend=...)`` (FSDP1)."""
    return torch.compile(model, backend=backend)


def _shard(
    ctx: RankContext, version: str, setting: str, model: nn.Module, policy: Any, backend: Any
) -> tuple[nn.Module, Callable[..., Any]]:
    """``model`` sharded as ``setting`` says, and what the user calls: compiled with
    ``backend`` (None: eager)."""
    if version == "fsdp1":
        kwargs = {"use_orig_params": True} if setting == "use_orig_params=True" else {}
        sharded = shard_fsdp1(model, ctx, policy, **kwargs)
        return sharded, sharded if backend is None else compile_model(sharded, backend)
    # the policy's units, found before fully_shard swaps each unit's class
    blocks = [m for m in planned_unit_modules(model, policy) if m is not model]
    sharded = shard_fsdp2(model, ctx, policy)
    if backend is not None:
        for block in blocks:
            compile_block(block, backend)
        if setting == "blocks and root":
            compile_block(sharded, backend)
    return sharded, sharded


# --------------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------------


def _skipping_block(original: Callable[..., None]) -> Callable[..., None]:
    return lambda module, backend: None


def _skipping_model(original: Callable[..., Any]) -> Callable[..., Any]:
    return lambda model, backend: model


def _scaled(out: Any) -> Any:
    """``out`` (a graph's outputs) with its first floating tensor times 1.5."""
    items = list(out) if isinstance(out, (list, tuple)) else [out]
    for i, item in enumerate(items):
        if isinstance(item, torch.Tensor) and item.is_floating_point():
            items[i] = item * 1.5
            break
    return type(out)(items) if isinstance(out, (list, tuple)) else items[0]


def perturbing_backend(backend: Any) -> Callable[..., Any]:
    """``backend`` whose every compiled graph returns its first output scaled by 1.5."""
    inner = _compat.dynamo_backend(backend) if isinstance(backend, str) else backend

    def compiler(gm: Any, example_inputs: Any) -> Callable[..., Any]:
        compiled = inner(gm, example_inputs) if inner is not None else gm.forward
        return lambda *args: _scaled(compiled(*args))

    return compiler


@contextlib.contextmanager
def _patch_both(block: Callable[[Any], Any], model: Callable[[Any], Any]) -> Iterator[None]:
    with (
        patched_attr(__name__, "compile_block", block),
        patched_attr(__name__, "compile_model", model),
    ):
        yield


def _perturbed(original: Callable[..., Any]) -> Callable[..., Any]:
    return lambda module, backend: original(module, perturbing_backend(backend))


FAULTS = FaultTable(
    compile_skipped=Fault(
        "the user's compile call does nothing (the model runs eager): parity and collectives "
        "hold; Dynamo's counters show nothing was compiled",
        lambda ctx: _patch_both(_skipping_block, _skipping_model),
    ),
    graph_perturbed=Fault(
        "every graph the backend compiles returns its first output scaled by 1.5 (a compiler "
        "that computes something else): the losses and updates differ from the reference's",
        lambda ctx: _patch_both(_perturbed, _perturbed),
    ),
)

# --------------------------------------------------------------------------------------------
# Observing
# --------------------------------------------------------------------------------------------


class DynamoCounts(TypedDict):
    """What Dynamo's counters moved by while one side trained."""

    #: Frames Dynamo compiled (``frames.ok``) and tried (``frames.total``).
    frames: int
    frames_total: int
    #: Graphs compiled (``stats.unique_graphs``).
    graphs: int
    graph_breaks: int
    #: Per graph break reason (its first line), how many.
    break_reasons: dict[str, int]
    #: Frames compiled after the first step (same shapes: each one a recompile).
    recompiles: int


def _moved(
    before: Mapping[str, Mapping[str, int]],
    after: Mapping[str, Mapping[str, int]],
    key: str,
    name: str,
) -> int:
    return after.get(key, {}).get(name, 0) - before.get(key, {}).get(name, 0)


def _dynamo_counts(
    snapshots: Sequence[Mapping[str, Mapping[str, int]] | None],
) -> DynamoCounts | None:
    """From counter snapshots before training, after the first step and at the end."""
    first, second, last = snapshots
    if first is None or second is None or last is None:
        return None
    reasons: collections.Counter[str] = collections.Counter()
    for reason in last.get("graph_break", {}):
        n = _moved(first, last, "graph_break", reason)
        if n:
            reasons[reason.strip().splitlines()[0]] += n
    return {
        "frames": _moved(first, last, "frames", "ok"),
        "frames_total": _moved(first, last, "frames", "total"),
        "graphs": _moved(first, last, "stats", "unique_graphs"),
        "graph_breaks": sum(reasons.values()),
        "break_reasons": dict(reasons),
        "recompiles": _moved(second, last, "frames", "ok"),
    }


class SideRun(TypedDict):
    """One side (eager or compiled) trained on one rank."""

    losses: list[float]
    ref_losses: list[float]
    steps: list[TensorComparison]
    #: Per step: per phase ("forward", "backward"): per collective kind: records per unit.
    collectives: list[dict[str, dict[str, dict[str, int]]]]
    #: The compiled side's counters (None: eager, or no counters on this torch).
    dynamo: DynamoCounts | None
    #: What torch raised, one line ("" when it trained).
    error: str
    dtype: str


class CompileRun(TypedDict):
    setting: str
    eager: SideRun
    compiled: SideRun


class CompileResult(TypedDict):
    rank: int
    version: str
    world_size: int
    backend: str
    dtype: str
    counters: bool
    runs: list[CompileRun]


def _train(ctx: RankContext, spec: ModelSpec, version: str, setting: str, backend: Any) -> SideRun:
    calls: list[Any] = []

    def shard(model: nn.Module, policy: Any) -> nn.Module:
        sharded, call = _shard(ctx, version, setting, model, policy, backend)
        calls.append(call)
        return sharded

    side = build_side(ctx, spec, shard)
    sharded, call, reference, dtype = side.sharded, calls[0], side.reference, side.dtype
    floor = REORDERED_SHARE if backend == "inductor" else NEGLIGIBLE_SHARE
    torch.compiler.reset()
    snapshots = [_compat.dynamo_counters()]
    run: SideRun = {
        "losses": [],
        "ref_losses": [],
        "steps": [],
        "collectives": [],
        "dynamo": None,
        "error": "",
        "dtype": str(dtype),
    }
    try:
        with record_collective_calls(unit_sizes(sharded, version, ctx.world_size)) as recorder:
            for step in range(STEPS):
                recorder.phase = "observe"
                before = full_params(sharded, version, dtype)
                ref_before = reference_params(reference.model, dtype)
                recorder.phase = f"forward {step}"
                loss = model_loss(call, side.batches[step][ctx.rank])
                recorder.phase = f"backward {step}"
                loss.backward()
                recorder.phase = "reference"
                run["losses"].append(float(loss))
                run["ref_losses"].append(reference.forward_backward(side.batches[step])[ctx.rank])
                sgd_step(sharded, LR)
                sgd_step(reference.model, LR)
                recorder.phase = "observe"
                after = full_params(sharded, version, dtype)
                seen = observe_update(
                    after, before, reference.model, ref_before, dtype, None, floor
                )
                run["steps"].append(seen["comparison"])
                snapshots.append(_compat.dynamo_counters())
        run["collectives"] = [
            {ph: per_unit(recorder, f"{ph} {step}") for ph in ("forward", "backward")}
            for step in range(STEPS)
        ]
    except Exception as exc:  # noqa: BLE001 - a raise under compile is a finding, reported
        run["error"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    if backend is not None and len(snapshots) == STEPS + 1:
        run["dynamo"] = _dynamo_counts([snapshots[0], snapshots[1], snapshots[-1]])
    torch.compiler.reset()
    if backend == "inductor":
        _compat.inductor_shutdown()  # its compile threads would outlive the rank call
    return run


def _require_compiler(ctx: RankContext, backend: str) -> None:
    if backend != "inductor" or ctx.device_type != "cpu":
        return
    names = _compat.inductor_cpp_compilers()
    if not any(shutil.which(n) for n in names):
        skip_rank(
            f"inductor on CPU compiles C++ with {' or '.join(names)} (inductor's "
            "cpp.cxx setting), and none is on PATH: install one (apt-get install g++) or point $CXX at "
            "a C++ compiler; the aot_eager check runs without one"
        )


def rank_compile(
    ctx: RankContext,
    spec: ModelSpec,
    version: str = "fsdp2",
    backend: str = "aot_eager",
    only: Sequence[str] = (),
    fault: str | Sequence[str] | None = None,
) -> CompileResult:
    """Every setting of :data:`SETTINGS` for ``version`` (``only``: those named), each trained
    eager and compiled with ``backend``."""
    version = check_fsdp_version(version)
    if ctx.world_size < 2:
        skip_rank("compile's collectives need two ranks to observe; run at world size >= 2")
    _require_compiler(ctx, backend)
    runs: list[CompileRun] = []
    with FAULTS.inject(fault, ctx):
        for setting, _, _ in SETTINGS[version]:
            if only and setting not in only:
                continue
            eager = _train(ctx, spec, version, setting, None)
            compiled = _train(ctx, spec, version, setting, backend)
            runs.append({"setting": setting, "eager": eager, "compiled": compiled})
    return {
        "rank": ctx.rank,
        "version": version,
        "world_size": ctx.world_size,
        "backend": backend,
        "dtype": runs[0]["eager"]["dtype"] if runs else "",
        "counters": _compat.dynamo_counters() is not None,
        "runs": runs,
    }


# --------------------------------------------------------------------------------------------
# The verdict
# --------------------------------------------------------------------------------------------


def _parity(label: str, side: SideRun, dtype: torch.dtype) -> list[str]:
    return parity_problems(label, side["losses"], side["ref_losses"], side["steps"], dtype)


def _collective_problems(label: str, run: CompileRun) -> list[str]:
    problems = []
    for step, (got, want) in enumerate(
        zip(run["compiled"]["collectives"], run["eager"]["collectives"])
    ):
        for phase in ("forward", "backward"):
            g, w = got.get(phase, {}), want.get(phase, {})
            for op in sorted(g.keys() | w.keys()):
                for unit in sorted(g.get(op, {}).keys() | w.get(op, {}).keys()):
                    a, b = g.get(op, {}).get(unit, 0), w.get(op, {}).get(unit, 0)
                    if a != b:
                        problems.append(
                            f"{label}: {phase} {step}: {a} {op}(s) for unit {unit!r} compiled, "
                            f"{b} eager"
                        )
    return problems


def _compiled_problems(label: str, side: SideRun, must: bool, counters: bool) -> list[str]:
    if not counters:
        return [
            f"{label}: this torch has no Dynamo counters (_compat.dynamo_counters), so what was "
            "compiled cannot be observed: update _compat for this torch"
        ]
    counts = side["dynamo"]
    if must and (counts is None or counts["frames"] == 0 or counts["graphs"] == 0):
        frames, graphs = (0, 0) if counts is None else (counts["frames"], counts["graphs"])
        return [
            f"{label}: nothing was compiled: Dynamo compiled {frames} frame(s) and {graphs} "
            "graph(s) while it trained (the model ran eager)"
        ]
    return []


def _run_problems(v: CompileResult, run: CompileRun, must: bool) -> list[str]:
    dtype = reported_dtype(v["dtype"])
    label = f"rank {v['rank']}: {run['setting']}"
    problems = []
    for side in ("eager", "compiled"):
        if run[side]["error"]:
            if side == "compiled" and not must:
                continue  # a documented finding (data), not a failure
            problems.append(f"{label}: {side} training raised {run[side]['error']}")
            continue
        problems += _parity(f"{label}: {side}", run[side], dtype)
    if not run["compiled"]["error"]:
        problems += _collective_problems(label, run)
        problems += _compiled_problems(label, run["compiled"], must, v["counters"])
    return problems


def _count(counts: DynamoCounts | None, key: str) -> int:
    value = None if counts is None else counts.get(key)
    return value if isinstance(value, int) else -1


def verdict_compile(values: Sequence[CompileResult], params: Mapping[str, Any]) -> Verdict:
    """Per setting: the compiled side's losses and updates equal the reference's, its
    collectives per unit per phase equal eager's, Dynamo compiled something (where the setting
    must compile); the counts as figures."""
    version = values[0]["version"]
    settings = [
        s for s in SETTINGS[version] if s[0] in params.get("only", ()) or not params.get("only")
    ]
    problems: list[str] = []
    for v in values:
        if [r["setting"] for r in v["runs"]] != [s[0] for s in settings]:
            problems.append(f"rank {v['rank']}: ran {[r['setting'] for r in v['runs']]}")
            continue
        for run, (_, _, must) in zip(v["runs"], settings):
            problems += _run_problems(v, run, must)
    figures: dict[str, Any] = {
        "update_rel_diff": max(
            (s["max_rel"] for v in values for r in v["runs"] for s in r["compiled"]["steps"]),
            default=0.0,
        ),
        "settings": len(settings),
        "steps": STEPS,
    }
    data: dict[str, Any] = {"backend": values[0]["backend"]}
    for run, (name, prefix, _) in zip(values[0]["runs"], settings):
        counts = run["compiled"]["dynamo"]
        for key in ("frames", "graphs", "graph_breaks", "recompiles"):
            # ints: compare shows a changed count between torch versions (-1: not observed)
            figures[f"{prefix}_{key}"] = max(
                _count(r["compiled"]["dynamo"], key)
                for v in values
                for r in v["runs"]
                if r["setting"] == name
            )
        data[name] = {
            "break_reasons": {} if counts is None else counts["break_reasons"],
            "error": run["compiled"]["error"],
            "collectives": run["compiled"]["collectives"][:1],
        }
    what = f"torch.compile(backend={values[0]['backend']!r}) on {version}"
    if problems:
        return Verdict(
            False,
            f"{what}: compiled training is not eager's:\n  " + "\n  ".join(dict.fromkeys(problems)),
            figures,
            data,
        )
    return Verdict(
        True,
        f"{what}: {len(settings)} settings, each trained {STEPS} steps compiled equal to the "
        f"reference (worst {figures['update_rel_diff']:.1e}), the same collectives per unit as "
        "eager, graphs compiled where required",
        figures,
        data,
    )
