"""The manager of warm pools: one :class:`~.pool.RankPool` per world size, backend and devices.

It starts a pool when a check needs one, keeps it warm for the next check of the same key, and
replaces it after any failure (a broken pool's ranks are in an unknown state) or when a check
needs a process group that outlasts a longer timeout. Checks that need fresh processes get a
pool of their own, closed after the check.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict

from fsdp_conformance.harness.engine import RankRequest
from fsdp_conformance.harness.forkserver import ForkServers, shared_servers
from fsdp_conformance.harness.outcomes import HarnessError
from fsdp_conformance.harness.pool import RankPool, prestart_fork_server
from fsdp_conformance.harness.protocol import RankOutcome
from fsdp_conformance.harness.timeouts import (
    DEFAULT_CHECK_TIMEOUT_S,
    fit_timeout,
    pg_timeout_for,
    seconds,
    start_timeout_for,
)


class PoolManager:
    """One warm pool per (world size, backend, device type), rebuilt after any failure.

    ``check_timeout``: the session's check timeout (``Settings.timeout``, which the harness
    session passes). The process groups of this manager's pools time out
    :data:`.timeouts.PG_TIMEOUT_MARGIN_S` after it (:func:`.timeouts.pg_timeout_for`), so the
    harness, not a watchdog, stops a stuck check.
    Each check's own timeout counts too (``run_suite``'s checks carry the run's, a test's
    ``ranks.configured(timeout=...)`` its own): a check longer than a warm pool's process
    group gets a new pool whose group outlasts it. A pool gets
    :func:`.timeouts.start_timeout_for` its world size and device to start, cut to an outer
    deadline.
    """

    def __init__(
        self,
        *,
        check_timeout: float = DEFAULT_CHECK_TIMEOUT_S,
        fork_servers: ForkServers | None = None,
    ) -> None:
        self._pools: dict[tuple[int, str, str, tuple[int, ...] | None], RankPool] = {}
        self.check_timeout = check_timeout
        #: The process-group timeout of this manager's pools (longer for a longer check).
        self.pg_timeout = pg_timeout_for(check_timeout)
        self.pools_started = 0
        #: Where this manager's CPU ranks are forked from (:mod:`.forkserver`): the process's
        #: servers, shared with every other manager, unless given a registry of its own.
        self.fork_servers = shared_servers() if fork_servers is None else fork_servers

    def prestart_fork_server(self, env: Mapping[str, str] | None = None) -> bool:
        """Start the fork server this manager's CPU ranks started with ``env`` added will fork
        from, without waiting for it (:func:`.pool.prestart_fork_server`); False where ranks are
        not forked."""
        return prestart_fork_server(self.fork_servers, env)

    def pg_timeout_for(self, timeout: float) -> float:
        """The process-group timeout for a check of ``timeout`` seconds on this manager."""
        return max(self.pg_timeout, pg_timeout_for(timeout))

    def pool(
        self,
        world_size: int,
        backend: str,
        device_type: str,
        *,
        start_timeout: float | None = None,
        pg_timeout: float | None = None,
        devices: Sequence[int] | None = None,
    ) -> RankPool:
        """The warm pool of this key, started (or restarted) when it is missing, broken, dead
        or its process group's timeout is shorter than ``pg_timeout``. ``devices``: its CUDA
        ranks' devices (:class:`RankPool`); pools on other devices are other pools."""
        key = _pool_key(world_size, backend, device_type, devices)
        needed = self.pg_timeout if pg_timeout is None else pg_timeout
        pool = self._pools.get(key)
        if pool is not None and (pool.broken or not pool.alive or pool.pg_timeout < needed):
            pool.close(force=True)
            pool = None
        if pool is None:
            pool = RankPool(
                world_size,
                backend,
                device_type,
                pg_timeout=needed,
                start_timeout=start_timeout,
                fork_servers=self.fork_servers,
                **_devices_option(devices),
            )
            self.pools_started += 1
            self._pools[key] = pool
        return pool

    def cannot_provide(self, request: RankRequest) -> str | None:
        """None: a manager starts ranks of any world size, backend, devices and start
        environment (whether the lane's devices exist is :func:`.ranks.lane_unavailable`'s)."""
        return None

    def run_outcomes(
        self,
        request: RankRequest,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> list[RankOutcome]:
        """``fn`` on the warm pool of the request's world size, backend and devices (a pool of
        its own, closed after it, for ``fresh`` or ``env``). ``request.devices``: the CUDA
        ranks' devices, rank ``r`` on ``devices[r]`` (the caller's slice of the machine:
        :func:`.ranks.pool_devices`); None: rank ``r`` on ``cuda:r``."""
        world_size, backend, device_type = request.world_size, request.backend, request.device_type
        devices, deadline, deadline_note = request.devices, request.deadline, request.deadline_note
        # Starting ranks counts against an outer deadline too: a pool that cannot start in
        # time is a HarnessError naming each rank's state, not pytest-timeout's bare Timeout.
        start_timeout, cut = fit_timeout(start_timeout_for(world_size, device_type), deadline)
        pg_timeout = self.pg_timeout_for(request.timeout)

        def run(pool: RankPool) -> list[RankOutcome]:
            return pool.run_outcomes(
                fn,
                args,
                kwargs,
                timeout=request.timeout,
                deadline=deadline,
                deadline_note=deadline_note,
                timeout_note=request.timeout_note,
            )

        if request.fresh or request.env:
            # Fresh processes: for settings that must exist before the process starts
            # (allocator variables such as MALLOC_MMAP_THRESHOLD_).
            pool = self._start_in_time(
                lambda: RankPool(
                    world_size,
                    backend,
                    device_type,
                    env=request.env,
                    pg_timeout=pg_timeout,
                    start_timeout=start_timeout,
                    fork_servers=self.fork_servers,
                    **_devices_option(devices),
                ),
                start_timeout,
                bool(cut),
                deadline_note,
            )
            self.pools_started += 1
            try:
                return run(pool)
            finally:
                pool.close(force=pool.broken)
        pool = self._start_in_time(
            lambda: self.pool(
                world_size,
                backend,
                device_type,
                start_timeout=start_timeout,
                pg_timeout=pg_timeout,
                devices=devices,
            ),
            start_timeout,
            bool(cut),
            deadline_note,
        )
        outcomes = run(pool)
        if pool.broken:
            pool.close(force=True)
            self._pools.pop(_pool_key(world_size, backend, device_type, devices), None)
        return outcomes

    @staticmethod
    def _start_in_time(
        start: Callable[[], RankPool], start_timeout: float, cut: bool, deadline_note: str
    ) -> RankPool:
        try:
            return start()
        except HarnessError as exc:
            if not cut or "timed out" not in str(exc):
                raise
            raise HarnessError(
                f"{exc}\n(the ranks had {seconds(start_timeout)} to start, the rest of "
                f"{deadline_note})"
            ) from None

    def close(self, force: bool = False) -> None:
        """Close every pool; ``force`` kills the ranks at once (on an interrupt).

        The fork servers stay: they are the process's (:func:`.forkserver.end_session` and
        interpreter exit close them), and other managers may be forking from them."""
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            pool.close(force=force or pool.broken)


def _pool_key(
    world_size: int, backend: str, device_type: str, devices: Sequence[int] | None
) -> tuple[int, str, str, tuple[int, ...] | None]:
    return (
        world_size,
        backend,
        device_type,
        None if devices is None or device_type != "cuda" else tuple(devices),
    )


class _DevicesOption(TypedDict, total=False):
    devices: tuple[int, ...]


def _devices_option(devices: Sequence[int] | None) -> _DevicesOption:
    """``RankPool``'s ``devices`` argument, given only where there are devices to give (a
    pool on every device is started as before)."""
    return {} if devices is None else {"devices": tuple(devices)}
