"""SIGINT and SIGTERM as one clean interruption: cleanup runs once, the exit code is 128 + N.

``timeout``, Kubernetes and CI cancellation send SIGTERM, whose default action ends Python
without running ``finally`` blocks: rank processes and their private folders would be left
behind. Here the first signal raises :class:`Interrupted` (a ``KeyboardInterrupt``, so no
``except Exception`` swallows it) in the main thread; the signals that follow while the
cleanup runs (a second Ctrl-C) are recorded and ignored, so the cleanup finishes and the exit
code stays the first signal's.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

#: The signals handled: Ctrl-C and the polite stop of every supervisor.
HANDLED = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The process received SIGINT or SIGTERM; ``exit_code`` is the conventional 128 + N."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(self.name)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class InterruptHandler:
    """The handler installed for :data:`HANDLED`: raises once, then records."""

    def __init__(self) -> None:
        #: Every signal received, in order (the first one is the one that counts).
        self.received: list[int] = []

    @property
    def first(self) -> Interrupted | None:
        return Interrupted(self.received[0]) if self.received else None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        if len(self.received) == 1:
            raise Interrupted(signum)
        # A later signal lands in the cleanup the first one started: let the cleanup finish.


def install(
    signums: Sequence[int] = HANDLED, *, only_default: bool = False
) -> tuple[InterruptHandler, dict[int, Any]] | None:
    """Install the handler; returns it and the previous handlers (None off the main thread).

    A signal the process was started with ignored (``nohup``, a background job) stays
    ignored. ``only_default``: also leave alone a signal someone else already handles.
    """
    if threading.current_thread() is not threading.main_thread():
        return None  # signal.signal works only in the main thread
    handler = InterruptHandler()
    previous: dict[int, Any] = {}
    for signum in signums:
        current = signal.getsignal(signum)
        if current is signal.SIG_IGN or (only_default and current is not signal.SIG_DFL):
            continue
        previous[signum] = signal.signal(signum, handler)
    return handler, previous


def restore(previous: dict[int, Any]) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, old in previous.items():
        signal.signal(signum, old if old is not None else signal.SIG_DFL)


def pending(signums: Sequence[int] = HANDLED) -> Interrupted | None:
    """The interruption an installed handler received, or None.

    For code that runs a check in this process behind a catch-all (``execute_check`` turns
    every exception into a rank's outcome): an interrupt swallowed there must still stop the
    run, or a launched rank would go on to the next check while torchrun waits to kill it.
    """
    for signum in signums:
        handler = signal.getsignal(signum)
        if isinstance(handler, InterruptHandler) and handler.first is not None:
            return handler.first
    return None


def ignore_from_now_on(signums: Sequence[int] = HANDLED) -> None:
    """After the cleanup: the process is ending with its exit code; more signals change nothing.

    Python's finalization puts SIG_DFL back for signals that have a Python handler, so a Ctrl-C
    pressed while the interpreter shuts down would end the process by SIGINT (exit -2) instead
    of the code the cleanup chose; an ignored signal stays ignored.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in signums:
        signal.signal(signum, signal.SIG_IGN)


@contextlib.contextmanager
def interruptible(signums: Sequence[int] = HANDLED) -> Iterator[InterruptHandler | None]:
    """Within the block, SIGINT/SIGTERM raise :class:`Interrupted` once; restored after."""
    installed = install(signums)
    if installed is None:
        yield None
        return
    handler, previous = installed
    try:
        yield handler
    finally:
        restore(previous)
