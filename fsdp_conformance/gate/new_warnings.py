"""New warnings and deprecations between two reports: each found per check, then grouped, one
difference per distinct warning and per deprecated API, naming every check that raised it."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_conformance.gate.difference import Difference
from fsdp_conformance.gate.schema import DEPRECATION_CATEGORIES

#: Source locations and object addresses inside warning texts change with every torch build;
#: without stripping them the same warning would show up as "new" after any upgrade.
_WARNING_NOISE = (
    re.compile(r"\s*\(Triggered internally at [^)]*\)\.?"),
    # the torch call a deprecation came through (_CALLED_AS): the same warning when torch
    # moves the function
    re.compile(r"\s*\[called as [^\]]+\]$"),
    re.compile(r"\bat 0x[0-9a-fA-F]+"),
)


def new_warnings(cid: str, old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Difference]:
    """A difference for each warning the new run raised that the old one did not."""
    diffs = []
    old_warnings = {_warning_key(w) for w in old.get("warnings", [])}
    deprecations = set(new.get("deprecations", []))
    reported: set[str] = set()
    for w in sorted(new.get("warnings", [])):
        key = _warning_key(w)
        if key in old_warnings or key in reported:
            continue
        reported.add(key)
        deprecation = w in deprecations or w.split(":", 1)[0] in DEPRECATION_CATEGORIES
        kind = "deprecation" if deprecation else "warning"
        # one line per difference: C++ warnings carry a newline before their hint
        diffs.append(Difference(cid, kind, False, f"new {kind}: {' '.join(w.split())}"))
    return diffs


def _warning_key(text: str) -> str:
    for pattern in _WARNING_NOISE:
        text = pattern.sub("", text)
    return " ".join(text.split())


def group_warnings(diffs: Sequence[Difference], fail_on_deprecation: bool) -> list[Difference]:
    """One difference per distinct new warning, and per API a new deprecation names, listing
    every check that raised it, where it was first seen: an upgrade's new warning is usually
    raised by many checks, and one line each buried the differences that matter. A deprecation
    is a regression with ``fail_on_deprecation``."""
    out: list[Difference | tuple[str, str]] = []
    groups: dict[tuple[str, str], list[Difference]] = {}
    for d in diffs:
        if d.kind not in ("warning", "deprecation"):
            out.append(d)
            continue
        key = (d.kind, deprecated_api(d.text) if d.kind == "deprecation" else d.text)
        if key not in groups:
            groups[key] = []
            out.append(key)  # the group sits where it was first seen
        groups[key].append(d)
    return [
        item
        if isinstance(item, Difference)
        else _one_group(item, groups[item], fail_on_deprecation)
        for item in out
    ]


def _one_group(
    key: tuple[str, str], members: Sequence[Difference], fail_on_deprecation: bool
) -> Difference:
    """A new warning's (or a deprecated API's) differences as one, naming every check."""
    kind, name = key
    cids = sorted({m.check_id for m in members})
    if kind == "deprecation":
        said = sorted({_CALLED_AS.sub("", m.text.split(": ", 1)[1]) for m in members})
        text = f"{name} will break: " + " | ".join(said) + f" (called by {', '.join(cids)})"
        where = cids[0] if len(cids) == 1 else f"{len(cids)} checks"
        return Difference(where, kind, fail_on_deprecation, text)
    if len(cids) == 1:
        return members[0]
    return Difference(f"{len(cids)} checks", kind, False, f"{name} (raised by {', '.join(cids)})")


#: The call a deprecation warning came through, as the worker records it (harness/worker.py):
#: ``FutureWarning: ... [called as torch.x.f]``.
_CALLED_AS = re.compile(r"\s*\[called as ([^\]]+)\]$")


def deprecated_api(text: str) -> str:
    """The API a deprecation names: the torch call it came through (recorded by the worker),
    else the first name its message quotes in backticks, else its first dotted or called name,
    else its message."""
    found = _CALLED_AS.search(text)
    if found:
        return found.group(1)
    message = text.split(": ", 2)[-1]
    named = re.search(r"`([^`]+)`", message) or re.search(
        r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?:\(\))?|[A-Za-z_]\w*\(\))", message
    )
    return named.group(1) if named else message
