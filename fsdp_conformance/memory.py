"""Memory conformance: the per-layer bound, measured peaks, depth invariance and the sawtooth.

Three layers, from plain data up:

* **The bound** (:func:`per_layer_bound`): a pure function of a unit plan (``UnitInfo`` rows from
  :func:`~fsdp_conformance.units.plan_units`) and a :class:`StepConfig` (world size, dtypes,
  optimizer, activation profile). Term by term, no allocation, so it also answers at full scale
  (70B on 1,024 ranks). docs/memory.md derives every term.
* **Measurement** behind a small interface of ours (:class:`Meter`): torch's ``MemTracker`` /
  ``FSDPMemTracker`` on CPU (via :mod:`~fsdp_conformance._compat`), the OS high-water mark as
  ground truth (and as the fallback when an upgrade moves the trackers), the CUDA caching
  allocator on GPU; plus a :class:`Timeline` sampled at every unit's forward and backward hooks.
* **Checks** (``CHECKS``): peak within the bound on every rank, depth invariance, the sawtooth,
  and the meter's agreement with ground truth. Each fails on the seeds' naive wrappings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from fsdp_conformance.checks import Check, Verdict
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.models import LlamaConfig, ModelConfig, ModelSpec, default_loss
from fsdp_conformance.units import ROOT, UnitInfo

MB = 1e6

#: Relative tolerance on the bound. Tracker peaks are deterministic at fixed settings, but the
#: OS and CUDA figures move a few percent run to run (up to ~8% seen, NOTES.md), so the bound
#: is checked against ``total * (1 + BOUND_TOLERANCE)``.
BOUND_TOLERANCE = 0.10
#: Sawtooth: a unit's gather (and release) must be within this fraction of its unsharded bytes.
SAWTOOTH_TOLERANCE = 0.25
#: Depth invariance: the per-layer working set may vary by this fraction of its smallest value.
DEPTH_TOLERANCE = 0.10
#: Meter cross-check: tracker vs OS (or CUDA allocator) step increase, relative.
METER_TOLERANCE = 0.05
#: The OS high-water mark resolves tensor memory to about 1 MB (NOTES.md), on each of the two
#: readings (start, peak) a step increase is the difference of: below 2 MB it cannot judge.
METER_RESOLUTION_BYTES = 2 * 10**6
#: The OS figure is only trustworthy with this allocator setting (one mmap per large tensor).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}

#: Optimizer state tensors kept per parameter element (sharded, in the parameter dtype).
OPTIMIZER_STATES = {None: 0, "sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}
#: Adam/AdamW also keep one ``step`` scalar per parameter tensor.
OPTIMIZER_SCALARS = {None: 0, "sgd": 0, "momentum": 0, "adam": 1, "adamw": 1}

#: The wrappings a check can measure. ``per_layer`` is the recommended policy (one unit per block);
#: the others are the seeds' naive cases and a broken per-layer variant (negative controls).
WRAPPINGS = ("per_layer", "monolithic", "top_level", "no_reshard")


class MemoryCheckError(ValueError):
    """A memory check was asked for something it cannot measure; the message says the fix."""


# ============================================================================================
# The bound: plain data in, plain data out
# ============================================================================================


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActivationProfile:
    """Activation memory of one step, per unit, in bytes (from :func:`profile_activations`)."""

    #: The input batch.
    input_bytes: int = 0
    #: Tensors saved for backward, by the unit whose forward saved them (parameters excluded).
    saved_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: Every tensor a unit's forward produces, saved or not (its transient working set).
    produced_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"input_bytes": self.input_bytes, "saved_bytes": dict(self.saved_bytes),
                "produced_bytes": dict(self.produced_bytes)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepConfig:
    """What a training step does, as plain data: enough to compute the bound without a model."""

    #: Ranks the parameters are sharded over.
    world_size: int
    #: "fsdp1" or "fsdp2" (their all-gather and reduce-scatter buffers differ).
    version: str = "fsdp2"
    #: Bytes per element of the sharded parameters, sharded gradients and optimizer state.
    param_bytes: int = 4
    #: Bytes per element of unsharded parameters and gradients (2 under bf16 mixed precision).
    compute_bytes: int = 4
    #: None (forward/backward only), "sgd", "momentum", "adam" or "adamw".
    optimizer: str | None = None
    #: Buffers (replicated, never sharded), in bytes.
    buffer_bytes: int = 0
    #: Activations; None counts none (a plan without a batch).
    activations: ActivationProfile | None = None
    #: Relative tolerance the bound is checked with.
    tolerance: float = BOUND_TOLERANCE

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"StepConfig.world_size must be >= 1, got {self.world_size}")
        if self.version not in ("fsdp1", "fsdp2"):
            raise ValueError(f"StepConfig.version must be 'fsdp1' or 'fsdp2', got {self.version!r}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(
                f"StepConfig.optimizer {self.optimizer!r} is not one of "
                f"{sorted(k for k in OPTIMIZER_STATES if k)} or None"
            )
        if self.tolerance < 0:
            raise ValueError(f"StepConfig.tolerance must be >= 0, got {self.tolerance}")


@dataclasses.dataclass(frozen=True)
class BoundTerm:
    name: str
    bytes: int
    #: How it was computed, with the numbers (shown in failure messages and docs).
    derivation: str
    #: True when the term grows with the number of layers (sharded state, saved activations).
    scales_with_depth: bool = False


@dataclasses.dataclass(frozen=True)
class Bound:
    """The per-layer bound: a sum of terms, checked with a relative tolerance."""

    terms: tuple[BoundTerm, ...]
    tolerance: float

    @property
    def total(self) -> int:
        return sum(t.bytes for t in self.terms)

    @property
    def limit(self) -> int:
        """What a measured peak must not exceed: ``total * (1 + tolerance)``."""
        return int(self.total * (1 + self.tolerance))

    @property
    def depth_scaling(self) -> int:
        """The part that grows with depth (sharded state, saved activations)."""
        return sum(t.bytes for t in self.terms if t.scales_with_depth)

    def term(self, name: str) -> BoundTerm:
        for t in self.terms:
            if t.name == name:
                return t
        raise KeyError(name)

    def format(self) -> str:
        width = max(len(t.name) for t in self.terms)
        lines = [f"  {t.name:<{width}}  {t.bytes / MB:9.2f} MB  {t.derivation}" for t in self.terms]
        lines.append(f"  {'total':<{width}}  {self.total / MB:9.2f} MB  "
                     f"(limit with {self.tolerance:.0%} tolerance: {self.limit / MB:.2f} MB)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"terms": [dataclasses.asdict(t) for t in self.terms], "tolerance": self.tolerance,
                "total": self.total, "limit": self.limit}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Bound:
        return cls(tuple(BoundTerm(**t) for t in data["terms"]), float(data["tolerance"]))


def _shard(numel: int, world_size: int) -> int:
    # FSDP1 pads each flat parameter to a multiple of the world size, so a rank holds exactly
    # ceil(numel / W); FSDP2 pads each parameter's dim 0, which ceil matches whenever dim 0
    # divides by W (it does for every model here and for Llama shapes up to 1,024 ranks).
    return -(-numel // world_size)


def per_layer_bound(units: Sequence[UnitInfo], config: StepConfig) -> Bound:
    """The per-rank peak of one training step under a per-layer plan, term by term.

    Every term is computed from ``units`` (unsharded numel per unit) and ``config``; see
    docs/memory.md for the derivation. It is an upper bound: each transient term is the largest
    it can be, and they are summed as if they coincided.
    """
    if not units:
        raise ValueError("per_layer_bound needs at least one unit (the root)")
    w, pb, cb = config.world_size, config.param_bytes, config.compute_bytes
    shard_numel = sum(_shard(u.numel, w) for u in units)
    num_tensors = sum(len(u.params) for u in units)
    root = next((u for u in units if u.fqn == ROOT), None)
    root_numel = root.numel if root is not None else 0
    others = sorted((u for u in units if u.fqn != ROOT), key=lambda u: u.numel, reverse=True)
    top2 = others[:2]
    largest = max(units, key=lambda u: u.numel)
    terms = [
        BoundTerm("sharded params", shard_numel * pb,
                  f"sum over {len(units)} units of ceil(numel/{w}) = {shard_numel:,} x {pb} B",
                  scales_with_depth=True),
        BoundTerm("sharded grads", shard_numel * pb,
                  f"one gradient shard per parameter shard: {shard_numel:,} x {pb} B",
                  scales_with_depth=True),
    ]
    states, scalars = OPTIMIZER_STATES[config.optimizer], OPTIMIZER_SCALARS[config.optimizer]
    if config.optimizer is not None:
        terms.append(BoundTerm(
            "optimizer state", (states * shard_numel + scalars * num_tensors) * pb,
            f"{config.optimizer}: {states} state(s) x {shard_numel:,} + {scalars} step scalar(s) "
            f"x {num_tensors} tensors, x {pb} B", scales_with_depth=True))
    gathered = root_numel + sum(u.numel for u in top2)
    names = ", ".join(u.fqn for u in top2) or "none"
    terms.append(BoundTerm(
        "unsharded params", gathered * cb,
        f"root ({root_numel:,}, kept gathered from forward into backward) + current and "
        f"prefetched unit (two largest: {names}) = {gathered:,} x {cb} B"))
    terms.append(BoundTerm(
        "unsharded grads", largest.numel * cb,
        f"the current unit's full gradient before its reduce-scatter (largest unit "
        f"{largest.fqn or '(root)'}: {largest.numel:,}) x {cb} B; the prefetched one has none yet"))
    ag_numel = _all_gather_buffer_numel(largest.numel, w, config.version)
    terms.append(BoundTerm(
        "all-gather buffers", ag_numel * cb,
        "fsdp1 gathers into the unsharded flat parameter itself (counted above): 0"
        if config.version == "fsdp1" else
        f"fsdp2 copy-in shard + gather output of the largest unit: ceil({largest.numel:,}/{w}) "
        f"+ {largest.numel:,} = {ag_numel:,} x {cb} B"))
    rs_numel = _reduce_scatter_buffer_numel(largest.numel, w, config.version)
    rs_input = ("padded input copy (only when numel % W != 0)" if config.version == "fsdp1"
                else "input copy")
    terms.append(BoundTerm(
        "reduce-scatter buffers", rs_numel * cb,
        f"{rs_input} + output shard of the largest unit = {rs_numel:,} x {cb} B"))
    if config.buffer_bytes:
        terms.append(BoundTerm("buffers", config.buffer_bytes,
                               "model buffers, replicated on every rank"))
    acts = config.activations
    if acts is not None:
        saved = sum(acts.saved_bytes.values())
        working_unit = max(acts.produced_bytes, key=lambda k: acts.produced_bytes[k], default=None)
        working = acts.produced_bytes.get(working_unit, 0) if working_unit is not None else 0
        terms.append(BoundTerm("input batch", acts.input_bytes, "the step's input tensors"))
        terms.append(BoundTerm(
            "saved activations", saved,
            f"tensors saved for backward by all {len(acts.saved_bytes)} units and the loss, all "
            "alive at the end of forward (measured on meta)", scales_with_depth=True))
        terms.append(BoundTerm(
            "activation working set", working,
            f"everything one unit's forward produces, saved or not (largest: "
            f"{working_unit or '(root)'}); also covers that unit's activation gradients in "
            "backward"))
    return Bound(tuple(terms), config.tolerance)


def _all_gather_buffer_numel(numel: int, world_size: int, version: str) -> int:
    if version == "fsdp1":
        return 0
    return _shard(numel, world_size) + _shard(numel, world_size) * world_size


def _reduce_scatter_buffer_numel(numel: int, world_size: int, version: str) -> int:
    out = _shard(numel, world_size)
    if version == "fsdp1":
        return out + (out * world_size if numel % world_size else 0)
    return out + out * world_size


# ============================================================================================
# From a model to the bound's inputs (no allocation: meta tensors)
# ============================================================================================


def _unit_of(model: Any, units: Sequence[UnitInfo]) -> dict[int, str]:
    """id(module) -> fqn of the unit that owns it (the closest enclosing unit module)."""
    fqns = {u.fqn for u in units}
    owner: dict[int, str] = {}
    for name, module in model.named_modules():
        parts = name.split(".") if name else []
        unit = ROOT
        for i in range(len(parts), 0, -1):
            candidate = ".".join(parts[:i])
            if candidate in fqns:
                unit = candidate
                break
        owner[id(module)] = unit
    return owner


def profile_activations(model: Any, batch: Any, units: Sequence[UnitInfo],
                        loss_fn: Callable[[Any], Any] = default_loss) -> ActivationProfile:
    """Activation bytes per unit for one forward + loss, measured on a meta model and batch.

    Saved tensors are those autograd keeps for backward (``saved_tensors_hooks``), deduplicated
    by storage; parameters are excluded (they are counted as parameters). Works on any device;
    on ``meta`` nothing is allocated, so it runs at full scale.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    owner = _unit_of(model, units)
    param_storages = {p.untyped_storage()._cdata for p in model.parameters()}
    stack: list[str] = [ROOT]
    saved: dict[str, int] = {u.fqn: 0 for u in units}
    produced: dict[str, int] = {u.fqn: 0 for u in units}
    seen: set[int] = set()

    def pack(t: Any) -> Any:
        st = t.untyped_storage()
        key = st._cdata
        if key not in param_storages and key not in seen:
            seen.add(key)
            saved[stack[-1]] += st.nbytes()
        return t

    class Produced(TorchDispatchMode):
        def __torch_dispatch__(  # type: ignore[no-untyped-def]
            self, func, types, args=(), kwargs=None
        ):
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and not t._is_view():
                    produced[stack[-1]] += t.untyped_storage().nbytes()
            return out

    def pre(module: Any, _args: Any) -> None:
        stack.append(owner[id(module)])

    def post(module: Any, _args: Any, _out: Any) -> None:
        stack.pop()

    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Produced():
            loss_fn(model(batch))
    finally:
        for h in handles:
            h.remove()
    leaves = torch.utils._pytree.tree_leaves(batch)
    input_bytes = sum(t.untyped_storage().nbytes() for t in leaves if isinstance(t, torch.Tensor))
    return ActivationProfile(input_bytes=input_bytes, saved_bytes=saved, produced_bytes=produced)


