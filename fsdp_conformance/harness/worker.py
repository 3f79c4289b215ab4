"""The rank side of the harness: one process per rank, started by :class:`RankPool`.

Run as ``python -m fsdp_conformance.harness.worker SPEC``. It joins the process group through
the pool's file store, then loops: receive a check, run it from a clean global state, send back
``(task_id, status, value, detail, warnings)``. It never decides a check's outcome; the parent
does, from what every rank reports. It imports only :mod:`~fsdp_conformance.harness.protocol`
and :mod:`~fsdp_conformance.harness.clean_state`, never the parent's side of the harness.
"""

from __future__ import annotations

import ast
import contextlib
import faulthandler
import os
import pickle
import signal
import sys
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fsdp_conformance.harness import clean_state, protocol
from fsdp_conformance.harness.clean_state import clean_global_state
from fsdp_conformance.harness.protocol import (
    UNPICKLABLE_VALUE,
    CheckSkipped,
    RankContext,
    traceback_text,
)

_UNRESTORABLE_HEADER = (
    "the check left this rank in a state the harness cannot restore (the pool is rebuilt, "
    "so the next check starts clean):"
)


def _is_pytest_skip(exc: BaseException) -> bool:
    pytest = sys.modules.get("pytest")
    return pytest is not None and isinstance(exc, pytest.skip.Exception)


