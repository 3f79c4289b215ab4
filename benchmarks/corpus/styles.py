"""Hand-written model styles, as people write them outside transformers.

- :class:`MinGPT`: Karpathy's minGPT: ``self.apply(self._init_weights)``, the residual
  projections scaled by depth after it, a causal mask buffer, the head tied to the embedding.
- :class:`TitanLlama`: torchtitan's Llama: a complex ``freqs_cis`` buffer on the root and a
  model-level ``init_weights(self, buffer_device=None)`` (per-block ``init_weights`` with a
  depth-scaled std), built on meta, materialized with ``to_empty`` and initialized by it.
- :class:`ResNet`: a small CNN with BatchNorm (running statistics, an int64 counter); its forward
  takes a float image (``example_input``).
- :class:`FrozenGPT`: a decoder whose attention projections are frozen (``requires_grad``
  False inside every block), as in adapter or partial fine-tuning.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 64
HEADS = 4
VOCAB = 256
CONTEXT = 64


# --------------------------------------------------------------------------------------------
# minGPT
# --------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.heads = heads
        mask = torch.tril(torch.ones(CONTEXT, CONTEXT)).view(1, 1, CONTEXT, CONTEXT)
        self.register_buffer("bias", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(0.0)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))  # type: ignore[no-any-return]


class MinGPT(nn.Module):
    def __init__(self, num_layers: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(CONTEXT, WIDTH)
        self.h = nn.ModuleList(Block(WIDTH, HEADS) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * num_layers))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.zeros_(module.bias)
            nn.init.ones_(module.weight)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------
# torchtitan's Llama
# --------------------------------------------------------------------------------------------


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, device=freqs.device)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs).float())


def apply_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs = freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, x_.shape[-1])
    return torch.view_as_real(x_ * freqs).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.wq = nn.Linear(width, width, bias=False)
        self.wk = nn.Linear(width, width, bias=False)
        self.wv = nn.Linear(width, width, bias=False)
        self.wo = nn.Linear(width, width, bias=False)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (w(x).view(b, t, self.heads, -1) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, freqs_cis), apply_rotary(k, freqs_cis)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, t, c))  # type: ignore[no-any-return]


class FeedForward(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, hidden, bias=False)
        self.w2 = nn.Linear(hidden, width, bias=False)
        self.w3 = nn.Linear(width, hidden, bias=False)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # type: ignore[no-any-return]


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, num_layers: int) -> None:
        super().__init__()
        self.attention = Attention(WIDTH, HEADS)
        self.feed_forward = FeedForward(WIDTH, 2 * WIDTH)
        self.attention_norm = nn.RMSNorm(WIDTH, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(WIDTH, eps=1e-5)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))  # type: ignore[no-any-return]


class TitanLlama(nn.Module):
    def __init__(self, num_layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, WIDTH)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=True)
        # A dict of layers, as torchtitan keeps them (stable names under pipeline splits).
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, num_layers) for i in range(num_layers)}
        )
        self.norm = nn.RMSNorm(WIDTH, eps=1e-5)
        self.output = nn.Linear(WIDTH, VOCAB, bias=False)
        self.init_weights()

    def _precompute_freqs_cis(self) -> torch.Tensor:
        return precompute_freqs_cis(WIDTH // HEADS, 2 * CONTEXT)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """torchtitan's model-level init: the buffers on ``buffer_device``, then every weight."""
        buffer_device = buffer_device or self.freqs_cis.device
        with torch.device(buffer_device):
            self.freqs_cis = self._precompute_freqs_cis()
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()  # type: ignore[operator]
        self.norm.reset_parameters()
        final_std = WIDTH**-0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=final_std, a=-3 * final_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------
# A ResNet with BatchNorm
# --------------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, channels_in: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or channels_in != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels, 1, stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, num_layers: int = 2, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16))
        channels = [16 * 2 ** min(i, 2) for i in range(num_layers)]
        blocks, previous = [], 16
        for i, c in enumerate(channels):
            blocks.append(BasicBlock(previous, c, 2 if i else 1))
            previous = c
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(previous, num_classes)

    def example_input(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        """The input :func:`corpus.models.inputs` makes: 32 x 32 RGB images."""
        return torch.randn(batch_size, 3, 32, 32, generator=generator)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.stem(images)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------
# Frozen submodules
# --------------------------------------------------------------------------------------------


class FrozenGPT(MinGPT):
    """minGPT with every block's attention projections frozen (the MLPs and norms train)."""

    def __init__(self, num_layers: int = 2) -> None:
        super().__init__(num_layers)
        for block in self.h:
            block.attn.requires_grad_(False)  # type: ignore[union-attr]


#: name -> (factory taking the depth, block class name for --block-cls, needs --input).
STYLES: dict[str, tuple[Callable[[int], nn.Module], str, bool]] = {
    "mingpt": (MinGPT, "Block", False),
    "titan_llama": (TitanLlama, "TransformerBlock", False),
    "small_resnet": (ResNet, "BasicBlock", True),
    "frozen_gpt": (FrozenGPT, "Block", False),
}