def wrap_policy(model: Any, spec: ModelSpec, wrapping: str) -> Any:
    """The auto-wrap policy for a wrapping name (see :data:`WRAPPINGS`)."""
    from fsdp_conformance.policies import recommended_policy

    if wrapping in ("per_layer", "no_reshard"):
        return recommended_policy(model, spec.block_classes(model), spec.size_threshold(model))
    if wrapping == "monolithic":
        return _root_only
    if wrapping == "top_level":
        # The seeds' "wrapping only the top-level modules": the root's direct children become
        # units, nothing below them. Containers (ModuleList/Dict) never run a forward of their
        # own, so FSDP cannot gather for them: their blocks stay in the root, as they would.
        import torch.nn as nn
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

        top = {id(c) for c in model.children() if not isinstance(c, (nn.ModuleList, nn.ModuleDict))}
        return functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in top)
    raise MemoryCheckError(f"unknown wrapping {wrapping!r}; choose one of {', '.join(WRAPPINGS)}")


def _root_only(module: Any, recurse: bool, nonwrapped_numel: int) -> bool:
    return False  # neither descend nor wrap: the root is the only unit (monolithic)


def plan_step(spec: ModelSpec, world_size: int, version: str, *, optimizer: str | None = None,
              batch_size: int = 2, compute_bytes: int = 4, param_bytes: int = 4,
              tolerance: float = BOUND_TOLERANCE) -> tuple[list[UnitInfo], StepConfig]:
    """The per-layer plan and step configuration of a model, on meta (nothing allocated)."""
    from fsdp_conformance.units import plan_units

    model = spec.build("meta")
    units = plan_units(model, wrap_policy(model, spec, "per_layer"))
    try:
        batch = spec.batch(model, batch_size, "meta")
        acts = profile_activations(model, batch, units)
    except Exception as exc:  # noqa: BLE001 - a user's model or input builder; say which
        raise MemoryCheckError(
            f"cannot profile the activations of {spec.name!r} on the meta device "
            f"({type(exc).__name__}: {exc}); the model's forward and its input builder must work "
            "with device='meta' (no data-dependent Python control flow on tensor values)"
        ) from exc
    buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())
    config = StepConfig(world_size=world_size, version=version, param_bytes=param_bytes,
                        compute_bytes=compute_bytes, optimizer=optimizer, buffer_bytes=buffers,
                        activations=acts, tolerance=tolerance)
    return units, config


