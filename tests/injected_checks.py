"""Test-only checks that ``fsdp-conformance run`` subprocesses get through a ``sitecustomize``.

``tests/test_launcher.py`` and ``tests/test_signals.py`` test what a run does around its
checks (the launch, the signal, the exit code), not what a check proves, so they run these
instead of real checks. :func:`site_path` writes a folder whose ``sitecustomize.py`` adds
:data:`CHECKS` to ``fsdp_conformance.claims.all_checks()`` in every process started with that
folder (and this one's) on ``PYTHONPATH``; ``--checks NAME`` selects one of them.

- ``test.blocks_until_signalled``: each rank writes ``rank{N}.in_check`` in its working
  directory (the run's), then sleeps. A test waits for both files and only then signals, so
  the signal always finds every rank inside the check: the run cannot end first, however
  loaded the machine.
- ``init.peak_memory.launch_environment``: asks for a variable at its ranks' start
  (``Check.env``) and returns, on each rank, what its process started with and whether it
  is a launched process itself (the launcher's ``RANK``) or a supervisor's child.
- ``init.peak_memory.injected_failure``: passes on rank 0 and raises on rank 1.
- ``test.hang.*``, ``test.dies.*``, ``test.lost.*`` (``tests/test_launch_nodes.py``): rank 1
  never returns, is killed mid-check, or waits while the test takes its node away; each is
  followed by an all-reduce that must still run (or, after a lost node, not).
  ``test.all_reduce``: an all-reduce of every rank.

The last two extend the name ``init.peak_memory`` so that ``--checks init.peak_memory``
selects them with the two real checks of that name: one launch (with the allocator setting)
shows those checks running, the launch's environment as its ranks see it, and a failure on
rank 1 only.

Importing this module imports neither torch nor a claim module (the ``sitecustomize`` also
runs in torchrun's own process).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fsdp_conformance.claims.check import Check, Verdict

BLOCKING = "test.blocks_until_signalled"
LAUNCH_ENVIRONMENT = "init.peak_memory.launch_environment"
FAILING_ON_RANK1 = "init.peak_memory.injected_failure"
#: Selected together by ``--checks test.hang``, ``test.dies``, ``test.lost``: the fault, then a
#: check that must still run (on a new generation of ranks, or not at all after a lost node).
HANG_ON_RANK1 = "test.hang.on_rank1"
HANG_THEN = "test.hang.then_all_reduce"
DIES_ON_RANK1 = "test.dies.on_rank1"
DIES_THEN = "test.dies.then_all_reduce"
NODE_LOST = "test.lost.node_of_rank1"
NODE_LOST_THEN = "test.lost.then_all_reduce"
ALL_REDUCE = "test.all_reduce"
#: How long a blocked rank sleeps: far past any test's guard (the signal ends it first).
BLOCK_S = 600.0

SITECUSTOMIZE = """
import injected_checks

