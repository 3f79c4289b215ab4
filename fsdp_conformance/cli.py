"""``fsdp-conformance``: run the suite, compare two reports, plan at full scale.

    fsdp-conformance run [--lane cpu|gpu|all] [--model pkg.mod:factory --block-cls Block] ...
    fsdp-conformance compare OLD.json NEW.json [--noise T] [--rollback R] [--markdown|--json]
    fsdp-conformance noise R1.json R2.json [...] --out noise.json
    fsdp-conformance plan --preset 70b --world-size 1024 [--json]

Exit codes: 0 all good; 1 a check failed (run) or the upgrade is not safe (compare);
2 bad input (the message names the problem and the fix); 130 / 143 interrupted by SIGINT /
SIGTERM (rank processes killed and their folders removed first).
Under torchrun/srun, ``run`` runs on the launch's ranks: rank 0 prints and writes the report,
the others log to ``DIR/rank{N}.log``, and every rank exits with the worst rank's code.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fsdp_conformance import cli_parser
from fsdp_conformance.gate.outputs import EXIT_FAILED, EXIT_OK
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

#: Bad input: the message names the problem and the fix (0 and 1 are the run's: gate.outputs).
EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input: printed as one line, exit code 2."""


def resolve_cli_settings(args: argparse.Namespace) -> Settings:
    cli = {o.name: getattr(args, o.name, None) for o in OPTIONS}
    return resolve_settings(cli, os.environ, {}, pyproject_settings(os.getcwd()), flag_style="cli")


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
        harness.prestart_fork_server(backend=settings.backend)
    lanes = lanes_for(args.lane)

    from fsdp_conformance.gate import outputs, suite
    from fsdp_conformance.gate.report import environment_summary
    from fsdp_conformance.models import user_model

    options = checkpoint_options(args)
    # What this command line runs, decided once: --list, the preflight, the run (launched too).
    plan = suite.plan_suite(settings, lanes, pattern=args.checks, options=options)
    if plan.spec is not None:  # the preflight: one line and exit 2 on bad input, before any rank
        notes = user_model.validate_user_model(
            plan.spec,
            lanes,
            settings.world_sizes,
            flag_style="cli",
            depth_rebuild=any(c.name == "memory.depth_invariance" for c, _ in plan.selected),
            init_checks=any(c.claim == "init" for c, _ in plan.selected),
        )
        for note in notes:
            print(f"fsdp-conformance run: note: {note}", file=sys.stderr)
        plan = dataclasses.replace(plan, notes=tuple(notes))  # the report keeps them too
    if not plan.selected:
        # Before running anything: an empty report would pass any gate downstream.
        raise UsageError(
            f"no check matched --checks {args.checks!r}; see `fsdp-conformance run "
            "--list` for the check names"
        )
    if args.list:
        # What this command line would run: one line per check and variant (FSDP version, model).
        for check, params in plan.selected:
            print(f"{suite.check_label(check, params):<50} {check.claim:<7} {check.description}")
        return EXIT_OK
    json_path = args.json_path or os.path.join(args.out, "report.json")
    md_path = args.markdown or os.path.join(args.out, "summary.md")
    # Before any check runs: a folder we cannot write would lose the whole run at the end.
    for path, flag in (
        (json_path, "--json" if args.json_path else "--out"),
        (md_path, "--markdown" if args.markdown else "--out"),
    ):
        _ensure_writable_folder(path, flag)
    if launched_externally():
        return outputs.run_launched(
            plan, harness, out=args.out, json_path=json_path, md_path=md_path, plot=args.plot
        )
    print(f"fsdp-conformance: {environment_summary(settings)}", file=sys.stderr)
    # The ranks of checks that start with variables of their own (allocator settings) fork from
    # a server of that environment: started now, it imports torch during the checks before
    # them instead of while the run waits.
    for env in plan.start_environments():
        harness.pools.prestart_fork_server(env)
    report = suite.run_suite(plan, harness.pools, report_path=json_path)
    return outputs.write_outputs(report, json_path, md_path, plot=args.plot)