# ============================================================================================
# Measurement: a small interface over torch's trackers, the OS and the CUDA allocator
# ============================================================================================


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

    def __init__(self, tracker: Any, source: str, device: Any) -> None:
        super().__init__(source)
        self.tracker = tracker
        self.device = device
        self.breakdown: dict[str, int] = {}

    def _snapshot(self, kind: str) -> dict[str, int]:
        snap = self.tracker.get_tracker_snapshot(kind)
        for dev, values in snap.items():
            if str(dev) == str(self.device) or getattr(dev, "type", None) == self.device.type:
                return {_category(k): int(v) for k, v in values.items()}
        return {}

    def current(self) -> int:
        return self._snapshot("current").get("Total", 0)

    def tracking(self) -> contextlib.AbstractContextManager[Any]:
        return self.tracker

    @contextlib.contextmanager
    def measure(self) -> Iterator[Meter]:
        # Leaving and re-entering the tracker resets its peak to the current total (its
        # documented behaviour on __enter__), while what it already tracks stays tracked.
        # Its per-module statistics refuse a second iteration unless cleared (public API).
        self.tracker.reset_mod_stats()
        with self.tracker:
            self.start = self.current()
            yield self
        peak = self._snapshot("peak")
        self.peak = peak.get("Total", 0)
        self.breakdown = {k: v for k, v in peak.items() if v and k != "Total"}


def _category(key: Any) -> str:
    return str(getattr(key, "value", key))


