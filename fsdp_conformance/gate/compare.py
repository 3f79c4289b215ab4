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
from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_conformance.expectations import known_label
from fsdp_conformance.gate.difference import Difference, listed
from fsdp_conformance.gate.figures import DRIFT_RTOL, drift, figure_change, is_number, memory_change
from fsdp_conformance.gate.migrate import migrate_report
from fsdp_conformance.gate.new_warnings import group_warnings, new_warnings
from fsdp_conformance.gate.noise import entry_noise, is_measured, is_memory_key
from fsdp_conformance.gate.structure import collective_changes, unit_change, unit_list
from fsdp_conformance.gate.tables import first_line
from fsdp_conformance.sizes import MiB

#: compare's default relative tolerance on memory figures.
DEFAULT_MEMORY_TOLERANCE = 0.05
#: compare's default absolute floor on memory moves: smaller ones are not reported (a move off a
#: zero baseline has no relative size, and OS high-water marks resolve to about 1 MB).
DEFAULT_MEMORY_FLOOR_BYTES = MiB
#: compare's relative tolerance on numeric results (figures ending in
#: :data:`~fsdp_conformance.gate.figures.NUMERIC_SUFFIXES`):
#: six orders above the float64 rounding measured between routes to the same value (module
#: docstring).
NUMERIC_RTOL = 1e-9
#: Outcome order: a move to a lower rank is a regression (failed and error rank alike).
_OUTCOME_RANK = {"passed": 2, "skipped": 1, "xfailed": 1, "failed": 0, "error": 0}


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
    (:func:`~fsdp_conformance.gate.figures.drift`). A check going from passed to an expected
    failure is a regression (``known_defect``: the candidate has a defect the user's checks
    hit); the reverse is ``fixed`` upstream. ``rollback``: the report of the current torch
    loading the checkpoints the candidate wrote (``run --load-checkpoint``): each checkpoint
    check it failed is a ``rollback`` regression. ``loads``: reports of the candidate loading
    the current torch's checkpoints at other world sizes (resharded): each checkpoint check they
    failed is a ``checkpoint`` regression. ``fail_on_deprecation``: new deprecations are
    regressions too.
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
                + listed(sorted(context.unmeasured))
                + "; measure it (`fsdp-conformance noise`, docs/upgrade-gate.md) and pass "
                "--noise",
            )
        )
    if rollback is not None:
        diffs += checkpoint_loads(rollback, "rollback")
    for report in loads:
        diffs += checkpoint_loads(report, "checkpoint")
    return group_warnings(diffs, fail_on_deprecation)


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
        change = unit_change(old_units, new_units)
        if change:
            diffs.append(Difference(cid, "units", True, change))
    of, nf = old.get("figures") or {}, new.get("figures") or {}
    lists = old_units is not None and new_units is not None
    # A check may state the tolerance of its own numeric results (a loop run in float32).
    rtol = max(
        [NUMERIC_RTOL] + [f["numeric_rtol"] for f in (of, nf) if is_number(f.get("numeric_rtol"))]
    )
    stated = any(is_number(f.get("numeric_rtol")) for f in (of, nf))
    for key in sorted(of.keys() | nf.keys()):
        a, b = of.get(key), nf.get(key)
        if a == b:
            continue
        if is_measured(key, a) and is_measured(key, b):
            if n in ("failed", "error"):
                continue  # the outcome is the regression, its measurements not a second one
            spread = entry_noise(old, context.noise, key)
            if is_memory_key(key):
                diffs += memory_change(cid, key, a, b, context.tol, context.floor, spread)
            elif spread is None:
                context.unmeasured.add(f"{cid} {key}")
            else:
                diffs += drift(cid, key, a, b, spread, rtol if stated else DRIFT_RTOL)
            continue
        diffs += figure_change(cid, key, a, b, rtol, lists)
    return diffs + collective_changes(cid, old, new) + new_warnings(cid, old, new)


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
