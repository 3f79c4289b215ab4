"""The configurations users stack on FSDP, FSDP1 and FSDP2, each trained against the
single-process reference on the same global batch
(:class:`~fsdp_conformance.fsdp.reference_step.SliceReference`), with what torch did observed.

One module per check family:

* :mod:`~fsdp_conformance.claims.stack.reshard`: ``stack.reshard.after_forward`` (FSDP2
  ``reshard_after_forward`` True, False and integers on the root and the blocks) and
  ``stack.reshard.strategies`` (FSDP1 ``sharding_strategy`` FULL_SHARD, SHARD_GRAD_OP,
  NO_SHARD): parity, the units kept unsharded after forward, the all-gathers in backward, the
  gradient reductions.
* :mod:`~fsdp_conformance.claims.stack.meshes`: ``stack.meshes.hsdp`` / ``.replicated``, HSDP
  on a 2-D device mesh (replicate x shard): parity, the replicas bitwise equal, the gradients
  reduce-scattered on the shard group and all-reduced across the replicas.
* :mod:`~fsdp_conformance.claims.stack.loss_scaling`: ``stack.loss_scaling``, fp16 mixed
  precision with loss scaling (FSDP1 ``ShardedGradScaler``, FSDP2 ``torch.amp.GradScaler``): a
  step with an inf gradient on one rank skipped on every rank, the scale identical everywhere,
  finite steps equal to a single-process scaler's.
* :mod:`~fsdp_conformance.claims.stack.compile`: ``stack.compile``, ``torch.compile`` as users
  stack it (FSDP2 blocks compiled after ``fully_shard``, the root eager or compiled too; FSDP1
  the wrapped model compiled): parity with the reference, the collectives per unit the same as
  eager's, Dynamo's graphs and graph breaks counted; ``stack.compile.inductor`` the same with
  inductor, in the GPU lane (its cold compile on CPU costs about 23 s a rank call).
* :mod:`~fsdp_conformance.claims.stack.checkpointing`: ``stack.checkpointing`` (and FSDP1's
  ``.reentrant_outside_unit``), activation checkpointing through ``apply_activation_checkpointing``
  / ``checkpoint_wrapper`` before and after wrapping, reentrant and not: parity, the blocks
  recomputed once per backward, one all-gather per unit per phase, state-dict and optimizer FQNs
  those of the plain model.
"""

from __future__ import annotations

from fsdp_conformance.claims.check import Check, variants
from fsdp_conformance.claims.stack.checkpointing import rank_checkpointing, verdict_checkpointing
from fsdp_conformance.claims.stack.compile import rank_compile, verdict_compile
from fsdp_conformance.claims.stack.loss_scaling import rank_loss_scaling, verdict_loss_scaling
from fsdp_conformance.claims.stack.meshes import rank_meshes, verdict_meshes
from fsdp_conformance.claims.stack.reshard import (
    rank_reshard_after_forward,
    rank_reshard_strategies,
    verdict_reshard_after_forward,
    verdict_reshard_strategies,
)
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.reference_models import LlamaConfig

_REF = ModelSpec(reference="odd")
#: stack.compile's work in its model's eager steps (``Check.cost``): Dynamo traces every
#: operator of the model, and AOT autograd its backward, for each compiled region, then the
#: steps run eager and compiled. Measured (docs/harness.md, "Timeouts that scale with the
#: work"): a mixture-of-experts model's compile took 216 s where its step took 0.02 to 0.13 s.
COMPILE_COST_STEPS = 15000.0

#: A small Llama (RMSNorm, grouped-query attention, rotary buffer; odd vocabulary and MLP
#: widths: uneven shards). Not the odd model for loss scaling: its batch norm under FSDP2's fp16
#: policy raises on CPU (docs/stack/loss_scaling.md).
_LLAMA = ModelSpec(
    reference="llama",
    config=LlamaConfig(
        num_layers=2, dim=12, num_heads=2, num_kv_heads=1, hidden_dim=27, vocab_size=61
    ),
)

