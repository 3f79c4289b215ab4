"""Benchmark: plan + estimate of the 70B preset at world size 1,024, in one fresh process.

Target: under 10 s and under 2 GB of memory on the 2-core build machine. Each run
is a fresh subprocess so that its peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) is
its own; phases are timed with ``time.perf_counter`` inside it:

* import: the ``fsdp_conformance.plan`` modules (torch included);
* plan + estimate: the meta model, the unit plan, the activation profile (a forward on meta),
  the per-layer bound and the "devices needed" search for 80 GiB and 140 GiB, with every
  activation checkpointing mode as the plan's own (none, every-4, every-3, every-2, op, full:
  each report also tables every mode);
* cross-check: FSDP2 ``fully_shard`` per unit and root on a 1,024-rank fake process group.

    python benchmarks/bench_plan.py [--preset 70b] [--world-size 1024] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from fsdp_conformance.plan.estimate import CHECKPOINTING_OPTIONS, plan_model
from fsdp_conformance.plan.model import PlanSettings, build_meta_model, choose_model
from fsdp_conformance.plan.report import plan_report
from fsdp_conformance.plan.verify import verify_fsdp2_shards
t1 = time.perf_counter()
preset, world_size = sys.argv[1], int(sys.argv[2])
choice = choose_model(preset=preset)
model = build_meta_model(choice)
plan = plan_model(choice, PlanSettings(), model)
devices = [80 * 2**30, 140 * 2**30]
reports = {m: plan_report(plan.with_checkpointing(m), world_size, devices)
           for m in CHECKPOINTING_OPTIONS}
report = reports["none"]
t2 = time.perf_counter()
rss_plan = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
check = verify_fsdp2_shards(plan, world_size, model)
t3 = time.perf_counter()
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({
    "import_s": t1 - t0, "plan_estimate_s": t2 - t1, "cross_check_s": t3 - t2,
    "rss_after_plan_mb": rss_plan / 1024, "max_rss_mb": usage.ru_maxrss / 1024,
    "cpu_s": usage.ru_utime + usage.ru_stime, "units": len(plan.units),
    "params": plan.total_numel, "estimate_bytes": report["estimate"]["total"],
    "matches": check.get("matches"),
    "mode_estimates": {m: r["estimate"]["total"] for m, r in reports.items()},
}))
"""


def run_once(preset: str, world_size: int) -> dict[str, Any]:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, preset, str(world_size)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"bench_plan: the planning process failed:\n{proc.stderr}")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    data["process_wall_s"] = wall
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="70b")
    parser.add_argument("--world-size", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    runs = [run_once(args.preset, args.world_size) for _ in range(args.repeat)]
    first = runs[0]
    print(
        f"preset {args.preset}: {first['params']:,} params, {first['units']} units, world size "
        f"{args.world_size:,}; estimate {first['estimate_bytes'] / 2**30:.2f} GiB per rank; "
        f"fsdp2 cross-check matches: {first['matches']}"
    )
    print(
        "per checkpointing mode: "
        + ", ".join(f"{m} {b / 2**30:.2f} GiB" for m, b in first["mode_estimates"].items())
    )
    print(
        f"{'run':>3}  {'import s':>8}  {'plan+estimate s':>15}  {'cross-check s':>13}  "
        f"{'process wall s':>14}  {'cpu s':>6}  {'max RSS MB':>10}"
    )
    for i, r in enumerate(runs):
        print(
            f"{i:>3}  {r['import_s']:>8.2f}  {r['plan_estimate_s']:>15.2f}  "
            f"{r['cross_check_s']:>13.2f}  {r['process_wall_s']:>14.2f}  {r['cpu_s']:>6.2f}  "
            f"{r['max_rss_mb']:>10.0f}"
        )

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    total = med("import_s") + med("plan_estimate_s")
    print(
        f"median: plan + estimate {med('plan_estimate_s'):.2f} s (with import {total:.2f} s), "
        f"cross-check {med('cross_check_s'):.2f} s, whole process {med('process_wall_s'):.2f} s, "
        f"max RSS {max(r['max_rss_mb'] for r in runs):.0f} MB "
        f"(target: under 10 s and 2,048 MB)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
