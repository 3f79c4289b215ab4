"""What both sides of the harness share: the parent (pool, launcher) and the rank (worker).

A neutral module: it imports nothing from the package, so the worker and the pool each import
it instead of each other. It holds what a check sees on its rank (:class:`RankContext`,
:func:`skip_rank`), what a rank reports (:class:`RankOutcome`), and the helpers both sides use.
"""

from __future__ import annotations

import dataclasses
import pickle
import sys
import traceback
import types
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
    #: Warnings the check emitted on this rank (:func:`warning_text`), deprecations among them.
    warnings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == "ok"


#: Warning categories that announce an API going away.
DEPRECATION_CATEGORIES = ("DeprecationWarning", "FutureWarning", "PendingDeprecationWarning")
#: Modules between the torch call and the warning that name no API of their own (decorators,
#: the warning machinery, this module).
_TRANSPARENT = frozenset({"warnings", "typing_extensions", "functools", "contextlib", __name__})


def called_torch_api(frame: types.FrameType | None) -> str | None:
    """The torch function the check's own code called that raised a warning, from the frame of
    the warning machinery outward: the outermost torch frame below the first frame outside
    torch (``torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel.
    state_dict_type``), a decorator's wrapper passed over for the function it wraps; None when
    the warning was raised outside torch."""
    api = wrapper = None
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module == "torch" or module.startswith("torch."):
            code = frame.f_code
            name = f"{module}.{getattr(code, 'co_qualname', code.co_name)}"
            # a decorator's wrapper (``...<locals>.wrapper``) names no API: the function it
            # wraps, below it, does
            if "<locals>" in name:
                wrapper = wrapper or name
            else:
                api = name
        elif module not in _TRANSPARENT and module.split(".", 1)[0] not in _TRANSPARENT:
            break  # the caller: the torch frames below it, or none
        frame = frame.f_back
    return api or wrapper


def warning_text(category: type[Warning], message: Warning | str, api: str | None) -> str:
    """A warning as a rank reports it: ``Category: message``, and for a deprecation the torch
    call it came through, ``... [called as torch.x.f]`` (compare groups deprecations by it)."""
    text = f"{category.__name__}: {message}"
    if api and category.__name__ in DEPRECATION_CATEGORIES:
        text += f" [called as {api}]"
    return text


def recording_warnings(into: list[str]) -> Callable[..., None]:
    """A ``warnings.showwarning`` that appends each warning's :func:`warning_text` to ``into``
    (used inside ``warnings.catch_warnings``, which puts the original back)."""

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        api = None
        if category.__name__ in DEPRECATION_CATEGORIES:
            api = called_torch_api(sys._getframe(1))
        into.append(warning_text(category, message, api))

    return show


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
