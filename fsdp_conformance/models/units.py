"""FSDP units in one normalized form: planned (no process group) and actual (FSDP1 and FSDP2).

A unit is the module whose parameters FSDP all-gathers and reduce-scatters together. Every
function here returns :class:`UnitInfo` rows (plain data), so a check on a rank can return them
and the parent can compare, print and store them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch.nn as nn

from fsdp_conformance import _compat
from fsdp_conformance._files import PlainData

ROOT = ""
_FSDP1_PREFIX = "_fsdp_wrapped_module"


@dataclasses.dataclass(frozen=True)
class UnitInfo(PlainData):
    """One FSDP unit."""

    #: FQN of the wrapped module in the original model ("" for the root).
    fqn: str
    #: Class name of the wrapped module (the original class, not FSDP's wrapper).
    cls: str
    #: Unsharded parameter count of the unit's own parameters (nested units excluded).
    numel: int
    #: Local shard numel on the reporting rank (padding included for FSDP1); None in a plan.
    local_numel: int | None = None
    #: FQN of the enclosing unit; None for the root.
    parent: str | None = None
    #: FQNs of the unit's own parameters (first name of a tied parameter).
    params: tuple[str, ...] = ()
    #: FSDP1 only: the FlatParameter's unsharded numel *with* alignment padding
    #: (``use_orig_params=True`` pads each parameter to 16 bytes); world-size padding comes on
    #: top of it. None elsewhere.
    flat_numel: int | None = None

    @property
    def depth(self) -> int:
        return 0 if self.fqn == ROOT else self.fqn.count(".") + 1

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> UnitInfo:
        data = dict(data)
        data["params"] = tuple(data.get("params", ()))
        return cls(**data)


# --------------------------------------------------------------------------------------------
# Plans: FSDP1's auto-wrap decisions reproduced on a (meta) model, no process group
# --------------------------------------------------------------------------------------------


def planned_unit_modules(model: nn.Module, policy: Any) -> list[nn.Module]:
    """The modules FSDP1 would wrap under ``policy`` (root excluded), in post-order.

    Runs torch's own decision code: ``_Policy._run_policy`` for policy objects
    (``ModuleWrapPolicy``, ``CustomPolicy``), ``_recursive_wrap`` with a recording wrapper for
    callables (``transformer_auto_wrap_policy`` and friends). Nothing is allocated: use a meta
    model for full-scale plans.
    """
    if isinstance(policy, _compat.policy_base()):
        targets = policy._run_policy(model, set(), {})
        chosen = {id(m) for m in targets if m is not model}
        return [m for m in _post_order(model) if id(m) in chosen]

    recorded: list[nn.Module] = []

    def record(module: nn.Module, **_: Any) -> nn.Module:
        recorded.append(module)
        return module

    _compat.recursive_wrap()(
        module=model,
        auto_wrap_policy=policy,
        wrapper_cls=record,
        ignored_modules=set(),
        ignored_params=set(),
        only_wrap_children=True,
    )
    return recorded


def mixed_requires_grad_units(
    model: nn.Module, unit_modules: Sequence[nn.Module], ignored: Iterable[nn.Module] = ()
) -> list[str]:
    """The FQNs (``""`` the root) of the units of a plan whose own parameters mix frozen and
    trainable ones (``requires_grad`` both False and True), each parameter counted in the
    innermost unit holding it, the parameters of ``ignored`` modules in none.

    FSDP1 with ``use_orig_params=False`` (its default) refuses to flatten such a unit (torch:
    "Must flatten tensors with uniform requires_grad", or under an auto-wrap policy "... has
    both parameters with requires_grad=True and False"); ``use_orig_params=True`` takes it.
    """
    names = {id(m): clean_fqn(n) for n, m in model.named_modules()}
    claimed = {id(p) for m in ignored for p in m.parameters()}
    out = []
    for module in [*_innermost_first(model, unit_modules), model]:
        own = [p for p in module.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        if len({p.requires_grad for p in own}) > 1:
            out.append(names.get(id(module), ""))
    return sorted(out)


def _innermost_first(model: nn.Module, unit_modules: Sequence[nn.Module]) -> list[nn.Module]:
    depth = {id(m): n.count(".") + 1 for n, m in model.named_modules() if n}
    units = [m for m in unit_modules if m is not model]
    return sorted(units, key=lambda m: -depth.get(id(m), 0))


def plan_units(model: nn.Module, policy: Any) -> list[UnitInfo]:
    """The units FSDP1 (or FSDP2 applied to the same modules) would create under ``policy``."""
    return units_for_modules(model, planned_unit_modules(model, policy))


def units_for_modules(model: nn.Module, unit_modules: Iterable[nn.Module]) -> list[UnitInfo]:
    """UnitInfo rows for the given unit modules plus the root, as FSDP assigns parameters.

    Post-order, first come first served: a parameter belongs to the first unit (children before
    parents) whose subtree holds it, so a tied weight lands where FSDP1 would flatten it.
    """
    chosen = {id(m) for m in unit_modules}
    chosen.add(id(model))
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    param_names: dict[int, str] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        param_names.setdefault(id(p), fqn)
    claimed: set[int] = set()
    rows: list[tuple[nn.Module, list[Any]]] = []
    for module in _post_order(model):
        if id(module) not in chosen:
            continue
        own = [p for p in module.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        rows.append((module, own))
    units = [
        UnitInfo(
            fqn=names[id(module)],
            cls=type(module).__name__,
            numel=sum(p.numel() for p in own),
            params=tuple(param_names[id(p)] for p in own),
        )
        for module, own in rows
    ]
    return _with_parents(units, [n for n, _ in model.named_modules()])


def _post_order(model: nn.Module) -> list[nn.Module]:
    order: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child in module.children():
            visit(child)
        order.append(module)

    visit(model)
    return order


def _with_parents(units: Sequence[UnitInfo], order: Sequence[str] = ()) -> list[UnitInfo]:
    """Fill in each unit's parent; sort root first, then in module registration order."""
    fqns = {u.fqn for u in units}
    out = []
    for u in units:
        parent = None
        if u.fqn != ROOT:
            parts = u.fqn.split(".")
            parent = ROOT
            for i in range(len(parts) - 1, 0, -1):
                candidate = ".".join(parts[:i])
                if candidate in fqns:
                    parent = candidate
                    break
        out.append(dataclasses.replace(u, parent=parent))
    rank = {fqn: i for i, fqn in enumerate(order)}
    return sorted(
        out, key=lambda u: (u.fqn != ROOT, rank.get(u.fqn, len(rank)), _natural_key(u.fqn))
    )


def _natural_key(fqn: str) -> list[Any]:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in fqn.split(".")]


