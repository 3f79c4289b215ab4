"""In-process mode: the processes were started by an external launcher (``torchrun``, ``srun``).

The check runs in-process on the ``env://`` process group and every rank's outcome is
all-gathered, so every rank's pytest sees the same verdict.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import os
import pickle
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TextIO

from fsdp_conformance.harness.engine import RankRequest
from fsdp_conformance.harness.outcomes import HarnessError
from fsdp_conformance.harness.protocol import (
    UNPICKLABLE_VALUE,
    RankContext,
    RankOutcome,
    all_gather_objects,
    function_name,
)
from fsdp_conformance.harness.timeouts import fit_timeout

#: The variables torchrun (and a launch by hand) sets for each rank.
TORCH_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
#: The variables srun sets for each task, and the ones its user sets for the launch's store.
SLURM_LAUNCH_VARIABLES = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
SLURM_STORE_VARIABLES = ("MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class LaunchEnvironment:
    """What an external launcher told this process about the launch it is one rank of."""

    rank: int
    world_size: int
    local_rank: int
    #: The launch's ranks on this node (``LOCAL_WORLD_SIZE``, srun's ``SLURM_NTASKS_PER_NODE``
    #: where it is one number), None where the launcher did not say.
    local_world_size: int | None
    master_addr: str
    master_port: int | None
    #: torchrun's agent hosts the launch's TCP store at ``MASTER_PORT``
    #: (``TORCHELASTIC_USE_AGENT_STORE=True``); otherwise rank 0 hosts it.
    agent_store: bool
    #: Names this launch among others on the same store (torchrun's run id and restart).
    run_id: str
    #: Which variables said so: ``RANK/WORLD_SIZE/LOCAL_RANK`` or ``SLURM_PROCID/...``.
    source: str


def launch_environment(environ: Mapping[str, str] | None = None) -> LaunchEnvironment | None:
    """The launch this process is one rank of, or None.

    torchrun (or any launcher setting ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
    ``MASTER_ADDR``) first; else an srun task (``SLURM_PROCID``, ``SLURM_NTASKS``,
    ``SLURM_LOCALID``) whose user set ``MASTER_ADDR`` and ``MASTER_PORT`` for the launch's store
    (an srun task without them, or a shell inside an allocation, is not a launch)."""
    env = os.environ if environ is None else environ
    if all(k in env for k in TORCH_LAUNCH_VARIABLES):
        local = env.get("LOCAL_WORLD_SIZE", "")
        restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        return LaunchEnvironment(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env["LOCAL_RANK"]),
            local_world_size=int(local) if local.isdigit() else None,
            master_addr=env["MASTER_ADDR"],
            master_port=int(env["MASTER_PORT"]) if env.get("MASTER_PORT", "").isdigit() else None,
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            run_id=f"{env.get('TORCHELASTIC_RUN_ID', 'env')}.{restart}",
            source="RANK/WORLD_SIZE/LOCAL_RANK",
        )
    if all(k in env for k in SLURM_LAUNCH_VARIABLES + SLURM_STORE_VARIABLES):
        per_node = env.get("SLURM_NTASKS_PER_NODE", "")
        return LaunchEnvironment(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env["SLURM_LOCALID"]),
            local_world_size=int(per_node) if per_node.isdigit() else None,
            master_addr=env["MASTER_ADDR"],
            master_port=int(env["MASTER_PORT"]) if env["MASTER_PORT"].isdigit() else None,
            agent_store=False,
            run_id=f"{env.get('SLURM_JOB_ID', 'slurm')}.{env.get('SLURM_STEP_ID', '0')}",
            source="SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID",
        )
    return None


def launched_externally(environ: Mapping[str, str] | None = None) -> bool:
    """True when an external launcher (torchrun, srun) started this process as one rank
    (:func:`launch_environment`)."""
    return launch_environment(environ) is not None


def ranks_on_this_node(environ: Mapping[str, str]) -> tuple[int, str]:
    """How many ranks of the launch run on this node, and where that number came from:
    ``LOCAL_WORLD_SIZE`` (torchrun sets it; srun's ``SLURM_NTASKS_PER_NODE``), else the
    launch's world size (one node)."""
    launch = launch_environment(environ)
    local = environ.get("LOCAL_WORLD_SIZE")
    if local:
        return int(local), f"LOCAL_WORLD_SIZE={local}"
    if launch is not None and launch.local_world_size is not None:
        return launch.local_world_size, f"SLURM_NTASKS_PER_NODE={launch.local_world_size}"
    world = environ.get("WORLD_SIZE") or environ.get("SLURM_NTASKS", "1")
    return int(world), f"WORLD_SIZE={world}, LOCAL_WORLD_SIZE unset"


def devices_bound_per_task(environ: Mapping[str, str]) -> bool:
    """Whether the launcher gave each task its own devices: an ``srun`` task
    (``SLURM_LOCALID``) with ``CUDA_VISIBLE_DEVICES`` set, as ``--gpus-per-task`` or
    ``--gpu-bind`` do. Then a rank that sees fewer devices than its node has ranks still has
    one of its own; if the tasks in fact share one, NCCL refuses at the group's start
    ("Duplicate GPU detected")."""
    return "SLURM_LOCALID" in environ and bool(environ.get("CUDA_VISIBLE_DEVICES"))


def launch_gpu_unavailable(environ: Mapping[str, str], visible: int) -> str | None:
    """Why a launched rank cannot run the gpu lane with ``visible`` CUDA devices, or None.

    Every rank needs a device of its own, so the ranks of this node (not of the launch: a
    2-node launch of 2 ranks per node needs 2 GPUs per node) are compared with the devices
    this process sees, unless each task sees its own (:func:`devices_bound_per_task`).
    """
    here, source = ranks_on_this_node(environ)
    if here <= visible or devices_bound_per_task(environ):
        return None
    return (
        f"gpu lane: this node runs {here} ranks of the launch ({source}) and this process sees "
        f"{visible} CUDA device{'' if visible == 1 else 's'} (one rank per device); launch at "
        f"most {visible} rank{'' if visible == 1 else 's'} per node (torchrun "
        f"--nproc-per-node {visible}), or give each rank its own GPU (srun --gpus-per-task=1)"
    )


def launch_device_index(local_rank: int, visible: int) -> int:
    """The CUDA device of a launched rank: ``LOCAL_RANK`` modulo the devices it sees.

    torchrun's ranks of a node all see every device (rank ``i`` takes ``cuda:i``); an srun
    task given one GPU (``--gpus-per-task=1``) sees only that one, as ``cuda:0``, whatever its
    ``LOCAL_RANK``.
    """
    if visible < 1:
        raise HarnessError(f"LOCAL_RANK {local_rank} needs a CUDA device; this process sees none")
    return local_rank % visible


def launch_backend(backend: str | None, local_rank: int) -> tuple[str, str, int | None]:
    """A launched rank's backend (``backend``, or by the machine: NCCL where CUDA is
    available, else gloo), device type and CUDA device (:func:`launch_device_index`; None on
    CPU)."""
    import torch

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend != "nccl":
        return backend, "cpu", None
    return backend, "cuda", launch_device_index(local_rank, torch.cuda.device_count())


def launch_mismatch(request: RankRequest, world_size: int, backend: str) -> str | None:
    """Why a launch of ``world_size`` ranks on ``backend`` cannot run a check asking for
    ``request``, or None: a launch has one world size (``WORLD_SIZE``) and one backend on one
    device type (a gpu lane on gloo, or a cpu lane on nccl, would test the wrong thing or
    crash)."""
    if request.world_size != world_size:
        return f"world size {request.world_size} is not this launch's (WORLD_SIZE={world_size})"
    device_type = "cuda" if backend == "nccl" else "cpu"
    if request.device_type != device_type:
        return (
            f"{request.lane} lane: this launch's process group is {backend} "
            f"on {device_type}; run the {request.lane} lane in its own launch "
            f"(e.g. torchrun ... -m pytest -m {request.lane} --fsdp-backend "
            f"{'nccl' if request.lane == 'gpu' else 'gloo'})"
        )
    return None


def process_group_options(
    device_type: str, device_index: int | None, pg_timeout: float | None
) -> dict[str, Any]:
    """``init_process_group``'s keyword arguments for the launch's group: its ``timeout``
    (``pg_timeout`` seconds; None: torch's default) and, on CUDA, ``device_id`` (this rank's
    device: NCCL binds the group to it and connects at once)."""
    from datetime import timedelta

    options: dict[str, Any] = {}
    if pg_timeout is not None:
        options["timeout"] = timedelta(seconds=pg_timeout)
    if device_type == "cuda" and device_index is not None:
        import torch

        options["device_id"] = torch.device("cuda", device_index)
    return options


#: Exit status of a launched rank whose check did not finish within its timeout (the
#: ``timeout`` command's): the harness's watchdog wrote every thread's stack before it.
HANG_EXIT_STATUS = 124
#: Seconds a rank's watchdog waits after writing its stacks before it ends the rank: the
#: launcher ends the whole launch at the first rank's exit, and the other ranks' watchdogs,
#: armed within moments of this one (the ranks leave the previous check's outcome exchange,
#: or the group's start, together), must have written theirs by then.
EXIT_GRACE_S = 2.0


@contextlib.contextmanager
def _stderr() -> Iterator[TextIO]:
    yield sys.stderr


class CheckWatchdog:
    """Ends a launched rank whose check does not finish within ``timeout`` seconds, stacks first.

    A launched rank has no parent watching it, and a rank stuck in a collective or a CUDA wait
    is inside torch's C++ code, where pytest-timeout's signal handler never runs. A watchdog
    thread does: torch releases the GIL in those waits. On expiry it writes one line naming
    the check, the rank and the timeout, then every thread's stack (``faulthandler``), to
    ``stream()`` (a context manager giving the stream: the plugin's suspends pytest's
    capture, which would otherwise swallow it), and ends the process with
    :data:`HANG_EXIT_STATUS` through ``end``. Every rank runs its own watchdog with the same
    timeout, so every rank's stack is written: the stuck one's where it is stuck, the others'
    where they wait for it (the outcome exchange). The launcher then ends the launch. A hang
    that holds the GIL (not torch's waits) is not caught; the process group's timeout applies.
    """

    def __init__(
        self,
        what: str,
        rank: int,
        timeout: float,
        note: str = "",
        stream: Callable[[], contextlib.AbstractContextManager[TextIO]] = _stderr,
        end: Callable[[int], Any] = os._exit,
        grace: float = EXIT_GRACE_S,
    ) -> None:
        self.what, self.rank, self.timeout, self.note = what, rank, timeout, note
        self.grace = grace
        self._stream, self._end = stream, end
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, daemon=True, name="fsdp-conformance-watchdog"
        )

    def __enter__(self) -> CheckWatchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        if self._done.wait(self.timeout):
            return
        # Dumped to a file first and written out at once: every rank dumps at the same moment
        # into what is often one stream (torchrun's), and faulthandler writes piecemeal.
        with tempfile.TemporaryFile("w+") as dump:
            faulthandler.dump_traceback(file=dump, all_threads=True)
            dump.seek(0)
            stacks = dump.read()
        with self._stream() as out:
            out.write(
                f"\nfsdp-conformance: check {self.what} did not finish within "
                f"{self.timeout:g} s{self.note} on rank {self.rank} of the launch; every "
                f"thread's stack follows, then this rank ends with exit status "
                f"{HANG_EXIT_STATUS} (each rank writes its own; raise --fsdp-timeout / "
                f"--timeout if the check needs longer)\n{stacks}"
            )
            out.flush()
        time.sleep(self.grace)
        self._end(HANG_EXIT_STATUS)


