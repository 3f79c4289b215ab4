"""Cheap rank starts: rank processes forked from a server that has already imported torch.

Starting a rank with ``python -m fsdp_conformance.harness.worker`` costs about 2.4 CPU-seconds,
nearly all of it importing torch; a test lane starts about a hundred ranks. A :class:`ForkServer`
is one such process, started once (``python -m fsdp_conformance.harness.worker --fork-server``)
with the environment the ranks would get. It imports torch, FSDP and the modules the parent has
loaded from this package and from ``transformers`` (the worker's ``serve_forks``), then forks
one child per rank on request. A child is the worker of an ``exec``-started rank in everything
but the import: the same environment, working directory, ``sys.path``, log file and spec.

The server never runs a torch operation, so it holds no thread pool, CUDA context or process
group a fork could copy half-made. It is used for CPU pools only: a CUDA process cannot be
forked from a parent that touched the driver, and the GPU lane's start-up is not its cost.

The parent sees a forked rank through :class:`ForkedProcess`, which answers as
``subprocess.Popen`` does (``pid``, ``poll``, ``wait``, ``kill``). Liveness and ``kill`` go
through a pidfd (no pid-reuse race); the exit status, which only the server can reap, is the
file the server writes beside the rank's log once it has reaped it. Nothing is read from the
server's connection outside a start, so a signal handler that closes pools mid-way (Ctrl-C, a
pytest-timeout) never finds that stream half-read.

Environment variables that must exist before a process starts (``MALLOC_*``) get a server of
their own: :class:`ForkServers` keys servers by the ranks' environment. The servers belong to
the process, not to a pool manager: every :class:`~fsdp_conformance.harness.manager.PoolManager`
of a process forks from the one registry :func:`shared_servers` returns (one server per
environment), so a pytest session's own managers, the in-process CLI runs and inner pytest
sessions it holds, and its fresh ``MALLOC_*`` pools import torch once per environment. A
manager's ``close`` ends its ranks and leaves the servers; they are closed when the outermost
session of the process ends (:func:`begin_session` / :func:`end_session`, which the harness
session of the pytest plugin and of the CLI calls) and at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

from fsdp_conformance.harness.outcomes import HarnessError, describe_exit

#: The worker module: the server runs its ``--fork-server`` mode (named, never imported here).
WORKER_MODULE = "fsdp_conformance.harness.worker"
#: Imported in the server before any fork, besides what the parent has loaded (see
#: :func:`preload_modules`): what every rank imports. A name an upgrade removed is skipped.
BASE_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.fsdp.fully_sharded_data_parallel",
    "torch.distributed.fsdp.wrap",
    "torch.distributed.tensor",
)
#: Packages whose modules the server imports when the parent has them loaded: heavy, imported by
#: the ranks of any check that uses them, and safe to import in a process that forks.
PRELOAD_PACKAGES = ("fsdp_conformance", "transformers", "pytest")
#: Seconds for the server to import everything and say it is ready.
SERVER_START_TIMEOUT_S = 60.0
#: Seconds a terminated rank's exit status may take to appear (the server reaps at once).
EXIT_STATUS_WAIT_S = 5.0
#: Servers kept at once (one per distinct rank environment); the least recently used is
#: closed first, and the ranks it forked with it.
MAX_SERVERS = 3


def fork_available() -> bool:
    """True where ranks can be forked: Linux with pidfds (kernel 5.3 and later)."""
    if not hasattr(os, "fork") or not hasattr(os, "pidfd_open"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


def preload_modules(modules: Mapping[str, Any] | None = None) -> list[str]:
    """What a server imports before forking: the base list and the parent's heavy packages."""
    loaded = sys.modules if modules is None else modules
    names = list(BASE_PRELOAD)
    for name in loaded:
        top = name.partition(".")[0]
        # Never the worker: the server runs it as __main__, and a second copy would be a twin.
        if top in PRELOAD_PACKAGES and name not in names and name != WORKER_MODULE:
            names.append(name)
    return names