injected_checks.register()
"""


def marker(directory: Path, rank: int) -> Path:
    """The file rank ``rank`` writes once it is inside ``test.blocks_until_signalled``."""
    return directory / f"rank{rank}.in_check"


def rank_blocks_until_signalled(ctx: Any) -> None:
    marker(Path.cwd(), ctx.rank).write_text(str(os.getpid()))
    time.sleep(BLOCK_S)


#: The variable :data:`LAUNCH_ENVIRONMENT` asks its ranks to start with (its ``Check.env``).
AT_START = "FSDPC_AT_START"


def rank_launch_environment(ctx: Any) -> dict[str, Any]:
    """What this rank's process started with (``/proc/self/environ``), and whether it is a
    launched process itself (it has the launcher's ``RANK``) or the child of one."""
    from fsdp_conformance.harness import startup_environ

    started = startup_environ()
    return {
        "rank": ctx.rank,
        "pid": os.getpid(),
        "at_start": started.get(AT_START),
        "launched_rank_variable": started.get("RANK"),
    }


def verdict_launch_environment(values: Sequence[Any], params: Mapping[str, Any]) -> Verdict:
    return Verdict(True, "what each rank's launcher cannot provide", data={"ranks": list(values)})


def rank_hangs_on_rank1(ctx: Any) -> int:
    """Rank 1 never returns; the others wait for it in a barrier."""
    import torch.distributed as dist

    if ctx.rank == 1:
        marker(Path.cwd(), ctx.rank).write_text(str(os.getpid()))
        time.sleep(BLOCK_S)
    dist.barrier()
    return ctx.rank


def rank_dies_on_rank1(ctx: Any) -> int:
    """Rank 1's process is killed (SIGKILL) mid-check; the others wait for it in a barrier."""
    import signal

    import torch.distributed as dist

    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return ctx.rank


def rank_sum(ctx: Any) -> int:
    """The sum of every rank's ``rank + 1`` (an all-reduce): the ranks are one group."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([ctx.rank + 1])
    dist.all_reduce(t)
    return int(t.item())


def verdict_rank_sum(values: Sequence[Any], params: Mapping[str, Any]) -> Verdict:
    n = len(values)
    return Verdict(
        list(values) == [n * (n + 1) // 2] * n, f"all-reduce of rank + 1: {list(values)}"
    )


def rank_waits_on_rank1(ctx: Any) -> int:
    """Every rank writes its marker (its pid); rank 1 then sleeps (its node is taken away by
    the test), the others wait for it in a barrier."""
    import torch.distributed as dist

    marker(Path.cwd(), ctx.rank).write_text(str(os.getpid()))
    if ctx.rank == 1:
        time.sleep(BLOCK_S)
    dist.barrier()
    return ctx.rank


def rank_fails_on_rank1(ctx: Any) -> int:
    if ctx.rank == 1:
        raise RuntimeError(f"failure injected on rank {ctx.rank}")
    return ctx.rank


def verdict_passes(values: Sequence[Any], params: Mapping[str, Any]) -> Verdict:
    return Verdict(True, f"every rank returned: {list(values)}")


CHECKS = (
    Check(
        BLOCKING,
        "test only: every rank waits in the check until the run is signalled",
        rank_blocks_until_signalled,
        verdict_passes,
        lanes=("cpu",),
    ),
    Check(
        LAUNCH_ENVIRONMENT,
        "test only: the environment each rank's process started with",
        rank_launch_environment,
        verdict_launch_environment,
        lanes=("cpu",),
        env={AT_START: "1"},
    ),
    Check(
        HANG_ON_RANK1,
        "test only: rank 1 never returns, the others wait in a barrier",
        rank_hangs_on_rank1,
        verdict_passes,
        lanes=("cpu",),
    ),
    Check(
        HANG_THEN,
        "test only: an all-reduce after the hang",
        rank_sum,
        verdict_rank_sum,
        lanes=("cpu",),
    ),
    Check(
        DIES_ON_RANK1,
        "test only: rank 1's process is killed mid-check",
        rank_dies_on_rank1,
        verdict_passes,
        lanes=("cpu",),
    ),
    Check(
        DIES_THEN,
        "test only: an all-reduce after the death",
        rank_sum,
        verdict_rank_sum,
        lanes=("cpu",),
    ),
    Check(
        ALL_REDUCE,
        "test only: an all-reduce of every rank",
        rank_sum,
        verdict_rank_sum,
        lanes=("cpu",),
    ),
    Check(
        NODE_LOST,
        "test only: rank 1 waits until the test takes its node away",
        rank_waits_on_rank1,
        verdict_passes,
        lanes=("cpu",),
    ),
    Check(
        NODE_LOST_THEN,
        "test only: an all-reduce after the lost node",
        rank_sum,
        verdict_rank_sum,
        lanes=("cpu",),
    ),
    Check(
        FAILING_ON_RANK1,
        "test only: passes on rank 0, raises on rank 1",
        rank_fails_on_rank1,
        verdict_passes,
        lanes=("cpu",),
    ),
)


def register() -> None:
    """Make ``all_checks()`` end with :data:`CHECKS` (before the CLI imports it)."""
    from fsdp_conformance import claims

    real = claims.all_checks

    def all_checks() -> list[Check]:
        return [*real(), *CHECKS]

    claims.all_checks = all_checks


def site_path(directory: Path) -> list[str]:
    """``PYTHONPATH`` entries that add :data:`CHECKS` to a run: a ``sitecustomize.py`` written
    in ``directory / "site"``, and this module's folder."""
    site = directory / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return [str(site), str(Path(__file__).resolve().parent)]


#: The message of :func:`rank_raises_unrelated`'s error.
UNRELATED = "an input the check was not written for (injected)"


def rank_raises_unrelated(ctx: Any, **params: Any) -> None:
    """A rank function that raises an error unrelated to any torch defect, on every rank; put in
    place of a real check's (``dataclasses.replace``) that an expectation covers."""
    raise ValueError(UNRELATED)


def verdict_fails_unrelated(values: Sequence[Any], params: Mapping[str, Any]) -> Verdict:
    """A verdict that fails for a cause no expectation describes."""
    return Verdict(False, "a failure of another cause (injected)")
