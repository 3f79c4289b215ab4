"""The warm pool: N rank processes started once, fed checks one at a time, killed on failure.

The ranks rendezvous through a ``FileStore`` in a private temporary folder (no TCP port, so
parallel sessions and ``pytest -n`` workers never collide), and talk to the parent over a unix
socket in that same folder. Each rank runs :mod:`fsdp_conformance.harness.worker`, started by
its module name only: the pool never imports the worker.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, Listener, wait
from typing import Any

from fsdp_conformance.harness import protocol
from fsdp_conformance.harness.forkserver import (
    ForkedProcess,
    ForkServers,
    close_all_servers,
    fork_available,
    shared_servers,
)
from fsdp_conformance.harness.outcomes import (
    STATUS_TITLE,
    HarnessError,
    crash_site,
    describe_exit,
)
from fsdp_conformance.harness.protocol import RankOutcome, function_name
from fsdp_conformance.harness.timeouts import (
    PG_TIMEOUT_MIN_S,
    fit_timeout,
    seconds,
    start_timeout_for,
)

#: The harness's one logger; named explicitly, because users configure it by this name.
log = logging.getLogger("fsdp_conformance.harness")

#: Seconds to wait for the other ranks to report once one rank has died or failed.
GRACE_AFTER_FAILURE_S = 3.0
#: Seconds to wait for the other ranks once one rank skipped: ranks that skip alike reach the
#: skip at about the same point; one still running after this waits on the skipper (a
#: collective it will never join) or disagrees with it.
GRACE_AFTER_SKIP_S = 5.0
#: Seconds to let faulthandler write its stack dumps before the ranks are killed.
STACK_DUMP_WAIT_S = 0.5
#: Seconds between two looks at the other nodes' ranks (:data:`PeerWatch`) while a hosted
#: rank starts or runs a check.
WATCH_INTERVAL_S = 0.1
#: Lines of a rank's own log shown in a failure report.
LOG_TAIL_LINES = 25
#: The longest path a unix socket may have (``sun_path`` holds 108 bytes with the final NUL).
UNIX_PATH_MAX = 107
#: Lines of a dead rank's log searched for the stack of its crash (faulthandler's dump of every
#: thread, the crashed one first, can be longer than the tail shown).
CRASH_LOG_LINES = 2000

#: A rank's process: started with ``exec``, or forked by a fork server (the same interface).
RankProcess = subprocess.Popen[bytes] | ForkedProcess


#: The variables torch reads for NCCL's asynchronous error handling (the first is current).
NCCL_ERROR_HANDLING_VARIABLES = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
#: NCCL pools' error handling, unless the user set one: 2 (``CleanUpOnly``) aborts the
#: communicators of a failed or timed-out collective and leaves the process alive, so the
#: rank's waiting collective raises and the rank reports that as the check's error, with its
#: traceback. torch's default (3, ``SkipCleanUp``) and 1 (``TearDown``) take the process down
#: instead (the rank "died", without a Python traceback); 0 leaves it hanging.
NCCL_ASYNC_ERROR_HANDLING = "2"


def rank_environment(
    extra_env: Mapping[str, str] | None = None, backend: str = "gloo"
) -> dict[str, str]:
    """The environment a pool's ranks start with: this process's, plus ``extra_env``.

    ``backend="nccl"`` adds ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (:data:`NCCL_ASYNC_ERROR_HANDLING`)
    where neither this process nor ``extra_env`` sets it (or its older name).
    """
    env = dict(os.environ)
    env.update(extra_env or {})
    if backend == "nccl" and not any(name in env for name in NCCL_ERROR_HANDLING_VARIABLES):
        env[NCCL_ERROR_HANDLING_VARIABLES[0]] = NCCL_ASYNC_ERROR_HANDLING
    # Checks are pickled by reference: the ranks must import what the parent imports.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("RANK", None)  # never let a stray launcher variable confuse the ranks
    env.pop("WORLD_SIZE", None)
    env.pop("LOCAL_RANK", None)
    return env


def control_address(folder: str) -> str:
    """The unix socket the ranks connect to: ``ctl.sock`` in the pool's private ``folder``.

    A socket's path has at most :data:`UNIX_PATH_MAX` bytes, and a deep ``TMPDIR`` (a test's
    temporary folder under pytest-xdist, a CI workspace) goes past it. There, on Linux, the
    socket gets a random name in the abstract namespace instead (no file; the authkey still
    guards it, as it guards the path); elsewhere the error names the variable to shorten.
    """
    path = os.path.join(folder, "ctl.sock")
    size = len(os.fsencode(path))
    if size <= UNIX_PATH_MAX:
        return path
    if sys.platform.startswith("linux"):
        return f"\0fsdp-conformance-{os.getpid()}-{secrets.token_hex(8)}"
    raise HarnessError(
        f"the ranks' control socket {path!r} is {size} bytes long, over the {UNIX_PATH_MAX} a "
        f"unix socket allows: set TMPDIR to a shorter folder (the pool's folder is made there)"
    )


def rank_threads(world_size: int, env: Mapping[str, str]) -> int:
    """Intra-op threads for each of a pool's ranks started with ``env``: its
    ``OMP_NUM_THREADS`` where set (the user's choice), else this machine's usable cores shared
    out among the ``world_size`` ranks, at least one each.

    Why: torch starts every process with a thread per core, so N ranks on one machine run N
    times as many compute threads as there are cores, spinning against each other; torchrun
    sets ``OMP_NUM_THREADS=1`` for several processes per node for the same reason. The rank
    sets the count itself (``torch.set_num_threads``), because a rank forked from a fork server
    has torch imported already and never reads the variable. Measured on 2 cores,
    ``fsdp-conformance run`` at world size 2: 97.6 CPU-seconds in 57.5 s wall with a thread
    per core in each rank, 77.3 in 45.6 s with the share (docs/harness.md, "Rank threads").
    """
    chosen = env.get("OMP_NUM_THREADS", "").strip()
    if chosen.isdigit() and int(chosen) > 0:
        return int(chosen)
    from fsdp_conformance.settings import usable_cores

    return max(1, usable_cores() // max(1, world_size))


def prestart_fork_server(
    fork_servers: ForkServers | None = None, env: Mapping[str, str] | None = None
) -> bool:
    """Start the fork server of this process's CPU pools (started with ``env`` added, as a
    check's fresh ranks are) now, without waiting for it.

    Its imports (torch and FSDP: seconds of CPU) then run on another core while this process
    does other work; the first CPU pool forks from it once it is ready (the server is keyed by
    :func:`rank_environment`, as the pool's will be, unless the environment changes before).
    Returns False where ranks are not forked (no fork server on this platform).
    """
    if not fork_available():
        return False
    servers = shared_servers() if fork_servers is None else fork_servers
    servers.server(rank_environment(env))
    return True


@dataclasses.dataclass(frozen=True)
class HostedRank:
    """The one rank a pool hosts of a world whose other ranks run elsewhere: the child of one
    supervisor of an external launch (:mod:`.supervisor`). It rendezvouses through the
    launch's TCP store under ``store_prefix`` (a fresh prefix per generation), not a
    ``FileStore`` in the pool's folder."""

    rank: int
    local_rank: int
    #: The ranks of the launch on this node (how many share its cores, :func:`rank_threads`).
    local_world_size: int
    #: Its CUDA device (None on CPU).
    device_index: int | None
    store_host: str
    store_port: int
    store_prefix: str


#: Asked while a pool starts or waits for its ranks: what another node's rank reported that
#: releases this pool's ranks early (its failure or skip), or None.
PeerWatch = Callable[[], RankOutcome | None]


@dataclasses.dataclass
class _Rank:
    rank: int
    proc: RankProcess
    conn: Connection
    log_path: str
    stacks_path: str


class RankPool:
    """N rank processes kept warm and fed checks one at a time.

    A pool that saw any failure (exception, death, hang) is marked ``broken`` and must be
    discarded: :class:`.manager.PoolManager` does that, so the next check runs on clean ranks.
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        device_type: str = "cpu",
        *,
        env: Mapping[str, str] | None = None,
        start_timeout: float | None = None,
        pg_timeout: float = PG_TIMEOUT_MIN_S,
        fork_servers: ForkServers | None = None,
        devices: Sequence[int] | None = None,
        hosted: HostedRank | None = None,
        watch: PeerWatch | None = None,
    ) -> None:
        """``hosted``: start only that rank of the world, rendezvousing through its TCP store
        (:class:`HostedRank`); ``watch``: asked while the ranks start and run a check
        (:data:`PeerWatch`), so that another node's failure releases them.

        ``fork_servers``: fork the ranks from these servers' pre-imported torch (CPU only,
        where the platform allows; :mod:`.forkserver`) instead of starting each with ``exec``.

        ``start_timeout``: seconds to start (None: :func:`.timeouts.start_timeout_for` this
        world); ``pg_timeout``: the process group's timeout (:func:`.timeouts.pg_timeout_for` a
        check timeout); ``devices``: the CUDA devices of the ranks, rank ``r`` on
        ``devices[r]`` (a pytest-xdist worker's slice of the machine's,
        :func:`.ranks.device_slice`); None: rank ``r`` on ``cuda:r``. CPU pools take none.
        """
        if protocol.loading_parent_main:
            # As multiprocessing's spawn: the script is re-imported on every rank, so an
            # unguarded pool at its top level would start ranks from within each rank.
            raise HarnessError(
                "a RankPool was started while a rank imported the parent's __main__ script; "
                'start pools under `if __name__ == "__main__":` in that script'
            )
        if world_size < 1:
            raise HarnessError(f"world_size must be >= 1, got {world_size}")
        if backend not in ("gloo", "nccl"):
            raise HarnessError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        #: The ranks' CUDA devices, by rank (None: rank ``r`` on ``cuda:r``).
        self.devices = checked_devices(world_size, device_type, devices)
        self.world_size = world_size
        self.backend = backend
        self.device_type = device_type
        self.hosted = hosted
        self.watch = watch
        #: The ranks this pool starts: every rank of the world, or the one it hosts.
        self.rank_ids = list(range(world_size)) if hosted is None else [hosted.rank]
        #: The process group's timeout: checks longer than ``pg_timeout - PG_TIMEOUT_MARGIN_S``
        #: need another pool (:meth:`.manager.PoolManager.pool` starts one).
        self.pg_timeout = pg_timeout
        if start_timeout is None:
            start_timeout = start_timeout_for(world_size, device_type)
        self.broken = False
        self.checks_run = 0
        self._next_task = 0
        self._ranks: list[_Rank] = []
        self._dir = tempfile.mkdtemp(prefix="fsdp-conformance-ranks-")
        self._fork_servers = fork_servers if device_type == "cpu" and fork_available() else None
        _LIVE_POOLS.add(self)  # found by close_all_pools() if an interrupt lands mid-way
        try:
            self._start(dict(env or {}), start_timeout, pg_timeout)
        except BaseException:
            self.close(force=True)
            raise

    # -- lifecycle ---------------------------------------------------------------------------

    def _start(self, extra_env: dict[str, str], start_timeout: float, pg_timeout: float) -> None:
        authkey = secrets.token_bytes(16)
        address = control_address(self._dir)
        listener = Listener(address, family="AF_UNIX", authkey=authkey)
        env = rank_environment(extra_env, self.backend)
        procs: list[tuple[int, RankProcess, str, str]] = []
        deadline = time.monotonic() + start_timeout
        try:
            try:
                self._spawn(procs, env, address, authkey, pg_timeout, deadline)
            except HarnessError as exc:  # the fork server's: which start failed, then why
                raise HarnessError(
                    f"could not start {self.world_size} {self.backend} ranks: {exc}"
                ) from None
            conns = self._accept(listener, procs, deadline)
            self._await_ready(conns, procs, deadline)
        except BaseException:
            for _, proc, _, _ in procs:
                _kill(proc)
            raise
        finally:
            listener.close()
        self._ranks = [
            _Rank(rank, proc, conns[rank], log_path, stacks_path)
            for rank, proc, log_path, stacks_path in procs
        ]

    def _spawn(
        self,
        procs: list[tuple[int, RankProcess, str, str]],
        env: dict[str, str],
        address: str,
        authkey: bytes,
        pg_timeout: float,
        deadline: float,
    ) -> None:
        # Appends as it goes, so that the caller can kill the ranks already started.
        server = self._fork_servers.server(env) if self._fork_servers is not None else None
        for rank in self.rank_ids:
            log_path = os.path.join(self._dir, f"rank{rank}.log")
            stacks_path = os.path.join(self._dir, f"rank{rank}.stacks")
            spec = self._rank_spec(rank, address, authkey, pg_timeout, stacks_path, env)
            if server is not None:
                timeout = deadline - time.monotonic()
                procs.append(
                    (
                        rank,
                        server.spawn(spec, log_path, env, timeout=timeout),
                        log_path,
                        stacks_path,
                    )
                )
                continue
            with open(log_path, "wb") as log_file:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "fsdp_conformance.harness.worker", repr(spec)],
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=os.getcwd(),
                )
            procs.append((rank, proc, log_path, stacks_path))

    def _rank_spec(
        self,
        rank: int,
        address: str,
        authkey: bytes,
        pg_timeout: float,
        stacks_path: str,
        env: Mapping[str, str],
    ) -> dict[str, Any]:
        """What rank ``rank`` is started with (``worker.main``'s argument)."""
        spec: dict[str, Any] = {
            "address": address,
            "authkey": authkey.hex(),
            "rank": rank,
            "world_size": self.world_size,
            "backend": self.backend,
            "device_type": self.device_type,
            "store": os.path.join(self._dir, "store"),
            "stacks_path": stacks_path,
            "pg_timeout": pg_timeout,
            "parent_pid": os.getpid(),
            "main_path": _main_path(),
            "threads": rank_threads(self.world_size, env),
        }
        if self.devices is not None:
            spec["devices"] = list(self.devices)  # the worker takes devices[rank]
        hosted = self.hosted
        if hosted is not None:
            spec["store"] = None
            spec["store_tcp"] = [hosted.store_host, hosted.store_port, hosted.store_prefix]
            spec["local_rank"] = hosted.local_rank
            spec["device_index"] = hosted.device_index
            spec["threads"] = rank_threads(hosted.local_world_size, env)
        return spec

    def _accept(
        self, listener: Listener, procs: list[Any], deadline: float
    ) -> dict[int, Connection]:
        conns: dict[int, Connection] = {}
        listener._listener._socket.settimeout(0.2)  # type: ignore[attr-defined]
        while len(conns) < len(self.rank_ids):
            if time.monotonic() > deadline:
                raise HarnessError(self._start_failure(procs, "timed out connecting"))
            for _, proc, _, _ in procs:
                if proc.poll() is not None:
                    raise HarnessError(self._start_failure(procs, "a rank exited at start"))
            try:
                conn = listener.accept()
            except (TimeoutError, OSError):
                continue
            try:
                hello = conn.recv()
            except (EOFError, OSError):
                conn.close()
                continue  # it died after connecting: the poll above names it next round
            conns[hello["rank"]] = conn
        return conns

    def _await_ready(self, conns: dict[int, Connection], procs: list[Any], deadline: float) -> None:
        # Every rank reports once its process group is up (or the error that stopped it).
        for rank, conn in conns.items():
            while not conn.poll(self._slice(max(0.1, deadline - time.monotonic()))):
                released = self.watch() if self.watch is not None else None
                if released is not None:
                    raise HarnessError(
                        self._start_failure(
                            procs,
                            f"rank {released.rank} {STATUS_TITLE[released.status]} "
                            "while this one joined the process group",
                        )
                    )
                if time.monotonic() > deadline:
                    raise HarnessError(self._start_failure(procs, "process group init timed out"))
            try:
                status, detail = conn.recv()
            except (EOFError, OSError):
                # The rank died while joining (a crash in the backend's init): its exit
                # and log say why, not a bare EOFError.
                dead = next(proc for r, proc, _, _ in procs if r == rank)
                try:
                    dead.wait(2.0)
                except subprocess.TimeoutExpired:
                    pass
                raise HarnessError(
                    self._start_failure(
                        procs, f"rank {rank} exited while joining the process group"
                    )
                ) from None
            if status != "ready":
                raise HarnessError(f"rank {rank} could not join the process group:\n{detail}")

    def _slice(self, remaining: float) -> float:
        """How long to wait for the ranks before asking :attr:`watch` again."""
        return remaining if self.watch is None else min(remaining, WATCH_INTERVAL_S)

    def _start_failure(self, procs: list[Any], what: str) -> str:
        lines = [f"could not start {self.world_size} {self.backend} ranks: {what}"]
        if self.hosted is not None:
            lines[0] = (
                f"could not start rank {self.hosted.rank} of {self.world_size} {self.backend} "
                f"ranks: {what}"
            )
        for rank, proc, log_path, _ in procs:
            lines.append(f"--- rank {rank}: {describe_rank_exit(proc)} ---")
            lines.append(_tail(log_path))
        return "\n".join(lines)

    @property
    def pids(self) -> list[int]:
        return [r.proc.pid for r in self._ranks]

    @property
    def alive(self) -> bool:
        return bool(self._ranks) and all(r.proc.poll() is None for r in self._ranks)

    def close(self, force: bool = False) -> None:
        """Stop the ranks (politely unless ``force``) and remove the private folder.

        Safe to call again after an interrupt cut it short: a rank leaves ``_ranks`` only
        once it is killed and waited for, and the folder goes last.
        """
        ranks = list(self._ranks)
        if not force:
            for r in ranks:
                try:
                    r.conn.send(("stop",))
                except OSError:
                    pass
            deadline = time.monotonic() + 5.0
            for r in ranks:
                try:
                    r.proc.wait(max(0.05, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for r in ranks:
            _kill(r.proc)
            r.conn.close()
            self._ranks.remove(r)
        shutil.rmtree(self._dir, ignore_errors=True)
        _LIVE_POOLS.discard(self)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(force=self.broken)

    # -- running checks ------------------------------------------------------------------------

    def run_outcomes(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        timeout: float = 120.0,
        deadline: float | None = None,
        deadline_note: str = "",
        timeout_note: str = "",
    ) -> list[RankOutcome]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; one :class:`RankOutcome` per rank.

        ``deadline`` (``time.monotonic()``): the check must end by then (an outer
        pytest-timeout), so ``timeout`` shrinks to fit and the failure says so.
        ``timeout_note``: where ``timeout`` came from, said with it in a hang's message.
        """
        if self.broken or not self._ranks:
            raise HarnessError("this rank pool is broken or closed; use a fresh one")
        task_id = self._next_task
        self._next_task += 1
        try:
            inner = pickle.dumps((fn, tuple(args), dict(kwargs or {})))
        except Exception as exc:  # noqa: BLE001 - re-raised with the fix spelled out
            raise HarnessError(
                f"check {function_name(fn)} or its arguments cannot be pickled ({exc}); "
                "define check functions at module level and pass plain data as arguments"
            ) from exc
        payload = pickle.dumps(("run", task_id, inner))
        self.checks_run += 1
        timeout, note = fit_timeout(timeout, deadline, deadline_note)
        note = timeout_note + note
        try:
            for r in self._ranks:
                r.conn.send_bytes(payload)
            return self._collect(task_id, timeout, note)
        except BaseException:
            # Interrupted (Ctrl-C, pytest-timeout): the ranks are in an unknown state.
            self.broken = True
            self.close(force=True)
            raise

    def _collect(self, task_id: int, timeout: float, note: str = "") -> list[RankOutcome]:
        outcomes: dict[int, RankOutcome] = {}
        pending = {r.conn: r for r in self._ranks}
        deadline = time.monotonic() + timeout
        #: The outcome whose grace cut the wait short, and that grace.
        released_by: tuple[RankOutcome, float] | None = None
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            peer = self.watch() if self.watch is not None and released_by is None else None
            if peer is not None:
                # Another node's rank failed or skipped: this pool's ranks may wait for it in
                # a collective it will never join, as for one of its own.
                grace = GRACE_AFTER_SKIP_S if peer.status == "skip" else GRACE_AFTER_FAILURE_S
                if time.monotonic() + grace < deadline:
                    deadline = time.monotonic() + grace
                    released_by = (peer, grace)
                    continue
            for conn in wait(list(pending), timeout=self._slice(remaining)):
                r = pending.pop(conn)  # type: ignore[call-overload]
                got = outcomes[r.rank] = self._receive(r, task_id)
                if not got.ok and pending:
                    # A rank failed or skipped: the others may wait for it in a collective it
                    # will never join. They get a grace to report, not the whole timeout.
                    grace = GRACE_AFTER_SKIP_S if got.status == "skip" else GRACE_AFTER_FAILURE_S
                    if time.monotonic() + grace < deadline:
                        deadline = time.monotonic() + grace
                        released_by = (got, grace)
        if pending:
            self.broken = True
            dumps = self._dump_stacks([pending[c] for c in pending])
            for r in pending.values():
                if released_by is not None:
                    first, grace = released_by
                    why = (
                        f"still running {seconds(grace)} after rank {first.rank} "
                        f"{STATUS_TITLE[first.status]} (released then, not after the check's "
                        f"timeout of {seconds(timeout)}{note}); its stacks:"
                    )
                else:
                    why = (
                        f"no result after the check's timeout of {seconds(timeout)}{note}; "
                        "its stacks:"
                    )
                outcomes[r.rank] = RankOutcome(r.rank, "hung", detail=f"{why}\n{dumps[r.rank]}")
        if any(o.status not in ("ok", "skip") for o in outcomes.values()):
            self.broken = True
        return [outcomes[r] for r in sorted(outcomes)]

    def _receive(self, r: _Rank, task_id: int) -> RankOutcome:
        try:
            message = r.conn.recv()
        except (EOFError, OSError):
            try:
                r.proc.wait(2.0)
            except subprocess.TimeoutExpired:
                pass
            searched = _tail(r.log_path, CRASH_LOG_LINES)  # read once: the tail shown is its end
            site = crash_site(searched)
            tail = "\n".join(searched.splitlines()[-LOG_TAIL_LINES:])
            return RankOutcome(
                r.rank,
                "died",
                detail=f"{describe_rank_exit(r.proc)}{' ' + site if site else ''} before "
                f"reporting; its log ends:\n{tail}",
            )
        except Exception as exc:  # noqa: BLE001 - the bytes arrived whole; only loading failed
            return RankOutcome(
                r.rank,
                "error",
                detail=f"the parent could not unpickle this rank's reply ({exc!r}); "
                "return plain data (dicts, lists, numbers, strings, tensors)",
            )
        got_id, status, value, detail, caught = message
        if got_id != task_id:  # an invariant of the protocol, not user input
            return RankOutcome(
                r.rank, "error", detail=f"protocol error: task {got_id} != {task_id}"
            )
        return RankOutcome(r.rank, status, value=value, detail=detail, warnings=tuple(caught))

    def _dump_stacks(self, ranks: Sequence[_Rank]) -> dict[int, str]:
        """Ask each stuck rank for a faulthandler dump of all its threads, then read it."""
        for r in ranks:
            if r.proc.poll() is None:
                try:
                    os.kill(r.proc.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(STACK_DUMP_WAIT_S)
        dumps = {}
        for r in ranks:
            try:
                with open(r.stacks_path, encoding="utf-8", errors="replace") as f:
                    text = f.read().strip()
            except OSError:
                text = ""
            dumps[r.rank] = text or f"(no stack dump: {describe_rank_exit(r.proc)})"
        return dumps


def checked_devices(
    world_size: int, device_type: str, devices: Sequence[int] | None
) -> tuple[int, ...] | None:
    """A pool's CUDA devices by rank (:class:`RankPool`'s ``devices``), or a
    :class:`HarnessError` where they cannot hold ``world_size`` ranks; None on CPU."""
    if devices is None or device_type != "cuda":
        return None
    if len(devices) < world_size:
        raise HarnessError(
            f"{world_size} CUDA ranks need {world_size} devices, given {len(devices)} "
            f"({list(devices)})"
        )
    return tuple(devices[:world_size])


#: Every pool not closed yet, whoever holds it: what an interrupt must clean up.
_LIVE_POOLS: set[RankPool] = set()


def close_all_pools() -> int:
    """Kill every rank process this process started and remove their folders (interrupts).

    Returns how many pools were closed. The pools' owners (``PoolManager``, a ``with`` block)
    normally close them; this catches a pool an interrupt left half-registered.
    """
    pools = list(_LIVE_POOLS)
    for pool in pools:
        pool.close(force=True)
    close_all_servers()  # after the pools: their ranks are already killed and reaped
    return len(pools)


def _main_path() -> str | None:
    """The parent's ``__main__`` script, so checks defined in a script unpickle on the ranks."""
    main = sys.modules.get("__main__")
    path: str | None = getattr(main, "__file__", None)
    if path and path.endswith(".py") and getattr(main, "__spec__", None) is None:
        return os.path.abspath(path)
    return None


def describe_rank_exit(proc: RankProcess) -> str:
    """How a rank process ended (:func:`describe_exit`), or that its status is unknown and why
    (a forked rank whose server could not report it)."""
    text = describe_exit(proc.poll())
    unknown = getattr(proc, "exit_unknown", "")
    return f"ended, exit status unknown: {unknown}" if unknown else text


def _kill(proc: RankProcess) -> None:
    if proc.poll() is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass
    try:
        proc.wait(10.0)
    except subprocess.TimeoutExpired:  # pragma: no cover - a process that ignores SIGKILL
        log.warning("rank process %d did not exit after SIGKILL", proc.pid)


def _tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read().rstrip().splitlines()
    except OSError:
        return "(no log)"
    if not text:
        return "(empty log)"
    return "\n".join(text[-lines:])
