"""The planner's input: the model to plan (a preset, a reference model or the user's factory, built
on ``meta``), the step's settings in the user's words, sizes, and :class:`PlanError`."""

from __future__ import annotations

import dataclasses
from typing import Any

from fsdp_conformance import sizes
from fsdp_conformance.measure.bound import OPTIMIZER_STATES
from fsdp_conformance.models.catalog import REFERENCE_MODELS
from fsdp_conformance.models.llama import LLAMA_PRESETS
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.policies import PLAN_POLICIES, PolicyName
from fsdp_conformance.models.reference_models import LLAMA_NORMS, LlamaConfig, ModelConfig

#: Bytes per element of the dtypes a plan can use.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: ``recommended`` = one unit per block (policies.recommended_policy); ``seeds`` = the seeds'
#: get_hybrid_policy (block type OR the size rule, which also fires inside the blocks);
#: ``monolithic`` = the root is the only unit (the names are the registry's own:
#: :data:`fsdp_conformance.models.policies.PLAN_POLICIES`).
POLICIES = PLAN_POLICIES
#: ``--preset``: the Llama shapes of llama.LLAMA_PRESETS (Llama 2 7B / 13B / 70B,
#: Llama 3 8B / 70B / 405B, saving what production Llama code saves), and the seeds' own
#: MassiveModel at the seeds' scale (dim 4096, 8 layers, vocab 32000).
PRESETS = (*LLAMA_PRESETS, "seeds")
OPTIMIZERS = tuple(k for k in OPTIMIZER_STATES if k) + ("none",)
#: flash: what fused attention saves for backward (q, k, v, output, logsumexp), as flash or
#: memory-efficient attention on GPU and the CPU flash kernel; math: the unfused path, which
#: also saves the seq x seq attention weights.
ATTENTION = ("flash", "math")
#: mse: the suite's step loss (``models.default_loss``: the mean square of the output in fp32),
#: what the trust check measures; cross-entropy: torchtitan's (the logits upcast to fp32, token
#: targets), for models with token inputs.
LOSSES = ("mse", "cross-entropy")


class PlanError(ValueError):
    """Bad input to the planner; the message names the problem and the fix (exit code 2)."""


class MetaForwardError(PlanError):
    """The model's forward (or its input builder) does not run on meta tensors, which planning
    needs (it plans at full scale, nothing allocated): a data-dependent step such as
    ``Tensor.item()``. The planner cannot plan such a model; the message names the error."""


# ============================================================================================
# Settings and the model to plan
# ============================================================================================


def checkpoint_every(checkpointing: str) -> int:
    """Every how many blocks one is checkpointed: 0 for "none", 1 for "full" and "op", K for
    "every-K"."""
    if checkpointing == "none":
        return 0
    if checkpointing in ("full", "op"):
        return 1
    head, _, k = checkpointing.partition("-")
    if head == "every" and k.isdigit() and int(k) >= 2:
        return int(k)
    raise PlanError(
        f"activation checkpointing {checkpointing!r} is not one of none, full, op "
        "(op-level selective: every block keeps its attention outputs and every other "
        "matmul's, torchtitan's policy), every-K (K >= 2: blocks 0, K, 2K, ... "
        "checkpointed); e.g. every-2"
    )


def checkpoint_ops(checkpointing: str) -> bool:
    """Op-level selective activation checkpointing ("op"): what a checkpointed block keeps is
    decided per op (torch's ``create_selective_checkpoint_contexts``, torchtitan's policy)."""
    return checkpointing == "op"


