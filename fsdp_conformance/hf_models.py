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
