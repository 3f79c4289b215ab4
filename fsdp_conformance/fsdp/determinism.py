"""Determinism for a comparison with a single-process reference: dropout off, and the evidence.

A sharded step and the single-process reference (:mod:`fsdp_conformance.fsdp.reference_step`)
draw different masks, so every parity check (``wrap.train``, the loop, stack, state and init
claims) switches dropout off first and skips a model whose forward still draws random numbers.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from fsdp_conformance._compat import tree_leaves
from fsdp_conformance.harness import skip_rank
from fsdp_conformance.models.model_spec import call_model, default_loss

#: Dropout modules, zeroed through their ``p``.
DROPOUT_MODULES = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)
#: A float module attribute whose name holds one of these is a functional dropout probability
#: (transformers' ``attention_dropout``, passed as ``dropout=`` to the attention interface when
#: ``self.training``; ``resid_pdrop``; ``layerdrop``, which skips whole layers; timm's
#: ``drop_prob``).
DROPOUT_ATTR_WORDS = ("dropout", "pdrop", "layerdrop", "drop_prob")
#: A float attribute named ``mask_*_prob`` is SpecAugment's masking probability (wav2vec2,
#: HuBERT, data2vec-audio: time and feature masks drawn when ``self.training``).
MASK_PROB = re.compile(r"^mask_\w*_prob$")
#: Two training-mode forwards of the same input after :func:`disable_dropout` may differ by this
#: much (relative, on the loss) before the model counts as still random.
DETERMINISM_RTOL = 1e-6


def disable_dropout(*models: torch.nn.Module) -> list[str]:
    """Set every dropout probability in ``models`` to 0; the names changed in the first model.

    A sharded step and the single-process reference draw different masks (each rank draws for
    its slice of the batch, in its own RNG stream), so with dropout on, a parity check compares
    two different functions. Why p = 0 and not ``eval()``: eval switches off more than dropout.
    A model's own ``if self.training`` branches (batch-norm statistics, MoE router jitter,
    gradient checkpointing) would no longer be what is trained, and FSDP1 itself reads
    ``module.training``: in eval, with ``FSDP_USE_FULL_PREC_IN_EVAL=1``, it computes in full
    precision, so a bf16 parity check would silently run in fp32. With p = 0 the models stay
    in training mode and dropout returns its input unchanged.

    Names are ``fqn`` for a dropout module and ``fqn.attr`` for a functional probability
    (``(root)`` for the root). Only probabilities above 0 count.
    """
    changed: list[list[str]] = []
    for model in models:
        names: list[str] = []
        seen: set[int] = set()  # a config object is shared by many modules: once each
        for name, module in model.named_modules():
            where = name or "(root)"
            if isinstance(module, DROPOUT_MODULES):
                if module.p > 0:
                    module.p = 0.0
                    names.append(where)
                continue
            names += _zero_probabilities(module, where)
            for attr, config in _configs(module, f"{where}.config"):
                if id(config) not in seen:
                    seen.add(id(config))
                    names += _zero_probabilities(config, attr)
        changed.append(names)
    return changed[0] if changed else []


def _is_probability(attr: str, value: object) -> bool:
    name = attr.lower()
    return (
        isinstance(value, float)
        and value > 0
        and (any(w in name for w in DROPOUT_ATTR_WORDS) or MASK_PROB.match(name) is not None)
    )


def _zero_probabilities(owner: object, where: str) -> list[str]:
    """Zero ``owner``'s own float probabilities (:func:`_is_probability`); their names."""
    names = []
    for attr, value in list(vars(owner).items()):
        if _is_probability(attr, value):
            setattr(owner, attr, 0.0)
            names.append(f"{where}.{attr}")
    return names


def _configs(module: torch.nn.Module, where: str) -> Iterator[tuple[str, object]]:
    """The configuration a module reads at forward time, and the sub-configurations it holds:
    transformers' modules read ``self.config.layerdrop`` and ``self.config.mask_time_prob``
    when ``self.training``, not attributes of their own. A plain object (not a module, not a
    tensor) under ``module.config``, and its attributes named ``*_config`` (a composite
    model's text or vision config)."""
    config = vars(module).get("config")
    if config is None or isinstance(config, (torch.nn.Module, torch.Tensor)):
        return
    if not hasattr(config, "__dict__"):
        return
    yield where, config
    for attr, sub in list(vars(config).items()):
        if attr.endswith("_config") and sub is not None and hasattr(sub, "__dict__"):
            yield f"{where}.{attr}", sub


def seed_everything(seed: int) -> None:
    """Seed every generator a model's forward may draw from: torch's (CPU and every CUDA
    device), Python's ``random`` and NumPy's global one (transformers' SpecAugment masks come
    from NumPy), so that two runs of the same step draw the same numbers."""
    import random

    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # no NumPy, nothing of the model draws from it
        return
    numpy.random.seed(seed % 2**32)


def forward_randomness(model: torch.nn.Module, batch: Any) -> float:
    """Relative difference between two training-mode losses of ``batch`` under different seeds.

    0 for a model whose forward draws no random numbers (after :func:`disable_dropout`, the
    evidence that the switch reached every dropout); runs on a copy, so buffers a forward
    updates (batch-norm statistics) stay as they were. The global RNG is restored.
    """
    import copy

    probe = copy.deepcopy(model)
    probe.train()
    devices = sorted(
        {
            t.device.index or 0
            for t in tree_leaves(batch)
            if isinstance(t, torch.Tensor) and t.is_cuda
        }
    )
    losses = []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        for seed in (1, 2):
            torch.manual_seed(seed)
            losses.append(float(default_loss(call_model(probe, batch))))
    return abs(losses[0] - losses[1]) / max(abs(losses[1]), 1e-12)


def require_deterministic(
    model: torch.nn.Module, batch: Any, dropout: Sequence[str], what: str
) -> None:
    """Skip on this rank (every rank alike: the same model and seeds) when ``model``'s forward
    in training mode still draws random numbers after ``dropout`` (the names
    :func:`disable_dropout` changed) was switched off; ``what`` cannot then be compared with
    the single-process reference."""
    randomness = forward_randomness(model, batch)
    if randomness > DETERMINISM_RTOL:
        skip_rank(
            f"{type(model).__name__}'s forward in training mode still draws random numbers "
            f"after dropout was disabled ({len(dropout)} settings): two calls on the same input "
            f"differ by {randomness:.1e} (relative), so {what} cannot be compared with "
            "the single-process reference. Make the randomness switchable: an nn.Dropout "
            "module, or a float attribute named like '*dropout*' (of the module or of its "
            "config) read when self.training"
        )
