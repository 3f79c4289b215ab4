"""The training loop users write, FSDP1 and FSDP2, each against a single-process reference on
the same global batch (:class:`~fsdp_conformance.reference_step.SliceReference`), with the
collectives observed.

One module per check family; what they share is :mod:`~fsdp_conformance.claims.loop.training`:

* :mod:`~fsdp_conformance.claims.loop.accumulation`: ``loop.accumulation.no_sync`` /
  ``.synced``, gradient accumulation with synchronisation off for all but the last micro-batch,
  and on for every one into existing gradients.
"""

from __future__ import annotations

from fsdp_conformance.claims.check import Check, variants
from fsdp_conformance.claims.loop.accumulation import rank_accumulation, verdict_accumulation
from fsdp_conformance.models import ModelSpec

_REF = ModelSpec(reference="odd")

#: Every loop check with its reference parameters (the CLI swaps in the user's spec).
CHECKS: tuple[Check, ...] = variants(
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
) + variants(
    "loop.accumulation.synced",
    "accumulation into existing gradients with synchronisation on: updates equal the "
    "reference, one reduce-scatter per unit per micro-batch",
    rank_accumulation,
    verdict_accumulation,
    specs=(_REF,),
    mode="synced",
)

__all__ = ["CHECKS"]
