"""``defaults.fingerprint``: what FSDP does when a user leaves a constructor option unset, observed.

One check per FSDP version. Its rank function builds a few tiny models
the way a user writes them (the option omitted), runs one training step on each with every
collective recorded (:mod:`fsdp_conformance.fsdp.collectives`), and derives each observable from
what happened: the dtypes and bytes of the collectives, the units left unsharded after forward, the
all-gather order against the units' forward and backward. Nothing is read from a signature or a
configuration object, except FSDP1's ``limit_all_gathers`` (a CUDA rate limiter with nothing to
observe on CPU; see docs/wrapping.md, "The default-behaviour fingerprint").

``EXPECTED`` holds what the pinned torch (2.13) does, measured; the check fails on any
difference, expected vs actual. The report keeps every observed value and every collective, so
``compare`` between two torch versions shows what moved even where the new value is right.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from fsdp_conformance import _compat
from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.defaults.common import TinyModel, differ, unexpected
from fsdp_conformance.claims.faults import Fault, FaultTable, patched, with_default
from fsdp_conformance.fsdp.collectives import record_collectives, unit_sizes
from fsdp_conformance.fsdp.sharding import check_fsdp_version, device_mesh
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.models.units import clean_fqn

#: The unit FQNs of the tiny model, in forward order; the root ("") owns the final norm.
LAYERS = ("layers.0", "layers.1", "layers.2")
ROOT = ""
BF16, FP32 = str(torch.bfloat16), str(torch.float32)

#: What torch 2.13 does with each option omitted (measured on CPU/gloo at world sizes 2 and 4).
#: Keys are the check's figures: ``<case>.<observable>``. Torch 2.15 differs in one: FSDP2's
#: ``param_dtype_only.reduce_scatter_dtype`` is fp32 there (``reduce_dtype=None`` follows the
#: gradient's dtype since 2.15; docs/defaults.md).
EXPECTED: dict[str, dict[str, Any]] = {
    "fsdp1": {
        "defaults.sharding": "FULL_SHARD",
        "defaults.backward_prefetch": "prefetched",
        "defaults.forward_prefetch": "not prefetched",
        "defaults.limit_all_gathers": True,
        "defaults.flat_parameters": True,
        "defaults.all_gather_dtype": FP32,
        "defaults.reduce_scatter_dtype": FP32,
        "param_dtype_only.all_gather_dtype": BF16,
        "param_dtype_only.reduce_scatter_dtype": BF16,
        "param_dtype_only.output_dtype": BF16,
        "explicit_shard_grad_op.sharding": "SHARD_GRAD_OP",
        "explicit_no_shard.sharding": "NO_SHARD",
    },
    "fsdp2": {
        "defaults.unsharded_after_forward": [ROOT],
        "defaults.regathered_in_backward": list(LAYERS),
        "defaults.backward_prefetch": "prefetched",
        "defaults.all_gather_dtype": FP32,
        "defaults.reduce_scatter_dtype": FP32,
        "defaults.shards_on_compute_device": True,
        "param_dtype_only.all_gather_dtype": BF16,
        "param_dtype_only.reduce_scatter_dtype": BF16,
        "param_dtype_only.unit_input_dtype": BF16,
        "param_dtype_only.output_dtype": BF16,
        "reduce_dtype_only.all_gather_dtype": FP32,
        "reduce_dtype_only.reduce_scatter_dtype": BF16,
        "output_dtype_only.all_gather_dtype": FP32,
        "output_dtype_only.output_dtype": BF16,
        # reshard_after_forward=True passed to every unit, the root's respected (the root
        # resharded and gathered again in backward; its meaning changed in 2025:
        # pytorch/pytorch#154704, #155319); the integer 1 means False (#147179).
        "explicit_true.unsharded_after_forward": [],
        "explicit_true.regathered_in_backward": sorted([ROOT, *LAYERS]),
        "explicit_int_1.unsharded_after_forward": [*LAYERS, ROOT],
        "explicit_int_1.regathered_in_backward": [],
    },
}


def _tiny(ctx: RankContext) -> TinyModel:
    torch.manual_seed(0)  # the same model on every rank
    return TinyModel().to(ctx.device)


def _batch(ctx: RankContext) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(4, 8, device=ctx.device)


# --------------------------------------------------------------------------------------------
# Faults: a changed default, injected into torch on the ranks (negative controls)
# --------------------------------------------------------------------------------------------


def _reduce_fp32(cls: Any) -> Any:
    # A factory in the class's place: the rank function looks the class up at call time.
    def make(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("reduce_dtype", torch.float32)
        return cls(*args, **kwargs)

    return make


@contextlib.contextmanager
def _reduce_dtype_fp32(ctx: RankContext) -> Iterator[None]:
    import torch.distributed.fsdp as fsdp

    with (
        patched(fsdp, "MixedPrecision", _reduce_fp32),
        patched(fsdp, "MixedPrecisionPolicy", _reduce_fp32),
    ):
        yield


def _fsdp1_default(key: str, value: Any) -> Callable[[RankContext], Any]:
    def effect(ctx: RankContext) -> Any:
        import torch.distributed.fsdp as fsdp

        return patched(
            fsdp.FullyShardedDataParallel, "__init__", lambda init: with_default(init, key, value)
        )

    return effect


def _fully_shard_default(key: str, value: Any) -> Callable[[RankContext], Any]:
    def effect(ctx: RankContext) -> Any:
        import torch.distributed.fsdp as fsdp

        return patched(fsdp, "fully_shard", lambda fn: with_default(fn, key, value))

    return effect


#: Each fault changes what torch does when the user omits an option, as an upgrade could.
FAULTS = FaultTable(
    reduce_dtype_default=Fault(
        "a policy with param_dtype only reduces in fp32 (MixedPrecision / MixedPrecisionPolicy "
        "default reduce_dtype float32 instead of param_dtype)",
        _reduce_dtype_fp32,
    ),
    backward_prefetch_default=Fault(
        "FSDP1's backward_prefetch defaults to None (no prefetch)",
        _fsdp1_default("backward_prefetch", None),
    ),
    reshard_after_forward_default=Fault(
        "FSDP2's reshard_after_forward defaults to False",
        _fully_shard_default("reshard_after_forward", False),
    ),
)


# --------------------------------------------------------------------------------------------
# One observed step
# --------------------------------------------------------------------------------------------


def _step(
    model: nn.Module,
    ctx: RankContext,
    version: str,
    iterations: int = 1,
    after_forward: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Forward and backward ``iterations`` times; the last one's collectives and marks.

    Marks: ``(index of the next collective, "fwd_end", unit)`` when a layer unit's forward
    returns, to place the all-gathers against the units' forward.
    """
    sizes = unit_sizes(model, version, ctx.world_size)
    marks: list[tuple[int, str, str]] = []
    units = {clean_fqn(n): m for n, m in model.named_modules()}
    seen: dict[str, str] = {}
    batch = _batch(ctx)
    records: list[dict[str, Any]] = []
    for _ in range(iterations):
        marks.clear()
        with record_collectives(sizes) as rec:
            handles = [
                units[u].register_forward_hook(
                    lambda m, a, o, u=u: marks.append((len(rec.records), "fwd_end", u))
                )
                for u in LAYERS
            ]
            handles.append(
                units["layers.0"].register_forward_pre_hook(
                    lambda m, a: seen.__setitem__("unit_input_dtype", str(a[0].dtype))
                )
            )
            rec.phase = "forward"
            out = model(batch)
            seen["output_dtype"] = str(out.dtype)
            if after_forward is not None:
                after_forward()
            rec.phase = "backward"
            out.float().sum().backward()
            for h in handles:
                h.remove()
        records = rec.records
    return {"collectives": records, "marks": marks, **seen}


