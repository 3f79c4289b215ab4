"""The memory building blocks: one set of meters, shared by the memory and init claims.

The bound (``bound``), its inputs on meta (``profile``), the meters (``meters``), the timeline
(``timeline``) and the measured step (``step``) are library modules; the claims read memory only
through them, so a fix to a meter reaches every check that reads it.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import pytest
import torch
from package_imports import file_imports

import fsdp_conformance
from fsdp_conformance.harness import RankContext, Ranks
from fsdp_conformance.measure.meters import host_or_cuda_peak
from fsdp_conformance.models.model_spec import ModelSpec

PACKAGE = pathlib.Path(fsdp_conformance.__file__).parent
BLOCKS = ("bound", "profile", "meters", "timeline", "step")
CLAIMS = ("fsdp_conformance.claims", "fsdp_conformance.planning", "fsdp_conformance.suite")
MB = 10**6

needs_clear_refs = pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"),
    reason="the host peak meter resets VmHWM through Linux /proc/self/clear_refs",
)


@pytest.mark.parametrize("block", BLOCKS)
def test_memory_blocks_import_no_claim(block: str) -> None:
    # A block that imported a claim would make the claims a library (init reaching into the
    # memory claim for its meters, say): the meters are measure/'s, the claims import them.
    found = sorted(
        m for m in file_imports(PACKAGE / "measure" / f"{block}.py") if m.startswith(CLAIMS)
    )
    assert not found, f"{block}.py imports {found}"


@pytest.mark.parametrize("claim", ("init", "memory"))
def test_claims_keep_no_copy_of_the_meters(claim: str) -> None:
    # The peak readings come from meters.py alone: no claim resets or reads a peak itself.
    # A claim is a module or a folder of check-family modules.
    folder = PACKAGE / "claims" / claim
    paths = sorted(folder.glob("*.py")) if folder.is_dir() else [folder.with_suffix(".py")]
    source = "".join(p.read_text(encoding="utf-8") for p in paths)
    for reader in (
        "max_memory_allocated",
        "reset_peak_memory_stats",
        "class OSMeter",
        "class CudaMeter",
        "def status_bytes",
        "def reset_peak_rss",
    ):
        assert reader not in source, f"{claim}.py has its own {reader!r}: use meters.py"


@needs_clear_refs
def test_host_peak_reads_a_freed_allocation_and_what_the_block_kept() -> None:
    ctx = RankContext(0, 1, 0, "gloo", "cpu")
    # 64 MB is above glibc's largest dynamic mmap threshold (32 MB), so it is its own mapping
    # and leaves the RSS when freed, with or without MALLOC_MMAP_THRESHOLD_ in this process.
    with host_or_cuda_peak(ctx) as reading:
        big = torch.ones(16 * 2**20)  # 64 MiB, touched
        del big
        kept = torch.ones(4 * 2**20)  # 16 MiB, still held at the end
    assert reading["meter"] == "VmHWM"
    assert reading["peak"] >= 60 * MB, reading
    assert 12 * MB <= reading["kept"] < 60 * MB, reading
    assert kept.numel() == 4 * 2**20


@needs_clear_refs
def test_host_peak_of_a_block_that_allocates_nothing_is_small() -> None:
    # Negative control for the test above: the figure is the block's growth, not the RSS.
    ctx = RankContext(0, 1, 0, "gloo", "cpu")
    with host_or_cuda_peak(ctx) as reading:
        pass
    assert reading["meter"] == "VmHWM"
    assert 0 <= reading["peak"] < 8 * MB, reading


def test_cuda_peak_is_relative_to_what_was_allocated_before_the_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No GPU on the CPU lane: the allocator's counters are replaced by a fake one, to pin the
    # arithmetic (peak and kept relative to the allocation at the block's start, the peak
    # counter reset at the start), which init's report data depends on.
    state = {"allocated": 100, "max": 500}

    def alloc(n: int) -> None:
        state["allocated"] += n
        state["max"] = max(state["max"], state["allocated"])

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["max"])
    monkeypatch.setattr(
        torch.cuda,
        "reset_peak_memory_stats",
        lambda device=None: state.update(max=state["allocated"]),
    )
    ctx = RankContext(0, 1, 0, "nccl", "cuda")
    with host_or_cuda_peak(ctx) as reading:
        alloc(70)
        alloc(-50)
    assert reading == {"meter": "cuda allocator", "peak": 70, "kept": 20}


def _tracked_step(cls: type, model: torch.nn.Module) -> dict[str, dict[str, int]]:
    tracker = cls()
    with tracker:
        out = model(torch.randn(4, 32)).sum()
        out.backward()
    cpu = torch.device("cpu")
    return {
        kind: {str(k): v for k, v in tracker.get_tracker_snapshot(kind)[cpu].items()}
        for kind in ("peak", "current")
    }


def test_the_trackers_that_update_only_the_global_peak_give_torchs_snapshots() -> None:
    # The suite's MemTracker skips torch's per-module peak walk after each operator; the
    # snapshots it reads must be torch's own. Many modules, so a walk has something to do.
    from fsdp_conformance import _compat

    lean, full = _compat.mem_tracker_cls(), _compat.mem_tracker_cls(global_peak_only=False)
    assert lean is not None and full is not None
    assert lean is not full and issubclass(lean, full)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU()) for _ in range(12))
    )
    _tracked_step(lean, model)  # first use: lazily made tensors are not the comparison's
    model.zero_grad(set_to_none=True)
    torch_snaps = _tracked_step(full, model)
    model.zero_grad(set_to_none=True)
    lean_snaps = _tracked_step(lean, model)
    assert torch_snaps["peak"]["Total"] > 0, torch_snaps
    assert lean_snaps == torch_snaps


def test_a_global_peak_update_that_skips_an_operator_gives_other_snapshots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Negative control for the comparison above: an update that misses operators (here: those
    # of the backward, where the gradients make the peak) reads a lower peak, and the
    # comparison sees it.
    from fsdp_conformance import _compat

    full = _compat.mem_tracker_cls(global_peak_only=False)
    assert full is not None

    class SkipsBackward(full):  # type: ignore[misc, valid-type]
        def _update_peak_stats(self, peak_state: object) -> None:
            if "BW" not in str(peak_state):
                super()._update_peak_stats(peak_state)

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(6)))
    _tracked_step(full, model)
    model.zero_grad(set_to_none=True)
    torch_snaps = _tracked_step(full, model)
    model.zero_grad(set_to_none=True)
    lower = _tracked_step(SkipsBackward, model)
    assert lower["peak"]["Total"] < torch_snaps["peak"]["Total"], (lower, torch_snaps)


def _fsdp2_tracker_peaks(ctx: RankContext) -> dict[str, Any]:
    from fsdp_conformance import _compat
    from fsdp_conformance.measure.step import measure_step

    spec = ModelSpec(reference=None, factory="fsdp_conformance.hf_models:llama")
    lean = _compat.fsdp_mem_tracker_cls()
    full = _compat.fsdp_mem_tracker_cls(global_peak_only=False)
    own = _compat.fsdp_mem_tracker_cls
    out: dict[str, Any] = {"rank": ctx.rank}
    for name, cls in (("warm-up", lean), ("torch", full), ("lean", lean)):
        _compat.fsdp_mem_tracker_cls = lambda global_peak_only=True, cls=cls: cls
        try:
            meter = measure_step(ctx, spec, "fsdp2", timeline=False)["meters"][0]
        finally:
            _compat.fsdp_mem_tracker_cls = own
        out[name] = {k: meter[k] for k in ("source", "peak", "breakdown")}
    return out


@pytest.mark.world_size(2)
def test_fsdp_mem_tracker_updating_only_the_global_peak_reads_torchs_figures(ranks: Ranks) -> None:
    # The FSDP2 meter on a measured step of a transformers model: peak and per-category
    # breakdown equal torch's own class on every rank.
    for value in ranks.run(_fsdp2_tracker_peaks):
        assert value["torch"]["source"] == "FSDPMemTracker", value
        assert value["torch"]["peak"] > 0, value
        assert value["lean"] == value["torch"], value


# --------------------------------------------------------------------------------------------
# The CUDA meter's figure: requested bytes, proven with a stand-in allocator
# --------------------------------------------------------------------------------------------


class _Allocator:
    """torch.cuda's counters as a caching allocator keeps them: requests rounded up to blocks."""

    def __init__(self, requested: bool = True) -> None:
        self.requested = self.requested_peak = 0
        self.allocated = self.allocated_peak = 0
        self.has_requested = requested

    def alloc(self, nbytes: int) -> None:
        self.requested += nbytes
        self.allocated += -(-nbytes // (2 << 20)) * (2 << 20)  # whole 2 MiB blocks
        self.requested_peak = max(self.requested_peak, self.requested)
        self.allocated_peak = max(self.allocated_peak, self.allocated)

    def stats(self, device: object = None) -> dict[str, int]:
        if not self.has_requested:
            return {"allocated_bytes.all.current": self.allocated}
        return {
            "requested_bytes.all.current": self.requested,
            "requested_bytes.all.peak": self.requested_peak,
            "allocated_bytes.all.current": self.allocated,
        }

    def reset(self, device: object = None) -> None:
        self.requested_peak, self.allocated_peak = self.requested, self.allocated


@pytest.mark.parametrize("requested", [True, False])
def test_cuda_meter_reads_the_bytes_tensors_requested_not_the_allocators_blocks(
    monkeypatch: pytest.MonkeyPatch,
    requested: bool,
) -> None:
    from fsdp_conformance.measure import meters

    alloc = _Allocator(requested)
    monkeypatch.setattr(torch.cuda, "memory_stats", alloc.stats)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: alloc.allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: alloc.allocated_peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", alloc.reset)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
    alloc.alloc(1000)  # before the step: the baseline
    meter = meters.CudaMeter(
        torch.device("cuda", 0), baseline=meters.cuda_bytes(torch.device("cuda", 0))
    )
    with meter.measure():
        alloc.alloc(3 * 1024 * 1024 + 5)
    if requested:
        assert (meter.baseline, meter.peak) == (1000, 3 * 1024 * 1024 + 5)
    else:  # a torch without requested_bytes: the allocator's own figures, whole blocks
        assert (meter.baseline, meter.peak) == (2 << 20, 2 * (2 << 20))
