"""``init.weights.faithful``: meta init gives the weights the model's factory gives.

The false PASS it rules out: a hand-written GPT that initializes its weights in ``__init__``
(nanoGPT's ``_init_weights``: normal 0.02, biases zero, the residual projections scaled by
``1 / sqrt(2 * layers)``; no ``reset_parameters`` of its own) passes every other ``init.*``
check while meta init gives it the modules' default init (embeddings std 1.0 instead of 0.02,
biases uniform instead of zero), because the suite's reference is built by the same meta path.

Negative controls: that model; an ``--init-fn`` that gets one tensor's scale wrong; the fault
``one_tensor_rescaled`` on the reference model. Positive controls: the same model with a faithful
``--init-fn``, the reference models and transformers models (their own init).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_conformance.claims import init
from fsdp_conformance.claims.check import Check, run_check
from fsdp_conformance.claims.init import faithful
from fsdp_conformance.claims.init.common import DEFAULT_SPEC
from fsdp_conformance.fsdp import distributions
from fsdp_conformance.harness import Ranks
from fsdp_conformance.models.catalog import REFERENCE_MODELS
from fsdp_conformance.models.model_spec import ModelSpec

LAYERS = 2


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.c_proj.residual = True  # what the user's --init-fn reads to scale it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for z in self.c_attn(x).split(d, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        return out


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = _Attention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.c_proj = nn.Linear(4 * dim, dim)
        self.c_proj.residual = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out: torch.Tensor = x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))
        return out


class NanoGPT(nn.Module):
    """nanoGPT's pattern: the init is in ``__init__`` (``apply(_init_weights)``, then the
    residual projections rescaled by name), with no ``reset_parameters`` of its own."""

    def __init__(self, vocab: int = 128, context: int = 32, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(context, dim)
        self.h = nn.ModuleList([Block(dim, heads) for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # tied, as nanoGPT ties them
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * LAYERS))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        out: torch.Tensor = self.lm_head(self.ln_f(x))
        return out


def nano_gpt() -> nn.Module:
    return NanoGPT()


def _nano_init(module: nn.Module, residual_scale: float) -> None:
    if isinstance(module, nn.Linear):
        std = 0.02 / math.sqrt(2 * LAYERS) if getattr(module, "residual", False) else 0.02
        nn.init.normal_(module.weight, std=std * residual_scale)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    elif isinstance(module, nn.LayerNorm):
        module.reset_parameters()


def faithful_init(module: nn.Module) -> None:
    """The user's --init-fn doing per module what NanoGPT.__init__ does."""
    _nano_init(module, 1.0)


def init_with_one_scale_wrong(module: nn.Module) -> None:
    """The same, but the residual projections drawn at twice their std."""
    _nano_init(module, 2.0 if getattr(module, "residual", False) else 1.0)


def _spec(init_fn: str | None = None) -> ModelSpec:
    return ModelSpec(
        reference=None, factory=f"{__name__}:nano_gpt", block_cls=("Block",), init_fn=init_fn
    )


NANO = _spec()
NANO_FAITHFUL = _spec(f"{__name__}:faithful_init")
NANO_ONE_WRONG = _spec(f"{__name__}:init_with_one_scale_wrong")
RESIDUALS = [
    f"h.{i}.{m}.c_proj.weight".replace("..", ".") for i in range(LAYERS) for m in ("attn", "")
]


def tiny_gpt2() -> nn.Module:
    from fsdp_conformance import hf_models

    return hf_models.gpt2(num_layers=2)


def tiny_bert() -> nn.Module:
    import transformers

    config = transformers.BertConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    return transformers.BertForMaskedLM(config)


def check() -> Check:
    (found,) = [c for c in init.CHECKS if c.name == "init.weights.faithful"]
    return found


def judged(spec: ModelSpec, seed: int = 0) -> faithful.Comparison:
    return faithful.compare_with_factory(spec, seed)


