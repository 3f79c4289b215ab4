"""Launched mode: the processes an external launcher started supervise, children run checks.

Under torchrun or srun every launched process is a *supervisor*: it runs no check itself but
starts one child rank (global rank ``RANK`` of ``WORLD_SIZE``, the pool's worker, forked from
a fork server on CPU) and feeds it checks, as a warm pool does. The children of all
supervisors form one process group through the launch's TCP store (torchrun's agent store at
``MASTER_ADDR:MASTER_PORT``, or one that rank 0's supervisor hosts there), each generation of
children under a prefix of its own. The supervisors coordinate each check through the same
store (:class:`CheckExchange`): each publishes its rank's outcome under the check's key and
reads every other rank's, so every node reaches the same verdict. A rank that fails (raises,
dies, hangs) releases the others: they get the pool's grace
(:data:`~.pool.GRACE_AFTER_FAILURE_S`), then their children's stacks are dumped and the
children killed ("still running 3s after rank 1 raised"). After any failure every supervisor
ends its children and the next check starts a new generation. A supervisor whose heartbeat
stops (its node lost) is reported lost, and the checks after that are reported not run.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from fsdp_conformance.harness.engine import RankRequest
from fsdp_conformance.harness.forkserver import ForkServers, fork_available, shared_servers
from fsdp_conformance.harness.launcher import (
    LaunchEnvironment,
    launch_backend,
    launch_environment,
    launch_mismatch,
)
from fsdp_conformance.harness.outcomes import HarnessError
from fsdp_conformance.harness.pool import (
    NCCL_ASYNC_ERROR_HANDLING,
    NCCL_ERROR_HANDLING_VARIABLES,
    HostedRank,
    RankPool,
    prestart_fork_server,
)
from fsdp_conformance.harness.protocol import RankOutcome, function_name
from fsdp_conformance.harness.timeouts import (
    DEFAULT_CHECK_TIMEOUT_S,
    fit_timeout,
    pg_timeout_for,
    seconds,
    start_timeout_for,
)

#: The launch store's keys of this harness begin with this.
STORE_PREFIX = "fsdp-conformance"
#: Seconds between two heartbeats of a supervisor (a counter in the store).
HEARTBEAT_S = 1.0
#: Seconds without a heartbeat after which a supervisor, and its node, count as lost.
LOST_AFTER_S = 20.0
#: Seconds a supervisor waits, past a check's own timeout and start, for the other ranks to
#: publish their outcomes (they may have reached the check later) before it counts the
#: silent ones lost.
EXCHANGE_MARGIN_S = 60.0
#: Seconds between two looks at the store while waiting for the other supervisors.
POLL_S = 0.02
#: Seconds rank 0, where it hosts the store, waits at the end for the others to leave it.
CLOSE_WAIT_S = 30.0
#: Seconds a supervisor waits for the others at the end of a run (the exit codes, the report's
#: path), past which the silent ones count as lost.
END_WAIT_S = 120.0

#: Supervisors made in this process: each takes keys of its own in the launch's store.
_made = 0


def store_client(host: str, port: int, timeout: float, *, host_store: bool = False) -> Any:
    """A ``TCPStore`` on the launch's ``host:port``: a client, or with ``host_store`` the
    server (rank 0 where no agent hosts one; its clients connect later)."""
    import torch.distributed as dist

    options: dict[str, Any] = {}
    if host_store:
        options = {"wait_for_workers": False, "multi_tenant": True}
    return dist.TCPStore(  # type: ignore[attr-defined]
        host, port, is_master=host_store, timeout=timedelta(seconds=timeout), **options
    )


class CheckExchange:
    """One check's outcomes in the launch's store: each rank's under ``check{N}/outcome/{rank}``,
    the first failure under ``check{N}/first``, a count of those published."""

    def __init__(self, store: Any, index: int, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.key = f"check{index}"

    def first_failure(self) -> RankOutcome | None:
        """The first rank that published a failure or skip for this check, or None."""
        first = f"{self.key}/first"
        if not self.store.check([first]):
            return None
        rank, status = self.store.get(first).decode().split(" ", 1)
        return RankOutcome(int(rank), status)

    def publish(self, name: str, outcome: RankOutcome) -> None:
        """This rank's outcome of check ``name``, for every supervisor to read."""
        self.store.set(f"{self.key}/outcome/{self.rank}", pickle.dumps((name, outcome)))
        if not outcome.ok:
            # Only the first failure is kept: every rank released by it names the same one.
            self.store.compare_set(f"{self.key}/first", "", f"{self.rank} {outcome.status}")
        self.store.add(f"{self.key}/published", 1)

    def published(self) -> int:
        return int(self.store.add(f"{self.key}/published", 0))

    def missing(self) -> list[int]:
        return [
            r for r in range(self.world_size) if not self.store.check([f"{self.key}/outcome/{r}"])
        ]

    def read(self, ranks: Sequence[int]) -> dict[int, tuple[str, RankOutcome]]:
        values = self.store.multi_get([f"{self.key}/outcome/{r}" for r in ranks])
        return {r: pickle.loads(bytes(v)) for r, v in zip(ranks, values)}