def _dtype_of(records: Sequence[Mapping[str, Any]], op: str, side: str) -> str | None:
    dtypes = sorted({r[side] for r in records if r["op"] == op})
    return "|".join(dtypes) if dtypes else None


def _dtype_figures(case: str, step: Mapping[str, Any], *names: str) -> dict[str, Any]:
    records = step["collectives"]
    values = {
        "all_gather_dtype": _dtype_of(records, "all_gather", "in_dtype"),
        "reduce_scatter_dtype": _dtype_of(records, "reduce_scatter", "in_dtype"),
        "output_dtype": step.get("output_dtype"),
        "unit_input_dtype": step.get("unit_input_dtype"),
    }
    return {f"{case}.{n}": values[n] for n in names}


def _first(records: Sequence[Mapping[str, Any]], op: str, unit: str, phase: str) -> int | None:
    return next(
        (
            i
            for i, r in enumerate(records)
            if r["op"] == op and r["unit"] == unit and r["phase"] == phase
        ),
        None,
    )


def _label(flags: Sequence[bool], yes: str, no: str) -> str:
    if not flags:
        return "nothing to observe"
    return yes if all(flags) else no if not any(flags) else f"mixed {list(flags)}"


def observe_sharding(records: Sequence[Mapping[str, Any]]) -> str:
    """The sharding strategy the collectives show (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD)."""
    ops = {r["op"] for r in records if r["phase"] == "backward"}
    regathered = {
        r["unit"] for r in records if r["op"] == "all_gather" and r["phase"] == "backward"
    }
    if "all_reduce" in ops and "all_gather" not in ops and "reduce_scatter" not in ops:
        return "NO_SHARD"
    if "reduce_scatter" in ops and set(LAYERS) <= regathered:
        return "FULL_SHARD"
    if "reduce_scatter" in ops and not regathered & set(LAYERS):
        return "SHARD_GRAD_OP"
    return f"other (backward ops {sorted(ops)}, regathered {sorted(regathered)})"


