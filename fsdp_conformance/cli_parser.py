"""The ``fsdp-conformance`` command line: its parser, subcommands and flags (wiring only).

Every setting flag comes from ``settings.OPTIONS`` (the flag, its environment variable and its
``[tool.fsdp_conformance]`` key written once); ``plan``'s flags are added on its first parse, so
``run``, ``compare`` and ``--help`` do not import torch for them. :mod:`fsdp_conformance.cli`
runs the commands.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from fsdp_conformance.settings import OPTIONS

DEFAULT_OUT = "fsdp-conformance-report"


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

    def __init__(
        self,
        *args: Any,
        add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
        defer_errors: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._add_arguments = add_arguments
        self._defer_errors = defer_errors

    def error(self, message: str) -> NoReturn:
        if not self._defer_errors:
            super().error(message)
        raise _DeferredUsageError(f"{message}; see `{self.prog} --help`")

    # ignore: typeshed overloads this on the namespace's type; only Namespace is used here
    def parse_known_args(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        namespace: argparse.Namespace | None = None,
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
    run.add_argument(
        "--lane",
        choices=("cpu", "gpu", "all", "auto"),
        default="auto",
        help="lanes to run: auto = cpu, plus gpu when CUDA is present",
    )
    run.add_argument(
        "--checks",
        metavar="SUBSTRING",
        default=None,
        help="only checks whose name contains SUBSTRING (e.g. 'wrap.'); a "
        "renamed check's old name matches too",
    )
    run.add_argument(
        "--out",
        default=DEFAULT_OUT,
        metavar="DIR",
        help=f"folder for report.json, summary.md (and the plot) [{DEFAULT_OUT}]",
    )
    run.add_argument(
        "--json",
        dest="json_path",
        default=None,
        metavar="PATH",
        help="JSON report path [DIR/report.json]",
    )
    run.add_argument(
        "--markdown",
        default=None,
        metavar="PATH",
        help="Markdown summary path [DIR/summary.md]; also appended to "
        "$GITHUB_STEP_SUMMARY when set",
    )
    run.add_argument(
        "--plot",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write memory_timeline.png next to summary.md, which links it: the "
        "memory timelines of the run (the default when the run has one); "
        "--no-plot: do not",
    )
    run.add_argument(
        "--save-checkpoint",
        metavar="DIR",
        default=None,
        help="also run state.checkpoint: save each variant's model with "
        "torch.distributed.checkpoint into DIR (a folder per variant, with the "
        "values saved and this torch's version), for --load-checkpoint on another "
        "torch (ci/upgrade-gate.sh)",
    )
    run.add_argument(
        "--load-checkpoint",
        metavar="DIR",
        default=None,
        help="also run state.checkpoint: load the checkpoints a run with "
        "--save-checkpoint DIR wrote (on another torch) into FSDP1, FSDP2 and one "
        "process, and compare every value with the saved ones, bitwise",
    )
    run.add_argument("--list", action="store_true", help="list the checks and exit")

    compare = sub.add_parser("compare", help="compare two reports: the torch-upgrade gate")
    compare.add_argument("old", help="report of the current torch (baseline)")
    compare.add_argument("new", help="report of the candidate torch")
    compare.add_argument(
        "--memory-tolerance",
        type=float,
        default=None,
        metavar="FRACTION",
        help="relative change of a memory figure that counts (default 0.05)",
    )
    compare.add_argument(
        "--memory-floor-mib",
        type=float,
        default=None,
        metavar="MIB",
        help="memory moves smaller than this many MiB are not reported, "
        "whatever their relative size (default 1)",
    )
    compare.add_argument(
        "--fail-on-change",
        action="store_true",
        help="exit 1 on any difference, not only on regressions",
    )
    compare.add_argument(
        "--noise",
        default=None,
        metavar="TABLE",
        help="noise table of the current torch (`fsdp-conformance noise`), for figures whose "
        "entry in OLD carries no noise: a measured figure moved beyond its noise is drift "
        "(reports of the reference models carry theirs)",
    )
    compare.add_argument(
        "--rollback",
        default=None,
        metavar="REPORT",
        help="report of the current torch loading the checkpoints the candidate saved "
        "(`run --load-checkpoint`): a checkpoint it cannot read is a rollback failure",
    )
    compare.add_argument(
        "--loads",
        action="append",
        default=[],
        metavar="REPORT",
        help="report of the candidate loading the current torch's checkpoints at another "
        "world size (`run --world-sizes 4 --load-checkpoint`); repeatable: a checkpoint "
        "it cannot load is a regression",
    )
    compare.add_argument(
        "--fail-on-deprecation",
        action="store_true",
        help="a new deprecation blocks the upgrade (exit 1), not only said",
    )
    output = compare.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the verdict as JSON")
    output.add_argument("--markdown", action="store_true", help="print the verdict as Markdown")
    compare.add_argument(
        "--force",
        action="store_true",
        help="compare reports of different models (model, block class, size "
        "threshold, input) or with no check in common anyway; without it such "
        "reports are 'not comparable' (exit 2)",
    )

    noise = sub.add_parser(
        "noise",
        help="the noise of every measured figure, from repeated runs on one torch "
        "(for compare --noise)",
    )
    noise.add_argument(
        "reports",
        nargs="+",
        metavar="REPORT",
        help="reports of two or more `fsdp-conformance run`s with the same settings on one torch",
    )
    noise.add_argument(
        "--out", required=True, metavar="FILE", help="where to write the noise table (JSON)"
    )

    matrix = sub.add_parser(
        "matrix", help="checks x torch versions from one report per version (ci/torch-matrix.sh)"
    )
    matrix.add_argument(
        "reports",
        nargs="+",
        metavar="REPORT",
        help="reports of `fsdp-conformance run`, one per torch version, in the "
        "order of the columns",
    )
    matrix.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="write DIR/matrix.md and DIR/matrix.svg (the Markdown is printed either way)",
    )
    matrix.add_argument(
        "--differing",
        action="store_true",
        help="print only the checks that do not pass on every version, and how "
        "many do (the files keep every check)",
    )

    sub.add_parser(
        "plan",
        add_arguments=_add_plan_flags,
        defer_errors=True,
        help="wrap plan and memory estimate at full scale, no devices "
        "(`fsdp-conformance plan --help`)",
        description="Wrap plan and per-rank memory estimate of one training step at "
        "full scale, in one process: the model is built on meta, nothing is allocated.",
    )
    return parser


def _add_plan_flags(p: argparse.ArgumentParser) -> None:
    from fsdp_conformance.models.catalog import REFERENCE_MODELS
    from fsdp_conformance.models.reference_models import LLAMA_NORMS
    from fsdp_conformance.plan.estimate import (
        CLAIM_WORLD_SIZES,
        DEFAULT_DEVICE_MEMORY,
        DEFAULT_RESERVE,
        MAX_WORLD_SIZE,
    )
    from fsdp_conformance.plan.model import (
        ATTENTION,
        DTYPE_BYTES,
        LOSSES,
        OPTIMIZERS,
        POLICIES,
        PRESETS,
    )
    from fsdp_conformance.sizes import format_bytes

    model = p.add_argument_group("model (exactly one)")
    model.add_argument(
        "--preset",
        metavar="NAME",
        help=f"a full-scale shape: {', '.join(PRESETS)} (seeds = the seeds' "
        "MassiveModel, dim 4096, 8 layers)",
    )
    model.add_argument(
        "--reference",
        metavar="NAME",
        help=f"a reference model at CPU size: {', '.join(REFERENCE_MODELS)}",
    )
    model.add_argument(
        "--model",
        dest="factory",
        metavar="PKG.MOD:FACTORY",
        help="your model factory (called with no arguments under meta)",
    )
    model.add_argument("--block-cls", metavar="CLASS[,CLASS]", help="your model's block class(es)")
    model.add_argument(
        "--min-params",
        type=int,
        metavar="N",
        help="size-rule threshold (default: 2e7 scaled with dim^2; the seeds' "
        "policy on a preset keeps the literal 2e7)",
    )
    model.add_argument(
        "--input",
        dest="input_builder",
        metavar="PKG.MOD:BUILDER",
        help="input builder(model, batch_size, device) for your model",
    )
    model.add_argument(
        "--norm",
        choices=LLAMA_NORMS,
        default=None,
        help="a Llama's RMSNorm: eager (one fp32 upcast, torchtitan's rmsnorm), fused "
        "(saves its input and the reciprocal RMS, torchtitan's fused_rmsnorm) or "
        "upcast-twice (the suite's first reference) [presets: eager; --reference "
        "llama: upcast-twice]",
    )
    model.add_argument("--layers", type=int, help="--reference only: number of blocks")
    model.add_argument("--dim", type=int, help="--reference only: width")
    step = p.add_argument_group("training step")
    step.add_argument(
        "--policy",
        choices=POLICIES,
        default="recommended",
        help="recommended (one unit per block), seeds (get_hybrid_policy), "
        "monolithic (root only) [recommended]",
    )
    step.add_argument(
        "--fsdp-version",
        dest="version",
        choices=("fsdp1", "fsdp2"),
        default="fsdp2",
        help="[fsdp2]",
    )
    step.add_argument(
        "--param-dtype",
        choices=tuple(DTYPE_BYTES),
        default="fp32",
        help="sharded params, grads and optimizer state [fp32]",
    )
    step.add_argument(
        "--compute-dtype",
        choices=tuple(DTYPE_BYTES),
        default="bf16",
        help="gathered params, unsharded grads, collectives, activations [bf16]",
    )
    step.add_argument(
        "--dtype", choices=tuple(DTYPE_BYTES), help="both of the above (no mixed precision)"
    )
    step.add_argument(
        "--reduce-dtype",
        choices=tuple(DTYPE_BYTES),
        default=None,
        help="the gradients' reduce-scatter (MixedPrecisionPolicy(reduce_dtype=...); "
        "torchtitan: fp32) [the compute dtype]",
    )
    step.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="[adamw]")
    step.add_argument("--batch-size", type=int, default=1, help="per-rank micro-batch [1]")
    step.add_argument("--seq-len", type=int, default=4096, help="tokens per sample [4096]")
    step.add_argument(
        "--activation-checkpointing",
        dest="checkpointing",
        default="none",
        metavar="none|full|op|every-K",
        help="checkpoint every block (full), every block op by op (op: attention and "
        "every other matmul kept, torchtitan's selective op policy) or blocks 0, K, 2K, "
        "... (every-K), as "
        "torch's checkpoint_wrapper does; the plan also shows each choice side by "
        "side [none]",
    )
    step.add_argument(
        "--shard-group-size",
        type=int,
        default=None,
        metavar="N",
        help="HSDP: shard each unit over groups of N ranks, replicated across "
        "groups (FSDP2 2-D mesh, FSDP1 HYBRID_SHARD); --world-size must be a "
        "multiple of N [full sharding]",
    )
    step.add_argument(
        "--cpu-offload",
        action="store_true",
        help="sharded params, grads and optimizer state in host memory (FSDP1 "
        "CPUOffload(offload_params=True), FSDP2 CPUOffloadPolicy): the estimate is "
        "the device's, the host's per rank is printed beside it",
    )
    step.add_argument(
        "--attention",
        choices=ATTENTION,
        default="flash",
        help="flash: fused kernel's saved set; math: also seq x seq weights [flash]",
    )
    step.add_argument(
        "--loss",
        choices=LOSSES,
        default="mse",
        help="the step's loss: mse (the suite's: mean square of the output in fp32) or "
        "cross-entropy (torchtitan's: fp32 logits, token targets) [mse]",
    )
    scale = p.add_argument_group("scale")
    scale.add_argument("--world-size", type=int, default=8, help="ranks to plan for [8]")
    scale.add_argument(
        "--device-memory",
        default=DEFAULT_DEVICE_MEMORY,
        metavar="SIZES",
        help=f"device sizes for 'devices needed' (GB = 10^9 B, GiB = 2^30 B) "
        f"[{DEFAULT_DEVICE_MEMORY}]",
    )
    scale.add_argument(
        "--device-reserve",
        default=None,
        metavar="SIZE",
        help="device memory kept free per rank outside the estimate (CUDA "
        "context, NCCL, cuBLAS workspaces; docs/planning.md) [stated "
        f"allowance, {format_bytes(DEFAULT_RESERVE.total, 'decimal')}]",
    )
    scale.add_argument(
        "--max-world-size",
        type=int,
        default=MAX_WORLD_SIZE,
        help=f"largest world size searched [{MAX_WORLD_SIZE}]",
    )
    scale.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip the FSDP2 cross-check on the fake process group",
    )
    out = p.add_argument_group("output")
    out.add_argument(
        "--compare-policies",
        action="store_true",
        help="the seeds' claim: fp16 weights, and the estimate of every policy at --world-sizes",
    )
    out.add_argument(
        "--world-sizes",
        default=",".join(map(str, CLAIM_WORLD_SIZES)),
        help="world sizes of --compare-policies [8,64,512,1024]",
    )
    out.add_argument(
        "--full-tree",
        action="store_true",
        help="one line per unit (default: identical siblings collapsed)",
    )
    out.add_argument("--json", action="store_true", help="print JSON instead of tables")
