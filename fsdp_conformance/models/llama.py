"""The Llama-style reference model: RMSNorm in three forms, rotary embeddings (a non-persistent
buffer), grouped-query attention; and the full-scale Llama 2 / Llama 3 presets the planner sizes.

Its shape is :class:`~fsdp_conformance.models.reference_models.LlamaConfig`; ``--reference
llama`` builds it at CPU size (:mod:`fsdp_conformance.models.catalog`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_conformance.models.reference_models import LlamaConfig, run_blocks


def _production(**shape: Any) -> LlamaConfig:
    """A Llama shape saving what production Llama code saves (torchtitan's ``models/llama``,
    Meta's ``llama/model.py``): one fp32 upcast in RMSNorm, rotary on (batch, seq, heads,
    head_dim)."""
    return LlamaConfig(norm="eager", rotary_layout="seq-first", **shape)


def _llama3(**shape: Any) -> LlamaConfig:
    """A Llama 3 shape (torchtitan's ``llama3_configs``): grouped-query attention with 8 KV
    heads, vocab 128,256, rope theta 500,000, saving what production code saves."""
    return _production(num_kv_heads=8, vocab_size=128256, rope_theta=500000.0, **shape)


#: Full-scale shapes: Llama 2 7B / 13B / 70B (Meta's ``params.json``; torchtitan's
#: ``llama2_configs``) and Llama 3 8B / 70B / 405B (torchtitan's ``llama3_configs``: vocab
#: 128,256, rope theta 500,000; FFN widths from ``ffn_dim_multiplier`` and ``multiple_of``:
#: 14,336, 28,672 and 53,248), saving what production code saves (:func:`_production`).
LLAMA_PRESETS: dict[str, LlamaConfig] = {
    "7b": _production(num_layers=32, dim=4096, num_heads=32, hidden_dim=11008, vocab_size=32000),
    "13b": _production(num_layers=40, dim=5120, num_heads=40, hidden_dim=13824, vocab_size=32000),
    "70b": _production(
        num_layers=80,
        dim=8192,
        num_heads=64,
        num_kv_heads=8,
        hidden_dim=28672,
        vocab_size=32000,
    ),
    "llama3-8b": _llama3(num_layers=32, dim=4096, num_heads=32, hidden_dim=14336),
    "llama3-70b": _llama3(num_layers=80, dim=8192, num_heads=64, hidden_dim=28672),
    "llama3-405b": _llama3(num_layers=126, dim=16384, num_heads=128, hidden_dim=53248),
}


def _inv_rms(up: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last dim of ``up``, an fp32 copy of the input."""
    return up.pow(2).mean(-1, keepdim=True).add(eps).rsqrt()


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm saving what a fused kernel saves: its input, the weight and the reciprocal RMS
    (torchtitan's Triton ``fused_rmsnorm``); the backward recomputes the normalized input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = _inv_rms(x.float(), eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x.float() * rstd).type_as(x) * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        n = x.float() * rstd
        grad_weight = (grad.float() * n).sum(tuple(range(grad.dim() - 1))).to(weight.dtype)
        gn = grad.float() * weight.float()
        grad_x = rstd * (gn - n * (gn * n).mean(-1, keepdim=True))
        return grad_x.type_as(x), grad_weight, None


class RMSNorm(nn.Module):
    """RMSNorm in one of :data:`LLAMA_NORMS` (the same values; what backward keeps differs)."""

    def __init__(self, dim: int, eps: float = 1e-6, kind: str = "upcast-twice") -> None:
        super().__init__()
        self.eps = eps
        self.kind = kind
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "fused":
            fused: torch.Tensor = _FusedRMSNorm.apply(x, self.weight, self.eps)  # type: ignore[no-untyped-call]
            return fused
        if self.kind == "eager":  # torchtitan's: x * rsqrt(mean(x^2) + eps) on one fp32 copy
            up = x.float()
            return (up * _inv_rms(up, self.eps)).type_as(x) * self.weight
        # upcast-twice: the reciprocal RMS and the product each from their own fp32 copy
        norm = _inv_rms(x.float(), self.eps)
        return (x.float() * norm).type_as(x) * self.weight


class Rotary(nn.Module):
    """Rotary position embedding; ``inv_freq`` is a non-persistent buffer (not in state dicts)."""

    inv_freq: torch.Tensor  # registered in __init__ (register_buffer); typed for mypy

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            exponents = torch.arange(
                0, self.head_dim, 2, dtype=torch.float32, device=self.inv_freq.device
            )
            self.inv_freq.copy_(1.0 / (self.theta ** (exponents / self.head_dim)))

    def forward(self, x: torch.Tensor, seq_first: bool = False) -> torch.Tensor:
        """``x``: (..., seq, head_dim), or (batch, seq, heads, head_dim) when ``seq_first``."""
        seq = x.shape[1] if seq_first else x.shape[-2]
        t = torch.arange(seq, device=x.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.float())
        cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
        if seq_first:
            cos, sin = cos[:, None, :], sin[:, None, :]
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        c = config
        self.num_heads, self.kv_heads, self.head_dim = c.num_heads, c.kv_heads, c.head_dim
        self.seq_first = c.rotary_layout == "seq-first"
        self.attn_norm = RMSNorm(c.dim, kind=c.norm)
        self.wq = nn.Linear(c.dim, c.num_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.num_heads * c.head_dim, c.dim, bias=False)
        self.rotary = Rotary(c.head_dim, c.rope_theta)
        self.mlp_norm = RMSNorm(c.dim, kind=c.norm)
        self.w1 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w3 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w2 = nn.Linear(c.hidden, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, s, self.num_heads, self.head_dim)
        k = self.wk(h).view(b, s, self.kv_heads, self.head_dim)
        v = self.wv(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.seq_first:  # rotary before the transpose: the attention output stays a view
            q, k = self.rotary(q, seq_first=True), self.rotary(k, seq_first=True)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        else:
            q, k = self.rotary(q.transpose(1, 2)), self.rotary(k.transpose(1, 2))
        if self.kv_heads != self.num_heads:
            repeat = self.num_heads // self.kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(attn.transpose(1, 2).reshape(b, s, -1))
        h = self.mlp_norm(x)
        out: torch.Tensor = x + self.w2(F.silu(self.w1(h)) * self.w3(h))
        return out


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig | None = None) -> None:
        super().__init__()
        config = config or LlamaConfig()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList([LlamaBlock(config) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.dim, kind=config.norm)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        x = run_blocks(self.layers, x)
        out: torch.Tensor = self.output(self.norm(x))
        return out