#: Every stack check with its reference parameters (the CLI swaps in the user's spec).
CHECKS: tuple[Check, ...] = (
    variants(
        "stack.reshard.after_forward",
        "fully_shard(reshard_after_forward=True / False / an integer) on the root and on the blocks: "
        "each unit sharded after forward over the group the option documents, all-gathered in "
        "backward only where resharded, updates equal the reference",
        rank_reshard_after_forward,
        verdict_reshard_after_forward,
        versions=("fsdp2",),
        specs=(_REF,),
    )
    + variants(
        "stack.reshard.strategies",
        "sharding_strategy FULL_SHARD / SHARD_GRAD_OP / NO_SHARD: the units kept unsharded after "
        "forward, no all-gather in backward under SHARD_GRAD_OP, all-reduce instead of "
        "reduce-scatter under NO_SHARD, updates equal the reference",
        rank_reshard_strategies,
        verdict_reshard_strategies,
        versions=("fsdp1",),
        specs=(_REF,),
    )
    + variants(
        "stack.meshes.hsdp",
        {
            "fsdp1": "HYBRID_SHARD and _HYBRID_SHARD_ZERO2 with a 2-D device_mesh (replicate x shard; "
            "(1, world) too): updates equal the reference, replicas bitwise equal, gradients "
            "reduce-scattered in the shard group and all-reduced across replicas",
            "fsdp2": "fully_shard(mesh=...) on a 2-D mesh (replicate x shard; (1, world) too): updates "
            "equal the reference, replicas bitwise equal, gradients reduce-scattered in the shard "
            "group and all-reduced across replicas",
        },
        rank_meshes,
        verdict_meshes,
        specs=(_REF,),
        layout="hsdp",
    )
    + variants(
        "stack.meshes.replicated",
        "HSDP on a (world, 1) mesh, every rank its own replica: updates equal the reference, the "
        "replicas bitwise equal, every gradient all-reduced across the replicas",
        rank_meshes,
        verdict_meshes,
        specs=(_REF,),
        layout="replicated",
    )
    + variants(
        "stack.loss_scaling",
        {
            "fsdp1": "fp16 MixedPrecision with ShardedGradScaler: a step with an inf gradient on one "
            "rank skipped on every rank, the scale identical everywhere and as scheduled, finite "
            "updates equal a single-process GradScaler's (fp16 tolerance)",
            "fsdp2": "fp16 MixedPrecisionPolicy with torch.amp.GradScaler: a step with an inf gradient "
            "on one rank skipped on every rank, the scale identical everywhere and as scheduled, "
            "finite updates equal a single-process GradScaler's (fp16 tolerance)",
        },
        rank_loss_scaling,
        verdict_loss_scaling,
        specs=(_LLAMA,),
    )
    + variants(
        "stack.compile",
        {
            "fsdp1": "torch.compile(fsdp_model, backend='aot_eager'), use_orig_params=True and not "
            "passed: losses and updates equal the reference, the same collectives per unit as "
            "eager, graphs compiled; graph breaks and graphs counted",
            "fsdp2": "block.compile(backend='aot_eager') on every block after fully_shard, the root "
            "eager and compiled: losses and updates equal the reference, the same collectives per "
            "unit as eager, graphs compiled; graph breaks and graphs counted",
        },
        rank_compile,
        verdict_compile,
        specs=(_REF,),
        cost=COMPILE_COST_STEPS,
    )
    + variants(
        "stack.compile.inductor",
        "stack.compile with backend='inductor' (Triton kernels on GPU): parity with the "
        "reference, the same collectives per unit as eager, graphs compiled",
        rank_compile,
        verdict_compile,
        specs=(_REF,),
        lanes=("gpu",),
        backend="inductor",
        cost=COMPILE_COST_STEPS,
    )
    + variants(
        "stack.checkpointing",
        {
            "fsdp1": "apply_activation_checkpointing(checkpoint_wrapper, NO_REENTRANT / REENTRANT) "
            "after FullyShardedDataParallel, and NO_REENTRANT before it: updates equal the "
            "reference, every block recomputed once per backward, one all-gather per unit per "
            "phase, full / sharded state-dict keys and optimizer FQNs those of the plain model",
            "fsdp2": "checkpoint_wrapper (NO_REENTRANT / REENTRANT) on each block before "
            "fully_shard: updates equal the reference, every block recomputed once per backward, "
            "one all-gather per unit per phase, get_model_state_dict keys and "
            "get_optimizer_state_dict FQNs those of the plain model",
        },
        rank_checkpointing,
        verdict_checkpointing,
        specs=(_REF,),
        part="main",
    )
    + variants(
        "stack.checkpointing.reentrant_outside_unit",
        "apply_activation_checkpointing(REENTRANT) before FullyShardedDataParallel (the "
        "checkpointed region holds the unit's hooks): updates equal the reference, one "
        "all-gather per unit per phase, state-dict keys those of the plain model",
        rank_checkpointing,
        verdict_checkpointing,
        versions=("fsdp1",),
        specs=(_REF,),
        part="reentrant_outside_unit",
    )
)

__all__ = ["CHECKS"]
