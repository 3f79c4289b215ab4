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
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from fsdp_conformance.harness import HarnessSession, launched_externally
from fsdp_conformance.settings import (
    OPTIONS,
    Settings,
    SettingsError,
    pyproject_settings,
    resolve_settings,
)
from fsdp_conformance.sizes import MiB

if TYPE_CHECKING:
    from fsdp_conformance.plan.model import PlanSettings

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_OUT = "fsdp-conformance-report"


class UsageError(Exception):
    """Bad input: printed as one line, exit code 2."""


class _DeferredUsageError(Exception):
    """A usage error of a subcommand parser with ``defer_errors`` (see :class:`_Parser`)."""


class _Parser(argparse.ArgumentParser):
    """A subcommand's parser; as plain argparse unless given ``add_arguments``/``defer_errors``.

    ``add_arguments(parser)`` runs on the first parse, not when the parser is built: ``plan``'s
    flags name the presets, reference models and optimizers, whose modules import torch, and
    ``run``, ``compare`` and ``--help`` must not pay for that (about 3 s on the build machine).
    ``defer_errors``: a usage error (a bad or unknown flag) does not exit from inside argparse;
    it is returned as ``args.usage_error`` for the command to raise as a :class:`UsageError`,
    so it reaches :func:`main`'s one handler (one line, exit 2) like every other bad input.
    """

    def __init__(self, *args: Any,
                 add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
                 defer_errors: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._add_arguments = add_arguments
        self._defer_errors = defer_errors

    def error(self, message: str) -> NoReturn:
        if not self._defer_errors:
            super().error(message)
        raise _DeferredUsageError(f"{message}; see `{self.prog} --help`")

    # ignore: typeshed overloads this on the namespace's type; only Namespace is used here
    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None,
    ) -> tuple[argparse.Namespace, list[str]]:
        if self._add_arguments is not None:
            add, self._add_arguments = self._add_arguments, None
            add(self)
        if not self._defer_errors:
            return super().parse_known_args(args, namespace)
        try:
            parsed, extras = super().parse_known_args(args, namespace)
            if extras:  # as argparse words it; here, not in the top-level parser
                self.error(f"unrecognized arguments: {' '.join(extras)}")
        except _DeferredUsageError as exc:
            return argparse.Namespace(usage_error=str(exc)), []
        parsed.usage_error = None
        return parsed, []


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
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run the conformance checks and write a report")
    _add_setting_flags(run)
    run.add_argument("--lane", choices=("cpu", "gpu", "all", "auto"), default="auto",
                     help="lanes to run: auto = cpu, plus gpu when CUDA is present")
    run.add_argument("--checks", metavar="SUBSTRING", default=None,
                     help="only checks whose name contains SUBSTRING (e.g. 'wrap.'); a "
                          "renamed check's old name matches too")
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
    run.add_argument("--save-checkpoint", metavar="DIR", default=None,
                     help="also run state.checkpoint: save each variant's model with "
                     "torch.distributed.checkpoint into DIR (a folder per variant, with the "
                     "values saved and this torch's version), for --load-checkpoint on another "
                     "torch (ci/upgrade-gate.sh)")
    run.add_argument("--load-checkpoint", metavar="DIR", default=None,
                     help="also run state.checkpoint: load the checkpoints a run with "
                     "--save-checkpoint DIR wrote (on another torch) into FSDP1, FSDP2 and one "
                     "process, and compare every value with the saved ones, bitwise")
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

    matrix = sub.add_parser(
        "matrix", help="checks x torch versions from one report per version (ci/torch-matrix.sh)")
    matrix.add_argument("reports", nargs="+", metavar="REPORT",
                        help="reports of `fsdp-conformance run`, one per torch version, in the "
                        "order of the columns")
    matrix.add_argument("--out", default=None, metavar="DIR",
                        help="write DIR/matrix.md and DIR/matrix.svg (the Markdown is printed "
                        "either way)")
    matrix.add_argument("--differing", action="store_true",
                        help="print only the checks that do not pass on every version, and how "
                        "many do (the files keep every check)")

    sub.add_parser("plan", add_arguments=_add_plan_flags, defer_errors=True,
                   help="wrap plan and memory estimate at full scale, no devices "
                   "(`fsdp-conformance plan --help`)",
                   description="Wrap plan and per-rank memory estimate of one training step at "
                   "full scale, in one process: the model is built on meta, nothing is allocated.")
    return parser


