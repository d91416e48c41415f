"""Per-type config knowledge the generic rules cannot guess.

As values: set on a type's shrunk (sub)config (``OVERRIDES``), keyword arguments its bare
default config needs (``DEFAULT_KWARGS``), multimodal RoPE sections for the tiny head dim
(``MROPE_SECTIONS``), special token ids the modeling code reads but the default leaves unset
(``NEEDED_TOKEN_IDS``), and the types no tiny model can be built of here, with the reason
(``NO_TINY_MODEL``). As code (``CONFIG_FIXES``), fixes that depend on the dict's current content
(and so on the transformers version): layer-kind lists the default leaves to the checkpoint,
hybrid layouts that need more than one layer of a kind, the VQ image vocabulary of Chameleon /
Emu3.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from liger_patch.verify.sizes import (
    EXPERTS,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    LAYERS,
    PATCHES_PER_SIDE,
    ROPE_HEAD_DIM,
    TOP_K,
    VOCAB,
    VQ_CODES,
    VQ_SIDE,
)

# Per-type values the generic rules cannot guess, applied to the (sub)config of that
# ``model_type`` after the rules; dotted keys reach into nested sub-config dicts.
OVERRIDES: dict[str, dict[str, Any]] = {
    # default configs that leave required values to the checkpoint
    "cohere_compass_text": {
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
        }
    },
    "dbrx": {"attn_config.rope_theta": 1e4, "attn_config.clip_qkv": 8.0},
    "dots3_note_text": {"head_dim": HEAD_DIM + ROPE_HEAD_DIM},
    "dots1": {"n_routed_experts": EXPERTS, "num_experts_per_tok": TOP_K, "n_shared_experts": 1},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": HEAD_DIM,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
    },
    # LSH / local attention chunks must divide the sequence; axial positions multiply to it
    "reformer": {
        "is_decoder": True,
        "local_attn_chunk_length": 8,
        "lsh_attn_chunk_length": 8,
        "axial_pos_shape": [4, 4],
        "axial_pos_embds_dim": [16, 48],
        "max_position_embeddings": 16,
    },
    "xmod": {"default_language": "en_XX"},
    # ESM's default leaves its vocabulary to the checkpoint's token list
    "esm": {"vocab_size": VOCAB, "pad_token_id": 1},
    # hybrids whose layer kinds repeat with a period longer than two layers: one of each
    "jamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
    },
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # Evolla (4.x) runs its decoder through an eager attention without key/value head repeat
    "evolla": {"num_key_value_heads": HEADS},
    "transfo_xl": {"cutoffs": [64, 128], "tie_projs": [False, True, True], "div_val": 1},
    "step3p5": {"sliding_window": 16},
    "step3p7": {"sliding_window": 16},
    # Aria's projector maps a patch count to a query count: 16 patches (4 x 4) -> 4 queries
    "aria": {"projector_patch_to_query_dict": {"16": 4}},
    # Granite 4 vision: one deep-stack injection, spatial groups into the 2-layer LM
    "granite4_vision": {
        "downsample_rate": "1/2",
        "deepstack_layer_map": [[-1, 0]],
        "spatial_target_layers": [1, 1, 1, 1],
    },
    # Molmo 2's ViT adds one position embedding per patch: the patch count is fixed by it
    "molmo2_vision": {"num_position_embeddings": PATCHES_PER_SIDE**2},
    # the projector reads the 2 x 2 merged vision features
    "muse_glimmer": {"out_hidden_size": 4 * HIDDEN},
    "muse_spark": {"out_hidden_size": 4 * HIDDEN},
    # Mllama concatenates the last layer with the kept intermediate one (one, after the cut)
    "mllama_vision_model": {"vision_output_dim": 2 * HIDDEN},
    # timm vision towers: TimmWrapperConfig declares no sizes (the rules drop FastVLM's
    # undeclared hidden_size as derived) and the timm model's are in model_args, which the rules
    # do not reach; the projector reads hidden_size / model_args["embed_dim"]. A tiny model of
    # the same timm family instead (TimmWrapperModel builds it with pretrained=False, no
    # download). FastViT MCi widens its last stage 2x; PerceptionLM's PE ViT keeps its CLS token
    # and takes the 56 px images of the default 14 px patch (4 x 4 patches).
    "fast_vlm": {
        "vision_config.hidden_size": HIDDEN,
        "vision_config.model_args": {
            "inference_mode": True,
            "layers": (1, 1),
            "embed_dims": (HIDDEN // 4, HIDDEN // 2),
            "mlp_ratios": (2, 2),
            "se_downsamples": (False, False),
            "downsamples": (False, True),
            "pos_embs": (None, None),
            "token_mixers": ("repmixer", "repmixer"),
        },
    },
    "perception_lm": {
        "vision_config.architecture": "vit_pe_core_tiny_patch16_384",
        "vision_config.model_args": {
            "embed_dim": HIDDEN,
            "depth": LAYERS,
            "num_heads": HEADS,
            "patch_size": 14,
            "img_size": 14 * PATCHES_PER_SIDE,
            "ref_feat_shape": (PATCHES_PER_SIDE, PATCHES_PER_SIDE),
            "global_pool": "",
        },
    },
    # Llama 4's pixel shuffle (ratio 0.5) makes 4 * hidden channels for the adapter MLP
    "llama4_vision_model": {
        "intermediate_size": 4 * HIDDEN,
        "projector_input_dim": HIDDEN,
        "projector_output_dim": HIDDEN,
        "vision_output_dim": HIDDEN,
    },
}


# Keyword arguments for a type's default config where the bare default does not validate.
DEFAULT_KWARGS: dict[str, dict[str, Any]] = {
    "gemma4_assistant": {"hidden_size_per_layer_input": 0},
    # towers that are optional and absent by default (Phi-4 multimodal: in 4.x), built with defaults
    "gemma4": {"vision_config": {}},
    "gemma4_unified": {"vision_config": {}},
    "phi4_multimodal": {"vision_config": {}, "audio_config": {}},
}


# Multimodal RoPE sections (temporal, height, width) for the tiny head dim, per text config type:
# the modeling code falls back to sections sized for the original head dim when none are set.
MROPE_SECTIONS: dict[str, list[int]] = {
    **dict.fromkeys(
        (
            "qwen2_vl_text",
            "qwen2_5_vl_text",
            "paddleocr_vl_text",
            "qwen2_5_omni_text",
            "glm4v_text",
            "glm_ocr_text",
        ),
        [2, 3, 3],
    ),
    **dict.fromkeys(("qwen3_vl_text", "qwen3_vl_moe_text"), [3, 3, 2]),
    "hunyuan_vl_text": [2, 2, 2, 2],
    "ernie4_5_vl_moe_text": [3, 3, 2],
    # partial rotary (half the head dim)
    **dict.fromkeys(("glm4v_moe_text", "glm4vmoe_text"), [1, 1, 2]),
}


# Special token ids the modeling code reads but the default config does not define.
NEEDED_TOKEN_IDS: dict[str, tuple[str, ...]] = {
    "qwen2_5_omni_thinker": ("vision_start_token_id",),
    "qwen3_omni_moe_thinker": ("vision_start_token_id",),
    "udop": ("decoder_start_token_id",),
    "kosmos_2": ("image_token_id",),
    "instructblipvideo": ("video_token_index",),
    "vision_encoder_decoder": ("pad_token_id", "decoder_start_token_id"),
}


# Types no tiny model can be built of on a CPU machine without internet, with the reason (the sweep
# calls them unbuildable).
NO_TINY_MODEL: dict[str, str] = {
    "gemma3n": "the vision tower is a timm model (TimmWrapperModel), which needs timm and a hub download",
}


def _two_hybrid_layers(d: dict[str, Any]) -> None:
    """Zamba ties one shared transformer block across its hybrid layers: it needs two of them."""
    kinds = d.get("layers_block_type") or []
    plain = next((k for k in kinds if k != "hybrid"), "mamba")
    d["layers_block_type"] = [plain, "hybrid", "hybrid"]
    d["num_hidden_layers"] = 3


def _one_attention_pattern(d: dict[str, Any]) -> None:
    """GPT-Neo (4.x): ``attention_types`` repeats its pattern to the layer count; repeat it once."""
    if d.get("attention_types"):
        pattern = d["attention_types"][0][0]
        d["attention_types"] = [[pattern, 1]]
        d["num_layers"] = len(pattern)


def _mamba_and_attention(d: dict[str, Any]) -> None:
    """GraniteMoeHybrid (4.x) leaves its layer kinds to the checkpoint (all Mamba)."""
    for key in ("layer_types", "layers_block_type"):
        if key in d and d[key] is None:
            d[key] = ["mamba", "attention"]


def _dense_then_sparse(d: dict[str, Any]) -> None:
    """DeepSeek-OCR 2 leaves its per-layer MLP kinds to the checkpoint."""
    if "mlp_layer_types" in d and d["mlp_layer_types"] is None:
        d["mlp_layer_types"] = ["dense", "sparse"][: d.get("num_hidden_layers", LAYERS)]


def _default_rope_scaling(d: dict[str, Any]) -> None:
    """Mllama (4.x) indexes ``rope_scaling`` even when the default leaves it None."""
    if "rope_scaling" in d and d["rope_scaling"] is None:
        d["rope_scaling"] = {"rope_type": "default"}


def _vq_image_vocabulary(d: dict[str, Any]) -> None:
    """Chameleon / Emu3: the map from the (tiny) VQ tokenizer's codes to text-vocabulary ids.

    The checkpoint's tokenizer provides ``vocabulary_map`` (names like ``IMGIMGBAZ`` or
    ``<|visual token 000001|>`` for each code, ``<image>`` for the placeholder); without it the
    model cannot place image tokens. Codes take the ids just below the middle of the vocabulary.
    """
    vq = d["vq_config"]
    emu3 = "codebook_size" in vq
    if emu3:
        vq.update(temporal_downsample_factor=1)
    else:
        vq.update(resolution=VQ_SIDE)
    first = VOCAB // 2 - VQ_CODES
    if emu3:
        codes = {f"<|visual token {code:06d}|>": first + code for code in range(VQ_CODES)}
        codes["<|extra_200|>"] = first - 2  # end of an image row
    else:
        codes = {
            "IMGIMG" + "".join(chr(ord("A") + int(c)) for c in str(code)) + "Z": first + code
            for code in range(VQ_CODES)
        }
    d["vocabulary_map"] = {"<image>": first - 1, **codes}
    d["image_token_id"] = first - 1


# Per-type fixes that depend on the dict's current content (and so on the transformers version).
CONFIG_FIXES: dict[str, Callable[[dict[str, Any]], None]] = {
    "chameleon": _vq_image_vocabulary,
    "deepseek_ocr2_text": _dense_then_sparse,
    "emu3": _vq_image_vocabulary,
    "gpt_neo": _one_attention_pattern,
    "granitemoehybrid": _mamba_and_attention,
    "mllama_text_model": _default_rope_scaling,
    "zamba": _two_hybrid_layers,
}
