"""One measured training step on a rank: build, shard, warm up, measure; plain data back.

Used by the memory claim's rank functions and the planner's trust check. Every free of the
measured step happens on the main thread, in program order (:func:`collectives_release_in_order`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fsdp_conformance._compat import storage_key
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.measure.bound import MeasureError
from fsdp_conformance.measure.meters import (
    choose_meter,
    cuda_baseline,
    make_meter,
    meter_data,
    sharded_param_bytes,
    torch_version_string,
    tracker_meter,
)
from fsdp_conformance.measure.timeline import Timeline, record_timeline
from fsdp_conformance.models import policies
from fsdp_conformance.models.model_spec import ModelSpec, call_model, default_loss

# torch's memory trackers are imported by the rank fork server before it forks
# (harness/worker.py, ``warm_rank_imports``), not with this module: their package pulls in
# torch's compiler stack (about 1.2 s), which the parent of a run (it imports this
# module through the claims) never uses and which delayed its first check.

# ============================================================================================
# Collectives that let go of their tensors in program order (gloo)
# ============================================================================================

#: The synchronous collectives FSDP1 and FSDP2 issue on CPU (``torch.distributed`` attributes,
#: looked up at call time by FSDP, so replacing them for one step reaches every call).
SYNCED_COLLECTIVES = (
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "broadcast",
)
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
    free happen on the main thread, in program order: the figure does not depend on
    scheduling. Yields counters (``calls``, ``waited``: calls that found the worker still
    holding on). CUDA: the caching allocator frees in stream order already; nothing changes.
    """

    from fsdp_conformance import _compat

    TorchDispatchMode = _compat.torch_dispatch_mode_cls()

    stats = {"calls": 0, "waited": 0}
    counts = _compat.use_counts()
    if device_type == "cuda" or counts is None or not dist.is_available():
        yield stats
        return

    def tensors_of(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        leaves = _compat.tree_leaves((list(args), dict(kwargs)))
        return [t for t in leaves if isinstance(t, torch.Tensor)]

    class Allocations(TorchDispatchMode):  # type: ignore[misc,valid-type]
        """Weak references to every storage created inside the collective (gloo's copies)."""

        def __init__(self) -> None:
            super().__init__()
            self.refs: list[weakref.ref[Any]] = []

        def __torch_dispatch__(  # type: ignore[no-untyped-def]
            self, func, types, args=(), kwargs=None
        ):
            out = func(*args, **(kwargs or {}))
            for t in _compat.tree_leaves(out):
                if isinstance(t, torch.Tensor) and not _compat.is_view(t):
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
            own = {_compat.storage_key(t.untyped_storage()) for t in held}
            made_here = [r for r in made.refs if _storage_key(r) not in own]
            _wait_for_release(name, made_here, held, before, counts, stats)
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


def _wait_for_release(
    name: str,
    made_here: Sequence[weakref.ref[Any]],
    held: Sequence[Any],
    before: Sequence[tuple[int, int]],
    counts: Callable[[Any], tuple[int, int]],
    stats: dict[str, int],
) -> None:
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    first = True
    # Released: the arguments' counts are back and every storage gloo made is gone.
    while any(r() is not None for r in made_here) or any(
        a > b0 or s > s0 for t, (b0, s0) in zip(held, before) for a, s in (counts(t),)
    ):
        if first:
            stats["waited"] += 1
            first = False
        if time.monotonic() > deadline:
            raise MeasureError(
                f"gloo still held the tensors of {name} {RELEASE_TIMEOUT_S:.0f} s after "
                "it returned: the step's memory cannot be measured in program order"
            )
        os.sched_yield()


def _storage_key(ref: Any) -> int | None:
    # No strong reference outlives this call: holding one would keep the storage alive.
    st = ref()
    return None if st is None else storage_key(st)


# ============================================================================================
# One measured step on a rank
# ============================================================================================


def make_optimizer(model: torch.nn.Module, name: str | None) -> torch.optim.Optimizer | None:
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
    raise MeasureError(f"unknown optimizer {name!r}; choose one of sgd, momentum, adam, adamw")


def train_step(
    model: torch.nn.Module, batch: Any, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """One step: forward, the mean-square loss, backward, and the optimizer when given."""
    loss = default_loss(call_model(model, batch))
    loss.backward()
    if optimizer is not None:
        optimizer.step()


def _zero_grad(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    # set_to_none: the measured step starts with no gradients, as a fresh step would.
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)


def measure_step(
    ctx: RankContext, spec: ModelSpec, version: str, wrapping: str = "per_layer", **options: Any
) -> dict[str, Any]:
    """One measured step (:func:`_measure_once`, whose ``options`` it takes) with mixed
    precision as users write it; where torch's defaults cannot run the model (FSDP1's input-dtype
    error, e.g. ViT; FSDP2's batch-norm error), the step measured again with the version's fix
    (:func:`~fsdp_conformance.fsdp.sharding.with_known_fix`: the failed run's model is freed
    first), said under ``"input_casts"`` (None: the defaults ran, the only run)."""
    from fsdp_conformance.fsdp.sharding import with_known_fix

    def once(known_fix: bool) -> dict[str, Any]:
        return _measure_once(ctx, spec, version, wrapping, known_fix=known_fix, **options)

    out, casts = with_known_fix(version, options.get("param_dtype") is not None, once)
    out["input_casts"] = casts
    return out


def _measure_once(
    ctx: RankContext,
    spec: ModelSpec,
    version: str,
    wrapping: str = "per_layer",
    *,
    optimizer: str | None = None,
    batch_size: int = 2,
    meter: str = "auto",
    also: str | None = None,
    timeline: bool = True,
    track_construction: bool = True,
    param_dtype: str | None = None,
    reduce_dtype: str | None = None,
    record: bool = False,
    checkpoint_every: int = 0,
    checkpoint_ops: bool = False,
    shard_group: int | None = None,
    seq_len: int = 8,
    offload: bool = False,
    known_fix: bool = False,
) -> dict[str, Any]:
    """Build, shard, warm up and measure one step on this rank; plain data back.

    ``meter``: "auto" (the CUDA allocator on GPU, torch's tracker on CPU, the OS figure when an
    upgrade moved the tracker and the allocator setting allows it), "tracker", "os", "cuda", or
    "none" (time the step only). ``also``: a second meter read around the same step (the
    cross-check). ``track_construction=False`` enters ``MemTracker`` only for the step, so it
    misses FSDP1's gather buffers: the meter check's negative control. ``param_dtype``: mixed
    precision with only that dtype named
    (:func:`~fsdp_conformance.fsdp.sharding.param_dtype_kwargs`); ``reduce_dtype`` names the
    reduction dtype too. ``record``: the measured step's collectives, as torch issued them
    (:func:`~fsdp_conformance.fsdp.collectives.record_collectives`), under ``"collective_records"``
    (and each unit's collective numels under ``"collective_unit_sizes"``). ``checkpoint_every``:
    activation checkpointing on every K-th block after sharding (1: every block; 0: none;
    :func:`~fsdp_conformance.fsdp.sharding.checkpoint_blocks`), the FQNs under ``"checkpointed"``;
    ``checkpoint_ops``: op-level selective there (torchtitan's policy).
    ``shard_group``: HSDP with shard groups of that many ranks
    (:func:`~fsdp_conformance.fsdp.sharding.hsdp_kwargs`). ``seq_len``: of the default batch.
    ``offload``: CPU offload of the sharded state
    (:func:`~fsdp_conformance.fsdp.sharding.offload_kwargs`). ``known_fix``: the version's fix
    of its known mixed-precision error (only :func:`measure_step`'s retry asks for it).
    """

    from fsdp_conformance.fsdp.sharding import (
        check_fsdp_version,
        checkpoint_blocks,
        fsdp1_full_precision_units,
        hsdp_kwargs,
        named_batch_norms,
        offload_kwargs,
        param_dtype_kwargs,
        reshard_kwargs,
        shard,
    )
    from fsdp_conformance.models.units import actual_units

    check_fsdp_version(version)
    wrap = policies.wrapping(wrapping)
    primary = choose_meter(ctx, meter, version)
    # Entered only for the step (the meter check's negative control), a tracker must be the
    # plain MemTracker: FSDPMemTracker is built around an already sharded FSDP2 model.
    if primary == "FSDPMemTracker" and not track_construction:
        primary = "MemTracker"
    second = choose_meter(ctx, also, version) if also else None
    # Read before anything of the check is allocated: on GPU the allocator's figures are
    # relative to it (CudaMeter), so workspaces and earlier checks' memory are not the step's.
    baseline = cuda_baseline(ctx.device) if "cuda" in (primary, second) else 0
    torch.manual_seed(0)
    construction = tracker_meter(ctx.device) if primary == "MemTracker" else None
    if construction is None and primary == "MemTracker":
        skip_rank(f"torch {torch_version_string()} has no MemTracker (moved by an upgrade)")
    tracked = construction is not None and track_construction
    scope = construction.tracking() if tracked and construction else contextlib.nullcontext()
    # Built before the tracker is entered: what it must see from their creation are the
    # tensors sharding makes (FSDP1's flat parameters and gather buffers); the model's own
    # are freed by sharding or met at their first forward. A module called outside any other
    # module's forward twice (a weight_norm parametrization, run each time the weight is read
    # while the model is built) makes MemTracker raise "does not support memory tracking for
    # multiple iterative calls".
    built = spec.instantiate(ctx.device)
    model = built.model
    with scope:
        # Resolved before sharding: FSDP2 changes the model's classes in place.
        blocks = built.blocks if checkpoint_every else ()
        policy = built.policy(wrap.policy)
        full_units = (
            {n: sum(p.numel() for p in m.parameters()) for n, m in named_batch_norms(model)}
            if known_fix and version == "fsdp2"
            else {}
        )
        sharded = shard(
            model,
            ctx,
            version,
            policy,
            **reshard_kwargs(version, wrap.reshard_after_forward),
            **param_dtype_kwargs(version, param_dtype, reduce_dtype, known_fix),
            **hsdp_kwargs(ctx, version, shard_group),
            **offload_kwargs(ctx, version, offload),
        )
        if version == "fsdp1" and param_dtype is not None:
            # torch's own full-precision units (MixedPrecision's _BatchNorm), observed.
            full_units = fsdp1_full_precision_units(sharded)
        checkpointed = checkpoint_blocks(sharded, blocks, checkpoint_every, checkpoint_ops)
        opt = make_optimizer(sharded, optimizer)
        batch = spec.batch(sharded, batch_size, ctx.device, seq_len)
        # FSDPMemTracker wraps the sharded model, so it cannot be entered for construction;
        # the warm-up runs inside it instead. Its first use in a process costs about 2.5 MB
        # of resident memory that is no tensor (measured: the OS saw 20.5 MB against the
        # tracker's 18.0 on a first tracked step, 18.4 on every later one), which would
        # otherwise be read by the OS meter as the measured step's. Only where a second meter
        # reads the same step: the tracker alone sees no such memory, and a tracked warm-up
        # costs CPU time. Tracked, the warm-up's collectives also release in program order:
        # a buffer gloo's worker still held would be counted at the start of the measured step.
        first = (
            make_meter(primary, ctx, sharded, opt, batch, construction, baseline)
            if primary == "FSDPMemTracker" and second
            else None
        )
        with contextlib.ExitStack() as warm:
            if first is not None:
                warm.enter_context(collectives_release_in_order(ctx.device_type))
                warm.enter_context(first.tracking())
            train_step(sharded, batch, opt)  # warm-up: lazy init, optimizer state, buffers
        _zero_grad(sharded, opt)
    meters = [first or make_meter(primary, ctx, sharded, opt, batch, construction, baseline)]
    if second:
        meters.append(make_meter(second, ctx, sharded, opt, batch, construction, baseline))
    rec = (
        record_timeline(sharded, meters[0])
        if timeline and primary != "none"
        else contextlib.nullcontext(Timeline())
    )
    with contextlib.ExitStack() as stack:
        # Outermost: every free of the step happens on the main thread, in program order.
        synced = stack.enter_context(collectives_release_in_order(ctx.device_type))
        for m in reversed(meters):  # the primary innermost: its hooks see the others' work
            stack.enter_context(m.measure())
        tl = stack.enter_context(rec)
        if record:
            from fsdp_conformance.fsdp.collectives import record_collectives, unit_sizes

            # Innermost: a dispatch mode of its own, it sees the c10d ops and allocates nothing.
            sizes = unit_sizes(sharded, version, ctx.world_size)
            recorder = stack.enter_context(record_collectives(sizes))
        t0 = time.perf_counter()
        train_step(sharded, batch, opt)
        if ctx.device_type == "cuda":
            torch.cuda.synchronize(ctx.device)
        seconds = time.perf_counter() - t0
    out = {
        "rank": ctx.rank,
        "wrapping": wrapping,
        "version": version,
        "seconds": seconds,
        "meters": [meter_data(m, sharded, opt, batch) for m in meters],
        # What every meter must at least see at every instant of the step: this rank's shards.
        "param_bytes": sharded_param_bytes(sharded),
        "timeline": tl.to_data(),
        "units": [u.to_dict() for u in actual_units(sharded)],
        "collectives": dict(synced),
        "checkpointed": checkpointed,
    }
    # Full-precision units by name, with numels: FSDP2's batch-norm fix (sharding.with_known_fix)
    # or FSDP1's MixedPrecision default (sharding.fsdp1_full_precision_units).
    out["full_precision_units"] = full_units
    if record:
        out["collective_records"] = recorder.records
        # Each unit's possible collective numels: what a record's bytes per element come from.
        out["collective_unit_sizes"] = sizes
    return out
