"""The configurations users stack on FSDP, FSDP1 and FSDP2, each trained against the
single-process reference (:class:`~fsdp_conformance.reference_step.SliceReference`), with what
torch did observed.

* :mod:`~fsdp_conformance.claims.stack.reshard`: ``stack.reshard.after_forward`` (FSDP2
  ``reshard_after_forward`` True, False and integers on the root and the blocks) and
  ``stack.reshard.strategies`` (FSDP1 ``sharding_strategy`` FULL_SHARD, SHARD_GRAD_OP,
  NO_SHARD): parity, the units kept unsharded after forward, the all-gathers in backward, the
  gradient reductions.
"""

from __future__ import annotations

from fsdp_conformance.claims.check import Check, variants
from fsdp_conformance.claims.stack.reshard import (
    rank_reshard_after_forward,
    rank_reshard_strategies,
    verdict_reshard_after_forward,
    verdict_reshard_strategies,
)
from fsdp_conformance.models import ModelSpec

_REF = ModelSpec(reference="odd")

#: Every stack check with its reference parameters.
CHECKS: tuple[Check, ...] = variants(
    "stack.reshard.after_forward",
    "fully_shard(reshard_after_forward=True / False / an integer) on the root and on the blocks: "
    "each unit sharded after forward over the group the option documents, all-gathered in "
    "backward only where resharded, updates equal the reference",
    rank_reshard_after_forward,
    verdict_reshard_after_forward,
    versions=("fsdp2",),
    specs=(_REF,),
) + variants(
    "stack.reshard.strategies",
    "sharding_strategy FULL_SHARD / SHARD_GRAD_OP / NO_SHARD: the units kept unsharded after "
    "forward, no all-gather in backward under SHARD_GRAD_OP, all-reduce instead of "
    "reduce-scatter under NO_SHARD, updates equal the reference",
    rank_reshard_strategies,
    verdict_reshard_strategies,
    versions=("fsdp1",),
    specs=(_REF,),
)

__all__ = ["CHECKS"]
