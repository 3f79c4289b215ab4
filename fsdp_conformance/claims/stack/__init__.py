"""The configurations users stack on FSDP, FSDP1 and FSDP2, each against a single-process
reference on the same global batch (:class:`~fsdp_conformance.reference_step.SliceReference`),
with the collectives observed.

One module per check family:

* :mod:`~fsdp_conformance.claims.stack.meshes`: ``stack.meshes.hsdp`` / ``.replicated``, HSDP
  on a 2-D device mesh (replicate x shard): parity, the replicas bitwise equal, the gradients
  reduce-scattered on the shard group and all-reduced across the replicas.
"""

from __future__ import annotations

from fsdp_conformance.claims.check import Check, variants
from fsdp_conformance.claims.stack.meshes import rank_meshes, verdict_meshes
from fsdp_conformance.models import ModelSpec

_REF = ModelSpec(reference="odd")

#: Every stack check with its reference parameters (the CLI swaps in the user's spec).
CHECKS: tuple[Check, ...] = variants(
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
) + variants(
    "stack.meshes.replicated",
    "HSDP on a (world, 1) mesh, every rank its own replica: updates equal the reference, the "
    "replicas bitwise equal, every gradient all-reduced across the replicas",
    rank_meshes,
    verdict_meshes,
    specs=(_REF,),
    layout="replicated",
)

__all__ = ["CHECKS"]
