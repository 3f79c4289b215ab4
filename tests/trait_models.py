"""Small hand-written models, each with one structural trait real models have, for the tests of
how the suite matches collectives to units, orders prefetches, applies checkpointing and shards
FSDP1 units:

* ``frozen_in_block``: a frozen parameter inside every block unit (a frozen norm, as a LoRA or a
  partly frozen fine-tune leaves it), beside trainable ones;
* ``reversed_blocks``: blocks registered in one order and run in the reverse one (a
  ``ModuleDict`` whose keys do not sort by use), so module order is not execution order;
* ``container_in_size_unit``: a stage the size rule wraps (a container over the minimum size)
  that holds the block units;
* ``stem_blocks``: a block class fed the model's input (features that need no gradient), as
  ViT's embeddings are a block class fed the pixels;
* ``data_dependent``: blocks that read a value of their input (``Tensor.item()``), so the
  forward cannot run on meta tensors (``token_model`` is its twin that can);
* the wav2vec2 family's traits: ``legacy_vector`` (a vector the legacy ``torch.Tensor(n)``
  constructor leaves real under meta; ``legacy_table``, a layer's worth), ``config_randomness``
  (layer drop and a NumPy time mask switched by ``self.config``), ``NumpyMasked`` (a NumPy mask
  with no switch), ``weight_normed`` (a weight-norm parametrization in every block).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB = 64
DIM = 32


class Block(nn.Module):
    """Pre-norm residual MLP block."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))
        return out


class TokenModel(nn.Module):
    """Embedding, blocks in ``self.blocks`` run in :meth:`order`, a norm and a head."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks: nn.Module = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def order(self) -> list[nn.Module]:
        return list(self.blocks.children())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.order():
            x = block(x)
        out: torch.Tensor = self.head(self.norm(x))
        return out


class FrozenInBlock(TokenModel):
    """Every block's norm frozen (``requires_grad=False`` from construction): each block unit
    holds frozen and trainable parameters."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__(layers)
        for block in self.order():
            assert isinstance(block, Block)
            block.norm.requires_grad_(False)


class ReversedBlocks(TokenModel):
    """Blocks in a ``ModuleDict`` registered ``b0, b1, ...`` and run last to first."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__(layers)
        self.blocks = nn.ModuleDict({f"b{i}": Block() for i in range(layers)})

    def order(self) -> list[nn.Module]:
        return list(self.blocks.children())[::-1]


class Stage(nn.Module):
    """A container of blocks with a projection of its own: large enough for the size rule."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for block in self.layers:
            x = block(x)
        return x