class OSMeter(Meter):
    """The kernel's resident high-water mark (``VmHWM``), reset through ``clear_refs``.

    Only tensor memory counts in the checks, so a peak is reported as the tensors resident at
    the start (``resident_fn``: parameters, gradients, optimizer state, batch) plus the growth of
    the high-water mark during the step. Valid only with :data:`MALLOC_ENV` set before the
    process started: otherwise glibc reuses freed heap and the figure is noise (NOTES.md).
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
            return ("the OS figure needs MALLOC_MMAP_THRESHOLD_=65536 set before the rank "
                    "processes start (run with ranks.configured(env=memory.MALLOC_ENV))")
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


class CudaMeter(Meter):
    """The CUDA caching allocator's own figures for this rank's device.

    ``baseline`` (from :func:`cuda_baseline`, read before the model is built) is subtracted from
    every figure: the allocator also holds memory that is not the step's (cuBLAS/cuBLASLt
    workspaces, 8 to 32 MiB per handle and stream depending on the GPU, allocated at the first
    matmul and kept for the life of the process; whatever earlier checks in the same warm rank
    process still hold), which would otherwise be counted against the per-layer bound.
    The allocator's counters are host-side: a free is counted when the tensor is released, and
    the block is reused in stream order, so reading them needs no synchronize; the peak is read
    after a synchronize so that every queued allocation of the step has happened.
    """

    def __init__(self, device: Any, baseline: int = 0) -> None:
        super().__init__("cuda")
        self.device = device
        self.baseline = baseline

    def current(self) -> int:
        import torch

        return int(torch.cuda.memory_allocated(self.device)) - self.baseline

    @contextlib.contextmanager
    def measure(self) -> Iterator[Meter]:
        import torch

        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.start = self.current()
        yield self
        torch.cuda.synchronize(self.device)
        self.peak = int(torch.cuda.max_memory_allocated(self.device)) - self.baseline


def cuda_baseline(device: Any) -> int:
    """Allocator bytes on ``device`` that belong to no model: read before a model is built.

    Collects garbage first (an earlier check's FSDP model can sit in reference cycles, its
    device memory still allocated), then runs one tiny Linear forward and backward so that the
    cuBLAS/cuBLASLt workspaces of the forward thread and of the autograd thread (one per handle
    and stream, from the caching allocator) exist before the baseline is read.
    """
    import gc

    import torch

    gc.collect()
    with torch.random.fork_rng(devices=[device]):  # the check's own seeding stays untouched
        layer = torch.nn.Linear(16, 16, device=device)
        x = torch.randn(4, 16, device=device, requires_grad=True)
        layer(x).sum().backward()
    del layer, x
    torch.cuda.synchronize(device)
    return int(torch.cuda.memory_allocated(device))


def tracker_meter(device: Any, model: Any = None, optimizer: Any = None) -> TrackerMeter | None:
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


def resident_tensor_bytes(model: Any, optimizer: Any = None, extra: Sequence[Any] = ()) -> int:
    """Bytes of the tensors a step starts with: local parameter shards, grads, state, buffers."""
    import torch

    seen: set[int] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if not isinstance(t, torch.Tensor):
            return
        local = t.to_local() if hasattr(t, "to_local") else t
        st = local.untyped_storage()
        if st._cdata not in seen:
            seen.add(st._cdata)
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
    for t in extra:
        add(t)
    return total


# ============================================================================================
# Collectives that let go of their tensors in program order (gloo)
# ============================================================================================

#: The synchronous collectives FSDP1 and FSDP2 issue on CPU (``torch.distributed`` attributes,
#: looked up at call time by FSDP, so replacing them for one step reaches every call).
SYNCED_COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
                      "reduce_scatter_tensor", "all_reduce", "broadcast")
#: How long a collective's tensors may stay held by gloo's worker after it finished.
RELEASE_TIMEOUT_S = 60.0


@contextlib.contextmanager
def collectives_release_in_order(device_type: str) -> Iterator[dict[str, int]]:
    """While inside, a synchronous collective returns only once gloo's worker let go of its tensors.

    Why: gloo runs a collective on a worker thread, which wakes the caller when the data is there
    and drops its own references to the tensors a moment later. When the caller has already
    dropped its own (FSDP2's reduce-scatter input, all-gather buffers), the last reference is the
    worker's, and the free happens on the worker whenever the OS schedules it: under CPU load,
    after the main thread has allocated the next unit's buffers. The tracker then sees both at
    once and the peak is bimodal (docs/memory.md). Waiting here for the worker's release (the
    tensors' and storages' reference counts back to what they were before the call) makes every
    free happen on the main thread, in program order: the figure no longer depends on
    scheduling. Yields counters (``calls``, ``waited``: calls that found the worker still
    holding on). CUDA: the caching allocator frees in stream order already; nothing changes.
    """
    import weakref

    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from fsdp_conformance import _compat

    stats = {"calls": 0, "waited": 0}
    counts = _compat.use_counts()
    if device_type == "cuda" or counts is None or not dist.is_available():
        yield stats
        return

    def tensors_of(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        leaves = torch.utils._pytree.tree_leaves((list(args), dict(kwargs)))
        return [t for t in leaves if isinstance(t, torch.Tensor)]

    class Allocations(TorchDispatchMode):
        """Weak references to every storage created inside the collective (gloo's copies)."""

        def __init__(self) -> None:
            super().__init__()
            self.refs: list[weakref.ref[Any]] = []

        def __torch_dispatch__(  # type: ignore[no-untyped-def]
            self, func, types, args=(), kwargs=None
        ):
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and not t._is_view():
                    self.refs.append(weakref.ref(t.untyped_storage()))
            return out

    def synced(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("async_op"):
                return fn(*args, **kwargs)  # its Work holds the tensors until the caller waits
            held = tensors_of(args, kwargs)
            before = [counts(t) for t in held]
            with Allocations() as made:
                result = fn(*args, **kwargs)
            stats["calls"] += 1
            # c10d's in-place ops return their arguments: those stay alive, they are the caller's.
            own = {t.untyped_storage()._cdata for t in held}
            made_here = [r for r in made.refs if _storage_key(r) not in own]
            deadline = time.monotonic() + RELEASE_TIMEOUT_S
            first = True
            # Released: the arguments' counts are back and every storage gloo made is gone.
            while (any(r() is not None for r in made_here)
                   or any(a > b0 or s > s0 for t, (b0, s0) in zip(held, before)
                          for a, s in (counts(t),))):
                if first:
                    stats["waited"] += 1
                    first = False
                if time.monotonic() > deadline:
                    raise MemoryCheckError(
                        f"gloo still held the tensors of {name} {RELEASE_TIMEOUT_S:.0f} s after "
                        "it returned: the step's memory cannot be measured in program order")
                os.sched_yield()
            return result
        return call

    originals = {n: getattr(dist, n) for n in SYNCED_COLLECTIVES if hasattr(dist, n)}
    try:
        for n, fn in originals.items():
            setattr(dist, n, synced(n, fn))
        yield stats
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)


def _storage_key(ref: Any) -> int | None:
    # No strong reference outlives this call: holding one would keep the storage alive.
    st = ref()
    return None if st is None else int(st._cdata)


# ============================================================================================
# The timeline: memory at every unit's forward and backward hooks
# ============================================================================================

#: Phases in the order a unit goes through them. ``gather``/``release`` samples are taken just
#: before FSDP's own pre-/post-forward hooks and ``forward``/``forward_done`` just after, so a
#: unit's gather is the difference between ``pre_forward`` and ``forward``.
PHASES = ("pre_forward", "forward", "forward_done", "post_forward", "pre_backward",
          "post_backward")


@dataclasses.dataclass
class Timeline:
    """Memory samples ``(unit, phase, bytes)`` in the order the hooks fired during one step."""

    events: list[tuple[str, str, int]] = dataclasses.field(default_factory=list)

    def to_data(self) -> list[dict[str, Any]]:
        return [{"i": i, "unit": u, "phase": p, "bytes": b} for i, (u, p, b) in
                enumerate(self.events)]


def _units_with_modules(model: Any) -> list[tuple[str, Any, Any]]:
    """(fqn, outer, inner) per FSDP unit: FSDP1's wrapper and wrapped module; FSDP2's module."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from fsdp_conformance import _compat
    from fsdp_conformance.units import clean_fqn

    fsdp2 = _compat.fsdp_module_cls()
    found = []
    for name, m in model.named_modules():
        if isinstance(m, FSDP):
            found.append((clean_fqn(name), m, m.module))
        elif isinstance(m, fsdp2):
            found.append((name, m, m))
    return found


@contextlib.contextmanager
def record_timeline(model: Any, meter: Meter) -> Iterator[Timeline]:
    """Sample ``meter.current()`` at every unit's forward and backward hooks while inside."""
    import torch

    timeline = Timeline()
    handles: list[Any] = []

    def sample(unit: str, phase: str) -> None:
        timeline.events.append((unit, phase, meter.current()))

    def tensors(obj: Any) -> list[Any]:
        return [t for t in torch.utils._pytree.tree_leaves(obj)
                if isinstance(t, torch.Tensor) and t.requires_grad]

    for fqn, outer, inner in _units_with_modules(model):
        same = outer is inner

        def pre_forward(_m: Any, _a: Any, fqn: str = fqn) -> None:
            sample(fqn, "pre_forward")

        def forward(_m: Any, args: Any, fqn: str = fqn) -> None:
            sample(fqn, "forward")
            inputs = tensors(args)
            if inputs:  # fires once the gradients w.r.t. the unit's inputs exist
                torch.autograd.graph.register_multi_grad_hook(
                    inputs, lambda _g, fqn=fqn: sample(fqn, "post_backward"), mode="any")

        def forward_done(_m: Any, _a: Any, _o: Any, fqn: str = fqn) -> None:
            sample(fqn, "forward_done")

        def post_forward(_m: Any, _a: Any, out: Any, fqn: str = fqn) -> None:
            sample(fqn, "post_forward")
            outputs = tensors(out)
            if outputs:  # registered after FSDP's own: fires once the unit is gathered again
                torch.autograd.graph.register_multi_grad_hook(
                    outputs, lambda _g, fqn=fqn: sample(fqn, "pre_backward"), mode="any")

        # FSDP2 registers its pre-forward with prepend=True and its post-forward appended;
        # FSDP1 works inside the wrapper's forward. Either way these land on the right side.
        handles.append(outer.register_forward_pre_hook(pre_forward, prepend=True))
        handles.append(inner.register_forward_pre_hook(forward))
        handles.append(inner.register_forward_hook(forward_done, prepend=same))
        handles.append(outer.register_forward_hook(post_forward))
    try:
        yield timeline
    finally:
        for h in handles:
            h.remove()


# ============================================================================================
# One measured step on a rank
# ============================================================================================


def _make_optimizer(model: Any, name: str | None) -> Any:
    import torch

    if name is None:
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3)
    if name == "momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    raise MemoryCheckError(f"unknown optimizer {name!r}; choose one of sgd, momentum, adam, adamw")


