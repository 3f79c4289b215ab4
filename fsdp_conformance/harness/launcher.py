"""What an external launcher (``torchrun``, ``srun``) told this process about its launch.

The launch's environment (:func:`launch_environment`: torchrun's ``RANK``/``WORLD_SIZE``/
``LOCAL_RANK``/``MASTER_ADDR``, or srun's ``SLURM_*`` with ``MASTER_ADDR``/``MASTER_PORT``),
the ranks and CUDA devices of this node, and what a launch cannot run. The launched process
supervises its rank's child (:mod:`.supervisor`), which runs the checks.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from fsdp_conformance.harness.engine import RankRequest
from fsdp_conformance.harness.outcomes import HarnessError

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
    (an srun task without them, a shell inside an allocation, or a step of one task, which
    starts its own ranks as anywhere else, is not a launch)."""
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
    if (
        all(k in env for k in SLURM_LAUNCH_VARIABLES + SLURM_STORE_VARIABLES)
        and env["SLURM_NTASKS"] != "1"
    ):
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


def startup_environ() -> dict[str, str]:
    """The environment this process started with (Linux: ``/proc/self/environ``)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return dict(os.environ)  # no procfs: the best we can see
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}
