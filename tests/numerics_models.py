"""Hand-written models with one numerical trait each, for tests/test_numerics.py (the ranks
import them by path): buffers of every tensor kind, a top-k mixture of experts, a small CNN with
batch norm, a learned position embedding fed float positions, and a module that computes in
fp32 whatever the mixed precision."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, DIM, SEQ = 64, 32, 16


# --------------------------------------------------------------------------------------------
# Buffers of every kind
# --------------------------------------------------------------------------------------------


class KindsBlock(nn.Module):
    """Causal attention whose buffers are of every kind a model may hold: a bool causal mask, an
    integer count of train-mode forwards, a complex rotation whose real part scales the values,
    an fp16 scale (not persistent) and a bf16 scale."""

    def __init__(self, dim: int = DIM, seq: int = SEQ) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.register_buffer("mask", torch.empty(seq, seq, dtype=torch.bool))
        self.register_buffer("calls", torch.empty((), dtype=torch.long))
        self.register_buffer("phase", torch.empty(dim, dtype=torch.complex64))
        self.register_buffer("half_scale", torch.empty(dim, dtype=torch.float16), persistent=False)
        self.register_buffer("bf16_scale", torch.empty(dim, dtype=torch.bfloat16))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        seq, dim = self.mask.shape[0], self.phase.shape[0]
        with torch.no_grad():
            self.mask.copy_(torch.tril(torch.ones(seq, seq, dtype=torch.bool)))
            self.calls.zero_()
            self.phase.copy_(torch.polar(torch.ones(dim), torch.linspace(0.0, 1.0, dim)))
            self.half_scale.fill_(1.0)
            self.bf16_scale.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        q, k, v = self.qkv(self.norm(x)).chunk(3, -1)
        scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(
            ~self.mask[:t, :t], float("-inf")
        )
        y = scores.softmax(-1) @ v
        scale = self.phase.real * self.half_scale.float() * self.bf16_scale.float()
        if self.training:
            self.calls += 1
        return x + self.out(y * scale.to(y.dtype))


class TokenStack(nn.Module):
    """Token embedding, ``num_layers`` blocks of the subclass's ``block`` class, a head."""

    block: type[nn.Module]

    def __init__(self, num_layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(self.block() for _ in range(num_layers))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        out: torch.Tensor = self.head(x)
        return out


class KindsModel(TokenStack):
    block = KindsBlock


def buffer_kinds() -> nn.Module:
    return KindsModel()


# --------------------------------------------------------------------------------------------
# A top-k mixture of experts
# --------------------------------------------------------------------------------------------


class MoEBlock(nn.Module):
    """Pre-norm top-2 of 4 experts per token, softmax over the chosen scores (Mixtral's
    routing): a token whose two best scores are close may be routed otherwise in fp16."""

    def __init__(self, dim: int = DIM, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
            for _ in range(experts)
        )
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        weights, chosen = self.router(h).topk(self.top_k, dim=-1)
        weights = weights.softmax(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            gate = (weights * (chosen == e)).sum(-1, keepdim=True)
            out = out + gate * expert(h)
        return x + out


class MoEModel(TokenStack):
    block = MoEBlock


def top_k_moe() -> nn.Module:
    return MoEModel()


# --------------------------------------------------------------------------------------------
# A small CNN with batch norm
# --------------------------------------------------------------------------------------------


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.bn(self.conv(x)))


class SmallCNN(nn.Module):
    def __init__(self, channels: int = 8, num_layers: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.layers = nn.ModuleList(ConvBlock(channels) for _ in range(num_layers))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean((2, 3)))


def small_cnn() -> nn.Module:
    return SmallCNN()


def images(model: nn.Module, batch_size: int, device: Any) -> torch.Tensor:
    """A batch of 3 x 8 x 8 images, the same for every call of the same size."""
    g = torch.Generator().manual_seed(batch_size)
    return torch.randn(batch_size, 3, 8, 8, generator=g).to(device)


# --------------------------------------------------------------------------------------------
# A learned position embedding fed float positions, and a module computing in fp32
# --------------------------------------------------------------------------------------------


class PositionsModel(nn.Module):
    """Token and learned position embeddings; the positions are computed from an all-ones
    attention mask as floats (a cumulative sum), as some models compute them, and the
    embedding gets them cast back to indices inside its own forward."""

    def __init__(self, num_layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.positions = FloatIndexEmbedding(SEQ, DIM)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM)) for _ in range(num_layers)
        )
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(ids.shape, dtype=torch.float32, device=ids.device)
        x = self.embed(ids) + self.positions(mask.cumsum(-1) - 1)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


class FloatIndexEmbedding(nn.Embedding):
    """An embedding whose input may arrive as float positions: indices whatever their dtype."""

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return super().forward(positions.long())


def float_positions() -> nn.Module:
    return PositionsModel()


class Fp32Linear(nn.Linear):
    """A projection that computes in fp32 whatever dtype its weight and input arrive in (an
    upcast left in by mistake): under bf16 mixed precision its output is fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias)


class Fp32HeadModel(PositionsModel):
    def __init__(self, num_layers: int = 2) -> None:
        super().__init__(num_layers)
        self.head = Fp32Linear(DIM, VOCAB)


def fp32_head() -> nn.Module:
    return Fp32HeadModel()
