"""Wrap policies: the seeds' hybrid policy as written, and the project's recommended one.

Both are built on torch's own builders (``transformer_auto_wrap_policy``,
``size_based_auto_wrap_policy``, ``_or_policy``), so a change in torch shows up here.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch.nn as nn
from torch.distributed.fsdp.wrap import (
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from fsdp_conformance import _compat

Policy = Callable[..., bool]

#: The seeds' size threshold: "Apply sharding if the module alone exceeds 20 million parameters".
SEED_MIN_PARAMS = 2 * 10**7


class PolicyError(ValueError):
    """A policy or block-class specification that cannot work; the message says the fix."""


# --------------------------------------------------------------------------------------------
# The seeds' policy, verbatim (kept as a named reference: the suite shows what it produces)
# --------------------------------------------------------------------------------------------


def custom_size_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    # Apply sharding if the module alone exceeds 20 million parameters
    # This catches large ad-hoc layers outside standard blocks
    return nonwrapped_numel >= 2 * 10**7


def get_hybrid_policy(transformer_layer_cls: type[nn.Module]) -> Policy:
    """The seeds' ``get_hybrid_policy``, verbatim: type policy OR the 2e7 size lambda."""
    type_policy = functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={transformer_layer_cls}
    )
    size_policy = functools.partial(custom_size_policy)
    return functools.partial(_compat.or_policy(), policies=[type_policy, size_policy])


def seeds_hybrid_policy(
    block_classes: Iterable[type[nn.Module]], min_params: int = SEED_MIN_PARAMS
) -> Policy:
    """The seeds' policy with its threshold scaled for a smaller model (same logic otherwise).

    Its size rule ignores ``recurse`` and applies *inside* the blocks too, so large linears
    inside a block become units of their own, nested in the block's unit.
    """

    def size_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return nonwrapped_numel >= min_params

    type_policy = functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls=set(block_classes)
    )
    return functools.partial(_compat.or_policy(), policies=[type_policy, size_policy])


# --------------------------------------------------------------------------------------------
# The recommended policy
# --------------------------------------------------------------------------------------------


def recommended_policy(
    model: nn.Module,
    block_classes: Iterable[type[nn.Module]],
    min_params: int,
) -> Policy:
    """One unit per block; the size rule only outside the blocks; tied weights never split.

    ``transformer_auto_wrap_policy`` makes each block a unit. Outside the blocks, torch's
    ``size_based_auto_wrap_policy`` decides by the parameters not yet wrapped, except that a
    module is never wrapped on its own when it shares a parameter with a module outside its own
    subtree (the shared weight then stays in the enclosing unit, so it is never split).
    """
    blocks = tuple(block_classes)
    if not blocks:
        raise PolicyError("recommended_policy needs at least one block class")
    inside_blocks = _modules_inside(model, blocks)
    splits_ties = _modules_splitting_shared_params(model)
    type_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=set(blocks))
    size_rule = functools.partial(size_based_auto_wrap_policy, min_num_params=min_params)

    def size_outside_blocks(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if recurse:
            return True  # keep descending: blocks and large modules may sit anywhere below
        if id(module) in inside_blocks or id(module) in splits_ties:
            return False
        return size_rule(module=module, recurse=False, nonwrapped_numel=nonwrapped_numel)

    return functools.partial(_compat.or_policy(), policies=[type_policy, size_outside_blocks])


def _modules_inside(model: nn.Module, blocks: tuple[type[nn.Module], ...]) -> set[int]:
    """ids of modules strictly inside a block (the block itself excluded)."""
    inside: set[int] = set()
    for module in model.modules():
        if isinstance(module, blocks):
            inside.update(id(m) for m in module.modules() if m is not module)
    return inside


def _modules_splitting_shared_params(model: nn.Module) -> set[int]:
    """ids of modules that share a parameter with a module outside their own subtree."""
    holders: dict[int, set[int]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(id(module))
    shared = {pid: mods for pid, mods in holders.items() if len(mods) > 1}
    if not shared:
        return set()
    splitting: set[int] = set()
    for module in model.modules():
        subtree = {id(m) for m in module.modules()}
        for p in module.parameters():
            if id(p) in shared and not shared[id(p)] <= subtree:
                splitting.add(id(module))
                break
    return splitting


def shared_parameter_groups(model: nn.Module) -> list[list[str]]:
    """Groups of parameter FQNs that are one tensor (tied weights), each group sorted."""
    names: dict[int, list[str]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            fqn = f"{module_name}.{pname}" if module_name else pname
            if fqn not in names.setdefault(id(p), []):
                names[id(p)].append(fqn)
    return sorted(sorted(g) for g in names.values() if len(g) > 1)


# --------------------------------------------------------------------------------------------
# Block classes: given as classes, dotted import paths or class names found in the model
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
    raise PolicyError(
        f"block class {name!r} matches no module class in the model {type(model).__name__}; "
        f"its module classes are: {', '.join(module_classes(model))}"
    )


# --------------------------------------------------------------------------------------------
# Plan validation: a policy that wraps nothing but the root is an error, never a silent pass
# --------------------------------------------------------------------------------------------


def validate_plan(
    model: nn.Module, policy: Any, *, what: str = "the wrap policy", detail: str = ""
) -> list[Any]:
    """The plan of ``policy`` on ``model`` (see :func:`~fsdp_conformance.units.plan_units`).

    Raises :class:`PolicyError` when the policy wraps nothing but the root: FSDP would then
    all-gather every parameter at once (the "monolithic" case the seeds warn about), and any
    check that only looks for "some FSDP wrapper" would pass. The message lists the model's
    module classes with their instance counts and sizes, so the right block class is visible;
    ``detail`` adds the caller's context (e.g. the block classes and threshold it was given).
    """
    from fsdp_conformance.units import plan_units

    units = plan_units(model, policy)
    if len(units) > 1:
        return units
    counts: dict[str, list[int]] = {}
    for module in model.modules():
        if module is model:
            continue
        entry = counts.setdefault(type(module).__name__, [0, 0])
        entry[0] += 1
        entry[1] = max(entry[1], sum(p.numel() for p in module.parameters()))
    listing = ", ".join(
        f"{name} (x{n}, up to {size:,} params)" for name, (n, size) in counts.items()
    )
    total = sum(p.numel() for p in model.parameters())
    raise PolicyError(
        f"{what} wraps nothing but the root of {type(model).__name__}: all {total:,} parameters "
        "would be gathered at once. Fix: name the model's block class (e.g. --fsdp-block-cls) "
        f"or lower the size threshold; its module classes are: {listing or '(none)'}"
        + (f" ({detail})" if detail else "")
    )
