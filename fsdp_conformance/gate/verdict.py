"""The upgrade gate's verdict: what ``compare`` prints, verdict first ("safe to upgrade: yes /
no"), then the counts by kind, then the differences grouped by kind; as text, Markdown or JSON
(docs/upgrade-gate.md).

Imports no torch (``compare`` stays light).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_conformance.gate.difference import Difference

#: The verdict's kinds, in the order they are shown, and the difference kinds each holds. A
#: difference of the ``regression`` kind is any blocking difference of another kind (a worse
#: outcome, a unit structure, memory, dtypes, collectives, numeric results, digests).
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("regression", "regressions"),
    ("drift", "numeric and memory drift"),
    ("known_defect", "known defects the candidate has, hit by your checks"),
    ("deprecation", "deprecations, by the API they name"),
    ("rollback", "rollback: the current torch loading the candidate's checkpoints"),
    ("fixed", "fixed upstream"),
    ("change", "other changes"),
)
#: Difference kinds with a category of their own; every other kind is a regression when it
#: blocks and a change when it does not.
_OWN = ("drift", "known_defect", "deprecation", "rollback", "fixed")


def category(d: Difference) -> str:
    """The verdict kind a difference is counted under."""
    if d.kind in _OWN:
        return d.kind
    return "regression" if d.regression else "change"


def counts(diffs: Sequence[Difference]) -> dict[str, dict[str, int]]:
    """Per verdict kind: how many differences, and how many of them block the upgrade."""
    out = {name: {"count": 0, "blocking": 0} for name, _ in CATEGORIES}
    for d in diffs:
        slot = out[category(d)]
        slot["count"] += 1
        slot["blocking"] += int(d.regression)
    return out


def safe(diffs: Sequence[Difference], fail_on_change: bool = False) -> bool:
    """Safe to upgrade: nothing blocks (with ``fail_on_change``: no difference at all)."""
    return not any(d.regression for d in diffs) and not (fail_on_change and diffs)


def _torches(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    return f"torch {old['environment']['torch']} -> {new['environment']['torch']}"


#: How the count line names each kind.
LABELS = {
    "regression": "regressions",
    "drift": "drift",
    "known_defect": "known defects",
    "deprecation": "deprecations",
    "rollback": "rollback",
    "fixed": "fixed upstream",
    "change": "other changes",
}


def _count_line(diffs: Sequence[Difference]) -> str:
    parts = []
    tally = counts(diffs)
    for name, _ in CATEGORIES:
        c = tally[name]
        label = LABELS[name]
        blocking = (
            f" ({c['blocking']} blocking)"
            if name in ("drift", "deprecation") and c["count"] and c["blocking"] != c["count"]
            else ""
        )
        parts.append(f"{label} {c['count']}{blocking}")
    return ", ".join(parts)


def _grouped(diffs: Sequence[Difference]) -> list[tuple[str, str, list[Difference]]]:
    return [
        (name, title, [d for d in diffs if category(d) == name])
        for name, title in CATEGORIES
        if any(category(d) == name for d in diffs)
    ]


def format_text(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    diffs: Sequence[Difference],
    fail_on_change: bool = False,
) -> str:
    """The verdict, the counts by kind, then the differences by kind (blocking ones marked)."""
    verdict = "yes" if safe(diffs, fail_on_change) else "no"
    lines = [
        f"safe to upgrade: {verdict} ({_torches(old, new)})",
        f"  {_count_line(diffs)}",
    ]
    if not diffs:
        return "\n".join(lines + ["no differences"])
    for _, title, members in _grouped(diffs):
        lines.append(f"{title}:")
        for d in members:
            mark = "BLOCKS" if d.regression else "said"
            lines.append(f"  [{mark}] {d.check_id}: {d.kind}: {d.text}")
    return "\n".join(lines)


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def format_markdown(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    diffs: Sequence[Difference],
    fail_on_change: bool = False,
) -> str:
    """The same verdict as Markdown: a heading with the answer, a table of counts by kind, a
    section per kind."""
    verdict = "yes" if safe(diffs, fail_on_change) else "no"
    lines = [
        f"# Safe to upgrade: {verdict}",
        "",
        f"{_torches(old, new)}",
        "",
        "| kind | count | blocking |",
        "| --- | ---: | ---: |",
    ]
    c = counts(diffs)
    for name, _ in CATEGORIES:
        lines.append(f"| {LABELS[name]} | {c[name]['count']} | {c[name]['blocking']} |")
    for _, title, members in _grouped(diffs):
        lines += ["", f"## {title[0].upper()}{title[1:]}", ""]
        for d in members:
            mark = "**blocks**" if d.regression else "said"
            lines.append(f"- {mark} `{_md(d.check_id)}` ({d.kind}): {_md(d.text)}")
    return "\n".join(lines) + "\n"


def to_json(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    diffs: Sequence[Difference],
    paths: tuple[str, str],
    options: Mapping[str, Any],
    fail_on_change: bool = False,
) -> str:
    """The verdict as JSON: ``safe_to_upgrade``, ``counts`` by kind, both reports' torch, the
    options compare ran with, and every difference with its kind."""
    return json.dumps(
        {
            "safe_to_upgrade": safe(diffs, fail_on_change),
            "counts": counts(diffs),
            "old": {"path": paths[0], "torch": old["environment"]["torch"]},
            "new": {"path": paths[1], "torch": new["environment"]["torch"]},
            **options,
            "regressions": sum(d.regression for d in diffs),
            "differences": [{**d.to_dict(), "category": category(d)} for d in diffs],
        },
        indent=2,
    )