# --------------------------------------------------------------------------------------------
# Actual units of a sharded model
# --------------------------------------------------------------------------------------------


def clean_fqn(name: str) -> str:
    """An FQN without FSDP1's wrapper components."""
    parts = [p for p in name.split(".") if p and p != _FSDP1_PREFIX]
    return ".".join(parts)


def fsdp1_units(model: nn.Module) -> list[UnitInfo]:
    """The units of an FSDP1-wrapped model (``FullyShardedDataParallel``), root included."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDP):
            continue
        fqn = clean_fqn(name)
        flat = _compat.fsdp1_flat_param(module)
        prefix = f"{fqn}." if fqn else ""
        units.append(
            UnitInfo(
                fqn=fqn,
                cls=type(module.module).__name__,
                # The original parameters' numels: `_unpadded_unsharded_size` also counts the
                # alignment padding that use_orig_params=True inserts between parameters.
                numel=sum(_compat.fsdp1_original_numels(flat)) if flat is not None else 0,
                local_numel=int(flat.numel()) if flat is not None else 0,
                params=tuple(prefix + clean_fqn(p) for p in _fsdp1_fqns(flat)),
                flat_numel=_compat.fsdp1_unsharded_numel(flat) if flat is not None else None,
            )
        )
    return _with_parents(units, [clean_fqn(n) for n, _ in model.named_modules()])


def _fsdp1_fqns(flat: Any) -> list[str]:
    return _compat.fsdp1_param_fqns(flat) if flat is not None else []


def fsdp2_original_class(module: nn.Module) -> type:
    """``fully_shard`` swaps a module's class for ``FSDP<Cls>``; this returns ``Cls``."""
    fsdp_cls = _compat.fsdp_module_cls()
    cls = type(module)
    if isinstance(module, fsdp_cls):
        bases = [b for b in cls.__bases__ if b is not fsdp_cls]
        if bases:
            return bases[0]
    return cls


