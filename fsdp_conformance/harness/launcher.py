"""In-process mode: the processes were started by an external launcher (``torchrun``, ``srun``).

The check runs in-process on the ``env://`` process group and every rank's outcome is
all-gathered, so every rank's pytest sees the same verdict.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fsdp_conformance.harness.protocol import (
    UNPICKLABLE_VALUE,
    RankContext,
    RankOutcome,
    all_gather_objects,
)


def launched_externally(environ: Mapping[str, str] | None = None) -> bool:
    """True when an external launcher (torchrun, srun) started this process as one rank."""
    env = os.environ if environ is None else environ
    return all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


class LauncherRunner:
    """Run checks in-process on the launcher's ``env://`` process group.

    Every rank runs the same pytest session; each check's outcome on every rank is all-gathered
    so that every rank reaches the same verdict. A hang here is caught by pytest-timeout.
    """

    def __init__(self, backend: str | None = None) -> None:
        import torch
        import torch.distributed as dist

        env = os.environ
        self.rank = int(env["RANK"])
        self.world_size = int(env["WORLD_SIZE"])
        self.local_rank = int(env["LOCAL_RANK"])
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.backend = backend
        self.device_type = "cuda" if backend == "nccl" else "cpu"
        if self.device_type == "cuda":
            torch.cuda.set_device(self.local_rank)
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method="env://")
        self.ctx = RankContext(
            self.rank, self.world_size, self.local_rank, backend, self.device_type
        )

    def cannot_provide(self, env: Mapping[str, str] | None, fresh: bool) -> str | None:
        """Why a check needing ``env`` (or fresh processes) cannot be judged in this launch.

        Settings such as ``MALLOC_MMAP_THRESHOLD_`` take effect only if present when the
        process starts, so what counts is the environment each rank *started* with
        (``/proc/self/environ``), not ``os.environ`` now. Every rank's answer is all-gathered:
        a collective, so every rank runs the check or every rank skips it, with one reason.
        """
        if fresh:
            return ("needs fresh rank processes, which an external launcher's ranks are not; "
                    "run it without the launcher (`fsdp-conformance run` or `pytest` starts "
                    "its own ranks)")
        if not env:
            return None
        started = startup_environ()
        missing = sorted(f"{k}={v}" for k, v in env.items() if started.get(k) != v)
        gathered = all_gather_objects((self.rank, missing), self.device_type)
        lacking = [rank for rank, m in gathered if m]
        if not lacking:
            return None
        wanted = " ".join(f"{k}={v}" for k, v in sorted(env.items()))
        found = sorted({item for _, m in gathered for item in m})
        return (f"needs {', '.join(found)} set before the ranks start (rank"
                f"{'s' if len(lacking) > 1 else ''} {', '.join(map(str, lacking))} started "
                f"without it); launch with `{wanted} torchrun ...` to run it")

    def close(self) -> None:
        """Leave the launcher's process group (the launcher itself ends the processes)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def run_outcomes(
        self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> list[RankOutcome]:
        from fsdp_conformance.harness import interrupts
        from fsdp_conformance.harness.worker import execute_check

        # Ctrl-C during the check stops the session here (every rank got it from the terminal
        # or from torchrun), not as this rank's error followed by the next check.
        status, value, detail, caught = execute_check(
            fn, self.ctx, args, kwargs, reraise_interrupts=True)
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