class Heartbeats:
    """This supervisor's heartbeat (a thread adding to a counter of the store, through a client
    of its own) and what it sees of the others': one whose counter stands still for
    :data:`LOST_AFTER_S` is lost."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self._stop = threading.Event()
        now = time.monotonic()
        self._seen = {r: (-1, now) for r in range(world_size) if r != rank}
        self._looked = 0.0
        self._thread = threading.Thread(target=self._beat, daemon=True, name="fsdpc-heartbeat")
        self._thread.start()

    def _beat(self) -> None:
        while True:
            try:
                self.store.add(f"heartbeat/{self.rank}", 1)
            except Exception:  # noqa: BLE001 - the store is gone: the others see this rank lost
                return
            if self._stop.wait(HEARTBEAT_S):
                return

    def stop(self) -> None:
        self._stop.set()

    def lost(self, among: Sequence[int]) -> dict[int, str]:
        """The ranks of ``among`` whose heartbeat stopped, each with why (looked up at most
        once per heartbeat)."""
        now = time.monotonic()
        if now - self._looked >= HEARTBEAT_S:
            self._looked = now
            for r in among:
                if r == self.rank:
                    continue
                count = int(self.store.add(f"heartbeat/{r}", 0))
                if count != self._seen[r][0]:
                    self._seen[r] = (count, now)
        # Only a supervisor seen beating can stop: one not started yet is not lost (the
        # exchange's own wait bounds that).
        return {
            r: f"no heartbeat from its supervisor for {seconds(now - self._seen[r][1])}"
            for r in among
            if r != self.rank and self._seen[r][0] > 0 and now - self._seen[r][1] > LOST_AFTER_S
        }


class LaunchSupervisor:
    """The :class:`~.engine.RankEngine` of a launched process: checks run in a child rank of
    this process, one per launched process, coordinated with the other supervisors through the
    launch's store (the module's docstring says how)."""

    def __init__(
        self,
        backend: str | None = None,
        *,
        check_timeout: float = DEFAULT_CHECK_TIMEOUT_S,
        environ: Mapping[str, str] | None = None,
        fork_servers: ForkServers | None = None,
    ) -> None:
        launch = launch_environment(environ)
        if launch is None:
            raise HarnessError("LaunchSupervisor outside a launch (no torchrun/srun environment)")
        if launch.master_port is None:
            raise HarnessError(
                f"rank {launch.rank} of the launch has MASTER_ADDR={launch.master_addr} but no "
                "MASTER_PORT: set MASTER_PORT (the port of the launch's store) for every rank"
            )
        self.launch: LaunchEnvironment = launch
        self.rank, self.world_size, self.local_rank = (
            launch.rank,
            launch.world_size,
            launch.local_rank,
        )
        #: The child's CUDA device (None on CPU): LOCAL_RANK modulo the devices it sees.
        self.device_index: int | None
        self.backend, self.device_type, self.device_index = launch_backend(backend, self.local_rank)
        self.check_timeout = check_timeout
        self.pg_timeout = pg_timeout_for(check_timeout)
        self.host = socket.gethostname()
        global _made
        _made += 1
        #: This supervisor's keys in the launch's store.
        self.prefix = f"{STORE_PREFIX}/{launch.run_id}/{_made}"
        #: Whether this process hosts the store (rank 0 where no torchrun agent does).
        self.hosts_store = launch.rank == 0 and not launch.agent_store
        import torch.distributed as dist

        host, port = launch.master_addr, launch.master_port
        self._client = store_client(host, port, self.pg_timeout, host_store=self.hosts_store)
        self.store: Any = dist.PrefixStore(  # type: ignore[attr-defined]
            self.prefix, self._client
        )
        self.store.set(f"host/{self.rank}", self.host)
        self.heartbeats = Heartbeats(
            dist.PrefixStore(  # type: ignore[attr-defined]
                self.prefix, store_client(host, port, self.pg_timeout)
            ),
            self.rank,
            self.world_size,
        )
        self.fork_servers = (
            (shared_servers() if fork_servers is None else fork_servers)
            if self.device_type == "cpu" and fork_available()
            else None
        )
        #: The warm generation of children (none before the first check, after a failure).
        self._warm: RankPool | None = None
        self._checks = 0
        #: Ranks lost for good, each with why.
        self.lost: dict[int, str] = {}
        self.generations_started = 0
        self.prestart_fork_server()

    # -- the engine contract ---------------------------------------------------------------------

    def cannot_provide(self, request: RankRequest) -> str | None:
        """Why a check asking for ``request`` cannot run in this launch, or None.

        A launch has one world size (``WORLD_SIZE``) and one backend on one device type: a gpu
        lane on gloo, or a cpu lane on nccl, would test the wrong thing or crash. Fresh
        processes and a start environment (``MALLOC_MMAP_THRESHOLD_``) it provides: a
        generation of children of their own. The same answer on every rank (no collective).
        """
        return launch_mismatch(request, self.world_size, self.backend)

    def run_outcomes(
        self,
        request: RankRequest,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> list[RankOutcome]:
        """Every rank's outcome of ``fn``: this rank's from its child, the others' from their
        supervisors through the store. Raises :class:`HarnessError` (the check not run) once a
        rank is lost."""
        index = self._checks
        self._checks += 1
        if self.lost:
            raise HarnessError(self.not_run())
        exchange = CheckExchange(self.store, index, self.rank, self.world_size)
        timeout, _ = fit_timeout(request.timeout, request.deadline, request.deadline_note)
        # Each node starts its own ranks, at once with the others: its share of the start.
        start_timeout = start_timeout_for(
            self.launch.local_world_size or self.world_size, self.device_type
        )
        name = function_name(fn)
        mine = self._run_here(request, index, exchange, fn, args, kwargs, start_timeout)
        try:
            exchange.publish(name, mine)
            outcomes = self._gather(exchange, name, timeout + start_timeout + EXCHANGE_MARGIN_S)
        except Exception as exc:  # noqa: BLE001 - the store's host is gone: so is every other rank
            self._end_generation()
            self.lost.update(
                {r: f"the launch's store stopped answering ({exc})" for r in self._others()}
            )
            raise HarnessError(self.not_run()) from None
        if any(o.status not in ("ok", "skip") for o in outcomes):
            self._end_generation()  # every supervisor sees the same outcomes: all end theirs
        return outcomes

    # -- this rank's child -------------------------------------------------------------------------

    def _run_here(
        self,
        request: RankRequest,
        index: int,
        exchange: CheckExchange,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        start_timeout: float,
    ) -> RankOutcome:
        """This rank's outcome of ``fn``, run in its child (a fresh generation of its own for a
        ``fresh`` or ``env`` request, closed after it)."""

        def watch() -> RankOutcome | None:
            first = exchange.first_failure()
            if first is not None and first.rank != self.rank:
                return first
            lost = self.heartbeats.lost(range(self.world_size))
            return RankOutcome(min(lost), "died") if lost else None

        one_off = bool(request.fresh or request.env)
        # A check longer than the warm generation's process group outlasts gets a generation
        # whose group outlasts it, as a pool manager's pools do (every supervisor has the same
        # request, so every one starts it).
        pg_timeout = max(self.pg_timeout, pg_timeout_for(request.timeout))
        try:
            if one_off:
                pool = self._start(index, request.env, start_timeout, watch, pg_timeout)
            else:
                if self._warm is not None and self._warm.pg_timeout < pg_timeout:
                    self._end_generation()
                if self._warm is None:
                    self._warm = self._start(index, None, start_timeout, watch, pg_timeout)
                pool = self._warm
        except Exception as exc:  # noqa: BLE001 - a start that failed (or the store lost)
            return RankOutcome(self.rank, "error", detail=str(exc))
        pool.watch = watch
        try:
            (mine,) = pool.run_outcomes(
                fn,
                args,
                kwargs,
                timeout=request.timeout,
                deadline=request.deadline,
                deadline_note=request.deadline_note,
                timeout_note=request.timeout_note,
            )
        except Exception as exc:  # noqa: BLE001 - an unpicklable check: the same on every rank
            mine = RankOutcome(self.rank, "error", detail=str(exc))
        finally:
            if one_off:
                pool.close(force=pool.broken)
        return mine

    def _start(
        self,
        index: int,
        env: Mapping[str, str] | None,
        start_timeout: float,
        watch: Callable[[], RankOutcome | None],
        pg_timeout: float,
    ) -> RankPool:
        """This rank's child of a new generation, named by the check it starts at (every
        supervisor starts one at the same check: they decide alike, from the same outcomes)."""
        hosted = self.hosted_rank(index)
        self.generations_started += 1
        return RankPool(
            self.world_size,
            self.backend,
            self.device_type,
            env=self.child_environment(env),
            start_timeout=start_timeout,
            pg_timeout=pg_timeout,
            fork_servers=self.fork_servers,
            hosted=hosted,
            watch=watch,
        )

    def hosted_rank(self, index: int) -> HostedRank:
        """This rank as the child of the generation that starts at check ``index`` hosts it."""
        return HostedRank(
            rank=self.rank,
            local_rank=self.local_rank,
            local_world_size=self.launch.local_world_size or self.world_size,
            device_index=self.device_index,
            store_host=self.launch.master_addr,
            store_port=int(self.launch.master_port or 0),
            store_prefix=f"{self.prefix}/generation{index}",
        )

    def child_environment(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """What the child starts with besides this process's environment: ``env`` (a check's
        ``MALLOC_*``) and, on NCCL, the pools' ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` in place of
        torchrun's (torchrun sets 1, which takes the process down, for every rank; 2 has a
        failed collective raise as the check's error)."""
        extra = dict(env or {})
        torchrun_default = os.environ.get(NCCL_ERROR_HANDLING_VARIABLES[0]) == "1"
        if self.backend == "nccl" and (self.launch.agent_store and torchrun_default):
            extra.setdefault(NCCL_ERROR_HANDLING_VARIABLES[0], NCCL_ASYNC_ERROR_HANDLING)
        return extra

    def prestart_fork_server(self, env: Mapping[str, str] | None = None) -> bool:
        """Start the fork server of children started with ``env`` added, without waiting for
        it (CPU only)."""
        if self.fork_servers is None:
            return False
        return prestart_fork_server(self.fork_servers, self.child_environment(env))

    def _end_generation(self) -> None:
        warm, self._warm = self._warm, None
        if warm is not None:
            warm.close(force=True)

    # -- the other supervisors ---------------------------------------------------------------------

    def _others(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank and r not in self.lost]

    def _gather(self, exchange: CheckExchange, name: str, wait_s: float) -> list[RankOutcome]:
        """Every rank's outcome by rank, once every rank published (a lost one's made here)."""
        deadline = time.monotonic() + wait_s
        lost: dict[int, str] = {}
        while exchange.published() < self.world_size:
            missing = exchange.missing()
            lost = self.heartbeats.lost(missing)
            if time.monotonic() > deadline:
                lost.update(
                    {
                        r: f"no outcome {seconds(wait_s)} after this rank's (its supervisor "
                        "fell out of step with the others)"
                        for r in missing
                        if r not in lost
                    }
                )
            if lost and set(lost) >= set(missing):
                break
            time.sleep(POLL_S)
        got = exchange.read([r for r in range(self.world_size) if r not in lost])
        names = {check for check, _ in got.values()}
        outcomes = {r: outcome for r, (_, outcome) in got.items()}
        for r, why in lost.items():
            self.lost[r] = why
            outcomes[r] = RankOutcome(
                r,
                "silent",
                detail=f"rank {r} (on {self._host_of(r)}) was lost: {why}; its node is gone "
                "for good, so the launch runs no more checks",
            )
        if len(names) > 1:  # supervisors out of step: every rank's outcome is void
            detail = "the ranks ran different checks: " + ", ".join(
                f"rank {r} {check}" for r, (check, _) in sorted(got.items())
            )
            return [RankOutcome(r, "error", detail=detail) for r in range(self.world_size)]
        return [outcomes[r] for r in range(self.world_size)]

    def _host_of(self, rank: int) -> str:
        with contextlib.suppress(Exception):
            key = f"host/{rank}"
            if self.store.check([key]):
                return str(self.store.get(key).decode())
        return "an unknown host"

    def hosts(self) -> dict[int, str]:
        """Each rank's host, by rank (as its supervisor published it at its start)."""
        return {r: self._host_of(r) for r in range(self.world_size)}

    def not_run(self) -> str:
        """Why a check after a lost rank does not run."""
        lost = ", ".join(f"rank {r} ({why})" for r, why in sorted(self.lost.items()))
        return (
            f"not run: the launch lost {lost}; a launch cannot run checks without all of its "
            f"{self.world_size} ranks (start it again)"
        )

    @property
    def leads(self) -> bool:
        """Rank 0's supervisor judges each check of a run; the others take its entries
        (:class:`~.engine.SharedVerdicts`)."""
        return self.rank == 0

    def share_entry(self, key: str, entry: Any) -> None:
        with contextlib.suppress(Exception):  # the store's host lost: the others are too
            self.store.set(f"entry/{key}", pickle.dumps(entry))

    def shared_entry(self, key: str, wait: float) -> Any:
        stored = f"entry/{key}"
        deadline = time.monotonic() + wait
        with contextlib.suppress(Exception):
            while time.monotonic() < deadline and 0 not in self.lost:
                if self.store.check([stored]):
                    return pickle.loads(bytes(self.store.get(stored)))
                self.lost.update(self.heartbeats.lost([0]))
                time.sleep(POLL_S)
        return None

    def share(self, name: str, value: str) -> None:
        """Publish ``value`` under ``name`` for the other supervisors (:meth:`shared`)."""
        with contextlib.suppress(Exception):  # the store's host lost: the others are too
            self.store.set(f"shared/{name}", value)

    def shared(self, name: str, timeout: float = END_WAIT_S) -> str | None:
        """What a supervisor published under ``name``, waited for up to ``timeout`` seconds;
        None if nothing came."""
        key = f"shared/{name}"
        deadline = time.monotonic() + timeout
        with contextlib.suppress(Exception):
            while time.monotonic() < deadline:
                if self.store.check([key]):
                    return str(self.store.get(key).decode())
                time.sleep(POLL_S * 4)
        return None

    def exit_codes(self, code: int) -> dict[int, int]:
        """Every rank's exit code by rank, this rank's being ``code`` (lost ranks left out):
        each supervisor publishes its own and waits for the others'."""
        try:
            self.store.set(f"exit/{self.rank}", str(code))
            deadline = time.monotonic() + END_WAIT_S
            while True:
                waiting = [r for r in self._others() if not self.store.check([f"exit/{r}"])]
                if not waiting:
                    break
                gone = self.heartbeats.lost(waiting)
                if time.monotonic() > deadline:
                    gone.update({r: "no exit code at the end of the run" for r in waiting})
                self.lost.update(gone)
                if set(gone) >= set(waiting):
                    break
                time.sleep(POLL_S)
            ranks = [r for r in range(self.world_size) if r not in self.lost]
            values = self.store.multi_get([f"exit/{r}" for r in ranks])
            return {r: int(bytes(v).decode()) for r, v in zip(ranks, values)}
        except Exception:  # noqa: BLE001 - the store's host is gone: this rank's code stands
            return {self.rank: code}

    def close(self, force: bool = False) -> None:
        """End this rank's children and the heartbeat; rank 0, where it hosts the store, waits
        for the other supervisors to leave it first."""
        self._end_generation()
        self.heartbeats.stop()
        with contextlib.suppress(Exception):
            self.store.add("closed", 1)
            if self.hosts_store and not force:
                deadline = time.monotonic() + CLOSE_WAIT_S
                while time.monotonic() < deadline:
                    gone = set(self.lost) | set(self.heartbeats.lost(self._others()))
                    if int(self.store.add("closed", 0)) >= self.world_size - len(gone):
                        break
                    time.sleep(POLL_S)
