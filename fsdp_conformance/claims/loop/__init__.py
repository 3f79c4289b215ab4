"""The training loop users write, FSDP1 and FSDP2, each against a single-process reference on
the same global batch (:class:`~fsdp_conformance.fsdp.reference_step.SliceReference`), with the
collectives observed.

One module per check family; what they share is :mod:`~fsdp_conformance.claims.loop.common`:

* :mod:`~fsdp_conformance.claims.loop.accumulation`: ``loop.accumulation.no_sync`` /
  ``.synced``, gradient accumulation with synchronisation off for all but the last micro-batch,
  and on for every one into existing gradients.
* :mod:`~fsdp_conformance.claims.loop.clipping`: ``loop.clipping.l2`` / ``.inf``, gradient
  clipping by the global norm (FSDP1 the root's ``clip_grad_norm_``, FSDP2
  ``torch.nn.utils.clip_grad_norm_`` on DTensor gradients).
* :mod:`~fsdp_conformance.claims.loop.frozen`: ``loop.frozen`` / ``.unused``, a freeze list
  (a wholly frozen block, a unit mixing frozen and trainable parameters) and parameters a step
  leaves unused (branches the input chooses).
* :mod:`~fsdp_conformance.claims.loop.ignored`: ``loop.ignored``, a module kept out of FSDP
  (FSDP1 ``ignored_modules``, FSDP2 ``ignored_params``) stays local, unsharded, unreduced and
  in the state dict.
* :mod:`~fsdp_conformance.claims.loop.entry_points`: ``loop.entry_points.two_forwards`` /
  ``.non_root`` / ``.divide_factor``, the model entered other than once through its root:
  two forwards before one backward, a block's own forward in the loss, the user's gradient
  divide factor; the optimizer made after the first backward.
* :mod:`~fsdp_conformance.claims.loop.uneven`: ``loop.uneven``, parameters whose dimension 0 does
  not divide by the world size: the shards' sizes, the parameters read back every way a user
  reads them, the steps.
* :mod:`~fsdp_conformance.claims.loop.buffers`: ``loop.buffers``, persistent buffers through
  training (per rank, never synchronised) and every state-dict kind, got and loaded.
"""

from __future__ import annotations

import math

from fsdp_conformance.claims.check import Check, variants
from fsdp_conformance.claims.loop.accumulation import rank_accumulation, verdict_accumulation
from fsdp_conformance.claims.loop.buffers import rank_buffers, verdict_buffers
from fsdp_conformance.claims.loop.clipping import rank_clipping, verdict_clipping
from fsdp_conformance.claims.loop.entry_points import rank_entry_points, verdict_entry_points
from fsdp_conformance.claims.loop.frozen import (
    BRANCH_MODEL,
    rank_frozen,
    rank_frozen_unused,
    verdict_frozen,
    verdict_frozen_unused,
)
from fsdp_conformance.claims.loop.ignored import rank_ignored, verdict_ignored
from fsdp_conformance.claims.loop.uneven import rank_uneven, verdict_uneven
from fsdp_conformance.models.model_spec import ModelSpec

_REF = ModelSpec(reference="odd")
_BRANCH = ModelSpec(reference=BRANCH_MODEL)