def train_step(model: Any, batch: Any, optimizer: Any = None) -> None:
    """One step: forward, the mean-square loss, backward, and the optimizer when given."""
    loss = default_loss(model(batch))
    loss.backward()
    if optimizer is not None:
        optimizer.step()


def _zero_grad(model: Any, optimizer: Any) -> None:
    # set_to_none: the measured step starts with no gradients, as a fresh step would.
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)


def _shard_kwargs(version: str, wrapping: str) -> dict[str, Any]:
    if wrapping != "no_reshard":
        return {}
    if version == "fsdp1":
        from torch.distributed.fsdp import ShardingStrategy

        return {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}
    return {"reshard_after_forward": False}


METERS = ("auto", "tracker", "os", "cuda", "none")


def measure_step(ctx: RankContext, spec: ModelSpec, version: str, wrapping: str = "per_layer", *,
                 optimizer: str | None = None, batch_size: int = 2, meter: str = "auto",
                 also: str | None = None, timeline: bool = True,
                 track_construction: bool = True) -> dict[str, Any]:
    """Build, shard, warm up and measure one step on this rank; plain data back.

    ``meter``: "auto" (the CUDA allocator on GPU, torch's tracker on CPU, the OS figure when an
    upgrade moved the tracker and the allocator setting allows it), "tracker", "os", "cuda", or
    "none" (time the step only). ``also``: a second meter read around the same step (the
    cross-check). ``track_construction=False`` enters ``MemTracker`` only for the step, so it
    misses FSDP1's gather buffers: the meter check's negative control.
    """
    import torch

    from fsdp_conformance.sharding import check_fsdp_version, shard
    from fsdp_conformance.units import actual_units

    check_fsdp_version(version)
    if wrapping not in WRAPPINGS:
        raise MemoryCheckError(
            f"unknown wrapping {wrapping!r}; choose one of {', '.join(WRAPPINGS)}")
    primary = _choose_meter(ctx, meter, version)
    # FSDPMemTracker needs an FSDP2 model; where a second meter is read, plain MemTracker keeps
    # the two figures about the same set of storages.
    if primary == "FSDPMemTracker" and (not track_construction or also):
        primary = "MemTracker"
    second = _choose_meter(ctx, also, version) if also else None
    # Read before anything of the check is allocated: on GPU the allocator's figures are
    # relative to it (CudaMeter), so workspaces and earlier checks' memory are not the step's.
    baseline = cuda_baseline(ctx.device) if "cuda" in (primary, second) else 0
    torch.manual_seed(0)
    construction = tracker_meter(ctx.device) if primary == "MemTracker" else None
    if construction is None and primary == "MemTracker":
        skip_rank(f"torch {_torch_version()} has no MemTracker (moved by an upgrade)")
    tracked = construction is not None and track_construction
    scope = construction.tracking() if tracked and construction else contextlib.nullcontext()
    with scope:
        model = spec.build(ctx.device)
        policy = wrap_policy(model, spec, wrapping)
        sharded = shard(model, ctx, version, policy, **_shard_kwargs(version, wrapping))
        opt = _make_optimizer(sharded, optimizer)
        batch = spec.batch(sharded, batch_size, ctx.device)
        train_step(sharded, batch, opt)  # warm-up: lazy init, optimizer state, buffers
        _zero_grad(sharded, opt)
    meters = [_make_meter(name, ctx, sharded, opt, batch, construction, baseline)
              for name in (primary, second) if name]
    rec = (record_timeline(sharded, meters[0]) if timeline and primary != "none"
           else contextlib.nullcontext(Timeline()))
    with contextlib.ExitStack() as stack:
        # Outermost: every free of the step happens on the main thread, in program order.
        synced = stack.enter_context(collectives_release_in_order(ctx.device_type))
        for m in reversed(meters):  # the primary innermost: its hooks see the others' work
            stack.enter_context(m.measure())
        tl = stack.enter_context(rec)
        t0 = time.perf_counter()
        train_step(sharded, batch, opt)
        if ctx.device_type == "cuda":
            torch.cuda.synchronize(ctx.device)
        seconds = time.perf_counter() - t0
    return {
        "rank": ctx.rank, "wrapping": wrapping, "version": version, "seconds": seconds,
        "meters": [_meter_data(m, sharded, opt, batch) for m in meters],
        "timeline": tl.to_data(), "units": [u.to_dict() for u in actual_units(sharded)],
        "collectives": dict(synced),
    }


def _meter_data(m: Meter, model: Any, opt: Any, batch: Any) -> dict[str, Any]:
    end = resident_tensor_bytes(model, opt, [batch]) if m.source in ("os", "none") else m.current()
    return {"source": m.source, "start": m.start, "peak": m.peak, "end": end,
            "breakdown": dict(getattr(m, "breakdown", {}))}


class _NoMeter(Meter):
    """Measures nothing: the baseline for the cost of measuring."""

    def current(self) -> int:
        return 0

    @contextlib.contextmanager
    def measure(self) -> Iterator[Meter]:
        yield self


def _make_meter(name: str, ctx: RankContext, model: Any, opt: Any, batch: Any,
                construction: TrackerMeter | None, cuda_base: int = 0) -> Meter:
    if name == "MemTracker":
        return construction or tracker_meter(ctx.device)  # type: ignore[return-value]
    if name == "FSDPMemTracker":
        m = tracker_meter(ctx.device, model, opt)
        assert m is not None  # _choose_meter checked the class exists
        m.tracker.track_inputs((batch,))
        return m
    if name == "cuda":
        return CudaMeter(ctx.device, cuda_base)
    if name == "os":
        return OSMeter(functools.partial(resident_tensor_bytes, model, opt, [batch]))
    return _NoMeter("none")


def _choose_meter(ctx: RankContext, meter: str, version: str) -> str:
    from fsdp_conformance import _compat

    if meter not in METERS:
        raise MemoryCheckError(f"unknown meter {meter!r}; choose one of {', '.join(METERS)}")
    if meter == "auto":
        if ctx.device_type == "cuda":
            return "cuda"
        if version == "fsdp2" and _compat.fsdp_mem_tracker_cls() is not None:
            return "FSDPMemTracker"
        if _compat.mem_tracker_cls() is not None:
            return "MemTracker"
        why = OSMeter.available()
        if why:
            skip_rank(f"torch {_torch_version()} moved its memory trackers and {why}")
        return "os"
    if meter == "tracker":
        if _compat.mem_tracker_cls() is None:
            skip_rank(f"torch {_torch_version()} has no MemTracker (moved by an upgrade)")
        return "MemTracker"
    if meter == "os":
        why = OSMeter.available()
        if why:
            skip_rank(why)
        return "os"
    if meter == "cuda" and ctx.device_type != "cuda":
        skip_rank("the CUDA allocator figure needs the gpu lane")
    return meter


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


# ============================================================================================
# Rank functions (module level, picklable, plain data back)
# ============================================================================================

#: The reference model of the memory checks: the seeds' MassiveModel at dim 256 (2.4 MB per
#: layer in fp32, so allocator noise and small tensors do not dominate), 8 layers.
DEFAULT_SPEC = ModelSpec(reference="massive", config=ModelConfig(num_layers=8, dim=256))
DEFAULT_DEPTHS = (2, 4, 8)


