"""Shrink any transformers config to a tiny size with one generic field table (no per-model
tuning): every field the table names is set where the config has it, by name alone.

Sizes: 2 layers, width 64, 4 heads (2 key/value heads, dividing them), head dim 16, intermediate
128, vocabulary 256, 4 experts (2 per token), 32 x 32 images in 8 x 8 patches, 64 positions,
convolution stacks of 32 channels, hierarchical stages one block deep.
"""

from __future__ import annotations

from typing import Any

LAYERS = 2
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 128
VOCAB = 256
EXPERTS = 4
TOP_K = 2
IMAGE = 32
PATCH = 8
POSITIONS = 64
CHANNELS = 32

#: Depth fields: every spelling of "how many layers" the configs use (set by the factory's depth).
LAYER_FIELDS = (
    "num_hidden_layers",
    "num_layers",
    "n_layer",
    "n_layers",
    "num_decoder_layers",
    "num_encoder_layers",
    "encoder_layers",
    "decoder_layers",
)

#: Scalar fields and their tiny value, by name.
SCALARS: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "model_dim"), HIDDEN),
    **dict.fromkeys(("word_embed_proj_dim", "embedding_size", "output_hidden_size"), HIDDEN),
    **dict.fromkeys(("pooler_output_size", "projection_dim", "classifier_proj_size"), HIDDEN),
    **dict.fromkeys(
        (
            "num_attention_heads",
            "n_head",
            "n_heads",
            "num_heads",
            "encoder_attention_heads",
            "decoder_attention_heads",
        ),
        HEADS,
    ),
    **dict.fromkeys(
        ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"), KV_HEADS
    ),
    **dict.fromkeys(("head_dim", "d_kv", "kv_channels", "attention_head_size"), HEAD_DIM),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"), HEAD_DIM),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 32),
    **dict.fromkeys(
        (
            "intermediate_size",
            "d_ff",
            "n_inner",
            "ffn_dim",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "ffn_hidden_size",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "expert_intermediate_size",
        ),
        INTERMEDIATE,
    ),
    "vocab_size": VOCAB,
    **dict.fromkeys(
        ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), EXPERTS
    ),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "num_experts_per_token"), TOP_K),
    **dict.fromkeys(("n_group", "topk_group"), 1),
    "image_size": IMAGE,
    "patch_size": PATCH,
    **dict.fromkeys(
        (
            "max_position_embeddings",
            "n_positions",
            "n_ctx",
            "max_seq_len",
            "max_source_positions",
            "max_target_positions",
        ),
        POSITIONS,
    ),
    **dict.fromkeys(("num_conv_pos_embeddings", "num_conv_pos_embedding_groups"), 16),
    **dict.fromkeys(("codevector_dim", "proj_codevector_dim", "xvector_output_dim"), CHANNELS),
}

#: List fields (one entry per stage or per convolution): each entry replaced, length kept.
LISTS: dict[str, int] = {
    "depths": 1,
    "num_heads": 2,
    "conv_dim": CHANNELS,
    "tdnn_dim": CHANNELS,
}
#: List fields of widths that grow by stage: 16, 32, 64, ...
GROWING = ("hidden_sizes", "embed_dims", "widths", "hidden_dims")


def tiny_fields(defaults: Any, num_layers: int) -> dict[str, Any]:
    """The keyword arguments that shrink a config whose defaults are ``defaults``: only the
    fields it has, each set by the tables above; token ids moved inside the small vocabulary;
    per-layer lists dropped (the config makes them again at the new depth)."""
    values = vars(defaults)
    fields: dict[str, Any] = {}
    old_depth = values.get("num_hidden_layers")
    for name, value in values.items():
        if name in LAYER_FIELDS and _is_int(value):
            fields[name] = num_layers
        elif name in SCALARS and _is_int(value):
            fields[name] = SCALARS[name]
        elif name in LISTS and isinstance(value, (list, tuple)):
            fields[name] = [LISTS[name]] * len(value)
        elif name in GROWING and isinstance(value, (list, tuple)):
            fields[name] = [16 * 2**i for i in range(len(value))]
        elif name.endswith("_token_id") and _is_int(value) and value >= VOCAB:
            fields[name] = VOCAB - 1
        elif (
            isinstance(value, (list, tuple))
            and "layer" in name.lower()
            and old_depth is not None
            and len(value) == old_depth
        ):
            fields[name] = None
    if "num_key_value_heads" in fields and values.get("num_key_value_heads") == values.get(
        "num_attention_heads"
    ):
        fields["num_key_value_heads"] = HEADS  # plain multi-head attention stays so
    return fields


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
