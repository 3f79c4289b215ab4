"""The corpus's models: ``fsdp-conformance run --model corpus.models:NAME`` (with ``benchmarks``
on ``PYTHONPATH``, as ``benchmarks/run_corpus.py`` runs it).

- Every architecture transformers maps from a config to a model class in its auto mappings
  (:data:`KIND_MAPPINGS`: seq2seq, masked LM (encoders), causal LM (decoders; a mixture of
  experts when its config counts experts), image classification, audio classification and CTC),
  built from ``AutoConfig.for_model(model_type, **tiny)`` with one generic field table
  (:mod:`corpus.shrink`). ``NAME`` is the model type with ``-`` spelled ``_``; each factory takes
  ``num_layers`` (the suite's depth rebuild uses it).
- Hand-written styles (:mod:`corpus.styles`): ``mingpt``, ``titan_llama``, ``small_resnet``,
  ``frozen_gpt``.

:func:`inputs` is the input builder of the models whose forward takes no token ids (images,
audio). :func:`probe` builds one model on the CPU and runs a forward and a backward;
``python benchmarks/run_corpus.py --probe`` writes which survive to ``survivors.json``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from corpus import shrink, styles

#: The auto mappings the corpus draws from, in order: a model type takes the kind of the first
#: mapping that names it.
KIND_MAPPINGS = (
    ("seq2seq", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("encoder", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    ("decoder", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("vision", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    ("audio", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES"),
    ("audio", "MODEL_FOR_CTC_MAPPING_NAMES"),
)
#: Config fields that count experts: a decoder with one of them is a mixture of experts.
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
#: Where the survivors of the last probe are kept (committed: the runner's list).
SURVIVORS = Path(__file__).with_name("survivors.json")
#: The most parameters a tiny model may have (the generic table left a large field).
MAX_PARAMS = 5_000_000
#: This module, as ``--model`` and ``--input`` name it.
MODULE = "corpus.models"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One corpus model: its factory name, kind, how it is built, and the flags its run needs."""

    name: str
    kind: str
    source: str  # "model_type -> Class" or "hand-written"
    block_cls: str | None = None


@functools.cache
def architectures() -> dict[str, Entry]:
    """Every transformers architecture of :data:`KIND_MAPPINGS`, by factory name."""
    import transformers
    from transformers.models.auto import modeling_auto

    exported = set(dir(transformers))
    found: dict[str, Entry] = {}
    for kind, mapping_name in KIND_MAPPINGS:
        mapping = getattr(modeling_auto, mapping_name, {})
        for model_type, cls_name in mapping.items():
            name = model_type.replace("-", "_")
            if name in found or name in styles.STYLES:
                continue
            # dir() of transformers' lazy module lists its classes without importing them
            # (an import of every modeling module costs half a minute, in every rank).
            if not isinstance(cls_name, str) or cls_name not in exported:
                continue
            found[name] = Entry(name, kind, f"{model_type} -> {cls_name}")
    return found


def hand_written() -> dict[str, Entry]:
    """The hand-written styles, by factory name."""
    return {
        name: Entry(name, "hand-written", "hand-written", block)
        for name, (_, block, _) in styles.STYLES.items()
    }


def _model_type(name: str) -> tuple[str, str]:
    model_type, _, cls_name = architectures()[name].source.partition(" -> ")
    return model_type, cls_name


def config_of(name: str, num_layers: int = shrink.LAYERS) -> Any:
    """The tiny config of architecture ``name``."""
    from transformers import AutoConfig

    model_type, _ = _model_type(name)
    defaults = AutoConfig.for_model(model_type)
    config = AutoConfig.for_model(model_type, **shrink.tiny_fields(defaults, num_layers))
    if architectures()[name].kind == "decoder":
        config.is_decoder = True  # an encoder class in the causal-LM mapping runs as a decoder
    return config


def build(name: str, num_layers: int = shrink.LAYERS) -> nn.Module:
    """Architecture ``name`` (or a hand-written style) at tiny size, randomly initialized."""
    if name in styles.STYLES:
        return styles.STYLES[name][0](num_layers)
    import transformers

    _, cls_name = _model_type(name)
    model: nn.Module = getattr(transformers, cls_name)(config_of(name, num_layers))
    return model


def kind_of(name: str) -> str:
    """The entry's kind; a decoder whose config counts experts is ``moe``."""
    if name in styles.STYLES:
        return "hand-written"
    entry = architectures()[name]
    if entry.kind == "decoder":
        config = config_of(name)
        if any(isinstance(getattr(config, f, None), int) for f in EXPERT_FIELDS):
            return "moe"
    return entry.kind


