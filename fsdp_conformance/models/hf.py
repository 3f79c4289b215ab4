"""What the suite reads from a transformers model, without importing transformers for others.

A model is a transformers model when an instance of ``transformers.PreTrainedModel``; the check
never imports transformers itself: a model of that library can only exist once the library is
imported, so ``sys.modules`` says whether to look.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn


def pretrained_model_cls() -> type[Any] | None:
    """``transformers.PreTrainedModel`` when transformers is loaded, else None."""
    module = sys.modules.get("transformers")
    if module is None:
        return None
    try:
        cls: type[Any] = module.PreTrainedModel
    except AttributeError:  # a partially imported or foreign module of that name
        return None
    return cls


def is_pretrained(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel``."""
    cls = pretrained_model_cls()
    return cls is not None and isinstance(model, cls)


# --------------------------------------------------------------------------------------------
# Default inputs and depth, read from the model's config
# --------------------------------------------------------------------------------------------


def default_inputs(
    model: nn.Module,
    batch_size: int,
    seq_len: int,
    device: str | torch.device,
    generator: torch.Generator,
) -> dict[str, Any]:
    """Keyword inputs from the config: ``input_ids`` below ``vocab_size``, shape (batch, seq).

    An encoder-decoder (``config.is_encoder_decoder``) also gets ``decoder_input_ids`` (its
    forward refuses to run without them when no labels are given). The sequence is cut to
    ``max_position_embeddings`` where the config has one smaller than ``seq_len``.
    """
    config: Any = model.config
    vocab = int(config.vocab_size)
    limit = getattr(config, "max_position_embeddings", None)
    seq = min(seq_len, int(limit)) if isinstance(limit, int) and limit > 0 else seq_len

    def ids() -> torch.Tensor:
        return torch.randint(0, vocab, (batch_size, seq), generator=generator).to(device)

    inputs = {"input_ids": ids()}
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids()
    return inputs


def config_depth(model: nn.Module) -> int | None:
    """``config.num_hidden_layers`` of a transformers model (any spelling the config maps to it:
    GPT-2's ``n_layer`` is read through the config's ``attribute_map``), else None."""
    if not is_pretrained(model):
        return None
    config: Any = model.config
    depth = getattr(config, "num_hidden_layers", None)
    return depth if isinstance(depth, int) and not isinstance(depth, bool) else None


class DepthRebuildError(ValueError):
    """The suite's own rebuild of a transformers model at another depth cannot be made (a
    per-layer config field it cannot extend): the model's factory is not at fault."""


def per_layer_fields(config: Any, depth: int) -> list[str]:
    """The config fields that hold one entry per layer at ``depth`` layers: lists or tuples of
    that length whose name says they are about layers (Gemma-2's ``layer_types``, SmolLM3's
    ``no_rope_layers``). A length alone would also match an ``eos_token_id`` list of three at
    depth three."""
    return sorted(
        k
        for k, v in vars(config).items()
        if isinstance(v, (list, tuple)) and len(v) == depth and "layer" in k.lower()
    )


def _regenerated(config: Any, field: str, depth: int) -> Any:
    """What the config class itself makes of ``field`` left unset at ``depth`` layers, or None
    when it makes nothing (or refuses)."""
    try:
        fresh = type(config).from_dict({**config.to_dict(), field: None})
        fresh.num_hidden_layers = depth
        again = type(config).from_dict({**fresh.to_dict(), field: None})
    except Exception:  # noqa: BLE001 - a config class that needs the field: no default to use
        return None
    return getattr(again, field, None)


def _at_depth(config: Any, field: str, old: int, depth: int) -> list[Any]:
    """``field``'s per-layer list at ``depth`` layers: the config's own default for it when the
    present value is that default at ``old`` layers; else the value's repeating pattern, when
    ``depth`` continues it (fewer layers: the first ``depth`` entries); else
    :class:`DepthRebuildError`."""
    value = list(getattr(config, field))
    default_old = _regenerated(config, field, old)
    if default_old is not None and list(default_old) == value:
        default_new = _regenerated(config, field, depth)
        if default_new is not None and len(default_new) == depth:
            return list(default_new)
    period = next(p for p in range(1, old + 1) if value == (value[:p] * old)[:old])
    if depth > old and depth % period and period == old:
        raise DepthRebuildError(
            f"config.{field} has one entry per layer ({old}: {value}) with no repeating pattern "
            f"that {depth} layers continue"
        )
    return (value[:period] * (depth // period + 1))[:depth]


def rebuild_with_depth(model: nn.Module, depth: int) -> nn.Module:
    """The same transformers model class, built from a copy of its config at ``depth`` layers.

    Only the config carries over: what a factory did to the model after building it (tying,
    freezing) is not repeated, which is why a factory's own depth keyword is preferred. Fields
    with one entry per layer (:func:`per_layer_fields`) are rebuilt at the new depth
    (:func:`_at_depth`): Gemma-2's ``layer_types`` kept at 4 entries for 8 layers made its
    model raise an ``IndexError``. Raises :class:`DepthRebuildError` when a field cannot be.
    """
    import copy

    config: Any = copy.deepcopy(model.config)
    old = int(config.num_hidden_layers)
    fields = {f: _at_depth(config, f, old, depth) for f in per_layer_fields(config, old)}
    config.num_hidden_layers = depth
    for field, value in fields.items():
        setattr(config, field, value)
    rebuilt: nn.Module = type(model)(config)
    return rebuilt


# --------------------------------------------------------------------------------------------
# transformers' own per-module init
# --------------------------------------------------------------------------------------------


def init_weights_fns(model: nn.Module) -> dict[str, Any]:
    """FQN -> the ``_init_weights`` transformers applies to that module of ``model``.

    That of the module's nearest ``PreTrainedModel`` (itself included), as transformers'
    ``initialize_weights`` dispatches when it walks a composite model (``smart_apply``): a
    sub-model initializes its own subtree with its own ``_init_weights``. Empty when ``model``
    is not a ``PreTrainedModel``.
    """
    cls = pretrained_model_cls()
    if cls is None or not isinstance(model, cls):
        return {}
    fns: dict[str, Any] = {}
    for fqn, module in model.named_modules():
        if isinstance(module, cls):
            fns[fqn] = module._init_weights
        else:
            fns[fqn] = fns[fqn.rpartition(".")[0]]  # named_modules yields parents first
    return fns
