"""Hand-written models of what real models contain, for the verdict tests
(tests/test_wrapping_verdicts.py, tests/test_state.py): an attention key bias whose true gradient
is zero beside a small but real update, and several ties per module (a weight and a bias)."""

from __future__ import annotations

import torch
from torch import nn


class KeyBiasBlock(nn.Module):
    """Pre-norm softmax attention with biased projections: the key bias adds, per query, one
    constant to every score, which softmax ignores, so its true gradient is zero (ViT, BERT)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.query, self.key, self.value = (nn.Linear(dim, dim) for _ in range(3))
        self.out = nn.Linear(dim, dim)
        nn.init.zeros_(self.key.bias)  # as BERT and ViT initialize it: its update is then noise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        scores = self.query(h) @ self.key(h).transpose(-1, -2) / h.shape[-1] ** 0.5
        return x + self.out(scores.softmax(-1) @ self.value(h))


class KeyBiasModel(nn.Module):
    """Token embedding, :class:`KeyBiasBlock` blocks, a head; and ``offset``, one element added
    to the logits at 1e-3: the model's smallest tensor, its update small (about 1e-3 of the
    largest) but far above rounding."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(KeyBiasBlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)
        self.offset = nn.Parameter(torch.ones(1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x) + 1e-3 * self.offset


def key_bias_model() -> nn.Module:
    return KeyBiasModel()


def _gemma2(layers: int, layer_types: list[str] | None = None) -> nn.Module:
    import transformers

    config = transformers.Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        layer_types=layer_types,
    )
    return transformers.Gemma2ForCausalLM(config)


def gemma2_two_layers() -> nn.Module:
    """Gemma-2 at 2 layers: ``config.layer_types`` has one entry per layer (sliding, full)."""
    return _gemma2(2)


def gemma2_unpatterned() -> nn.Module:
    """Gemma-2 at 3 layers with per-layer types that no longer depth continues (full, full,
    sliding): the suite's rebuild at 4 layers cannot guess the fourth."""
    return _gemma2(3, ["full_attention", "full_attention", "sliding_attention"])


class Block(nn.Module):
    """A residual MLP block."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class PredictionHead(nn.Module):
    """BERT's ``cls.predictions``: a transform, then a decoder whose weight is the embedding's
    and whose bias is this module's own ``bias`` (``decoder.bias is bias``)."""

    def __init__(self, embed: nn.Embedding, tied: bool = True) -> None:
        super().__init__()
        vocab, dim = embed.weight.shape
        self.transform = nn.Linear(dim, dim)
        self.bias = nn.Parameter(torch.zeros(vocab))
        self.decoder = nn.Linear(dim, vocab)
        if tied:
            self.decoder.weight = embed.weight
            self.decoder.bias = self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(x))


class TwoTiesModel(nn.Module):
    """Two ties in one module, a weight and a bias (BERT's masked-LM head): ``head.decoder``
    holds the embedding's weight and ``head``'s bias. ``embed.weight``, the first parameter by
    name, is tied; ``embed_norm`` consumes the embedding's output outside the blocks (Bloom's
    ``word_embeddings_layernorm``). ``tied=False``: no tie, the consumer alone."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, tied: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.embed_norm = nn.LayerNorm(dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = PredictionHead(self.embed, tied)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_norm(self.embed(ids))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def two_ties_model() -> nn.Module:
    return TwoTiesModel()


def embed_norm_model() -> nn.Module:
    """:class:`TwoTiesModel` without its ties: a LayerNorm consumes the embedding's output."""
    return TwoTiesModel(tied=False)


class ContextBlock(nn.Module):
    """A block that reads, besides its input, a ``context`` computed once outside the blocks
    and passed to every block (T5: the encoder's output into each decoder block's
    cross-attention, block 0's position bias into every block), through two projections (a key
    and a value): the context's gradient is a sum over uses, two in each block."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.query, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim, bias=False)  # a key bias's true gradient is zero
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        scores = self.query(x) @ self.key(context).transpose(-1, -2) / x.shape[-1] ** 0.5
        x = x + scores.softmax(-1) @ self.value(context)
        return x + self.down(torch.relu(self.up(x)))


class ContextModel(nn.Module):
    """Token embedding, a context projection in the root, :class:`ContextBlock` blocks each
    taking the context as a keyword argument, a head."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.context = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(ContextBlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        context = self.context(x)
        for block in self.blocks:
            x = block(x, context=context)
        return self.head(x)


def context_model() -> nn.Module:
    return ContextModel()
