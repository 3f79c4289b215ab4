"""The plan for people (the unit tree, the estimate term by term, the policy table) and for tools
(the ``--json`` document)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_conformance.measure.bound import Bound
from fsdp_conformance.models.units import ROOT, UnitInfo
from fsdp_conformance.plan.estimate import (
    DEFAULT_RESERVE,
    MAX_WORLD_SIZE,
    DeviceReserve,
    ModelPlan,
    breakdown,
    cheapest_fit,
    checkpointing_options,
    devices_needed,
    plan_style,
    term_sum,
)
from fsdp_conformance.plan.model import DTYPE_BYTES, PlanSettings
from fsdp_conformance.sizes import ByteStyle, format_bytes, size_style

PROG = "fsdp-conformance plan"


def _group_siblings(
    children: Sequence[UnitInfo], subtree: Mapping[str, tuple[Any, ...]]
) -> list[list[UnitInfo]]:
    """Runs of consecutive siblings that differ only by one index (layers.0, layers.1, ...)."""
    groups: list[list[UnitInfo]] = []
    for u in children:
        if groups and _next_in_run(groups[-1], u) and subtree[u.fqn] == subtree[groups[-1][0].fqn]:
            groups[-1].append(u)
        else:
            groups.append([u])
    return groups


def _next_in_run(run: Sequence[UnitInfo], u: UnitInfo) -> bool:
    a, b = run[-1].fqn.split("."), u.fqn.split(".")
    if len(a) != len(b) or run[-1].cls != u.cls or run[-1].numel != u.numel:
        return False
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if len(diff) != 1 or not (a[diff[0]].isdigit() and b[diff[0]].isdigit()):
        return False
    if int(b[diff[0]]) != int(a[diff[0]]) + 1:
        return False
    if len(run) > 1:  # the run must vary the same component
        first = run[0].fqn.split(".")
        if [i for i, (x, y) in enumerate(zip(first, a)) if x != y] != diff:
            return False
    return True


def format_plan_tree(
    plan: ModelPlan,
    world_size: int,
    verification: Mapping[str, Any] | None = None,
    collapse: bool = True,
    style: ByteStyle = "iec",
) -> str:
    """The units as a tree with params, all-gather bytes and the per-rank shard.

    Identical consecutive siblings (``layers.0`` .. ``layers.79``) collapse into one line
    ``layers.{0..79} x80`` unless ``collapse`` is False.
    """
    s = plan.settings
    cb, pb = DTYPE_BYTES[s.compute_dtype], DTYPE_BYTES[s.param_dtype]
    local = {r["fqn"]: r["local_numel"] for r in (verification or {}).get("units", [])}
    by_parent: dict[str | None, list[UnitInfo]] = {}
    for u in plan.units:
        by_parent.setdefault(u.parent, []).append(u)

    subtree: dict[str, tuple[Any, ...]] = {}

    def signature(u: UnitInfo) -> tuple[Any, ...]:
        kids = tuple(signature(c) for c in by_parent.get(u.fqn, []))
        subtree[u.fqn] = (u.cls, u.numel, kids)
        return subtree[u.fqn]

    for root in by_parent.get(None, []):
        signature(root)
    head = (
        f"{'unit':<44} {'params':>15} {'all-gather ' + s.compute_dtype:>16} "
        f"{'shard/rank ' + s.param_dtype:>17}"
    )
    if local:
        head += f" {'fsdp2 rank 0':>14}"
    lines = [head]

    def row(name: str, u: UnitInfo, count: int) -> str:
        each = " each" if count > 1 else ""
        text = (
            f"{name:<44} {u.numel:>15,} {format_bytes(u.numel * cb, style) + each:>16} "
            f"{format_bytes(-(-u.numel // world_size) * pb, style) + each:>17}"
        )
        if local:
            got = local.get(u.fqn)
            text += f" {'-' if got is None else format_bytes(got * pb, style) + each:>14}"
        return text

    def walk(parent: UnitInfo | None, prefix: str) -> None:
        kids = by_parent.get(parent.fqn if parent else None, [])
        groups = _group_siblings(kids, subtree) if collapse else [[k] for k in kids]
        for i, group in enumerate(groups):
            u = group[0]
            last = i == len(groups) - 1
            branch = "" if parent is None else ("└── " if last else "├── ")
            if parent is None:
                name = f"{u.cls} (root)"
            else:
                rel = u.fqn[len(parent.fqn) + 1 :] if parent.fqn else u.fqn
                if len(group) > 1:
                    rel = _range_name(rel, group, parent.fqn)
                name = f"{rel}  {u.cls}" + (f" x{len(group)}" if len(group) > 1 else "")
            lines.append(row(prefix + branch + name, u, len(group)))
            walk(u, prefix + ("" if parent is None else ("    " if last else "│   ")))

    walk(None, "")
    return "\n".join(lines)


def _range_name(rel: str, group: Sequence[UnitInfo], parent: str) -> str:
    first, last = group[0].fqn.split("."), group[-1].fqn.split(".")
    i = next(i for i, (x, y) in enumerate(zip(first, last)) if x != y)
    offset = len(parent.split(".")) if parent else 0
    parts = rel.split(".")
    parts[i - offset] = f"{{{first[i]}..{last[i]}}}"
    return ".".join(parts)


def format_bound(bound: Bound, style: ByteStyle = "iec") -> str:
    """The estimate term by term, with how each term was computed."""
    width = max(len(t.name) for t in bound.terms)
    lines = [
        f"  {t.name:<{width}}  {format_bytes(t.bytes, style):>11}  {t.derivation}"
        for t in bound.terms
    ]
    lines.append(f"  {'total':<{width}}  {format_bytes(bound.total, style):>11}  per rank")
    return "\n".join(lines)


def plan_report(
    plan: ModelPlan,
    world_size: int,
    device_bytes: Sequence[int],
    verification: Mapping[str, Any] | None = None,
    max_world_size: int = MAX_WORLD_SIZE,
    reserve: DeviceReserve = DEFAULT_RESERVE,
) -> dict[str, Any]:
    """Everything ``plan`` prints, as plain data (the ``--json`` document)."""
    bound = plan.estimate(world_size)
    options = checkpointing_options(plan, world_size, device_bytes, max_world_size, reserve)
    cb = DTYPE_BYTES[plan.settings.compute_dtype]
    pb = DTYPE_BYTES[plan.settings.param_dtype]
    return {
        "model": {
            "label": plan.choice.label,
            "name": plan.choice.spec.name,
            "class": plan.model_class,
            "params": plan.total_numel,
        },
        "settings": plan.settings.to_dict(),
        "world_size": world_size,
        "units": [
            {
                **u.to_dict(),
                "all_gather_bytes": u.numel * cb,
                "shard_numel": -(-u.numel // world_size),
                "shard_bytes": -(-u.numel // world_size) * pb,
            }
            for u in plan.units
        ],
        "sharded_param_bytes_per_rank": term_sum(bound, ("sharded params",)),
        "host_bytes_per_rank": plan.host_bytes(world_size),
        "estimate": {**bound.to_dict(), "breakdown": breakdown(bound)},
        "activations": plan.activations.to_dict(),
        "checkpointing": {
            "setting": plan.settings.checkpointing,
            "checkpointed_units": list(plan.checkpointed),
            "recompute_flops": plan.recompute_flops,
        },
        "checkpointing_options": options,
        "answer": cheapest_fit(options, plan, reserve),
        "reserve": reserve.to_dict(),
        "reserve_text": reserve.describe(plan_style(device_bytes)),
        "style": plan_style(device_bytes),
        "devices_needed": [
            devices_needed(plan, d, max_world_size, reserve).to_dict() for d in device_bytes
        ],
        "verification": dict(verification) if verification is not None else None,
        "plan_seconds": plan.seconds,
    }


def format_plan(plan: ModelPlan, report: Mapping[str, Any], collapse: bool = True) -> str:
    w = report["world_size"]
    style: ByteStyle = report["style"]
    s = plan.settings
    bound = Bound.from_dict(report["estimate"])
    lines = [
        f"{PROG}: {plan.choice.label} ({plan.model_class}, {plan.total_numel:,} params), "
        f"{s.policy} policy, world size {w:,}",
        f"settings: {s.describe()}",
        "",
        f"wrap plan: {len(plan.units)} units ({_unit_note(style)})",
        format_plan_tree(plan, w, report.get("verification"), collapse, style),
        "",
        "sharded parameters per rank: "
        f"{format_bytes(report['sharded_param_bytes_per_rank'], style)} "
        f"({s.param_dtype})",
        "",
        "estimated peak per rank of a training step (memory.per_layer_bound, docs/memory.md):",
        format_bound(bound, style),
        "",
    ]
    if s.cpu_offload:
        lines[-1:-1] = [
            f"  host memory per rank (cpu offload): "
            f"{format_bytes(report['host_bytes_per_rank'], style)} (sharded "
            "params, grads and optimizer state; derived, not measured: "
            "docs/planning.md)"
        ]
    lines.append(
        "devices needed (smallest world size whose estimate fits the device, with "
        f"{report['reserve_text']}; docs/planning.md, 'Device reserve'):"
    )
    for d in report["devices_needed"]:
        lines.append(f"  {_device(d['device_bytes'])}: {d['reason']}")
    lines += _nested_note(plan, style)
    lines += ["", *format_checkpointing(report)]
    v = report.get("verification")
    if v:
        lines.append("")
        lines.append(_format_verification(v, s.param_dtype, style))
    return "\n".join(lines)


def _unit_note(style: ByteStyle) -> str:
    return "GB = 10^9 B" if style == "decimal" else "GiB = 2^30 B"


def _device(device_bytes: int) -> str:
    """A device size as the user gave it: GiB for ``80GiB``, GB for ``80GB``."""
    return format_bytes(device_bytes, size_style(device_bytes))


def _flops(flops: int | None) -> str:
    return "not counted" if flops is None else f"{flops / 1e12:,.1f} TFLOP"


def format_checkpointing(report: Mapping[str, Any]) -> list[str]:
    """The estimate with each activation-checkpointing choice, and the cheapest that fits."""
    w = report["world_size"]
    style: ByteStyle = report["style"]
    devices = [d["device_bytes"] for d in report["devices_needed"]]
    lines = [
        f"activation checkpointing of the blocks (torch's checkpoint_wrapper; recompute = "
        f"forward FLOPs run again in backward, per rank and step) at {w:,} ranks:",
        f"  {'checkpointing':<14} {'blocks':>6} {'estimate':>11} {'recompute':>14}  "
        + "  ".join(f"{'ranks for ' + _device(d):>19}" for d in devices),
    ]
    for o in report["checkpointing_options"]:
        needs = "  ".join(
            f"{n['world_size'] or 'never':>19}"
            if n["world_size"] is None
            else f"{n['world_size']:>19,}"
            for n in o["devices_needed"]
        )
        lines.append(
            f"  {o['checkpointing']:<14} {o['checkpointed_units']:>6} "
            f"{format_bytes(o['estimate_bytes'], style):>11} "
            f"{_flops(o['recompute_flops']):>14}  {needs}"
        )
    lines.append("cheapest that fits (least recompute, then fewest ranks):")
    for a in report["answer"]:
        device = _device(a["device_bytes"])
        if a["checkpointing"] is None:
            lines.append(
                f"  {device}: nothing fits at any world size, even with activation "
                "checkpointing on every block (offloading the sharded state would not "
                "help: it removes only what more ranks shrink); fix: a smaller "
                "per-rank batch or sequence, or smaller units"
            )
            continue
        lines.append(
            f"  {device}: activation checkpointing {a['checkpointing']}, "
            f"{a['world_size']:,} ranks: {format_bytes(a['estimate_bytes'], style)} "
            f"per rank, {format_bytes(a['room_bytes'], style)} to spare after the "
            f"device reserve; recompute {_flops(a['recompute_flops'])} per step"
        )
        off = a.get("offload")
        if off:
            lines.append(
                f"    or fewer ranks with the sharded state offloaded to the host "
                f"(--cpu-offload; derived, not measured): from {off['world_size']:,} "
                f"rank{'s' if off['world_size'] > 1 else ''}, "
                f"{format_bytes(off['host_bytes'], style)} of host memory per rank"
            )
        if a.get("shard_group") is not None:
            lines.append(
                f"    or HSDP with shard groups of at least {a['shard_group']:,} ranks "
                "(--shard-group-size), replicated across as many groups as you like: "
                "the same per-rank estimate"
            )
    return lines


def _nested_note(plan: ModelPlan, style: ByteStyle = "iec") -> list[str]:
    # memory.per_layer_bound counts the root plus the two largest other units as gathered
    # (under FSDP2 the second as its all-gather output); in a nested plan (the seeds' policy)
    # the enclosing unit stays gathered while its children run, which the bound does not
    # count. Say how much that is instead of hiding it.
    nested = [u for u in plan.units if u.parent not in (None, ROOT)]
    if not nested:
        return []
    parents = {u.parent for u in nested}
    biggest = max((u for u in plan.units if u.fqn in parents), key=lambda u: u.numel)
    cb = DTYPE_BYTES[plan.settings.compute_dtype]
    return [
        f"  note: {len(nested)} units are nested in other units; while one runs, its "
        f"enclosing unit stays gathered too (largest: {biggest.fqn}, "
        f"{format_bytes(biggest.numel * cb, style)}), which the per-layer bound does not "
        "count"
    ]


def _format_verification(v: Mapping[str, Any], param_dtype: str, style: ByteStyle = "iec") -> str:
    if "skipped" in v:
        return f"fsdp2 cross-check: skipped: {v['skipped']}"
    pb = DTYPE_BYTES[param_dtype]
    head = (
        f"fsdp2 cross-check (fully_shard on a {v['world_size']:,}-rank fake process group, "
        f"rank 0, {v['seconds']:.1f} s): "
    )
    if v["matches"]:
        text = (
            f"{head}every unit's local shard equals the analytic dim-0 padding "
            f"(ceil(dim0/W) rows per parameter): {v['local_numel']:,} elements per rank"
        )
    else:
        text = f"{head}MISMATCH in {', '.join(v['mismatched'][:8])}" + "".join(
            f"\n  {d}" for d in v["unit_differences"][:8]
        )
    pad = v["padding_numel"]
    return text + (
        f"\n  the estimate's ceil(numel/W) is {v['ceil_numel']:,}: FSDP2's padding "
        f"adds {pad:,} elements ({format_bytes(pad * pb, style)} per "
        "sharded-state tensor kind) per rank"
        if pad
        else "\n  equal to the estimate's ceil(numel/W): no padding at this world size"
    )


def format_comparison(data: Mapping[str, Any]) -> str:
    m, claim = data["model"], data["claim"]
    settings = PlanSettings(**{**data["settings"], "policy": "recommended"})
    devices = data["device_bytes"]
    style: ByteStyle = data.get("style", "iec")
    lines = [f'the seeds\' claim: "{claim["text"]}"'] if claim["text"] else []
    lines += [
        f"{m['label']}: {m['params']:,} params x 2 B (fp16) = "
        f"{format_bytes(claim['fp16_weight_bytes'], style)} of weights on one host",
        "",
        f"estimated peak per rank of a training step ({settings.describe()}):",
        f"{'policy':<12} {'units':>5} {'ranks':>6} {'sharded state':>14} "
        f"{'unit working set':>17} {'activations':>12} {'estimate':>11}  "
        + "  ".join(f"{'fits ' + _device(d):>12}" for d in devices),
    ]
    for r in data["rows"]:
        fits = "  ".join(f"{'yes' if r['fits'][str(d)] else 'no':>12}" for d in devices)
        lines.append(
            f"{r['policy']:<12} {r['units']:>5} {r['world_size']:>6,} "
            f"{format_bytes(r['sharded_state'], style):>14} "
            f"{format_bytes(r['unit_working_set'], style):>17} "
            f"{format_bytes(r['activations'], style):>12} "
            f"{format_bytes(r['total'], style):>11}  {fits}"
        )
    lines += ["", f"devices needed ({data['reserve_text']}):"]
    for policy, items in data["devices_needed"].items():
        for d in items:
            lines.append(f"  {policy:<12} {_device(d['device_bytes'])}: {d['reason']}")
    return "\n".join(lines)
