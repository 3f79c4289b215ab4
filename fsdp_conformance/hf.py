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
