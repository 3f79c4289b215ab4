"""``init.weights.faithful``: meta init gives the weights the model's own factory gives.

``init.weights`` proves that every rank holds the suite's single-process meta-init reference; this
check proves that the reference is the user's model. The model is built once as the user builds
it (the factory called on CPU after ``torch.manual_seed(seed)``) and a second time from
``seed + 1``, then compared, tensor by tensor, with
:func:`~fsdp_conformance.fsdp.meta_init.reference_model` (the same meta build, init contract and
seed as every sharded init of the suite). The two draw from different RNG orders by design (the meta
path seeds each module from ``(seed, FQN)`` so that the values do not depend on the world size),
so values are compared where the factory's output does not depend on the seed, and distributions
elsewhere (:func:`judge_tensor`, the stated test: docs/init.md).

A model whose ``__init__`` overwrites its modules' values (nanoGPT's ``_init_weights``: normal
0.02, zero biases) passes ``init.weights`` but not this check, which names the tensors, both
figures and the fix (``--init-fn`` or ``reset_parameters()`` on the class).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import torch
import torch.nn as nn

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.init.common import (
    DEFAULT_SPEC,
    FAULTS,
    Failure,
    agree_on_failure,
    describe_init_error,
    failed_on_ranks,
    preflight,
    preflight_failure,
)
from fsdp_conformance.fsdp.distributions import (
    TensorStats,
    flat_chunks,
    judge_tensor,
    tensor_stats,
)
from fsdp_conformance.fsdp.meta_init import (
    build_on_meta,
    canonical_state,
    factory_model,
    init_contract,
    owners,
    reference_model,
    state_bytes,
)
from fsdp_conformance.fsdp.tensors import listing
from fsdp_conformance.harness import RankContext, skip_rank
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.user_model import MEMORY_HEADROOM, _available_host_bytes

#: Tolerance for tensors the factory makes the same for every seed (computed buffers, ones).
RTOL, ATOL = 1e-5, 1e-7


class Mismatch(TypedDict):
    """One tensor whose meta init differs from the factory's."""

    name: str
    #: FQN of the module that initializes it (a tie's first holder), and that module's class.
    module: str
    cls: str
    #: Whether the class is torch's own (``torch.nn.Linear``): no reset_parameters() to edit.
    torch_class: bool
    #: What differs, in words with both figures.
    detail: str
    #: The same for seeds ``s`` and ``s + 1`` as built (else random as built).
    deterministic: bool
    built: TensorStats | None
    meta: TensorStats | None


class Comparison(TypedDict):
    """The meta-init reference against the factory's model (:func:`compare_with_factory`)."""

    #: Tensors compared: by value (the same for every seed as built), by distribution, and
    #: random tensors too small to judge (a single element): named, not judged.
    checked: int
    by_value: int
    by_distribution: int
    unjudged: list[str]
    mismatches: list[Mismatch]


class FaithfulReport(Failure, total=False):
    """One rank's comparison (or the preflight's finding), with the init contract it used."""

    contract: str
    comparison: Comparison


# --------------------------------------------------------------------------------------------
# The stated test, on plain numbers
# --------------------------------------------------------------------------------------------


def describe_values(t: torch.Tensor) -> str:
    """A seed-independent tensor in words: all zeros, all ones, a constant, or its moments."""
    if t.numel() and bool((t == 0).all()):
        return "all zeros"
    if t.numel() and bool((t == 1).all()):
        return "all ones"
    s = tensor_stats(t)
    if s["std"] == 0:
        return f"constant {s['mean']:.4g}"
    return f"mean {s['mean']:.4g}, std {s['std']:.4g}"


def compare_by_value(built: torch.Tensor, meta: torch.Tensor) -> str | None:
    """A tensor the factory makes the same for every seed: the meta init must give it too."""
    if built.is_floating_point() or built.is_complex():
        same = all(
            torch.allclose(m, b, rtol=RTOL, atol=ATOL)
            for m, b in zip(flat_chunks(meta), flat_chunks(built), strict=True)
        )
    else:
        same = torch.equal(meta.cpu(), built.cpu())
    if same:
        return None
    return (
        f"{describe_values(built)} as built (the same for every seed), "
        f"{describe_values(meta)} after meta init"
    )


# --------------------------------------------------------------------------------------------
# On a rank: the factory's model, twice, against the meta-init reference
# --------------------------------------------------------------------------------------------


def _owner_of(model: nn.Module) -> dict[str, tuple[str, type[nn.Module]]]:
    """Canonical tensor name -> (owning module FQN, its class)."""
    modules = dict(model.named_modules())
    owner = owners(model)
    out: dict[str, tuple[str, type[nn.Module]]] = {}
    for name, t in canonical_state(model).items():
        fqn = owner.get(id(t), name.rpartition(".")[0])
        out[name] = (fqn or "(root)", type(modules.get(fqn, model)))
    return out


