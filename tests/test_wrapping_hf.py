"""The wrap claim on a transformers model with dropout and tied embeddings (GPT-2-style,
``fsdp_conformance.hf_models``): parity compares the model without its dropout, and the mixed
per-unit configuration keeps tied modules in one unit (or skips on every rank with the reason).
Negative controls run on the same model: a fault still fails with dropout switched off."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_conformance.claims.wrap.mixed import rank_mixed, verdict_mixed
from fsdp_conformance.claims.wrap.train import rank_train, verdict_train
from fsdp_conformance.fsdp.determinism import disable_dropout, forward_randomness
from fsdp_conformance.harness import CheckSkipped, RankContext, Ranks
from fsdp_conformance.models.model_spec import ModelSpec

pytest.importorskip(
    "transformers",
    reason="the Hugging Face reference models need the hf extra "
    "(pip install 'fsdp-conformance[hf]')",
)

VERSIONS = ("fsdp1", "fsdp2")
GPT2 = ModelSpec(
    reference=None, factory="fsdp_conformance.hf_models:gpt2", block_cls=("GPT2Block",)
)
#: GPT-2's dropout: the embedding's, and per block (two by default) attention, residual and MLP
#: dropout modules; and its config's probabilities (resid, embd, attn, summary_first_dropout),
#: which transformers' modules may read at forward time.
GPT2_DROPOUT = 1 + 3 * 2 + 4


# --------------------------------------------------------------------------------------------
# Dropout is off for the comparison, on both sides
# --------------------------------------------------------------------------------------------


def test_disable_dropout_reaches_modules_and_functional_probabilities() -> None:
    import transformers

    from fsdp_conformance import hf_models
    from fsdp_conformance.models.model_spec import make_batch

    # The models' weights and batches from a fixed seed: the randomness measured below depends
    # on them (from whatever RNG state earlier tests left, GPT-2's once measured 4.5e-5).
    torch.manual_seed(0)
    gpt2 = hf_models.gpt2(num_layers=2)
    # Llama's attention dropout is functional: a float passed as dropout= when self.training.
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            attention_dropout=0.3,
            bos_token_id=0,
            eos_token_id=1,
        )
    )
    for model, expected in (
        (gpt2, {"transformer.drop", "transformer.h.1.attn.attn_dropout"}),
        (
            llama,
            {
                "model.layers.0.self_attn.attention_dropout",
                "model.layers.1.self_attn.attention_dropout",
            },
        ),
    ):
        batch = make_batch(model)
        assert forward_randomness(model, batch) > 1e-4  # the negative control: random before
        changed = disable_dropout(model)
        assert expected <= set(changed)
        assert forward_randomness(model, batch) == 0.0
        assert model.training  # p = 0, not eval(): training branches stay what is trained
        assert disable_dropout(model) == []  # nothing left above 0


class _Noisy(nn.Module):
    """Randomness the switch cannot reach: noise added in training, under no dropout name."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(h + 0.1 * torch.randn_like(h) if self.training else h)


def test_randomness_left_after_disabling_is_seen() -> None:
    model = _Noisy()
    batch = torch.randint(0, 64, (2, 8))
    assert disable_dropout(model) == []
    before = torch.get_rng_state()
    assert forward_randomness(model, batch) > 1e-4
    assert torch.equal(torch.get_rng_state(), before)  # the probe leaves the RNG as it was


@pytest.mark.world_size(2)
def test_training_parity_on_a_dropout_model_says_dropout_was_disabled(ranks: Ranks) -> None:
    # Before: loss rel diff 4.7e-3, update rel diff 0.59 (the masks differed between sides).
    for version in VERSIONS:
        params = {"spec": GPT2, "version": version, "precision": "fp32"}
        values = ranks.run(rank_train, **params)
        verdict = verdict_train(values, params)
        assert verdict.passed, verdict.message
        assert f"dropout disabled for the comparison: {GPT2_DROPOUT} settings" in verdict.message
        assert verdict.figures["dropout_disabled"] == GPT2_DROPOUT
        assert all(len(v["dropout_disabled"]) == GPT2_DROPOUT for v in values)


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    "fault, message",
    [
        ("summed_grads", "'s update differs from the reference's by"),
        ("permuted_shard", "differs from the reference by"),
    ],
)
def test_negative_controls_still_fail_on_a_dropout_model(
    ranks: Ranks, fault: str, message: str
) -> None:
    for version in VERSIONS:
        params = {"spec": GPT2, "version": version, "precision": "fp32", "fault": fault}
        verdict = verdict_train(ranks.run(rank_train, **params), params)
        assert not verdict.passed, f"{version} {fault}: {verdict.message}"
        assert message in verdict.message
        assert "dropout disabled for the comparison" in verdict.message


class _NoisySpec(ModelSpec):
    def build(self, device: str | torch.device | None = None) -> nn.Module:
        return _Noisy()


def test_parity_skips_when_randomness_cannot_be_switched_off() -> None:
    # The probe runs before anything is sharded, so one in-process rank shows the skip; every
    # rank builds the same model from the same seed and skips alike.
    ctx = RankContext(rank=0, world_size=2, local_rank=0, backend="gloo", device_type="cpu")
    with pytest.raises(
        CheckSkipped,
        match="still draws random numbers after dropout was "
        r"disabled \(0 settings\): two calls on the same input differ",
    ):
        rank_train(ctx, _NoisySpec(reference="massive"), version="fsdp2")


# --------------------------------------------------------------------------------------------
# Tied embeddings in the mixed per-unit configuration
# --------------------------------------------------------------------------------------------


@pytest.mark.world_size(2)
def test_mixed_configuration_keeps_a_tied_head_in_the_embedding_unit(ranks: Ranks) -> None:
    # Before: FSDP2 raised "Parameter 'transformer.wte.weight' is shared with a parameter
    # already managed by another FSDP group"; FSDP1 failed (GPT-2's Conv1D was not recorded).
    params = {"spec": GPT2, "version": "fsdp2"}
    values = ranks.run(rank_mixed, **params)
    verdict = verdict_mixed(values, params)
    assert verdict.passed, verdict.message
    assert "(one unit with the tied lm_head)" in verdict.message
    for v in values:
        assert v["tied"] == {"lm_head": {"same_unit": True, "still_tied": True}}
        assert v["strategies"]["lm_head"] == v["strategies"]["transformer.wte"] == "NO_SHARD"
        assert v["compute_dtypes"]["lm_head"][1] == "torch.float32"
        # Conv1D (a matrix weight, not an nn.Linear) is recorded: the blocks really ran bf16.
        assert v["compute_dtypes"]["transformer.h.0.attn.c_attn"] == (
            "torch.bfloat16",
            "torch.bfloat16",
        )


@pytest.mark.world_size(2)
def test_mixed_configuration_skips_fsdp1_on_a_tied_model_with_the_reason(ranks: Ranks) -> None:
    with pytest.raises(
        CheckSkipped,
        match=r"transformer.wte's weight is tied to lm_head\. "
        r"FSDP1 units follow the module tree.*here the root \(GPT2LMHeadModel\)",
    ):
        ranks.configured(skip=None).run(rank_mixed, spec=GPT2, version="fsdp1")
