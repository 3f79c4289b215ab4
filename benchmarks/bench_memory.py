"""Benchmark: torch's tracker against ground truth, and what measuring costs.

One run, side by side on every rank: the tracker's step increase against the OS high-water
mark (CPU; ranks start with MALLOC_MMAP_THRESHOLD_=65536) or the CUDA caching allocator (GPU),
printed as a ratio (target: within 5%); then the step time with and without tracking.

    python benchmarks/bench_memory.py [--dim 512] [--layers 8] [--world-size 2] [--repeat 3]
                                      [--plot memory_timeline.png]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from fsdp_conformance.harness import PoolManager, RankContext, Ranks, cuda_device_count
from fsdp_conformance.measure.bound import Bound, per_layer_bound
from fsdp_conformance.measure.meters import MALLOC_ENV
from fsdp_conformance.measure.profile import plan_step
from fsdp_conformance.measure.step import measure_step
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.reference_models import ModelConfig


def bench_rank(ctx: RankContext, spec: ModelSpec, version: str, repeat: int) -> dict[str, Any]:
    """Agreement (tracker vs truth), peaks per wrapping, and step times per meter, on this rank."""
    truth = "cuda" if ctx.device_type == "cuda" else "os"
    # The agreement of the meter memory.meter_agrees cross-checks (FSDPMemTracker for FSDP2
    # on CPU: the source of its figures), on the same step.
    both = measure_step(
        ctx,
        spec,
        version,
        "per_layer",
        meter="auto" if truth == "os" else "tracker",
        also=truth,
        timeline=False,
    )
    out: dict[str, Any] = {"rank": ctx.rank, "agreement": both["meters"]}
    for wrapping in ("per_layer", "monolithic"):
        m = measure_step(ctx, spec, version, wrapping, meter="tracker", also=truth)
        out[wrapping] = {
            "tracker": m["meters"][0]["peak"],
            truth: m["meters"][1]["peak"],
            "timeline": m["timeline"],
        }
    units, config = plan_step(spec, ctx.world_size, version)
    out["bound"] = per_layer_bound(units, config).to_dict()
    times: dict[str, float] = {}
    for meter in ("none", "tracker", truth):
        runs = [
            measure_step(ctx, spec, version, "per_layer", meter=meter, timeline=False)["seconds"]
            for _ in range(repeat)
        ]
        times[meter] = statistics.median(runs)
    timed = measure_step(ctx, spec, version, "per_layer", meter="tracker", timeline=True)
    times["tracker+timeline"] = timed["seconds"]
    out["times"] = times
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--plot", default=None, help="write the fsdp2 timelines as a PNG here")
    args = parser.parse_args(argv)
    spec = ModelSpec(reference="massive", config=ModelConfig(num_layers=args.layers, dim=args.dim))
    gpu = cuda_device_count() >= args.world_size
    manager = PoolManager()
    ranks = Ranks(
        manager,
        args.world_size,
        lane="gpu" if gpu else "cpu",
        backend="nccl" if gpu else "gloo",
        timeout=600,
    )
    if not gpu:
        ranks = ranks.configured(env=MALLOC_ENV)
    truth = "cuda" if gpu else "os"
    lane = "gpu (CUDA allocator)" if gpu else "cpu (OS VmHWM, MALLOC_MMAP_THRESHOLD_=65536)"
    print(
        f"model: massive dim {args.dim}, {args.layers} layers; world size {args.world_size}; "
        f"lane {lane}"
    )
    try:
        for version in ("fsdp1", "fsdp2"):
            values = ranks.run(bench_rank, spec, version, args.repeat)
            report(version, values, truth)
            if args.plot and version == "fsdp2":
                write_plot(values[0], args.plot)
    finally:
        manager.close()
    return 0


def report(version: str, values: list[dict[str, Any]], truth: str) -> None:
    bound = Bound.from_dict(values[0]["bound"])
    print(f"\n== {version} ==")
    tracker = values[0]["agreement"][0]["source"]
    print(f"{'rank':>4}  {tracker + ' step +MB':>16}  {truth + ' step +MB':>14}  {'ratio':>6}")
    for v in values:
        tr, gt = v["agreement"]
        a, b = tr["peak"] - tr["start"], gt["peak"] - gt["start"]
        print(f"{v['rank']:>4}  {a / 1e6:>16.2f}  {b / 1e6:>14.2f}  {a / b:>6.3f}")
    print(
        f"{'rank':>4}  {'wrapping':>10}  {'tracker peak MB':>15}  {truth + ' peak MB':>12}  "
        f"{'ratio':>6}  {'bound MB':>8}"
    )
    for v in values:
        for w in ("per_layer", "monolithic"):
            t, g = v[w]["tracker"], v[w][truth]
            print(
                f"{v['rank']:>4}  {w:>10}  {t / 1e6:>15.2f}  {g / 1e6:>12.2f}  {t / g:>6.3f}  "
                f"{bound.total / 1e6:>8.2f}"
            )
    for v in values:
        times = v["times"]
        base = times["none"]
        parts = ", ".join(f"{k} {s * 1e3:.1f} ms ({s / base:.2f}x)" for k, s in times.items())
        print(f"rank {v['rank']} step time: {parts}")


def write_plot(value: dict[str, Any], path: str) -> None:
    try:
        from fsdp_conformance.gate import plots

        plots.plot_timelines(
            {w: value[w]["timeline"] for w in ("per_layer", "monolithic")},
            path,
            limit_bytes=Bound.from_dict(value["bound"]).limit,
            peaks={w: value[w]["tracker"] for w in ("per_layer", "monolithic")},
            title="fsdp2, rank 0: per-layer sawtooth vs monolithic",
        )
        print(f"plot: {path}")
    except ImportError as exc:
        print(f"plot: not written ({exc}); pip install matplotlib")


if __name__ == "__main__":
    sys.exit(main())
