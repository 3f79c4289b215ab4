"""Reference models: the seeds' ``DecoderLayer`` / ``MassiveModel`` and the cases around them.

Every model here is an ordinary ``nn.Module`` that builds on any device (``torch.device("meta")``
included), defines ``reset_parameters`` on each module that owns state (FSDP1's default meta
path calls it), and takes a plain batch built by
:func:`fsdp_conformance.models.model_spec.make_batch`. The Llama-style model and its full-scale
presets are in :mod:`fsdp_conformance.models.llama` (its shape, :class:`LlamaConfig`, is here);
:data:`fsdp_conformance.models.catalog.REFERENCE_MODELS` names them all, with their block
classes, for ``ModelSpec(reference=...)``.

Sizes: the seeds' full-scale model is dim 4096, 8 layers, vocab 32000, size threshold 2e7. The
CPU-sized defaults keep the same *size structure* by scaling the threshold with ``dim**2`` and
the vocabulary with ``dim``: the head stays above the threshold, the embedding below it, and the
blocks' large MLP linears above it (which is what trips the seeds' policy, see README).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn as nn

from fsdp_conformance.models.policies import SEED_MIN_PARAMS

SEED_DIM = 4096
SEED_VOCAB = 32000
SEED_LAYERS = 8


def scaled_min_params(dim: int) -> int:
    """The size threshold for a model of width ``dim``, as 2e7 relates to dim 4096."""
    return max(1, round(SEED_MIN_PARAMS * dim * dim / (SEED_DIM * SEED_DIM)))


def scaled_vocab(dim: int) -> int:
    """The head width for a model of width ``dim``, as 32000 relates to dim 4096."""
    return max(2, round(SEED_VOCAB * dim / SEED_DIM))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the seeds' ``MassiveModel``; defaults are CPU-sized with the seeds' structure."""

    #: Number of ``DecoderLayer`` blocks.
    num_layers: int = 4
    #: Model width (the seeds: 4096).
    dim: int = 64
    #: MLP width; None means ``4 * dim`` as in the seeds.
    hidden_dim: int | None = None
    #: Head output width; None scales the seeds' 32000 with ``dim``.
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def hidden(self) -> int:
        return self.hidden_dim if self.hidden_dim is not None else 4 * self.dim

    @property
    def vocab(self) -> int:
        return self.vocab_size if self.vocab_size is not None else scaled_vocab(self.dim)

    @property
    def min_params(self) -> int:
        return scaled_min_params(self.dim)

    @classmethod
    def seeds_full_scale(cls) -> ModelConfig:
        """The seeds' own scale: dim 4096, 8 layers, vocab 32000 (~1.36 B parameters)."""
        return cls(num_layers=SEED_LAYERS, dim=SEED_DIM, vocab_size=SEED_VOCAB)


# --------------------------------------------------------------------------------------------
# The seeds' models, as written (plus reset_parameters on the containers for clarity)
# --------------------------------------------------------------------------------------------


def _stack(block: Callable[[int, int], nn.Module], config: ModelConfig) -> nn.ModuleList:
    """``config.num_layers`` blocks of ``config.dim`` x ``config.hidden``."""
    return nn.ModuleList([block(config.dim, config.hidden) for _ in range(config.num_layers)])