def _factory(name: str) -> Callable[..., nn.Module]:
    def factory(num_layers: int = shrink.LAYERS) -> nn.Module:
        return build(name, num_layers)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = f"The corpus model {name!r} at tiny size ({num_layers_doc(name)})."
    return factory


def num_layers_doc(name: str) -> str:
    return "hand-written" if name in styles.STYLES else architectures()[name].source


def __getattr__(name: str) -> Any:
    """``corpus.models:NAME``: the factory of corpus model ``NAME``."""
    if name.startswith("__"):
        raise AttributeError(name)
    if name in styles.STYLES or name in architectures():
        return _factory(name)
    raise AttributeError(f"module {__name__!r} has no corpus model {name!r}")


# --------------------------------------------------------------------------------------------
# Inputs of the models whose forward takes no token ids
# --------------------------------------------------------------------------------------------


def inputs(model: nn.Module, batch_size: int, device: Any) -> Any:
    """A batch for a model whose main input is not token ids, from its config (the same on
    every rank): ``pixel_values`` (images of the config's size and channels), ``input_values``
    (a spectrogram where the config has mel bins, else one second of 16 kHz audio), or a
    hand-written style's own input."""
    g = torch.Generator().manual_seed(0)
    style_input = getattr(model, "example_input", None)
    if callable(style_input):
        return style_input(batch_size, g).to(device)
    config = model.config
    main = getattr(model, "main_input_name", "input_ids")
    if main == "pixel_values":
        size = config.image_size
        size = size if isinstance(size, int) else size[0]
        shape: tuple[int, ...] = (batch_size, config.num_channels, size, size)
    elif main == "input_values" and hasattr(config, "num_mel_bins"):
        shape = (batch_size, config.max_length, config.num_mel_bins)
    elif main == "input_values":
        shape = (batch_size, 16000)
    else:
        raise ValueError(f"corpus.models.inputs: no input for main input {main!r}")
    return {main: torch.randn(*shape, generator=g).to(device)}


def input_flag(name: str) -> str | None:
    """The ``--input`` a corpus model needs (None: its forward takes token ids)."""
    if name in styles.STYLES:
        needs = styles.STYLES[name][2]
    else:
        import transformers

        cls = getattr(transformers, _model_type(name)[1])
        needs = getattr(cls, "main_input_name", "input_ids") != "input_ids"
    return f"{MODULE}:inputs" if needs else None


# --------------------------------------------------------------------------------------------
# The probe: which architectures build and train at tiny size on the CPU
# --------------------------------------------------------------------------------------------


def probe(name: str) -> str | None:
    """Build ``name`` on the CPU and run one forward and backward; None when it works, else
    the reason in one line."""
    from fsdp_conformance.models.model_spec import call_model, default_loss, make_batch

    try:
        with torch.device("meta"):
            numel = sum(p.numel() for p in build(name).parameters())
        if numel > MAX_PARAMS:
            return f"not shrunk by the generic table: {numel:,} parameters"
        torch.manual_seed(0)
        model = build(name)
        flag = input_flag(name)
        batch = inputs(model, 2, "cpu") if flag else make_batch(model, batch_size=2)
        model.train()
        loss = default_loss(call_model(model, batch))
        loss.backward()
        if not any(p.grad is not None and bool(p.grad.any()) for p in model.parameters()):
            return "no parameter got a nonzero gradient"
        if not torch.isfinite(loss):
            return "the loss is not finite"
    except Exception as exc:  # noqa: BLE001 - any failure is a reason to leave it out
        lines = [line for line in str(exc).splitlines() if line.strip()]
        return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"
    return None


def probe_all(names: list[str], log: Callable[[str], None] = print) -> dict[str, Any]:
    """Probe every name; the survivors (name, kind, seconds) and the failures (name, reason)."""
    survivors: dict[str, Any] = {}
    failed: dict[str, str] = {}
    for i, name in enumerate(names, 1):
        start = time.perf_counter()
        reason = probe(name)
        seconds = round(time.perf_counter() - start, 2)
        if reason is None:
            survivors[name] = {"kind": kind_of(name), "seconds": seconds}
        else:
            failed[name] = reason
        log(f"probe {i}/{len(names)} {name}: {reason or 'ok'} ({seconds} s)")
    return {"survivors": survivors, "failed": failed}


def load_survivors() -> dict[str, Any]:
    """The last probe's result (``survivors.json``)."""
    data: dict[str, Any] = json.loads(SURVIVORS.read_text())
    return data