class ContainerInSizeUnit(TokenModel):
    """The blocks inside a :class:`Stage`, which the size rule wraps above the block units."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__(layers)
        self.blocks = Stage(layers)

    def order(self) -> list[nn.Module]:
        return [self.blocks]


class Stem(nn.Module):
    """The first block class: a projection of the model's input features."""

    def __init__(self, features: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(features, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(x)
        return out


class StemBlocks(nn.Module):
    """A :class:`Stem` on float features, then blocks and a head."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.stem = Stem()
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(DIM, 4)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.stem(features)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def features(model: nn.Module, batch_size: int, device: Any) -> torch.Tensor:
    """:class:`StemBlocks`' input: random features, the same on every rank."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 6, 8, generator=generator).to(device)


def stem_blocks() -> nn.Module:
    return StemBlocks()


def frozen_in_block() -> nn.Module:
    return FrozenInBlock()


def reversed_blocks() -> nn.Module:
    return ReversedBlocks()


def container_in_size_unit() -> nn.Module:
    return ContainerInSizeUnit()


class ScaledBlock(Block):
    """A block that reads a value of its input in Python (``Tensor.item()``), as a model's
    routing, masking or normalising step can: its forward cannot run on meta tensors."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = float(x.abs().amax().item()) or 1.0
        return super().forward(x) / scale


class DataDependent(TokenModel):
    def __init__(self) -> None:
        super().__init__(layers=2)
        self.blocks = nn.ModuleList([ScaledBlock() for _ in range(2)])


def data_dependent() -> nn.Module:
    return DataDependent()


def token_model() -> nn.Module:
    """The twin of ``data_dependent`` whose forward runs on meta (no ``.item()``)."""
    return TokenModel(layers=2)


# --------------------------------------------------------------------------------------------
# Traits of the wav2vec2 family (HuBERT, data2vec-audio, SEW), each in a small model
# --------------------------------------------------------------------------------------------


class LegacyVector(TokenModel):
    """A learned vector made with the legacy ``torch.Tensor(n)`` constructor, which ignores
    ``torch.device('meta')`` (transformers' ``masked_spec_embed``), initialized by the model's
    ``reset_parameters``; ``size`` floats (``DIM``: negligible beside a layer)."""

    def __init__(self, layers: int = 3, size: int = DIM) -> None:
        super().__init__(layers)
        self.spec_embed = nn.Parameter(torch.Tensor(size).uniform_())

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.spec_embed)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) + self.spec_embed[:VOCAB].sum()


def legacy_vector() -> nn.Module:
    return LegacyVector()


def legacy_table() -> nn.Module:
    """:class:`LegacyVector` with a table's worth of floats left real (a layer's size)."""
    return LegacyVector(size=VOCAB * DIM)


class ConfigRandomness(TokenModel):
    """Randomness switched by its config, read at forward time as transformers' modules do:
    ``self.config.layerdrop`` (skips a block, from torch's generator) and
    ``self.config.mask_time_prob`` (SpecAugment: a time mask from NumPy's generator)."""

    class Config:
        def __init__(self) -> None:
            self.layerdrop = 0.5
            self.mask_time_prob = 0.5
            self.hidden_size = DIM

    def __init__(self, layers: int = 3) -> None:
        super().__init__(layers)
        self.config = self.Config()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        import numpy

        x = self.embed(input_ids)
        if self.training and self.config.mask_time_prob > 0:
            keep = numpy.random.random(x.shape[:2]) >= self.config.mask_time_prob
            x = x * torch.as_tensor(keep, dtype=x.dtype).unsqueeze(-1)
        for block in self.order():
            if self.training and float(torch.rand([])) < self.config.layerdrop:
                continue
            x = block(x)
        out: torch.Tensor = self.head(self.norm(x))
        return out


def config_randomness() -> nn.Module:
    return ConfigRandomness()


class NumpyMasked(TokenModel):
    """A time mask drawn from NumPy's global generator in every training forward, with no
    switch (what ``torch.manual_seed`` alone does not make repeatable)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        import numpy

        x = self.embed(input_ids)
        keep = numpy.random.random(x.shape[:2]) >= 0.5
        x = x * torch.as_tensor(keep, dtype=x.dtype).unsqueeze(-1)
        for block in self.order():
            x = block(x)
        out: torch.Tensor = self.head(self.norm(x))
        return out


class NormedBlock(Block):
    """:class:`Block` whose first projection is weight-normed with torch's parametrization
    (wav2vec2's positional convolution): reading ``fc1.weight`` runs a module."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__(dim)
        nn.utils.parametrizations.weight_norm(self.fc1)


class WeightNormed(TokenModel):
    def __init__(self, layers: int = 3) -> None:
        super().__init__(layers)
        self.blocks = nn.ModuleList(NormedBlock() for _ in range(layers))


def weight_normed() -> nn.Module:
    return WeightNormed()


class ZeroToken(TokenModel):
    """A zero-initialized token prepended to the sequence (BEiT's ``cls_token``) before blocks
    whose LayerNorm has eps 1e-12: the token's row has zero variance, so the norm's inverse
    deviation is 1e6 and its gradient overflows fp16 when the norm computes in fp16."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__(layers)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, DIM))
        for block in self.order():
            assert isinstance(block, Block)
            block.norm = nn.LayerNorm(DIM, eps=1e-12)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x[:, 1:]], dim=1)
        for block in self.order():
            x = block(x)
        out: torch.Tensor = self.head(self.norm(x))
        return out


class CrossBlock(Block):
    """:class:`Block` with a cross-attention projection its forward uses only when given
    encoder states (Whisper's decoder layer run as a causal LM): without them, its parameters
    get no gradient."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__(dim)
        self.cross = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, encoder: torch.Tensor | None = None) -> torch.Tensor:
        x = super().forward(x)
        return x if encoder is None else x + self.cross(encoder)


class UnusedInBlock(TokenModel):
    def __init__(self, layers: int = 3) -> None:
        super().__init__(layers)
        self.blocks = nn.ModuleList(CrossBlock() for _ in range(layers))


def unused_in_block() -> nn.Module:
    return UnusedInBlock()
