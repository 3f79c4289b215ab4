"""The shape every conformance check has, so tests, the CLI and reports drive them alike.

A check is a pair: a *rank function* (module level, picklable) that builds a model, shards it,
inspects it and returns plain data; and a *verdict* that the parent computes from every rank's
data. The data path stays short: every rank's outcome, then ``verdict(values, params)``
(:func:`execute` and :func:`run_check` share it).

One convention for every claim module (:mod:`~fsdp_conformance.claims.wrap`,
:mod:`~fsdp_conformance.claims.init`, :mod:`~fsdp_conformance.claims.memory`, ...):

* a check is named ``<claim>.<what>[.<detail>]``; its claim is the name's first part;
* its rank function is ``rank_<what>`` and its verdict ``verdict_<what>`` (one rank function may
  serve several checks);
* ``CHECKS`` is built only by concatenating :func:`variants` calls: the FSDP version and the
  model are parameters (hence the report's variant), never part of the name.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fsdp_conformance import expectations
from fsdp_conformance.expectations import Expectation
from fsdp_conformance.fsdp.torch_errors import failure_line, parse_traceback
from fsdp_conformance.harness import (
    CheckSkipped,
    RankFailure,
    Ranks,
    resolve_outcomes,
    traceback_text,
)
from fsdp_conformance.harness.protocol import function_name

if TYPE_CHECKING:
    from fsdp_conformance.models.model_spec import ModelSpec

#: Outcomes a check can have in a report; ``xfailed``: failed as an expectation of this torch
#: says it does (a known torch defect, :mod:`fsdp_conformance.expectations`).
PASSED, FAILED, SKIPPED, ERROR, XFAILED = "passed", "failed", "skipped", "error", "xfailed"


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

    #: Dotted, stable name used in reports and compare: ``<claim>.<what>[.<detail>]``, without
    #: the FSDP version or model (those are parameters, shown as the report's variant).
    name: str
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
    #: Parameters a run must give for this check to run at all (``run --save-checkpoint DIR``
    #: gives ``save_to``): a check with any is left out of a run that gives none of them.
    opt_in: tuple[str, ...] = ()
    #: What its work is worth in its model's eager training steps (``torch.compile`` traces
    #: every operator: hundreds), for a timeout that scales with the model
    #: (:func:`~fsdp_conformance.harness.timeouts.scaled_timeout`); 0: the run's timeout as is.
    cost: float = 0.0

    @property
    def claim(self) -> str:
        """The claim it belongs to ("wrap", "init", "memory"): the name's first part."""
        return self.name.split(".", 1)[0]


#: The FSDP versions a check runs on unless it says otherwise.
VERSIONS: tuple[str, ...] = ("fsdp1", "fsdp2")


def variants(
    name: str,
    description: str | Mapping[str, str],
    rank_fn: Callable[..., Any],
    verdict: Callable[[Sequence[Any], Mapping[str, Any]], Verdict],
    *,
    versions: Sequence[str] | None = VERSIONS,
    specs: Sequence[ModelSpec] = (),
    env: Mapping[str, str] | None = None,
    lanes: tuple[str, ...] = ("cpu", "gpu"),
    opt_in: tuple[str, ...] = (),
    cost: float = 0.0,
    **params: Any,
) -> tuple[Check, ...]:
    """One :class:`Check` named ``name`` per (version, spec), version-major.

    The version and spec go into ``params`` (hence into the report's variant), never into the
    name. ``versions=None``: a check without an FSDP version; ``specs=()``: no ``spec`` param
    (or one given in ``params``). ``description`` may be a ``{version: text}`` mapping when the
    versions do different things.
    """
    out = []
    for version in versions if versions is not None else (None,):
        text = description if isinstance(description, str) else description[version or ""]
        for spec in specs or (None,):
            variant: dict[str, Any] = {} if spec is None else {"spec": spec}
            if version is not None:
                variant["version"] = version
            out.append(
                Check(
                    name,
                    text,
                    rank_fn,
                    verdict,
                    {**variant, **params},
                    env=env,
                    lanes=lanes,
                    opt_in=opt_in,
                    cost=cost,
                )
            )
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class CheckRun:
    """A check's outcome with its timing and the warnings torch emitted on the ranks."""

    check: str
    outcome: str  # PASSED | FAILED | SKIPPED | ERROR
    verdict: Verdict | None
    detail: str
    seconds: float
    warnings: tuple[str, ...] = ()
    #: The expectation that covers this check on this torch (its fields), failed or not.
    expected: Mapping[str, str] | None = None
    #: An error's whole story (every rank's traceback); ``detail`` is then its one line.
    traceback: str = ""