# ------------------------------------------------------------------------------------------
# Pure: the stated test on plain numbers, and the comparison on one process
# ------------------------------------------------------------------------------------------


def _stats(
    std: float, n: int = 4096, mean: float = 0.0, zeros: float = 0.0
) -> faithful.TensorStats:
    return {"numel": n, "mean": mean, "std": std, "kurtosis": 3.0, "zeros": zeros}


def test_the_stated_test_flags_a_scale_a_shift_and_zeros_and_accepts_noise() -> None:
    a, b = _stats(0.0200), _stats(0.0201)
    assert faithful.judge_tensor(a, b, _stats(0.0199)) is None  # iid noise at n = 4096
    assert faithful.judge_tensor(a, b, _stats(1.0)) == (
        "std 1 after meta init vs 0.02005 as built (49.9x)"
    )
    assert faithful.judge_tensor(a, b, _stats(0.02, mean=0.01)) is not None
    assert "exact zeros" in str(faithful.judge_tensor(a, b, _stats(0.02, zeros=0.5)))
    assert "constant after meta init" in str(faithful.judge_tensor(a, b, _stats(0.0)))
    # A small tensor's std is known only roughly: at n = 16 six standard errors reach about
    # 3.9x, so 40 % off is noise and 5x is not.
    small_a, small_b = _stats(0.1, n=16), _stats(0.12, n=16)
    assert faithful.judge_tensor(small_a, small_b, _stats(0.154, n=16)) is None
    assert faithful.judge_tensor(small_a, small_b, _stats(0.55, n=16)) is not None


def test_a_model_initializing_in_init_differs_from_its_meta_init() -> None:
    report = judged(NANO)
    by_name = {m["name"]: m for m in report["mismatches"]}
    # The tied embedding (std 1.0 vs 0.02), the position embedding, every projection, every
    # bias (zeros as built, uniform after meta init); the LayerNorms agree.
    assert "wte.weight" in by_name and "wpe.weight" in by_name
    wte = by_name["wte.weight"]
    assert wte["built"] is not None and wte["meta"] is not None
    assert 0.018 < wte["built"]["std"] < 0.022 and 0.9 < wte["meta"]["std"] < 1.1
    assert wte["detail"].startswith("std 0.9") and "as built (" in wte["detail"]
    bias = by_name["h.0.attn.c_attn.bias"]
    assert bias["deterministic"] and bias["detail"].startswith(
        "all zeros as built (the same for every seed), mean"
    )
    assert all(not n.startswith(("h.0.ln_", "ln_f")) for n in by_name)
    assert len(by_name) == 18  # 2 embeddings (one tied to lm_head) + 8 linears x (w, b)


def test_a_faithful_init_fn_passes_and_one_with_a_scale_wrong_is_named() -> None:
    for seed in range(3):
        assert judged(NANO_FAITHFUL, seed)["mismatches"] == [], seed
    wrong = judged(NANO_ONE_WRONG)
    assert sorted(m["name"] for m in wrong["mismatches"]) == sorted(RESIDUALS)
    for m in wrong["mismatches"]:  # "std 0.0198 after meta init vs 0.00999 as built (1.98x)"
        ratio = float(re.search(r"\(([0-9.]+)x\)$", m["detail"]).group(1))  # type: ignore[union-attr]
        assert 1.8 < ratio < 2.2, m["detail"]


@pytest.mark.parametrize("name", sorted(REFERENCE_MODELS))
def test_the_reference_models_are_faithful(name: str) -> None:
    spec = DEFAULT_SPEC if name == "llama" else ModelSpec(reference=name)
    for seed in range(3):
        report = judged(spec, seed)
        assert report["mismatches"] == [], (name, seed, report["mismatches"])
        assert report["by_distribution"] > 0


