"""What the suite reads from a transformers model, without importing transformers for others.

A model is a transformers model when an instance of ``transformers.PreTrainedModel``; the check
never imports transformers itself: a model of that library can only exist once the library is
imported, so ``sys.modules`` says whether to look.
"""

from __future__ import annotations

import sys
from typing import Any

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
