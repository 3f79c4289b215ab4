"""The user's model (``--model``): its spec from the settings, and the preflight before any rank.

Shared by ``fsdp-conformance run`` and the pytest plugin (``--fsdp-model``), so bad input is one
message in both, before a rank pool starts: :func:`validate_user_model` builds the model on meta,
resolves its block classes (keeping tied weights whole), checks its plan and size, makes one
batch and runs the forward on meta with it, and rebuilds the model at another depth as the
depth check will. Never run for the reference models.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fsdp_conformance.models import hf
from fsdp_conformance.models.block_classes import (
    nested_note,
    no_block_class,
    no_split_block_classes,
    tie_safe_note,
)
from fsdp_conformance.models.model_spec import (
    DEPTH_KEYWORDS,
    BuiltModel,
    ModelSpec,
    ModelSpecError,
    NoDefaultBatch,
    builder_fix,
    call_model,
    depth_keyword,
    load_object,
    root_init_weights,
    without_reset_parameters,
)
from fsdp_conformance.models.units import mixed_requires_grad_units, planned_unit_modules
from fsdp_conformance.settings import OPTIONS_BY_NAME, FlagStyle, Settings


def user_spec(settings: Settings) -> ModelSpec | None:
    """The user's model from the settings, or None when running on the reference models."""
    if not settings.model:
        # Resolution refused --block-cls / --input without --model (settings.resolve_settings).
        return None
    blocks = tuple(b.strip() for b in settings.block_cls.split(",")) if settings.block_cls else None
    return ModelSpec(
        reference=None,
        factory=settings.model,
        block_cls=blocks,
        min_params=settings.min_params,
        input_builder=settings.input,
        init_fn=settings.init_fn,
        model_init=settings.model_init,
    )


#: Host bytes a CPU rank needs per parameter of the user's model: the fp32 sharded model is
#: small, but the checks also build a full single-process reference (4 B/param), its grads
#: (4 B) and gather full weights for comparison (4 B), with headroom for activations (4 B).
CPU_BYTES_PER_PARAM = 16
#: Fraction of the available memory the checks may plan to use.
MEMORY_HEADROOM = 0.8
#: The depth the preflight rebuilds the model at: the deepest of ``memory.depth_invariance``'s
#: depths (2, 4, 8; ``tests/test_preflight.py`` holds the two equal), where a config field of
#: one entry per layer kept at the factory's depth runs out first.
REBUILD_DEPTH = 8
#: The batch the preflight makes: as the checks make theirs, on the CPU.
PREFLIGHT_BATCH = 2


def validate_user_model(
    spec: ModelSpec,
    lanes: Sequence[str],
    world_sizes: Sequence[int],
    *,
    flag_style: FlagStyle = "pytest",
    depth_rebuild: bool = True,
    init_checks: bool = True,
) -> list[str]:
    """Fail early, in one line each: import path, factory (built on meta), block class, empty
    policy, size, one batch through the forward (on meta, and on the CPU where meta fails),
    the init contract, the depth rebuild.

    Returns the notes the run goes on with, one line each (the default block classes that keep
    a tie whole); ``flag_style`` spells the flags in the messages as the front end does;
    ``depth_rebuild``: whether a selected check rebuilds the model at other depths;
    ``init_checks``: whether a selected check initializes the model on meta.
    """
    from fsdp_conformance.models.policies import validate_plan

    built = _build_on_meta(spec)
    model = built.model
    if spec.init_fn:  # a bad path is one line here, not a finding from every init check
        load_object(spec.init_fn, "init function")
    if spec.model_init:
        load_object(spec.model_init, "model init function")
    if not spec.block_cls and not hf.is_pretrained(model):
        raise ModelSpecError(no_block_class(model, spec.name, _flag("block_cls", flag_style)))
    notes = []
    if not spec.block_cls and hf.is_pretrained(model):
        # Its _no_split_modules; where they name no block, the line names this front end's flag.
        no_split_block_classes(model, spec.name, _flag("block_cls", flag_style))
        for note in (
            tie_safe_note(model, _flag("block_cls", flag_style)),
            nested_note(model, _flag("block_cls", flag_style)),
        ):
            if note:
                notes.append(note)
    blocks = built.blocks
    threshold = built.size_threshold
    # Without --block-cls only a transformers model gets this far: its _no_split_modules.
    given = "" if spec.block_cls else " (from the model's _no_split_modules)"
    validate_plan(
        model,
        built.policy("recommended"),
        detail=f"{spec.name}: block classes {', '.join(b.__name__ for b in blocks)}{given}, "
        f"threshold {threshold:,}; check {_flag('block_cls', flag_style)} names the model's "
        "block class",
        flag=_flag("block_cls", flag_style),
    )
    mixed = mixed_requires_grad_units(
        model, planned_unit_modules(model, built.policy("recommended"))
    )
    if mixed:
        notes.append(frozen_units_note(mixed))
    _check_size(spec, model, lanes, world_sizes)
    _check_batch(built, flag_style)
    problem = init_contract_problem(spec, model, flag_style) if init_checks else None
    if problem:
        raise ModelSpecError(problem)
    if depth_rebuild:
        _check_depth_rebuild(spec, model)
    return notes


