"""The rank harness: run a picklable check function on N ranks and get back each rank's value.

Two engines implement one contract (:class:`RankEngine`, :mod:`.engine`: whether they can
provide what a check asks for, a :class:`RankRequest`, and every rank's outcome of running it);
:class:`Ranks` (``run(fn, *args, **kwargs) -> list[value per rank]``) runs checks on whichever
its caller hands it:

* :class:`PoolManager` (the single-machine default, :mod:`.manager`): warm pools
  (:class:`RankPool`, :mod:`.pool`) of N worker processes that stay warm across checks,
  rendezvous through a ``FileStore`` in a private temporary folder (no TCP port, so parallel
  sessions and ``pytest -n`` workers never collide), and talk to the parent over a unix socket
  in that same folder.
* :class:`LaunchSupervisor` (:mod:`.supervisor`): the processes were started by an external
  launcher (``torchrun``, ``srun``, one node or many); each supervises one child rank (the
  pool's worker) and the supervisors exchange every rank's outcome through the launch's store,
  so every node sees the same verdict and a failing, hanging or dying rank costs one check.

Outcomes come from what each rank reports, never from exit codes alone: a rank that dies before
reporting is a failure even if the others passed, and gloo's occasional abort at process exit
*after* every rank reported (docs/harness.md, "Gloo's abort at exit") does not turn a pass into
a failure.

The folder: :mod:`.protocol` (what both sides share; imports nothing from the package),
:mod:`.engine` (the engines' contract), :mod:`.outcomes` (rank outcomes to one result),
:mod:`.timeouts` (start, check and process group timeouts), :mod:`.pool` (the warm pool of
ranks), :mod:`.manager` (the pools by world size), :mod:`.forkserver`, :mod:`.launcher`,
:mod:`.supervisor` (launched mode), :mod:`.ranks` (the ``ranks`` fixture's object) and
:mod:`.session` (one run's lifecycle: signals, fork servers, pools, the launch) on the
parent's side; :mod:`.worker` and
:mod:`.clean_state` on the rank's side, importing only :mod:`.protocol`; :mod:`.interrupts`
(SIGINT/SIGTERM). This module re-exports the public names, so
``from fsdp_conformance.harness import Ranks`` is the way to use them; the CLI and the pytest
plugin reach the harness only through them (a :class:`HarnessSession` each).
"""

from __future__ import annotations

from fsdp_conformance.harness.engine import RankEngine, RankRequest, SharedVerdicts
from fsdp_conformance.harness.launcher import launched_externally, startup_environ
from fsdp_conformance.harness.manager import PoolManager
from fsdp_conformance.harness.outcomes import (
    HarnessError,
    RankFailure,
    describe_exit,
    format_failure,
    resolve_outcomes,
)
from fsdp_conformance.harness.pool import (
    GRACE_AFTER_FAILURE_S,
    GRACE_AFTER_SKIP_S,
    LOG_TAIL_LINES,
    STACK_DUMP_WAIT_S,
    RankPool,
    close_all_pools,
    log,
)
from fsdp_conformance.harness.protocol import (
    CheckSkipped,
    RankContext,
    RankOutcome,
    all_gather_objects,
    skip_rank,
    traceback_text,
)
from fsdp_conformance.harness.ranks import (
    GpuShare,
    Ranks,
    cuda_device_count,
    lane_unavailable,
    xdist_share,
)
from fsdp_conformance.harness.session import HarnessSession
from fsdp_conformance.harness.supervisor import LaunchSupervisor
from fsdp_conformance.harness.timeouts import (
    OUTER_TIMEOUT_RESERVE_S,
    fit_timeout,
    outer_deadline,
    scaled_timeout,
)

__all__ = [
    "GRACE_AFTER_FAILURE_S",
    "GRACE_AFTER_SKIP_S",
    "LOG_TAIL_LINES",
    "OUTER_TIMEOUT_RESERVE_S",
    "STACK_DUMP_WAIT_S",
    "CheckSkipped",
    "GpuShare",
    "HarnessError",
    "HarnessSession",
    "LaunchSupervisor",
    "PoolManager",
    "RankContext",
    "RankEngine",
    "RankFailure",
    "RankOutcome",
    "RankPool",
    "RankRequest",
    "SharedVerdicts",
    "Ranks",
    "all_gather_objects",
    "close_all_pools",
    "cuda_device_count",
    "describe_exit",
    "fit_timeout",
    "format_failure",
    "lane_unavailable",
    "launched_externally",
    "log",
    "outer_deadline",
    "resolve_outcomes",
    "scaled_timeout",
    "skip_rank",
    "startup_environ",
    "traceback_text",
    "xdist_share",
]

# Users catch and read these by this name (pytest prints "fsdp_conformance.harness.RankFailure",
# as docs/harness.md shows), whichever of the package's modules defines them.
for _exception in (CheckSkipped, HarnessError, RankFailure):
    _exception.__module__ = __name__
del _exception