class LauncherRunner:
    """Run checks in-process on the launcher's ``env://`` process group.

    Every rank runs the same pytest session; each check's outcome on every rank is all-gathered
    so that every rank reaches the same verdict. A check (with its outcome exchange) that does
    not finish within its timeout ends the rank with every thread's stack
    (:class:`CheckWatchdog`).
    """

    def __init__(
        self,
        backend: str | None = None,
        *,
        pg_timeout: float | None = None,
        hang_stream: Callable[[], contextlib.AbstractContextManager[TextIO]] = _stderr,
    ) -> None:
        """``pg_timeout``: the timeout of the launch's process group, in seconds (the plugin
        passes ``pool.pg_timeout_for`` its check timeout); None keeps torch's default. Both it
        and the rank's device (``device_id``) apply only where this runner starts the group.
        ``hang_stream``: where a stuck check's stacks go (:class:`CheckWatchdog`)."""
        self.hang_stream = hang_stream
        import torch
        import torch.distributed as dist

        env = os.environ
        self.rank = int(env["RANK"])
        self.world_size = int(env["WORLD_SIZE"])
        self.local_rank = int(env["LOCAL_RANK"])
        #: This rank's CUDA device (None on CPU): LOCAL_RANK modulo the devices it sees.
        self.device_index: int | None
        backend, self.device_type, self.device_index = launch_backend(backend, self.local_rank)
        self.backend = backend
        if self.device_index is not None:
            torch.cuda.set_device(self.device_index)
        #: Whether this runner started the launch's group, and so ends it in :meth:`close`
        #: (a runner made where the group is up already joins it and leaves it alone).
        self.owns_group = not dist.is_initialized()
        if self.owns_group:
            dist.init_process_group(
                backend,
                init_method="env://",
                **process_group_options(self.device_type, self.device_index, pg_timeout),
            )
            # Every rank leaves here together, so the first check's watchdogs are armed
            # together too (EXIT_GRACE_S); later checks start from the last one's exchange.
            dist.barrier()
        self.ctx = RankContext(
            self.rank,
            self.world_size,
            self.local_rank,
            backend,
            self.device_type,
            self.device_index,
        )

    def cannot_provide(self, request: RankRequest) -> str | None:
        """Why a check asking for ``request`` cannot be judged in this launch, or None.

        A launch has one world size (``WORLD_SIZE``) and one process group, on one device type:
        a gpu lane on gloo, or a cpu lane on nccl (CPU tensors in NCCL collectives), would test
        the wrong thing or crash. Its processes are not fresh, and settings such as
        ``MALLOC_MMAP_THRESHOLD_`` take effect only if present when the process starts, so what
        counts is the environment each rank *started* with (``/proc/self/environ``), not
        ``os.environ`` now. Every rank's answer on the environment is all-gathered: a
        collective, so every rank runs the check or every rank skips it, with one reason.
        """
        mismatch = launch_mismatch(request, self.world_size, self.backend)
        if mismatch is not None:
            return mismatch
        if request.fresh:
            return (
                "needs fresh rank processes, which an external launcher's ranks are not; "
                "run it without the launcher (`fsdp-conformance run` or `pytest` starts "
                "its own ranks)"
            )
        return self._missing_at_start(request.env) if request.env else None

    def _missing_at_start(self, env: Mapping[str, str]) -> str | None:
        started = startup_environ()
        missing = sorted(f"{k}={v}" for k, v in env.items() if started.get(k) != v)
        gathered = all_gather_objects((self.rank, missing), self.device_type)
        lacking = [rank for rank, m in gathered if m]
        if not lacking:
            return None
        wanted = " ".join(f"{k}={v}" for k, v in sorted(env.items()))
        found = sorted({item for _, m in gathered for item in m})
        return (
            f"needs {', '.join(found)} set before the ranks start (rank"
            f"{'s' if len(lacking) > 1 else ''} {', '.join(map(str, lacking))} started "
            f"without it); launch with `{wanted} torchrun ...` to run it"
        )

    def close(self) -> None:
        """End the launch's process group if this runner started it (the launcher itself ends
        the processes): at the end of ``fsdp-conformance run`` and of a launched pytest
        session."""
        import torch.distributed as dist

        if getattr(self, "owns_group", True) and dist.is_initialized():
            dist.destroy_process_group()

    def run_outcomes(
        self,
        request: RankRequest,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> list[RankOutcome]:
        """Every rank's outcome of ``fn``, run in this process on the launch's group; past
        ``request.timeout`` seconds (cut to end before ``request.deadline``) the rank ends with
        its stacks (:class:`CheckWatchdog`, whose line says why the timeout was cut)."""
        timeout, note = fit_timeout(request.timeout, request.deadline, request.deadline_note)
        note = request.timeout_note + note
        with CheckWatchdog(function_name(fn), self.rank, timeout, note, self.hang_stream):
            return self._run_outcomes(fn, args, kwargs)

    def _run_outcomes(
        self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> list[RankOutcome]:
        from fsdp_conformance.harness import interrupts
        from fsdp_conformance.harness.worker import execute_check

        # Ctrl-C during the check stops the session here (every rank got it from the terminal
        # or from torchrun), not as this rank's error followed by the next check.
        status, value, detail, caught = execute_check(
            fn, self.ctx, args, kwargs, reraise_interrupts=True
        )
        interrupted = interrupts.pending()
        if interrupted is not None:
            raise interrupted  # an interrupt the check itself swallowed: stop, not at the next
        mine = RankOutcome(self.rank, status, value, detail, tuple(caught))
        try:
            pickle.dumps(mine)
        except Exception as exc:  # noqa: BLE001 - must still join the all-gather, or all hang
            detail = UNPICKLABLE_VALUE.format(exc=exc)
            mine = RankOutcome(self.rank, "error", detail=detail, warnings=mine.warnings)
        return all_gather_objects(mine, self.device_type)


def startup_environ() -> dict[str, str]:
    """The environment this process started with (Linux: ``/proc/self/environ``)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return dict(os.environ)  # no procfs: the best we can see
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}
