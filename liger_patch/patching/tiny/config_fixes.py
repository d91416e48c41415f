"""Per-type config fixes that depend on the dict's current content (and so on the version).

Each takes one (sub)config dict of its type, after the generic shrinking, and edits it in
place: layer-kind lists the default leaves to the checkpoint, hybrid layouts that need more
than one layer of a kind, the VQ image vocabulary of Chameleon / Emu3.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from liger_patch.patching.tiny.sizes import LAYERS, VOCAB, VQ_CODES, VQ_SIDE


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