def fsdp2_units(model: nn.Module) -> list[UnitInfo]:
    """The units of an FSDP2 model (``fully_shard``), root included when it was sharded.

    Read from FSDP2's own state (each unit module's ``FSDPState``, its param groups and their
    managed parameters, through :mod:`~fsdp_conformance._compat`), not from the modules'
    ``named_parameters()``: a parameter ``fully_shard`` left out (``ignored_params``, or one
    re-assigned after sharding) is in no unit. Sizes come from the sharded parameters the
    groups hold, so the figures are right whether or not the model is currently gathered.
    Modules given to one ``fully_shard([...])`` call share a state; each reports the managed
    parameters registered in its own subtree (a tied weight under both names).
    """
    dtensor = _compat.dtensor_cls()
    module_names: dict[int, str] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        module_names.setdefault(id(m), n)
    order = {n: i for i, (n, _) in enumerate(model.named_parameters(remove_duplicate=False))}
    unit_modules = [(n, m, _compat.fsdp2_state(m)) for n, m in model.named_modules()]
    unit_modules = [(n, m, st) for n, m, st in unit_modules if st is not None]
    sharing: dict[int, list[str]] = {}
    for name, _, state in unit_modules:
        sharing.setdefault(id(state), []).append(name)
    units = []
    for name, module, state in unit_modules:
        own: dict[int, tuple[str, Any]] = {}
        for group in _compat.fsdp2_managed_params(state):
            for param, owners in group:
                fqn = _owner_fqn(module_names, name, owners)
                if (
                    fqn is None
                    and sharing[id(state)][0] == name
                    and not any(
                        _owner_fqn(module_names, other, owners) is not None
                        for other in sharing[id(state)][1:]
                    )
                ):
                    # Registered nowhere under the unit's modules any more: still the first
                    # module's, under the name torch recorded for it.
                    mod, attr = owners[0]
                    fqn = _join(module_names.get(id(mod), "<module outside the model>"), attr)
                if fqn is not None:
                    own.setdefault(id(param), (fqn, param))
        rows = sorted(own.values(), key=lambda np: (order.get(np[0], len(order)), np[0]))
        units.append(
            UnitInfo(
                fqn=name,
                cls=fsdp2_original_class(module).__name__,
                numel=sum(p.numel() for _, p in rows),
                local_numel=sum(
                    p.to_local().numel() if isinstance(p, dtensor) else p.numel() for _, p in rows
                ),
                params=tuple(n for n, _ in rows),
            )
        )
    return _with_parents(units, [n for n, _ in model.named_modules()])


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _owner_fqn(
    module_names: Mapping[int, str], unit: str, owners: Sequence[tuple[nn.Module, str]]
) -> str | None:
    """The first name a managed parameter is registered under inside ``unit``'s subtree."""
    for mod, attr in owners:
        where = module_names.get(id(mod))
        if where is not None and (where == unit or _is_below(where, unit)):
            return _join(where, attr)
    return None


def fsdp2_management_problems(model: nn.Module) -> list[str]:
    """Every parameter of an FSDP2 model is a sharded DTensor managed by exactly one param
    group: one line per parameter that is not (empty when all are).

    Read from FSDP2's state (:func:`fsdp2_units` says how). Call it while the model is
    resharded (after sharding, or after a backward that resharded): between a forward and
    its backward with ``reshard_after_forward=False`` the registered parameters are the
    unsharded ones.
    """
    dtensor = _compat.dtensor_cls()
    module_names: dict[int, str] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        module_names.setdefault(id(m), n)
    held_by: dict[int, list[str]] = {}
    stale: list[str] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        state = _compat.fsdp2_state(module)
        if state is None or id(state) in seen:
            continue
        seen.add(id(state))
        groups = _compat.fsdp2_managed_params(state)
        for i, group in enumerate(groups):
            label = (name or "(root)") + (f" (group {i})" if len(groups) > 1 else "")
            for param, owners in group:
                held_by.setdefault(id(param), []).append(label)
                if not any(getattr(mod, attr, None) is param for mod, attr in owners):
                    mod, attr = owners[0]
                    where = _join(module_names.get(id(mod), "<module outside the model>"), attr)
                    stale.append(
                        f"{where}: unit {label} manages a parameter the model no "
                        "longer holds there (re-assigned after fully_shard)"
                    )
    problems = []
    for fqn, p in model.named_parameters():
        holders = held_by.get(id(p), [])
        if not holders:
            problems.append(f"{fqn}: managed by no FSDP2 param group ({_describe(p, dtensor)})")
        elif len(holders) > 1:
            problems.append(
                f"{fqn}: managed by {len(holders)} param groups "
                f"({', '.join(holders)}); it must be exactly one"
            )
        elif not (isinstance(p, dtensor) and any(pl.is_shard() for pl in p.placements)):
            problems.append(
                f"{fqn}: managed by {holders[0]} but not sharded ({_describe(p, dtensor)})"
            )
    return problems + stale


def _describe(p: Any, dtensor: type[Any]) -> str:
    if isinstance(p, dtensor):
        return (
            f"DTensor {tuple(p.placements)}, {p.to_local().numel():,} of {p.numel():,} "
            "elements local"
        )
    return f"plain {type(p).__name__}, replicated: all {p.numel():,} elements on every rank"


def _is_below(name: str, ancestor: str) -> bool:
    return ancestor == ROOT and name != ROOT or name.startswith(ancestor + ".")


