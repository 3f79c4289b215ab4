"""Capabilities: what a torch version cannot do is a skip naming it, on every
rank, never an error; anything else stays an error.

Measured for real on torch 2.6.0 (`fsdp-conformance run`, CPU, world size 2: 36 passed, 30
skipped by capability, 1 expected failure, 0 errors; without the capability skips: 17 errors);
here, on the pinned torch, the probes find both features and a missing one is simulated.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp_conformance.fsdp import capabilities
from fsdp_conformance.fsdp.capabilities import Capability, require
from fsdp_conformance.harness import CheckSkipped

pytestmark = pytest.mark.cpu


def test_the_pinned_torch_has_every_capability_the_checks_need() -> None:
    assert capabilities.FSDP2_ON_CPU.present
    assert capabilities.DCP_NO_DIST.present
    require(capabilities.FSDP2_ON_CPU, "cpu")  # no skip
    require(capabilities.DCP_NO_DIST)


def test_a_missing_capability_is_a_skip_naming_it_the_torch_and_where_it_was_measured() -> None:
    missing = Capability("a feature", "torch.thing.attr", "first seen in 9.9.0", lambda: False)
    with pytest.raises(CheckSkipped) as info:
        require(missing)
    said = str(info.value)
    assert said.startswith(
        f"capability 'a feature' is not in torch {torch.__version__} "
        "(needs torch.thing.attr; first seen in 9.9.0): skipped by "
        "capability, not a failure"
    ), said


def test_a_probe_that_raises_finds_nothing_and_fsdp2_on_gpu_is_not_asked_about_cpu() -> None:
    def broken() -> bool:
        raise RuntimeError("no such module")

    assert not Capability("b", "c", "d", broken).present
    # FSDP2 on CUDA tensors does not need the CPU stream: no skip there whatever the probe says.
    require(capabilities.FSDP2_ON_CPU, "cuda")


def test_the_cpu_stream_probe_reads_torch_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    class OldStream:  # torch 2.6's torch.cpu.Stream: no record_event
        pass

    monkeypatch.setattr(torch.cpu, "current_stream", lambda *a, **k: OldStream())
    assert not capabilities._cpu_stream_records_events()


def test_the_dcp_probe_reads_the_load_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.checkpoint import state_dict_loader

    def old_load(state_dict: Any, *, storage_reader: Any = None) -> None:  # torch 2.6's
        return None

    monkeypatch.setattr(state_dict_loader, "load", old_load)
    assert not capabilities._dcp_loads_without_a_group()


def test_pinned_host_memory_is_there_exactly_where_torch_has_a_gpu_and_its_skip_says_so() -> None:
    # FSDP1's CPU offload pins its shard: a machine without a GPU cannot (this one, CI's).
    assert capabilities.PINNED_HOST_MEMORY.present == torch.cuda.is_available()
    if not torch.cuda.is_available():
        with pytest.raises(
            CheckSkipped,
            match=r"capability 'pinned host memory' is not in torch "
            r".*skipped by capability, not a failure; run it on a machine with a "
            r"GPU$",
        ):
            require(capabilities.PINNED_HOST_MEMORY)


def test_the_unused_params_probe_reads_fsdp2s_module_class(monkeypatch: pytest.MonkeyPatch) -> None:
    # The pinned torch has it; 2.8.0, 2.10.0 and 2.12.1 lack it (loop.frozen.unused skips there).
    from fsdp_conformance import _compat

    assert capabilities.FSDP2_REDUCE_SCATTER_UNUSED_PARAMS.present
    monkeypatch.delattr(_compat.fsdp_module_cls(), "set_reduce_scatter_unused_params")
    assert not capabilities._fsdp2_reduces_unused_params()
