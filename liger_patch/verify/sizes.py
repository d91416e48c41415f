"""The sizes of every tiny model, and which config attribute names hold which size.

One set of sizes for every family, so that widths agree across sub-configs without bookkeeping:
a projector reading ``vision_config.hidden_size`` and writing ``text_config.hidden_size`` sees 64
on both sides. The generic shrinking recognises a size by its attribute name, in whichever
(sub)config it appears: the tables below say which names are layer counts, widths, heads, head
dims, low ranks, expert counts, token ids and dropout rates, and the ceiling of each.
"""

from __future__ import annotations

import re

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
ROPE_HEAD_DIM = 8
FFN = 128
LAYERS = 2
VOCAB = 256
EXPERTS = 4
TOP_K = 2
LORA_RANK = 32
SMALL_RANK = 8
MAX_POSITIONS = 4096
PATCHES_PER_SIDE = 4
# Images of VQ tokenizers (Chameleon, Emu3): 16 px, 4 x 4 codes after 4x downsampling. Every
# codebook (image tokenizers, audio codecs) has 32 codes.
VQ_SIDE = 16
VQ_CODES = 32
# Leading positions of a batch's last row that are padding (attention_mask 0, label -100).
LEFT_PAD = 2


# Layer counts, the main one first (the others are checked in this order too).
LAYER_KEYS = (
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "num_layers",
    "decoder_layers",
    "encoder_layers",
    "num_decoder_layers",
    "num_encoder_layers",
    "layers",
    "depth",
    "conf_num_hidden_layers",
    "num_blocks",
    "num_layers_per_stack",
    "num_global_layers",
)


WIDTH_KEYS = frozenset(
    (
        "hidden_size",
        "d_model",
        "n_embd",
        "embed_dim",
        "dim",
        "hidden_dim",
        "embedding_size",
        "emb_dim",
        "embedding_dim",
        "word_embed_proj_dim",
        "input_embedding_size",
        "output_embedding_size",
        "projection_dim",
        "out_hidden_size",
        "projector_hidden_size",
        "hidden_size_global",
        "lru_width",
        "attention_hidden_size",
        "encoder_hidden_size",
        "text_hidden_size",
        "vision_hidden_size",
        "output_dim",
        "vision_output_dim",
        "projector_input_dim",
        "projector_output_dim",
        "image_token_embed_dim",
        "projection_hidden_size",
        "backbone_hidden_size",
        "merged_hidden_size",
        "adapter_out_dim",
        "adapter_in_dim",
        "adapter_input_size",
        "decoder_hidden_size",
        "patch_embed_hidden_size",
        "image_text_hidden_size",
        "mm_hidden_size",
        "projection_hidden_dim",
        "ple_embed_dim",
        "mm_embed_dim",
        "output_proj_dims",
        "hidden_size_per_layer_input",
        "router_hidden_size",
        "codebook_dim",
    )
)


HEAD_KEYS = frozenset(
    (
        "num_attention_heads",
        "n_head",
        "n_heads",
        "num_heads",
        "encoder_attention_heads",
        "decoder_attention_heads",
        "attention_heads",
        "num_encoder_attention_heads",
        "num_decoder_attention_heads",
        "resampler_n_heads",
        "swa_num_attention_heads",
        "num_sliding_attention_heads",
        "index_n_heads",
        "linear_num_heads",
        "linear_num_value_heads",
        "mamba_n_heads",
        "mamba_num_heads",
    )
)


KV_HEAD_KEYS = frozenset(
    (
        "num_key_value_heads",
        "num_kv_heads",
        "n_kv_heads",
        "multi_query_group_num",
        "num_query_groups",
        "linear_num_key_heads",
        "swa_num_key_value_heads",
    )
)


HEAD_DIM_KEYS = frozenset(
    (
        "head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "kv_channels",
        "d_head",
        "d_kv",
        "attention_head_size",
        "dim_head",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_head_dim",
        "resampler_head_dim",
        "swa_head_dim",
        "index_head_dim",
        "mamba_d_head",
        "mamba_head_dim",
        "mamba_headdim",
        "attention_head_dim",
        "resampler_dim_head",
    )
)


LORA_KEYS = frozenset(
    (
        "kv_lora_rank",
        "q_lora_rank",
        "o_lora_rank",
    )
)


RANK_KEYS = frozenset(
    (
        "laurel_rank",
        "adapter_rank",
        "gated_norm_rank",
        "hc_lowrank",
    )
)


EXPERT_KEYS = frozenset(
    (
        "num_experts",
        "num_local_experts",
        "n_routed_experts",
        "moe_num_experts",
        "n_experts",
    )
)


TOP_K_KEYS = frozenset(
    (
        "num_experts_per_tok",
        "top_k",
        "moe_topk",
        "num_experts_per_token",
        "moe_k",
    )
)


TOKEN_ID_RE = re.compile(r"(_token_id|_token_index|_token_ids|_id|_ids|_index|_idx)$")


DROPOUT_RE = re.compile(r"(dropout|_pdrop|drop_prob|layerdrop|drop_path|jitter)")


# Ceilings of the size attributes known by name (other names: see ``config_rules._int_rule``).
INT_CEILINGS: dict[str, int] = {
    **dict.fromkeys(WIDTH_KEYS, HIDDEN),
    **dict.fromkeys(HEAD_KEYS, HEADS),
    **dict.fromkeys(HEAD_DIM_KEYS, HEAD_DIM),
    **dict.fromkeys(LORA_KEYS, LORA_RANK),
    **dict.fromkeys(RANK_KEYS, SMALL_RANK),
    **dict.fromkeys(EXPERT_KEYS, EXPERTS),
    **dict.fromkeys(TOP_K_KEYS, TOP_K),
    "qk_rope_head_dim": ROPE_HEAD_DIM,
    "rotary_dim": ROPE_HEAD_DIM,
    "vocab_size": VOCAB,
    "decoder_vocab_size": VOCAB,
    "max_position_embeddings": MAX_POSITIONS,
    # an audio encoder's positions (Whisper takes exactly twice as many mel frames)
    "max_source_positions": 64,
    "n_positions": MAX_POSITIONS,
    "n_ctx": MAX_POSITIONS,
    "ssm_state_size": 16,
    "mamba_d_state": 16,
    "state_size": 16,
    "mamba_dt_rank": SMALL_RANK,
    "num_query_tokens": 4,
    "latent_query_num": 4,
    "n_group": 1,
    "num_expert_group": 1,
    "num_kv_shared_layers": 0,
    "topk_group": 1,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "zero_expert_num": 2,
    "mm_posemb_size": 64,
    "codebook_size": VQ_CODES,
    "position_embedding_size": 64,
}
