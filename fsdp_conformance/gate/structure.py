"""What torch built and issued, compared: a check's unit list and its recorded collectives."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_conformance.gate.difference import Difference, listed
from fsdp_conformance.gate.schema import UNIT_DATA_KEYS, collective_steps

#: Unit fields compare looks at; a change in any of them is a changed unit structure.
UNIT_FIELDS = ("cls", "numel", "parent", "local_numel", "params")


def unit_list(entry: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    """The unit list a report entry stores (``data["units"]``, ``["actual"]`` or ``["plan"]``)."""
    data = entry.get("data") or {}
    for key in UNIT_DATA_KEYS:
        units = data.get(key)
        if isinstance(units, list) and all(isinstance(u, dict) and "fqn" in u for u in units):
            return units
    return None


def unit_change(
    old_units: Sequence[Mapping[str, Any]], new_units: Sequence[Mapping[str, Any]]
) -> str:
    """'' when the structures agree, else the changed units, one ``+``/``-``/``~`` item each."""

    def norm(u: Mapping[str, Any]) -> dict[str, Any]:
        out = {f: u.get(f) for f in UNIT_FIELDS}
        if isinstance(out["params"], list):
            out["params"] = sorted(out["params"])
        return out

    o = {u["fqn"]: norm(u) for u in old_units}
    n = {u["fqn"]: norm(u) for u in new_units}
    parts = []
    for fqn in [u["fqn"] for u in old_units if u["fqn"] not in n]:
        parts.append(f"- {fqn or '(root)'} ({o[fqn]['cls']})")
    for fqn in [u["fqn"] for u in new_units if u["fqn"] not in o]:
        parts.append(f"+ {fqn or '(root)'} ({n[fqn]['cls']})")
    for fqn in [u["fqn"] for u in old_units if u["fqn"] in n]:
        for field in UNIT_FIELDS:
            a, b = o[fqn][field], n[fqn][field]
            if a == b:
                continue
            if field == "params" and isinstance(a, list) and isinstance(b, list):
                moved = [f"-{p}" for p in a if p not in b] + [f"+{p}" for p in b if p not in a]
                parts.append(f"~ {fqn or '(root)'} params: {' '.join(moved)}")
            else:
                parts.append(f"~ {fqn or '(root)'} {field}: {a!r} -> {b!r}")
    if not parts and [u["fqn"] for u in old_units] != [u["fqn"] for u in new_units]:
        parts.append("unit order: " + ", ".join(u["fqn"] or "(root)" for u in new_units))
    return "unit structure changed: " + "; ".join(parts) if parts else ""


def _collective_key(r: Mapping[str, Any]) -> tuple[str, str, str]:
    return (str(r.get("op")), str(r.get("unit")), str(r.get("phase")))


def _collective_name(key: tuple[str, str, str], k: int) -> str:
    op, unit, phase = key
    return f"{phase + ' ' if phase else ''}{op} {unit or '(root)'}" + (f" #{k + 1}" if k else "")


def collective_changes(
    cid: str, old: Mapping[str, Any], new: Mapping[str, Any]
) -> list[Difference]:
    """Recorded collectives, step by step: the k-th (op, unit, phase) of one report is matched
    with the k-th of the other; dtypes and bytes are compared pair by pair."""
    a, b = collective_steps(old), collective_steps(new)
    if a is None or b is None:
        return []
    diffs = []
    for step in sorted(a.keys() | b.keys()):
        label = f"{step}: " if step else ""
        if step not in b:
            diffs.append(
                Difference(
                    cid,
                    "collectives",
                    True,
                    f"{label}no collectives recorded any more (was {len(a[step])})",
                )
            )
            continue
        if step not in a:
            diffs.append(
                Difference(
                    cid, "collectives", False, f"{label}newly recorded ({len(b[step])} collectives)"
                )
            )
            continue
        diffs += _step_changes(cid, label, a[step], b[step])
    return diffs


def _numbered(records: Sequence[Mapping[str, Any]]) -> list[tuple[tuple[str, str, str], int]]:
    seen: dict[tuple[str, str, str], int] = {}
    out = []
    for r in records:
        key = _collective_key(r)
        out.append((key, seen.get(key, 0)))
        seen[key] = seen.get(key, 0) + 1
    return out


def _step_changes(
    cid: str, label: str, old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]
) -> list[Difference]:
    old_ids, new_ids = _numbered(old), _numbered(new)
    by_old = dict(zip(old_ids, old))
    by_new = dict(zip(new_ids, new))
    dtypes, sizes = [], []
    for ident in old_ids:
        if ident not in by_new:
            continue
        x, y, name = by_old[ident], by_new[ident], _collective_name(*ident)
        for side in ("in", "out"):
            if x.get(f"{side}_dtype") != y.get(f"{side}_dtype"):
                dtypes.append(
                    f"{name} {side}_dtype {x.get(f'{side}_dtype')} -> {y.get(f'{side}_dtype')}"
                )
            if x.get(f"{side}_bytes") != y.get(f"{side}_bytes"):
                sizes.append(
                    f"{name} {side}_bytes {x.get(f'{side}_bytes')} -> {y.get(f'{side}_bytes')}"
                )
    gone = [f"- {_collective_name(*i)}" for i in old_ids if i not in by_new]
    came = [f"+ {_collective_name(*i)}" for i in new_ids if i not in by_old]
    diffs = []
    if dtypes:
        diffs.append(Difference(cid, "dtype", True, f"{label}collective dtype: {listed(dtypes)}"))
    if sizes:
        diffs.append(
            Difference(cid, "collectives", True, f"{label}collective bytes: {listed(sizes)}")
        )
    if gone or came:
        diffs.append(
            Difference(
                cid, "collectives", True, f"{label}collectives issued: {listed(gone + came)}"
            )
        )
    elif old_ids != new_ids:
        order = ", ".join(_collective_name(*i) for i in new_ids)
        diffs.append(Difference(cid, "order", False, f"{label}collective order now: {order}"))
    return diffs
