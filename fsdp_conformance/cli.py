"""``fsdp-conformance``: run the suite, compare two reports, plan at full scale.

    fsdp-conformance run [--lane cpu|gpu|all] [--model pkg.mod:factory --block-cls Block] ...
    fsdp-conformance compare OLD.json NEW.json [--memory-tolerance 0.05] [--fail-on-change]
    fsdp-conformance plan --preset 70b --world-size 1024 [--json]

Exit codes: 0 all good; 1 a check failed (run) or a regression was found (compare);
2 bad input (the message names the problem and the fix); 130 / 143 interrupted by SIGINT /
SIGTERM (rank processes killed and their folders removed first).
Under torchrun/srun, ``run`` runs on the launch's ranks: rank 0 prints and writes the report,
the others log to ``DIR/rank{N}.log``, and every rank exits with the worst rank's code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from fsdp_conformance.harness import interrupts, launched_externally
from fsdp_conformance.settings import (
    OPTIONS,
    Settings,
    SettingsError,
    pyproject_settings,
    resolve_settings,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_OUT = "fsdp-conformance-report"


class UsageError(Exception):
    """Bad input: printed as one line, exit code 2."""


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    for option in OPTIONS:
        parser.add_argument(
            "--" + option.name.replace("_", "-"),
            option.flag,
            dest=option.name,
            default=None,
            metavar=option.metavar,
            help=f"{option.help} [env {option.env}; pyproject [tool.fsdp_conformance] "
            f"{option.name}]",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-conformance",
        description="Distributed conformance suite for PyTorch FSDP (FSDP1 and FSDP2).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the conformance checks and write a report")
    _add_setting_flags(run)
    run.add_argument("--lane", choices=("cpu", "gpu", "all", "auto"), default="auto",
                     help="lanes to run: auto = cpu, plus gpu when CUDA is present")
    run.add_argument("--checks", metavar="SUBSTRING", default=None,
                     help="only checks whose name contains SUBSTRING (e.g. 'wrap.')")
    run.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                     help=f"folder for report.json, summary.md (and the plot) [{DEFAULT_OUT}]")
    run.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                     help="JSON report path [DIR/report.json]")
    run.add_argument("--markdown", default=None, metavar="PATH",
                     help="Markdown summary path [DIR/summary.md]; also appended to "
                     "$GITHUB_STEP_SUMMARY when set")
    run.add_argument("--plot", action=argparse.BooleanOptionalAction, default=None,
                     help="write memory_timeline.png next to summary.md, which links it: the "
                     "memory timelines of the run (the default when the run has one); "
                     "--no-plot: do not")
    run.add_argument("--list", action="store_true", help="list the checks and exit")

    compare = sub.add_parser("compare", help="compare two reports: the torch-upgrade gate")
    compare.add_argument("old", help="report of the current torch (baseline)")
    compare.add_argument("new", help="report of the candidate torch")
    compare.add_argument("--memory-tolerance", type=float, default=None, metavar="FRACTION",
                         help="relative change of a memory figure that counts (default 0.05)")
    compare.add_argument("--memory-floor-mib", type=float, default=None, metavar="MIB",
                         help="memory moves smaller than this many MiB are not reported, "
                         "whatever their relative size (default 1)")
    compare.add_argument("--fail-on-change", action="store_true",
                         help="exit 1 on any difference, not only on regressions")
    compare.add_argument("--json", action="store_true", help="print the differences as JSON")
    compare.add_argument("--force", action="store_true",
                         help="compare reports of different models (model, block class, size "
                         "threshold, input) or with no check in common anyway; without it such "
                         "reports are 'not comparable' (exit 2)")

    sub.add_parser("plan", add_help=False,
                   help="wrap plan and memory estimate at full scale, no devices "
                   "(`fsdp-conformance plan --help`)")
    return parser


def resolve_cli_settings(args: argparse.Namespace) -> Settings:
    cli = {o.name: getattr(args, o.name, None) for o in OPTIONS}
    return resolve_settings(cli, os.environ, {}, pyproject_settings(os.getcwd()))


def lanes_for(choice: str) -> list[str]:
    from fsdp_conformance.harness import cuda_device_count

    if choice == "all":
        return ["cpu", "gpu"]
    if choice == "auto":
        return ["cpu", "gpu"] if cuda_device_count() else ["cpu"]
    return [choice]


def cmd_run(args: argparse.Namespace) -> int:
    from fsdp_conformance import reports, suite

    settings = resolve_cli_settings(args)
    lanes = lanes_for(args.lane)
    spec = suite.user_spec(settings)
    if spec is not None:
        suite.validate_user_model(spec, lanes, settings.world_sizes)
    selected = suite.select_checks(suite.all_checks(), spec, args.checks)
    if not selected:
        # Before running anything: an empty report would pass any gate downstream.
        raise UsageError(f"no check matched --checks {args.checks!r}; see `fsdp-conformance run "
                         "--list` for the check names")
    if args.list:
        # What this command line would run: one line per check and variant (FSDP version, model).
        for check, params in selected:
            variant = suite.variant_of(params)
            label = f"{check.name}[{variant}]" if variant else check.name
            print(f"{label:<50} {check.claim:<7} {check.description}")
        return EXIT_OK
    json_path = args.json_path or os.path.join(args.out, "report.json")
    md_path = args.markdown or os.path.join(args.out, "summary.md")
    # Before any check runs: a folder we cannot write would lose the whole run at the end.
    for path, flag in ((json_path, "--json" if args.json_path else "--out"),
                       (md_path, "--markdown" if args.markdown else "--out")):
        _ensure_writable_folder(path, flag)
    if launched_externally():
        return _run_launched(args, settings, lanes, json_path, md_path)
    print(f"fsdp-conformance: {reports.environment_summary(settings)}", file=sys.stderr)
    report = suite.run_suite(settings, lanes, pattern=args.checks)
    return _write_outputs(args, report, json_path, md_path)


def _write_outputs(args: argparse.Namespace, report: dict[str, Any], json_path: str,
                   md_path: str, rank_logs: Sequence[str] = ()) -> int:
    from fsdp_conformance import reports

    reports.write_json_report(json_path, report)
    plot_path = None
    if args.plot is not False:  # the default: a picture wherever the run has a timeline
        # next to summary.md, which links it: the pair can be moved or uploaded together
        plot_path = write_plot(report, os.path.dirname(md_path), explicit=args.plot is True)
    plot_link = os.path.basename(plot_path) if plot_path else None
    markdown = reports.format_markdown(report, plot=plot_link)
    reports.write_atomic(md_path, markdown)
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        try:
            with open(os.environ["GITHUB_STEP_SUMMARY"], "a", encoding="utf-8") as f:
                # the job page cannot show a file of the runner: name it instead of linking it
                f.write(reports.format_markdown(report, plot_file=plot_path))
        except OSError as exc:  # the report is written already: say so, do not lose the run
            print(f"fsdp-conformance run: warning: could not append to $GITHUB_STEP_SUMMARY "
                  f"({exc}); the summary is in {md_path}", file=sys.stderr)
    print(reports.format_table(report))
    print(f"report: {json_path}\nsummary: {md_path}")
    if plot_path:
        print(f"plot: {plot_path}")
    if rank_logs:
        print(f"other ranks' logs: {', '.join(rank_logs)}")
    return _exit_code(report)


def _exit_code(report: dict[str, Any]) -> int:
    s = report["summary"]
    return EXIT_FAILED if s["failed"] or s["error"] else EXIT_OK


#: Set once a run joined an external launcher's process group (see ``main``).
_launched_run = False


def _run_launched(args: argparse.Namespace, settings: Settings, lanes: list[str],
                  json_path: str, md_path: str) -> int:
    """One rank of ``torchrun ... fsdp-conformance run``: rank 0 speaks, the others log.

    Every rank runs every check on the launch's process group and gets every rank's outcome,
    so every rank builds the same report; rank 0 prints it and writes the files, the others
    write progress and table to ``DIR/rank{N}.log``. The exit code is the worst of all ranks,
    so torchrun reports the same outcome whichever rank it looks at.
    """
    global _launched_run
    from fsdp_conformance import reports, suite
    from fsdp_conformance.harness import LauncherRunner, all_gather_objects

    world_size = int(os.environ["WORLD_SIZE"])
    settings = suite.launch_settings(settings, world_size)
    launcher = LauncherRunner(None if settings.backend == "auto" else settings.backend)
    _launched_run = True
    header = f"fsdp-conformance: {reports.environment_summary(settings)}"
    rank_logs = [suite.rank_log_path(args.out, r) for r in range(1, world_size)]
    with contextlib.ExitStack() as stack:
        log: TextIO | None = None
        if launcher.rank == 0:
            print(header, file=sys.stderr)
        else:
            log = stack.enter_context(open(suite.rank_log_path(args.out, launcher.rank), "w",
                                           encoding="utf-8"))
            log.write(header + "\n")
            log.flush()
        report = suite.run_suite(settings, lanes, pattern=args.checks, stream=log,
                                 launcher=launcher)
        if log is None:
            code = _write_outputs(args, report, json_path, md_path, rank_logs)
        else:
            log.write(reports.format_table(report) + "\n")
            log.write(f"rank 0 writes the report: {json_path}\n")
            code = _exit_code(report)
        codes = all_gather_objects(code, launcher.device_type)
        worst = max(codes)
        ending = (f"exit {worst} (the worst of every rank's: "
                  + ", ".join(f"rank {r} {c}" for r, c in enumerate(codes)) + ")")
        if log is not None:
            log.write(ending + "\n")
        elif any(c != code for c in codes):
            print(ending, file=sys.stderr)
    launcher.close()
    return worst


def _ensure_writable_folder(path: str, flag: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot write the report to {os.path.dirname(path) or '.'} "
                         f"({exc.strerror}); give {flag} a folder you can write") from None
    if not os.access(folder, os.W_OK):
        raise UsageError(f"cannot write the report to {os.path.dirname(path) or '.'} (not "
                         f"writable); give {flag} a folder you can write")


def write_plot(report: dict[str, Any], out_dir: str, *, explicit: bool = False) -> str | None:
    """Write ``out_dir/memory_timeline.png`` from the report's timelines; its path, or None.

    None when the report has no timeline (no memory timeline check ran), said on stderr only
    when ``--plot`` was asked for. A plot that cannot be drawn is a warning: the report is
    written already and the run's verdict does not depend on the picture.
    """
    path = os.path.join(out_dir, "memory_timeline.png")
    try:
        from fsdp_conformance import plots

        written = plots.plot_report_timelines(report, path)
    except ImportError as exc:
        print(f"fsdp-conformance run: warning: memory timeline not plotted ({exc}); install "
              "matplotlib (pip install matplotlib), or pass --no-plot", file=sys.stderr)
        return None
    except Exception as exc:  # noqa: BLE001  (a drawing failure must not lose the run)
        print(f"fsdp-conformance run: warning: memory timeline not plotted "
              f"({type(exc).__name__}: {exc}); the report and summary are complete",
              file=sys.stderr)
        return None
    if written is None and explicit:
        print("fsdp-conformance run: no memory timeline in this run (no memory.sawtooth check "
              "ran): no plot written", file=sys.stderr)
    return written


def cmd_compare(args: argparse.Namespace) -> int:
    from fsdp_conformance import reports

    old = reports.load_report(args.old)
    new = reports.load_report(args.new)
    differs = reports.comparability(old, new)
    if differs and not args.force:
        # Every check would be "missing" and "added": a wall of regressions that hides the cause.
        raise UsageError(f"{args.old!r} and {args.new!r} are not comparable: {differs}; compare "
                         "reports of the same model and checks (same --model, --block-cls, "
                         "--min-params, --input, world sizes and --checks), or pass --force to "
                         "compare them anyway")
    if differs:
        print(f"fsdp-conformance compare: warning: the reports are not comparable ({differs}); "
              "compared anyway (--force)", file=sys.stderr)
    tolerance = (
        args.memory_tolerance if args.memory_tolerance is not None
        else reports.DEFAULT_MEMORY_TOLERANCE
    )
    if not tolerance >= 0:  # also refuses nan
        raise UsageError(f"--memory-tolerance must be a fraction >= 0 (0.05 = 5%), got {tolerance}")
    floor_mib = (
        args.memory_floor_mib if args.memory_floor_mib is not None
        else reports.DEFAULT_MEMORY_FLOOR_BYTES / 2**20
    )
    if not floor_mib >= 0:
        raise UsageError(f"--memory-floor-mib must be >= 0 (in MiB), got {floor_mib}")
    diffs = reports.compare_reports(old, new, memory_tolerance=tolerance,
                                    memory_floor_bytes=floor_mib * 2**20)
    if args.json:
        print(json.dumps({
            "old": {"path": args.old, "torch": old["environment"]["torch"]},
            "new": {"path": args.new, "torch": new["environment"]["torch"]},
            "memory_tolerance": tolerance,
            "memory_floor_mib": floor_mib,
            "regressions": sum(d.regression for d in diffs),
            "differences": [d.to_dict() for d in diffs],
        }, indent=2))
    else:
        print(reports.format_differences(old, new, diffs))
    if any(d.regression for d in diffs) or (args.fail_on_change and diffs):
        return EXIT_FAILED
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    from fsdp_conformance.models import ModelSpecError
    from fsdp_conformance.policies import PolicyError
    from fsdp_conformance.reports import ReportError

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        # `plan` has its own parser (planning.main); argparse.REMAINDER refuses leading flags.
        from fsdp_conformance import planning

        return int(planning.main(argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"run": cmd_run, "compare": cmd_compare}
    # SIGTERM (timeout, Kubernetes, CI cancellation) ends the run like Ctrl-C: ranks killed,
    # folders removed, exit 128+N; a second signal during that cleanup is ignored.
    installed = interrupts.install()
    try:
        code = handlers[args.command](args)
    except (UsageError, SettingsError, ModelSpecError, PolicyError, ReportError) as exc:
        print(f"fsdp-conformance {args.command}: error: {exc}", file=sys.stderr)
        code = EXIT_USAGE
    except KeyboardInterrupt as exc:
        code = _interrupted(args.command, exc)
    finally:
        if _launched_run:
            # The outcome is decided: torchrun's SIGTERM to the ranks still running (once one
            # rank exited non-zero) must not turn this rank's exit code into -15.
            interrupts.ignore_from_now_on()
        elif installed is not None and not installed[0].received:
            interrupts.restore(installed[1])  # in-process callers (tests) get theirs back
    if _launched_run:
        # Skip interpreter teardown, as the pool's ranks do: gloo sometimes aborts a process
        # at exit (docs/harness.md), which torchrun would report as this rank's failure.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _interrupted(command: str, exc: KeyboardInterrupt) -> int:
    """Clean up after SIGINT/SIGTERM: every rank process killed, every rank folder removed."""
    from fsdp_conformance.harness import close_all_pools

    signum = exc.signum if isinstance(exc, interrupts.Interrupted) else signal.SIGINT
    close_all_pools()
    name = signal.Signals(signum).name
    if _launched_run:  # no pool here: this process is one of the launch's ranks
        done = f"rank {os.environ.get('RANK', '?')} of the launch stopped"
    else:
        done = "rank processes stopped and their folders removed"
    # A new line: the interrupt may have cut a progress line ("[3/51] check ... ") short.
    print(f"\nfsdp-conformance {command}: interrupted by {name}; {done}; no report written "
          f"(exit {128 + signum})", file=sys.stderr)
    interrupts.ignore_from_now_on()
    return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
