"""The per-layer bound: plain data in, plain data out (no model, no allocation).

:func:`per_layer_bound` is a pure function of a unit plan (``UnitInfo`` rows from
:func:`~fsdp_conformance.models.units.plan_units`) and a :class:`StepConfig` (world size, dtypes,
optimizer, activation profile). Term by term, so it also answers at full scale (70B on 1,024
ranks). docs/memory.md derives every term. The memory claim, init's peak check and the planner
all use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_conformance.models.units import ROOT, UnitInfo
from fsdp_conformance.sizes import MB

#: Relative tolerance on the bound. Tracker peaks are deterministic at fixed settings, but the
#: OS and CUDA figures move a few percent run to run (up to ~8% seen: docs/memory.md,
#: "Facts about measuring memory on CPU"), so the bound
#: is checked against ``total * (1 + BOUND_TOLERANCE)``.
BOUND_TOLERANCE = 0.10
#: Optimizer state tensors kept per parameter element (sharded, in the parameter dtype).
OPTIMIZER_STATES = {None: 0, "sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}
#: Adam/AdamW also keep one ``step`` scalar per parameter tensor.
OPTIMIZER_SCALARS = {None: 0, "sgd": 0, "momentum": 0, "adam": 1, "adamw": 1}


class MeasureError(ValueError):
    """A bound or a measurement was asked for something it cannot do; the message says the fix."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActivationProfile:
    """Activation memory of one step, per unit, in bytes (from :func:`profile_activations`)."""

    #: The input batch.
    input_bytes: int = 0
    #: Tensors saved for backward, by the unit whose forward saved them (parameters excluded).
    saved_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: Every tensor a unit's forward produces, saved or not (its transient working set).
    produced_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: The tensors a unit's forward receives (parameters excluded): what activation
    #: checkpointing keeps of a checkpointed unit in place of what it would have saved.
    entry_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: Floating-point operations of a unit's forward, nested modules included (torch's
    #: ``FlopCounterMode``): what recomputing a checkpointed unit costs. Empty where unknown.
    forward_flops: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: The outputs of the ops op-level selective activation checkpointing decides on
    #: (:data:`OP_SAC_KINDS`), per unit in forward order: ``(order, kind, bytes, saved bytes,
    #: flops)``, ``saved bytes`` being the part autograd also saves for backward.
    op_outputs: Mapping[str, tuple[tuple[int, str, int, int, int], ...]] = dataclasses.field(
        default_factory=dict
    )
    #: The working set measured with a backward on meta (``profile_activations(backward=True)``,
    #: the planner's): the most bytes alive at once of the tensors the step makes that are
    #: neither saved for backward nor parameter gradients, in forward and in backward. None:
    #: not measured (the working set is then the largest unit's forward products).
    working_forward_bytes: int | None = None
    working_backward_bytes: int | None = None
    #: The same peak while each unit runs, in forward and in backward (a unit's own figure:
    #: the step's alive bytes then, not only what it made). Empty where not measured.
    working_forward_by_unit: Mapping[str, int] = dataclasses.field(default_factory=dict)
    working_backward_by_unit: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: Per unit, the most bytes alive at once in its forward of what its forward made (nested
    #: modules' included; neither saved nor gradients): what a recompute of it makes again.
    forward_local_by_unit: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: Per unit, the working set alive when its backward starts (the gradient flowing into it
    #: and what else is alive then).
    backward_entry_by_unit: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: Per unit, at the moment of its backward where the sum is largest: (bytes it saved for
    #: backward still alive, the working set). What it saved is freed as its backward uses it.
    backward_with_saved_by_unit: Mapping[str, tuple[int, int]] = dataclasses.field(
        default_factory=dict
    )

    def unit_working(self, unit: str) -> tuple[int, int]:
        """(forward, backward) working set while ``unit`` runs (0 where it runs no op)."""
        return (
            self.working_forward_by_unit.get(unit, 0),
            self.working_backward_by_unit.get(unit, 0),
        )

    def recompute_peak(self, unit: str, again: int) -> tuple[int, int, str]:
        """The activation peak of ``unit`` were it checkpointed, as (its saved set alive then,
        the working set then, how): the recompute (all of ``again``, its recomputed saved set,
        with what was alive as its backward started and what its forward makes again; or, if
        larger, its first forward's working set, when that saved set is transient) or its
        backward, as measured on meta (what it saved still alive and the working set),
        whichever sum is larger. Without the per-unit figures: ``again``
        with the unit's forward and backward working sets summed."""
        fwd, bwd = self.unit_working(unit)
        local = self.forward_local_by_unit.get(unit)
        entry = self.backward_entry_by_unit.get(unit)
        if local is None or entry is None:
            return again, fwd + bwd, f"its forward {fwd:,} B + its backward {bwd:,} B"
        # Its first forward, checkpointed, keeps none of its saved set: those tensors are
        # transient then, with the forward's working set (``fwd``) and less than all of saved
        # activations: within ``again`` + ``fwd``.
        recompute = (again, max(entry + local, fwd))
        saved, working = self.backward_with_saved_by_unit.get(unit, (0, 0))
        if sum(recompute) >= saved + working:
            return (
                *recompute,
                f"while it is recomputed: what was alive as its backward started "
                f"({entry:,} B) + what its forward makes again ({local:,} B)"
                if entry + local >= fwd
                else f"in its checkpointed forward: the working set then ({fwd:,} B)",
            )
        # What it saved beyond ``again`` is what the recompute does not make again (the op
        # outputs op-level checkpointing keeps): counted in saved activations.
        return (
            min(saved, again),
            working,
            f"during its backward, with {min(saved, again):,} B of its recomputed saved set "
            "still alive",
        )

    def op_kept(self, unit: str) -> tuple[int, int, int]:
        """What op-level selective activation checkpointing keeps of ``unit`` from forward to
        its backward, as torchtitan's policy (``apply_ac``, ``selective_ac_option = "op"``)
        decides: every attention output, and the output of every other matmul (the 1st, 3rd,
        ... of each checkpointed call; the others are recomputed). Returns (bytes kept, of
        those the bytes autograd saves anyway, forward FLOPs of the kept ops: not recomputed).
        """
        kept = saved = flops = mm = 0
        for _, kind, nbytes, also_saved, op_flops in sorted(self.op_outputs.get(unit, ())):
            if kind == "mm":
                mm += 1
                if mm % 2 == 0:
                    continue
            kept, saved, flops = kept + nbytes, saved + also_saved, flops + op_flops
        return kept, saved, flops

    def to_dict(self) -> dict[str, Any]:
        return {
            "input_bytes": self.input_bytes,
            "saved_bytes": dict(self.saved_bytes),
            "produced_bytes": dict(self.produced_bytes),
            "entry_bytes": dict(self.entry_bytes),
            "forward_flops": dict(self.forward_flops),
            "op_outputs": {k: [list(e) for e in v] for k, v in self.op_outputs.items()},
            "working_forward_bytes": self.working_forward_bytes,
            "working_backward_bytes": self.working_backward_bytes,
            "working_forward_by_unit": dict(self.working_forward_by_unit),
            "working_backward_by_unit": dict(self.working_backward_by_unit),
            "forward_local_by_unit": dict(self.forward_local_by_unit),
            "backward_entry_by_unit": dict(self.backward_entry_by_unit),
            "backward_with_saved_by_unit": {
                k: list(v) for k, v in self.backward_with_saved_by_unit.items()
            },
        }


#: The op kinds of :attr:`ActivationProfile.op_outputs`: "mm" (a matmul, ``aten.mm``; every
#: other one kept) and "attention" (fused attention's outputs, always kept).
OP_SAC_KINDS = ("mm", "attention")


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
    #: Bytes per element of the gradient reduction (the reduce-scatter's input); None: the
    #: compute bytes (no reduce dtype of its own).
    reduce_bytes: int | None = None
    #: None (forward/backward only), "sgd", "momentum", "adam" or "adamw".
    optimizer: str | None = None
    #: Buffers (replicated, never sharded), in bytes.
    buffer_bytes: int = 0
    #: Activations; None counts none (a plan without a batch).
    activations: ActivationProfile | None = None
    #: Relative tolerance the bound is checked with.
    tolerance: float = BOUND_TOLERANCE
    #: Units whose forward runs under activation checkpointing (recomputed in backward):
    #: they keep only what enters them until backward, then their saved set while recomputed.
    checkpointed: tuple[str, ...] = ()
    #: Op-level selective activation checkpointing of the ``checkpointed`` units: each keeps,
    #: besides its inputs, the outputs of the ops the policy saves
    #: (:meth:`ActivationProfile.op_kept`); the rest is recomputed in backward.
    checkpoint_ops: bool = False
    #: HSDP: the ranks each unit is sharded over (a 2-D mesh of world / shard_group replicas x
    #: shard_group, or FSDP1's HYBRID_SHARD); None shards over the whole world.
    shard_group: int | None = None
    #: CPU offload (FSDP1 ``CPUOffload(offload_params=True)``, FSDP2 ``CPUOffloadPolicy``): the
    #: sharded parameters, gradients and optimizer state live in host memory
    #: (:func:`host_bytes`); the bound is then the device's.
    offload: bool = False

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
        if self.shard_group is not None and not (
            1 <= self.shard_group <= self.world_size and self.world_size % self.shard_group == 0
        ):
            raise ValueError(
                f"StepConfig.shard_group must divide the world size "
                f"{self.world_size}, got {self.shard_group}"
            )

    @property
    def shard_ranks(self) -> int:
        """The ranks a unit is sharded over: the shard group under HSDP, else the world."""
        return self.shard_group or self.world_size


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
        lines.append(
            f"  {'total':<{width}}  {self.total / MB:9.2f} MB  "
            f"(limit with {self.tolerance:.0%} tolerance: {self.limit / MB:.2f} MB)"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "terms": [dataclasses.asdict(t) for t in self.terms],
            "tolerance": self.tolerance,
            "total": self.total,
            "limit": self.limit,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Bound:
        return cls(tuple(BoundTerm(**t) for t in data["terms"]), float(data["tolerance"]))


def _shard(numel: int, world_size: int) -> int:
    # FSDP1 pads each flat parameter to a multiple of the world size, so a rank holds exactly
    # ceil(numel / W); FSDP2 pads each parameter's dim 0, which ceil matches whenever dim 0
    # divides by W (it does for every model here and for Llama shapes up to 1,024 ranks).
    return -(-numel // world_size)


#: The term :func:`with_full_precision_units` adds.
FULL_PRECISION_TERM = "fp32 units"


def with_full_precision_units(bound: Bound, numels: Mapping[str, int]) -> Bound:
    """``bound`` with the full-precision units (``numels``: each unit's unsharded numel,
    ``step.measure_step``'s ``"full_precision_units"``: FSDP2's batch-norm fix, or the
    ``_BatchNorm`` units FSDP1's ``MixedPrecision`` keeps fp32 by default) counted once more:
    the plan counts their parameters at the compute dtype (inside their parents' units), the
    run gathers them as units of their own in fp32. Each is counted
    unsharded at 4 B three times (gathered parameters, unsharded gradient, reduce-scatter
    input), all at once: an upper bound. ``numels`` empty: ``bound`` as it is."""
    if not numels:
        return bound
    total = sum(numels.values())
    term = BoundTerm(
        FULL_PRECISION_TERM,
        3 * 4 * total,
        f"{len(numels)} unit(s) in fp32 ({total:,} elements): gathered params, "
        f"grads and reduce-scatter input, 3 x {total:,} x 4 B",
    )
    return Bound((*bound.terms, term), bound.tolerance)


def per_layer_bound(units: Sequence[UnitInfo], config: StepConfig) -> Bound:
    """The per-rank peak of one training step under a per-layer plan, term by term.

    Every term is computed from ``units`` (unsharded numel per unit) and ``config``; see
    docs/memory.md for the derivation. It is an upper bound: each transient term is the largest
    it can be, and they are summed as if they coincided.
    """
    if not units:
        raise ValueError("per_layer_bound needs at least one unit (the root)")
    # Every per-rank figure follows the ranks a unit is sharded over; under HSDP the replicas'
    # all-reduce of the gradient shards runs in place on the reduce-scatter's output.
    w, pb, cb = config.shard_ranks, config.param_bytes, config.compute_bytes
    rb = cb if config.reduce_bytes is None else config.reduce_bytes
    root = next((u for u in units if u.fqn == ROOT), None)
    root_numel = root.numel if root is not None else 0
    others = sorted((u for u in units if u.fqn != ROOT), key=lambda u: u.numel, reverse=True)
    top2 = others[:2]
    over = (
        ""
        if config.shard_group is None
        else f" (HSDP: shard groups of {w} ranks, {config.world_size // w} replicas)"
    )
    largest = max(units, key=lambda u: u.numel)
    if config.offload:
        copies = 2 * _shard(largest.numel, w)
        terms = [
            BoundTerm(
                "offloaded shard copies",
                copies * pb,
                f"cpu offload: sharded params, grads and optimizer state in host memory "
                f"({host_bytes(units, config):,} B per rank); on the device the largest unit's "
                f"parameter shard (copied in for its all-gather) and gradient shard (before its "
                f"copy out): 2 x ceil({largest.numel:,}/{w}) = {copies:,} x {pb} B" + over,
            )
        ]
    else:
        terms = _sharded_state_terms(units, config, over)
    if config.version == "fsdp1":
        gathered = root_numel + sum(u.numel for u in top2)
        names = ", ".join(u.fqn for u in top2) or "none"
        what = f"current and prefetched unit (two largest: {names})"
    else:
        # FSDP2 holds the prefetched unit as its all-gather output until its own copy-out
        # (backward), and the current unit's output until the next copy-out (forward): the
        # second gathered unit is the all-gather buffers' output, not a second unsharded one.
        gathered = root_numel + sum(u.numel for u in top2[:1])
        names = top2[0].fqn if top2 else "none"
        what = (
            f"current unit (largest: {names}; the prefetched one is held as its all-gather "
            "output, counted there)"
        )
    terms.append(
        BoundTerm(
            "unsharded params",
            gathered * cb,
            f"root ({root_numel:,}, kept gathered from forward into backward) + {what} = "
            f"{gathered:,} x {cb} B",
        )
    )
    # FSDP1 casts the unsharded gradient to the reduce dtype in place of the flat gradient
    # (``flat_param.grad.data = grad.to(reduce_dtype)``): both are alive at the cast. FSDP2
    # copies into its reduce-scatter input instead, counted with the reduce-scatter buffers.
    cast = rb if config.version == "fsdp1" and rb != cb else 0
    terms.append(
        BoundTerm(
            "unsharded grads",
            largest.numel * (cb + cast),
            f"the current unit's full gradient before its reduce-scatter (largest unit "
            f"{largest.fqn or '(root)'}: {largest.numel:,}) x {cb} B; the prefetched one has none yet"
            + (f"; + its fsdp1 cast to the reduce dtype, x {cast} B" if cast else ""),
        )
    )
    ag_numel = _all_gather_buffer_numel(largest.numel, w, config.version)
    terms.append(
        BoundTerm(
            "all-gather buffers",
            ag_numel * cb,
            "fsdp1 gathers into the unsharded flat parameter itself (counted above): 0"
            if config.version == "fsdp1"
            else f"fsdp2 copy-in shard + gather output of the largest unit: ceil({largest.numel:,}/{w}) "
            f"+ {largest.numel:,} = {ag_numel:,} x {cb} B",
        )
    )
    rs_numel = _reduce_scatter_buffer_numel(largest.numel, w, config.version)
    rs_input = (
        "padded input copy (only when numel % W != 0)"
        if config.version == "fsdp1"
        else "input copy"
    )
    terms.append(
        BoundTerm(
            "reduce-scatter buffers",
            rs_numel * rb,
            f"{rs_input} + output shard of the largest unit = {rs_numel:,} x {rb} B",
        )
    )
    if config.buffer_bytes:
        terms.append(
            BoundTerm("buffers", config.buffer_bytes, "model buffers, replicated on every rank")
        )
    acts = config.activations
    if acts is not None:
        terms.append(BoundTerm("input batch", acts.input_bytes, "the step's input tensors"))
        ckpt = [u for u in config.checkpointed if u in acts.saved_bytes]
        # Op-level selective checkpointing: what each checkpointed unit keeps, read once.
        kept = {u: acts.op_kept(u) for u in ckpt} if config.checkpoint_ops else None
        terms.append(_saved_term(acts, ckpt, kept))
        recomputed = _recomputed(acts, ckpt, kept)
        if acts.working_forward_by_unit or acts.working_backward_by_unit:
            terms += _unit_peak_terms(acts, recomputed, config.checkpoint_ops)
        else:
            terms += _step_peak_terms(acts, recomputed, config.checkpoint_ops)
    return Bound(tuple(terms), config.tolerance)


def _recomputed(
    acts: ActivationProfile, ckpt: Sequence[str], kept: Mapping[str, tuple[int, int, int]] | None
) -> dict[str, int]:
    """Per checkpointed unit, its saved set while backward recomputes it: all of it, or
    under op-level selective checkpointing (``kept``: :meth:`ActivationProfile.op_kept` per
    unit) less the kept op outputs the recompute reuses."""
    if kept is not None:
        return {u: acts.saved_bytes[u] - kept[u][1] for u in ckpt}
    return {u: acts.saved_bytes[u] for u in ckpt}


def _recomputed_text(ops: bool) -> str:
    return (
        "the saved set of one checkpointed unit while backward recomputes it, less the kept "
        "op outputs it reuses"
        if ops
        else "the saved set of one checkpointed unit while backward recomputes it"
    )


def _unit_peak_terms(
    acts: ActivationProfile, recomputed: Mapping[str, int], ops: bool
) -> list[BoundTerm]:
    """The working set, and with checkpointing the recomputed unit, at the unit where their
    sum is largest (measured on meta with the step's backward, per unit).

    While a unit that is not checkpointed runs, the working set is what the step keeps alive
    then (:meth:`ActivationProfile.unit_working`: the larger of its forward and its backward).
    A checkpointed unit's backward first runs its forward again: its saved set exists once
    more (the recomputed unit) with what was alive when the backward started (the gradient
    flowing in) and what its forward makes again; then its backward frees that set as it
    uses it: :meth:`ActivationProfile.recompute_peak`. Without per-unit figures,
    :func:`_step_peak_terms`.
    """
    peaks: dict[str, tuple[int, int, str]] = {}
    for unit in {*acts.working_forward_by_unit, *acts.working_backward_by_unit, *recomputed}:
        fwd, bwd = acts.unit_working(unit)
        peaks[unit] = (
            acts.recompute_peak(unit, recomputed[unit])
            if unit in recomputed
            else (0, max(fwd, bwd), f"forward {fwd:,} B, backward {bwd:,} B")
        )
    worst = max(sorted(peaks), key=lambda u: peaks[u][0] + peaks[u][1])
    again, working, how_measured = peaks[worst]
    name = worst or "(root)"
    terms = []
    if recomputed:
        terms.append(
            BoundTerm(
                "recomputed unit",
                again,
                f"{_recomputed_text(ops)}: {name}, at the step's activation peak"
                if worst in recomputed
                else "0: no checkpointed unit's recompute is at the step's activation peak "
                f"({name}'s working set, {working:,} B, is above every checkpointed unit's "
                "saved set with its working set; largest saved set "
                f"{max(recomputed.values()):,} B)",
            )
        )
    how = (
        f"at {name}, checkpointed, {how_measured}"
        if worst in recomputed
        else f"while {name} runs: {how_measured}"
    )
    terms.append(
        BoundTerm(
            "activation working set",
            working,
            f"the most the step keeps alive besides saved activations and gradients, {how} "
            f"(measured per unit on meta with the step's backward; the whole step: forward "
            f"{acts.working_forward_bytes or 0:,} B, backward {acts.working_backward_bytes or 0:,} B)",
        )
    )
    return terms


def _step_peak_terms(
    acts: ActivationProfile, recomputed: Mapping[str, int], ops: bool
) -> list[BoundTerm]:
    """The recomputed unit and the working set as if they coincided: the step's working set
    (measured on meta with its backward) or, without a backward (the memory checks' profile),
    everything one unit's forward produces."""
    terms = []
    if recomputed:
        again = max(recomputed, key=lambda u: recomputed[u])
        terms.append(
            BoundTerm(
                "recomputed unit",
                recomputed[again],
                f"{_recomputed_text(ops)} (largest: {again})",
            )
        )
    fwd, bwd = acts.working_forward_bytes, acts.working_backward_bytes
    if fwd is None or bwd is None:
        unit = max(acts.produced_bytes, key=lambda k: acts.produced_bytes[k], default=None)
        terms.append(
            BoundTerm(
                "activation working set",
                acts.produced_bytes.get(unit, 0) if unit is not None else 0,
                f"everything one unit's forward produces, saved or not (largest: "
                f"{unit or '(root)'}); also covers that unit's activation gradients in backward",
            )
        )
        return terms
    terms.append(
        BoundTerm(
            "activation working set",
            max(fwd, bwd),
            f"the most the step keeps alive at once besides saved activations and gradients "
            f"(measured on meta with its backward): forward {fwd:,} B, backward {bwd:,} B",
        )
    )
    return terms


def _sharded_state_terms(
    units: Sequence[UnitInfo], config: StepConfig, over: str = ""
) -> list[BoundTerm]:
    """Sharded params, sharded grads and (with an optimizer) its state, per rank: on the
    device, or on the host under CPU offload (:func:`host_bytes`)."""
    w, pb = config.shard_ranks, config.param_bytes
    shard_numel = sum(_shard(u.numel, w) for u in units)
    num_tensors = sum(len(u.params) for u in units)
    terms = [
        BoundTerm(
            "sharded params",
            shard_numel * pb,
            f"sum over {len(units)} units of ceil(numel/{w}) = {shard_numel:,} x {pb} B" + over,
            scales_with_depth=True,
        ),
        BoundTerm(
            "sharded grads",
            shard_numel * pb,
            f"one gradient shard per parameter shard: {shard_numel:,} x {pb} B",
            scales_with_depth=True,
        ),
    ]
    states, scalars = OPTIMIZER_STATES[config.optimizer], OPTIMIZER_SCALARS[config.optimizer]
    if config.optimizer is not None:
        terms.append(
            BoundTerm(
                "optimizer state",
                (states * shard_numel + scalars * num_tensors) * pb,
                f"{config.optimizer}: {states} state(s) x {shard_numel:,} + {scalars} step scalar(s) "
                f"x {num_tensors} tensors, x {pb} B",
                scales_with_depth=True,
            )
        )
    return terms


def host_bytes(units: Sequence[UnitInfo], config: StepConfig) -> int:
    """Host memory per rank under CPU offload: the sharded parameters, gradients and optimizer
    state the device no longer holds (0 without offload)."""
    if not config.offload:
        return 0
    return sum(t.bytes for t in _sharded_state_terms(units, config))


def _saved_term(
    acts: ActivationProfile,
    ckpt: Sequence[str],
    kept: Mapping[str, tuple[int, int, int]] | None = None,
) -> BoundTerm:
    """Saved activations, all alive at the end of forward.

    A checkpointed unit saves nothing for backward in forward: it keeps what entered it (its
    inputs, for the recompute); everything else is saved as without checkpointing. Under
    op-level selective checkpointing (``kept``: :meth:`ActivationProfile.op_kept` per unit) a
    checkpointed unit also keeps the outputs its policy saves until its backward. The
    recompute itself is :func:`_recomputed`.
    """
    if not ckpt:
        return BoundTerm(
            "saved activations",
            sum(acts.saved_bytes.values()),
            f"tensors saved for backward by all {len(acts.saved_bytes)} units and the loss, all "
            "alive at the end of forward (measured on meta)",
            scales_with_depth=True,
        )
    others = sum(v for k, v in acts.saved_bytes.items() if k not in ckpt)
    entries = sum(acts.entry_bytes.get(u, 0) for u in ckpt)
    not_ckpt = len(acts.saved_bytes) - len(ckpt)
    if kept is None:
        return BoundTerm(
            "saved activations",
            others + entries,
            f"saved for backward by the {not_ckpt} units not checkpointed and the loss "
            f"({others:,} B), + the inputs the {len(ckpt)} checkpointed units keep for their "
            f"recompute ({entries:,} B), all alive at the end of forward (measured on meta)",
            scales_with_depth=True,
        )
    outputs = sum(kept[u][0] for u in ckpt)
    return BoundTerm(
        "saved activations",
        others + entries + outputs,
        f"saved for backward by the {not_ckpt} units not checkpointed and the loss ({others:,} B), "
        f"+ the inputs the {len(ckpt)} units under op-level selective checkpointing keep for "
        f"their recompute ({entries:,} B) and the op outputs their policy keeps (attention, every "
        f"other matmul: {outputs:,} B), all alive at the end of forward (measured on meta)",
        scales_with_depth=True,
    )


def _all_gather_buffer_numel(numel: int, world_size: int, version: str) -> int:
    if version == "fsdp1":
        return 0
    return _shard(numel, world_size) + _shard(numel, world_size) * world_size


def _reduce_scatter_buffer_numel(numel: int, world_size: int, version: str) -> int:
    out = _shard(numel, world_size)
    if version == "fsdp1":
        return out + (out * world_size if numel % world_size else 0)
    return out + out * world_size


def init_peak_bound(
    sharded_bytes: int,
    largest_unit_bytes: int,
    version: str,
    tolerance_fraction: float,
    fixed_bytes: float,
) -> tuple[float, int]:
    """Peak while materializing a meta-built model: ``(bound bytes, FSDP1 flat copy bytes)``.

    The sharded model this rank keeps, plus one unit unsharded (FSDP1 materializes a whole unit
    before sharding it; FSDP2 materializes only shards, and init generates one full parameter at
    a time, at most one unit), plus on FSDP1 one more unit: the flat parameter it concatenates
    the unit into while the materialized originals still exist. Checked with
    ``tolerance_fraction`` of that plus ``fixed_bytes`` (docs/init.md, the peak-memory bound).
    """
    flatten = largest_unit_bytes if version == "fsdp1" else 0
    raw = sharded_bytes + largest_unit_bytes + flatten
    return raw * (1 + tolerance_fraction) + fixed_bytes, flatten