def frozen_units_note(units: Sequence[str]) -> str:
    """The one line that says the FSDP1 checks run with ``use_orig_params=True``, because the
    units ``units`` (FQNs, ``""`` the root) mix frozen and trainable parameters."""
    shown = ", ".join(repr(u) if u else "the root" for u in units[:4])
    more = f" and {len(units) - 4} more" if len(units) > 4 else ""
    return (
        f"FSDP1 unit(s) {shown}{more} hold frozen and trainable parameters, which FSDP1 "
        'cannot flatten with use_orig_params=False, its default (torch: "Must flatten tensors '
        'with uniform requires_grad"); the FSDP1 checks run with the fix, '
        "use_orig_params=True (or keep the frozen modules out of those units: wrap them as "
        "units of their own)"
    )


def _flag(name: str, flag_style: FlagStyle) -> str:
    return OPTIONS_BY_NAME[name].flag_in(flag_style)


def _reason(exc: BaseException) -> str:
    """An exception in one line: its type and the first line of its message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _build_on_meta(spec: ModelSpec) -> BuiltModel:
    """The model built on meta, or one line naming the factory, the meta device and torch's
    reason (the factory's own errors: a wrong path, a non-module, stay as they are)."""
    try:
        return spec.instantiate("meta")
    except ModelSpecError as exc:
        cause = exc.__cause__
        if cause is None:
            raise
        raise ModelSpecError(
            f"model factory {spec.factory!r} raised {_reason(cause)} when built on the meta "
            "device (under `with torch.device('meta')`, where the suite builds every model "
            "first: meta init and planning); fix the factory (it is called with no arguments) "
            "so that it builds there too"
        ) from None


def _check_size(
    spec: ModelSpec, model: nn.Module, lanes: Sequence[str], world_sizes: Sequence[int]
) -> None:
    numel = sum(p.numel() for p in model.parameters())
    need = numel * CPU_BYTES_PER_PARAM * max(world_sizes)
    available = _available_host_bytes()
    if "cpu" in lanes and available and need > MEMORY_HEADROOM * available:
        raise ModelSpecError(
            f"model {spec.name} has {numel / 1e9:.2f} B parameters: the cpu lane at world size "
            f"{max(world_sizes)} needs about {need / 2**30:.1f} GiB of host memory, "
            f"{available / 2**30:.1f} GiB is available; use a smaller config of the model for "
            "the cpu lane, the gpu lane, or `fsdp-conformance plan` for full-scale planning"
        )


def _available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# --------------------------------------------------------------------------------------------
# One batch, through the forward on meta
# --------------------------------------------------------------------------------------------


def _check_batch(built: BuiltModel, flag_style: FlagStyle) -> None:
    """One batch made as the checks make it (on the CPU, from the model on meta), bound to the
    forward's signature, and run through the forward on meta.

    Refused, in one line naming the input the forward wants, only where the data says the input
    is at fault: no batch could be made, the forward's signature does not take it, or the
    forward failed on meta without an input it needs (:func:`_missing_inputs`). Any other
    failure on meta (a meta kernel torch lacks, such as Mixtral's grouped matmul in fp32, or the
    model's own error) is left to the checks, which run the forward on real tensors.
    """
    spec, model = built.spec, built.model

    def fix(names: Sequence[str]) -> str:
        if spec.input_builder:
            return (
                f"make input builder {spec.input_builder!r} return what the forward takes (a "
                "mapping is passed as keyword arguments)"
            )
        return builder_fix(_flag("input", flag_style), *names)

    batch = _make_batch(built, flag_style)
    what = _describe_batch(batch, spec)
    signature = _signature(model)
    if signature is not None:
        try:
            if isinstance(batch, Mapping):
                signature.bind(**batch)
            else:
                signature.bind(batch)
        except TypeError as exc:
            raise ModelSpecError(
                f"the forward of {type(model).__name__} does not take {what}: {exc}; "
                f"{_needs(signature)}; {fix(_required(signature))}"
            ) from None
    try:
        with torch.no_grad():
            call_model(model, _on_meta(batch))
    except Exception as exc:  # judged below: what is not the input's goes on to the checks
        missing = _missing_inputs(exc, model, signature, batch)
        if not missing:
            # A meta kernel torch lacks (Mixtral's grouped matmul in fp32), or a batch the
            # forward cannot take (a CNN given features): a tiny forward on the CPU tells.
            _check_batch_on_cpu(built, batch, what, fix([]))
            return
        raise ModelSpecError(
            f"the forward of {type(model).__name__} on {what} raised {_reason(exc)}; it needs "
            f"{', '.join(missing)}, which the batch does not give; {fix(missing)}"
        ) from None


#: The largest model (its parameters and buffers) the preflight builds on the CPU to run one
#: forward where the forward failed on meta; a larger one is left to the checks.
CPU_FORWARD_BYTES = 1 << 30


def _check_batch_on_cpu(built: BuiltModel, batch: Any, what: str, fix: str) -> None:
    """The forward on the CPU, the model built there as its factory builds it: where it fails
    too, every check would fail the same way on every rank, so it is one line now."""
    model = built.model
    size = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    if size > CPU_FORWARD_BYTES:
        return
    with torch.random.fork_rng(devices=[]):
        cpu_model = built.spec.build("cpu")
    try:
        with torch.no_grad():
            call_model(cpu_model, batch)
    except Exception as exc:  # the finding: the same error every rank would raise
        raise ModelSpecError(
            f"the forward of {type(model).__name__} does not take {what}: it raised "
            f"{_reason(exc)} on the meta device and on the CPU, so every check would fail "
            f"with it; {fix} (a forward that fails on any input fails here too: fix it first)"
        ) from None


def _make_batch(built: BuiltModel, flag_style: FlagStyle) -> Any:
    spec, model = built.spec, built.model
    try:
        return built.batch(batch_size=PREFLIGHT_BATCH, device="cpu")
    except NoDefaultBatch as exc:
        wants = [exc.wants] if exc.wants else []
        raise ModelSpecError(
            f"{exc.problem}; {builder_fix(_flag('input', flag_style), *wants)}"
        ) from None
    except ModelSpecError:
        raise
    except Exception as exc:
        if spec.input_builder:
            raise ModelSpecError(
                f"input builder {spec.input_builder!r} raised {_reason(exc)}; fix the builder "
                f"(called as builder(model, {PREFLIGHT_BATCH}, 'cpu'), the model built on the "
                "meta device)"
            ) from None
        raise ModelSpecError(
            f"cannot make a default batch for {type(model).__name__}: {_reason(exc)}; "
            f"{builder_fix(_flag('input', flag_style))}"
        ) from None


def _describe_batch(batch: Any, spec: ModelSpec) -> str:
    source = (
        f"the batch of input builder {spec.input_builder!r}"
        if spec.input_builder
        else "the default batch"
    )
    if isinstance(batch, torch.Tensor):
        kind = "token ids" if not batch.is_floating_point() else "features"
        return f"{source} (one tensor of {kind}, shape {tuple(batch.shape)})"
    if isinstance(batch, Mapping):
        return f"{source} (keywords {', '.join(map(str, batch))})"
    return f"{source} (one {type(batch).__name__}, passed as one positional argument)"


def _signature(model: nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):  # a forward of C code or a callable object without one
        return None


def _inputs(signature: inspect.Signature | None) -> list[inspect.Parameter]:
    if signature is None:
        return []
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p for p in signature.parameters.values() if p.kind not in variadic]