def describe_checkpointing(checkpointing: str) -> str:
    if checkpoint_ops(checkpointing):
        return "op-level selective on every block (attention and every other matmul kept)"
    k = checkpoint_every(checkpointing)
    return {0: "off", 1: "on every block"}.get(k, f"on every {k}th block")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """What one training step does, in the user's words (resolved to a StepConfig per W)."""

    #: One of :data:`POLICIES`.
    policy: PolicyName = "recommended"
    #: "fsdp1" or "fsdp2".
    version: str = "fsdp2"
    #: Sharded parameters, sharded gradients and optimizer state (the fp32 master copy).
    param_dtype: str = "fp32"
    #: Gathered parameters, unsharded gradients, all-gather/reduce-scatter and activations
    #: (bf16 mixed precision: FSDP2 ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``).
    compute_dtype: str = "bf16"
    #: The gradients' reduce-scatter (FSDP2 ``MixedPrecisionPolicy(reduce_dtype=...)``, FSDP1
    #: ``MixedPrecision(reduce_dtype=...)``): its input copy and output shard, and FSDP1's cast
    #: of the unsharded gradient; None: the compute dtype (both versions' default).
    #: torchtitan reduces in fp32.
    reduce_dtype: str | None = None
    #: One of :data:`OPTIMIZERS` ("none": forward and backward only).
    optimizer: str = "adamw"
    #: Per-rank micro-batch.
    batch_size: int = 1
    #: Tokens per sample (ignored when the model has its own input builder).
    seq_len: int = 4096
    #: One of :data:`ATTENTION`.
    attention: str = "flash"
    #: One of :data:`LOSSES`.
    loss: str = "mse"
    #: Activation checkpointing of the blocks: "none", "full" (every block), "op" (every block,
    #: op-level selective: torchtitan's ``selective_ac_option = "op"``) or "every-K" (blocks 0,
    #: K, 2K, ...: selective by layer), as torch's ``checkpoint_wrapper`` applies it.
    checkpointing: str = "none"
    #: HSDP: the ranks each unit is sharded over (FSDP2's 2-D mesh, replicate x shard; FSDP1's
    #: HYBRID_SHARD); None: full sharding over the world.
    shard_group_size: int | None = None
    #: CPU offload of the sharded state (FSDP1 ``CPUOffload(offload_params=True)``, FSDP2
    #: ``CPUOffloadPolicy``): the estimate is the device's, the host's is reported beside it.
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        checkpoint_every(self.checkpointing)  # raises PlanError naming the accepted forms
        if self.shard_group_size is not None and self.shard_group_size < 1:
            raise PlanError(f"--shard-group-size must be >= 1, got {self.shard_group_size}")
        for name, allowed in (
            ("policy", POLICIES),
            ("version", ("fsdp1", "fsdp2")),
            ("param_dtype", tuple(DTYPE_BYTES)),
            ("compute_dtype", tuple(DTYPE_BYTES)),
            ("reduce_dtype", (*DTYPE_BYTES, None)),
            ("optimizer", OPTIMIZERS),
            ("attention", ATTENTION),
            ("loss", LOSSES),
        ):
            if getattr(self, name) not in allowed:
                raise PlanError(
                    f"{name.replace('_', '-')} {getattr(self, name)!r} is not one of "
                    f"{', '.join(a for a in allowed if a is not None)}"
                )
        for name in ("batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise PlanError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )

    @property
    def optimizer_name(self) -> str | None:
        return None if self.optimizer == "none" else self.optimizer

    def describe(self) -> str:
        opt = "no optimizer" if self.optimizer == "none" else f"{self.optimizer} state"
        return (
            f"{self.version}; sharded params, grads and {opt} in {self.param_dtype}; "
            f"gathered params, unsharded grads, collectives and activations in "
            f"{self.compute_dtype}"
            + (
                f", gradients reduced in {self.reduce_dtype}"
                if self.reduce_dtype not in (None, self.compute_dtype)
                else ""
            )
            + f"; per-rank batch {self.batch_size} x seq {self.seq_len}, "
            f"{self.attention} attention"
            + (
                ""
                if self.checkpointing == "none"
                else f", activation checkpointing {describe_checkpointing(self.checkpointing)}"
            )
            + (
                ""
                if self.shard_group_size is None
                else f", HSDP with shard groups of {self.shard_group_size} ranks"
            )
            + (", sharded state offloaded to the host" if self.cpu_offload else "")
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ModelChoice:
    """The model to plan and how to name it."""

    spec: ModelSpec
    label: str
    #: True for the full-scale presets: the seeds' policy then keeps its literal 2e7 threshold.
    full_scale: bool = False


def choose_model(
    *,
    preset: str | None = None,
    reference: str | None = None,
    factory: str | None = None,
    block_cls: str | None = None,
    min_params: int | None = None,
    layers: int | None = None,
    dim: int | None = None,
    input_builder: str | None = None,
    norm: str | None = None,
) -> ModelChoice:
    """A preset, a (small) reference model or the user's factory, with one clear error each.

    ``norm``: the Llama RMSNorm form (``LlamaConfig.norm``: "eager", "fused", or the suite's
    first reference "upcast-twice"), for a Llama preset or ``--reference llama``."""
    given = [
        n
        for n, v in (("--preset", preset), ("--reference", reference), ("--model", factory))
        if v is not None
    ]
    if len(given) != 1:
        problem = "name one model, not " + " and ".join(given) if given else "no model given"
        raise PlanError(
            f"{problem}: "
            f"pass --preset ({', '.join(PRESETS)}), --reference NAME "
            f"({', '.join(REFERENCE_MODELS)}) or --model pkg.module:factory --block-cls CLASS"
        )
    if min_params is not None and min_params < 1:
        raise PlanError(f"--min-params must be >= 1, got {min_params}")
    if factory is None and (block_cls or input_builder):
        raise PlanError("--block-cls and --input go with --model pkg.module:factory")
    _check_norm(norm, preset, reference)
    if preset is not None:
        if layers is not None or dim is not None:
            raise PlanError(
                "--layers and --dim change a --reference model; a preset has its "
                "own shape (use --reference llama --layers N --dim D instead)"
            )
        return _preset_choice(preset, min_params, norm)
    if reference is not None:
        if reference not in REFERENCE_MODELS:
            raise PlanError(
                f"unknown reference model {reference!r}; choose one of "
                f"{', '.join(REFERENCE_MODELS)} (or --preset {', '.join(PRESETS)})"
            )
        config: ModelConfig | LlamaConfig = LlamaConfig() if reference == "llama" else ModelConfig()
        # Any: mypy's dataclasses.replace plugin checks **changes against every field of the
        # union's members (their field sets differ), so dict[str, int] reads as "Never".
        changes: dict[str, Any] = {
            k: v for k, v in (("num_layers", layers), ("dim", dim), ("norm", norm)) if v is not None
        }
        try:
            config = dataclasses.replace(config, **changes)
        except ValueError as exc:
            raise PlanError(f"--reference {reference}: {exc}") from None
        spec = ModelSpec(reference=reference, config=config, min_params=min_params)
        return ModelChoice(spec, f"reference {reference} ({_config_label(config)})")
    if layers is not None or dim is not None:
        raise PlanError("--layers and --dim change a --reference model, not a --model factory")
    blocks = tuple(b.strip() for b in block_cls.split(",") if b.strip()) if block_cls else None
    spec = ModelSpec(
        reference=None,
        factory=factory,
        block_cls=blocks,
        min_params=min_params,
        input_builder=input_builder,
    )
    return ModelChoice(spec, f"{factory}")


def _preset_choice(preset: str, min_params: int | None, norm: str | None) -> ModelChoice:
    if preset == "seeds":
        spec = ModelSpec(
            reference="massive", config=ModelConfig.seeds_full_scale(), min_params=min_params
        )
        return ModelChoice(spec, "the seeds' MassiveModel at full scale", full_scale=True)
    if preset not in LLAMA_PRESETS:
        raise PlanError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    config = LLAMA_PRESETS[preset]
    if norm is not None:
        config = dataclasses.replace(config, norm=norm)
    spec = ModelSpec(reference="llama", config=config, min_params=min_params)
    return ModelChoice(spec, f"Llama {preset} preset, {config.norm} RMSNorm", full_scale=True)


def _check_norm(norm: str | None, preset: str | None, reference: str | None) -> None:
    if norm is None:
        return
    if norm not in LLAMA_NORMS:
        raise PlanError(f"--norm {norm!r} is not one of {', '.join(LLAMA_NORMS)}")
    if not (preset in LLAMA_PRESETS or reference == "llama"):
        raise PlanError(
            "--norm sets a Llama's RMSNorm: it goes with a Llama preset "
            f"({', '.join(LLAMA_PRESETS)}) or --reference llama; your own model "
            "(--model) is planned with the norm its code runs"
        )


def _config_label(config: ModelConfig | LlamaConfig) -> str:
    return f"{config.num_layers} layers, dim {config.dim}"


def build_meta_model(choice: ModelChoice) -> Any:
    """The model on ``meta``: shapes only, no storage, at any size."""
    return choice.spec.build("meta")


def _require_meta(model: Any, choice: ModelChoice) -> None:
    """Refuse a model whose meta build left more than negligible storage real
    (:func:`~fsdp_conformance.fsdp.meta_init.real_under_meta`: a table, an embedding, a
    layer's weights); a negligible real tensor (transformers' ``masked_spec_embed``, made by
    the legacy ``torch.Tensor(n)`` constructor) is moved to meta, since a plan needs only its
    shape."""
    from fsdp_conformance.fsdp.meta_init import real_under_meta

    if all(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return
    try:
        blocks = choice.spec.block_classes(model)
    except Exception:  # noqa: BLE001 - no block class: judged against the whole model
        blocks = ()
    count = sum(isinstance(m, blocks) for m in model.modules()) if blocks else 1
    real = real_under_meta(model, count)
    if real.too_large:
        raise PlanError(
            f"{choice.label} builds tensors with storage even under torch.device('meta') "
            f"({', '.join(real.names[:5])}: {real.bytes:,} bytes); create them without an "
            "explicit device= in the factory (the legacy torch.Tensor(n) constructor ignores "
            "the device context: use torch.empty(n)) so planning allocates nothing"
        )
    model.to("meta")


def meta_batch(model: Any, choice: ModelChoice, settings: PlanSettings) -> Any:
    """An input batch on meta: token ids or float features, ``batch_size x seq_len``."""
    import torch

    from fsdp_conformance.models.model_spec import make_batch

    spec, b, s = choice.spec, settings.batch_size, settings.seq_len
    if spec.input_builder:
        return spec.batch(model, b, "meta")
    if spec.reference is not None:
        if REFERENCE_MODELS[spec.reference].input_kind == "tokens":
            return torch.empty((b, s), dtype=torch.long, device="meta")
        return torch.empty((b, s, model.config.dim), device="meta")
    return make_batch(model, b, s, device="meta")


# ============================================================================================
# Sizes in the user's words (decimal units, as device memory is quoted)
# ============================================================================================


def parse_bytes(text: str, what: str = "--device-memory", allow_zero: bool = False) -> int:
    """``80GB``, ``141 GB``, ``80GiB``, ``8e10``: bytes (GB = 10^9 B, GiB = 2^30 B)."""
    try:
        return sizes.parse_bytes(text, what, allow_zero)
    except ValueError as exc:
        raise PlanError(str(exc)) from None


def parse_world_sizes(text: str) -> tuple[int, ...]:
    """``--world-sizes``: the suite's rules (sizes.parse_world_sizes) with the plan's texts."""
    try:
        return sizes.parse_world_sizes(text)
    except ValueError:
        parts = [p for p in text.replace(" ", ",").split(",") if p]
        if all(p.lstrip("-").isdigit() for p in parts):
            raise PlanError(
                f"--world-sizes {text!r} needs integers >= 1, e.g. 8,64,512,1024"
            ) from None
        raise PlanError(
            f"--world-sizes {text!r} is not a comma-separated list of integers; "
            "write e.g. 8,64,512,1024"
        ) from None
