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

from fsdp_conformance.models import hf
from fsdp_conformance.models.catalog import REFERENCE_MODELS
from fsdp_conformance.models.policies import PolicyError, shared_parameter_groups


def block_classes_of(
    model: nn.Module,
    *,
    given: Sequence[str] | None,
    reference: str | None,
    name: str,
    flag: str = "--fsdp-block-cls",
) -> tuple[type[nn.Module], ...]:
    """The block classes of ``model``: ``given`` resolved against it, else the reference
    model's, else a transformers model's ``_no_split_modules``; ``name`` is the model's name
    in the messages, ``flag`` the block-class flag as the front end in use spells it."""
    if given:
        return resolve_block_classes(model, list(given))
    if reference is not None:
        return REFERENCE_MODELS[reference].block_classes
    if hf.is_pretrained(model):
        return no_split_block_classes(model, name, flag)
    raise PolicyError(no_block_class(model, name, flag))


def no_block_class(model: nn.Module, name: str, flag: str) -> str:
    """The message for a model given no block class: the flag, and the classes it repeats."""
    found = candidate_blocks(model)
    listed = ", ".join(found) if found else "none (no module class with children repeats)"
    return (
        f"no block class given for {name!r}: pass {flag} with the class of its transformer "
        f"block (a class name found in the model or a dotted path); candidates, the module "
        f"classes it repeats: {listed}"
    )


#: Containers that hold the blocks rather than being one.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def candidate_blocks(model: nn.Module, limit: int = 6) -> list[str]:
    """``Class (xN, P params)`` of the module classes ``model`` repeats that hold submodules
    (a block is a repeated composite module): the model's own classes first, then by count."""
    counts: dict[type[nn.Module], list[int]] = {}
    for module in model.modules():
        if module is model or isinstance(module, _CONTAINERS) or not any(module.children()):
            continue
        entry = counts.setdefault(type(module), [0, 0])
        entry[0] += 1
        entry[1] = max(entry[1], sum(p.numel() for p in module.parameters()))
    repeated = [(cls, n, size) for cls, (n, size) in counts.items() if n >= 2 and size]
    repeated.sort(key=lambda c: (c[0].__module__.startswith("torch."), -c[1]))
    return [f"{cls.__name__} (x{n}, up to {size:,} params)" for cls, n, size in repeated[:limit]]


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


def _listed_classes(model: nn.Module, names: Sequence[str]) -> tuple[type[nn.Module], ...]:
    """The model's module classes named in ``names``, in first-seen order."""
    return tuple(dict.fromkeys(type(m) for m in model.modules() if type(m).__name__ in names))


def no_split_block_classes(
    model: nn.Module, name: str, flag: str = "--fsdp-block-cls"
) -> tuple[type[nn.Module], ...]:
    """A transformers model's blocks: its ``_no_split_modules`` classes found in the model.

    As accelerate's FSDP plugin does when no layer class is given; a listed name the model does
    not contain (``_no_split_modules`` is gathered over a model family's submodels) is skipped
    as long as one is found. A listed class that would split a tied weight (:func:`split_ties`:
    BERT's ``BertEmbeddings``) is left out as long as another is left, and
    :func:`tie_safe_note` says so; when every listed class would, a :class:`PolicyError` names
    the ties.
    """
    names = no_split_modules(model)
    found = _listed_classes(model, names)
    if found:
        splits = split_ties(model, found)
        safe = tuple(cls for cls in found if cls not in splits)
        if safe:
            return outermost_classes(model, safe)
        raise PolicyError(
            f"no block class given for {name!r}, and every class its transformers model "
            f"{type(model).__name__} lists in _no_split_modules would split a tied weight ("
            + "; ".join(_split_words(cls, pair) for cls, pair in splits.items())
            + f"): FSDP cannot shard one tensor in two units; pass {flag} with the "
            "class of its transformer block, one that holds every alias of a tied weight or none"
        )
    listed = ", ".join(names) if names else "no class"
    raise PolicyError(
        f"no block class given for {name!r}, and its transformers model "
        f"{type(model).__name__} lists {listed} in _no_split_modules"
        + (", none of which is in the model" if names else "")
        + f"; pass {flag} with the class of its transformer block; candidates, the module "
        + "classes it repeats: "
        + (", ".join(candidate_blocks(model)) or "none (no module class with children repeats)")
    )


