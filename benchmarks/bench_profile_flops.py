"""Benchmark: one meta profile of a preset with and without the FLOP counter, side by side.

The memory checks' profile (``profile.plan_step``) counts bytes only; the planner's also counts
each unit's forward FLOPs with torch's ``FlopCounterMode``. This times
``profile.profile_activations`` on the same meta model and batch, alternating with and without
the counter in one process after a warm-up (the meta machinery's lazy imports), checks that the
bytes are the same, and prints each time and the ratio without / with.

    python benchmarks/bench_profile_flops.py [--preset 70b] [--batch-size 2] [--repeat 2]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    from fsdp_conformance.measure.profile import profile_activations
    from fsdp_conformance.models.llama import LLAMA_PRESETS
    from fsdp_conformance.models.model_spec import BuiltModel, ModelSpec
    from fsdp_conformance.models.units import plan_units

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="70b", choices=sorted(LLAMA_PRESETS))
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()

    spec = ModelSpec(reference="llama", config=LLAMA_PRESETS[args.preset])
    model = spec.build("meta")
    units = plan_units(model, BuiltModel(spec, model).policy("recommended"))
    batch = spec.batch(model, args.batch_size, "meta")
    profile_activations(model, batch, units, count_flops=False)  # warm-up: lazy imports
    times: dict[bool, list[float]] = {True: [], False: []}
    saved: dict[bool, int] = {}
    for _ in range(args.repeat):
        for count in (True, False):
            start = time.perf_counter()
            profile = profile_activations(model, batch, units, count_flops=count)
            times[count].append(time.perf_counter() - start)
            saved[count] = sum(profile.saved_bytes.values())
    if saved[True] != saved[False]:
        raise SystemExit(f"the two profiles differ in saved bytes: {saved}")
    print(
        f"preset {args.preset}, batch {args.batch_size} x 8, {len(units)} units, "
        f"saved bytes {saved[True]:,} either way"
    )
    for count in (True, False):
        label = "with FlopCounterMode   " if count else "without FlopCounterMode"
        print(f"{label}: " + ", ".join(f"{t:.2f} s" for t in times[count]))
    ratio = statistics.median(times[False]) / statistics.median(times[True])
    print(f"median without / with: {ratio:.2f}")


if __name__ == "__main__":
    main()