def actual_units(model: nn.Module) -> list[UnitInfo]:
    """Units of a sharded model, FSDP1 or FSDP2, detected from the model itself."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(model, FSDP) or any(isinstance(m, FSDP) for m in model.modules()):
        return fsdp1_units(model)
    return fsdp2_units(model)


# --------------------------------------------------------------------------------------------
# Printing and comparing
# --------------------------------------------------------------------------------------------


def format_unit_tree(units: Sequence[UnitInfo], title: str | None = None) -> str:
    """The units as an indented tree, in the spirit of the seeds' ``print(fsdp_model)``::

    MassiveModel (root)                 4,160 params
    ├── layers.0  DecoderLayer          37,184 params  local 18,592
    └── head      Linear                32,500 params
    """
    by_parent: dict[str | None, list[UnitInfo]] = {}
    for u in units:
        by_parent.setdefault(u.parent, []).append(u)
    lines = [title] if title else []
    width = max((len(u.fqn) + 4 * u.depth for u in units), default=10) + 2

    def label(u: UnitInfo) -> str:
        text = f"{u.numel:,} params"
        if u.local_numel is not None:
            text += f"  local {u.local_numel:,}"
        return text

    def walk(parent: str | None, prefix: str) -> None:
        children = by_parent.get(parent, [])
        for i, u in enumerate(children):
            last = i == len(children) - 1
            branch = "" if parent is None else ("└── " if last else "├── ")
            name = f"{u.cls} (root)" if u.fqn == ROOT else f"{u.fqn}  {u.cls}"
            head = f"{prefix}{branch}{name}"
            lines.append(f"{head:<{width + 24}} {label(u)}")
            walk(u.fqn, prefix + ("" if parent is None else ("    " if last else "│   ")))

    walk(None, "")
    orphans = [u for u in units if u.parent is not None and u.parent not in {x.fqn for x in units}]
    for u in orphans:
        lines.append(f"?? {u.fqn} {u.cls} (parent {u.parent!r} missing) {label(u)}")
    return "\n".join(lines)


def unit_differences(
    expected: Sequence[UnitInfo],
    actual: Sequence[UnitInfo],
    compare: Sequence[str] = ("cls", "numel", "parent"),
) -> list[str]:
    """Human-readable differences between two unit lists (empty when they agree)."""
    exp = {u.fqn: u for u in expected}
    act = {u.fqn: u for u in actual}
    diffs = []
    for fqn in sorted(exp.keys() - act.keys(), key=_natural_key):
        u = exp[fqn]
        diffs.append(f"- missing unit {fqn or '(root)'} ({u.cls}, {u.numel:,} params)")
    for fqn in sorted(act.keys() - exp.keys(), key=_natural_key):
        u = act[fqn]
        where = f" inside {u.parent or '(root)'}" if u.parent else ""
        diffs.append(f"+ unexpected unit {fqn or '(root)'} ({u.cls}, {u.numel:,} params){where}")
    for fqn in sorted(exp.keys() & act.keys(), key=_natural_key):
        for field in compare:
            a, b = getattr(exp[fqn], field), getattr(act[fqn], field)
            if a != b:
                diffs.append(
                    f"~ unit {fqn or '(root)'}: {field} expected {_show(a)}, got {_show(b)}"
                )
    return diffs


def unit_set_differences(expected: Sequence[UnitInfo], actual: Sequence[UnitInfo]) -> list[str]:
    """Differences in units, classes, sizes and nesting; plus a plain hint for common causes."""
    diffs = unit_differences(expected, actual, ("cls", "numel", "parent"))
    if diffs and len(actual) == 1 and len(expected) > 1:
        diffs.append(
            "! the policy wrapped nothing but the root: name the model's block class "
            "(--fsdp-block-cls) or check the size threshold"
        )
    expected_fqns = {u.fqn for u in expected}
    nested = [
        u
        for u in actual
        if u.fqn not in expected_fqns and u.parent in expected_fqns and u.parent != ROOT
    ]
    for u in nested:
        diffs.append(f"! {u.fqn} is a unit nested inside the block unit {u.parent}")
    return diffs


def _show(value: Any) -> str:
    """Counts with thousands separators (as in the trees), everything else as repr."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return repr(value)


def format_unit_mismatch(
    what: str, expected: Sequence[UnitInfo], actual: Sequence[UnitInfo], diffs: Sequence[str]
) -> str:
    """Expected vs actual as trees, then the differences: a failing check's message."""
    return "\n".join(
        [
            f"{what}: {len(diffs)} difference(s)",
            *(f"  {d}" for d in diffs),
            "",
            format_unit_tree(expected, "expected units:"),
            "",
            format_unit_tree(actual, "actual units:"),
        ]
    )


def assert_units_equal(
    what: str,
    expected: Sequence[UnitInfo],
    actual: Sequence[UnitInfo],
    compare: Sequence[str] = ("cls", "numel", "parent"),
) -> None:
    diffs = unit_differences(expected, actual, compare)
    if diffs:
        raise AssertionError(format_unit_mismatch(what, expected, actual, diffs))