def compare_with_factory(spec: ModelSpec, seed: int) -> Comparison:
    """The meta-init reference of ``spec`` against its factory's model, tensor by tensor.

    Holds at most two full models at once (the factory's first build with its second, then
    with the reference): 8 bytes per fp32 parameter, within the 16 the cpu lane plans for
    (``user_model.CPU_BYTES_PER_PARAM``).
    """
    first = canonical_state(factory_model(spec, seed))
    second: dict[str, TensorStats] = {}
    seed_free: set[str] = set()
    for name, t in canonical_state(factory_model(spec, seed + 1)).items():
        second[name] = tensor_stats(t)
        if name in first and _same(first[name], t):
            seed_free.add(name)
    reference = reference_model(spec, seed)
    where = _owner_of(reference)
    out: Comparison = {
        "checked": 0,
        "by_value": 0,
        "by_distribution": 0,
        "unjudged": [],
        "mismatches": [],
    }
    for name, meta in canonical_state(reference).items():
        module, cls = where[name]
        built = first.get(name)
        if built is None or built.shape != meta.shape or built.dtype != meta.dtype:
            was = "not in the factory's model" if built is None else _kind(built) + " as built"
            detail = f"{was}, {_kind(meta)} after meta init"
            out["mismatches"].append(_mismatch(name, module, cls, detail, None, meta))
            continue
        how, finding = judge_one(built, second.get(name), name in seed_free, meta)
        if how == "unjudged":
            out["unjudged"].append(name)
            continue
        out["by_value" if how == "value" else "by_distribution"] += 1
        if finding:
            out["mismatches"].append(
                _mismatch(name, module, cls, finding, built, meta, deterministic=name in seed_free)
            )
    out["checked"] = out["by_value"] + out["by_distribution"] + len(out["unjudged"])
    return out


def judge_one(
    built: torch.Tensor, second: TensorStats | None, seed_free: bool, meta: torch.Tensor
) -> tuple[str, str | None]:
    """How one tensor is compared (``value``, ``distribution``, ``unjudged``) and what differs.

    Seed-independent as built (``seed_free``: equal for seeds ``s`` and ``s + 1``): by value
    when constant (zeros, ones) or not floating; a non-constant floating one (a computed table
    such as ``inv_freq``, or the weights of a factory that seeds itself or loads a checkpoint)
    by value when equal, else by distribution (one factory draw). Random as built: by
    distribution (:func:`judge_tensor`), except a single element (unjudged).
    """
    if seed_free:
        finding = compare_by_value(built, meta)
        if finding is None or not built.is_floating_point():
            return "value", finding
        stats = tensor_stats(built)
        if stats["std"] == 0 or built.numel() < 2:
            return "value", finding
        differs = judge_tensor(stats, stats, tensor_stats(meta))
        return "distribution", differs and differs + " (the same for every seed as built)"
    if second is None or built.numel() < 2:
        return "unjudged", None
    return "distribution", judge_tensor(tensor_stats(built), second, tensor_stats(meta))