def checkpoint_options(args: argparse.Namespace) -> dict[str, str | None]:
    """``state.checkpoint``'s opt-in parameters from ``--save-checkpoint`` and
    ``--load-checkpoint``, as absolute paths (ranks may run in another folder); a folder that
    cannot be written or read is a usage error now, not a failed check later."""
    save_to = load_from = None
    if args.save_checkpoint is not None:
        save_to = os.path.abspath(args.save_checkpoint)
        _writable_folder(
            save_to,
            f"--save-checkpoint {args.save_checkpoint}: cannot write to it",
            "give a folder you can write",
        )
    if args.load_checkpoint is not None:
        load_from = os.path.abspath(args.load_checkpoint)
        if not os.path.isdir(load_from):
            raise UsageError(
                f"--load-checkpoint {args.load_checkpoint}: no such folder; give "
                "the folder a run with --save-checkpoint wrote"
            )
        if save_to is not None and os.path.samefile(save_to, load_from):
            raise UsageError(
                "--save-checkpoint and --load-checkpoint name the same folder: "
                "the save would replace what the load reads; give two folders"
            )
    return {"save_to": save_to, "load_from": load_from}


def _ensure_writable_folder(path: str, flag: str) -> None:
    _writable_folder(
        os.path.dirname(os.path.abspath(path)),
        f"cannot write the report to {os.path.dirname(path) or '.'}",
        f"give {flag} a folder you can write",
    )


