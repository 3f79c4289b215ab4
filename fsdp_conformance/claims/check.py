"""The shape every conformance check has, so tests, the CLI and reports drive them alike.

A check is a pair: a *rank function* (module level, picklable) that builds a model, shards it,
inspects it and returns plain data; and a *verdict* that the parent computes from every rank's
data. The data path stays short: ``run_check`` = ``ranks.run(rank_fn, **params)`` then
``verdict(values, params)``.

Claim modules (:mod:`~fsdp_conformance.claims.wrap`, :mod:`~fsdp_conformance.claims.init`,
:mod:`~fsdp_conformance.claims.memory`) each define their checks and list them in ``CHECKS``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fsdp_conformance.harness import Ranks, resolve_outcomes

#: Outcomes a check can have in a report.
PASSED, FAILED, SKIPPED, ERROR = "passed", "failed", "skipped", "error"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A check's outcome, computed in the parent from what every rank reported."""

    passed: bool
    #: On failure: expected vs actual (trees for units), readable at a glance. On pass: a summary.
    message: str
    #: A few key figures for tables and compare (units, peak MB, bound MB, init digest, ...).
    figures: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: Everything worth storing in the JSON report (unit trees, timelines, ...): plain data.
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def raise_if_failed(self) -> Verdict:
        if not self.passed:
            raise AssertionError(self.message)
        return self


@dataclasses.dataclass(frozen=True)
class Check:
    """One conformance check."""

    #: Dotted, stable name used in reports and compare: ``<claim>.<what>[.<variant>]``.
    name: str
    #: The claim it belongs to: "wrap", "init" or "memory".
    claim: str
    #: One line saying what it proves.
    description: str
    #: ``rank_fn(ctx, **params) -> plain data`` run on every rank.
    rank_fn: Callable[..., Any]
    #: ``verdict(values_by_rank, params) -> Verdict`` run in the parent.
    verdict: Callable[[Sequence[Any], Mapping[str, Any]], Verdict]
    #: Default parameters (plain data; a ``spec`` (ModelSpec) and ``version`` usually).
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: Environment for fresh rank processes (e.g. allocator settings), or None for warm ranks.
    env: Mapping[str, str] | None = None
    #: Lanes it applies to.
    lanes: tuple[str, ...] = ("cpu", "gpu")


@dataclasses.dataclass(frozen=True)
class CheckRun:
    """A check's outcome with its timing and the warnings torch emitted on the ranks."""

    check: str
    outcome: str  # PASSED | FAILED | SKIPPED | ERROR
    verdict: Verdict | None
    detail: str
    seconds: float
    warnings: tuple[str, ...] = ()


def run_check(ranks: Ranks, check: Check, **overrides: Any) -> Verdict:
    """Run a check on ``ranks`` and return its verdict (raises on rank failures and skips)."""
    params = {**check.params, **overrides}
    runner = ranks.configured(env=dict(check.env)) if check.env else ranks
    values = runner.run(check.rank_fn, **params)
    return check.verdict(values, params)


def execute(ranks: Ranks, check: Check, **overrides: Any) -> CheckRun:
    """Run a check and never raise: every outcome (skip, rank failure) becomes a CheckRun."""
    from fsdp_conformance.harness import CheckSkipped, RankFailure
    from fsdp_conformance.harness.protocol import function_name

    params = {**check.params, **overrides}
    runner = ranks.configured(env=dict(check.env) if check.env else None, skip=None)
    start = time.perf_counter()
    try:
        outcomes = runner.run_outcomes(check.rank_fn, **params)
        caught = tuple(sorted({w for o in outcomes for w in o.warnings}))
        values = resolve_outcomes(function_name(check.rank_fn), outcomes)
        verdict = check.verdict(values, params)
    except CheckSkipped as exc:
        return CheckRun(check.name, SKIPPED, None, str(exc), time.perf_counter() - start)
    except RankFailure as exc:
        return CheckRun(check.name, ERROR, None, str(exc), time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - a verdict or harness error is an error outcome
        return CheckRun(check.name, ERROR, None, f"{type(exc).__name__}: {exc}",
                        time.perf_counter() - start)
    outcome = PASSED if verdict.passed else FAILED
    return CheckRun(check.name, outcome, verdict, verdict.message, time.perf_counter() - start,
                    caught)


def all_equal(values: Sequence[Any]) -> bool:
    return all(v == values[0] for v in values[1:])
