"""How every rank's outcome becomes one result: values, a skip, or one failure naming each rank."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from typing import Any

from fsdp_conformance.harness.protocol import CheckSkipped, RankOutcome


class RankFailure(AssertionError):
    """One or more ranks failed a check: the message holds every rank's story."""


class HarnessError(RuntimeError):
    """The harness itself could not do what was asked (bad arguments, ranks failed to start)."""


def resolve_outcomes(check_name: str, outcomes: Sequence[RankOutcome]) -> list[Any]:
    """Turn every rank's outcome into the check's result: values, a skip, or one failure."""
    __tracebackhide__ = True  # the report is the ranks' story, not this frame
    statuses = {o.status for o in outcomes}
    if statuses == {"ok"}:
        return [o.value for o in sorted(outcomes, key=lambda o: o.rank)]
    if statuses == {"skip"}:
        reasons = sorted({o.detail for o in outcomes})
        raise CheckSkipped("; ".join(reasons))
    raise RankFailure(format_failure(check_name, outcomes))


STATUS_TITLE = {
    "ok": "passed",
    "skip": "skipped",
    "error": "raised",
    "died": "died",
    "hung": "did not finish",
    "silent": "never reported",
    # Passed (or skipped) but left a change the rank cannot undo: a live non-daemon thread,
    # a destroyed process group. Not "ok", so the pool is discarded and rebuilt.
    "leaked": "left state behind",
}


def format_failure(check_name: str, outcomes: Sequence[RankOutcome]) -> str:
    """A report a person can act on: a one-line summary, then each rank's story."""
    ordered = sorted(outcomes, key=lambda o: o.rank)
    statuses = {o.status for o in ordered}
    summary = ", ".join(f"rank {o.rank} {STATUS_TITLE.get(o.status, o.status)}" for o in ordered)
    # A rank stopped while the others skipped did not skip: the ranks disagree.
    if "skip" in statuses and statuses <= {"ok", "skip", "hung"}:
        headline = (
            f"check {check_name!r}: ranks disagree on skipping ({summary}); "
            "a check must skip on every rank or on none"
        )
    else:
        headline = f"check {check_name!r} failed on {len(ordered)} ranks: {summary}"
    parts = [headline]
    for o in ordered:
        if o.status == "ok":
            continue
        title = f"--- rank {o.rank}: {STATUS_TITLE.get(o.status, o.status)}"
        parts.append(f"{title} ---\n{o.detail.rstrip()}" if o.detail else title + " ---")
    return "\n".join(parts)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        return f"killed by {_signal_name(-returncode)} (exit status {returncode})"
    return f"exited with code {returncode}"