@pytest.mark.parametrize("factory", ["tiny_gpt2", "tiny_bert"])
def test_transformers_models_are_faithful(factory: str) -> None:
    spec = ModelSpec(reference=None, factory=f"{__name__}:{factory}")
    report = judged(spec)
    assert report["mismatches"] == [], report["mismatches"]
    # LayerNorm weights and biases are compared by value (ones and zeros for every seed).
    assert report["by_value"] > 0 and report["by_distribution"] > 0


# ------------------------------------------------------------------------------------------
# On ranks: the check as the suite runs it
# ------------------------------------------------------------------------------------------


@pytest.mark.world_size(2)
def test_the_check_fails_on_an_init_in_init_naming_the_fix(ranks: Ranks) -> None:
    verdict = run_check(ranks, check(), spec=NANO)
    assert not verdict.passed
    lines = verdict.message.splitlines()
    assert lines[0] == (
        "meta init (reset_parameters) does not give 18 of 28 tensors the values "
        f"{__name__}:nano_gpt's factory gives them (seeded, on CPU; 18 by value (the same "
        "for every seed as built), 10 by distribution):"
    )
    assert any(line.strip().startswith("wte.weight (Embedding): std 0.9") for line in lines)
    assert "as built (" in verdict.message and "x)" in verdict.message
    assert lines[-1].startswith(
        "fix: the model's construction overrides the reset_parameters() of Embedding, Linear "
        "(an init in __init__, as nanoGPT's _init_weights): name an --init-fn pkg.module:fn"
    )
    # torch's own classes: no reset_parameters() of the user's to define.
    assert "define reset_parameters()" not in lines[-1]
    assert verdict.figures["differ"] == 18


@pytest.mark.world_size(2)
def test_the_check_passes_with_a_faithful_init_fn_and_names_a_wrong_one(ranks: Ranks) -> None:
    good = run_check(ranks, check(), spec=NANO_FAITHFUL)
    assert good.passed, good.message
    assert good.message.startswith("meta init (init_fn) gives all 28 tensors the values")
    bad = run_check(ranks, check(), spec=NANO_ONE_WRONG)
    assert not bad.passed
    assert all(name in bad.message for name in RESIDUALS), bad.message
    assert f"fix: the init function '{__name__}:init_with_one_scale_wrong'" in bad.message


@pytest.mark.world_size(2)
def test_the_reference_model_passes_and_a_rescaled_tensor_fails(ranks: Ranks) -> None:
    good = run_check(ranks, check())
    assert good.passed, good.message
    bad = run_check(ranks, check(), fault="one_tensor_rescaled")
    assert not bad.passed
    assert bad.message.splitlines()[1].strip().startswith("tok_embeddings.weight (Embedding): std")
    assert bad.figures["differ"] == 1