class ForkedProcess:
    """A rank forked by a :class:`ForkServer`, with ``subprocess.Popen``'s interface."""

    def __init__(
        self, pid: int, exit_path: str, args: Sequence[str], server: subprocess.Popen[bytes]
    ) -> None:
        self.pid = pid
        self._server = server
        self.args = list(args)
        self.returncode: int | None = None
        #: Set when the exit status could not be read (``returncode`` is then SIGKILL's, a
        #: guess): why, for the failure message (:func:`~.pool.describe_rank_exit`).
        self.exit_unknown = ""
        self._exit_path = exit_path
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # ended (and was reaped) before we looked: the file says how
            self._pidfd = None

    def _terminated(self, timeout: float) -> bool:
        if self._pidfd is None:
            return True
        readable, _, _ = select.select([self._pidfd], [], [], max(timeout, 0.0))
        return bool(readable)

    def _read_exit(self) -> int:
        deadline = time.monotonic() + EXIT_STATUS_WAIT_S
        while True:
            try:
                with open(self._exit_path, encoding="ascii") as f:
                    return int(f.read())
            except (OSError, ValueError):
                if self._server.poll() is not None:
                    # The server is gone: its ranks die with it (their parent-death signal).
                    self.exit_unknown = (
                        f"its fork server (pid {self._server.pid}) ended "
                        f"first, {describe_exit(self._server.returncode)}"
                    )
                    return -signal.SIGKILL
                if time.monotonic() > deadline:
                    self.exit_unknown = (
                        f"its fork server (pid {self._server.pid}) did not "
                        f"report it within {EXIT_STATUS_WAIT_S:g} s"
                    )
                    return -signal.SIGKILL
                time.sleep(0.01)

    def _settle(self) -> int:
        self.returncode = self._read_exit()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None and self._terminated(0):
            self._settle()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        if not self._terminated(1e9 if timeout is None else timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._settle()

    def kill(self) -> None:
        if self.returncode is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)


class ForkServer:
    """One server process that forks ranks with the environment it was started with."""

    def __init__(
        self, env: Mapping[str, str], preload: Sequence[str], *, follow_parent: bool = True
    ) -> None:
        self._dir = tempfile.mkdtemp(prefix="fsdp-conformance-forks-")
        self.log_path = os.path.join(self._dir, "server.log")
        ours, theirs = socket.socketpair()
        # Its command line names the parent as a rank's does ('parent_pid': N, ...), and the
        # ranks it forks keep that command line: a scan for a session's ranks finds them all.
        spec = {"parent_pid": os.getpid(), "fd": theirs.fileno(), "preload": list(preload)}
        self.args = [sys.executable, "-m", WORKER_MODULE, "--fork-server", repr(spec)]
        try:
            with open(self.log_path, "wb") as log_file:
                self._proc = subprocess.Popen(
                    self.args,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=dict(env),
                    pass_fds=[theirs.fileno()],
                )
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self._ready = False
        #: Whether each fork first imports what the parent has loaded since (the default).
        self._follow_parent = follow_parent
        _register_exit_handler()
        _LIVE_SERVERS.add(self)

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _await_ready(self, deadline: float) -> None:
        if self._ready:
            return
        if not self._conn.poll(max(0.0, deadline - time.monotonic())):
            raise HarnessError(self._failure("timed out importing torch"))
        try:
            self._conn.recv()
        except (EOFError, OSError):
            raise HarnessError(self._failure("exited while importing")) from None
        self._ready = True

    def _failure(self, what: str) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                log_text = f.read().strip()[-4000:]
        except OSError:
            log_text = ""
        log_text = log_text or "(empty)"
        return f"the rank fork server (pid {self._proc.pid}) {what}; its log:\n{log_text}"

    def spawn(
        self, spec: Mapping[str, Any], log_path: str, env: Mapping[str, str], *, timeout: float
    ) -> ForkedProcess:
        """Fork one rank running the worker with ``spec``; its output goes to ``log_path``.

        ``env`` becomes the child's ``os.environ``: the server's own environment, but for the
        variables :class:`ForkServers` does not key servers by.
        """
        deadline = time.monotonic() + timeout
        self._await_ready(deadline)
        exit_path = log_path + ".exit"
        request = {
            "spec": repr(dict(spec)),
            "log_path": log_path,
            "exit_path": exit_path,
            "cwd": os.getcwd(),
            "env": dict(env),
            # What the parent has imported by now: a server started before the parent imported
            # the user's model imports it before this fork (once, for every later rank too).
            "preload": preload_modules() if self._follow_parent else [],
        }
        try:
            self._conn.send(request)
            if not self._conn.poll(max(0.0, deadline - time.monotonic())):
                raise HarnessError(self._failure("timed out forking a rank"))
            pid = self._conn.recv()
        except (EOFError, OSError):
            raise HarnessError(self._failure("exited")) from None
        return ForkedProcess(pid, exit_path, [*self.args[:3], repr(dict(spec))], self._proc)

    def close(self) -> None:
        """Stop the server; ranks it forked die with it (their parent-death signal)."""
        with contextlib.suppress(OSError):
            self._conn.close()
        if self._proc.poll() is None:
            try:
                # It exits once its connection closes, but reads it only once it is ready: one
                # still importing (started early, by a run that then stopped at a usage error)
                # has forked nothing and is killed at once rather than waited for.
                self._proc.wait(2.0 if self._ready else 0.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)
        _LIVE_SERVERS.discard(self)


#: Every server not closed yet: what an interrupt must stop (:func:`close_all_servers`).
_LIVE_SERVERS: set[ForkServer] = set()


def close_all_servers() -> int:
    """Stop every fork server this process started (interrupts, exit); returns how many."""
    servers = list(_LIVE_SERVERS)
    for server in servers:
        server.close()
    return len(servers)


