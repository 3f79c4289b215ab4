"""Per-tensor distributions: the moments of a tensor and the stated test that tells whether one
draw of an init is a draw of another init's distribution.

``init.weights.faithful`` compares the meta init with the model as its factory builds it, and
``init.weights`` a model-level init's draws on FSDP2's shards with the same init unsharded: in
both the values cannot match (different RNG orders), the distributions must (docs/init.md,
"Faithful to the model as built", for the test and why it does not false-alarm).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple, TypedDict

import torch

#: Standard errors a statistic may lie from the factory's (6: about 2e-9 per tensor for a
#: normal statistic, so that thousands of tensors give no false alarm).
Z = 6.0
#: Relative slack on the std and on the mean (in stds) that no init difference worth naming
#: hides in; it absorbs what the iid standard errors do not model (correlated elements).
REL_TOL = 0.05
#: Absolute slack on the fraction of exact zeros.
ZEROS_TOL = 0.01


class TensorStats(TypedDict):
    """One tensor's distribution, as float64 moments over its elements."""

    numel: int
    mean: float
    std: float
    kurtosis: float
    zeros: float


#: Elements per float64 chunk when reducing a tensor (32 MiB): a statistic of a large embedding
#: never makes float64 copies of the whole tensor.
CHUNK = 1 << 22


def flat_chunks(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """``t``'s elements (a complex tensor's real and imaginary parts) as float64 CPU chunks."""
    flat = t.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    for start in range(0, flat.numel(), CHUNK):
        yield flat[start : start + CHUNK].to("cpu", torch.float64)  # a factory may move it


def tensor_stats(t: torch.Tensor) -> TensorStats:
    """Mean, std, kurtosis and the fraction of exact zeros over ``t``'s elements (two passes
    over float64 chunks)."""
    n = total = zeros = 0.0
    for chunk in flat_chunks(t):
        n += chunk.numel()
        total += float(chunk.sum())
        zeros += float((chunk == 0).sum())
    if not n:
        return {"numel": 0, "mean": 0.0, "std": 0.0, "kurtosis": 0.0, "zeros": 0.0}
    mean = total / n
    m2 = m4 = 0.0
    for chunk in flat_chunks(t):
        squared = (chunk - mean).square_()
        m2 += float(squared.sum())
        m4 += float(squared.square_().sum())
    var, m4 = m2 / n, m4 / n
    return {
        "numel": int(n),
        "mean": mean,
        "std": math.sqrt(var),
        "kurtosis": m4 / var**2 if var > 0 else 0.0,
        "zeros": zeros / n,
    }


def _ratio(meta: float, built: float) -> str:
    if built == 0:
        return "from zero"
    return f"{meta / built:.3g}x"


class Deviation(NamedTuple):
    """One statistic of the meta draw against the factory's: how far, one standard error, and
    the bound (``Z`` standard errors plus the slack)."""

    deviation: float
    se: float
    bound: float


def deviations(a: TensorStats, b: TensorStats, meta: TensorStats) -> dict[str, Deviation]:
    """The std (log scale), the mean and the exact-zero fraction of ``meta`` (one draw of the
    meta init) against the factory's, of which ``a`` and ``b`` are two draws (seeds ``s`` and
    ``s + 1``); for tensors with a spread in every draw (``judge_tensor`` handles the rest).

    * std, on a log scale: the standard error of a sample std over ``n`` iid elements is
      ``sqrt((kurtosis - 1) / (4 n))`` relatively (the largest kurtosis of the three draws), or
      the seed-to-seed spread the two factory draws show, when larger; slack ``REL_TOL``;
    * mean: ``std / sqrt(n)`` (or the two factory draws' spread); slack ``REL_TOL`` stds;
    * fraction of exact zeros: binomial; slack ``ZEROS_TOL``.

    One meta draw against the mean of two factory draws: each standard error times
    ``sqrt(1 + 1/2)``.
    """
    n = a["numel"]
    pair = math.sqrt(1.5)
    built_std = math.sqrt((a["std"] ** 2 + b["std"] ** 2) / 2)
    kurtosis = max(a["kurtosis"], b["kurtosis"], meta["kurtosis"], 1.5)
    se_log = pair * max(
        math.sqrt((kurtosis - 1) / (4 * n)), abs(math.log(a["std"] / b["std"])) / math.sqrt(2)
    )
    scale = max(built_std, meta["std"])
    se_mean = pair * max(scale / math.sqrt(n), abs(a["mean"] - b["mean"]) / math.sqrt(2))
    built_zeros = (a["zeros"] + b["zeros"]) / 2
    p = min(max(built_zeros, meta["zeros"], 1 / n), 1 - 1 / n)
    se_zeros = pair * math.sqrt(p * (1 - p) / n)
    return {
        "std": Deviation(
            abs(math.log(meta["std"] / built_std)), se_log, Z * se_log + math.log1p(REL_TOL)
        ),
        "mean": Deviation(
            abs(meta["mean"] - (a["mean"] + b["mean"]) / 2), se_mean, Z * se_mean + REL_TOL * scale
        ),
        "zeros": Deviation(abs(meta["zeros"] - built_zeros), se_zeros, Z * se_zeros + ZEROS_TOL),
    }


def judge_tensor(a: TensorStats, b: TensorStats, meta: TensorStats) -> str | None:
    """Whether ``meta`` is a draw of the factory's distribution (:func:`deviations`, each
    within its bound); None, or what differs, with both figures."""
    built_std = math.sqrt((a["std"] ** 2 + b["std"] ** 2) / 2)
    if built_std == 0 or meta["std"] == 0:
        if built_std == meta["std"]:
            return None  # constant in every draw, the constant depending on the seed
        return f"std {meta['std']:.4g} after meta init vs {built_std:.4g} as built" + (
            " (constant after meta init)" if meta["std"] == 0 else " (constant as built)"
        )
    found = deviations(a, b, meta)
    if found["std"].deviation > found["std"].bound:
        return (
            f"std {meta['std']:.4g} after meta init vs {built_std:.4g} as built "
            f"({_ratio(meta['std'], built_std)})"
        )
    if found["mean"].deviation > found["mean"].bound:
        built_mean = (a["mean"] + b["mean"]) / 2
        return f"mean {meta['mean']:.4g} after meta init vs {built_mean:.4g} as built"
    if found["zeros"].deviation > found["zeros"].bound:
        built_zeros = (a["zeros"] + b["zeros"]) / 2
        return (
            f"{meta['zeros']:.1%} exact zeros after meta init vs {built_zeros:.1%} as built "
            f"(std {meta['std']:.4g} vs {built_std:.4g})"
        )
    return None