def run_blocks(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    """The blocks applied in order, each to the last one's output."""
    for block in blocks:
        x = block(x)
    return x


class _AttnThenMLP(nn.Module):
    """A block that runs its ``attn`` then its ``mlp`` (no residual, as the seeds wrote it)."""

    attn: nn.Module
    mlp: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(self.attn(x))
        return out


class _EmbedLayersHead(nn.Module):
    """A model that runs ``embed``, then its ``layers`` in order, then ``head``."""

    embed: nn.Module
    layers: nn.ModuleList
    head: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(run_blocks(self.layers, self.embed(x)))
        return out

    def _linear_stack(self, config: ModelConfig, block: Callable[[int, int], nn.Module]) -> None:
        """The seeds' layout: ``embed`` (dim x dim), ``layers`` of ``block``, ``head``."""
        self.config = config
        self.embed = nn.Linear(config.dim, config.dim)
        self.layers = _stack(block, config)
        self.head = nn.Linear(config.dim, config.vocab)


class DecoderLayer(_AttnThenMLP):
    """The seeds' mock transformer block: ``attn`` linear, then a two-layer MLP."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.attn = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, dim))


class MassiveModel(_EmbedLayersHead):
    """The seeds' model: ``embed`` (dim x dim), DecoderLayer ``layers``, ``head`` (dim x vocab)."""

    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__()
        self._linear_stack(config or ModelConfig(), DecoderLayer)


# --------------------------------------------------------------------------------------------
# The size rule at its boundary
# --------------------------------------------------------------------------------------------

#: :class:`SizeBoundaryModel`'s size threshold: each of its ``AT`` modules has exactly this many
#: parameters not yet wrapped when the size rule decides it, each of its ``BELOW`` modules one
#: fewer.
BOUNDARY_MIN_PARAMS = 169


class Gated(nn.Module):
    """``proj`` (large: a unit of its own under the size rule) times a ``width``-element gate:
    once ``proj`` is wrapped, the gate is all the module has left that is not yet wrapped."""

    def __init__(self, dim: int, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, width)
        self.gate = nn.Parameter(torch.empty(width))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.gate.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(x) * self.gate
        return out


class SizeBoundaryModel(nn.Module):
    """Siblings on either side of the size rule's boundary, :data:`BOUNDARY_MIN_PARAMS` (169),
    at width 12:

    * ``at``: ``Linear(12, 13)``, 13 x 12 + 13 = 169 parameters, exactly the threshold;
    * ``below``: ``Linear(12, 14, bias=False)``, 14 x 12 = 168, one fewer;
    * ``gated_at`` / ``gated_below``: :class:`Gated` with gates of 169 / 168 elements behind a
      ``proj`` of 2,197 / 2,184 (a unit of its own): the threshold reached, or missed by one, by
      what is left *after* a child was wrapped (torch's ``nonwrapped_numel``);
    * ``layers``: one seeds' ``DecoderLayer(12, 24)`` (the recommended policy needs a block;
      its MLP linears, 312 and 300, and its ``attn``, 156, are far from the threshold), and
      ``head`` over the four siblings' outputs (1,095).
    """

    #: The modules at the threshold, and their siblings one parameter below it.
    AT = ("at", "gated_at")
    BELOW = ("below", "gated_below")

    def __init__(self, dim: int = 12) -> None:
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer(dim, 2 * dim)])
        self.at = nn.Linear(dim, 13)
        self.below = nn.Linear(dim, 14, bias=False)
        self.gated_at = Gated(dim, BOUNDARY_MIN_PARAMS)
        self.gated_below = Gated(dim, BOUNDARY_MIN_PARAMS - 1)
        self.head = nn.Linear(13 + 14 + 2 * BOUNDARY_MIN_PARAMS - 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = run_blocks(self.layers, x)
        branches = (self.at, self.below, self.gated_at, self.gated_below)
        out: torch.Tensor = self.head(torch.cat([b(x) for b in branches], dim=-1))
        return out


# --------------------------------------------------------------------------------------------
# The second seed's heterogeneous cases
# --------------------------------------------------------------------------------------------


class EmbeddingClassifier(nn.Module):
    """A large embedding table, a few blocks, then a small classification head.

    The table is above the size threshold (its own unit); the head far below it (root).
    """

    def __init__(self, config: ModelConfig | None = None, num_classes: int = 10) -> None:
        super().__init__()
        config = config or ModelConfig()
        self.config = config
        self.embedding = nn.Embedding(4 * config.vocab, config.dim)
        self.layers = _stack(DecoderLayer, config)
        self.classifier = nn.Linear(config.dim, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        x = run_blocks(self.layers, x)
        out: torch.Tensor = self.classifier(x.mean(dim=1))
        return out


class EncoderLayer(nn.Module):
    """An encoder block: narrower MLP than the decoder's (2x instead of 4x)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        out: torch.Tensor = x + self.mlp(x)
        return out


class EncoderDecoder(nn.Module):
    """An asymmetric encoder-decoder: few narrow encoder blocks, more decoder blocks."""

    def __init__(self, config: ModelConfig | None = None, num_encoder_layers: int = 2) -> None:
        super().__init__()
        config = config or ModelConfig()
        self.config = config
        self.encoder = nn.ModuleList([EncoderLayer(config.dim) for _ in range(num_encoder_layers)])
        self.bridge = nn.Linear(config.dim, config.dim)
        self.decoder = _stack(DecoderLayer, config)
        self.head = nn.Linear(config.dim, config.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = run_blocks(self.encoder, x)
        x = self.bridge(x)
        x = run_blocks(self.decoder, x)
        out: torch.Tensor = self.head(x)
        return out


class TiedLM(_EmbedLayersHead):
    """Embedding and head share one weight (weight tying), both above the size threshold.

    The shared weight must end in exactly one unit: wrapping either side on its own splits it.
    """

    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__()
        config = config or ModelConfig()
        self.config = config
        self.embed = nn.Embedding(config.vocab * 2, config.dim)
        self.layers = _stack(DecoderLayer, config)
        self.head = nn.Linear(config.dim, config.vocab * 2, bias=False)
        self.head.weight = self.embed.weight


class LoRALinear(nn.Module):
    """A frozen base linear plus a trainable low-rank adapter (as in LoRA)."""

    def __init__(self, dim_in: int, dim_out: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(dim_in, dim_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(dim_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, dim_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x) + self.lora_b(self.lora_a(x))
        return out


class LoRADecoderLayer(_AttnThenMLP):
    """A block with mixed ``requires_grad``: frozen base weights, trainable adapters."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.attn = LoRALinear(dim, dim)
        self.mlp = nn.Sequential(
            LoRALinear(dim, hidden_dim), nn.ReLU(), LoRALinear(hidden_dim, dim)
        )


class LoRAModel(_EmbedLayersHead):
    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__()
        self._linear_stack(config or ModelConfig(), LoRADecoderLayer)
        self.embed.requires_grad_(False)
        self.head.requires_grad_(False)


# --------------------------------------------------------------------------------------------
# Odd sizes and persistent buffers: what the training-loop checks shard and save
# --------------------------------------------------------------------------------------------

#: The odd model's shape: no width divides by 2 or 4 (every shard uneven at world sizes 2 and 4).
ODD_CONFIG = ModelConfig(num_layers=2, dim=13, hidden_dim=27, vocab_size=31)


class OddModel(nn.Module):
    """Uneven shards and persistent buffers: no dimension divides by 2 or 4, a one-element
    gain (fewer elements than ranks: some ranks hold none of it), batch norm's running
    statistics (``running_mean``, ``running_var``, ``num_batches_tracked``) and a registered
    persistent buffer (``scale``) that the forward reads.

    ``embed``, then the seeds' ``DecoderLayer`` blocks, then batch norm over the features, the
    scale and the gain, then ``head`` (above the size threshold: its own unit).
    """

    scale: torch.Tensor  # registered in __init__; typed for mypy

    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__()
        config = config or ODD_CONFIG
        self.config = config
        self.embed = nn.Linear(config.dim, config.dim)
        self.layers = _stack(DecoderLayer, config)
        self.norm = nn.BatchNorm1d(config.dim)
        self.gain = nn.Parameter(torch.empty(1))
        self.register_buffer("scale", torch.empty(config.dim))
        self.head = nn.Linear(config.dim, config.vocab)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.gain.fill_(1.0)
            self.scale.copy_(torch.linspace(0.5, 1.5, self.config.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = run_blocks(self.layers, self.embed(x))
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        out: torch.Tensor = self.head(x * self.scale * self.gain)
        return out


#: The branch model's shape: the odd model's widths, one block always run.
BRANCH_CONFIG = ModelConfig(num_layers=1, dim=13, hidden_dim=27, vocab_size=31)
#: The input features that choose the branch model's branches: a call takes a branch when its
#: input's feature sums positive over the batch.
ADAPTER_FEATURE = 0
EXTRA_FEATURE = 1


def _chooses(x: torch.Tensor, feature: int) -> bool:
    return bool(x[..., feature].sum() > 0)


class BranchModel(nn.Module):
    """Parameters a step may leave unused: two branches its input chooses, as a mixture of
    experts' router or a multi-modal model's "this batch has images" does.

    ``embed``; ``adapter`` (a square linear without bias, in the root unit, which runs on every
    call) added when the input's feature :data:`ADAPTER_FEATURE` sums positive; the seeds'
    ``DecoderLayer`` ``layers``; ``extra`` (one more ``DecoderLayer``: units of its own) run
    when feature :data:`EXTRA_FEATURE` sums positive; ``head``. No width divides by 2 or 4.
    """

    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__()
        config = config or BRANCH_CONFIG
        self.config = config
        self.embed = nn.Linear(config.dim, config.dim)
        self.adapter = nn.Linear(config.dim, config.dim, bias=False)
        self.layers = _stack(DecoderLayer, config)
        self.extra = DecoderLayer(config.dim, config.hidden)
        self.head = nn.Linear(config.dim, config.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if _chooses(x, ADAPTER_FEATURE):
            h = h + self.adapter(h)
        h = run_blocks(self.layers, h)
        if _chooses(x, EXTRA_FEATURE):
            h = self.extra(h)
        out: torch.Tensor = self.head(h)
        return out


# --------------------------------------------------------------------------------------------
# A Llama-style model's shape (the model and the full-scale presets: models/llama.py)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Llama-style shape (of :class:`~fsdp_conformance.models.llama.LlamaModel`). Presets for
    planning at full scale live in :data:`~fsdp_conformance.models.llama.LLAMA_PRESETS`."""

    num_layers: int = 4
    dim: int = 64
    num_heads: int = 4
    num_kv_heads: int | None = None  # None: as many as num_heads (no grouping)
    hidden_dim: int | None = None  # None: the Llama rule, 8/3 * dim rounded up to 32
    vocab_size: int = 512
    rope_theta: float = 10000.0
    #: RMSNorm as it runs (:data:`LLAMA_NORMS`): "upcast-twice" (this suite's first reference:
    #: the input upcast to fp32 twice, both copies saved for backward), "eager" (torchtitan's and
    #: Meta's Llama: one fp32 upcast), "fused" (a fused kernel, as torchtitan's Triton
    #: ``fused_rmsnorm``: saves its input and the reciprocal RMS only).
    norm: str = "upcast-twice"
    #: Where rotary is applied (:data:`ROTARY_LAYOUTS`): "heads-first" (this suite's first
    #: reference: on (batch, heads, seq, head_dim), so the attention output is copied before the
    #: output projection) or "seq-first" (torchtitan's and Meta's: on (batch, seq, heads,
    #: head_dim) before the transpose, so the output projection's input is a view).
    rotary_layout: str = "heads-first"

    def __post_init__(self) -> None:
        for name, allowed in (("norm", LLAMA_NORMS), ("rotary_layout", ROTARY_LAYOUTS)):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name} {getattr(self, name)!r} is not one of {', '.join(allowed)}"
                )
        if self.dim % self.num_heads:
            raise ValueError(f"dim {self.dim} must be divisible by num_heads {self.num_heads}")
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be divisible by num_kv_heads {self.kv_heads}"
            )

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def hidden(self) -> int:
        if self.hidden_dim is not None:
            return self.hidden_dim
        return 32 * math.ceil(int(8 * self.dim / 3) / 32)

    @property
    def min_params(self) -> int:
        return scaled_min_params(self.dim)


#: The RMSNorm forms of :attr:`LlamaConfig.norm`.
LLAMA_NORMS = ("upcast-twice", "eager", "fused")
#: The rotary layouts of :attr:`LlamaConfig.rotary_layout`.
ROTARY_LAYOUTS = ("heads-first", "seq-first")
