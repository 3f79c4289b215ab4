"""Harness overhead: one trivial check on a warm pool vs. a fresh spawn per check.

    python benchmarks/bench_harness.py [--world-size 2] [--warm 200] [--fresh 5]

(a) runs the same trivial check (an all-reduce of one integer) ``--warm`` times on one warm
:class:`RankPool`; (b) starts a new :class:`RankPool` for each of ``--fresh`` checks (spawn,
process-group init, the check, teardown). Prints both medians in milliseconds and their ratio,
against the targets of issue 2: warm overhead under 20 ms per check at world size 2, and at
least 30 times less than a fresh spawn.
"""

from __future__ import annotations

import argparse
import statistics
import time

from fsdp_conformance.harness import RankContext, RankPool, resolve_outcomes

WARM_TARGET_MS = 20.0
RATIO_TARGET = 30.0


def trivial_check(ctx: RankContext) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([ctx.rank])
    dist.all_reduce(t)
    return int(t.item())


def run_once(pool: RankPool) -> float:
    start = time.perf_counter()
    values = resolve_outcomes("trivial_check", pool.run_outcomes(trivial_check))
    elapsed = time.perf_counter() - start
    expected = sum(range(pool.world_size))
    if values != [expected] * pool.world_size:  # a wrong answer would make the timing moot
        raise SystemExit(f"trivial check returned {values}, expected {expected} on every rank")
    return elapsed


def warm_times(world_size: int, repeats: int) -> list[float]:
    with RankPool(world_size) as pool:
        run_once(pool)  # the first check imports the check's module on the ranks
        return [run_once(pool) for _ in range(repeats)]


def fresh_times(world_size: int, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        with RankPool(world_size) as pool:
            run_once(pool)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--warm", type=int, default=200, help="checks on the warm pool")
    parser.add_argument("--fresh", type=int, default=5, help="checks with a fresh spawn each")
    args = parser.parse_args()

    warm_ms = statistics.median(warm_times(args.world_size, args.warm)) * 1e3
    fresh_ms = statistics.median(fresh_times(args.world_size, args.fresh)) * 1e3
    ratio = fresh_ms / warm_ms
    print(f"world size {args.world_size}, trivial check (all_reduce of one int)")
    print(f"warm pool:   median {warm_ms:8.2f} ms per check over {args.warm} checks")
    print(f"fresh spawn: median {fresh_ms:8.2f} ms per check over {args.fresh} checks")
    print(f"ratio fresh/warm: {ratio:.0f}x")
    warm_ok = warm_ms < WARM_TARGET_MS
    ratio_ok = ratio >= RATIO_TARGET
    print(
        f"targets: warm < {WARM_TARGET_MS:g} ms: {'met' if warm_ok else 'MISSED'}; "
        f"ratio >= {RATIO_TARGET:g}x: {'met' if ratio_ok else 'MISSED'}"
    )
    raise SystemExit(0 if warm_ok and ratio_ok else 1)


if __name__ == "__main__":
    main()
