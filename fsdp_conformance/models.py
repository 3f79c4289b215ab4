"""Reference models: the seeds' ``DecoderLayer`` / ``MassiveModel`` and the cases around them.

Every model here is an ordinary ``nn.Module`` that builds on any device (``torch.device("meta")``
included), defines ``reset_parameters`` on each module that owns state (FSDP1's default meta
path calls it), and takes a plain batch built by :func:`make_batch`.

Sizes: the seeds' full-scale model is dim 4096, 8 layers, vocab 32000, size threshold 2e7. The
CPU-sized defaults keep the same *size structure* by scaling the threshold with ``dim**2`` and
the vocabulary with ``dim``: the head stays above the threshold, the embedding below it, and the
blocks' large MLP linears above it (which is what trips the seeds' policy, see README).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import math
import os
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_conformance.policies import SEED_MIN_PARAMS

if TYPE_CHECKING:
    from fsdp_conformance.policies import Policy, PolicyName

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


def _run(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
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
        out: torch.Tensor = self.head(_run(self.layers, self.embed(x)))
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
        x = _run(self.layers, x)
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
        x = _run(self.encoder, x)
        x = self.bridge(x)
        x = _run(self.decoder, x)
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
# A Llama-style model: norms, grouped-query attention, rotary non-persistent buffer
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Llama-style shape. Presets for planning at full scale live in :data:`LLAMA_PRESETS`."""

    num_layers: int = 4
    dim: int = 64
    num_heads: int = 4
    num_kv_heads: int | None = None  # None: as many as num_heads (no grouping)
    hidden_dim: int | None = None  # None: the Llama rule, 8/3 * dim rounded up to 32
    vocab_size: int = 512
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
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