def _add_plan_flags(p: argparse.ArgumentParser) -> None:
    from fsdp_conformance.plan.estimate import (
        CLAIM_WORLD_SIZES,
        DEFAULT_DEVICE_MEMORY,
        DEFAULT_RESERVE,
        MAX_WORLD_SIZE,
    )
    from fsdp_conformance.plan.model import ATTENTION, DTYPE_BYTES, OPTIMIZERS, POLICIES, PRESETS
    from fsdp_conformance.reference_models import REFERENCE_MODELS
    from fsdp_conformance.sizes import format_bytes

    model = p.add_argument_group("model (exactly one)")
    model.add_argument("--preset", metavar="NAME",
                       help=f"a full-scale shape: {', '.join(PRESETS)} (seeds = the seeds' "
                       "MassiveModel, dim 4096, 8 layers)")
    model.add_argument("--reference", metavar="NAME",
                       help=f"a reference model at CPU size: {', '.join(REFERENCE_MODELS)}")
    model.add_argument("--model", dest="factory", metavar="PKG.MOD:FACTORY",
                       help="your model factory (called with no arguments under meta)")
    model.add_argument("--block-cls", metavar="CLASS[,CLASS]", help="your model's block class(es)")
    model.add_argument("--min-params", type=int, metavar="N",
                       help="size-rule threshold (default: 2e7 scaled with dim^2; the seeds' "
                       "policy on a preset keeps the literal 2e7)")
    model.add_argument("--input", dest="input_builder", metavar="PKG.MOD:BUILDER",
                       help="input builder(model, batch_size, device) for your model")
    model.add_argument("--layers", type=int, help="--reference only: number of blocks")
    model.add_argument("--dim", type=int, help="--reference only: width")
    step = p.add_argument_group("training step")
    step.add_argument("--policy", choices=POLICIES, default="recommended",
                      help="recommended (one unit per block), seeds (get_hybrid_policy), "
                      "monolithic (root only) [recommended]")
    step.add_argument("--fsdp-version", dest="version", choices=("fsdp1", "fsdp2"),
                      default="fsdp2", help="[fsdp2]")
    step.add_argument("--param-dtype", choices=tuple(DTYPE_BYTES), default="fp32",
                      help="sharded params, grads and optimizer state [fp32]")
    step.add_argument("--compute-dtype", choices=tuple(DTYPE_BYTES), default="bf16",
                      help="gathered params, unsharded grads, collectives, activations [bf16]")
    step.add_argument("--dtype", choices=tuple(DTYPE_BYTES),
                      help="both of the above (no mixed precision)")
    step.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="[adamw]")
    step.add_argument("--batch-size", type=int, default=1, help="per-rank micro-batch [1]")
    step.add_argument("--seq-len", type=int, default=4096, help="tokens per sample [4096]")
    step.add_argument("--activation-checkpointing", dest="checkpointing", default="none",
                      metavar="none|full|every-K",
                      help="checkpoint every block (full) or blocks 0, K, 2K, ... (every-K), as "
                      "torch's checkpoint_wrapper does; the plan also shows each choice side by "
                      "side [none]")
    step.add_argument("--shard-group-size", type=int, default=None, metavar="N",
                      help="HSDP: shard each unit over groups of N ranks, replicated across "
                      "groups (FSDP2 2-D mesh, FSDP1 HYBRID_SHARD); --world-size must be a "
                      "multiple of N [full sharding]")
    step.add_argument("--cpu-offload", action="store_true",
                      help="sharded params, grads and optimizer state in host memory (FSDP1 "
                      "CPUOffload(offload_params=True), FSDP2 CPUOffloadPolicy): the estimate is "
                      "the device's, the host's per rank is printed beside it")
    step.add_argument("--attention", choices=ATTENTION, default="flash",
                      help="flash: fused kernel's saved set; math: also seq x seq weights "
                      "[flash]")
    scale = p.add_argument_group("scale")
    scale.add_argument("--world-size", type=int, default=8, help="ranks to plan for [8]")
    scale.add_argument("--device-memory", default=DEFAULT_DEVICE_MEMORY, metavar="SIZES",
                       help=f"device sizes for 'devices needed' (GB = 10^9 B, GiB = 2^30 B) "
                       f"[{DEFAULT_DEVICE_MEMORY}]")
    scale.add_argument("--device-reserve", default=None, metavar="SIZE",
                       help="device memory kept free per rank outside the estimate (CUDA "
                       "context, NCCL, cuBLAS workspaces; docs/planning.md) [stated "
                       f"allowance, {format_bytes(DEFAULT_RESERVE.total, 'decimal')}]")
    scale.add_argument("--max-world-size", type=int, default=MAX_WORLD_SIZE,
                       help=f"largest world size searched [{MAX_WORLD_SIZE}]")
    scale.add_argument("--no-verify", dest="verify", action="store_false",
                       help="skip the FSDP2 cross-check on the fake process group")
    out = p.add_argument_group("output")
    out.add_argument("--compare-policies", action="store_true",
                     help="the seeds' claim: fp16 weights, and the estimate of every policy at "
                     "--world-sizes")
    out.add_argument("--world-sizes", default=",".join(map(str, CLAIM_WORLD_SIZES)),
                     help="world sizes of --compare-policies [8,64,512,1024]")
    out.add_argument("--full-tree", action="store_true",
                     help="one line per unit (default: identical siblings collapsed)")
    out.add_argument("--json", action="store_true", help="print JSON instead of tables")