def execute_check(
    fn: Callable[..., Any],
    ctx: RankContext,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> tuple[str, Any, str, list[str]]:
    """Run one check on this rank: ``(status, value, detail, warnings)``.

    Every failure becomes this rank's outcome. A rank ignores SIGINT (its parent, a pool's
    or a launched process's supervisor, handles Ctrl-C), so a ``KeyboardInterrupt`` here is
    something the check raised: its error. ``SystemExit`` is the rank's error too, as pytest
    reports a test's ``sys.exit()`` as that test's failure.

    On a CUDA rank a check that returned is not done until its queued device work is
    (:func:`synchronize_device`): an asynchronous CUDA or NCCL error is its error.
    """
    caught: list[str] = []
    with clean_global_state() as unrestorable:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            # every warning, and for a deprecation the torch call it came through
            warnings.showwarning = protocol.recording_warnings(caught)
            try:
                value = fn(ctx, *args, **kwargs)
                synchronize_device(ctx)  # an asynchronous CUDA/NCCL error is this check's
                status, detail = "ok", ""
            except CheckSkipped as exc:
                value, status, detail = None, "skip", str(exc)
            except BaseException as exc:  # noqa: BLE001 - every failure is reported, by rank
                if _is_pytest_skip(exc):
                    value, status, detail = None, "skip", str(getattr(exc, "msg", exc))
                else:
                    value, status, detail = None, "error", traceback_text(exc)
    if unrestorable:
        # The check that changed the state fails (a skip too: the pool must be rebuilt either
        # way), never the next, innocent one.
        what = "\n".join(f"- {line}" for line in unrestorable)
        if status == "error":
            detail = f"{detail.rstrip()}\n{_UNRESTORABLE_HEADER}\n{what}"
        else:
            value, status, detail = None, "leaked", f"{_UNRESTORABLE_HEADER}\n{what}"
    return status, value, detail, caught


def synchronize_device(ctx: RankContext) -> None:
    """Wait for the work the check queued on this rank's CUDA device (kernels, NCCL
    collectives) before its outcome is reported.

    CUDA and NCCL report errors asynchronously, at the next call that waits: without this,
    an error the check caused is raised in the next check (or its setup) and blamed on it.
    Called inside the check's error handling, so an error raised here is the check's. Nothing
    happens on a CPU rank.
    """
    if ctx.device_type != "cuda":
        return
    import torch

    torch.cuda.synchronize(ctx.device)


def _set_parent_death_signal() -> None:
    """Linux: die with the parent even if stuck in a collective (best effort)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def rank_device_index(spec: Mapping[str, Any]) -> int:
    """This pool rank's CUDA device: the ``rank``-th of the pool's devices (``spec['devices']``,
    a pytest-xdist worker's slice of the machine's), or ``cuda:<rank>`` when the pool was given
    none (it has every device)."""
    devices = spec.get("devices")
    return int(devices[spec["rank"]]) if devices else int(spec["rank"])


def _init_process_group(spec: Mapping[str, Any]) -> RankContext:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if spec.get("threads"):
        # Before the first check: the clean-state baseline is taken with this count.
        torch.set_num_threads(int(spec["threads"]))
    backend = spec["backend"]
    rank, world_size = spec["rank"], spec["world_size"]
    # A pool's ranks share one machine (local rank = rank); a launch's child is told its own.
    local_rank = spec.get("local_rank", rank)
    timeout = timedelta(seconds=spec["pg_timeout"])
    kwargs: dict[str, Any] = {}
    device_index = None
    if spec["device_type"] == "cuda":
        given = spec.get("device_index")
        device_index = rank_device_index(spec) if given is None else int(given)
        torch.cuda.set_device(device_index)
        kwargs["device_id"] = torch.device("cuda", device_index)
    if spec.get("store_tcp"):
        # A launch's child: the launch's TCP store (its agent's, or the supervisor of rank 0's),
        # under this generation's own prefix, so that no two generations' keys meet.
        host, port, prefix = spec["store_tcp"]
        client = dist.TCPStore(  # type: ignore[attr-defined]
            host, int(port), is_master=False, timeout=timeout
        )
        kwargs["store"] = dist.PrefixStore(prefix, client)  # type: ignore[attr-defined]
    else:
        kwargs["init_method"] = f"file://{spec['store']}"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    return RankContext(rank, world_size, local_rank, backend, spec["device_type"], device_index)


def main(argv: Sequence[str]) -> None:
    from multiprocessing.connection import Client

    spec = ast.literal_eval(argv[0])
    _set_parent_death_signal()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and cleans up
    faulthandler.enable(file=sys.stderr, all_threads=True)  # segfaults: Python stack in the log
    stacks = open(spec["stacks_path"], "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    clean_state.stacks_file = stacks
    if spec.get("main_path"):
        _load_parent_main(spec["main_path"])
    conn = Client(spec["address"], family="AF_UNIX", authkey=bytes.fromhex(spec["authkey"]))
    conn.send({"rank": spec["rank"], "pid": os.getpid()})
    try:
        ctx = _init_process_group(spec)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback_text(exc)))
        os._exit(1)
    conn.send(("ready", ""))
    while True:
        try:
            outer = conn.recv_bytes()
        except (EOFError, OSError):
            break  # the parent is gone
        message = pickle.loads(outer)
        if message[0] == "stop":
            break
        _, task_id, inner = message
        try:
            fn, args, kwargs = pickle.loads(inner)
        except BaseException as exc:  # noqa: BLE001 - e.g. the test module fails to import here
            reply: tuple[Any, ...] = (
                task_id,
                "error",
                None,
                "could not load the check on this rank:\n" + traceback_text(exc),
                [],
            )
        else:
            reply = (task_id, *execute_check(fn, ctx, args, kwargs))
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001 - an unpicklable return value
            conn.send((task_id, "error", None, UNPICKLABLE_VALUE.format(exc=exc), reply[4]))
    _shutdown()


def _load_parent_main(path: str) -> None:
    """Import the parent's script as ``__mp_main__`` (as multiprocessing's spawn does)."""
    import runpy

    protocol.loading_parent_main = True
    try:
        namespace = runpy.run_path(path, run_name="__mp_main__")
    finally:
        protocol.loading_parent_main = False
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(namespace)
    sys.modules["__mp_main__"] = module
    sys.modules["__main__"] = module


def _shutdown() -> None:
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo sometimes aborts there (docs/harness.md, "Gloo's abort at
    # exit"), and the results are in.
    os._exit(0)


# --------------------------------------------------------------------------------------------
# The fork server: ranks forked from a process that has already imported torch
# --------------------------------------------------------------------------------------------


def serve_forks(spec: Mapping[str, Any]) -> None:
    """Import torch and the preload list once, then fork one rank per request until EOF.

    A request names the parent's preload list as it is then (:func:`~fsdp_conformance.harness.
    forkserver.preload_modules`): what the parent imported after this server started (the
    user's model, transformers) is imported here before the fork, once for every later rank.

    The parent's side is :class:`fsdp_conformance.harness.forkserver.ForkServer` (the protocol:
    it sends a request dict, this answers the child's pid; this writes each child's exit status
    to the request's ``exit_path`` once it has reaped the child).
    """
    import importlib
    import select
    from multiprocessing.connection import Connection

    # No parent-death signal here: it fires when the *thread* that started this process ends,
    # and a pool may be started from any thread of the session. The parent's death closes the
    # connection instead, which the loop below sees at once (it only ever waits there); the
    # ranks' own parent-death signal then takes them with this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and cleans up
    conn = Connection(spec["fd"])
    tried: set[str] = set()

    def preload(names: Sequence[str]) -> None:
        for name in names:
            if name in tried:
                continue
            tried.add(name)
            try:
                importlib.import_module(name)
            except BaseException as exc:  # noqa: BLE001 - a rank that needs it reports the error
                print(f"preload {name} failed: {exc!r}", file=sys.stderr)

    preload(spec["preload"])
    warm_rank_imports()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd fires
    exit_paths: dict[int, str] = {}
    try:
        conn.send(("ready", os.getpid()))
    except OSError:
        os._exit(0)  # the parent went while this was importing
    while True:
        readable, _, _ = select.select([conn.fileno(), wake_r], [], [])
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        _reap(exit_paths)
        if conn.fileno() in readable:
            try:
                request = conn.recv()
            except (EOFError, OSError):
                break  # the parent closed us: its pools are closed or it is gone
            # What the parent has loaded since this server started (a server started early,
            # before the parent imported the user's model): imported once, here, not per rank.
            preload(request.get("preload", ()))
            pid = os.fork()
            if pid == 0:
                _become_rank(request, conn, (wake_r, wake_w))
            exit_paths[pid] = request["exit_path"]
            try:
                conn.send(pid)
            except OSError:
                break
    os._exit(0)


def warm_rank_imports() -> None:
    """Import, in the fork server, what ranks import lazily on their first measured step:
    torch's memory trackers (their package pulls in torch's compiler stack, about
    1.2 s), once for every rank it forks instead of once per rank and pool. The parent never
    needs them. A torch that moved them: the accessors say None, the meters say why."""
    with contextlib.suppress(Exception):
        from fsdp_conformance import _compat

        _compat.mem_tracker_cls()
        _compat.fsdp_mem_tracker_cls()


def _reap(exit_paths: dict[int, str]) -> None:
    while exit_paths:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = exit_paths.pop(pid, None)
        if path is not None:
            with open(path + ".tmp", "w", encoding="ascii") as f:
                f.write(str(os.waitstatus_to_exitcode(status)))
            os.replace(path + ".tmp", path)  # whole or absent, never half-written


def _become_rank(request: Mapping[str, Any], conn: Any, wake_fds: tuple[int, int]) -> None:
    """In the forked child: look as an ``exec``-started rank would, then run the worker."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        conn.close()
        for fd in wake_fds:
            os.close(fd)
        log_fd = os.open(request["log_path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.chdir(request["cwd"])
        # As `python -m` in that folder with the request's PYTHONPATH (the parent's sys.path,
        # which the pool sets for either start) would have it.
        pythonpath = request["env"].get("PYTHONPATH", "").split(os.pathsep)
        parent_path = [request["cwd"], *(p for p in pythonpath if p)]
        sys.path[:] = parent_path + [p for p in sys.path[1:] if p not in parent_path]
        os.environ.clear()
        os.environ.update(request["env"])  # PYTHONPATH and the per-test variables included
        import random

        random.seed()  # as a fresh interpreter: ranks must not share the server's sequence
        main([request["spec"]])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - the log says why; the exit status says it failed
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--fork-server"]:
        serve_forks(ast.literal_eval(sys.argv[2]))
    else:
        main(sys.argv[1:])
