"""Harness overhead: one trivial check on a warm pool vs. a fresh spawn per check.

    python benchmarks/bench_harness.py [--world-size 2] [--warm 200] [--fresh 5]

(a) runs the same trivial check (an all-reduce of one integer) ``--warm`` times on one warm
:class:`RankPool`; (b) starts a new :class:`RankPool` for each of ``--fresh`` checks (spawn,
process-group init, the check, teardown). Prints both medians in milliseconds and their ratio,
against the harness's targets (docs/harness.md): warm overhead under 20 ms per check at world
size 2, and at least 30 times less than a fresh spawn. (c) does (b) with the ranks forked from
one fork server (:mod:`fsdp_conformance.harness.forkserver`, as a ``PoolManager`` starts CPU
pools), after the server's own start, which is timed apart; and prints the CPU-seconds per rank
start both ways (this process's children: the ranks, and the server with the ranks it reaped).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

from fsdp_conformance.harness import RankContext, RankPool, resolve_outcomes
from fsdp_conformance.harness.forkserver import ForkServers

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


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def fresh_times(
    world_size: int, repeats: int, servers: ForkServers | None = None
) -> tuple[list[float], float]:
    """Wall seconds of each fresh pool's start, check and close; and CPU-seconds per rank."""
    times = []
    cpu = _children_cpu_s()
    for _ in range(repeats):
        start = time.perf_counter()
        with RankPool(world_size, fork_servers=servers) as pool:
            run_once(pool)
        times.append(time.perf_counter() - start)
    return times, (_children_cpu_s() - cpu) / (repeats * world_size)


def forked_times(world_size: int, repeats: int) -> tuple[float, list[float], float]:
    """The fork server's start (wall s), then :func:`fresh_times` with ranks forked from it."""
    servers = ForkServers()
    try:
        start = time.perf_counter()
        with RankPool(world_size, fork_servers=servers) as pool:  # starts the server
            run_once(pool)
        server_s = time.perf_counter() - start
        times, _ = fresh_times(world_size, repeats, servers)
    finally:
        cpu = _children_cpu_s()
        servers.close()  # the server's CPU, and its ranks', count once it is reaped
    per_rank = (_children_cpu_s() - cpu) / ((repeats + 1) * world_size)
    return server_s, times, per_rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--warm", type=int, default=200, help="checks on the warm pool")
    parser.add_argument("--fresh", type=int, default=5, help="checks with a fresh spawn each")
    args = parser.parse_args()

    warm_ms = statistics.median(warm_times(args.world_size, args.warm)) * 1e3
    fresh, exec_cpu = fresh_times(args.world_size, args.fresh)
    fresh_ms = statistics.median(fresh) * 1e3
    server_s, forked, fork_cpu = forked_times(args.world_size, args.fresh)
    forked_ms = statistics.median(forked) * 1e3
    ratio = fresh_ms / warm_ms
    print(f"world size {args.world_size}, trivial check (all_reduce of one int)")
    print(f"warm pool:   median {warm_ms:8.2f} ms per check over {args.warm} checks")
    print(
        f"fresh spawn: median {fresh_ms:8.2f} ms per check over {args.fresh} checks "
        f"({exec_cpu:.2f} CPU-s per rank)"
    )
    print(
        f"fresh fork:  median {forked_ms:8.2f} ms per check over {args.fresh} checks "
        f"({fork_cpu:.2f} CPU-s per rank, the server's start included; "
        f"the server took {server_s * 1e3:.0f} ms with its first pool)"
    )
    print(
        f"ratio fresh/warm: {ratio:.0f}x; spawn/fork: {fresh_ms / forked_ms:.1f}x wall, "
        f"{exec_cpu / fork_cpu:.1f}x CPU"
    )
    warm_ok = warm_ms < WARM_TARGET_MS
    ratio_ok = ratio >= RATIO_TARGET
    print(
        f"targets: warm < {WARM_TARGET_MS:g} ms: {'met' if warm_ok else 'MISSED'}; "
        f"ratio >= {RATIO_TARGET:g}x: {'met' if ratio_ok else 'MISSED'}"
    )
    raise SystemExit(0 if warm_ok and ratio_ok else 1)


if __name__ == "__main__":
    main()
