"""compare: the upgrade gate between two reports (``fsdp-conformance compare``).

``figures`` conventions that compare understands: keys ending in ``_bytes`` (or ``_MiB``) are
memory figures, a number or a list of numbers (compared with a relative tolerance and an
absolute floor); keys ending in ``_dtype``/``_dtypes`` are dtypes (any change is a regression);
``units`` is a unit count; keys ending in ``_norm``/``_norms`` are numeric results, a number or a
list of numbers (compared value by value with the relative tolerance :data:`NUMERIC_RTOL`, or
the larger one a check states in its figure ``numeric_rtol``, as the loop's float32 runs do: a
move beyond it is a regression); keys ending in ``_digest``/``_digests`` are digests of values
that must stay bitwise the same (compared exactly: a change is a regression); other floats are
measurements compare leaves to the checks; any other changed figure (an init ``digest``, a
count) is reported as a change. ``data["units"]``, else ``data["actual"]``, else
``data["plan"]``, is the check's unit list (structure changes are regressions).
``data["collectives"]`` is the check's recorded collectives (a changed dtype or byte count, or a
collective issued or no longer issued, is a regression; the same collectives in another order a
difference).

Numeric results and measurements differ in what moves them. A measurement (a loss or update
difference against a reference, a memory ratio) moves run to run or with rounding; its check
judges it against its own tolerance, so a measurement crossing it is already a failed outcome
(the loop's ``update_rel_diff`` above ``UPDATE_RTOL``), and compare follows the outcome. A
numeric result is what a check computes deterministically, so a move is torch computing
something else: the loop claim's ``grad_norms`` (the gradient's norm per optimizer step) and
clipping's ``total_norm`` run in float64 from seed 0 on both sides. Why 1e-9 relative: measured
on torch 2.13.0 (the odd model, world size 2, both accumulation checks), two runs give the same
bits, FSDP1 and FSDP2 the same bits, and two computations of the same gradient by other routes
(the sharded step against the single-process reference, accumulation with and without
synchronisation) agree to 1.1e-15 and 1.2e-16 relative: that is what a torch that sums in
another order moves them by. A torch that computes something else moves them by far more than
1e-9: a gradient summed instead of averaged by the world size (2x), a clipping coefficient
applied or not (the loop's negative controls move the updates by 0.3 or more). 1e-9 sits six
orders above rounding and leaves room for float64 sums over larger models. Such figures must be
stored unrounded: a value rounded to six decimals can flip its last digit on a 1e-16 move.
A figure only one report has (the suite added or dropped it) is a change, not a regression.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_conformance._files import PlainData
from fsdp_conformance.expectations import known_label
from fsdp_conformance.gate.migrate import migrate_report
from fsdp_conformance.gate.noise import entry_noise, is_measured, is_memory_key, numbers
from fsdp_conformance.gate.report import (
    DEPRECATION_CATEGORIES,
    UNIT_DATA_KEYS,
    collective_steps,
    first_line,
)
from fsdp_conformance.sizes import MiB

#: compare's default relative tolerance on memory figures.
DEFAULT_MEMORY_TOLERANCE = 0.05
#: compare's default absolute floor on memory moves: smaller ones are not reported (a move off a
#: zero baseline has no relative size, and OS high-water marks resolve to about 1 MB).
DEFAULT_MEMORY_FLOOR_BYTES = MiB
#: compare's relative tolerance on numeric results (figures ending in :data:`NUMERIC_SUFFIXES`):
#: six orders above the float64 rounding measured between routes to the same value (module
#: docstring).
NUMERIC_RTOL = 1e-9
#: A measured figure is drift when it moves by more than this many times its noise (the largest
#: spread of repeated runs on one torch, gate/noise.py): the spread of 2-3 runs underestimates
#: the true one, 3x covers that (docs/upgrade-gate.md).
DRIFT_K = 3.0
#: The rounding floor of a measured float whose check states no ``numeric_rtol``: relative to
#: the value (absolute for a difference against a reference, already relative). float32's
#: summation-order scale (~1e-7 per operation, 1e-5 over a step: the loop's float32
#: ``numeric_rtol``); a check in float64 or a lower precision states its own.
DRIFT_RTOL = 1e-5
#: Figure keys that are numeric results (a number or a list of numbers): a move beyond
#: :data:`NUMERIC_RTOL` is a regression.
NUMERIC_SUFFIXES = ("_norm", "_norms")
#: Figure keys that are digests of values that must stay bitwise the same: a change is a
#: regression.
DIGEST_SUFFIXES = ("_digest", "_digests")
#: Digest figures that are reported as a change, not a regression: init's ``reference_digest``
#: is the single-process model built from the seed on this torch; a torch whose initializers
#: draw differently changes it (the same seed, other weights: reproducibility, said), while
#: whether meta init equals that reference is init's own verdict on each side.
CHANGE_ONLY_DIGESTS = ("reference_digest",)
#: Unit fields compare looks at; a change in any of them is a changed unit structure.
UNIT_FIELDS = ("cls", "numel", "parent", "local_numel", "params")
#: Outcome order: a move to a lower rank is a regression (failed and error rank alike).
_OUTCOME_RANK = {"passed": 2, "skipped": 1, "xfailed": 1, "failed": 0, "error": 0}
#: Source locations and object addresses inside warning texts change with every torch build;
#: without stripping them the same warning would show up as "new" after any upgrade.
_WARNING_NOISE = (
    re.compile(r"\s*\(Triggered internally at [^)]*\)\.?"),
    # the torch call a deprecation came through (_CALLED_AS): the same warning when torch
    # moves the function
    re.compile(r"\s*\[called as [^\]]+\]$"),
    re.compile(r"\bat 0x[0-9a-fA-F]+"),
)


@dataclasses.dataclass(frozen=True)
class Difference(PlainData):
    """One difference between two reports."""

    check_id: str
    #: outcome | known_defect | fixed | missing | added | units | memory | drift | dtype |
    #: numeric | digest | collectives | order | warning | deprecation | rollback | checkpoint |
    #: figure |
    #: settings (:data:`~fsdp_conformance.gate.verdict.CATEGORIES` groups them for the verdict)
    kind: str
    regression: bool
    text: str


def compare_reports(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    memory_tolerance: float = DEFAULT_MEMORY_TOLERANCE,
    memory_floor_bytes: float = DEFAULT_MEMORY_FLOOR_BYTES,
    noise: Mapping[str, Any] | None = None,
    rollback: Mapping[str, Any] | None = None,
    fail_on_deprecation: bool = False,
    loads: Sequence[Mapping[str, Any]] = (),
) -> list[Difference]:
    """Every difference that matters for an upgrade, regressions flagged.

    Checks are matched by ``id``, after both reports are migrated to the current check names
    (:mod:`~fsdp_conformance.gate.migrate`), so a report of an older layout still matches.
    Regressions: a worse outcome (passed -> skipped/failed/error, skipped -> failed/error), a
    check missing from ``new``, a changed unit structure or unit count, a memory figure up by
    more than ``memory_tolerance`` (relative) and ``memory_floor_bytes`` (absolute), a changed
    dtype figure, a numeric result moved beyond :data:`NUMERIC_RTOL`, a changed digest, a
    recorded collective with another dtype or byte count, or issued in one report only.
    Reported but not regressions: better outcomes, added checks, memory down, other changed
    figures, the same collectives in another order, new warnings and deprecations, different
    settings.

    ``noise``: a noise table (:mod:`~fsdp_conformance.gate.noise`) for the figures whose entry
    in ``old`` carries none: a measured figure moved beyond its noise is a ``drift``
    (:func:`_drift`). A check going from passed to an expected failure is a regression
    (``known_defect``: the candidate has a defect the user's checks hit); the reverse is
    ``fixed`` upstream. ``rollback``: the report of the current torch loading the checkpoints
    the candidate wrote (``run --load-checkpoint``): each checkpoint check it failed is a
    ``rollback`` regression. ``loads``: reports of the candidate loading the current torch's
    checkpoints at other world sizes (resharded): each checkpoint check they failed is a
    ``checkpoint`` regression. ``fail_on_deprecation``: new deprecations are regressions too.
    """
    context = _Context(memory_tolerance, memory_floor_bytes, noise)
    old_checks = {e["id"]: e for e in migrate_report(old)["checks"]}
    new_checks = {e["id"]: e for e in migrate_report(new)["checks"]}
    diffs = _compare_settings(old.get("settings") or {}, new.get("settings") or {})
    for cid in sorted(old_checks.keys() - new_checks.keys()):
        was = old_checks[cid]["outcome"]
        diffs.append(
            Difference(cid, "missing", True, f"check missing from the new report (was {was})")
        )
    for cid in sorted(new_checks.keys() - old_checks.keys()):
        # A new check that fails is a failure on the candidate torch: the gate must not pass it.
        now = new_checks[cid]["outcome"]
        diffs.append(Difference(cid, "added", now in ("failed", "error"), f"new check (now {now})"))
    for cid in sorted(old_checks.keys() & new_checks.keys()):
        diffs += _compare_entry(cid, old_checks[cid], new_checks[cid], context)
    if context.unmeasured:
        diffs.append(
            Difference(
                f"{len(context.unmeasured)} checks",
                "drift",
                False,
                "measured figures moved, but their noise was never measured, so drift cannot "
                "be told from noise: "
                + _items(sorted(context.unmeasured))
                + "; measure it (`fsdp-conformance noise`, docs/upgrade-gate.md) and pass "
                "--noise",
            )
        )
    if rollback is not None:
        diffs += checkpoint_loads(rollback, "rollback")
    for report in loads:
        diffs += checkpoint_loads(report, "checkpoint")
    return _group_warnings(diffs, fail_on_deprecation)


def _group_warnings(diffs: Sequence[Difference], fail_on_deprecation: bool) -> list[Difference]:
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


#: Settings that define the model under test: reports that differ in one of them measured
#: different models, so their checks cannot be matched.
MODEL_SETTINGS = ("model", "block_cls", "min_params", "input")


def comparability(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """None when two (validated) reports can be compared, else what differs, in one line.

    Not comparable: a different model (any of ``MODEL_SETTINGS``), or no check id in common
    (different world sizes, lanes or ``--checks``; an empty report). Either way every check
    would show up as missing and added, burying the one difference that matters.
    """
    reasons = [
        f"settings.{key} {old['settings'].get(key)!r} vs {new['settings'].get(key)!r}"
        for key in MODEL_SETTINGS
        if old["settings"].get(key) != new["settings"].get(key)
    ]
    old_ids = {e["id"] for e in migrate_report(old)["checks"]}
    new_ids = {e["id"] for e in migrate_report(new)["checks"]}
    if not old_ids & new_ids:
        others = [
            f"{key} {old['settings'].get(key)!r} vs {new['settings'].get(key)!r}"
            for key in sorted(old["settings"].keys() | new["settings"].keys())
            if key not in MODEL_SETTINGS and old["settings"].get(key) != new["settings"].get(key)
        ]
        reasons.append(
            f"no check in common ({len(old_ids)} checks vs {len(new_ids)}"
            + (f"; settings {', '.join(others)}" if others else "")
            + ")"
        )
    return "; ".join(reasons) or None


def _compare_settings(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Difference]:
    # Context, not a verdict: different settings usually explain the differences that follow.
    return [
        Difference("(settings)", "settings", False, f"{key}: {old.get(key)!r} -> {new.get(key)!r}")
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key)
    ]


@dataclasses.dataclass
class _Context:
    """What every entry's comparison shares: memory's tolerance and floor, the noise table, and
    the measured figures that moved with no noise to judge them by (one summary line)."""

    tol: float
    floor: float
    noise: Mapping[str, Any] | None
    unmeasured: set[str] = dataclasses.field(default_factory=set)


def _compare_entry(
    cid: str, old: Mapping[str, Any], new: Mapping[str, Any], context: _Context
) -> list[Difference]:
    diffs = []
    o, n = old["outcome"], new["outcome"]
    if o != n and "xfailed" in (o, n) and "failed" not in (o, n) and "error" not in (o, n):
        diffs.append(_expectation_change(cid, old, new))
    elif o != n:
        regression = _OUTCOME_RANK[n] < _OUTCOME_RANK[o]
        why = first_line(new.get("message", "")) if n != "passed" else ""
        text = f"{o} -> {n}" + (f": {why}" if why else "")
        diffs.append(Difference(cid, "outcome", regression, text))
    old_units, new_units = unit_list(old), unit_list(new)
    if old_units is not None and new_units is not None:
        change = _unit_change(old_units, new_units)
        if change:
            diffs.append(Difference(cid, "units", True, change))
    of, nf = old.get("figures") or {}, new.get("figures") or {}
    lists = old_units is not None and new_units is not None
    # A check may state the tolerance of its own numeric results (a loop run in float32).
    rtol = max(
        [NUMERIC_RTOL] + [f["numeric_rtol"] for f in (of, nf) if _number(f.get("numeric_rtol"))]
    )
    stated = any(_number(f.get("numeric_rtol")) for f in (of, nf))
    for key in sorted(of.keys() | nf.keys()):
        a, b = of.get(key), nf.get(key)
        if a == b:
            continue
        if is_measured(key, a) and is_measured(key, b):
            if n in ("failed", "error"):
                continue  # the outcome is the regression, its measurements not a second one
            spread = entry_noise(old, context.noise, key)
            if is_memory_key(key):
                diffs += _memory_change(cid, key, a, b, context.tol, context.floor, spread)
            elif spread is None:
                context.unmeasured.add(f"{cid} {key}")
            else:
                diffs += _drift(cid, key, a, b, spread, rtol if stated else DRIFT_RTOL)
            continue
        diffs += _figure_change(cid, key, a, b, rtol, lists)
    return diffs + _collective_changes(cid, old, new) + _new_warnings(cid, old, new)


def _figure_change(
    cid: str, key: str, a: Any, b: Any, rtol: float, unit_lists: bool
) -> list[Difference]:
    """One changed figure that is not a measurement, by the conventions of the module
    docstring; ``rtol``: the numeric results' relative tolerance."""
    if key.endswith(("_dtype", "_dtypes")):
        return [Difference(cid, "dtype", True, f"{key}: {a} -> {b}")]
    if key == "units":
        # With both unit lists, the change is reported with them.
        return [] if unit_lists else [Difference(cid, "units", True, f"unit count {a} -> {b}")]
    if key.endswith(NUMERIC_SUFFIXES + DIGEST_SUFFIXES) and key not in CHANGE_ONLY_DIGESTS:
        if a is None or b is None:  # a figure the suite added or dropped: a change
            return [Difference(cid, "figure", False, f"{key}: {a!r} -> {b!r}")]
        if key.endswith(NUMERIC_SUFFIXES):
            return _numeric_change(cid, key, a, b, rtol)
        return [Difference(cid, "digest", True, f"{key}: {_changed_values(a, b)}")]
    if key == "numeric_rtol" or _is_measurement(a) or _is_measurement(b):
        return []  # a stated tolerance, or a figure the suite added or dropped
    return [Difference(cid, "figure", False, f"{key}: {a!r} -> {b!r}")]


def is_error_figure(key: str) -> bool:
    """A difference against a reference (``update_rel_diff``, ``max_param_diff``): growing is
    moving away from the reference, shrinking is moving towards it."""
    return key.endswith(("_diff", "_diffs"))


def is_loss_figure(key: str) -> bool:
    """A loss (``loss``, ``reference_loss``, ``losses``): what the step computed."""
    return key in ("loss", "losses") or key.endswith(("_loss", "_losses"))


def _drift(cid: str, key: str, a: Any, b: Any, spread: float, rtol: float) -> list[Difference]:
    """A measured float (not memory) against its noise: each value moved by more than
    :data:`DRIFT_K` times the noise, and more than the rounding floor (``rtol``, relative to the
    value, or absolute for a difference against a reference, which is already relative), is
    drift. A regression when the step computes something else: a
    difference against the reference grown, a loss moved; another figure (a ratio) moved, or a
    difference shrunk towards the reference, is drift reported, not a regression."""
    xs, ys = numbers(a) or [], numbers(b) or []
    if len(xs) != len(ys):
        return [Difference(cid, "figure", False, f"{key}: {a!r} -> {b!r}")]
    moved, grew = [], False
    for i, (x, y) in enumerate(zip(xs, ys)):
        scale = 1.0 if is_error_figure(key) else max(abs(x), abs(y))
        floor = rtol * scale
        if math.isnan(x) != math.isnan(y) or abs(y - x) > max(DRIFT_K * spread, floor):
            label = f"[{i}] " if len(xs) > 1 else ""
            moved.append(f"{label}{x!r} -> {y!r}")
            grew = grew or not y <= x  # a NaN is never better
    if not moved:
        return []
    if is_error_figure(key):
        regression = grew
        how = "away from the reference" if grew else "towards the reference"
    else:
        regression = is_loss_figure(key)
        how = "the step computes another loss" if regression else "moved"
    return [
        Difference(
            cid,
            "drift",
            regression,
            f"{key}: {_items(moved)} ({how}; noise {spread:.3g} over repeated runs, "
            f"drift beyond {DRIFT_K}x it and the rounding floor {rtol:.0e})",
        )
    ]


def _changed_values(a: Any, b: Any) -> str:
    """``a -> b``, or for two lists of one length the positions that differ, ``[i] x -> y``."""
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return _items([f"[{i}] {x!r} -> {y!r}" for i, (x, y) in enumerate(zip(a, b)) if x != y])
    return f"{a!r} -> {b!r}"


def _same_number(x: float, y: float, rtol: float) -> bool:
    """Equal within ``rtol`` of the larger magnitude (two NaNs are the same result)."""
    if x == y or (math.isnan(x) and math.isnan(y)):
        return True
    return abs(y - x) <= rtol * max(abs(x), abs(y))  # False with one NaN


def _numeric_change(cid: str, key: str, a: Any, b: Any, rtol: float) -> list[Difference]:
    """A numeric result (a number, or a list of numbers compared value by value): each value
    moved beyond ``rtol``, relative to the larger, is named; a regression."""
    if _number(a) and _number(b):
        pairs = [("", a, b)]
    elif (
        isinstance(a, list)
        and isinstance(b, list)
        and len(a) == len(b)
        and all(_number(x) for x in a + b)
    ):
        pairs = [(f"[{i}] ", x, y) for i, (x, y) in enumerate(zip(a, b))]
    else:
        return [
            Difference(
                cid, "numeric", True, f"{key}: {a!r} -> {b!r} (not comparable value by value)"
            )
        ]
    moved = []
    for label, x, y in pairs:
        if not _same_number(x, y, rtol):
            rel = (y - x) / abs(x) if x else math.inf
            moved.append(f"{label}{x!r} -> {y!r} ({rel:+.1e})")
    if not moved:
        return []
    return [
        Difference(
            cid,
            "numeric",
            True,
            f"{key}: {_items(moved)} (relative tolerance {rtol:.0e})",
        )
    ]


def _expectation_change(cid: str, old: Mapping[str, Any], new: Mapping[str, Any]) -> Difference:
    """A move into or out of an expected failure (a known torch defect). Into it is a regression
    (``known_defect``): the candidate has a defect the user's checks hit, and the user would hit
    it too; out of it is ``fixed`` upstream (its expectation can go). A failure no expectation
    covers stays a regression (the outcome rule)."""
    o, n = old["outcome"], new["outcome"]
    if o == "xfailed":
        why = (old.get("expected") or {}).get("link", "")
        return Difference(
            cid,
            "fixed",
            False,
            f"xfailed -> {n}: the expected failure ({why}) no longer fails on the "
            "candidate: fixed upstream? its expectation can go",
        )
    expected = new.get("expected") or {}
    return Difference(
        cid,
        "known_defect",
        o == "passed",
        f"{o} -> xfailed: the candidate has a {known_label(expected.get('kind'))} your checks "
        f"hit: {expected.get('reason', '')} ({expected.get('link', '')})",
    )


def checkpoint_loads(report: Mapping[str, Any], kind: str) -> list[Difference]:
    """A report of loading the other side's checkpoints (``run --load-checkpoint``): each
    checkpoint check that did not pass is a regression of ``kind``, in its message's first line
    (``rollback``: the current torch loading the candidate's; ``checkpoint``: the candidate
    loading the current torch's at another world size); none run is said, and blocks (it proves
    nothing), as is every one passing."""
    entries = [e for e in report["checks"] if e["check"].startswith("state.checkpoint")]
    torch = report["environment"]["torch"]
    sizes = ",".join(map(str, report["settings"].get("world_sizes") or []))
    where = f"(checkpoints loaded by torch {torch} at world size {sizes})"
    if not entries:
        return [
            Difference(
                where,
                kind,
                True,
                f"the report of loading checkpoints on torch {torch} holds no state.checkpoint "
                "check: run it with --load-checkpoint DIR, DIR the other side's "
                "--save-checkpoint",
            )
        ]
    bad = [e for e in entries if e["outcome"] not in ("passed", "xfailed")]
    if not bad:
        return [
            Difference(
                where,
                kind,
                False,
                f"torch {torch} loads the checkpoints the other side wrote ({len(entries)} checks)",
            )
        ]
    return [
        Difference(e["id"], kind, True, first_line(e.get("message", ""), width=None)) for e in bad
    ]


#: Changed items listed in one difference line before "(+N more)".
_SHOWN = 4


def _items(parts: Sequence[str]) -> str:
    more = f"; (+{len(parts) - _SHOWN} more)" if len(parts) > _SHOWN else ""
    return "; ".join(parts[:_SHOWN]) + more


def _collective_key(r: Mapping[str, Any]) -> tuple[str, str, str]:
    return (str(r.get("op")), str(r.get("unit")), str(r.get("phase")))


def _collective_name(key: tuple[str, str, str], k: int) -> str:
    op, unit, phase = key
    return f"{phase + ' ' if phase else ''}{op} {unit or '(root)'}" + (f" #{k + 1}" if k else "")


def _collective_changes(
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
        diffs.append(Difference(cid, "dtype", True, f"{label}collective dtype: {_items(dtypes)}"))
    if sizes:
        diffs.append(
            Difference(cid, "collectives", True, f"{label}collective bytes: {_items(sizes)}")
        )
    if gone or came:
        diffs.append(
            Difference(
                cid, "collectives", True, f"{label}collectives issued: {_items(gone + came)}"
            )
        )
    elif old_ids != new_ids:
        order = ", ".join(_collective_name(*i) for i in new_ids)
        diffs.append(Difference(cid, "order", False, f"{label}collective order now: {order}"))
    return diffs


def _new_warnings(cid: str, old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Difference]:
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


def unit_list(entry: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    """The unit list a report entry stores (``data["units"]``, ``["actual"]`` or ``["plan"]``)."""
    data = entry.get("data") or {}
    for key in UNIT_DATA_KEYS:
        units = data.get(key)
        if isinstance(units, list) and all(isinstance(u, dict) and "fqn" in u for u in units):
            return units
    return None


def _warning_key(text: str) -> str:
    for pattern in _WARNING_NOISE:
        text = pattern.sub("", text)
    return " ".join(text.split())


def _is_measurement(value: Any) -> bool:
    """A float, or a list of numbers with a float among them."""
    if isinstance(value, float):
        return True
    if isinstance(value, list) and value:
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        return numbers and any(isinstance(v, float) for v in value)
    return False


def _mib(key: str, value: float) -> float:
    return value / MiB if key.endswith("_bytes") else value


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _memory_change(
    cid: str, key: str, a: Any, b: Any, tol: float, floor_bytes: float, spread: float | None
) -> list[Difference]:
    """A memory figure (a number, or a list of numbers compared element by element): a rise
    beyond the relative tolerance, the absolute floor and :data:`DRIFT_K` times its noise (where
    measured) is a regression; a move beyond its noise inside the tolerance is drift, said."""
    xs, ys = numbers(a), numbers(b)
    if xs is None or ys is None or len(xs) != len(ys):
        return [Difference(cid, "figure", False, f"{key}: {a!r} -> {b!r}")]
    single = _number(a)
    floor = floor_bytes if key.endswith("_bytes") else floor_bytes / MiB
    noise = DRIFT_K * spread if spread is not None else 0.0
    diffs, drifted = [], []
    for i, (x, y) in enumerate(zip(xs, ys)):
        label = key if single else f"{key}[{i}]"
        # Both a relative and an absolute threshold: a move off a zero (or tiny) baseline is
        # infinite in relative terms, and OS high-water marks resolve to about 1 MB.
        rel = (y - x) / x if x else float("inf") if y > x else float("-inf")
        values = f"{_mib(key, x):.2f} MiB -> {_mib(key, y):.2f} MiB ({rel:+.1%}"
        beyond_noise = abs(y - x) > noise
        if abs(y - x) > floor and abs(rel) > tol and abs(y - x) > noise:
            said = f"; noise {_mib(key, spread):.2f} MiB" if spread is not None else ""
            diffs.append(
                Difference(
                    cid,
                    "memory",
                    y > x,
                    f"{label}: {values}; tolerance {tol:.0%}, floor {floor_bytes / MiB:.2f} "
                    f"MiB{said})",
                )
            )
        elif spread is not None and beyond_noise:
            drifted.append(f"{label}: {values})")
    if drifted:
        diffs.append(
            Difference(
                cid,
                "drift",
                False,
                f"memory moved beyond its noise ({_mib(key, spread or 0.0):.2f} MiB over "
                f"repeated runs), inside the tolerance: {_items(drifted)}",
            )
        )
    return diffs


def _unit_change(
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
