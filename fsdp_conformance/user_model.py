"""The user's model (``--model``): its spec from the settings, and early checks before any rank.

Shared by ``fsdp-conformance run`` and the pytest plugin (``--fsdp-model``), so bad input is one
message in both, before a rank pool starts.
"""

from __future__ import annotations

from collections.abc import Sequence

from fsdp_conformance.models import ModelSpec, ModelSpecError, load_object
from fsdp_conformance.settings import Settings


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
    )


#: Host bytes a CPU rank needs per parameter of the user's model: the fp32 sharded model is
#: small, but the checks also build a full single-process reference (4 B/param), its grads
#: (4 B) and gather full weights for comparison (4 B), with headroom for activations (4 B).
CPU_BYTES_PER_PARAM = 16
#: Fraction of the available memory the checks may plan to use.
MEMORY_HEADROOM = 0.8


def validate_user_model(spec: ModelSpec, lanes: Sequence[str], world_sizes: Sequence[int]) -> None:
    """Fail early, in one line each: import path, factory, block class, empty policy, size."""
    from fsdp_conformance.policies import validate_plan

    built = spec.instantiate("meta")
    model = built.model
    if spec.init_fn:  # a bad path is one line here, not a finding from every init check
        load_object(spec.init_fn, "init function")
    blocks = built.blocks
    threshold = built.size_threshold
    # Without --block-cls only a transformers model gets this far: its _no_split_modules.
    given = "" if spec.block_cls else " (from the model's _no_split_modules)"
    validate_plan(
        model,
        built.policy("recommended"),
        detail=f"{spec.name}: block classes {', '.join(b.__name__ for b in blocks)}{given}, "
        f"threshold {threshold:,}; check --fsdp-block-cls names the model's block class",
    )
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