def _writable_folder(folder: str, problem: str, fix: str) -> None:
    """Make ``folder`` if missing; a usage error (``problem (why); fix``) when it cannot be made
    or written."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{problem} ({exc.strerror}); {fix}") from None
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{problem} (not writable); {fix}")


def cmd_compare(args: argparse.Namespace) -> int:
    from fsdp_conformance.gate import compare
    from fsdp_conformance.gate.report import load_report

    old = load_report(args.old)
    new = load_report(args.new)
    differs = compare.comparability(old, new)
    if differs and not args.force:
        # Every check would be "missing" and "added": a wall of regressions that hides the cause.
        raise UsageError(
            f"{args.old!r} and {args.new!r} are not comparable: {differs}; compare "
            "reports of the same model and checks (same --model, --block-cls, "
            "--min-params, --input, world sizes and --checks), or pass --force to "
            "compare them anyway"
        )
    if differs:
        print(
            f"fsdp-conformance compare: warning: the reports are not comparable ({differs}); "
            "compared anyway (--force)",
            file=sys.stderr,
        )
    tolerance = (
        args.memory_tolerance
        if args.memory_tolerance is not None
        else compare.DEFAULT_MEMORY_TOLERANCE
    )
    if not tolerance >= 0:  # also refuses nan
        raise UsageError(f"--memory-tolerance must be a fraction >= 0 (0.05 = 5%), got {tolerance}")
    floor_mib = (
        args.memory_floor_mib
        if args.memory_floor_mib is not None
        else compare.DEFAULT_MEMORY_FLOOR_BYTES / MiB
    )
    if not floor_mib >= 0:
        raise UsageError(f"--memory-floor-mib must be >= 0 (in MiB), got {floor_mib}")
    from fsdp_conformance.gate import noise, verdict

    try:
        table = noise.load_table(args.noise) if args.noise else None
    except noise.NoiseError as exc:
        raise UsageError(f"--noise {exc}") from None
    rollback = load_report(args.rollback) if args.rollback else None
    diffs = compare.compare_reports(
        old,
        new,
        memory_tolerance=tolerance,
        memory_floor_bytes=floor_mib * MiB,
        noise=table,
        rollback=rollback,
        fail_on_deprecation=args.fail_on_deprecation,
        loads=[load_report(path) for path in args.loads],
    )
    if args.json:
        options = {
            "memory_tolerance": tolerance,
            "memory_floor_mib": floor_mib,
            "noise": args.noise,
            "rollback": args.rollback,
            "loads": args.loads,
        }
        out = verdict.to_json(old, new, diffs, (args.old, args.new), options, args.fail_on_change)
    elif args.markdown:
        out = verdict.format_markdown(old, new, diffs, args.fail_on_change)
    else:
        out = verdict.format_text(old, new, diffs, args.fail_on_change)
    print(out)
    return EXIT_OK if verdict.safe(diffs, args.fail_on_change) else EXIT_FAILED


def cmd_noise(args: argparse.Namespace) -> int:
    from fsdp_conformance._files import write_atomic
    from fsdp_conformance.gate import noise
    from fsdp_conformance.gate.report import load_report

    reports = [load_report(path) for path in args.reports]
    try:
        table = noise.measure(reports, args.reports)
    except noise.NoiseError as exc:
        raise UsageError(str(exc)) from None
    write_atomic(args.out, json.dumps(table, indent=1) + "\n")
    figures = sum(len(v) for v in table["noise"].values())
    noisy = sum(1 for v in table["noise"].values() for x in v.values() if x > 0)
    print(
        f"noise: {figures} measured figures of {len(table['noise'])} checks over "
        f"{table['runs']} runs on torch {table['torch']}; {noisy} moved between runs; "
        f"written to {args.out}"
    )
    return EXIT_OK


def cmd_matrix(args: argparse.Namespace) -> int:
    from fsdp_conformance.gate import compare, matrix
    from fsdp_conformance.gate.report import load_report

    reports = [(path, load_report(path)) for path in args.reports]
    for path, report in reports[1:]:
        differs = compare.comparability(reports[0][1], report)
        if differs:  # a row per check of each model: shown, but not one model across versions
            print(
                f"fsdp-conformance matrix: warning: {path!r} is not comparable with "
                f"{reports[0][0]!r} ({differs}); its checks get rows of their own",
                file=sys.stderr,
            )
    matrix.print_and_write(matrix.build_matrix(reports), args.out, differing=args.differing)
    return EXIT_OK


def _plan_settings(args: argparse.Namespace) -> PlanSettings:
    from fsdp_conformance.plan.model import PlanSettings

    param, compute = args.param_dtype, args.compute_dtype
    if args.dtype is not None:
        param = compute = args.dtype
    return PlanSettings(
        policy=args.policy,
        version=args.version,
        param_dtype=param,
        compute_dtype=compute,
        reduce_dtype=args.reduce_dtype,
        optimizer=args.optimizer,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        attention=args.attention,
        loss=args.loss,
        checkpointing=args.checkpointing,
        shard_group_size=args.shard_group_size,
        cpu_offload=args.cpu_offload,
    )


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
        choice = choose_model(
            preset=args.preset,
            reference=args.reference,
            factory=args.factory,
            block_cls=args.block_cls,
            min_params=args.min_params,
            layers=args.layers,
            dim=args.dim,
            input_builder=args.input_builder,
            norm=args.norm,
        )
        settings = _plan_settings(args)
        devices = [parse_bytes(x) for x in args.device_memory.split(",") if x.strip()]
        if not devices:
            raise UsageError("--device-memory is empty; write e.g. 80GB,141GB")
        if args.max_world_size < 1:
            raise UsageError(f"--max-world-size must be >= 1, got {args.max_world_size}")
        world_sizes = parse_world_sizes(args.world_sizes) if args.compare_policies else ()
        if not args.compare_policies and args.world_size < 1:
            raise UsageError(f"--world-size must be >= 1, got {args.world_size}")
        reserve = (
            DEFAULT_RESERVE
            if args.device_reserve is None
            else DeviceReserve.of_total(
                parse_bytes(args.device_reserve, "--device-reserve", allow_zero=True)
            )
        )
        text, data = plan_command(
            choice,
            settings,
            args.world_size,
            devices,
            verify=args.verify,
            compare=args.compare_policies,
            world_sizes=world_sizes,
            max_world_size=args.max_world_size,
            full_tree=args.full_tree,
            reserve=reserve,
        )
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
    for module, name in (
        ("fsdp_conformance.models.model_spec", "ModelSpecError"),
        ("fsdp_conformance.models.policies", "PolicyError"),
    ):
        loaded = sys.modules.get(module)
        if loaded is not None:
            errors.append(getattr(loaded, name))
    return tuple(errors)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = cli_parser.build_parser()
    args = parser.parse_args(argv)
    handlers = {
        "compare": cmd_compare,
        "noise": cmd_noise,
        "matrix": cmd_matrix,
        "plan": cmd_plan,
    }
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
    print(
        f"\nfsdp-conformance {command}: interrupted by {stopped.name}; {done}; no report "
        f"written (exit {stopped.exit_code})",
        file=sys.stderr,
    )
    return stopped.exit_code


if __name__ == "__main__":
    sys.exit(main())