def resolve_cli_settings(args: argparse.Namespace) -> Settings:
    cli = {o.name: getattr(args, o.name, None) for o in OPTIONS}
    return resolve_settings(cli, os.environ, {}, pyproject_settings(os.getcwd()),
                            flag_style="cli")


def lanes_for(choice: str) -> list[str]:
    from fsdp_conformance.harness import cuda_device_count

    if choice == "all":
        return ["cpu", "gpu"]
    if choice == "auto":
        return ["cpu", "gpu"] if cuda_device_count() else ["cpu"]
    return [choice]


def cmd_run(args: argparse.Namespace, harness: HarnessSession) -> int:
    settings = resolve_cli_settings(args)
    harness.check_timeout = settings.timeout  # the pools' and the launch's process groups
    if args.lane != "gpu" and not args.list:
        # Before anything imports torch (the lanes' CUDA count included) or the model: the CPU
        # ranks' fork server imports the same on the other core meanwhile, not after them.
        harness.prestart_fork_server()
    lanes = lanes_for(args.lane)

    from fsdp_conformance import user_model
    from fsdp_conformance.claims import all_checks
    from fsdp_conformance.gate import suite
    from fsdp_conformance.gate.report import environment_summary

    spec = user_model.user_spec(settings)
    if spec is not None:
        user_model.validate_user_model(spec, lanes, settings.world_sizes)
    options = checkpoint_options(args)
    selected = suite.select_checks(all_checks(), spec, args.checks, options)
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
        return _run_launched(args, settings, lanes, json_path, md_path, harness)
    print(f"fsdp-conformance: {environment_summary(settings)}", file=sys.stderr)
    report = suite.run_suite(settings, lanes, pattern=args.checks, options=options,
                             pools=harness.pools)
    return _write_outputs(args, report, json_path, md_path)


