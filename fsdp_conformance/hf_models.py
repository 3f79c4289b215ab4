"""Reference Hugging Face models: small causal LMs built from transformers configs, no weights.

Each factory builds a randomly initialized model from a config alone (nothing is downloaded), so
the suite can run on the models most FSDP users train, the way a user would point it at theirs:
``fsdp-conformance run --model fsdp_conformance.hf_models:llama``. ``num_layers`` sets the depth:
two blocks by default, the fewest that still show each block as a unit of its own beside the
embeddings and the head (depth invariance builds its own depths), so that the three whole runs
fit the CPU lane.

- :func:`llama`: Llama-style, untied input and output embeddings, rotary embeddings, RMSNorm.
- :func:`gpt2`: GPT-2-style, tied embeddings (``lm_head.weight is wte.weight``), dropout 0.1.
- :func:`mixtral`: a mixture-of-experts causal LM (4 experts, 2 per token).

transformers is an optional dependency (the ``hf`` extra): importing this module without it
raises :class:`ModuleNotFoundError` naming the extra.
"""

from __future__ import annotations

from typing import Any

try:
    import transformers
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError(
        "fsdp_conformance.hf_models needs transformers: pip install 'fsdp-conformance[hf]'"
    ) from exc

#: The width every reference model shares: big enough for several FSDP units per block, small
#: enough for the CPU lane.
HIDDEN = 64
VOCAB = 256
HEADS = 4


def _small(**config: Any) -> dict[str, Any]:
    # Token ids the config names must lie inside the small vocabulary (transformers warns
    # otherwise): the reference models have no tokenizer, so 0 and 1 serve.
    return {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 1, **config}


def llama(num_layers: int = 2) -> transformers.PreTrainedModel:
    """A Llama-style causal LM with untied embeddings."""
    config = transformers.LlamaConfig(
        **_small(
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=num_layers,
            num_attention_heads=HEADS,
            num_key_value_heads=HEADS // 2,
            tie_word_embeddings=False,
        )
    )
    return transformers.LlamaForCausalLM(config)


def gpt2(num_layers: int = 2) -> transformers.PreTrainedModel:
    """A GPT-2-style causal LM: tied embeddings and dropout 0.1 (transformers' defaults)."""
    config = transformers.GPT2Config(
        **_small(
            n_embd=HIDDEN,
            n_layer=num_layers,
            n_head=HEADS,
            n_positions=64,
        )
    )
    return transformers.GPT2LMHeadModel(config)


def mixtral(num_layers: int = 2) -> transformers.PreTrainedModel:
    """A mixture-of-experts causal LM: 4 experts per block, 2 chosen per token."""
    config = transformers.MixtralConfig(
        **_small(
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=num_layers,
            num_attention_heads=HEADS,
            num_key_value_heads=HEADS // 2,
            num_local_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        )
    )
    return transformers.MixtralForCausalLM(config)


#: The reference factories by name (the tests and docs iterate over them).
FACTORIES = {"llama": llama, "gpt2": gpt2, "mixtral": mixtral}


# ---------------------------------------------------------------------------------------------
# More architectures, for the whole run on models no reference test names (ci/architectures.sh)
# ---------------------------------------------------------------------------------------------


def _untyped(**config: Any) -> dict[str, Any]:
    return config


def _layers(num_layers: int, **config: Any) -> dict[str, Any]:
    # pad_token_id inside the small vocabulary: some configs default to a large one.
    return _small(num_hidden_layers=num_layers, num_attention_heads=HEADS, pad_token_id=0, **config)


def bert(num_layers: int = 4) -> transformers.PreTrainedModel:
    """An encoder with a masked-LM head: the word embedding tied to the decoder, and the
    decoder's bias tied to the head's (two ties)."""
    config = transformers.BertConfig(
        **_layers(num_layers, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN),
        max_position_embeddings=64,
    )
    return transformers.BertForMaskedLM(config)