#: Below this unsharded size of the largest unit, a unit's gather cannot be told apart from the
#: activations and allocator rounding between two hooks: the sawtooth is not measurable.
SAWTOOTH_MIN_UNIT_BYTES = 256 * 1024


def rank_sawtooth(ctx: RankContext, spec: ModelSpec = DEFAULT_SPEC, version: str = "fsdp2",
                  **kwargs: Any) -> dict[str, Any]:
    """:func:`rank_step` for the sawtooth, skipped (on every rank alike) when units are tiny."""
    units, config = plan_step(spec, ctx.world_size, version,
                              optimizer=kwargs.get("optimizer"),
                              batch_size=kwargs.get("batch_size", 2))
    largest = _block_bytes(units, config)
    if largest < SAWTOOTH_MIN_UNIT_BYTES:
        skip_rank(f"the largest unit of {spec.name} is {largest / 1024:.0f} KiB unsharded, under "
                  f"{SAWTOOTH_MIN_UNIT_BYTES // 1024} KiB: a gather that small cannot be told "
                  "apart from activations in the timeline; use a larger config of the model")
    return rank_step(ctx, spec, version, **kwargs)


def require_sharding(ctx: RankContext, version: str) -> None:
    """Skip (on every rank alike) where the wrapping cannot change memory: FSDP1 at one rank.

    FSDP1 clamps every sharding strategy to NO_SHARD at world size 1 (torch's
    ``_init_core_state`` warns "FSDP is switching to use `NO_SHARD`"): units never gather or
    release, so per-layer and monolithic wrapping hold the same memory and neither the bound's
    negative controls nor the sawtooth can be told apart. FSDP2 still shards over a mesh of one
    (it gathers into separate unsharded parameters), so it is measured at world size 1.
    """
    if version == "fsdp1" and ctx.world_size == 1:
        skip_rank("FSDP1 runs NO_SHARD at world size 1 (torch switches any sharding strategy to "
                  "NO_SHARD): nothing is gathered or released, so the per-layer memory claims "
                  "cannot be told apart from monolithic wrapping; run at world size >= 2")


def rank_step(ctx: RankContext, spec: ModelSpec = DEFAULT_SPEC, version: str = "fsdp2",
              wrapping: str = "per_layer", optimizer: str | None = None, batch_size: int = 2,
              compare_with: str | None = None) -> dict[str, Any]:
    """One measured step plus the per-layer bound for this model and world size.

    ``compare_with`` (e.g. "monolithic") also measures that wrapping's timeline, for the
    picture; reference models only, since a user's model may not fit unsharded.
    """
    require_sharding(ctx, version)
    units, config = plan_step(spec, ctx.world_size, version, optimizer=optimizer,
                              batch_size=batch_size)
    result = measure_step(ctx, spec, version, wrapping, optimizer=optimizer,
                          batch_size=batch_size)
    result["bound"] = per_layer_bound(units, config).to_dict()
    result["plan"] = [u.to_dict() for u in units]
    result["compute_bytes"] = config.compute_bytes
    if compare_with and spec.reference is not None and compare_with != wrapping:
        other = measure_step(ctx, spec, version, compare_with, optimizer=optimizer,
                             batch_size=batch_size)
        result["compare"] = {"wrapping": compare_with, "timeline": other["timeline"],
                             "peak": other["meters"][0]["peak"]}
    return result


def with_depth(spec: ModelSpec, num_layers: int) -> ModelSpec:
    """The same model with ``num_layers`` blocks (reference models with a config only)."""
    if spec.reference is None:
        raise MemoryCheckError(
            f"depth invariance needs a model whose depth can be set; {spec.name!r} is a factory "
            "(run the check on a reference model, or pass specs of several depths yourself)"
        )
    config = spec.config if spec.config is not None else spec.build("meta").config
    if not isinstance(config, (ModelConfig, LlamaConfig)):
        raise MemoryCheckError(f"reference model {spec.name!r} has no num_layers in its config")
    return dataclasses.replace(spec, config=dataclasses.replace(config, num_layers=num_layers))


def rank_depths(ctx: RankContext, spec: ModelSpec = DEFAULT_SPEC, version: str = "fsdp2",
                depths: Sequence[int] = DEFAULT_DEPTHS, wrapping: str = "per_layer",
                reference: str = "monolithic", optimizer: str | None = None,
                batch_size: int = 2) -> dict[str, Any]:
    """Peaks at several depths for ``wrapping`` and for the ``reference`` (monolithic) wrapping."""
    if spec.reference is None:
        skip_rank(f"depth invariance needs a reference model with a settable depth; "
                  f"{spec.name!r} is a factory")
    if len(set(depths)) < 3:
        raise MemoryCheckError(f"depth invariance needs at least three depths, got {list(depths)}")
    require_sharding(ctx, version)
    rows = []
    for depth in sorted(set(depths)):
        deep = with_depth(spec, depth)
        units, config = plan_step(deep, ctx.world_size, version, optimizer=optimizer,
                                  batch_size=batch_size)
        bound = per_layer_bound(units, config)
        row: dict[str, Any] = {"depth": depth, "bound": bound.to_dict(),
                               "layer_bytes": _block_bytes(units, config)}
        for w in dict.fromkeys((wrapping, reference)):
            m = measure_step(ctx, deep, version, w, optimizer=optimizer, batch_size=batch_size,
                             timeline=False)
            row[w] = m["meters"][0]["peak"]
        rows.append(row)
    return {"rank": ctx.rank, "rows": rows, "wrapping": wrapping, "reference": reference}


def _block_bytes(units: Sequence[UnitInfo], config: StepConfig) -> int:
    """Unsharded bytes of the largest non-root unit (one layer of the per-layer plan)."""
    others = [u.numel for u in units if u.fqn != ROOT] or [u.numel for u in units]
    return max(others) * config.compute_bytes