_exit_handler_registered = False


def _register_exit_handler() -> None:
    """Close the servers at interpreter exit, in the process that started them only (a server
    imports this module too, and its forks leave with ``os._exit``)."""
    global _exit_handler_registered
    if not _exit_handler_registered:
        _exit_handler_registered = True
        atexit.register(close_all_servers)


#: Variables a child takes from its start request rather than from its server's start: they
#: change from test to test (pytest sets ``PYTEST_CURRENT_TEST`` for each; pytester's
#: in-process runs set ``HOME``, ``USERPROFILE`` and ``PY_COLORS``) and nothing a rank needs
#: reads them while a process starts (``sys.path`` is set from the parent's, so the user
#: site folder ``HOME`` names at start does not matter), so servers need not differ by them.
#: ``TORCHINDUCTOR_CACHE_DIR`` is set in ``os.environ`` by the parent's first import of
#: inductor (its default cache folder) and read by inductor only when it compiles: without it
#: here, every pool started after that import would get a second server (about 4 CPU-s).
#: ``GITHUB_STEP_SUMMARY`` (set by GitHub Actions for every step, set or removed by the CLI's
#: tests) is read only by the CLI's parent process, when it writes the job summary.
#: ``OMP_NUM_THREADS`` is read by torch only at its import: every rank sets its intra-op thread
#: count itself from the variable (:func:`~fsdp_conformance.harness.pool.rank_threads`).
AFTER_FORK_PREFIXES = ("PYTEST_", "FSDP_CONFORMANCE_")
AFTER_FORK_NAMES = (
    "PYTHONPATH",
    "HOME",
    "USERPROFILE",
    "PY_COLORS",
    "COLUMNS",
    "LINES",
    "TORCHINDUCTOR_CACHE_DIR",
    "GITHUB_STEP_SUMMARY",
    "OMP_NUM_THREADS",
)


def _set_after_fork(name: str) -> bool:
    return name in AFTER_FORK_NAMES or name.startswith(AFTER_FORK_PREFIXES)


class ForkServers:
    """Fork servers by environment, at most :data:`MAX_SERVERS` (the least recently used is
    closed first, with its ranks). :func:`shared_servers` is the one every pool manager of the
    process uses; a registry of its own is for a pool or a benchmark that must not share."""

    def __init__(self, *, preload: Sequence[str] | None = None) -> None:
        """``preload``: exactly what each server imports before it forks (for a registry
        whose ranks need no more, such as the harness's own tests); by default
        :func:`preload_modules`, then before each fork what the parent has loaded since."""
        self._preload = None if preload is None else list(preload)
        self._servers: dict[tuple[tuple[str, str], ...], ForkServer] = {}
        self._lock = threading.Lock()  # pools may be started from any thread

    def server(self, env: Mapping[str, str]) -> ForkServer:
        key = tuple(sorted((k, v) for k, v in env.items() if not _set_after_fork(k)))
        with self._lock:
            found = self._servers.pop(key, None)  # put back last: the oldest is the least used
            if found is not None and not found.alive:
                found.close()  # killed, or closed by an interrupt: the next ranks get a new one
                found = None
            if found is None:
                while len(self._servers) >= MAX_SERVERS:
                    oldest = next(iter(self._servers))
                    self._servers.pop(oldest).close()
                found = (
                    ForkServer(env, preload_modules())
                    if self._preload is None
                    else ForkServer(env, self._preload, follow_parent=False)
                )
            self._servers[key] = found
            return found

    def pids(self) -> list[int]:
        """The pids of the live servers (for tests and diagnostics)."""
        with self._lock:
            return [s.pid for s in self._servers.values() if s.alive]

    def close(self) -> None:
        with self._lock:
            servers, self._servers = self._servers, {}
        for server in servers.values():
            server.close()


#: The process's fork servers, shared by every pool manager (:func:`shared_servers`).
_SHARED = ForkServers()
#: Sessions (pytest sessions, CLI runs) of this process still running: the servers outlive
#: every session but the outermost, whose end closes them (:func:`end_session`).
_sessions = 0


def shared_servers() -> ForkServers:
    """The fork servers of this process: one per rank environment, for every pool manager."""
    return _SHARED


def begin_session() -> None:
    """A pytest session or a CLI run starts in this process (the plugin and the CLI call it)."""
    global _sessions
    _sessions += 1


def end_session() -> int:
    """A session that :func:`begin_session` counted ends. When it was the outermost (an
    in-process CLI run or inner pytest session inside a test is not), the shared servers are
    closed, with any rank still forked from them. Returns how many servers were closed."""
    global _sessions
    _sessions = max(0, _sessions - 1)
    if _sessions:
        return 0
    closed = len(_SHARED.pids())
    _SHARED.close()
    return closed
