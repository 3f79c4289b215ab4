"""What a run leaves behind: ``report.json``, ``summary.md`` (and the job summary on CI), the
memory timeline plot beside it, the table on the console, and the exit code; and the launched
run (``torchrun ... fsdp-conformance run``), where rank 0 writes them and the others log.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from fsdp_conformance.gate.suite import SuitePlan
    from fsdp_conformance.harness import HarnessSession

#: The run's exit codes: every check passed (or was skipped or expected to fail); a check failed
#: or errored. (Bad input, 2, is the CLI's.)
EXIT_OK, EXIT_FAILED = 0, 1


def exit_code(report: Mapping[str, Any]) -> int:
    s = report["summary"]
    return EXIT_FAILED if s["failed"] or s["error"] else EXIT_OK


def write_outputs(
    report: dict[str, Any],
    json_path: str,
    md_path: str,
    *,
    plot: bool | None,
    rank_logs: Sequence[str] = (),
) -> int:
    """Write the report, the summary and (unless ``plot`` is False) the plot; print the table
    and where each file is; return the run's exit code. ``plot``: None draws a plot wherever the
    run has a timeline, True also says why when it has none."""
    from fsdp_conformance._files import write_atomic
    from fsdp_conformance.gate.report import write_json_report
    from fsdp_conformance.gate.tables import format_markdown, format_table

    write_json_report(json_path, report)
    plot_path = None
    if plot is not False:  # the default: a picture wherever the run has a timeline
        # next to summary.md, which links it: the pair can be moved or uploaded together
        plot_path = write_plot(report, os.path.dirname(md_path), explicit=plot is True)
    plot_link = os.path.basename(plot_path) if plot_path else None
    markdown = format_markdown(report, plot=plot_link, report_path=json_path)
    write_atomic(md_path, markdown)
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        try:
            with open(os.environ["GITHUB_STEP_SUMMARY"], "a", encoding="utf-8") as f:
                # the job page cannot show a file of the runner: name it instead of linking it
                f.write(format_markdown(report, plot_file=plot_path, report_path=json_path))
        except OSError as exc:  # the report is written already: say so, do not lose the run
            print(
                f"fsdp-conformance run: warning: could not append to $GITHUB_STEP_SUMMARY "
                f"({exc}); the summary is in {md_path}",
                file=sys.stderr,
            )
    print(format_table(report, json_path))
    print(f"report: {json_path}\nsummary: {md_path}")
    if plot_path:
        print(f"plot: {plot_path}")
    if rank_logs:
        print(f"other ranks' logs: {', '.join(rank_logs)}")
    return exit_code(report)


def write_plot(report: dict[str, Any], out_dir: str, *, explicit: bool = False) -> str | None:
    """Write ``out_dir/memory_timeline.png`` from the report's timelines; its path, or None.

    None when the report has no timeline (no memory timeline check ran), said on stderr only
    when ``--plot`` was asked for. A plot that cannot be drawn is a warning: the report is
    written already and the run's verdict does not depend on the picture.
    """
    path = os.path.join(out_dir, "memory_timeline.png")
    try:
        from fsdp_conformance.gate import plots

        written = plots.plot_report_timelines(report, path)
    except ImportError as exc:
        print(
            f"fsdp-conformance run: warning: memory timeline not plotted ({exc}); install "
            "matplotlib (pip install matplotlib), or pass --no-plot",
            file=sys.stderr,
        )
        return None
    except Exception as exc:  # noqa: BLE001  (a drawing failure must not lose the run)
        print(
            f"fsdp-conformance run: warning: memory timeline not plotted "
            f"({type(exc).__name__}: {exc}); the report and summary are complete",
            file=sys.stderr,
        )
        return None
    if written is None and explicit:
        print(
            "fsdp-conformance run: no memory timeline in this run (no memory.sawtooth check "
            "ran): no plot written",
            file=sys.stderr,
        )
    return written


def run_launched(
    plan: SuitePlan,
    harness: HarnessSession,
    *,
    out: str,
    json_path: str,
    md_path: str,
    plot: bool | None,
) -> int:
    """One launched process of ``torchrun ... fsdp-conformance run``: rank 0 speaks, the others
    log.

    Every launched process supervises its rank's child (:class:`~fsdp_conformance.harness.
    supervisor.LaunchSupervisor`) and gets every rank's outcome of every check through the
    launch's store, so every rank builds the same report; rank 0 prints it and writes the files,
    the others write progress and table to ``DIR/rank{N}.log`` (each node only its own ranks'
    logs, on a shared ``--out`` too). Every node's console names the host and path of the
    report (rank 0 publishes them through the store). The exit code is the worst of all ranks,
    so torchrun reports the same outcome whichever rank it looks at. ``plan``: the command
    line's, run at the launch's world size (:meth:`~.suite.SuitePlan.for_launch`).
    """
    from fsdp_conformance.gate import suite
    from fsdp_conformance.gate.report import environment_summary
    from fsdp_conformance.gate.tables import format_table

    launcher = harness.launch(plan.settings.backend)
    if launcher is None:
        raise RuntimeError("run_launched outside a launch (no torchrun/srun environment)")
    world_size, rank = launcher.world_size, launcher.rank
    plan = plan.for_launch(world_size)
    settings = plan.settings
    # The ranks' children of the memory checks start with their allocator settings: their fork
    # servers import torch now, while the first checks run.
    for env in plan.start_environments():
        launcher.prestart_fork_server(env)
    header = f"fsdp-conformance: {environment_summary(settings)}"
    with contextlib.ExitStack() as stack:
        log: TextIO | None = None
        if rank == 0:
            print(header, file=sys.stderr)
        else:
            log = stack.enter_context(open(suite.rank_log_path(out, rank), "w", encoding="utf-8"))
            log.write(header + "\n")
            log.flush()
        report = suite.run_suite(plan, launcher, stream=log, report_path=json_path)
        if log is None:
            hosts = launcher.hosts()
            rank_logs = [
                suite.rank_log_path(out, r)
                + ("" if hosts[r] == launcher.host else f" (on {hosts[r]})")
                for r in range(1, world_size)
            ]
            code = write_outputs(report, json_path, md_path, plot=plot, rank_logs=rank_logs)
            written = f"{launcher.host}:{os.path.abspath(json_path)}"
            launcher.share("report", written)
            print(f"fsdp-conformance run: the report is on {written}", file=sys.stderr)
        else:
            log.write(format_table(report, json_path) + "\n")
            code = exit_code(report)
            where = launcher.shared("report")
            told = f"rank {rank} on {launcher.host}: " + (
                f"the report is on {where}"
                if where is not None
                else "rank 0 published no report (its node lost?); this rank's table is in "
                + suite.rank_log_path(out, rank)
            )
            log.write(told + "\n")
            log.flush()
            print(f"fsdp-conformance run: {told}", file=sys.stderr)
        codes = harness.launch_exit_codes(code)
        worst: int = max(codes.values())
        ending = (
            f"exit {worst} (the worst of every rank's: "
            + ", ".join(f"rank {r} {c}" for r, c in sorted(codes.items()))
            + (
                f"; lost: {', '.join(f'rank {r}' for r in sorted(launcher.lost))}"
                if launcher.lost
                else ""
            )
            + ")"
        )
        if log is not None:
            log.write(ending + "\n")
        elif any(c != code for c in codes.values()) or launcher.lost:
            print(ending, file=sys.stderr)
    harness.finish()
    return worst