def outermost_classes(
    model: nn.Module, classes: Sequence[type[nn.Module]]
) -> tuple[type[nn.Module], ...]:
    """The classes of ``classes`` with an instance inside no instance of another of them.

    ``_no_split_modules`` says what must not be split across devices, and may name a block and
    a module inside it (Mamba: ``MambaBlock`` and its ``MambaMixer``): one unit per block keeps
    both whole, where wrapping every listed class nests a second unit inside each block (the
    block's own unit then holds only its norm). The blocks are the outermost listed classes;
    :func:`nested_note` says which were left out.
    """
    wanted = tuple(classes)
    outer: dict[type[nn.Module], None] = {}

    def walk(module: nn.Module, inside: bool) -> None:
        hit = isinstance(module, wanted)
        if hit and not inside:
            outer[type(module)] = None
        for child in module.children():
            walk(child, inside or hit)

    walk(model, False)
    return tuple(cls for cls in wanted if cls in outer) or wanted


def nested_note(model: nn.Module, flag: str = "--fsdp-block-cls") -> str | None:
    """One line naming the ``_no_split_modules`` classes left out of the blocks because every
    instance sits inside another listed class's (:func:`outermost_classes`); None when none."""
    listed = _listed_classes(model, no_split_modules(model))
    splits = split_ties(model, listed)
    safe = tuple(cls for cls in listed if cls not in splits)
    outer = outermost_classes(model, safe)
    inner = [cls.__name__ for cls in safe if cls not in outer]
    if not inner:
        return None
    return (
        f"{type(model).__name__}'s _no_split_modules lists {', '.join(inner)}, which sit"
        f"{'s' if len(inner) == 1 else ''} only inside {', '.join(c.__name__ for c in outer)}: "
        f"the blocks are the outermost, one unit each, which keeps both whole (pass {flag} to "
        "choose them yourself; wrapping every listed class nests a unit inside each block)"
    )


# --------------------------------------------------------------------------------------------
# Tied weights: block classes that would split one tensor between two FSDP units
# --------------------------------------------------------------------------------------------


def split_ties(
    model: nn.Module, classes: Sequence[type[nn.Module]]
) -> dict[type[nn.Module], tuple[str, str]]:
    """The block classes of ``classes`` that would split a tied weight, each with one pair
    (an alias inside one of its instances, an alias of the same tensor outside that instance).

    Each instance of a block class is an FSDP unit; a tensor with an alias inside the unit and
    one outside it would be in two units. On BERT's masked LM (``BertEmbeddings`` of its
    ``_no_split_modules`` holds the word embedding, tied to the decoder outside it) FSDP2
    refuses it ("shared with a parameter already managed by another FSDP group") and FSDP1's
    training step breaks (with ``--model`` alone: 10 failed, 18 errors). The groups are
    :func:`fsdp_conformance.models.policies.shared_parameter_groups`.
    """
    groups = shared_parameter_groups(model)
    if not groups:
        return {}
    wanted = tuple(classes)
    splits: dict[type[nn.Module], tuple[str, str]] = {}
    for prefix, module in model.named_modules():
        cls = type(module)
        if not prefix or not isinstance(module, wanted) or cls in splits:
            continue
        for group in groups:
            inside = [n for n in group if n.startswith(prefix + ".")]
            outside = [n for n in group if not n.startswith(prefix + ".")]
            if inside and outside:
                splits[cls] = (inside[0], outside[0])
                break
    return splits


def _split_words(cls: type[nn.Module], pair: tuple[str, str]) -> str:
    return f"{cls.__name__} holds {pair[0]}, the same tensor as {pair[1]} outside it"


def tie_safe_note(model: nn.Module, flag: str = "--fsdp-block-cls") -> str | None:
    """What the default block classes of a transformers model left out to keep its tied
    weights whole (:func:`no_split_block_classes`), in one line; None when nothing was.

    ``flag`` is the block-class flag as the front end in use spells it.
    """
    listed = _listed_classes(model, no_split_modules(model))
    splits = split_ties(model, listed)
    safe = [cls.__name__ for cls in listed if cls not in splits]
    if not splits or not safe:
        return None
    return (
        f"the default block classes of {type(model).__name__} (its _no_split_modules: "
        f"{', '.join(c.__name__ for c in listed)}) would split a tied weight: "
        + "; ".join(_split_words(cls, pair) for cls, pair in splits.items())
        + f"; FSDP cannot shard one tensor in two units, so the run goes on with "
        f"{flag} {','.join(safe)}, the classes that keep every tie whole (pass it to choose "
        "them yourself; wrapping _no_split_modules as it is, as accelerate's FSDP plugin "
        "does, splits the tie)"
    )
