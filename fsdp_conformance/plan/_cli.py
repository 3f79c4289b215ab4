"""``fsdp-conformance plan``'s own argument parser (until it joins ``cli.py``'s parser).

``cli.main`` hands ``plan``'s arguments to :func:`main`; ``run`` parses them, plans and reports.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from fsdp_conformance.models import REFERENCE_MODELS, ModelSpecError
from fsdp_conformance.plan.estimate import (
    CLAIM_WORLD_SIZES,
    DEFAULT_DEVICE_MEMORY,
    MAX_WORLD_SIZE,
    compare_policies,
    plan_model,
)
from fsdp_conformance.plan.model import (
    ATTENTION,
    DTYPE_BYTES,
    OPTIMIZERS,
    POLICIES,
    PRESETS,
    PlanError,
    PlanSettings,
    build_meta_model,
    choose_model,
    parse_bytes,
    parse_world_sizes,
)
from fsdp_conformance.plan.report import PROG, format_comparison, format_plan, plan_report
from fsdp_conformance.plan.verify import verify_fsdp2_shards
from fsdp_conformance.policies import PolicyError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # type: ignore[override]
        raise PlanError(f"{message}; see `{PROG} --help`")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=(
        "Wrap plan and per-rank memory estimate of one training step at full scale, in one "
        "process: the model is built on meta, nothing is allocated."))
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
    step.add_argument("--attention", choices=ATTENTION, default="flash",
                      help="flash: fused kernel's saved set; math: also seq x seq weights "
                      "[flash]")
    scale = p.add_argument_group("scale")
    scale.add_argument("--world-size", type=int, default=8, help="ranks to plan for [8]")
    scale.add_argument("--device-memory", default=DEFAULT_DEVICE_MEMORY, metavar="SIZES",
                       help=f"device sizes for 'devices needed' (GB = 10^9 B, GiB = 2^30 B) "
                       f"[{DEFAULT_DEVICE_MEMORY}]")
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
    return p


def settings_from_args(args: argparse.Namespace) -> PlanSettings:
    param, compute = args.param_dtype, args.compute_dtype
    if args.dtype is not None:
        param = compute = args.dtype
    return PlanSettings(policy=args.policy, version=args.version, param_dtype=param,
                        compute_dtype=compute, optimizer=args.optimizer,
                        batch_size=args.batch_size, seq_len=args.seq_len,
                        attention=args.attention)


def run(argv: Sequence[str]) -> tuple[str, dict[str, Any], bool]:
    """Parse, plan and report: (text for people, data for tools, --json?). Raises PlanError."""
    args = build_parser().parse_args(list(argv))
    choice = choose_model(preset=args.preset, reference=args.reference, factory=args.factory,
                          block_cls=args.block_cls, min_params=args.min_params,
                          layers=args.layers, dim=args.dim, input_builder=args.input_builder)
    settings = settings_from_args(args)
    devices = [parse_bytes(x) for x in args.device_memory.split(",") if x.strip()]
    if not devices:
        raise PlanError("--device-memory is empty; write e.g. 80GB,141GB")
    if args.max_world_size < 1:
        raise PlanError(f"--max-world-size must be >= 1, got {args.max_world_size}")
    if args.compare_policies:
        data = compare_policies(choice, settings, parse_world_sizes(args.world_sizes), devices,
                                max_world_size=args.max_world_size)
        return format_comparison(data), data, args.json
    if args.world_size < 1:
        raise PlanError(f"--world-size must be >= 1, got {args.world_size}")
    model = build_meta_model(choice)
    plan = plan_model(choice, settings, model)
    verification = None
    if args.verify and settings.version == "fsdp2":
        verification = verify_fsdp2_shards(plan, args.world_size, model)
    report = plan_report(plan, args.world_size, devices, verification, args.max_world_size)
    return format_plan(plan, report, collapse=not args.full_tree), report, args.json


def main(argv: Sequence[str] | None = None) -> int:
    """``fsdp-conformance plan ARGS``: 0 ok, 2 bad input (one line on stderr naming the fix)."""
    try:
        text, data, as_json = run(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except (PlanError, ModelSpecError, PolicyError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(data, indent=2, default=str) if as_json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
