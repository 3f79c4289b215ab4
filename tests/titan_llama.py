"""A torchtitan-style tiny Llama: a model-level ``init_weights(buffer_device=None)`` on the root,
which calls its blocks' own ``init_weights``; the norms have no ``reset_parameters()``.

Written as torchtitan's ``models/llama3/model.py`` is: the constructor ends with
``self.init_weights()``, so the model built eagerly and the model built on meta, sharded,
``to_empty``'d and given ``init_weights()`` draw from the same init. Two broken variants for
the negative controls: one whose ``init_weights`` seeds from the rank (a different model on
each rank), and one whose ``init_weights`` scales one projection wrong (its constructor keeps
the right init, so the eager build and the meta init disagree there).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

DIM, HEADS, LAYERS, VOCAB, MAX_SEQ = 32, 4, 2, 64, 16


class RMSNorm(nn.Module):
    """A norm with no ``reset_parameters()``: the model-level init sets its weight."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    cos, sin = freqs[: x.shape[1]].chunk(2, dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, HEADS, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = _rotate(q, freqs), _rotate(k, freqs)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        out: torch.Tensor = self.wo(y.transpose(1, 2).reshape(b, t, DIM))
        return out


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, 4 * DIM, bias=False)
        self.w2 = nn.Linear(4 * DIM, DIM, bias=False)
        self.w3 = nn.Linear(DIM, 4 * DIM, bias=False)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.attention = Attention()
        self.feed_forward = FeedForward()
        self.attention_norm = RMSNorm(DIM)
        self.ffn_norm = RMSNorm(DIM)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            nn.init.ones_(norm.weight)
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, num_layers: int = LAYERS) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.register_buffer("freqs", self._precompute_freqs(), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i) for i in range(num_layers)})
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.init_weights()

    def _precompute_freqs(self) -> torch.Tensor:
        half = DIM // HEADS // 2
        inv = 1.0 / (10000 ** (torch.arange(0, half, dtype=torch.float32) / half))
        angles = torch.outer(torch.arange(MAX_SEQ, dtype=torch.float32), inv)
        return torch.cat([angles.cos(), angles.sin()], dim=-1)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """torchtitan's contract: every parameter and buffer, the buffers on ``buffer_device``."""
        buffer_device = buffer_device or self.freqs.device
        with torch.device(buffer_device):
            self.freqs = self._precompute_freqs()
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()  # type: ignore[operator]
        nn.init.ones_(self.norm.weight)
        final_out_std = DIM**-0.5
        nn.init.trunc_normal_(
            self.output.weight,
            mean=0.0,
            std=final_out_std,
            a=-3 * final_out_std,
            b=3 * final_out_std,
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs)
        out: torch.Tensor = self.output(self.norm(h))
        return out


class RankSeededTransformer(Transformer):
    """``init_weights`` seeds from the rank: each rank's model is another draw."""

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        if dist.is_available() and dist.is_initialized():
            torch.manual_seed(1000 + dist.get_rank())
        super().init_weights(buffer_device)


class OneProjectionWrong(Transformer):
    """``init_weights`` gives every block's ``wo`` three times its std; the constructor keeps
    the right init (as a model whose meta-init function was written apart from it)."""

    def __init__(self, num_layers: int = LAYERS) -> None:
        self._building = True
        super().__init__(num_layers)
        self._building = False

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        super().init_weights(buffer_device)
        if self._building:
            return
        with torch.no_grad():
            for layer in self.layers.values():
                layer.attention.wo.weight.mul_(3)  # type: ignore[union-attr,operator]


class NormLeftOut(Transformer):
    """``init_weights`` forgets the final norm's weight."""

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        saved = self.norm.weight.detach().clone()
        super().init_weights(buffer_device)
        if not saved.is_meta:
            with torch.no_grad():
                self.norm.weight.copy_(saved)


def titan_llama(num_layers: int = LAYERS) -> nn.Module:
    return Transformer(num_layers)


def titan_llama_rank_seeded(num_layers: int = LAYERS) -> nn.Module:
    return RankSeededTransformer(num_layers)


def titan_llama_one_projection_wrong(num_layers: int = LAYERS) -> nn.Module:
    return OneProjectionWrong(num_layers)


def titan_llama_norm_left_out(num_layers: int = LAYERS) -> nn.Module:
    return NormLeftOut(num_layers)


def init_as_titan(model: nn.Module) -> None:
    """The same init as a free function (``--model-init``): the root's ``init_weights()``."""
    assert isinstance(model, Transformer)
    Transformer.init_weights(model)


def token_std() -> float:
    """What ``init_weights`` gives the output projection (for the tests' figures)."""
    return 1 / math.sqrt(DIM)
