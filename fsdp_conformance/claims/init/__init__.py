"""The init claim: meta-device init gives a zero-memory build, correct weights, the same on
every rank.

The library it checks is two blocks: :mod:`fsdp_conformance.fsdp.meta_init` (build on meta, the init
contracts, the deterministic init and its single-process reference) and
:mod:`fsdp_conformance.fsdp.meta_materialize` (shard, ``to_empty`` and materialize by method, then
inspect). One module per check family here: :mod:`.meta_build`, :mod:`.weights` (``no_meta``,
``weights``, ``weights.default_path``), :mod:`.faithful` (``weights.faithful``: the reference
against the model as its factory builds it), :mod:`.broadcast` (``sync_module_states``,
``broadcast_rank0``), :mod:`.train_step`, :mod:`.peak_memory`, :mod:`.seeds`; what they share
(the default model, the negative controls' :data:`~.common.FAULTS`, the reports and how they
are judged) is :mod:`.common`.

The checks compare what every rank holds against the single-process reference: never "finite"
(``to_empty`` memory can look finite) and never "identical across ranks" (gathered weights are
identical on every rank even when the ranks initialized differently: docs/init.md, "Facts about
meta-device init"). :data:`SEEDS_CHECKS` runs the seeds' ``materialization_fn`` as written and
turns what goes wrong into one-line findings (:func:`~.common.describe_init_error`).
"""

from __future__ import annotations

from fsdp_conformance.claims.check import Check, variants
from fsdp_conformance.claims.init.broadcast import (
    rank_broadcast_rank0,
    rank_sync_module_states,
    verdict_broadcast_rank0,
    verdict_sync_module_states,
)
from fsdp_conformance.claims.init.common import DEFAULT_SPEC
from fsdp_conformance.claims.init.faithful import rank_weights_faithful, verdict_weights_faithful
from fsdp_conformance.claims.init.meta_build import rank_meta_build, verdict_meta_build
from fsdp_conformance.claims.init.peak_memory import (
    MEMORY_SPEC,
    rank_peak_memory,
    verdict_peak_memory,
)
from fsdp_conformance.claims.init.seeds import verdict_seeds_fn, verdict_seeds_fn_to_empty
from fsdp_conformance.claims.init.train_step import rank_train_step, verdict_train_step
from fsdp_conformance.claims.init.weights import rank_weights, verdict_no_meta, verdict_weights
from fsdp_conformance.measure.meters import MALLOC_ENV

CHECKS: tuple[Check, ...] = (
    variants(
        "init.meta_build",
        "building the model on meta allocates no storage (peak memory grows by almost nothing)",
        rank_meta_build,
        verdict_meta_build,
        versions=None,
        specs=(DEFAULT_SPEC,),
    )
    + variants(
        "init.no_meta",
        {
            "fsdp1": "FSDP1 + param_init_fn: every parameter and buffer on the compute device, "
            "initialized",
            "fsdp2": "FSDP2 + to_empty + init: every parameter and buffer on the compute device, "
            "initialized",
        },
        rank_weights,
        verdict_no_meta,
        specs=(DEFAULT_SPEC,),
    )
    + variants(
        "init.weights",
        {
            v: f"{v.upper()}: each rank's shards and the gathered weights equal the single-process "
            "reference"
            for v in ("fsdp1", "fsdp2")
        },
        rank_weights,
        verdict_weights,
        specs=(DEFAULT_SPEC,),
    )
    + variants(
        "init.weights.default_path",
        "FSDP1's default meta path (to_empty + reset_parameters per module, no param_init_fn) "
        "equals the same calls made single-process in FSDP1's order",
        rank_weights,
        verdict_weights,
        versions=("fsdp1",),
        specs=(DEFAULT_SPEC,),
        method="reset_parameters",
    )
    + variants(
        "init.weights.faithful",
        "the meta init's weights are the model's own: the factory's model (seeded, on CPU) "
        "against the reference, by value where the factory's values do not depend on the seed, "
        "by distribution elsewhere",
        rank_weights_faithful,
        verdict_weights_faithful,
        versions=None,
        specs=(DEFAULT_SPEC,),
    )
    + variants(
        "init.sync_module_states",
        "FSDP1 sync_module_states=True: refused on CPU (a fact); on GPU rank 0's weights win",
        rank_sync_module_states,
        verdict_sync_module_states,
        versions=None,
        specs=(DEFAULT_SPEC,),
    )
    + variants(
        "init.broadcast_rank0",
        {
            "fsdp1": "FSDP1: an explicit rank-0 broadcast in param_init_fn gives every rank rank "
            "0's weights",
            "fsdp2": "FSDP2: set_model_state_dict(broadcast_from_rank0=True) gives every rank "
            "rank 0's weights",
        },
        rank_broadcast_rank0,
        verdict_broadcast_rank0,
        specs=(DEFAULT_SPEC,),
    )
    + variants(
        "init.train_step",
        {
            v: f"{v.upper()}: the first training step after meta init matches the reference's"
            for v in ("fsdp1", "fsdp2")
        },
        rank_train_step,
        verdict_train_step,
        specs=(DEFAULT_SPEC,),
    )
    + variants(
        "init.peak_memory",
        {
            "fsdp1": "FSDP1: peak host memory while materializing stays within shards + one unit "
            "(+ flat copy)",
            "fsdp2": "FSDP2: peak host memory while materializing stays within shards + one unit",
        },
        rank_peak_memory,
        verdict_peak_memory,
        specs=(MEMORY_SPEC,),
        env=MALLOC_ENV,
    )
)

#: The seeds' ``materialization_fn`` as written, through the same rank function: expected to
#: fail, each with a one-line finding (docs/init.md). Not in CHECKS: they judge the seeds' code,
#: not the user's model. ``method`` is the variant they run, not a negative control.
SEEDS_CHECKS: tuple[Check, ...] = variants(
    "init.seeds_fn",
    {
        "fsdp1": "the seeds' materialization_fn as FSDP1's param_init_fn (never calls to_empty)",
        "fsdp2": "the seeds' materialization_fn after fully_shard, without to_empty",
    },
    rank_weights,
    verdict_seeds_fn,
    specs=(DEFAULT_SPEC,),
    method="seeds",
) + variants(
    "init.seeds_fn_to_empty",
    "the seeds' function with to_empty added: 1-D weights and buffers stay uninitialized",
    rank_weights,
    verdict_seeds_fn_to_empty,
    versions=("fsdp1",),
    specs=(DEFAULT_SPEC,),
    method="seeds_to_empty",
)
