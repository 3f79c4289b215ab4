"""The rank-engine contract: what runs a check on ranks for :class:`~.ranks.Ranks`.

Two engines implement it: :class:`~.manager.PoolManager` (warm pools of rank processes this
process starts) and :class:`~.supervisor.LaunchSupervisor` (this process is one of an external
launch's, torchrun or srun, and supervises its rank's child). The caller that owns an engine
hands it to ``Ranks`` (the plugin's ``ranks`` fixture and ``run_suite`` take their harness
session's); ``Ranks`` describes each check's needs as one :class:`RankRequest`, skips it with
the engine's reason where the engine cannot provide that, and otherwise returns what the
engine's ranks reported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from fsdp_conformance.harness.protocol import RankOutcome


@dataclasses.dataclass(frozen=True)
class RankRequest:
    """What one check asks of the ranks that run it."""

    world_size: int
    #: ``cpu`` (gloo on CPU tensors) or ``gpu`` (one CUDA device per rank).
    lane: str = "cpu"
    backend: str = "gloo"
    #: Seconds the check may take, before an outer ``deadline`` cuts it.
    timeout: float = 120.0
    #: Where ``timeout`` came from, for its message (:func:`.timeouts.scaled_timeout`).
    timeout_note: str = ""
    #: ``time.monotonic()`` by which the check must end (an outer pytest-timeout), and what it is.
    deadline: float | None = None
    deadline_note: str = ""
    #: Ranks started for this check alone (settings read at process start).
    fresh: bool = False
    #: Variables the ranks must have had when their process started (``MALLOC_*``).
    env: Mapping[str, str] | None = None
    #: The CUDA devices the ranks take, rank ``r`` the ``r``-th (a pytest-xdist worker's slice);
    #: None: rank ``r`` on ``cuda:r``. Meaningful to engines that start ranks.
    devices: tuple[int, ...] | None = None

    @property
    def device_type(self) -> str:
        return "cuda" if self.lane == "gpu" else "cpu"


class RankEngine(Protocol):
    """Runs a picklable function on ranks and returns what every rank reported."""

    def cannot_provide(self, request: RankRequest) -> str | None:
        """Why this engine cannot run a check that asks for ``request`` (the check is skipped
        with it, a sentence naming the fix), or None. Under a launch every rank answers alike."""
        ...

    def run_outcomes(
        self,
        request: RankRequest,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> list[RankOutcome]:
        """``fn(ctx, *args, **kwargs)`` on ``request.world_size`` ranks: one outcome per rank,
        by rank. Raises :class:`~.outcomes.HarnessError` where the ranks could not run it."""
        ...


@runtime_checkable
class SharedVerdicts(Protocol):
    """An engine whose every process builds the same report (the launch's supervisors): one of
    them, the leader, judges each check (the verdict is the parent's work, such as a
    single-process reference step) and shares the report entry; the others run their ranks'
    part and take it."""

    @property
    def leads(self) -> bool:
        """Whether this process judges the checks and shares their entries."""
        ...

    def share_entry(self, key: str, entry: Any) -> None:
        """What the leader decided under ``key`` (a check's timeout, its report entry), for
        the others."""
        ...

    def shared_entry(self, key: str, wait: float) -> Any:
        """What the leader shared under ``key``, waited for up to ``wait`` seconds (as long as
        the leader lives); None where nothing came."""
        ...