LLAMA_PRESETS: dict[str, LlamaConfig] = {
    "7b": LlamaConfig(num_layers=32, dim=4096, num_heads=32, hidden_dim=11008, vocab_size=32000),
    "13b": LlamaConfig(num_layers=40, dim=5120, num_heads=40, hidden_dim=13824, vocab_size=32000),
    "70b": LlamaConfig(
        num_layers=80, dim=8192, num_heads=64, num_kv_heads=8, hidden_dim=28672, vocab_size=32000
    ),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = x.float().pow(2).mean(-1, keepdim=True).add(self.eps).rsqrt()
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
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32,
                                     device=self.inv_freq.device)
            self.inv_freq.copy_(1.0 / (self.theta ** (exponents / self.head_dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[-2]
        t = torch.arange(seq, device=x.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.float())
        cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        c = config
        self.num_heads, self.kv_heads, self.head_dim = c.num_heads, c.kv_heads, c.head_dim
        self.attn_norm = RMSNorm(c.dim)
        self.wq = nn.Linear(c.dim, c.num_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.num_heads * c.head_dim, c.dim, bias=False)
        self.rotary = Rotary(c.head_dim, c.rope_theta)
        self.mlp_norm = RMSNorm(c.dim)
        self.w1 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w3 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w2 = nn.Linear(c.hidden, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotary(q), self.rotary(k)
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
        self.norm = RMSNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        x = _run(self.layers, x)
        out: torch.Tensor = self.output(self.norm(x))
        return out


# --------------------------------------------------------------------------------------------
# Registry and batches
# --------------------------------------------------------------------------------------------


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
        ReferenceModel("massive", MassiveModel, (DecoderLayer,), "features",
                       "the seeds' MassiveModel (embed, DecoderLayers, large head)"),
        ReferenceModel("embedding_classifier", EmbeddingClassifier, (DecoderLayer,), "tokens",
                       "large embedding table, small classification head"),
        ReferenceModel("encoder_decoder", EncoderDecoder, (EncoderLayer, DecoderLayer),
                       "features", "asymmetric encoder-decoder"),
        ReferenceModel("tied", TiedLM, (DecoderLayer,), "tokens",
                       "embedding and head share one weight"),
        ReferenceModel("lora", LoRAModel, (LoRADecoderLayer,), "features",
                       "frozen base with trainable adapters (mixed requires_grad)"),
        ReferenceModel("llama", LlamaModel, (LlamaBlock,), "tokens",
                       "Llama-style blocks with norms, GQA and a rotary non-persistent buffer"),
    )
}


def build_reference(name: str, config: ModelConfig | LlamaConfig | None = None,
                    device: str | torch.device | None = None) -> nn.Module:
    """Build a reference model by name, optionally on a device (``"meta"`` for no storage)."""
    try:
        ref = REFERENCE_MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown reference model {name!r}; choose one of {', '.join(REFERENCE_MODELS)}"
        ) from None
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return ref.build(config) if config is not None else ref.build()


def default_loss(output: Any) -> torch.Tensor:
    """The loss every check's training step uses: the mean square of the output in fp32.

    Any output shape and float dtype; a tuple/list output contributes its first element, a
    mapping its ``logits`` when it has them, else its first value. A transformers
    ``ModelOutput`` is such a mapping: ``logits`` is named rather than taken as the first
    value, because with ``labels`` in the input the first value is transformers' own scalar
    loss, and the checks compare the same loss on every model. One definition, so the checks'
    steps and the memory profile compute the same thing.
    """
    if isinstance(output, (tuple, list)):
        output = output[0]
    if isinstance(output, Mapping):
        output = output["logits"] if "logits" in output else next(iter(output.values()))
    out: torch.Tensor = output.float().pow(2).mean()
    return out


def make_batch(model: nn.Module, batch_size: int = 2, seq_len: int = 8,
               device: str | torch.device = "cpu", seed: int = 1234) -> Any:
    """A deterministic input batch (the same on every rank for a seed).

    A transformers ``PreTrainedModel`` (looked through FSDP1's wrapper) gets keyword inputs
    from its config (:func:`fsdp_conformance.hf.default_inputs`: ``input_ids`` below
    ``vocab_size``, plus ``decoder_input_ids`` for an encoder-decoder), a mapping that
    :func:`call_model` passes as keyword arguments. Any other model gets one tensor whose kind
    follows its first ``nn.Embedding`` or ``nn.Linear`` in registration order (wrappers are
    looked through): an embedding takes token ids below its ``num_embeddings``, a linear takes
    features of its ``in_features``. A model that starts otherwise (convolutions, several
    inputs) needs an input builder (``--fsdp-input``).
    """
    from fsdp_conformance import hf

    g = torch.Generator().manual_seed(seed)
    inner = _inside_fsdp1(model)
    if hf.is_pretrained(inner):
        return hf.default_inputs(inner, batch_size, seq_len, device, g)
    first = _first_input_module(model)
    if isinstance(first, nn.Embedding):
        shape: tuple[int, ...] = (batch_size, seq_len)
        return torch.randint(0, first.num_embeddings, shape, generator=g).to(device)
    return torch.randn(batch_size, seq_len, first.in_features, generator=g).to(device)


def _inside_fsdp1(model: nn.Module) -> nn.Module:
    """The module an FSDP1 root wraps (FSDP2 keeps the module itself, class included)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    while isinstance(model, FullyShardedDataParallel):
        model = model.module
    return model


def call_model(model: nn.Module, batch: Any) -> Any:
    """Run ``model`` on ``batch``: a mapping is passed as keyword arguments, anything else as
    the one positional argument (a tuple too: that is today's contract of input builders).

    Every forward of the checks goes through here, so an input builder (or the default input
    of a transformers model) may return ``{"input_ids": ..., "attention_mask": ...}``.
    """
    if isinstance(batch, Mapping):
        return model(**batch)
    return model(batch)


def batch_rows(batch: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` (dim 0) of every tensor in a batch: a tensor, a mapping or a
    tuple/list of tensors; anything else is an error naming the builder's contract."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return {k: batch_rows(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(batch_rows(v, start, stop) for v in batch)
    raise ModelSpecError(
        f"cannot split the input batch across ranks along dim 0: it holds a "
        f"{type(batch).__name__}; the input builder must return a tensor, or a mapping, tuple "
        "or list of tensors whose first dimension is the batch"
    )


def _first_input_module(model: nn.Module) -> nn.Embedding | nn.Linear:
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.Linear)):
            return module
    raise ModelSpecError(
        f"cannot build a default batch for {type(model).__name__}: it has no nn.Embedding or "
        "nn.Linear; pass an input builder "
        "(--fsdp-input pkg.module:builder, called as builder(model, batch_size, device))"
    )


# --------------------------------------------------------------------------------------------
# ModelSpec: a picklable description of "which model", sent to the ranks
# --------------------------------------------------------------------------------------------


class ModelSpecError(ValueError):
    """The model specification cannot be used; the message names the problem and the fix."""


def import_from_cwd(module_path: str) -> Any:
    """Import ``module_path`` with the current folder first on ``sys.path``, as ``python -m``.

    A console script (``fsdp-conformance``, ``pytest``) starts with its own bin folder first
    on ``sys.path``, not the current one, so ``--model mymodels:build`` run next to
    ``mymodels.py`` would not import. The folder stays first for the rest of the process (as
    under ``python -m``), so a factory that imports its sibling modules later finds them too;
    the rank processes start with the same folder as their working directory and ``-m``.
    """
    cwd = os.getcwd()
    if not sys.path or sys.path[0] not in ("", cwd):
        sys.path.insert(0, cwd)
        importlib.invalidate_caches()
    return importlib.import_module(module_path)


def load_object(path: str, what: str) -> Any:
    """Import ``pkg.module:name`` (or ``pkg.module.name``) with one clear error per failure."""
    module_path, sep, attr = path.partition(":")
    if not sep:
        module_path, _, attr = path.rpartition(".")
    if not module_path or not attr:
        raise ModelSpecError(
            f"{what} {path!r} is not of the form 'pkg.module:name'; e.g. mypkg.model:build_model"
        )
    try:
        module = import_from_cwd(module_path)
    except ImportError as exc:
        raise ModelSpecError(
            f"cannot import module {module_path!r} for {what} {path!r} ({exc}); check the "
            f"path and that the module is in the current folder ({os.getcwd()}), installed in "
            "this environment, or on PYTHONPATH"
        ) from None
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ModelSpecError(
                f"module {module_path!r} has no attribute {attr!r} ({what} {path!r}); "
                f"check the name after the colon"
            ) from None
    if not callable(obj):
        raise ModelSpecError(f"{what} {path!r} is not callable ({type(obj).__name__}); "
                             "name a function or class after the colon")
    return obj


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Which model a check builds: a reference model by name, or the user's factory.

    Plain data (strings, numbers, a frozen config), so it pickles to the ranks.
    """

    #: A key of :data:`REFERENCE_MODELS`, or None when ``factory`` is given.
    reference: str | None = "massive"
    #: Config for the reference model (None: its default).
    config: ModelConfig | LlamaConfig | None = None
    #: ``pkg.module:factory`` returning an ``nn.Module`` (the user's model).
    factory: str | None = None
    #: Block classes as dotted paths or class names (None: the reference model's own).
    block_cls: tuple[str, ...] | None = None
    #: Size-policy threshold (None: scaled from the model's width, or the config's).
    min_params: int | None = None
    #: ``pkg.module:builder`` returning a batch: builder(model, batch_size, device).
    input_builder: str | None = None
    #: The factory's model at this many layers (None: as the factory builds it); see
    #: :meth:`depth_setting` for how a factory's depth is set.
    depth: int | None = None
    #: ``pkg.module:fn`` initializing one module's own state for meta init (None: the model's
    #: own contract; see ``meta_init.module_init_for``).
    init_fn: str | None = None

    def __post_init__(self) -> None:
        if (self.reference is None) == (self.factory is None):
            raise ModelSpecError("ModelSpec needs exactly one of reference= or factory=")
        if self.depth is not None and (self.reference is not None or self.depth < 1):
            raise ModelSpecError(
                f"ModelSpec.depth is for a factory and must be >= 1, got {self.depth} "
                f"({self.name}); set a reference model's depth in its config")
        if self.reference is not None and self.reference not in REFERENCE_MODELS:
            raise ModelSpecError(
                f"unknown reference model {self.reference!r}; choose one of "
                f"{', '.join(REFERENCE_MODELS)}"
            )

    @property
    def name(self) -> str:
        return self.factory or str(self.reference)

    def build(self, device: str | torch.device | None = None) -> nn.Module:
        """Build the model (under ``torch.device(device)`` when given, e.g. ``"meta"``)."""
        if self.reference is not None:
            return build_reference(self.reference, self.config, device)
        assert self.factory is not None  # __post_init__ guarantees one of the two
        factory = load_object(self.factory, "model factory")
        keyword = depth_keyword(factory) if self.depth is not None else None
        kwargs = {keyword: self.depth} if keyword else {}
        called = ", ".join(f"{k}={v}" for k, v in kwargs.items()) or "no arguments"
        try:
            with torch.device(device) if device is not None else contextlib.nullcontext():
                model = factory(**kwargs)
                if self.depth is not None and keyword is None:
                    model = self._config_at_depth(model, self.depth)
        except ModelSpecError:
            raise
        except Exception as exc:
            raise ModelSpecError(
                f"model factory {self.factory!r} raised {type(exc).__name__}: {exc}; "
                f"fix the factory (it is called with {called})"
            ) from exc
        if not isinstance(model, nn.Module):
            raise ModelSpecError(
                f"model factory {self.factory!r} returned {type(model).__name__}, "
                "not an nn.Module; make it return the model itself (an nn.Module instance)"
            )
        return model

    def instantiate(self, device: str | torch.device | None = None) -> BuiltModel:
        """Build the model once and resolve, on demand, what every claim asks of it: its block
        classes, size threshold, policies and batches (:class:`BuiltModel`)."""
        return BuiltModel(self, self.build(device))

    def _config_at_depth(self, model: Any, depth: int) -> nn.Module:
        from fsdp_conformance import hf

        if not isinstance(model, nn.Module) or hf.config_depth(model) is None:
            raise ModelSpecError(f"cannot build {self.factory!r} at {depth} layers: "
                                 + NO_SETTABLE_DEPTH)
        return hf.rebuild_with_depth(model, depth)

    def depth_setting(self) -> str | None:
        """How this model's depth is set, in words for a report, or None when it cannot be.

        A reference model: its config's ``num_layers``. A factory: its own depth keyword
        (:data:`DEPTH_KEYWORDS`, preferred: the factory stays in charge of the model), else
        ``config.num_hidden_layers`` of the transformers model it returns (rebuilt from a copy
        of that config). A factory taking only ``**kwargs`` is not guessed at: nothing says
        which name it reads, or that it reads one.
        """
        from fsdp_conformance import hf

        if self.reference is not None:
            return "the reference config's num_layers"
        assert self.factory is not None
        keyword = depth_keyword(load_object(self.factory, "model factory"))
        if keyword is not None:
            return f"the factory's {keyword}= keyword"
        model = dataclasses.replace(self, depth=None).build("meta")
        if hf.config_depth(model) is not None:
            return f"config.num_hidden_layers of its {type(model).__name__}"
        return None

    def block_classes(self, model: nn.Module) -> tuple[type[nn.Module], ...]:
        """The block classes, resolved against the built model (clear error if absent)."""
        from fsdp_conformance import hf
        from fsdp_conformance.policies import PolicyError, resolve_block_classes

        if self.block_cls:
            return resolve_block_classes(model, list(self.block_cls))
        if self.reference is not None:
            return REFERENCE_MODELS[self.reference].block_classes
        if hf.is_pretrained(model):
            return _no_split_block_classes(model, self.name)
        raise PolicyError(
            f"no block class given for {self.factory!r}: pass --fsdp-block-cls with the class of "
            "its transformer block (a class name found in the model or a dotted path)"
        )

    def size_threshold(self, model: nn.Module) -> int:
        """The size-policy threshold: explicit, else scaled from the model's width."""
        if self.min_params is not None:
            return self.min_params
        config = getattr(model, "config", None)
        if isinstance(config, (ModelConfig, LlamaConfig)):
            return config.min_params
        return scaled_min_params(infer_width(model))

    def batch(self, model: nn.Module, batch_size: int = 2,
              device: str | torch.device = "cpu", seq_len: int = 8) -> Any:
        """An input batch: the user's builder (its own length), else :func:`make_batch`."""
        if self.input_builder:
            builder = load_object(self.input_builder, "input builder")
            return builder(model, batch_size, device)
        return make_batch(model, batch_size=batch_size, seq_len=seq_len, device=device)


#: Keywords a factory may take for its depth (the reference factories' ``num_layers``, common
#: spellings elsewhere, and the transformers config attribute names).
DEPTH_KEYWORDS = ("num_layers", "n_layers", "num_hidden_layers", "n_layer")

#: Why a factory's depth cannot be set, and the two ways to make it settable.
NO_SETTABLE_DEPTH = (
    "its depth cannot be set: give the factory a depth keyword ("
    + ", ".join(f"{k}=" for k in DEPTH_KEYWORDS)
    + "), or make it return a transformers model whose config has num_hidden_layers"
)


def depth_keyword(factory: Callable[..., Any]) -> str | None:
    """The factory's parameter (of :data:`DEPTH_KEYWORDS`) that can be passed by keyword."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return None
    for name in DEPTH_KEYWORDS:
        p = parameters.get(name)
        if p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            return name
    return None


def _no_split_block_classes(model: nn.Module, name: str) -> tuple[type[nn.Module], ...]:
    """A transformers model's blocks: its ``_no_split_modules`` classes found in the model.

    As accelerate's FSDP plugin does when no layer class is given; a listed name the model does
    not contain (``_no_split_modules`` is gathered over a model family's submodels) is skipped
    as long as one is found.
    """
    from fsdp_conformance import hf
    from fsdp_conformance.policies import PolicyError, module_classes

    names = hf.no_split_modules(model)
    found = dict.fromkeys(type(m) for m in model.modules() if type(m).__name__ in names)
    if found:
        return tuple(found)
    listed = ", ".join(names) if names else "no class"
    raise PolicyError(
        f"no block class given for {name!r}, and its transformers model "
        f"{type(model).__name__} lists {listed} in _no_split_modules"
        + (", none of which is in the model" if names else "")
        + "; pass --fsdp-block-cls with the class of its transformer block (one of: "
        + ", ".join(module_classes(model)) + ")"
    )


def infer_width(model: nn.Module) -> int:
    """The model's width: the most common ``in_features`` of its linears (embedding dim else)."""
    counts: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear):
            counts[module.in_features] = counts.get(module.in_features, 0) + 1
        elif isinstance(module, nn.Embedding):
            counts[module.embedding_dim] = counts.get(module.embedding_dim, 0) + 1
    if not counts:
        raise ModelSpecError(
            f"cannot infer the width of {type(model).__name__} (no Linear or Embedding); "
            "pass --fsdp-min-params"
        )
    return max(counts, key=lambda k: (counts[k], k))


class BuiltModel:
    """A :class:`ModelSpec`'s model, built once, with what the claims ask of it resolved against
    that model and kept: the one way a check reaches its model's block classes, size threshold,
    policy and batch."""

    def __init__(self, spec: ModelSpec, model: nn.Module) -> None:
        self.spec = spec
        self.model = model

    @functools.cached_property
    def blocks(self) -> tuple[type[nn.Module], ...]:
        """The block classes (raises a clear error when the spec names none and the model has no
        default)."""
        return self.spec.block_classes(self.model)

    @functools.cached_property
    def size_threshold(self) -> int:
        """The size policy's threshold for this model."""
        return self.spec.size_threshold(self.model)

    def policy(self, name: PolicyName, *, full_scale: bool = False) -> Policy:
        """The auto-wrap policy ``name`` for this model (``policies.policy_for``)."""
        from fsdp_conformance.policies import policy_for

        return policy_for(name, self.model, self.spec, full_scale=full_scale)

    def batch(self, batch_size: int = 2, device: str | torch.device = "cpu",
              seq_len: int = 8) -> Any:
        """An input batch for this model (``ModelSpec.batch``)."""
        return self.spec.batch(self.model, batch_size=batch_size, device=device, seq_len=seq_len)
