"""Measurement behind a small interface of ours (:class:`Meter`).

torch's ``MemTracker`` / ``FSDPMemTracker`` on CPU (via :mod:`~fsdp_conformance._compat`), the OS
high-water mark as ground truth (and as the fallback when an upgrade moves the trackers), the
CUDA caching allocator on GPU. The memory claim, the planner's trust check (through
:mod:`~fsdp_conformance.measure.step`) and init's peak check read memory only through this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from fsdp_conformance._compat import storage_key, tree_leaves
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.measure.bound import MeasureError

#: The OS high-water mark resolves tensor memory to about 1 MB (docs/memory.md, "Facts about
#: measuring memory on CPU"), on each of the two
#: readings (start, peak) a step increase is the difference of: below 2 MB it cannot judge.
METER_RESOLUTION_BYTES = 2 * 10**6
#: The OS figure is only trustworthy with this allocator setting (one mmap per large tensor).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


@dataclasses.dataclass
class Meter:
    """Current and peak tensor bytes on one rank, from one source.

    ``tracking()`` wraps everything that should be attributed (model construction included,
    so that FSDP1's gather buffers are known to the tracker); ``measure()`` wraps the measured
    step and resets the peak at its start. ``peak`` and ``start`` are absolute bytes.
    """

    source: str
    start: int = 0
    peak: int = 0

    def current(self) -> int:
        raise NotImplementedError

    def tracking(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def measure(self) -> Iterator[Meter]:
        raise NotImplementedError
        yield self  # pragma: no cover


class TrackerMeter(Meter):
    """torch's ``MemTracker`` (any module) or ``FSDPMemTracker`` (FSDP2, with categories)."""

    def __init__(self, tracker: Any, source: str, device: torch.device) -> None:
        super().__init__(source)
        self.tracker = tracker
        self.device = device
        self.breakdown: dict[str, int] = {}
        #: Each category's own peak over the measurement (not at the total's peak); empty
        #: where this torch's tracker class is used as is.
        self.category_peaks: dict[str, int] = {}

    def _snapshot(self, kind: str) -> dict[str, int]:
        snap = self.tracker.get_tracker_snapshot(kind)
        for dev, values in snap.items():
            if str(dev) == str(self.device) or getattr(dev, "type", None) == self.device.type:
                return {_category(k): int(v) for k, v in values.items()}
        return {}

    def current(self) -> int:
        return self._snapshot("current").get("Total", 0)

    def tracking(self) -> contextlib.AbstractContextManager[Any]:
        tracker: contextlib.AbstractContextManager[Any] = self.tracker
        return tracker

    @contextlib.contextmanager
    def measure(self) -> Iterator[Meter]:
        # Leaving and re-entering the tracker resets its peak to the current total (its
        # documented behaviour on __enter__), while what it already tracks stays tracked.
        # Its per-module statistics refuse a second iteration unless cleared (public API).
        from fsdp_conformance._compat import CATEGORY_PEAKS

        self.tracker.reset_mod_stats()
        setattr(self.tracker, CATEGORY_PEAKS, {})
        with self.tracker:
            self.start = self.current()
            yield self
        peak = self._snapshot("peak")
        self.peak = peak.get("Total", 0)
        self.breakdown = {k: v for k, v in peak.items() if v and k != "Total"}
        own = getattr(self.tracker, CATEGORY_PEAKS, {})
        self.category_peaks = {
            _category(k): int(v)
            for dev, values in own.items()
            if str(dev) == str(self.device) or getattr(dev, "type", None) == self.device.type
            for k, v in values.items()
            if v and _category(k) != "Total"
        }


def _category(key: Any) -> str:
    return str(getattr(key, "value", key))


class OSMeter(Meter):
    """The kernel's resident high-water mark (``VmHWM``), reset through ``clear_refs``.

    Only tensor memory counts in the checks, so a peak is reported as the tensors resident at
    the start (``resident_fn``: parameters, gradients, optimizer state, batch) plus the growth of
    the high-water mark during the step. Valid only with :data:`MALLOC_ENV` set before the
    process started: otherwise glibc reuses freed heap and the figure is noise (docs/memory.md,
    "Facts about measuring memory on CPU").
    """

    def __init__(self, resident_fn: Callable[[], int]) -> None:
        super().__init__("os")
        self.resident_fn = resident_fn
        self.rss_start = 0
        self.hwm = 0

    @staticmethod
    def available() -> str | None:
        """None when usable here, else why not."""
        if not os.path.exists("/proc/self/clear_refs"):
            return "the OS figure needs Linux /proc/self/clear_refs"
        if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]:
            return (
                "the OS figure needs MALLOC_MMAP_THRESHOLD_=65536 set before the rank "
                "processes start (run with ranks.configured(env=memory.MALLOC_ENV))"
            )
        return None

    def current(self) -> int:
        return self.resident_fn() + status_bytes("VmRSS") - self.rss_start

    @contextlib.contextmanager
    def measure(self) -> Iterator[Meter]:
        self.rss_start = reset_peak_rss()
        self.start = self.resident_fn()
        yield self
        self.hwm = status_bytes("VmHWM")
        self.peak = self.start + max(0, self.hwm - self.rss_start)


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` figure (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} (Linux only)")


def reset_peak_rss() -> int:
    """Reset ``VmHWM`` to the current RSS (``5`` into ``/proc/self/clear_refs``); returns RSS."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
    return status_bytes("VmRSS")


def cuda_bytes(device: torch.device, which: str = "current") -> int:
    """Bytes the tensors on ``device`` asked the CUDA caching allocator for (``which``:
    ``current`` or ``peak`` since the last ``reset_peak_memory_stats``).

    ``requested_bytes``, not ``allocated_bytes``: the allocator rounds every request up (to
    512 B, and large ones to 2 MiB blocks it may not split), so its allocated figure runs ahead
    of the tensor bytes the trackers count, by an amount that depends on the sizes asked for;
    the requested figure is the comparable one. A torch without it falls back to
    ``memory_allocated`` / ``max_memory_allocated``.
    """
    value = torch.cuda.memory_stats(device).get(f"requested_bytes.all.{which}")
    if value is not None:
        return int(value)
    if which == "peak":
        return int(torch.cuda.max_memory_allocated(device))
    return int(torch.cuda.memory_allocated(device))


class CudaMeter(Meter):
    """The CUDA caching allocator's own figures for this rank's device: the bytes tensors
    requested (:func:`cuda_bytes`), current and peak.

    ``baseline`` (from :func:`cuda_baseline`, read before the model is built) is subtracted from
    every figure: the allocator also holds memory that is not the step's (cuBLAS/cuBLASLt
    workspaces, 8 to 32 MiB per handle and stream depending on the GPU, allocated at the first
    matmul and kept for the life of the process; whatever earlier checks in the same warm rank
    process still hold), which would otherwise be counted against the per-layer bound.
    The allocator's counters are host-side: a free is counted when the tensor is released, and
    the block is reused in stream order, so reading them needs no synchronize; the peak is read
    after a synchronize so that every queued allocation of the step has happened.
    """

    def __init__(self, device: torch.device, baseline: int = 0) -> None:
        super().__init__("cuda")
        self.device = device
        self.baseline = baseline

    def current(self) -> int:
        return cuda_bytes(self.device) - self.baseline

    @contextlib.contextmanager
    def measure(self) -> Iterator[Meter]:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.start = self.current()
        yield self
        torch.cuda.synchronize(self.device)
        self.peak = cuda_bytes(self.device, "peak") - self.baseline


def cuda_baseline(device: torch.device) -> int:
    """Allocator bytes on ``device`` that belong to no model: read before a model is built.

    Collects garbage first (an earlier check's FSDP model can sit in reference cycles, its
    device memory still allocated), then runs one tiny Linear forward and backward so that the
    cuBLAS/cuBLASLt workspaces of the forward thread and of the autograd thread (one per handle
    and stream, from the caching allocator) exist before the baseline is read.
    """
    import gc

    gc.collect()
    with torch.random.fork_rng(devices=[device]):  # the check's own seeding stays untouched
        layer = torch.nn.Linear(16, 16, device=device)
        x = torch.randn(4, 16, device=device, requires_grad=True)
        layer(x).sum().backward()
    del layer, x
    torch.cuda.synchronize(device)
    return cuda_bytes(device)


def tracker_meter(
    device: torch.device,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> TrackerMeter | None:
    """torch's tracker behind our interface, or None when this torch moved it.

    With ``model`` given (an FSDP2 model), ``FSDPMemTracker`` for its per-category breakdown;
    otherwise ``MemTracker``, which must then be entered (``tracking()``) before the model is
    built so it knows every storage FSDP allocates.
    """
    from fsdp_conformance import _compat

    if model is not None:
        cls = _compat.fsdp_mem_tracker_cls()
        if cls is not None:
            return TrackerMeter(cls(model, optimizer), "FSDPMemTracker", device)
        return None
    cls = _compat.mem_tracker_cls()
    return TrackerMeter(cls(), "MemTracker", device) if cls is not None else None


def resident_tensor_bytes(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Sequence[Any] = (),
) -> int:
    """Bytes of the tensors a step starts with: local parameter shards, grads, state, buffers."""

    seen: set[int] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if not isinstance(t, torch.Tensor):
            return
        local = t.to_local() if hasattr(t, "to_local") else t
        st = local.untyped_storage()
        if storage_key(st) not in seen:
            seen.add(storage_key(st))
            total += st.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for b in model.buffers():
        add(b)
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                add(v)
    for t in tree_leaves(list(extra)):  # a batch may be a mapping of tensors (call_model)
        add(t)
    return total


def sharded_param_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's parameter shards: FSDP2's local DTensor pieces, FSDP1's flat
    parameter shards (its padding included), each parameter once.

    A lower bound on what a meter must report at every instant of a step, since the shards
    stay resident throughout: a meter reading less is blind to memory it must see
    (:func:`meter_floor_problems`).
    """
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def meter_floor_problems(
    rank: int, meters: Sequence[dict[str, Any]], param_bytes: int | None
) -> list[str]:
    """One line per meter whose start or peak is below this rank's parameter shards."""
    if param_bytes is None:
        return []
    out = []
    for m in meters:
        if m["source"] == "none":
            continue  # measures nothing by design (the timing baseline)
        low = {k: m[k] for k in ("start", "peak") if m[k] < param_bytes}
        if low:
            readings = ", ".join(f"{k} {v:,} B" for k, v in low.items())
            out.append(
                f"rank {rank}: {m['source']} reads {readings}, less than the "
                f"{param_bytes:,} B of parameter shards this rank holds throughout the "
                "step: the meter does not see this rank's memory"
            )
    return out


METERS = ("auto", "tracker", "os", "cuda", "none")


def meter_data(
    m: Meter, model: torch.nn.Module, opt: torch.optim.Optimizer | None, batch: Any
) -> dict[str, Any]:
    end = resident_tensor_bytes(model, opt, [batch]) if m.source in ("os", "none") else m.current()
    return {
        "source": m.source,
        "start": m.start,
        "peak": m.peak,
        "end": end,
        "breakdown": dict(getattr(m, "breakdown", {})),
        "category_peaks": dict(getattr(m, "category_peaks", {})),
    }


class _NoMeter(Meter):
    """Measures nothing: the baseline for the cost of measuring."""

    def current(self) -> int:
        return 0

    @contextlib.contextmanager
    def measure(self) -> Iterator[Meter]:
        yield self


def make_meter(
    name: str,
    ctx: RankContext,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer | None,
    batch: Any,
    construction: TrackerMeter | None,
    cuda_base: int = 0,
) -> Meter:
    if name == "MemTracker":
        return construction or tracker_meter(ctx.device)  # type: ignore[return-value]
    if name == "FSDPMemTracker":
        m = tracker_meter(ctx.device, model, opt)
        assert m is not None  # choose_meter checked the class exists
        m.tracker.track_inputs((batch,))
        return m
    if name == "cuda":
        return CudaMeter(ctx.device, cuda_base)
    if name == "os":
        return OSMeter(functools.partial(resident_tensor_bytes, model, opt, [batch]))
    return _NoMeter("none")


def choose_meter(ctx: RankContext, meter: str, version: str) -> str:
    from fsdp_conformance import _compat

    if meter not in METERS:
        raise MeasureError(f"unknown meter {meter!r}; choose one of {', '.join(METERS)}")
    if meter == "auto":
        if ctx.device_type == "cuda":
            return "cuda"
        if version == "fsdp2" and _compat.fsdp_mem_tracker_cls() is not None:
            return "FSDPMemTracker"
        if _compat.mem_tracker_cls() is not None:
            return "MemTracker"
        why = OSMeter.available()
        if why:
            skip_rank(f"torch {torch_version_string()} moved its memory trackers and {why}")
        return "os"
    if meter == "tracker":
        if _compat.mem_tracker_cls() is None:
            skip_rank(f"torch {torch_version_string()} has no MemTracker (moved by an upgrade)")
        return "MemTracker"
    if meter == "os":
        why = OSMeter.available()
        if why:
            skip_rank(why)
        return "os"
    if meter == "cuda" and ctx.device_type != "cuda":
        skip_rank("the CUDA allocator figure needs the gpu lane")
    return meter


def torch_version_string() -> str:
    return str(torch.__version__)


@contextlib.contextmanager
def host_or_cuda_peak(ctx: RankContext) -> Iterator[dict[str, Any]]:
    """Peak and kept bytes of the block, on the memory that holds the parameters.

    CPU: the process's ``VmHWM`` (reset through ``clear_refs``), an :class:`OSMeter` that counts
    nothing as resident, so its peak is the growth of the high-water mark. GPU: the CUDA caching
    allocator (a :class:`CudaMeter` whose baseline is what was allocated before the block; the
    parameters live there, the host only ever holds one module's full values while they are
    generated). The dict yielded is filled on exit: ``meter`` ("VmHWM" or "cuda allocator"),
    ``peak`` and ``kept`` (bytes still held at the end), both relative to the block's start.
    """
    meter: Meter
    if ctx.device_type == "cuda":
        meter = CudaMeter(ctx.device, baseline=cuda_bytes(ctx.device))
        label = "cuda allocator"
    else:
        meter = OSMeter(lambda: 0)
        label = "VmHWM"
    reading: dict[str, Any] = {}
    with meter.measure():
        yield reading
    reading.update(meter=label, peak=meter.peak, kept=meter.current())