def observe_backward_prefetch(records: Sequence[Mapping[str, Any]]) -> str:
    """Whether a unit's backward all-gather is issued before the previous unit's reduce-scatter.

    Units in the order backward reduces them; for each next unit gathered in backward, its
    all-gather before the reduce-scatter of the unit before it is a prefetch.
    """
    order = [r["unit"] for r in records if r["op"] == "reduce_scatter" and r["unit"] in LAYERS]
    flags = []
    for done, nxt in zip(order, order[1:]):
        gather = _first(records, "all_gather", nxt, "backward")
        reduce = _first(records, "reduce_scatter", done, "backward")
        if gather is not None and reduce is not None:
            flags.append(gather < reduce)
    return _label(flags, "prefetched", "not prefetched")


def observe_forward_prefetch(
    records: Sequence[Mapping[str, Any]], marks: Sequence[tuple[int, str, str]]
) -> str:
    """Whether layer k+1's all-gather is issued before layer k's forward returns."""
    ends = {unit: index for index, kind, unit in marks if kind == "fwd_end"}
    flags = []
    for done, nxt in zip(LAYERS, LAYERS[1:]):
        gather = _first(records, "all_gather", nxt, "forward")
        if gather is not None and done in ends:
            flags.append(gather < ends[done])
    return _label(flags, "prefetched", "not prefetched")


