"""The model a check builds: :class:`ModelSpec` (which model, as plain data for the ranks),
:class:`BuiltModel` (that model built once, with its block classes, size threshold, policies and
batches), the user's objects loaded by import path, and the batch and loss every check's step
uses on any model.

The reference models themselves (the seeds' ``MassiveModel`` and the cases around them) are in
:mod:`fsdp_conformance.models.reference_models` (the Llama-style one in
:mod:`fsdp_conformance.models.llama`), by name in :mod:`fsdp_conformance.models.catalog`;
block-class resolution is in
:mod:`fsdp_conformance.models.block_classes`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.nn as nn

from fsdp_conformance.models import hf, policies
from fsdp_conformance.models.block_classes import block_classes_of
from fsdp_conformance.models.catalog import REFERENCE_MODELS, build_reference
from fsdp_conformance.models.policies import SEED_MIN_PARAMS, Policy, PolicyName
from fsdp_conformance.models.reference_models import LlamaConfig, ModelConfig, scaled_min_params

# --------------------------------------------------------------------------------------------
# Batches and the loss: for any model
# --------------------------------------------------------------------------------------------


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


def make_batch(
    model: nn.Module,
    batch_size: int = 2,
    seq_len: int = 8,
    device: str | torch.device = "cpu",
    seed: int = 1234,
) -> Any:
    """A deterministic input batch (the same on every rank for a seed).

    A transformers ``PreTrainedModel`` (looked through FSDP1's wrapper) gets keyword inputs
    from its config (:func:`fsdp_conformance.models.hf.default_inputs`: ``input_ids`` below
    ``vocab_size``, plus ``decoder_input_ids`` for an encoder-decoder), a mapping that
    :func:`call_model` passes as keyword arguments. Any other model gets one tensor whose kind
    follows its first ``nn.Embedding`` or ``nn.Linear`` in registration order (wrappers are
    looked through): an embedding takes token ids below its ``num_embeddings``, a linear takes
    features of its ``in_features``. A model that starts otherwise (convolutions, several
    inputs) needs an input builder (``--fsdp-input``).
    """
    g = torch.Generator().manual_seed(seed)
    inner = _inside_fsdp1(model)
    if hf.is_pretrained(inner):
        _require_token_ids(inner)
        return hf.default_inputs(inner, batch_size, seq_len, device, g)
    first = _first_input_module(model)
    if isinstance(first, nn.Embedding):
        shape: tuple[int, ...] = (batch_size, seq_len)
        return torch.randint(0, first.num_embeddings, shape, generator=g).to(device)
    return torch.randn(batch_size, seq_len, first.in_features, generator=g).to(device)


def _require_token_ids(model: nn.Module) -> None:
    """A transformers model's default input is token ids: refuse one whose forward's main
    input is something else (ViT's ``pixel_values``, Whisper's ``input_features``) or whose
    config has no ``vocab_size``, naming the input its forward wants."""
    wants = str(getattr(model, "main_input_name", "input_ids") or "input_ids")
    has_vocab = isinstance(getattr(model.config, "vocab_size", None), int)
    if wants == "input_ids" and has_vocab:
        return
    why = "" if has_vocab else f" ({type(model.config).__name__} has no vocab_size)"
    raise NoDefaultBatch(
        f"cannot make a default batch for {type(model).__name__}: the default input is token "
        f"ids below config.vocab_size, and its forward's main input is {wants}{why}",
        wants,
    )


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
    raise NoDefaultBatch(
        f"cannot build a default batch for {type(model).__name__}: it has no nn.Embedding or "
        "nn.Linear"
    )


# --------------------------------------------------------------------------------------------
# What a model provides for meta init: a model-level init_weights(), per-module
# reset_parameters()
# --------------------------------------------------------------------------------------------


def root_init_weights(model: nn.Module) -> Callable[..., Any] | None:
    """The root's ``init_weights`` when it is a model-level init: a method callable with no
    argument or with ``buffer_device=`` only (torchtitan's ``init_weights(self,
    buffer_device=None)``); None otherwise (absent, or needing arguments)."""
    method = getattr(type(model), "init_weights", None)
    if not callable(method):
        return None
    # getattr: nn.Module.__getattr__ types an attribute as a Tensor or a Module, not a method
    bound = getattr(model, "init_weights")  # noqa: B009
    try:
        signature = inspect.signature(bound)
    except (TypeError, ValueError):
        return None
    required = [
        p
        for p in signature.parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    return None if required else cast("Callable[..., Any]", bound)


def without_reset_parameters(model: nn.Module) -> list[str]:
    """``fqn (Class)`` of every module that owns state but has no ``reset_parameters()``."""
    return sorted(
        {
            f"{fqn or '(root)'} ({type(m).__name__})"
            for fqn, m in model.named_modules()
            if _owns_state(m) and not callable(getattr(m, "reset_parameters", None))
        }
    )


def _owns_state(module: nn.Module) -> bool:
    return any(t is not None for t in (*module._parameters.values(), *module._buffers.values()))


# --------------------------------------------------------------------------------------------
# ModelSpec: a picklable description of "which model", sent to the ranks
# --------------------------------------------------------------------------------------------


class ModelSpecError(ValueError):
    """The model specification cannot be used; the message names the problem and the fix."""


class NoDefaultBatch(ModelSpecError):
    """No default batch fits the model: ``problem`` says why, ``wants`` names the input its
    forward takes (None when unknown); the message adds the fix, an input builder."""

    def __init__(self, problem: str, wants: str | None = None) -> None:
        super().__init__(f"{problem}; {builder_fix('--fsdp-input', *([wants] if wants else []))}")
        self.problem = problem
        self.wants = wants


def builder_fix(flag: str, *wants: str) -> str:
    """The fix for a model the default batch does not fit, ``flag`` the input flag as the front
    end in use spells it; ``wants``: the inputs to name in the example."""
    named = ", ".join(f"{name!r}: ..." for name in wants)
    example = f", returning e.g. {{{named}}}" if wants else ""
    return (
        f"pass an input builder ({flag} pkg.module:builder, called as builder(model, "
        f"batch_size, device){example}; a mapping it returns is passed as keyword arguments)"
    )


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
        raise ModelSpecError(
            f"{what} {path!r} is not callable ({type(obj).__name__}); "
            "name a function or class after the colon"
        )
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
    #: ``pkg.module:fn`` initializing the whole model after ``to_empty``, called as
    #: ``fn(model)`` (None: the root's own ``init_weights()`` when it has one; see
    #: ``meta_init.init_contract``).
    model_init: str | None = None

    def __post_init__(self) -> None:
        if (self.reference is None) == (self.factory is None):
            raise ModelSpecError("ModelSpec needs exactly one of reference= or factory=")
        if self.depth is not None and (self.reference is not None or self.depth < 1):
            raise ModelSpecError(
                f"ModelSpec.depth is for a factory and must be >= 1, got {self.depth} "
                f"({self.name}); set a reference model's depth in its config"
            )
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
        if not isinstance(model, nn.Module) or hf.config_depth(model) is None:
            raise ModelSpecError(
                f"cannot build {self.factory!r} at {depth} layers: " + NO_SETTABLE_DEPTH
            )
        # The factory built its model; what follows is the suite's own step: its failure is
        # never the factory's (Gemma-2's per-layer layer_types once raised an IndexError here,
        # reported as "fix the factory").
        try:
            return hf.rebuild_with_depth(model, depth)
        except Exception as exc:
            raise ModelSpecError(
                f"the suite could not rebuild {self.factory!r}'s {type(model).__name__} at "
                f"{depth} layers from a copy of its config (the factory itself built the model "
                f"fine): {type(exc).__name__}: {exc}; give the factory a depth keyword ("
                + ", ".join(f"{k}=" for k in DEPTH_KEYWORDS)
                + ") so that it builds the model at a given depth itself"
            ) from exc

    def depth_setting(self) -> str | None:
        """How this model's depth is set, in words for a report, or None when it cannot be.

        A reference model: its config's ``num_layers``. A factory: its own depth keyword
        (:data:`DEPTH_KEYWORDS`, preferred: the factory stays in charge of the model), else
        ``config.num_hidden_layers`` of the transformers model it returns (rebuilt from a copy
        of that config). A factory taking only ``**kwargs`` is not guessed at: nothing says
        which name it reads, or that it reads one.
        """
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
        """The block classes, resolved against the built model (clear error if absent):
        :func:`fsdp_conformance.models.block_classes.block_classes_of`."""
        return block_classes_of(
            model, given=self.block_cls, reference=self.reference, name=self.name
        )

    def size_threshold(self, model: nn.Module) -> int:
        """The size-policy threshold: explicit, else scaled from the model's width."""
        if self.min_params is not None:
            return self.min_params
        config = getattr(model, "config", None)
        if isinstance(config, (ModelConfig, LlamaConfig)):
            return config.min_params
        return scaled_min_params(infer_width(model))

    def batch(
        self,
        model: nn.Module,
        batch_size: int = 2,
        device: str | torch.device = "cpu",
        seq_len: int = 8,
    ) -> Any:
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
        """The auto-wrap policy ``name`` (:func:`fsdp_conformance.models.policies.policy`) for this
        model, with the spec's block classes and size threshold.

        ``full_scale``: the model is at the seeds' own scale, so ``seeds`` keeps the seeds'
        literal threshold (2e7) unless the spec sets one; on a scaled-down model the threshold
        is scaled with dim**2, as the rest of the suite does.
        """
        if name in policies.BLOCKLESS:
            # Neither needs the spec's block classes, which a factory model may not name.
            return policies.policy(name, self.model, (), 0)
        blocks = self.blocks
        if name == "seeds" and full_scale and self.spec.min_params is None:
            return policies.policy(name, self.model, blocks, SEED_MIN_PARAMS)
        return policies.policy(name, self.model, blocks, self.size_threshold)

    def batch(
        self, batch_size: int = 2, device: str | torch.device = "cpu", seq_len: int = 8
    ) -> Any:
        """An input batch for this model (``ModelSpec.batch``)."""
        return self.spec.batch(self.model, batch_size=batch_size, device=device, seq_len=seq_len)