def _kind(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _mismatch(
    name: str,
    module: str,
    cls: type[nn.Module],
    detail: str,
    built: torch.Tensor | None,
    meta: torch.Tensor,
    *,
    deterministic: bool = True,
) -> Mismatch:
    return {
        "name": name,
        "module": module,
        "cls": cls.__name__,
        "torch_class": cls.__module__.startswith("torch."),
        "detail": detail,
        "deterministic": deterministic,
        "built": tensor_stats(built) if built is not None else None,
        "meta": tensor_stats(meta),
    }


def fits_in_host_memory(spec: ModelSpec, world_size: int) -> str | None:
    """Why the factory's model cannot be built on this host by every rank (None: it can)."""
    need = 2 * state_bytes(build_on_meta(spec).model) * world_size
    available = _available_host_bytes()
    if available and need > MEMORY_HEADROOM * available:
        return (
            f"building {spec.name} as its factory does (twice, on CPU, on each of "
            f"{world_size} ranks) needs about {need / 2**30:.1f} GiB of host memory and "
            f"{available / 2**30:.1f} GiB is available: init.weights.faithful compares the "
            "meta init with the factory's own model only where that fits; run it on a smaller "
            "config of the model"
        )
    return None


def rank_weights_faithful(
    ctx: RankContext,
    spec: ModelSpec = DEFAULT_SPEC,
    seed: int = 0,
    fault: str | Sequence[str] | None = None,
) -> FaithfulReport:
    """The factory's model (seeded, on CPU) against the suite's meta-init reference.

    Every rank makes the same comparison (the same seeds): a property of the model and of the
    init contract, not of sharding; ``init.weights`` proves the shards equal the reference.
    ``fault``: a negative control applied to the meta init (``one_tensor_rescaled``).
    """
    failed = preflight(spec)
    if failed:
        return preflight_failure(FaithfulReport, ctx, failed)
    reason = fits_in_host_memory(spec, ctx.world_size)
    if reason:
        skip_rank(reason)
    error = None
    try:
        with FAULTS.inject(fault, ctx):
            comparison = compare_with_factory(spec, seed)
    except Exception as exc:  # noqa: BLE001 - the factory's CPU build failing is the finding
        error = describe_init_error(exc)
    errors = agree_on_failure(ctx, error)
    if any(errors):
        return {"rank": ctx.rank, "error": error, "errors": errors}
    return {
        "rank": ctx.rank,
        "error": None,
        "contract": init_contract(spec, build_on_meta(spec).model),
        "comparison": comparison,
    }


# --------------------------------------------------------------------------------------------
# The verdict
# --------------------------------------------------------------------------------------------


def fix_for(contract: str, spec: ModelSpec, mismatches: Sequence[Mismatch]) -> str:
    """What the user changes so that meta init gives their model's values."""
    return "fix: " + _loaded_hint(mismatches) + _fix_for_contract(contract, spec, mismatches)


def _loaded_hint(mismatches: Sequence[Mismatch]) -> str:
    """Tensors the same for every seed as built and not constant: a checkpoint the factory
    loads (or a computed table)."""
    loaded = [
        m["name"]
        for m in mismatches
        if m["deterministic"] and m["built"] is not None and m["built"]["std"] > 0
    ]
    if not loaded:
        return ""
    return (
        f"{listing(loaded, 3)} are the same for every seed as built but not constant: if the "
        "factory loads weights, meta init cannot recreate them (load them after sharding: "
        "set_model_state_dict with broadcast_from_rank0=True); else "
    )


def _fix_for_contract(contract: str, spec: ModelSpec, mismatches: Sequence[Mismatch]) -> str:
    named = ", ".join(sorted({m["cls"] for m in mismatches}))
    if contract in ("init_weights", "model_init"):
        init = (
            f"the model init function {spec.model_init!r}"
            if contract == "model_init"
            else "the model's init_weights()"
        )
        return (
            f"{init} must give each tensor named above what the model's construction gives "
            f"it ({named}): run after to_empty, it is the only init the sharded model gets"
        )
    if contract == "init_fn":
        return (
            f"the init function {spec.init_fn!r} must give each module's own tensors what the "
            f"model's factory gives them ({named})"
        )
    per_module = (
        "name an --init-fn pkg.module:fn (--fsdp-init-fn under pytest, init_fn in "
        "[tool.fsdp_conformance]) that gives each module's own tensors what the model's "
        "construction gives them (fn(module) is called on every module that owns state)"
    )
    if contract == "transformers":
        return (
            "transformers' _init_weights does not reproduce the model as built: override "
            f"_init_weights on the model class for {named}, or {per_module}"
        )
    own = sorted({m["cls"] for m in mismatches if not m["torch_class"]})
    text = (
        f"the model's construction overrides the reset_parameters() of {named} (an init in "
        f"__init__, as nanoGPT's _init_weights): {per_module}"
    )
    if own:
        text += f", or define reset_parameters() on {', '.join(own)} doing what it does"
    return text


def verdict_weights_faithful(
    values: Sequence[FaithfulReport], params: Mapping[str, Any]
) -> Verdict:
    """No tensor of the meta-init reference differs from the factory's model, on any rank."""
    failed = failed_on_ranks(values)
    if failed:
        return failed
    spec: ModelSpec = params.get("spec", DEFAULT_SPEC)
    return judge_comparisons([v["comparison"] for v in values], values[0].get("contract", ""), spec)


def judge_comparisons(comparisons: Sequence[Comparison], contract: str, spec: ModelSpec) -> Verdict:
    """Every rank's comparison: each differing tensor named once, with both figures and the fix."""
    first = comparisons[0]
    seen: dict[str, Mismatch] = {}
    for c in comparisons:
        for m in c["mismatches"]:
            seen.setdefault(m["name"], m)
    figures = {
        "checked": first["checked"],
        "by_value": first["by_value"],
        "by_distribution": first["by_distribution"],
        "differ": len(seen),
    }
    how = (
        f"{first['by_value']} by value (the same for every seed as built), "
        f"{first['by_distribution']} by distribution"
    )
    if seen:
        lines = [f"{m['name']} ({m['cls']}): {m['detail']}" for m in seen.values()]
        return Verdict(
            False,
            f"meta init ({contract}) does not give {len(seen)} of {first['checked']} "
            f"tensors the values {spec.name}'s factory gives them (seeded, on CPU; {how}):\n  "
            + "\n  ".join(lines[:12])
            + (f"\n  ... and {len(lines) - 12} more" if len(lines) > 12 else "")
            + "\n"
            + fix_for(contract, spec, list(seen.values())),
            figures,
            {"mismatches": list(seen.values())},
        )
    unjudged = first["unjudged"]
    note = f"; not judged (one random element): {listing(unjudged, 4)}" if unjudged else ""
    return Verdict(
        True,
        f"meta init ({contract}) gives all {first['checked']} tensors the values "
        f"{spec.name}'s factory gives them ({how}){note}",
        figures,
    )
