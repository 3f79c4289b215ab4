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
- ``init.peak_memory.launch_environment``: on each launched rank, what the launcher says it
  cannot provide (``LauncherRunner.cannot_provide``) for a variable the ranks started with,
  one set after the start, one only rank 1 started with, another value, and fresh ranks.
- ``init.peak_memory.injected_failure``: passes on rank 0 and raises on rank 1.

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


def rank_launch_environment(ctx: Any) -> dict[str, str | None]:
    from fsdp_conformance.harness import LauncherRunner, RankRequest

    launcher = LauncherRunner(ctx.backend)  # the launch's group is up: it is joined, not made
    os.environ["FSDPC_SET_LATE"] = "1"  # set after the start: too late for an allocator
    malloc = "MALLOC_MMAP_THRESHOLD_"
    lane = "gpu" if ctx.device_type == "cuda" else "cpu"

    def needing(env: Mapping[str, str] | None = None, fresh: bool = False) -> str | None:
        request = RankRequest(ctx.world_size, lane=lane, backend=ctx.backend, env=env, fresh=fresh)
        return launcher.cannot_provide(request)

    return {
        "started_with": needing({malloc: os.environ[malloc]}),
        "set_late": needing({"FSDPC_SET_LATE": "1"}),
        "rank1_only": needing({"LOCAL_RANK": "1"}),
        "other_value": needing({malloc: "1"}),
        "fresh": needing(fresh=True),
    }


def verdict_launch_environment(values: Sequence[Any], params: Mapping[str, Any]) -> Verdict:
    return Verdict(True, "what each rank's launcher cannot provide", data={"ranks": list(values)})


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
        "test only: what the launch provides, as each rank sees it",
        rank_launch_environment,
        verdict_launch_environment,
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