#: Every loop check with its reference parameters (the CLI swaps in the user's spec).
CHECKS: tuple[Check, ...] = (
    variants(
        "loop.accumulation.no_sync",
        {
            "fsdp1": "accumulation under no_sync(): updates equal the reference, reduce-scatters "
            "only in the last micro-batch",
            "fsdp2": "accumulation under set_requires_gradient_sync(False): updates equal the "
            "reference, reduce-scatters only in the last micro-batch",
        },
        rank_accumulation,
        verdict_accumulation,
        specs=(_REF,),
        mode="no_sync",
    )
    + variants(
        "loop.accumulation.synced",
        "accumulation into existing gradients with synchronisation on: updates equal the "
        "reference, one reduce-scatter per unit per micro-batch",
        rank_accumulation,
        verdict_accumulation,
        specs=(_REF,),
        mode="synced",
    )
    + variants(
        "loop.clipping.l2",
        {
            "fsdp1": "clipping by the global L2 norm (the root's clip_grad_norm_): the norm is "
            "identical on every rank and equals the reference's, updates equal the reference",
            "fsdp2": "clipping by the global L2 norm (torch.nn.utils.clip_grad_norm_ on DTensor "
            "gradients): the norm is identical on every rank and equals the reference's, updates "
            "equal the reference",
        },
        rank_clipping,
        verdict_clipping,
        specs=(_REF,),
        norm_type=2.0,
    )
    + variants(
        "loop.clipping.inf",
        {
            "fsdp1": "clipping by the global inf norm (the root's clip_grad_norm_): the norm is "
            "identical on every rank and equals the reference's, updates equal the reference",
            "fsdp2": "clipping by the global inf norm (torch.nn.utils.clip_grad_norm_ on DTensor "
            "gradients): the norm is identical on every rank and equals the reference's, updates "
            "equal the reference",
        },
        rank_clipping,
        verdict_clipping,
        specs=(_REF,),
        norm_type=math.inf,
    )
    + variants(
        "loop.frozen",
        {
            "fsdp1": "a freeze list under use_orig_params=True (a wholly frozen block, a mixed "
            "unit): frozen parameters bitwise unchanged, no reduce-scatter for a frozen unit, "
            "updates equal the reference",
            "fsdp2": "a freeze list (a wholly frozen block, a mixed unit): frozen parameters bitwise "
            "unchanged, no reduce-scatter for a frozen unit, updates equal the reference",
        },
        rank_frozen,
        verdict_frozen,
        specs=(_REF,),
    )
    + variants(
        "loop.frozen.unused",
        {
            "fsdp1": "parameters a step leaves unused (on one rank, on all, a unit not run) under "
            "use_orig_params=True: no or zero gradients, updates equal the reference",
            "fsdp2": "parameters a step leaves unused (on one rank, on all, a unit not run) with "
            "set_reduce_scatter_unused_params(True): no or zero gradients, updates equal the "
            "reference",
        },
        rank_frozen_unused,
        verdict_frozen_unused,
        specs=(_BRANCH,),
    )
    + variants(
        "loop.ignored",
        {
            "fsdp1": "a module in ignored_modules stays local and unsharded, its gradient this "
            "rank's own (no collective carries it), its values in the full state dict",
            "fsdp2": "a module's parameters in fully_shard(ignored_params=...) stay local and "
            "unsharded, their gradient this rank's own (no collective carries them), their values "
            "in get_model_state_dict",
        },
        rank_ignored,
        verdict_ignored,
        specs=(_REF,),
    )
    + variants(
        "loop.entry_points.two_forwards",
        "the root's forward on two inputs, summed losses, one backward; the optimizer made after "
        "the first backward: updates equal the reference, every unit that trains reduced",
        rank_entry_points,
        verdict_entry_points,
        specs=(_REF,),
        what="two_forwards",
    )
    + variants(
        "loop.entry_points.non_root",
        "a block's own forward (an FSDP unit called outside the root's forward) in the loss beside "
        "the root's: updates equal the reference, every unit that trains reduced",
        rank_entry_points,
        verdict_entry_points,
        specs=(_REF,),
        what="non_root",
    )
    + variants(
        "loop.entry_points.divide_factor",
        "set_gradient_divide_factor(2 x world size) on every FSDP module: the reduced gradients "
        "are the ranks' sum over that factor (the reference's, its loss scaled by world / factor)",
        rank_entry_points,
        verdict_entry_points,
        versions=("fsdp2",),
        specs=(_REF,),
        what="divide_factor",
    )
    + variants(
        "loop.uneven",
        {
            "fsdp1": "uneven shards: each unit's flat parameter holds ceil(numel / world) elements, "
            "padded; summon_full_params, the full and the sharded state dicts and every update "
            "equal the reference",
            "fsdp2": "uneven shards: each parameter's to_local() holds ceil(rows / world) rows (none "
            "on some ranks); unshard(), the full and the sharded state dicts and every update equal "
            "the reference",
        },
        rank_uneven,
        verdict_uneven,
        specs=(_REF,),
    )
    + variants(
        "loop.buffers",
        "persistent buffers after training equal the reference's per rank (never synchronised); "
        "every state-dict kind carries each with this rank's value, and loading it into a fresh "
        "sharded model restores it",
        rank_buffers,
        verdict_buffers,
        specs=(_REF,),
    )
)

__all__ = ["CHECKS"]