def rank_meter_agreement(ctx: RankContext, spec: ModelSpec = DEFAULT_SPEC,
                         version: str = "fsdp2", wrapping: str = "per_layer",
                         track_construction: bool = True, batch_size: int = 2) -> dict[str, Any]:
    """The tracker and the ground truth (OS on CPU, CUDA allocator on GPU) on the same step."""
    truth = "cuda" if ctx.device_type == "cuda" else "os"
    result = measure_step(ctx, spec, version, wrapping, meter="tracker", also=truth,
                          batch_size=batch_size, timeline=False,
                          track_construction=track_construction)
    # A step the ground truth cannot resolve makes any tracker figure "agree": skip it, on
    # every rank alike (the smallest rank's step decides, so no rank skips alone).
    import torch
    import torch.distributed as dist

    seen = result["meters"][1]["peak"] - result["meters"][1]["start"]
    smallest = torch.tensor([int(seen)], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    if smallest.item() <= METER_RESOLUTION_BYTES:
        skip_rank(f"the step of {spec.name} adds {smallest.item() / MB:.2f} MB by the "
                  f"{truth} figure, within the meters' resolution ({_mb(METER_RESOLUTION_BYTES)}):"
                  " tracker and truth cannot be compared; use a larger config of the model or "
                  "batch")
    return result


# ============================================================================================
# Verdicts (parent side, from every rank's values)
# ============================================================================================


def _mb(n: float) -> str:
    return f"{n / MB:.2f} MB"


def _label(params: Mapping[str, Any]) -> str:
    spec = params.get("spec", DEFAULT_SPEC)
    return (f"{params.get('wrapping', 'per_layer')} wrapping, {params.get('version', 'fsdp2')}, "
            f"{getattr(spec, 'name', spec)}")


def peak_verdict(values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Verdict:
    """Every rank's measured peak at or under the per-layer bound (with its tolerance)."""
    rows = []
    for v in values:
        bound = Bound.from_dict(v["bound"])
        meter = v["meters"][0]
        rows.append((v["rank"], meter["peak"], bound, meter))
    over = [(r, p, b, m) for r, p, b, m in rows if p > b.limit]
    bound = rows[0][2]
    peak = max(p for _, p, _, _ in rows)
    figures = {"peak_bytes": peak, "bound_bytes": bound.total, "limit_bytes": bound.limit,
               "peak_over_bound": round(peak / bound.total, 3), "source": rows[0][3]["source"]}
    data = {"bound": bound.to_dict(), "peaks": {r: p for r, p, _, _ in rows},
            "breakdown": {r: m["breakdown"] for r, _, _, m in rows}}
    if not over:
        return Verdict(True, f"{_label(params)}: peak {_mb(peak)} on the highest rank, at or under "
                       f"the per-layer bound {_mb(bound.total)} (limit {_mb(bound.limit)}) on "
                       f"all {len(rows)} ranks", figures, data)
    from fsdp_conformance.units import UnitInfo as _U
    from fsdp_conformance.units import format_unit_tree

    lines = [f"{_label(params)}: peak exceeds the per-layer bound on rank(s) "
             f"{', '.join(str(r) for r, *_ in over)}"]
    for r, p, b, m in over:
        lines.append(f"  rank {r}: peak {_mb(p)} > limit {_mb(b.limit)} (bound {_mb(b.total)} + "
                     f"{b.tolerance:.0%}), over by {_mb(p - b.limit)} ({p / b.total:.2f}x the "
                     f"bound); measured by {m['source']}")
        if m["breakdown"]:
            parts = ", ".join(f"{k} {_mb(x)}" for k, x in sorted(m["breakdown"].items(),
                                                                  key=lambda kv: -kv[1]))
            lines.append(f"    at the peak: {parts}")
    lines += ["expected (per-layer bound, term by term):", bound.format(), "",
              format_unit_tree([_U.from_dict(u) for u in values[0]["plan"]],
                               "expected units (per-layer plan):"), "",
              format_unit_tree([_U.from_dict(u) for u in values[0]["units"]], "actual units:")]
    return Verdict(False, "\n".join(lines), figures, data)


def sawtooth_teeth(timeline: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per unit, in forward order: the rise at its gather and the fall at its release."""
    at: dict[tuple[str, str], int] = {}
    order: list[str] = []
    for e in timeline:
        key = (e["unit"], e["phase"])
        if key not in at:  # the forward samples: the first of each phase
            at[key] = e["bytes"]
            if e["phase"] == "pre_forward":
                order.append(e["unit"])
    teeth = []
    for unit in order:
        try:
            rise = at[(unit, "forward")] - at[(unit, "pre_forward")]
            fall = at[(unit, "forward_done")] - at[(unit, "post_forward")]
        except KeyError:
            continue
        teeth.append({"unit": unit, "rise": rise, "fall": fall})
    return teeth


def sawtooth_verdict(values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Verdict:
    """Each unit's gather rises by about one unit and its release falls back, on every rank.

    Rise: at most the current plus the prefetched unit of the per-layer plan (FSDP2 prefetches
    the next unit in forward), within the tolerance. Fall: the unit's own unsharded bytes,
    within the tolerance (the root is exempt: FSDP keeps it gathered into backward). A sawtooth
    needs teeth: at least two non-root units.
    """
    t = params.get("tolerance", SAWTOOTH_TOLERANCE)
    problems: list[str] = []
    summary = []
    for v in values:
        cb = v["compute_bytes"]
        plan_max = max((u["numel"] for u in v["plan"] if u["fqn"] != ROOT), default=0) * cb
        own = {u["fqn"]: u["numel"] * cb for u in v["units"]}
        teeth = sawtooth_teeth(v["timeline"])
        nonroot = [x for x in teeth if x["unit"] != ROOT]
        r = v["rank"]
        if len(nonroot) < 2:
            whole = next((x["rise"] for x in teeth if x["unit"] == ROOT), 0)
            problems.append(f"rank {r}: no sawtooth: {len(nonroot)} non-root unit(s) ran in "
                            f"forward; the root gathered {_mb(whole)} at once")
        for x in teeth:
            if x["rise"] > (1 + t) * 2 * plan_max:
                problems.append(
                    f"rank {r}: unit {x['unit'] or '(root)'} gathered {_mb(x['rise'])} at once, "
                    f"more than the current + prefetched unit of the per-layer plan "
                    f"(2 x {_mb(plan_max)} + {t:.0%})")
            if x["unit"] != ROOT and x["fall"] < (1 - t) * own.get(x["unit"], 0):
                problems.append(
                    f"rank {r}: unit {x['unit']} kept its parameters after forward: released "
                    f"{_mb(x['fall'])}, expected about {_mb(own[x['unit']])} (its unsharded size, "
                    f"-{t:.0%})")
        summary.append((r, nonroot))
    first = values[0]
    data: dict[str, Any] = {"timeline": first["timeline"],
                            "teeth": sawtooth_teeth(first["timeline"]),
                            "wrapping": first["wrapping"], "limit_bytes": first["bound"]["limit"],
                            "peak_bytes": first["meters"][0]["peak"],
                            "timelines_by_rank": {v["rank"]: v["timeline"] for v in values}}
    if "compare" in first:
        data["compare"] = first["compare"]
    teeth0 = summary[0][1]
    figures = {"teeth": len(teeth0),
               "max_rise_bytes": max((x["rise"] for x in teeth0), default=0),
               "min_fall_bytes": min((x["fall"] for x in teeth0), default=0)}
    if problems:
        lines = [f"{_label(params)}: the timeline is not a per-unit sawtooth:", *problems[:12]]
        if len(problems) > 12:
            lines.append(f"... and {len(problems) - 12} more")
        lines.append("forward teeth on rank 0 (unit: rise / fall):")
        lines += [f"  {x['unit'] or '(root)'}: +{_mb(x['rise'])} / -{_mb(x['fall'])}"
                  for x in sawtooth_teeth(first["timeline"])]
        return Verdict(False, "\n".join(lines), figures, data)
    return Verdict(True, f"{_label(params)}: sawtooth on all {len(values)} ranks: "
                   f"{len(teeth0)} units each rise by at most {_mb(figures['max_rise_bytes'])} and "
                   f"release their own parameters", figures, data)


def _sharded_state(bound: Bound) -> int:
    return sum(t.bytes for t in bound.terms
               if t.scales_with_depth and t.name != "saved activations")


def _saved_activations(bound: Bound) -> int:
    return sum(t.bytes for t in bound.terms if t.name == "saved activations")


def depth_verdict(values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Verdict:
    """The per-layer working set constant across depths on every rank; monolithic's grows.

    Working set = peak - sharded state (params, grads, optimizer state: what per-layer FSDP is
    allowed to add per layer). Saved activations also grow with depth but only part of them is
    alive at a backward peak, so each depth gives a range ``[ws - saved, ws]``; the ranges must
    meet within the tolerance: ``max(ws - saved) <= (1 + tolerance) * min(ws)``, whichever depth
    is the larger one (more at fewer layers is not constant either; the measurement is
    deterministic, see :func:`collectives_release_in_order`). The monolithic reference must grow
    by at least the added layers' unsharded bytes between depths, or the measurement could not
    tell the wrappings apart and the check fails rather than pass blindly.
    """
    t = params.get("tolerance", DEPTH_TOLERANCE)
    problems = []
    tables = {}
    for v in values:
        wrapping, reference = v["wrapping"], v["reference"]
        rows = v["rows"]
        bounds = [Bound.from_dict(row["bound"]) for row in rows]
        ws = [row[wrapping] - _sharded_state(b) for row, b in zip(rows, bounds)]
        low = [w - _saved_activations(b) for w, b in zip(ws, bounds)]
        r = v["rank"]
        # Every pair of depths, both ways: the claim is "constant", so a shallow depth that
        # needs more is a failure too. (A late free on gloo's worker thread once made one
        # depth read ~1 MB high; frees now happen in program order, so it cannot.)
        apart = [(i, j) for j in range(len(rows)) for i in range(len(rows))
                 if i != j and low[j] > (1 + t) * ws[i]]
        if apart:
            i, j = max(apart, key=lambda ij: low[ij[1]] - ws[ij[0]])
            steps = ", ".join(f"{row['depth']} layers: {_mb(w)}" for row, w in zip(rows, ws))
            how = ("grows with depth" if j > i else
                   "is not constant over depth (larger at fewer layers)")
            problems.append(
                f"rank {r}: the {wrapping} working set {how} ({steps}); at "
                f"{rows[j]['depth']} layers at least {_mb(low[j])} (saved activations "
                f"discounted) > {_mb(ws[i])} at {rows[i]['depth']} layers + {t:.0%}")
        ref_ws = ([row[reference] - _sharded_state(b) for row, b in zip(rows, bounds)]
                  if reference != wrapping else ws)
        if reference != wrapping:
            for a, b, wa, wb in zip(rows, rows[1:], ref_ws, ref_ws[1:]):
                added = (b["depth"] - a["depth"]) * b["layer_bytes"]
                if wb - wa < (1 - t) * added:
                    problems.append(
                        f"rank {r}: the {reference} reference grew by only {_mb(wb - wa)} from "
                        f"{a['depth']} to {b['depth']} layers, expected at least the added layers' "
                        f"{_mb(added)}: the measurement cannot tell the wrappings apart")
        tables[r] = [(row["depth"], row[wrapping], _sharded_state(b), w, row[reference], rw)
                     for row, b, w, rw in zip(rows, bounds, ws, ref_ws)]
    shown = next((v["rank"] for v in values if any(p.startswith(f"rank {v['rank']}:")
                                                   for p in problems)), values[0]["rank"])
    table = tables[shown]
    lines = [f"rank {shown}:",
             f"{'layers':>6}  {'peak':>10}  {'sharded':>10}  {'working set':>11}  "
             f"{'monolithic peak':>15}  {'its working set':>15}"]
    lines += [f"{d:>6}  {_mb(p):>10}  {_mb(s):>10}  {_mb(w):>11}  {_mb(m):>15}  {_mb(mw):>15}"
              for d, p, s, w, m, mw in table]
    figures = {"depths": [row[0] for row in table], "working_set_bytes": [row[3] for row in table],
               "peak_bytes": table[-1][1]}
    data = {"rows_by_rank": {v["rank"]: v["rows"] for v in values}}
    if problems:
        return Verdict(False, f"{_label(params)}: depth invariance fails:\n" + "\n".join(problems)
                       + "\n" + "\n".join(lines), figures, data)
    return Verdict(True, f"{_label(params)}: working set constant within {t:.0%} over "
                   f"{len(table)} depths on all {len(values)} ranks\n" + "\n".join(lines),
                   figures, data)


def meter_verdict(values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Verdict:
    """The tracker's step increase (peak - start) within the tolerance of the ground truth's."""
    t = params.get("tolerance", METER_TOLERANCE)
    problems, ratios = [], []
    for v in values:
        tracker, truth = v["meters"][0], v["meters"][1]
        got, want = tracker["peak"] - tracker["start"], truth["peak"] - truth["start"]
        ratio = got / want if want else float("inf")
        ratios.append(round(ratio, 3))
        if want <= METER_RESOLUTION_BYTES:
            # Within the resolution any tracker figure, 0 included, would "agree": no verdict.
            problems.append(f"rank {v['rank']}: {truth['source']} saw the step add only "
                            f"{_mb(want)}, below the meters' resolution "
                            f"({_mb(METER_RESOLUTION_BYTES)}): the tracker's {_mb(got)} cannot "
                            "be judged; use a larger config of the model or batch")
        elif abs(got - want) > max(t * want, METER_RESOLUTION_BYTES):
            problems.append(f"rank {v['rank']}: {tracker['source']} saw the step add {_mb(got)}, "
                            f"{truth['source']} {_mb(want)} (ratio {ratio:.3f}, tolerance {t:.0%} "
                            f"or {_mb(METER_RESOLUTION_BYTES)}, whichever is larger)")
    truth_src = values[0]["meters"][1]["source"]
    figures = {"tracker_over_truth": ratios, "truth": truth_src}
    if problems:
        return Verdict(False, f"{_label(params)}: the tracker disagrees with the {truth_src} "
                       "figure:\n" + "\n".join(problems), figures, {})
    return Verdict(True, f"{_label(params)}: tracker within {t:.0%} of the {truth_src} figure on "
                   f"all ranks (ratios {ratios})", figures, {})


# ============================================================================================
# The checks
# ============================================================================================


def _variants(name: str, description: str, rank_fn: Callable[..., Any],
              verdict: Callable[..., Verdict], env: Mapping[str, str] | None = None,
              **params: Any) -> tuple[Check, ...]:
    return tuple(
        Check(name=name, claim="memory", description=description, rank_fn=rank_fn,
              verdict=verdict, params={"spec": DEFAULT_SPEC, "version": version, **params},
              env=env)
        for version in ("fsdp1", "fsdp2")
    )


PEAK_CHECKS = _variants(
    "memory.peak_within_bound",
    "per-layer wrapping: every rank's peak at or under the term-by-term per-layer bound",
    rank_step, peak_verdict)
SAWTOOTH_CHECKS = _variants(
    "memory.sawtooth",
    "the timeline rises by about one unit at each gather and falls back at each release",
    rank_sawtooth, sawtooth_verdict, compare_with="monolithic")
DEPTH_CHECKS = _variants(
    "memory.depth_invariance",
    "more layers add only sharded state per rank (per-layer); monolithic adds the full layers",
    rank_depths, depth_verdict)
METER_CHECKS = _variants(
    "memory.meter_agrees",
    "torch's tracker agrees with ground truth (OS high-water mark / CUDA allocator) on a step",
    rank_meter_agreement, meter_verdict, env=MALLOC_ENV)

CHECKS: tuple[Check, ...] = PEAK_CHECKS + SAWTOOTH_CHECKS + DEPTH_CHECKS + METER_CHECKS