def _fsdp1_cases(ctx: RankContext) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch.distributed.fsdp as fsdp
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    def wrap(**options: Any) -> nn.Module:
        # As a user writes it: a wrap policy and the device, every other option omitted.
        return fsdp.FullyShardedDataParallel(
            _tiny(ctx),
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            device_id=ctx.device,
            **options,
        )

    figures: dict[str, Any] = {}
    model = wrap()
    # Two iterations: FSDP1 records the forward order in the first and prefetches from it.
    plain = _step(model, ctx, "fsdp1", iterations=2)
    records = plain["collectives"]
    figures["defaults.sharding"] = observe_sharding(records)
    figures["defaults.backward_prefetch"] = observe_backward_prefetch(records)
    figures["defaults.forward_prefetch"] = observe_forward_prefetch(records, plain["marks"])
    figures["defaults.limit_all_gathers"] = _compat.fsdp1_limit_all_gathers(model)
    figures["defaults.flat_parameters"] = any(
        "_flat_param" in n for n, _ in model.named_parameters()
    )
    figures.update(_dtype_figures("defaults", plain, "all_gather_dtype", "reduce_scatter_dtype"))
    mixed = _step(
        wrap(mixed_precision=fsdp.MixedPrecision(param_dtype=torch.bfloat16)), ctx, "fsdp1"
    )
    explicit = {}
    for strategy in ("SHARD_GRAD_OP", "NO_SHARD"):
        # An explicit strategy, as a user writes it: what the collectives show it did.
        case = f"explicit_{strategy.lower()}"
        step = _step(wrap(sharding_strategy=fsdp.ShardingStrategy[strategy]), ctx, "fsdp1")
        figures[f"{case}.sharding"] = observe_sharding(step["collectives"])
        explicit[case] = step["collectives"]
    figures.update(
        _dtype_figures(
            "param_dtype_only", mixed, "all_gather_dtype", "reduce_scatter_dtype", "output_dtype"
        )
    )
    return figures, {"defaults": records, "param_dtype_only": mixed["collectives"], **explicit}


def _fsdp2_cases(ctx: RankContext) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch.distributed.fsdp as fsdp

    mesh = device_mesh(ctx)

    def shard(root_only: bool = False, **options: Any) -> nn.Module:
        # Looked up at call time (a fault may replace it); older torch: through _compat.
        fully_shard = getattr(fsdp, "fully_shard", None) or _compat.fully_shard()
        model = _tiny(ctx)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, **({} if root_only else options))
        fully_shard(model, mesh=mesh, **options)
        return model

    def policy(**fields: Any) -> Any:
        cls = getattr(fsdp, "MixedPrecisionPolicy", None) or _compat.mixed_precision_policy_cls()
        return cls(**fields)

    figures: dict[str, Any] = {}
    model = shard()
    plain = _reshard_step(model, ctx, "defaults", figures)
    records = plain["collectives"]
    figures["defaults.backward_prefetch"] = observe_backward_prefetch(records)
    figures.update(_dtype_figures("defaults", plain, "all_gather_dtype", "reduce_scatter_dtype"))
    figures["defaults.shards_on_compute_device"] = all(
        p.to_local().device.type == ctx.device_type  # type: ignore[attr-defined]
        for p in model.parameters()
    )
    cases = {"defaults": records}
    # output_dtype on the root only, as a user writes it: on every unit it would feed bf16
    # activations into the next unit's fp32 parameters (no param_dtype, so no input cast).
    for case, fields, root_only, names in (
        (
            "param_dtype_only",
            {"param_dtype": torch.bfloat16},
            False,
            ("all_gather_dtype", "reduce_scatter_dtype", "unit_input_dtype", "output_dtype"),
        ),
        (
            "reduce_dtype_only",
            {"reduce_dtype": torch.bfloat16},
            False,
            ("all_gather_dtype", "reduce_scatter_dtype"),
        ),
        (
            "output_dtype_only",
            {"output_dtype": torch.bfloat16},
            True,
            ("all_gather_dtype", "output_dtype"),
        ),
    ):
        step = _step(shard(root_only, mp_policy=policy(**fields)), ctx, "fsdp2")
        figures.update(_dtype_figures(case, step, *names))
        cases[case] = step["collectives"]
    # Explicit options whose meaning moved upstream, passed to every unit (so that a changed
    # default does not move them): True (the root's included), and the integer 1.
    for case, value in (("explicit_true", True), ("explicit_int_1", 1)):
        step = _reshard_step(shard(reshard_after_forward=value), ctx, case, figures)
        cases[case] = step["collectives"]
    return figures, cases


