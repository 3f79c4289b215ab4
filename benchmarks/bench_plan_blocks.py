"""Benchmark: a deep preset's per-module meta profile, whole forward against three blocks.

The planner profiles a reference model or preset deeper than three blocks at three (the first,
a middle one, the last) and gives the other blocks the middle one's figures
(``plan.activations._module_profile``). This times both on the same meta model and settings,
alternating in one process after a warm-up (the meta machinery's lazy imports), checks that
every module's bytes and FLOPs are the same, and prints each time and the ratio.

    python benchmarks/bench_plan_blocks.py [--preset 70b] [--seq-len 4096] [--repeat 2]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    from fsdp_conformance.models.llama import LLAMA_PRESETS
    from fsdp_conformance.models.units import UnitInfo
    from fsdp_conformance.plan import activations
    from fsdp_conformance.plan.model import PlanSettings, build_meta_model, choose_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="70b", choices=sorted(LLAMA_PRESETS))
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()

    choice = choose_model(preset=args.preset)
    model = build_meta_model(choice)
    settings = PlanSettings(seq_len=args.seq_len)
    every = [UnitInfo(fqn=n, cls=type(m).__name__, numel=0) for n, m in model.named_modules()]
    activations._module_profile(model, choice, settings)  # warm-up: lazy imports
    runs = {
        "whole forward": lambda: activations.profile_step_activations(
            model, choice, every, settings
        ),
        "three blocks ": lambda: activations._module_profile(model, choice, settings),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    profiles = {}
    for _ in range(args.repeat):
        for name, run in runs.items():
            start = time.perf_counter()
            profiles[name] = run()
            times[name].append(time.perf_counter() - start)
    whole, short = profiles.values()
    if whole != short:
        differ = [n for n in whole.saved_bytes if whole.saved_bytes[n] != short.saved_bytes[n]]
        raise SystemExit(f"the two profiles differ (saved bytes of {differ[:5]}, or FLOPs)")
    print(
        f"preset {args.preset}: {len(model.layers)} blocks, {len(every)} modules, "
        f"{settings.compute_dtype}, batch {settings.batch_size} x {settings.seq_len}; "
        f"saved bytes {sum(whole.saved_bytes.values()):,} and forward FLOPs "
        f"{whole.forward_flops['']:,} either way"
    )
    for name, values in times.items():
        print(f"{name}: " + ", ".join(f"{t:.2f} s" for t in values))
    ratio = statistics.median(times["three blocks "]) / statistics.median(times["whole forward"])
    print(f"median three blocks / whole forward: {ratio:.2f}")


if __name__ == "__main__":
    main()
