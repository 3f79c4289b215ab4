"""The conformance suite as a whole: which checks run where, with progress, into a report.

:func:`plan_suite` decides what a run runs (a :class:`SuitePlan`: the user's model, the selected
checks and their parameters, the lanes and world sizes), once per front end: ``fsdp-conformance
run`` (:func:`run_suite` runs it, also under torchrun), and the pytest plugin, which
parametrizes ``model_tests.py`` with it. Tests drive the same checks through the ``ranks``
fixture.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TextIO

from fsdp_conformance.claims import all_checks
from fsdp_conformance.claims.check import Check, CheckRun, execute
from fsdp_conformance.gate.migrate import legacy_name
from fsdp_conformance.gate.report import build_report, check_entry
from fsdp_conformance.harness import RankEngine, Ranks, SharedVerdicts, scaled_timeout
from fsdp_conformance.measure.step_cost import eager_step_seconds
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.user_model import user_spec
from fsdp_conformance.settings import FlagStyle, Settings, SettingsError


def variant_of(params: Mapping[str, Any]) -> str:
    """A short label for a check's parameters: FSDP version and model."""
    parts = []
    if "version" in params:
        parts.append(str(params["version"]))
    spec = params.get("spec")
    if isinstance(spec, ModelSpec):
        parts.append(spec.name)
    return ",".join(parts)


