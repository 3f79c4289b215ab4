"""The harness's lifecycle in one process: what a CLI run or a pytest session opens and closes.

A :class:`HarnessSession` owns, from :meth:`~HarnessSession.open` to
:meth:`~HarnessSession.close`:

* the signals (:mod:`.interrupts`): the first SIGINT/SIGTERM raises one
  :class:`~.interrupts.Interrupted`, the ones after it are recorded while the cleanup runs, and
  the first decides the exit code (128 + N);
* the fork servers (:mod:`.forkserver`): the session is counted, so the process's servers end
  with the outermost session (not with a CLI run or an inner pytest session held inside one);
* the warm pools (:attr:`~HarnessSession.pools`, a :class:`~.manager.PoolManager` whose process
  groups outlast the session's check timeout), closed at the end and killed at once after an
  interrupt, with every pool the interrupt caught half-started (pools lent by an outer
  session are that session's to close);
* the launch (:meth:`~HarnessSession.launch`): under torchrun/srun, this process's
  :class:`~.supervisor.LaunchSupervisor` of its rank, made once, its children ended when the
  run is over (:meth:`~HarnessSession.finish`); where the session owns the process's exit
  (the CLI), a launched run ignores later signals and ends with ``os._exit``
  (:meth:`~HarnessSession.exit`).

Its :meth:`~HarnessSession.engine` is the :class:`~.engine.RankEngine` its checks run on: the
launch where there is one, else the warm pools. The CLI enters one around each command; the
pytest plugin opens one in ``pytest_configure`` and closes it in ``pytest_unconfigure``.
Neither reaches further into the harness.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from fsdp_conformance.harness import forkserver, interrupts
from fsdp_conformance.harness.engine import RankEngine
from fsdp_conformance.harness.launcher import launched_externally
from fsdp_conformance.harness.manager import PoolManager
from fsdp_conformance.harness.outcomes import HarnessError
from fsdp_conformance.harness.pool import close_all_pools, prestart_fork_server
from fsdp_conformance.harness.supervisor import LaunchSupervisor
from fsdp_conformance.harness.timeouts import DEFAULT_CHECK_TIMEOUT_S

#: Present where the machine has an NVIDIA GPU and its driver (a launch there runs NCCL).
NVIDIA_DEVICE = "/dev/nvidiactl"


class HarnessSession:
    """Signals, fork servers, warm pools and the launch of one CLI run or pytest session.

    ``check_timeout``: the session's check timeout (``Settings.timeout``); the pools' and the
    launch's process groups outlast it (:func:`.timeouts.pg_timeout_for`). It is read when the
    pools or the launch are first made, so a front end that learns it later (the CLI, after
    its settings) sets it before then. ``signals``: the signals raised as
    :class:`~.interrupts.Interrupted` while the session is open; ``only_default``: leave alone
    one that someone else already handles (a pytest session inside a harness that handles
    SIGTERM). ``owns_exit``: the session decides how the process ends (the CLI, not pytest):
    see :meth:`exit`.
    """

    def __init__(
        self,
        *,
        check_timeout: float = DEFAULT_CHECK_TIMEOUT_S,
        signals: Sequence[int] = interrupts.HANDLED,
        only_default: bool = False,
        owns_exit: bool = False,
    ) -> None:
        self.check_timeout = check_timeout
        self.signals = tuple(signals)
        self.only_default = only_default
        self.owns_exit = owns_exit
        self._handler: interrupts.InterruptHandler | None = None
        self._previous: dict[int, Any] = {}
        self._pools: PoolManager | None = None
        #: Whether :attr:`pools` were lent by an outer session (which closes them).
        self._pools_lent = False
        self._launcher: LaunchSupervisor | None = None

    # -- open and close ------------------------------------------------------------------------

    def open(self) -> HarnessSession:
        """Count the session for the fork servers and install the signal handler."""
        forkserver.begin_session()
        installed = interrupts.install(self.signals, only_default=self.only_default)
        if installed is not None:  # None off the main thread: signals stay as they are
            self._handler, self._previous = installed
        return self

    def close(self) -> None:
        """Close the pools (killed at once after an interrupt), end the fork servers where this
        is the outermost session, and leave the signals as the run's end needs them: ignored
        after an interrupt (the exit code is decided; interpreter shutdown must not turn a
        second Ctrl-C into a death by SIGINT) and after a launched run whose exit the session
        owns (torchrun's SIGTERM to the ranks still running must not make this rank's code
        -15), the previous handlers back otherwise (in-process callers, tests, get theirs)."""
        interrupted = self.interrupted
        if self._pools is not None and not self._pools_lent:
            self._pools.close(force=interrupted)
        forkserver.end_session()
        if interrupted:
            close_all_pools()  # a fresh pool the interrupt caught before its owner held it
            interrupts.ignore_from_now_on(self.signals)
        elif self.owns_exit and self.launched:
            interrupts.ignore_from_now_on(self.signals)
        elif self._handler is not None:
            interrupts.restore(self._previous)

    def __enter__(self) -> HarnessSession:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- signals -------------------------------------------------------------------------------

    @property
    def interrupted(self) -> bool:
        """Whether a signal of this session's arrived."""
        return self._handler is not None and bool(self._handler.received)

    @property
    def interrupt(self) -> interrupts.Interrupted | None:
        """The first signal of this session's (it decides the exit code), or None."""
        return self._handler.first if self._handler is not None else None

    def stop(self, exc: KeyboardInterrupt) -> interrupts.Interrupted:
        """After SIGINT/SIGTERM (``exc``, which reached the front end): every rank process
        killed, every rank folder removed, later signals ignored. Returns the interruption
        (a plain ``KeyboardInterrupt`` counts as SIGINT), whose ``exit_code`` the run ends
        with."""
        stopped = (
            exc
            if isinstance(exc, interrupts.Interrupted)
            else (interrupts.Interrupted(signal.SIGINT))
        )
        close_all_pools()
        interrupts.ignore_from_now_on(self.signals)
        return stopped

    # -- pools ---------------------------------------------------------------------------------

    @property
    def pools(self) -> PoolManager:
        """The session's warm pools, one per world size, backend and devices (made on first
        use), whose process groups outlast :attr:`check_timeout`; closed with the session."""
        if self._pools is None:
            self._pools = PoolManager(check_timeout=self.check_timeout)
        return self._pools

    @pools.setter
    def pools(self, lent: PoolManager) -> None:
        # An outer session's warm pools, lent to an inner pytest session (a test's): used here,
        # left warm at this session's close (the outer session closes them).
        self._pools = lent
        self._pools_lent = True

    def engine(self, backend: str) -> RankEngine:
        """What this session's checks run on: the launch's supervisor where an external
        launcher started the process (:meth:`launch`, made with ``backend`` on first use),
        else the warm pools (:attr:`pools`)."""
        launcher = self.launch(backend)
        return self.pools if launcher is None else launcher

    def prestart_fork_server(
        self, env: Mapping[str, str] | None = None, *, backend: str = "auto"
    ) -> bool:
        """Start the fork server of this process's CPU ranks now, without waiting for it: its
        imports (torch and FSDP) run on another core while this process does other work. A
        launched process's children fork from the same server (its supervisor's, keyed alike),
        where the launch runs gloo (``backend``, or ``auto`` on a machine without an NVIDIA
        device: the check is cheap, torch is not imported yet). False where nothing was
        started."""
        if launched_externally() and not (
            backend == "gloo" or (backend == "auto" and not os.path.exists(NVIDIA_DEVICE))
        ):
            return False
        return prestart_fork_server(env=env)

    # -- the launch ----------------------------------------------------------------------------

    @property
    def launched(self) -> bool:
        """Whether this process supervises one rank of an external launch (:meth:`launch`)."""
        return self._launcher is not None

    def launch(self, backend: str) -> LaunchSupervisor | None:
        """This process's supervisor of its rank of the launch where an external launcher
        (torchrun, srun) started it; None where it did not.

        Made on the first call (``backend``: the settings' backend, ``"auto"`` chooses by the
        machine): it joins the launch's store, and its children's process groups outlast a
        check as a pool's do (:attr:`check_timeout` + 60 s, at least 300 s), so a stuck check
        is the harness's to report (one failed check), not the group's watchdog's.
        """
        if self._launcher is None:
            if not launched_externally():
                return None
            self._launcher = LaunchSupervisor(
                None if backend == "auto" else backend, check_timeout=self.check_timeout
            )
        return self._launcher

    def launch_exit_codes(self, code: int) -> dict[int, int]:
        """Every rank's exit code by rank, this rank's being ``code``, through the launch's
        store (a rank lost during the run is left out): every rank calls it once its run is
        over, so that every rank can exit with the worst and torchrun reports one outcome
        whichever rank it looks at."""
        if self._launcher is None:
            raise HarnessError("launch_exit_codes: this session joined no launch (launch())")
        return self._launcher.exit_codes(code)

    def finish(self, *, interrupted: bool = False) -> int | None:
        """The run is over: the launch's supervisor ends its children (rank 0, where it hosts
        the launch's store, once the others have left it); after a signal or ``interrupted``
        at once (the run was cut short; the launcher ends the processes). Returns the exit
        code a signal decided (128 + N), or None."""
        interrupt = self.interrupt
        if self._launcher is not None:
            self._launcher.close(force=interrupt is not None or interrupted)
        return None if interrupt is None else interrupt.exit_code

    def exit(self, code: int) -> int:
        """How the process ends, after :meth:`close`: ``code`` returned, except for a launched
        run whose exit the session owns (``owns_exit``): that process ends here with ``code``,
        skipping interpreter teardown as the pool's ranks do, because gloo sometimes aborts a
        process at exit (docs/harness.md), which torchrun would report as this rank's
        failure."""
        if self.owns_exit and self.launched:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
