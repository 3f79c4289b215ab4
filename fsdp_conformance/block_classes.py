"""Block classes: which module classes of a model are its transformer blocks.

One resolution for every model a check builds (``ModelSpec.block_classes`` calls
:func:`block_classes_of`): the classes the user named (``--block-cls``: classes, dotted
import paths or class names found in the model), else a reference model's own, else a
transformers model's ``_no_split_modules``. Each failure is one :class:`PolicyError` that lists
the model's module classes, so the right block class is visible.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch.nn as nn

from fsdp_conformance import hf
from fsdp_conformance.policies import PolicyError
from fsdp_conformance.reference_models import REFERENCE_MODELS


def block_classes_of(
    model: nn.Module, *, given: Sequence[str] | None, reference: str | None, name: str
) -> tuple[type[nn.Module], ...]:
    """The block classes of ``model``: ``given`` resolved against it, else the reference
    model's, else a transformers model's ``_no_split_modules``; ``name`` is the model's name
    in the messages."""
    if given:
        return resolve_block_classes(model, list(given))
    if reference is not None:
        return REFERENCE_MODELS[reference].block_classes
    if hf.is_pretrained(model):
        return no_split_block_classes(model, name)
    raise PolicyError(
        f"no block class given for {name!r}: pass --fsdp-block-cls with the class of "
        "its transformer block (a class name found in the model or a dotted path)"
    )


# --------------------------------------------------------------------------------------------
# Given as classes, dotted import paths or class names found in the model
# --------------------------------------------------------------------------------------------


def module_classes(model: nn.Module) -> list[str]:
    """The model's module classes, qualified, in first-seen order."""
    seen: dict[str, None] = {}
    for module in model.modules():
        seen.setdefault(_qualname(type(module)), None)
    return list(seen)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def resolve_block_classes(
    model: nn.Module, spec: type[nn.Module] | str | Sequence[type[nn.Module] | str]
) -> tuple[type[nn.Module], ...]:
    """Resolve block classes given as classes, dotted paths or names; each must be in the model."""
    items = [spec] if isinstance(spec, (str, type)) else list(spec)
    if not items:
        raise PolicyError("no block class given: name the transformer block class of the model")
    present = {type(m) for m in model.modules()}
    resolved: list[type[nn.Module]] = []
    for item in items:
        cls = _resolve_one(model, item, present)
        if cls not in present:
            raise PolicyError(
                f"block class {_qualname(cls)} is not in the model {type(model).__name__}; "
                f"its module classes are: {', '.join(module_classes(model))}"
            )
        resolved.append(cls)
    return tuple(dict.fromkeys(resolved))


def _resolve_one(model: nn.Module, item: Any, present: set[type]) -> type[nn.Module]:
    if isinstance(item, type):
        if not issubclass(item, nn.Module):
            raise PolicyError(f"block class {item!r} is not an nn.Module subclass")
        return item
    if not isinstance(item, str) or not item.strip():
        raise PolicyError(f"block class must be a class, a dotted path or a name, got {item!r}")
    name = item.strip()
    by_name = [c for c in present if c.__name__ == name or _qualname(c) == name]
    if len(by_name) == 1:
        return by_name[0]
    if len(by_name) > 1:
        raise PolicyError(
            f"block class name {name!r} is ambiguous in the model: "
            f"{', '.join(sorted(_qualname(c) for c in by_name))}; give the dotted path"
        )
    if "." in name or ":" in name:
        return _import_class(name)
    raise PolicyError(
        f"block class {name!r} matches no module class in the model {type(model).__name__}; "
        f"its module classes are: {', '.join(module_classes(model))}"
    )


def _import_class(name: str) -> type[nn.Module]:
    module_path, _, attr = name.replace(":", ".").rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_path), attr)
    except ImportError as exc:
        raise PolicyError(
            f"cannot import block class {name!r}: {exc}; check the module path"
        ) from None
    except AttributeError:
        raise PolicyError(
            f"module {module_path!r} has no attribute {attr!r} (block class {name!r})"
        ) from None
    if not isinstance(obj, type) or not issubclass(obj, nn.Module):
        raise PolicyError(f"{name!r} is not an nn.Module class")
    return obj


# --------------------------------------------------------------------------------------------
# A transformers model's own: _no_split_modules
# --------------------------------------------------------------------------------------------


def no_split_modules(model: nn.Module) -> list[str]:
    """The class names transformers never splits across devices: the model's blocks.

    ``PreTrainedModel._no_split_modules`` (gathered from the submodels in ``post_init``), the
    same list accelerate's FSDP plugin wraps when it is not told a layer class. Sorted, so
    every rank and every run resolves them in the same order; empty when the model names none.
    """
    names = getattr(model, "_no_split_modules", None) or ()
    return sorted({str(n) for n in names})


def no_split_block_classes(model: nn.Module, name: str) -> tuple[type[nn.Module], ...]:
    """A transformers model's blocks: its ``_no_split_modules`` classes found in the model.

    As accelerate's FSDP plugin does when no layer class is given; a listed name the model does
    not contain (``_no_split_modules`` is gathered over a model family's submodels) is skipped
    as long as one is found.
    """
    names = no_split_modules(model)
    found = dict.fromkeys(type(m) for m in model.modules() if type(m).__name__ in names)
    if found:
        return tuple(found)
    listed = ", ".join(names) if names else "no class"
    raise PolicyError(
        f"no block class given for {name!r}, and its transformers model "
        f"{type(model).__name__} lists {listed} in _no_split_modules"
        + (", none of which is in the model" if names else "")
        + "; pass --fsdp-block-cls with the class of its transformer block (one of: "
        + ", ".join(module_classes(model))
        + ")"
    )
