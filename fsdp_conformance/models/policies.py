"""Wrap policies: the seeds' hybrid policy as written, and the project's recommended one.

Both are built on torch's own builders (``transformer_auto_wrap_policy``,
``size_based_auto_wrap_policy``, ``_or_policy``), so a change in torch shows up here.

:func:`policy` is the one registry every claim and the planner resolve a policy name with
(:data:`PolicyName`, one vocabulary): the planner's ``--policy`` names (:data:`PLAN_POLICIES`)
are some of its names, and memory's wrappings (:data:`WRAPPINGS`) are a policy of it plus the
reshard choice. Block classes are resolved in :mod:`fsdp_conformance.models.block_classes`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, get_args

import torch.nn as nn
from torch.distributed.fsdp import wrap as torch_wrap
from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy, transformer_auto_wrap_policy

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

    The size rule is torch's function as torch's module holds it when the policy is built (not
    a name bound at import), so the threshold is applied exactly as torch applies it:
    ``nonwrapped_numel >= min_params`` (``wrap.builders.size_boundary`` checks the boundary).
    """
    blocks = tuple(block_classes)
    if not blocks:
        raise PolicyError("recommended_policy needs at least one block class")
    inside_blocks = _modules_inside(model, blocks)
    splits_ties = _modules_splitting_shared_params(model)
    type_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=set(blocks))
    size_rule = functools.partial(torch_wrap.size_based_auto_wrap_policy, min_num_params=min_params)

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
# The registry: every policy by name
# --------------------------------------------------------------------------------------------

PolicyName = Literal[
    "recommended", "seeds", "seeds_verbatim", "blocks_only", "monolithic", "top_level"
]
POLICY_NAMES: tuple[PolicyName, ...] = get_args(PolicyName)
#: The policies that need neither the block classes nor the size threshold (a factory model
#: may name no block class, and these still apply to it).
BLOCKLESS: tuple[PolicyName, ...] = ("monolithic", "top_level")


def _monolithic(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    return False  # neither descend nor wrap: the root is the only unit


def _top_level(model: nn.Module) -> Policy:
    # The seeds' "wrapping only the top-level modules": the root's direct children become
    # units, nothing below them. Containers (ModuleList/Dict) never run a forward of their
    # own, so FSDP cannot gather for them: their blocks stay in the root, as they would.
    top = {id(c) for c in model.children() if not isinstance(c, (nn.ModuleList, nn.ModuleDict))}
    return functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in top)


def policy(
    name: PolicyName, model: nn.Module, blocks: Sequence[type[nn.Module]], min_params: int
) -> Policy:
    """The auto-wrap policy ``name`` (one of :data:`POLICY_NAMES`) for ``model``.

    ``blocks`` and ``min_params`` are used by the names that need them (those of
    :data:`BLOCKLESS` ignore both). An unknown name raises :class:`PolicyError` listing the
    names. A check reaches it through ``BuiltModel.policy``
    (:mod:`fsdp_conformance.models.model_spec`), which takes the block classes and the threshold
    from the model's spec.
    """
    blocks = tuple(blocks)
    if name == "recommended":
        return recommended_policy(model, blocks, min_params)
    if name == "seeds":  # the seeds' logic with the threshold scaled to the model
        return seeds_hybrid_policy(blocks, min_params)
    if name == "seeds_verbatim":  # the seeds' code exactly, 2e7 and one block class
        if len(blocks) != 1:
            raise PolicyError("the seeds' get_hybrid_policy takes exactly one block class")
        return get_hybrid_policy(blocks[0])
    if name == "blocks_only":  # misses oversized modules outside the blocks
        return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=set(blocks))
    if name == "monolithic":
        return _monolithic
    if name == "top_level":
        return _top_level(model)
    raise PolicyError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


#: The planner's ``--policy`` names (user-visible, and keys of its output): registry names.
PLAN_POLICIES: tuple[PolicyName, ...] = ("recommended", "seeds", "monolithic")

# Memory's wrappings: a policy of the registry plus whether FSDP reshards parameters after the
# forward. Keyed by the policy's name where that is all a wrapping is; ``per_layer`` (the
# recommended policy) keeps the word memory's reports, plots and check messages have always
# shown, and ``no_reshard`` is the recommended policy without resharding.
WrappingName = Literal["per_layer", "monolithic", "top_level", "no_reshard"]


@dataclasses.dataclass(frozen=True)
class Wrapping:
    """A wrapping resolved: the policy and the reshard-after-forward choice."""

    policy: PolicyName
    #: False: FSDP1 ``SHARD_GRAD_OP``, FSDP2 ``reshard_after_forward=False`` (see
    #: :func:`fsdp_conformance.fsdp.sharding.reshard_kwargs`).
    reshard_after_forward: bool = True


#: ``per_layer`` is the recommended policy (one unit per block); the others are the seeds'
#: naive cases and a broken per-layer variant (negative controls).
WRAPPINGS: Mapping[WrappingName, Wrapping] = {
    "per_layer": Wrapping("recommended"),
    "monolithic": Wrapping("monolithic"),
    "top_level": Wrapping("top_level"),
    "no_reshard": Wrapping("recommended", reshard_after_forward=False),
}


def wrapping(label: str) -> Wrapping:
    """The :class:`Wrapping` of a label of :data:`WRAPPINGS`; unknown: :class:`PolicyError`."""
    found: Wrapping | None = WRAPPINGS.get(label)  # type: ignore[call-overload]
    if found is None:
        raise PolicyError(f"unknown wrapping {label!r}; choose one of {', '.join(WRAPPINGS)}")
    return found


def wrapping_label(name: PolicyName) -> WrappingName | None:
    """The wrapping label that measures policy ``name`` as planned (resharding), if any."""
    for label, w in WRAPPINGS.items():
        if w.policy == name and w.reshard_after_forward:
            return label
    return None


# --------------------------------------------------------------------------------------------
# Plan validation: a policy that wraps nothing but the root is an error, never a silent pass
# --------------------------------------------------------------------------------------------


def validate_plan(
    model: nn.Module,
    policy: Any,
    *,
    what: str = "the wrap policy",
    detail: str = "",
    flag: str = "--fsdp-block-cls",
) -> list[Any]:
    """The plan of ``policy`` on ``model`` (see :func:`~fsdp_conformance.models.units.plan_units`).

    Raises :class:`PolicyError` when the policy wraps nothing but the root: FSDP would then
    all-gather every parameter at once (the "monolithic" case the seeds warn about), and any
    check that only looks for "some FSDP wrapper" would pass. The message lists the model's
    module classes with their instance counts and sizes, so the right block class is visible;
    ``detail`` adds the caller's context (e.g. the block classes and threshold it was given).
    """
    from fsdp_conformance.models.units import plan_units

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
        f"would be gathered at once. Fix: name the model's block class (e.g. {flag}) "
        f"or lower the size threshold; its module classes are: {listing or '(none)'}"
        + (f" ({detail})" if detail else "")
    )
