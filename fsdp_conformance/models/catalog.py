"""The reference models by name (``--reference``, ``ModelSpec(reference=...)``): how each is
built, its block classes and its input kind."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
import torch.nn as nn

from fsdp_conformance.models.llama import LlamaBlock, LlamaModel
from fsdp_conformance.models.reference_models import (
    BranchModel,
    DecoderLayer,
    EmbeddingClassifier,
    EncoderDecoder,
    EncoderLayer,
    LlamaConfig,
    LoRADecoderLayer,
    LoRAModel,
    MassiveModel,
    ModelConfig,
    OddModel,
    TiedLM,
)


@dataclasses.dataclass(frozen=True)
class ReferenceModel:
    """A named reference model: how to build it, its block classes and its input kind."""

    name: str
    build: Callable[..., nn.Module]
    block_classes: tuple[type[nn.Module], ...]
    #: "features" (float batch x seq x dim) or "tokens" (int batch x seq).
    input_kind: str
    description: str


REFERENCE_MODELS: dict[str, ReferenceModel] = {
    m.name: m
    for m in (
        ReferenceModel(
            "massive",
            MassiveModel,
            (DecoderLayer,),
            "features",
            "the seeds' MassiveModel (embed, DecoderLayers, large head)",
        ),
        ReferenceModel(
            "embedding_classifier",
            EmbeddingClassifier,
            (DecoderLayer,),
            "tokens",
            "large embedding table, small classification head",
        ),
        ReferenceModel(
            "encoder_decoder",
            EncoderDecoder,
            (EncoderLayer, DecoderLayer),
            "features",
            "asymmetric encoder-decoder",
        ),
        ReferenceModel(
            "tied", TiedLM, (DecoderLayer,), "tokens", "embedding and head share one weight"
        ),
        ReferenceModel(
            "lora",
            LoRAModel,
            (LoRADecoderLayer,),
            "features",
            "frozen base with trainable adapters (mixed requires_grad)",
        ),
        ReferenceModel(
            "odd",
            OddModel,
            (DecoderLayer,),
            "features",
            "odd sizes (uneven shards, a one-element gain) and persistent buffers",
        ),
        ReferenceModel(
            "branch",
            BranchModel,
            (DecoderLayer,),
            "features",
            "branches the input chooses: parameters unused in some steps, on some ranks",
        ),
        ReferenceModel(
            "llama",
            LlamaModel,
            (LlamaBlock,),
            "tokens",
            "Llama-style blocks with norms, GQA and a rotary non-persistent buffer",
        ),
    )
}


def build_reference(
    name: str,
    config: ModelConfig | LlamaConfig | None = None,
    device: str | torch.device | None = None,
) -> nn.Module:
    """Build a reference model by name, optionally on a device (``"meta"`` for no storage)."""
    try:
        ref = REFERENCE_MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown reference model {name!r}; choose one of {', '.join(REFERENCE_MODELS)}"
        ) from None
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return ref.build(config) if config is not None else ref.build()