def t5(num_layers: int = 4) -> transformers.PreTrainedModel:
    """An encoder-decoder: one embedding shared by encoder, decoder and head, a learned
    relative position bias added to the attention scores."""
    config = transformers.T5Config(
        **_small(
            d_model=HIDDEN,
            d_ff=2 * HIDDEN,
            d_kv=HIDDEN // HEADS,
            num_heads=HEADS,
            num_layers=num_layers,
            pad_token_id=0,
            decoder_start_token_id=0,
        )
    )
    return transformers.T5ForConditionalGeneration(config)


def bloom(num_layers: int = 4) -> transformers.PreTrainedModel:
    """A tied decoder with a LayerNorm right after the embedding (outside the blocks)."""
    config = transformers.BloomConfig(
        **_small(hidden_size=HIDDEN, n_layer=num_layers, n_head=HEADS)
    )
    return transformers.BloomForCausalLM(config)


def falcon(num_layers: int = 4) -> transformers.PreTrainedModel:
    """A tied decoder with parallel attention and MLP."""
    config = transformers.FalconConfig(**_layers(num_layers, hidden_size=HIDDEN))
    return transformers.FalconForCausalLM(config)


def phi3(num_layers: int = 4) -> transformers.PreTrainedModel:
    """A decoder with fused QKV and gate-up projections."""
    config = transformers.Phi3Config(
        **_layers(
            num_layers, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_key_value_heads=HEADS
        )
    )
    return transformers.Phi3ForCausalLM(config)


def gemma2(num_layers: int = 4) -> transformers.PreTrainedModel:
    """A tied decoder whose config lists each layer's attention type (``layer_types``)."""
    config = transformers.Gemma2Config(
        **_layers(
            num_layers,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_key_value_heads=HEADS // 2,
            head_dim=HIDDEN // HEADS,
        )
    )
    return transformers.Gemma2ForCausalLM(config)


def qwen2_moe(num_layers: int = 4) -> transformers.PreTrainedModel:
    """A mixture of experts with a shared expert beside 4 routed ones (2 per token)."""
    config = transformers.Qwen2MoeConfig(
        **_layers(
            num_layers,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            moe_intermediate_size=HIDDEN,
            shared_expert_intermediate_size=HIDDEN,
            num_key_value_heads=HEADS // 2,
            num_experts=4,
            num_experts_per_tok=2,
        )
    )
    return transformers.Qwen2MoeForCausalLM(config)


def gpt_neox(num_layers: int = 4) -> transformers.PreTrainedModel:
    """A decoder with untied embeddings and partial rotary embeddings."""
    config = transformers.GPTNeoXConfig(
        **_layers(num_layers, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN)
    )
    return transformers.GPTNeoXForCausalLM(config)


def vit(num_layers: int = 4) -> transformers.PreTrainedModel:
    """A vision transformer classifying 32 x 32 images in 8 x 8 patches (its input:
    :func:`vit_pixels`, ``--input fsdp_conformance.hf_models:vit_pixels``)."""
    config = transformers.ViTConfig(
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=num_layers,
        num_attention_heads=HEADS,
        image_size=32,
        patch_size=8,
        **_untyped(num_labels=10),  # a PretrainedConfig keyword its typed signature leaves out
    )
    return transformers.ViTForImageClassification(config)


def vit_pixels(model: Any, batch_size: int, device: Any) -> dict[str, Any]:
    """:func:`vit`'s input: a batch of random images, the same on every rank."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(batch_size, 3, 32, 32, generator=generator).to(device)}


#: More architectures by name, each with the input builder its forward needs (None: token ids):
#: decoders, tied decoders, an encoder, an encoder-decoder, a vision model, a mixture of experts.
#: Four layers by default (the reference three have two, for the CPU lane's budget): at two,
#: the planner's loose activation working-set term outweighs Phi-3's sharded state and its
#: trust check reads the estimate as too loose (ratio 0.448 against 0.45; docs/planning.md).
ARCHITECTURES: dict[str, tuple[Any, str | None]] = {
    "bert": (bert, None),
    "t5": (t5, None),
    "bloom": (bloom, None),
    "falcon": (falcon, None),
    "phi3": (phi3, None),
    "gemma2": (gemma2, None),
    "qwen2_moe": (qwen2_moe, None),
    "gpt_neox": (gpt_neox, None),
    "vit": (vit, "fsdp_conformance.hf_models:vit_pixels"),
}