def checkpoint_options(args: argparse.Namespace) -> dict[str, str | None]:
    """``state.checkpoint``'s opt-in parameters from ``--save-checkpoint`` and
    ``--load-checkpoint``, as absolute paths (ranks may run in another folder); a folder that
    cannot be written or read is a usage error now, not a failed check later."""
    save_to = load_from = None
    if args.save_checkpoint is not None:
        save_to = os.path.abspath(args.save_checkpoint)
        _writable_folder(save_to, f"--save-checkpoint {args.save_checkpoint}: cannot write to it",
                         "give a folder you can write")
    if args.load_checkpoint is not None:
        load_from = os.path.abspath(args.load_checkpoint)
        if not os.path.isdir(load_from):
            raise UsageError(f"--load-checkpoint {args.load_checkpoint}: no such folder; give "
                             "the folder a run with --save-checkpoint wrote")
        if save_to is not None and os.path.samefile(save_to, load_from):
            raise UsageError("--save-checkpoint and --load-checkpoint name the same folder: "
                             "the save would replace what the load reads; give two folders")
    return {"save_to": save_to, "load_from": load_from}


def _write_outputs(args: argparse.Namespace, report: dict[str, Any], json_path: str,
                   md_path: str, rank_logs: Sequence[str] = ()) -> int:
    from fsdp_conformance._files import write_atomic
    from fsdp_conformance.gate.report import format_markdown, format_table, write_json_report

    write_json_report(json_path, report)
    plot_path = None
    if args.plot is not False:  # the default: a picture wherever the run has a timeline
        # next to summary.md, which links it: the pair can be moved or uploaded together
        plot_path = write_plot(report, os.path.dirname(md_path), explicit=args.plot is True)
    plot_link = os.path.basename(plot_path) if plot_path else None
    markdown = format_markdown(report, plot=plot_link)
    write_atomic(md_path, markdown)
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        try:
            with open(os.environ["GITHUB_STEP_SUMMARY"], "a", encoding="utf-8") as f:
                # the job page cannot show a file of the runner: name it instead of linking it
                f.write(format_markdown(report, plot_file=plot_path))
        except OSError as exc:  # the report is written already: say so, do not lose the run
            print(f"fsdp-conformance run: warning: could not append to $GITHUB_STEP_SUMMARY "
                  f"({exc}); the summary is in {md_path}", file=sys.stderr)
    print(format_table(report))
    print(f"report: {json_path}\nsummary: {md_path}")
    if plot_path:
        print(f"plot: {plot_path}")
    if rank_logs:
        print(f"other ranks' logs: {', '.join(rank_logs)}")
    return _exit_code(report)


def _exit_code(report: dict[str, Any]) -> int:
    s = report["summary"]
    return EXIT_FAILED if s["failed"] or s["error"] else EXIT_OK


def _run_launched(args: argparse.Namespace, settings: Settings, lanes: list[str],
                  json_path: str, md_path: str, harness: HarnessSession) -> int:
    """One rank of ``torchrun ... fsdp-conformance run``: rank 0 speaks, the others log.

    Every rank runs every check on the launch's process group and gets every rank's outcome,
    so every rank builds the same report; rank 0 prints it and writes the files, the others
    write progress and table to ``DIR/rank{N}.log``. The exit code is the worst of all ranks,
    so torchrun reports the same outcome whichever rank it looks at.
    """
    from fsdp_conformance.gate import suite
    from fsdp_conformance.gate.report import environment_summary, format_table

    world_size = int(os.environ["WORLD_SIZE"])
    settings = suite.launch_settings(settings, world_size)
    launcher = harness.launch(settings.backend)
    assert launcher is not None  # launched_externally() chose this path
    header = f"fsdp-conformance: {environment_summary(settings)}"
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
                                 launcher=launcher, options=checkpoint_options(args))
        if log is None:
            code = _write_outputs(args, report, json_path, md_path, rank_logs)
        else:
            log.write(format_table(report) + "\n")
            log.write(f"rank 0 writes the report: {json_path}\n")
            code = _exit_code(report)
        codes = harness.launch_exit_codes(code)
        worst: int = max(codes)
        ending = (f"exit {worst} (the worst of every rank's: "
                  + ", ".join(f"rank {r} {c}" for r, c in enumerate(codes)) + ")")
        if log is not None:
            log.write(ending + "\n")
        elif any(c != code for c in codes):
            print(ending, file=sys.stderr)
    harness.finish()
    return worst