def _required(signature: inspect.Signature) -> list[str]:
    return [p.name for p in _inputs(signature) if p.default is inspect.Parameter.empty]


def _needs(signature: inspect.Signature) -> str:
    parts = []
    for p in _inputs(signature):
        if p.default is inspect.Parameter.empty:
            keyword = p.kind is inspect.Parameter.KEYWORD_ONLY
            parts.append(f"{p.name} (keyword-only)" if keyword else p.name)
    if not parts:
        return "its forward has no required input"
    return f"its forward needs {', '.join(parts)}"


def _on_meta(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to("meta")
    if isinstance(batch, Mapping):
        return {k: _on_meta(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_on_meta(v) for v in batch)
    return batch


def _missing_inputs(
    exc: BaseException, model: nn.Module, signature: inspect.Signature | None, batch: Any
) -> list[str]:
    """The inputs the failed forward needed and the batch did not give, where the data says so:
    a transformers model's ``main_input_name`` missing from the batch (ViT's ``pixel_values``:
    its forward then fails on None), or, for a TypeError or ValueError, the forward's inputs
    its message names. Empty otherwise: nothing blames the input."""
    params = _inputs(signature)
    if isinstance(batch, Mapping):
        given = set(map(str, batch))
    else:  # one positional argument: the forward's first input
        given = {params[0].name} if params else set()
    main = getattr(model, "main_input_name", None) if hf.is_pretrained(model) else None
    if isinstance(main, str) and main not in given:
        return [main]
    if not isinstance(exc, (TypeError, ValueError)):
        return []
    message = str(exc)
    return [
        p.name
        for p in params
        if p.name not in given and re.search(rf"(?<![\w.]){re.escape(p.name)}(?!\w)", message)
    ]


# --------------------------------------------------------------------------------------------
# The init contract
# --------------------------------------------------------------------------------------------


def init_contract_problem(
    spec: ModelSpec, model: nn.Module, flag_style: FlagStyle = "pytest"
) -> str | None:
    """Why the init checks cannot initialize ``spec``'s model on meta (None: they can), in one
    line naming the fix: said before any rank, not as the same finding from every init check
    after the run. A model has an init contract when it is named (``--init-fn``,
    ``--model-init``), is a transformers model, has a root ``init_weights()``, or every module
    owning state has ``reset_parameters()``."""
    if spec.init_fn or spec.model_init or hf.is_pretrained(model):
        return None
    if root_init_weights(model) is not None:
        return None
    missing = without_reset_parameters(model)
    if not missing:
        return None
    leave_out = (
        "or run the other claims alone (--checks wrap. and so on)"
        if flag_style == "cli"
        else "or deselect the init checks (-k 'not init.'); they fail with this finding"
    )
    shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    return (
        f"{len(missing)} module(s) of {type(model).__name__} own parameters or buffers but have "
        f"no reset_parameters(), and the model has no init_weights(): meta init (the init "
        f"checks) cannot recreate their values ({shown}); name its init: "
        f"{_flag('model_init', flag_style)} pkg.module:fn (fn(model), the whole model after "
        f"to_empty) or {_flag('init_fn', flag_style)} pkg.module:fn (fn(module), per module), or "
        f"define reset_parameters() on those classes; {leave_out}"
    )


# --------------------------------------------------------------------------------------------
# The depth rebuild
# --------------------------------------------------------------------------------------------


def _check_depth_rebuild(spec: ModelSpec, model: nn.Module) -> None:
    """Build the model once on meta at :data:`REBUILD_DEPTH` layers, as ``memory.
    depth_invariance`` will: through the factory's depth keyword (its failure is the
    factory's), else the suite's own rebuild from a copy of its transformers config (its failure
    is the suite's, never the factory's). A model whose depth cannot be set is left to that
    check, which skips and says how to make it settable."""
    assert spec.factory is not None
    keyword = depth_keyword(load_object(spec.factory, "model factory"))
    if keyword is None and hf.config_depth(model) is None:
        return
    try:
        dataclasses.replace(spec, depth=REBUILD_DEPTH).build("meta")
    except ModelSpecError as exc:
        if keyword is not None:
            raise ModelSpecError(
                f"{exc}; memory.depth_invariance builds the model at 2, 4 and {REBUILD_DEPTH} "
                f"layers through its {keyword}= keyword"
            ) from None
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        raise ModelSpecError(
            f"the suite's own rebuild of {type(model).__name__} at {REBUILD_DEPTH} layers "
            f"failed: {_reason(cause)} (memory.depth_invariance rebuilds a transformers model "
            "from a copy of its config with num_hidden_layers set; the factory is not called "
            "and not at fault); give the factory a depth keyword ("
            + ", ".join(f"{k}=" for k in DEPTH_KEYWORDS)
            + ") and the suite builds each depth through it instead"
        ) from None
