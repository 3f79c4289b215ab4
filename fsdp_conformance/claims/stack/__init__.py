"""The configurations users stack on FSDP, each against a single-process reference, FSDP1 and
FSDP2.

One module per check family:

* :mod:`~fsdp_conformance.claims.stack.loss_scaling`: ``stack.loss_scaling``, fp16 mixed
  precision with loss scaling (FSDP1 ``ShardedGradScaler``, FSDP2 ``torch.amp.GradScaler``): a
  step with an inf gradient on one rank skipped on every rank, the scale identical everywhere,
  finite steps equal to a single-process scaler's.
"""

from __future__ import annotations

from fsdp_conformance.claims.check import Check, variants
from fsdp_conformance.claims.stack.loss_scaling import rank_loss_scaling, verdict_loss_scaling
from fsdp_conformance.models import ModelSpec
from fsdp_conformance.reference_models import LlamaConfig

#: A small Llama (RMSNorm, grouped-query attention, rotary buffer; odd vocabulary and MLP
#: widths: uneven shards). Not the odd model: its batch norm under FSDP2's fp16 policy raises
#: on CPU (docs/stack/loss_scaling.md).
_LLAMA = ModelSpec(
    reference="llama",
    config=LlamaConfig(
        num_layers=2, dim=12, num_heads=2, num_kv_heads=1, hidden_dim=27, vocab_size=61
    ),
)

#: Every stack check with its reference parameters (the CLI swaps in the user's spec).
CHECKS: tuple[Check, ...] = variants(
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

__all__ = ["CHECKS"]