def _reshard_step(
    model: nn.Module, ctx: RankContext, case: str, figures: dict[str, Any]
) -> dict[str, Any]:
    """One FSDP2 step on the tiny model; ``<case>.unsharded_after_forward`` (the units whose
    registered parameters are plain tensors, not DTensors, once the forward returned) and
    ``<case>.regathered_in_backward`` (the units all-gathered again in backward) go into
    ``figures``."""
    dtensor = _compat.dtensor_cls()
    unsharded: list[str] = []

    def after_forward() -> None:
        for unit in (*LAYERS, ROOT):
            module = model.get_submodule("norm" if unit == ROOT else unit)
            if not all(isinstance(p, dtensor) for p in module.parameters()):
                unsharded.append(unit)

    step = _step(model, ctx, "fsdp2", after_forward=after_forward)
    figures[f"{case}.unsharded_after_forward"] = unsharded
    figures[f"{case}.regathered_in_backward"] = sorted(
        {
            r["unit"]
            for r in step["collectives"]
            if r["op"] == "all_gather" and r["phase"] == "backward"
        }
    )
    return step


class Fingerprint(TypedDict):
    """One rank's observed defaults and the collectives behind them."""

    rank: int
    #: Every observable, ``<case>.<observable>`` (the keys of :data:`EXPECTED`).
    figures: dict[str, Any]
    #: Each case's collectives (:mod:`fsdp_conformance.fsdp.collectives` records), by case.
    collectives: dict[str, Any]


def rank_fingerprint(
    ctx: RankContext, version: str = "fsdp2", fault: str | Sequence[str] | None = None
) -> Fingerprint:
    """Every observable of ``version``'s defaults on this rank, and the collectives behind them.

    ``fault``: defaults changed in torch for the duration (:data:`FAULTS`), negative controls.
    """
    check_fsdp_version(version)
    if version == "fsdp1" and ctx.world_size == 1:
        skip_rank(
            "FSDP1 runs NO_SHARD at world size 1 (torch switches any sharding strategy to "
            "NO_SHARD): its sharded defaults cannot be observed; run at world size >= 2"
        )
    with FAULTS.inject(fault, ctx):
        cases = _fsdp1_cases(ctx) if version == "fsdp1" else _fsdp2_cases(ctx)
    figures, collectives = cases
    return {"rank": ctx.rank, "figures": figures, "collectives": collectives}


def verdict_fingerprint(values: Sequence[Fingerprint], params: Mapping[str, Any]) -> Verdict:
    """Every observable equals what the pinned torch does, on every rank.

    Figures: the observed values (rank 0's, after the ranks were found to agree). Data: the
    collectives of each case (:mod:`fsdp_conformance.fsdp.collectives` records, rank 0's).
    """
    version = params["version"]
    first = values[0]
    problems = []
    for v in values[1:]:
        for key in ("figures", "collectives"):
            if v[key] != first[key]:
                problems.append(f"rank {v['rank']} observed other {key} than rank {first['rank']}")
    expected = EXPECTED[version]
    observed = first["figures"]
    problems += unexpected(
        expected,
        observed,
        lambda key: "the option as given" if key.startswith("explicit_") else "the option omitted",
    )
    figures = dict(observed)
    figures["collectives_recorded"] = sum(len(c) for c in first["collectives"].values())
    data = {"collectives": first["collectives"], "expected": expected}
    if problems:
        return differ(f"{version} defaults", problems, figures, data)
    return Verdict(
        True,
        f"{len(expected)} default behaviours as expected; "
        f"{figures['collectives_recorded']} collectives recorded",
        figures,
        data,
    )


__all__ = [
    "EXPECTED",
    "FAULTS",
    "Fingerprint",
    "LAYERS",
    "observe_backward_prefetch",
    "observe_forward_prefetch",
    "observe_sharding",
    "rank_fingerprint",
    "verdict_fingerprint",
]