def _ensure_writable_folder(path: str, flag: str) -> None:
    _writable_folder(os.path.dirname(os.path.abspath(path)),
                     f"cannot write the report to {os.path.dirname(path) or '.'}",
                     f"give {flag} a folder you can write")


def _writable_folder(folder: str, problem: str, fix: str) -> None:
    """Make ``folder`` if missing; a usage error (``problem (why); fix``) when it cannot be made
    or written."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{problem} ({exc.strerror}); {fix}") from None
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{problem} (not writable); {fix}")


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
    from fsdp_conformance.gate import compare
    from fsdp_conformance.gate.report import load_report

    old = load_report(args.old)
    new = load_report(args.new)
    differs = compare.comparability(old, new)
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
        else compare.DEFAULT_MEMORY_TOLERANCE
    )
    if not tolerance >= 0:  # also refuses nan
        raise UsageError(f"--memory-tolerance must be a fraction >= 0 (0.05 = 5%), got {tolerance}")
    floor_mib = (
        args.memory_floor_mib if args.memory_floor_mib is not None
        else compare.DEFAULT_MEMORY_FLOOR_BYTES / MiB
    )
    if not floor_mib >= 0:
        raise UsageError(f"--memory-floor-mib must be >= 0 (in MiB), got {floor_mib}")
    diffs = compare.compare_reports(old, new, memory_tolerance=tolerance,
                                    memory_floor_bytes=floor_mib * MiB)
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
        print(compare.format_differences(old, new, diffs))
    if any(d.regression for d in diffs) or (args.fail_on_change and diffs):
        return EXIT_FAILED
    return EXIT_OK


def cmd_matrix(args: argparse.Namespace) -> int:
    from fsdp_conformance.gate import compare, matrix
    from fsdp_conformance.gate.report import load_report

    reports = [(path, load_report(path)) for path in args.reports]
    for path, report in reports[1:]:
        differs = compare.comparability(reports[0][1], report)
        if differs:  # a row per check of each model: shown, but not one model across versions
            print(f"fsdp-conformance matrix: warning: {path!r} is not comparable with "
                  f"{reports[0][0]!r} ({differs}); its checks get rows of their own",
                  file=sys.stderr)
    table = matrix.build_matrix(reports)
    text = matrix.to_markdown(table)
    print(matrix.to_markdown(table, differing=True) if args.differing else text, end="")
    if args.out is not None:
        os.makedirs(args.out, exist_ok=True)
        for name, content in (("matrix.md", text), ("matrix.svg", matrix.to_svg(table))):
            with open(os.path.join(args.out, name), "w", encoding="utf-8") as f:
                f.write(content)
        print(f"matrix: {os.path.join(args.out, 'matrix.md')}, "
              f"{os.path.join(args.out, 'matrix.svg')}", file=sys.stderr)
    return EXIT_OK


def _plan_settings(args: argparse.Namespace) -> PlanSettings:
    from fsdp_conformance.plan.model import PlanSettings

    param, compute = args.param_dtype, args.compute_dtype
    if args.dtype is not None:
        param = compute = args.dtype
    return PlanSettings(policy=args.policy, version=args.version, param_dtype=param,
                        compute_dtype=compute, optimizer=args.optimizer,
                        batch_size=args.batch_size, seq_len=args.seq_len,
                        attention=args.attention, checkpointing=args.checkpointing,
                        shard_group_size=args.shard_group_size,
                        cpu_offload=args.cpu_offload)


def cmd_plan(args: argparse.Namespace) -> int:
    from fsdp_conformance.plan import plan_command
    from fsdp_conformance.plan.estimate import DEFAULT_RESERVE, DeviceReserve
    from fsdp_conformance.plan.model import (
        PlanError,
        choose_model,
        parse_bytes,
        parse_world_sizes,
    )

    if args.usage_error:
        raise UsageError(args.usage_error)
    try:
        choice = choose_model(preset=args.preset, reference=args.reference,
                              factory=args.factory, block_cls=args.block_cls,
                              min_params=args.min_params, layers=args.layers, dim=args.dim,
                              input_builder=args.input_builder)
        settings = _plan_settings(args)
        devices = [parse_bytes(x) for x in args.device_memory.split(",") if x.strip()]
        if not devices:
            raise UsageError("--device-memory is empty; write e.g. 80GB,141GB")
        if args.max_world_size < 1:
            raise UsageError(f"--max-world-size must be >= 1, got {args.max_world_size}")
        world_sizes = parse_world_sizes(args.world_sizes) if args.compare_policies else ()
        if not args.compare_policies and args.world_size < 1:
            raise UsageError(f"--world-size must be >= 1, got {args.world_size}")
        reserve = (DEFAULT_RESERVE if args.device_reserve is None
                   else DeviceReserve.of_total(
                       parse_bytes(args.device_reserve, "--device-reserve", allow_zero=True)))
        text, data = plan_command(choice, settings, args.world_size, devices,
                                  verify=args.verify, compare=args.compare_policies,
                                  world_sizes=world_sizes, max_world_size=args.max_world_size,
                                  full_tree=args.full_tree, reserve=reserve)
    except PlanError as exc:  # the planner's bad input: the same one line as the CLI's own
        raise UsageError(str(exc)) from None
    print(json.dumps(data, indent=2, default=str) if args.json else text)
    return EXIT_OK


def _usage_errors() -> tuple[type[Exception], ...]:
    """The exceptions :func:`main` prints as one line with exit 2.

    ``models`` and ``policies`` import torch (about 2 s): their errors are named only once a
    command has loaded them (none can be raised before), so that ``--help``, a bad flag and
    ``compare`` stay as light as the parser. Called in the ``except`` clause, i.e. only when
    an exception reaches it.
    """
    from fsdp_conformance.gate.report import ReportError

    errors: list[type[Exception]] = [UsageError, SettingsError, ReportError]
    for module, name in (("fsdp_conformance.models", "ModelSpecError"),
                         ("fsdp_conformance.policies", "PolicyError")):
        loaded = sys.modules.get(module)
        if loaded is not None:
            errors.append(getattr(loaded, name))
    return tuple(errors)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"compare": cmd_compare, "matrix": cmd_matrix, "plan": cmd_plan}
    # SIGTERM (timeout, Kubernetes, CI cancellation) ends the run like Ctrl-C: ranks killed,
    # folders removed, exit 128+N; a second signal during that cleanup is ignored. The run's
    # fork servers end with it (not an outer session's); a launched run's process ends in
    # harness.exit.
    with HarnessSession(owns_exit=True) as harness:
        try:
            if args.command == "run":
                code = cmd_run(args, harness)
            else:
                code = handlers[args.command](args)
        except _usage_errors() as exc:
            print(f"fsdp-conformance {args.command}: error: {exc}", file=sys.stderr)
            code = EXIT_USAGE
        except KeyboardInterrupt as exc:
            code = _interrupted(args.command, exc, harness)
    return harness.exit(code)


def _interrupted(command: str, exc: KeyboardInterrupt, harness: HarnessSession) -> int:
    """Say what SIGINT/SIGTERM stopped (the session kills every rank process and removes
    every rank folder); the exit code, 128 + N."""
    stopped = harness.stop(exc)
    # One of a launch's ranks (no pool here), also while it is still joining the launch's
    # group, before the session has joined it.
    if harness.launched or (command == "run" and launched_externally()):
        done = f"rank {os.environ.get('RANK', '?')} of the launch stopped"
    else:
        done = "rank processes stopped and their folders removed"
    # A new line: the interrupt may have cut a progress line ("[3/51] check ... ") short.
    print(f"\nfsdp-conformance {command}: interrupted by {stopped.name}; {done}; no report "
          f"written (exit {stopped.exit_code})", file=sys.stderr)
    return stopped.exit_code


if __name__ == "__main__":
    sys.exit(main())