def _judge(
    ranks: Ranks, check: Check, params: Mapping[str, Any]
) -> tuple[Verdict, tuple[str, ...]]:
    """The one outcome path: every rank's outcome, resolved, then the verdict (and warnings).

    Raises :class:`CheckSkipped` when every rank skipped and :class:`RankFailure` when any
    rank failed; the callers decide what those become.
    """
    __tracebackhide__ = True  # a failure points at the caller's line, then the ranks' story
    runner = ranks.configured(env=dict(check.env)) if check.env else ranks
    outcomes = runner.run_outcomes(check.rank_fn, **params)
    caught = tuple(sorted({w for o in outcomes for w in o.warnings}))
    values = resolve_outcomes(function_name(check.rank_fn), outcomes)
    return check.verdict(values, params), caught


def expectation_for(ranks: Ranks, check: Check, params: Mapping[str, Any]) -> Expectation | None:
    """The expectation covering ``check`` on this torch and lane, when it runs as the suite runs
    it: its own parameters, on any model. A negative control (a parameter changed) gets none."""
    import torch

    free = {"spec", *check.opt_in}  # the user's model, a run's folder: still the suite's run
    own = {k: v for k, v in check.params.items() if k not in free}
    if {k: v for k, v in params.items() if k not in free} != own:
        return None
    return expectations.find(check.name, params.get("version"), ranks.lane, torch.__version__)


def run_check(ranks: Ranks, check: Check, **overrides: Any) -> Verdict:
    """Run a check on ``ranks`` and return its verdict (raises on rank failures and skips).

    A skip on every rank goes to ``ranks.skip`` (``pytest.skip`` under the plugin) when set; a
    failure an expectation covers (:func:`expectation_for`) and whose content it matches goes
    to ``ranks.xfail`` (``pytest.xfail``) when set. A covered failure it does not match stays a
    failure, its message (the verdict's, or the rank failure's first line) saying so.
    """
    __tracebackhide__ = True
    params = {**check.params, **overrides}
    try:
        verdict = _judge(ranks, check, params)[0]
    except CheckSkipped as exc:
        if ranks.skip is None:
            raise
        ranks.skip(str(exc))
        raise  # a skip callable that returns: still a skip
    except RankFailure as exc:
        # one line first (the torch API, the ranks, the fix where known), then the ranks' story
        line = error_line(exc, params)
        expected, note = _matched(ranks, check, params, f"{line}\n{exc}", raised_names(exc))
        if expected is not None and not note:
            _xfail(ranks, expected, f"{line}\n{exc}")
        raise RankFailure(f"{line}{_inline(note)}\n{exc}", exc.outcomes) from None
    if not verdict.passed:
        expected, note = _matched(ranks, check, params, verdict.message, ())
        if expected is not None and not note:
            _xfail(ranks, expected, verdict.message)
        if note:
            verdict = dataclasses.replace(verdict, message=f"{verdict.message}\n{note}")
    return verdict


def _xfail(ranks: Ranks, expected: Expectation, message: str) -> None:
    if ranks.xfail is not None:
        ranks.xfail(f"expected failure: {expected.describe()}\n{message}")


def _matched(
    ranks: Ranks,
    check: Check,
    params: Mapping[str, Any],
    text: str,
    raised: Sequence[str],
) -> tuple[Expectation | None, str]:
    """The expectation covering a failed run, and "" when the failure is its defect, else the
    line saying the expectation did not match (:meth:`Expectation.mismatch`)."""
    expected = expectation_for(ranks, check, params)
    if expected is None:
        return None, ""
    why = expected.mismatch(text, raised)
    return expected, "" if why is None else expected.unmatched(why)


