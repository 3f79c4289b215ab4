"""What this torch can do, detected once, so a check it cannot run skips instead of erroring.

A capability is a feature some supported torch versions lack (FSDP2 on CPU, an argument a
newer API takes), with a probe that reads torch itself (no version table) and the versions it
was measured on. :func:`require` skips the check on this rank, naming the capability, what is
missing and the first version measured to have it; every rank runs the same torch, so every
rank skips alike, before any collective of the capability's own. Anything else that goes wrong
stays an error: a probe answers only "is the feature there", never "did it work".
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable

import torch

from fsdp_conformance import _compat
from fsdp_conformance.harness import skip_rank


@dataclasses.dataclass(frozen=True)
class Capability:
    """A feature some supported torch versions lack."""

    name: str
    #: What the probe looks for, in words.
    needs: str
    #: Where it was measured: the first version seen with it, and those seen without.
    measured: str
    #: True when this torch has it; read once per process.
    probe: Callable[[], bool] = dataclasses.field(compare=False, repr=False)
    #: Where to run a check that needs it.
    remedy: str = "run it on a torch that has it"

    @property
    def present(self) -> bool:
        return _probe(self)


@functools.cache
def _probe(capability: Capability) -> bool:
    try:
        return bool(capability.probe())
    except Exception:  # noqa: BLE001 - a probe that cannot look finds nothing there
        return False


def _cpu_stream_records_events() -> bool:
    stream_module = getattr(torch, "cpu", None)
    current = getattr(stream_module, "current_stream", None)
    return current is not None and hasattr(current(), "record_event")


def _pins_host_memory() -> bool:
    torch.empty(1).pin_memory()  # raises where torch has no accelerator to pin through
    return True


def _dcp_loads_without_a_group() -> bool:
    from torch.distributed.checkpoint.state_dict_loader import load

    return "no_dist" in inspect.signature(load).parameters


#: FSDP2 (``fully_shard``) on CPU tensors: it records events on the device's current stream,
#: which torch 2.6's CPU stream cannot ("'Stream' object has no attribute 'record_event'").
FSDP2_ON_CPU = Capability(
    "FSDP2 on CPU",
    "torch.cpu.Stream.record_event, which fully_shard uses on CPU",
    "first seen in 2.8.0; missing in 2.6.0 (2.7 not measured)",
    _cpu_stream_records_events,
)
#: Pinned host memory, which FSDP1's ``CPUOffload(offload_params=True)`` keeps its offloaded
#: shard in: torch pins through an accelerator, so a machine without one has none (FSDP1 refuses
#: the offload at construction or at its first forward). A property of the machine as much as
#: of torch.
PINNED_HOST_MEMORY = Capability(
    "pinned host memory",
    "an accelerator to pin host memory through (Tensor.pin_memory), "
    "which FSDP1's CPUOffload pins its offloaded shard in",
    "missing without a GPU: 2.13.0's CPU wheel ('Cannot access accelerator device when none is "
    "available'), the 2.14.1 and 2.15.0 CUDA wheels ('Found no NVIDIA driver on your system')",
    _pins_host_memory,
    remedy="run it on a machine with a GPU",
)
#: Loading a distributed checkpoint in one process without a process group (``no_dist``).
DCP_NO_DIST = Capability(
    "torch.distributed.checkpoint.load(no_dist=True)",
    "the no_dist argument of dcp.load",
    "present in 2.8.0 to 2.15.0 (the torch matrix); missing in 2.6.0",
    _dcp_loads_without_a_group,
)


def _fully_shard_ignores_params() -> bool:
    return "ignored_params" in inspect.signature(_compat.fully_shard()).parameters


def _fsdp2_sets_gradient_divide_factor() -> bool:
    return callable(getattr(_compat.fsdp_module_cls(), "set_gradient_divide_factor", None))


#: FSDP2's ``fully_shard(..., ignored_params={...})``: parameters left local and unsharded.
FSDP2_IGNORED_PARAMS = Capability(
    "fully_shard(ignored_params=...)",
    "the ignored_params argument of torch.distributed.fsdp.fully_shard",
    "present in 2.8.0 to 2.15.0 (the torch matrix)",
    _fully_shard_ignores_params,
)
#: FSDP2's ``FSDPModule.set_gradient_divide_factor``: the user's divisor of the reduced gradients.
FSDP2_GRADIENT_DIVIDE_FACTOR = Capability(
    "FSDPModule.set_gradient_divide_factor",
    "torch.distributed.fsdp.FSDPModule.set_gradient_divide_factor",
    "present in 2.8.0 to 2.15.0 (the torch matrix)",
    _fsdp2_sets_gradient_divide_factor,
)


def _fsdp2_reduces_unused_params() -> bool:
    return callable(getattr(_compat.fsdp_module_cls(), "set_reduce_scatter_unused_params", None))


#: FSDP2's ``FSDPModule.set_reduce_scatter_unused_params``: a zero gradient reduced for a
#: parameter this rank did not use, so ranks that use different parameters still issue
#: reduce-scatters of one size.
FSDP2_REDUCE_SCATTER_UNUSED_PARAMS = Capability(
    "FSDPModule.set_reduce_scatter_unused_params",
    "FSDPModule.set_reduce_scatter_unused_params (ranks using different parameters otherwise "
    "reduce-scatter different sizes)",
    "present in 2.13.0, 2.14.1 and 2.15.0; missing in 2.8.0, 2.10.0 and 2.12.1",
    _fsdp2_reduces_unused_params,
)


def require(capability: Capability, device_type: str | None = None) -> None:
    """Skip the check on this rank when this torch lacks ``capability`` (``FSDP2_ON_CPU``
    applies to CPU tensors only: pass the rank's device type)."""
    if capability is FSDP2_ON_CPU and device_type not in (None, "cpu"):
        return
    if not capability.present:
        skip_rank(
            f"capability {capability.name!r} is not in torch {torch.__version__} "
            f"(needs {capability.needs}; {capability.measured}): skipped by capability, "
            f"not a failure; {capability.remedy}"
        )