def select_checks(
    checks: Sequence[Check],
    spec: ModelSpec | None,
    pattern: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> list[tuple[Check, dict[str, Any]]]:
    """(check, params) pairs to run: reference params, or every model check on the user's spec.

    On the user's model only checks that take a ``spec`` run (each with the user's spec in
    place of the reference one); a check's own negative-control variants stay in the tests.
    ``pattern`` is a substring of the check's name or of the name its variant had before a
    rename (``init.weights.fsdp2`` still selects ``init.weights`` on FSDP2). ``options``: the
    run's values of opt-in parameters (``save_to``, ``load_from``); a check with
    :attr:`~fsdp_conformance.claims.check.Check.opt_in` parameters runs only when one is given,
    with them.
    """
    given = {k: v for k, v in (options or {}).items() if v is not None}
    chosen: list[tuple[Check, dict[str, Any]]] = []
    seen: set[tuple[str, str]] = set()
    for check in checks:
        if (
            pattern
            and pattern not in check.name
            and pattern not in (legacy_name(check.name, check.params.get("version")) or "")
        ):
            continue
        if check.opt_in and not given.keys() & set(check.opt_in):
            continue
        params = {**check.params, **{k: given[k] for k in check.opt_in if k in given}}
        if spec is not None:
            if "spec" not in params:
                continue
            params["spec"] = spec
            key = (check.name, variant_of(params))
            if key in seen:
                continue  # several reference variants collapse onto one user-model run
            seen.add(key)
        chosen.append((check, params))
    return chosen


def check_label(check: Check, params: Mapping[str, Any]) -> str:
    """A check and its variant as ``run --list`` and the plugin's test ids name them:
    ``wrap.units.exact[fsdp2,massive]``."""
    variant = variant_of(params)
    return f"{check.name}[{variant}]" if variant else check.name


#: One run of a check: (lane, world size, check, params).
PlannedRun = tuple[str, int, Check, dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class SuitePlan:
    """What a run runs, decided once per front end (:func:`plan_suite`) and handed down."""

    settings: Settings
    #: The user's model (``--model``), or None: the reference models.
    spec: ModelSpec | None
    #: (check, params) in report order (:func:`select_checks`).
    selected: tuple[tuple[Check, dict[str, Any]], ...]
    #: The lanes the run asks for, in report order.
    lanes: tuple[str, ...]
    #: What the preflight said of the user's model (a fix the suite applied, a block class it
    #: took from the model), one line each; the report keeps them (``notes``).
    notes: tuple[str, ...] = ()

    @property
    def world_sizes(self) -> tuple[int, ...]:
        return self.settings.world_sizes

    @property
    def runs(self) -> list[PlannedRun]:
        """(lane, world size, check, params) in run order: each selected check at every world
        size on every lane of the plan it runs on."""
        return [
            (lane, ws, check, params)
            for lane in self.lanes
            for ws in self.world_sizes
            for check, params in self.selected
            if lane in check.lanes
        ]

    def start_environments(self) -> list[dict[str, str]]:
        """The environments the cpu lane's ranks of this plan start with besides the default
        (a check's ``env``, the ``MALLOC_*`` of the memory checks), each once, in run order."""
        found = dict.fromkeys(
            tuple(sorted(check.env.items()))
            for lane, _, check, _ in self.runs
            if lane == "cpu" and check.env
        )
        return [dict(env) for env in found]

    def for_launch(self, launch_world_size: int) -> SuitePlan:
        """This plan on an external launch's ranks: its world size is the launch's
        (:func:`launch_settings`)."""
        return dataclasses.replace(self, settings=launch_settings(self.settings, launch_world_size))


def plan_suite(
    settings: Settings,
    lanes: Iterable[str],
    *,
    pattern: str | None = None,
    options: Mapping[str, Any] | None = None,
    checks: Sequence[Check] | None = None,
) -> SuitePlan:
    """The plan of a run: the user's model from ``settings`` (None on the reference models),
    the checks of ``checks`` (every claim's by default) that ``pattern`` and ``options`` select
    (:func:`select_checks`), on ``lanes`` at ``settings``' world sizes."""
    spec = user_spec(settings)
    selected = select_checks(
        list(checks) if checks is not None else all_checks(), spec, pattern, options
    )
    return SuitePlan(settings, spec, tuple(selected), tuple(lanes))


@dataclasses.dataclass
class Progress:
    """Prints one line per check as it finishes (to stderr by default)."""

    total: int
    #: None: ``sys.stderr`` as it is when a line is written (so capture and redirection apply).
    stream: TextIO | None = None
    done: int = 0
    #: Where the report will be written (an error's line says its traceback is there).
    report_path: str | None = None

    @property
    def out(self) -> TextIO:
        return self.stream if self.stream is not None else sys.stderr

    def start(self, label: str) -> None:
        width = len(str(self.total))
        self.out.write(f"[{self.done + 1:>{width}}/{self.total}] {label} ... ")
        self.out.flush()

    def finish(self, run: CheckRun) -> None:
        self.done += 1
        out = self.out
        out.write(f"{run.outcome} ({run.seconds:.2f}s)\n")
        if run.outcome == "failed":
            for line in run.detail.strip().splitlines()[:40]:
                out.write(f"      {line}\n")
        elif run.outcome in ("error", "skipped"):  # one line, whole
            out.write(f"      {' '.join(run.detail.split())}\n")
            if run.traceback:
                where = self.report_path or "the report"
                out.write(f"      (its traceback: {where}, this check's 'traceback')\n")
        out.flush()


@dataclasses.dataclass
class CheckTimeouts:
    """Each check's timeout in a run: the run's, or one derived from the check's work.

    An explicit timeout (``--timeout``, its variable or pyproject key) is the user's: every
    check gets it as given. Otherwise a check that declares a cost (``Check.cost``: its work in
    its model's eager steps) gets :func:`~fsdp_conformance.harness.timeouts.scaled_timeout`
    of it and of that model's eager step, measured once per model in this run
    (:func:`~fsdp_conformance.measure.step_cost.eager_step_seconds`), never below the run's
    timeout. ``measure``: the step's measure (a test's stand-in).
    """

    settings: Settings
    measure: Callable[[ModelSpec], float] = eager_step_seconds
    #: The measured step of each model (None: it could not be measured; the check says why).
    steps: dict[ModelSpec, float | None] = dataclasses.field(default_factory=dict)

    def for_check(self, check: Check, params: Mapping[str, Any]) -> tuple[float, str]:
        """The check's timeout and where it came from ("" for the run's own)."""
        default = self.settings.timeout
        spec = params.get("spec")
        explicit = self.settings.sources.get("timeout", "default") != "default"
        if explicit or check.cost <= 0 or not isinstance(spec, ModelSpec):
            return default, ""
        if spec not in self.steps:
            try:
                self.steps[spec] = self.measure(spec)
            except Exception:  # noqa: BLE001 - the check itself reports what the model did
                self.steps[spec] = None
        step = self.steps[spec]
        if step is None:
            return default, ""
        return scaled_timeout(default, check.cost, step)


def run_suite(
    plan: SuitePlan,
    engine: RankEngine,
    *,
    stream: TextIO | None = None,
    on_run: Callable[[dict[str, Any]], None] | None = None,
    flag_style: FlagStyle = "cli",
    report_path: str | None = None,
) -> dict[str, Any]:
    """Run the plan's checks on every lane and world size; return the report (plain data).

    Every check runs on ``engine``'s ranks (the caller's, which the caller closes): warm rank
    pools, or under torchrun/srun the launch's process group, where every rank's outcome is
    all-gathered, so every rank builds the same report. A lane this machine cannot run is
    reported skipped, with the reason (:meth:`Ranks.run_outcomes` decides it), its flags
    spelled as ``flag_style``'s front end does. ``report_path``: where the report will be
    written, named in the progress below an error.
    """
    settings = plan.settings
    runs = plan.runs
    progress = Progress(len(runs), stream, report_path=report_path)
    entries: list[dict[str, Any]] = []
    start = time.perf_counter()
    timeouts = CheckTimeouts(settings)
    # Under a launch every process builds the report: the leader judges, the others follow.
    shared = engine if isinstance(engine, SharedVerdicts) else None
    following = shared is not None and not shared.leads
    for index, (lane, ws, check, params) in enumerate(runs):
        variant = variant_of(params)
        # Each check carries the run's timeout, or one derived from its work: the engine fits
        # its ranks' timeouts to it (a pool's process group outlasts it).
        if shared is None or shared.leads:
            timeout, timeout_note = timeouts.for_check(check, params)
            if shared is not None:
                shared.share_entry(f"timeout/{index}", (timeout, timeout_note))
        else:
            led = shared.shared_entry(f"timeout/{index}", LEADER_WAIT_S)
            timeout, timeout_note = led if led is not None else (settings.timeout, "")
        progress.start(f"{check.name} [{lane}, ws{ws}{', ' + variant if variant else ''}]")
        ranks = Ranks(
            engine,
            ws,
            lane=lane,
            backend=settings.backend_for(lane),
            timeout=timeout,
            timeout_note=timeout_note,
            flag_style=flag_style,
        )
        if following:
            assert shared is not None
            entry = follow_check(ranks, check, params, shared, index, timeout)
            progress.finish(entry_run(entry))
        else:
            run = execute(ranks, check, **params)
            progress.finish(run)
            verdict = run.verdict
            entry = check_entry(
                check=check.name,
                claim=check.claim,
                lane=lane,
                world_size=ws,
                variant=variant,
                outcome=run.outcome,
                message=run.detail,
                figures=verdict.figures if verdict else {},
                data=verdict.data if verdict else {},
                seconds=run.seconds,
                warnings=run.warnings,
                expected=run.expected,
                traceback=run.traceback,
                timeout={"seconds": round(timeout, 1), "from": timeout_note.strip(" ()")}
                if timeout_note
                else None,
            )
            if shared is not None:
                shared.share_entry(f"check/{index}", entry)
        entries.append(entry)
        if on_run is not None:
            on_run(entry)
    return build_report(entries, settings, time.perf_counter() - start, notes=plan.notes)


#: Seconds a follower waits for the leader's timeout of a check (the leader measures a model's
#: eager step first) or, past the check's own timeout, for its entry.
LEADER_WAIT_S = 600.0


def follow_check(
    ranks: Ranks,
    check: Check,
    params: Mapping[str, Any],
    shared: SharedVerdicts,
    index: int,
    timeout: float,
) -> dict[str, Any]:
    """A follower's part of a check under a launch: its ranks run it (their outcomes reach the
    leader through the engine), and the leader's entry is this process's too. An entry that
    never comes (the leader lost) is this check's error."""
    started = time.perf_counter()
    runner = ranks.configured(env=dict(check.env)) if check.env else ranks
    try:
        runner.run_outcomes(check.rank_fn, **params)
    except Exception:  # noqa: BLE001 - a skip or a harness error: the leader's entry says it
        pass
    entry = shared.shared_entry(f"check/{index}", timeout + LEADER_WAIT_S)
    if entry is not None:
        return dict(entry)
    return check_entry(
        check=check.name,
        claim=check.claim,
        lane=ranks.lane,
        world_size=ranks.world_size,
        variant=variant_of(params),
        outcome="error",
        message="the launch's rank 0 shared no verdict for this check (its node lost?)",
        figures={},
        data={},
        seconds=time.perf_counter() - started,
        warnings=(),
    )


def entry_run(entry: Mapping[str, Any]) -> CheckRun:
    """The progress line's view of a report entry (a follower's, from the leader)."""
    return CheckRun(
        entry["check"],
        entry["outcome"],
        None,
        entry["message"],
        float(entry["seconds"]),
        traceback=entry.get("traceback", ""),
    )


def launch_settings(settings: Settings, launch_world_size: int) -> Settings:
    """The settings of a run under an external launcher: its world size is the launch's.

    The launcher started WORLD_SIZE processes, so that is the world size the checks can have;
    the default world sizes follow it. World sizes given explicitly must include it (the
    others are reported as skipped, with the reason).
    """
    source = settings.sources.get("world_sizes", "default")
    if source == "default":
        sources = {**settings.sources, "world_sizes": "the launcher's WORLD_SIZE"}
        return dataclasses.replace(settings, world_sizes=(launch_world_size,), sources=sources)
    if launch_world_size not in settings.world_sizes:
        sizes = ",".join(map(str, settings.world_sizes))
        raise SettingsError(
            f"world sizes {sizes} (from {source}) do not include this launch's WORLD_SIZE="
            f"{launch_world_size}; launch {settings.world_sizes[0]} ranks (torchrun "
            f"--nproc-per-node {settings.world_sizes[0]}) or drop the world-size setting"
        )
    return settings


def rank_log_path(out_dir: str, rank: int) -> str:
    """Where rank ``rank`` (not 0) of a launched run writes its progress and table."""
    return os.path.join(out_dir, f"rank{rank}.log")