def _inline(note: str) -> str:
    """A note kept on an error's one line."""
    return f" ({note})" if note else ""


def raised_names(failure: RankFailure) -> tuple[str, ...]:
    """The names of the exceptions the ranks of ``failure`` raised (each error's last one, as
    its traceback prints it: ``RuntimeError``, ``torch.distributed.DistBackendError``)."""
    names = []
    for outcome in failure.outcomes:
        error = parse_traceback(outcome.detail) if outcome.status == "error" else None
        if error is not None:
            names.append(error.type)
    return tuple(names)


def execute(ranks: Ranks, check: Check, **overrides: Any) -> CheckRun:
    """Run a check and never raise: every outcome (skip, rank failure) becomes a CheckRun. A
    failure or error an expectation covers is ``xfailed`` when its content matches the
    expectation; one it does not match stays failed (or an error), its detail saying the
    expectation did not match. A pass it covers says the defect may be fixed."""
    start = time.perf_counter()
    params = {**check.params, **overrides}
    story = ""  # an error's whole story; its detail is one line
    raised: tuple[str, ...] = ()
    try:
        verdict: Verdict | None
        verdict, caught = _judge(ranks, check, params)
        outcome, detail = (PASSED if verdict.passed else FAILED), verdict.message
    except CheckSkipped as exc:
        return CheckRun(check.name, SKIPPED, None, str(exc), time.perf_counter() - start)
    except RankFailure as exc:
        verdict, caught, outcome, detail, story = None, (), ERROR, error_line(exc, params), str(exc)
        raised = raised_names(exc)
    except Exception as exc:  # noqa: BLE001 - a verdict or harness error is an error outcome
        verdict, caught, outcome, story = None, (), ERROR, traceback_text(exc)
        detail = f"{type(exc).__name__}: {exc}".splitlines()[0]
        raised = (type(exc).__name__,)
    expected = expectation_for(ranks, check, params)
    if expected is not None:
        if outcome != PASSED:
            why = expected.mismatch(f"{detail}\n{story}" if story else detail, raised)
            if why is None:
                outcome, detail = XFAILED, f"expected failure: {expected.describe()}\n{detail}"
            elif outcome == ERROR:
                detail += _inline(expected.unmatched(why))  # an error's detail stays one line
            else:
                detail += f"\n{expected.unmatched(why)}"
        elif params.get("spec") == check.params.get("spec"):
            # Only on the model the defect was measured on: a pass on a user's model (without
            # the defect's conditions, such as an empty shard) says nothing about torch.
            detail += (
                f"\n(an expectation says this fails on torch {expected.torch}, and it "
                "passed: the defect may be fixed; remove its entry from "
                "expectations.toml)"
            )
    return CheckRun(
        check.name,
        outcome,
        verdict,
        detail,
        time.perf_counter() - start,
        caught,
        expected.as_data() if expected is not None else None,
        story,
    )


def error_line(failure: RankFailure, params: Mapping[str, Any]) -> str:
    """A rank failure in one line: each error with the torch API that raised it, its ranks and,
    for a known torch error, the fix (:mod:`fsdp_conformance.fsdp.torch_errors`); the ranks that
    died or hung. Without outcomes (a failure raised by hand), its message's first line."""
    if failure.outcomes:
        try:
            return failure_line(failure.outcomes, params)
        except Exception as exc:  # noqa: BLE001 - the outcome stands; only its line is lost
            head = next((ln for ln in str(failure).splitlines() if ln.strip()), "ranks failed")
            return f"{head} (its one line could not be made: {type(exc).__name__}: {exc})"
    return next((ln for ln in str(failure).splitlines() if ln.strip()), "ranks failed")


def all_equal(values: Sequence[Any]) -> bool:
    return all(v == values[0] for v in values[1:])