class Scale(nn.Module):
    """A user's class whose ``__init__`` and ``reset_parameters()`` disagree (0.5 vs ones)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), 0.5))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def scaled_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), Scale(), nn.Linear(8, 8))


def test_a_class_whose_reset_parameters_disagrees_with_its_init_is_named() -> None:
    spec = ModelSpec(reference=None, factory=f"{__name__}:scaled_mlp", block_cls=("Linear",))
    report = judged(spec)
    (mismatch,) = report["mismatches"]
    assert mismatch["name"] == "1.weight" and mismatch["cls"] == "Scale"
    assert mismatch["detail"] == (
        "constant 0.5 as built (the same for every seed), all ones after meta init"
    )
    verdict = faithful.judge_comparisons([report], "reset_parameters", spec)
    assert not verdict.passed
    assert verdict.message.endswith(", or define reset_parameters() on Scale doing what it does")


def self_seeded_nano_gpt() -> nn.Module:
    """A factory that seeds itself (common in scripts): every tensor the same for every seed."""
    torch.manual_seed(1234)
    return NanoGPT()


def test_a_factory_that_seeds_itself_is_judged_by_distribution() -> None:
    # Its weights are seed-independent but random: compared by distribution, so a faithful
    # --init-fn passes (no false alarm) and the default init still fails, with the hint.
    def spec(init_fn: str | None) -> ModelSpec:
        factory = f"{__name__}:self_seeded_nano_gpt"
        return ModelSpec(reference=None, factory=factory, block_cls=("Block",), init_fn=init_fn)

    good = judged(spec(f"{__name__}:faithful_init"))
    assert good["mismatches"] == [] and good["by_distribution"] == 10
    bad = judged(spec(None))
    assert "wte.weight" in {m["name"] for m in bad["mismatches"]}
    verdict = faithful.judge_comparisons([bad], "reset_parameters", spec(None))
    assert "(the same for every seed as built)" in verdict.message
    assert "are the same for every seed as built but not constant: if the factory loads" in (
        verdict.message
    )


def test_a_model_too_large_to_build_twice_on_this_host_is_skipped_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert faithful.fits_in_host_memory(NANO, 2) is None  # 0.4 MiB: fits anywhere
    monkeypatch.setattr(faithful, "_available_host_bytes", lambda: 2**20)  # 1 MiB available
    reason = faithful.fits_in_host_memory(NANO, 2)
    assert reason is not None
    assert reason.startswith(
        f"building {__name__}:nano_gpt as its factory does (twice, on CPU, on each of 2 ranks)"
    )
    assert reason.endswith("run it on a smaller config of the model")


def test_statistics_over_chunks_equal_those_over_the_whole_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Chunks keep a large embedding's float64 temporaries at 32 MiB; here 1,000 elements.
    monkeypatch.setattr(distributions, "CHUNK", 1000)
    x = torch.randn(12345, generator=torch.Generator().manual_seed(0)) * 0.02 + 0.1
    x[:100] = 0
    stats = faithful.tensor_stats(x)
    d = x.double()
    centred = d - d.mean()
    var = float(centred.square().mean())
    assert stats["numel"] == 12345 and stats["zeros"] == 100 / 12345
    assert math.isclose(stats["mean"], float(d.mean()), rel_tol=1e-12)
    assert math.isclose(stats["std"], math.sqrt(var), rel_tol=1e-12)
    assert math.isclose(stats["kurtosis"], float(centred.pow(4).mean()) / var**2, rel_tol=1e-9)
    assert faithful.compare_by_value(x, x.clone()) is None
    assert faithful.compare_by_value(x, x * 1.001) is not None  # 1e-3 relative: past rtol 1e-5


@pytest.mark.world_size(2)
def test_fsdp1_default_path_says_it_does_not_use_the_init_fn(ranks: Ranks) -> None:
    (default_path,) = [c for c in init.CHECKS if c.name == "init.weights.default_path"]
    verdict = run_check(ranks, default_path, spec=NANO_FAITHFUL)
    assert verdict.passed, verdict.message  # the path itself is checked as it is
    assert verdict.message.endswith(
        f"; note: FSDP1's default path calls reset_parameters(), not the init function "
        f"'{__name__}:faithful_init' that initializes this model: its values are not the "
        "model's unless reset_parameters() gives the same (pass the init as param_init_fn "
        "instead)"
    )
    assert "note:" not in run_check(ranks, default_path, spec=NANO).message


def meta_only() -> nn.Module:
    """A factory that builds on meta and refuses a CPU build (as a too-large model would)."""
    if not torch.empty(0).is_meta:
        raise RuntimeError("out of host memory (simulated)")
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))


@pytest.mark.world_size(2)
def test_a_factory_failing_on_cpu_is_one_line_not_a_traceback(ranks: Ranks) -> None:
    spec = ModelSpec(reference=None, factory=f"{__name__}:meta_only", block_cls=("Linear",))
    verdict = run_check(ranks, check(), spec=spec)
    assert not verdict.passed
    assert verdict.message == (
        f"all ranks: model factory '{__name__}:meta_only' raised RuntimeError: out of host "
        "memory (simulated); fix the factory (it is called with no arguments)"
    )
