"""How every rank's outcome becomes one result: values, a skip, or one failure naming each rank."""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence
from typing import Any

from fsdp_conformance.harness.protocol import CheckSkipped, RankOutcome


class RankFailure(AssertionError):
    """One or more ranks failed a check: the message holds every rank's story, ``outcomes``
    every rank's outcome (for a reader that tells the story in one line)."""

    def __init__(self, message: str, outcomes: Sequence[RankOutcome] = ()) -> None:
        super().__init__(message)
        self.outcomes = tuple(outcomes)


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
    raise RankFailure(format_failure(check_name, outcomes), outcomes)


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


_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def crash_site(log_text: str) -> str | None:
    """Where a rank's crash happened, from the stack faulthandler wrote to its log.

    The torch function the caller called and, where that differs, the innermost torch frame
    (``inside torch: torch.distributed.c10d_logger.wrapper (crashed in
    torch.distributed.distributed_c10d.all_reduce, line 2942)``); without a torch frame, the
    innermost frame. None where the log holds no crashed thread's stack (faulthandler prints it
    most recent first, after "Current thread" or "Thread").
    """
    lines = log_text.splitlines()
    starts = [
        i
        for i, ln in enumerate(lines)
        if ln.startswith(("Current thread", "Thread 0x")) and "most recent call first" in ln
    ]
    if not starts:
        return None
    current = [i for i in starts if lines[i].startswith("Current thread")]
    frames = []
    for ln in lines[(current or starts)[0] + 1 :]:
        m = _FRAME.match(ln)
        if not m:
            break
        frames.append(m)
    if not frames:
        return None

    def torch_name(m: re.Match[str]) -> str | None:
        path = m["path"].replace("\\", "/")
        if "/torch/" not in path:
            return None
        module = "torch/" + path.rsplit("/torch/", 1)[1]
        return f"{module.removesuffix('.py').replace('/', '.')}.{m['func']}"

    names = [torch_name(m) for m in frames]
    inner = next((i for i, name in enumerate(names) if name), None)
    if inner is None:
        m = frames[0]
        return f"in {m['func']} ({m['path']}, line {m['line']})"
    entry = inner  # the torch function the caller called: outward while frames stay in torch
    while entry + 1 < len(names) and names[entry + 1]:
        entry += 1
    crashed = f"{names[inner]}, line {frames[inner]['line']}"
    if entry == inner:
        return f"inside torch: {crashed}"
    return f"inside torch: {names[entry]} (crashed in {crashed})"


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        return f"killed by {_signal_name(-returncode)} (exit status {returncode})"
    return f"exited with code {returncode}"
