"""What both sides of the harness share: the parent (pool, launcher) and the rank (worker).

A neutral module: it imports nothing from the package, so the worker and the pool each import
it instead of each other. It holds what a check sees on its rank (:class:`RankContext`,
:func:`skip_rank`), what a rank reports (:class:`RankOutcome`), and the helpers both sides use.
"""

from __future__ import annotations

import dataclasses
import pickle
import traceback
from collections.abc import Callable
from typing import Any

UNPICKLABLE_VALUE = (
    "the check returned a value that cannot be pickled ({exc}); "
    "return plain data (dicts, lists, numbers, strings)"
)
#: Set by a rank process while it imports the parent's ``__main__`` script.
loading_parent_main = False


# --------------------------------------------------------------------------------------------
# What a check sees on its rank
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RankContext:
    """Where a check runs: passed as the first argument of every check function."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    #: The compute device of this rank: ``cpu`` on gloo, ``cuda:<device_index>`` on NCCL.
    device_type: str
    #: This rank's CUDA device, where it is not ``cuda:<local_rank>``: the rank-th device of a
    #: pool's slice (a pytest-xdist worker's), ``LOCAL_RANK`` modulo the devices a launched
    #: rank sees (one GPU per task). ``None``: ``local_rank``.
    device_index: int | None = None

    @property
    def device(self) -> Any:
        import torch

        if self.device_type == "cuda":
            index = self.local_rank if self.device_index is None else self.device_index
            return torch.device("cuda", index)
        return torch.device(self.device_type)


class CheckSkipped(Exception):
    """Raised by a check on a rank (``skip_rank``) or by the runner when every rank skipped."""


def skip_rank(reason: str) -> None:
    """Skip the check on this rank (e.g. a feature missing in this torch)."""
    raise CheckSkipped(reason)


@dataclasses.dataclass(frozen=True)
class RankOutcome:
    """What one rank did for one check."""

    rank: int
    status: str  # "ok" | "error" | "skip" | "died" | "hung" | "silent" | "leaked"
    value: Any = None
    detail: str = ""  # traceback, skip reason, death cause, or stack dump
    #: Warnings the check emitted on this rank ("Category: message"), deprecations among them.
    warnings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def function_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def all_gather_objects(obj: Any, device_type: str) -> list[Any]:
    """All-gather picklable objects without numpy (``all_gather_object`` needs it)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else "cpu"
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device))
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    chunks = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(chunks, padded)
    return [
        pickle.loads(bytes(chunk[: int(size.item())].cpu().tolist()))
        for chunk, size in zip(chunks, sizes)
    ]


def traceback_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
