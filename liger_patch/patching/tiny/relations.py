"""Relations between shrunk sizes that the modeling code relies on, restored after the rules.

Key/value heads dividing the heads, Mamba heads x head dim equal to the inner size, MLA rope
dims, RoPE sections and per-frequency factors for the new head dim, small images, a VQ-GAN
the GroupNorm accepts, and image settings fitted to the shrunk vision tower.
"""

from __future__ import annotations

from typing import Any

from liger_patch.patching.tiny.config_names import KV_HEAD_KEYS, LAYER_KEYS
from liger_patch.patching.tiny.config_tree import is_int, sub_dicts
from liger_patch.patching.tiny.shrink_rules import head_dim_of
from liger_patch.patching.tiny.sizes import HEAD_DIM, HEADS, KV_HEADS, PATCHES_PER_SIDE, VQ_CODES


def fit_kv_heads(d: dict[str, Any], old: dict[str, Any]) -> None:
    """Shrink key/value heads keeping their relation to the attention heads.

    Multi-head stays multi-head (several MLA / MoE models require it), multi-query stays
    multi-query, grouped-query gets ``KV_HEADS`` groups.
    """
    key = next(
        (k for k in ("num_attention_heads", "num_heads", "n_head", "n_heads") if is_int(d.get(k))), None
    )
    if key is None:
        return
    heads, old_heads = d[key], old.get(key)
    for key in KV_HEAD_KEYS:
        kv = d.get(key)
        if not is_int(kv):
            continue
        if kv == old_heads:
            d[key] = heads
        elif kv == 1:
            d[key] = 1
        else:
            d[key] = KV_HEADS if heads % KV_HEADS == 0 else heads


# (heads, head dim, expand, explicit inner size) of Mamba-2 style mixers, whose heads times head
# dim must equal the inner size (``expand * hidden_size`` unless given).
_MAMBA_KEYS = (
    ("mamba_n_heads", "mamba_d_head", "mamba_expand", "mamba_d_ssm"),
    ("n_mamba_heads", "mamba_headdim", "mamba_expand", None),
    ("mamba_num_heads", "mamba_head_dim", "expand", None),
    ("num_heads", "head_dim", "expand", None),
)


_MAMBA_GROUP_KEYS = ("n_groups", "mamba_n_groups", "mamba_ngroups")


def fit_mamba(d: dict[str, Any]) -> None:
    """Mamba-2 mixers: heads * head_dim == inner size, groups dividing the heads."""
    hidden = d.get("hidden_size")
    for heads_key, dim_key, expand_key, inner_key in _MAMBA_KEYS:
        if not (is_int(d.get(heads_key)) and is_int(d.get(expand_key)) and is_int(hidden)):
            continue
        inner = d[expand_key] * hidden
        if inner_key is not None and is_int(d.get(inner_key)):
            d[inner_key] = inner
        if is_int(d.get(dim_key)):
            d[dim_key] = min(d[dim_key], HEAD_DIM)
            d[heads_key] = inner // d[dim_key]
        elif inner % d[heads_key]:
            d[heads_key] = HEADS
        for group_key in _MAMBA_GROUP_KEYS:
            if is_int(d.get(group_key)) and d[heads_key] % d[group_key]:
                d[group_key] = 1
    if d.get("use_mamba_kernels") is True:
        d["use_mamba_kernels"] = False


def fit_mla(d: dict[str, Any], old: dict[str, Any]) -> None:
    """Multi-head latent attention: keep ``head_dim == qk_rope_head_dim`` (the rotary's dim),
    ``qk_head_dim == qk_nope_head_dim + qk_rope_head_dim`` and the rotary fraction of the
    query/key head where the config had them."""
    rope = d.get("qk_rope_head_dim")
    if not is_int(rope):
        return
    if is_int(d.get("qk_nope_head_dim")) and "qk_head_dim" in d:
        d["qk_head_dim"] = d["qk_nope_head_dim"] + rope
    if is_int(d.get("head_dim")) and old.get("head_dim") == old.get("qk_rope_head_dim"):
        d["head_dim"] = rope
    elif (
        is_int(d.get("head_dim"))
        and old.get("head_dim") == old.get("qk_nope_head_dim", 0) + old["qk_rope_head_dim"]
    ):
        d["head_dim"] = d["qk_nope_head_dim"] + rope
    rope_params = d.get("rope_parameters")
    if isinstance(rope_params, dict) and "partial_rotary_factor" in rope_params:
        old_factor = old["qk_rope_head_dim"] / (old.get("qk_nope_head_dim", 0) + old["qk_rope_head_dim"])
        if abs(rope_params["partial_rotary_factor"] - old_factor) < 1e-6:
            rope_params["partial_rotary_factor"] = rope / (d.get("qk_nope_head_dim", 0) + rope)


def fit_rope(d: dict[str, Any], old_head_dim: int | None) -> None:
    """Rescale RoPE sections / per-frequency factors to the new head dim."""
    new_head_dim = head_dim_of(d)
    if not old_head_dim or not new_head_dim:
        return
    ratio = new_head_dim / old_head_dim
    for key in ("rope_parameters", "rope_scaling"):
        value = d.get(key)
        if isinstance(value, dict):
            _fit_rope_dict(value, ratio)


def _fit_rope_dict(rope: dict[str, Any], ratio: float) -> None:
    """One rope parameter dict (or a dict of them, one per layer type), in place."""
    for key, value in list(rope.items()):
        if isinstance(value, dict):
            _fit_rope_dict(value, ratio)
        elif isinstance(value, list) and value and all(is_int(v) for v in value) and "section" in key:
            rope[key] = _rescale_sections(value, ratio)
        elif isinstance(value, list) and value and all(isinstance(v, float) for v in value):
            size = max(1, round(len(value) * ratio))
            step = len(value) / size
            rope[key] = [value[int(i * step)] for i in range(size)]


def _rescale_sections(sections: list[int], ratio: float) -> list[int]:
    """Sections scaled by ``ratio`` whose sum is the scaled sum (largest remainder rounding)."""
    target = max(len(sections), round(sum(sections) * ratio))
    raw = [s * target / sum(sections) for s in sections]
    out = [max(1, int(r)) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - int(raw[i]), reverse=True)
    i = 0
    while sum(out) < target:
        out[order[i % len(order)]] += 1
        i += 1
    while sum(out) > target:
        j = max(range(len(out)), key=lambda k: out[k])
        out[j] -= 1
    return out


def fit_vision(d: dict[str, Any]) -> None:
    """Small images: a few patches per side, the patch size kept."""
    patch, image = d.get("patch_size"), d.get("image_size")
    if is_int(patch) and is_int(image) and image > patch * PATCHES_PER_SIDE:
        d["image_size"] = patch * PATCHES_PER_SIDE
    elif is_int(patch) and isinstance(image, list) and len(image) == 2:
        d["image_size"] = [min(image[0], patch * PATCHES_PER_SIDE), min(image[1], patch * PATCHES_PER_SIDE)]


def fit_vqgan(d: dict[str, Any]) -> None:
    """VQ-GAN image tokenizers (Chameleon, Emu3, Janus): 32 channels (their GroupNorm has 32
    groups), one block per level, three levels (4x downsampling), a 32-code codebook."""
    if "base_channels" not in d or "channel_multiplier" not in d:
        return
    d.update(base_channels=32, num_res_blocks=1, channel_multiplier=list(d["channel_multiplier"][:3]))
    for key in ("latent_channels", "embed_dim"):
        if is_int(d.get(key)):
            d[key] = min(d[key], 32)
    for key in ("num_embeddings", "codebook_size"):
        if is_int(d.get(key)):
            d[key] = VQ_CODES
    if "attn_resolutions" in d:
        d["attn_resolutions"] = []


def fit_image_layout(tree: dict[str, Any]) -> None:
    """Image settings of every (sub)config with a vision tower, fitted to the shrunk tower.

    LLaVA-NeXT's resolution grid is in pixels of the original tower; Gemma 3 pools the patch
    grid down to ``mm_tokens_per_image`` tokens, which must be a square dividing it; indices of
    the vision layers whose features are used must exist in the two-layer tower.
    """
    for parent in list(sub_dicts(tree)):
        vision = parent.get("vision_config")
        if not isinstance(vision, dict):
            continue
        side = vision.get("image_size")
        side = side[0] if isinstance(side, list) else side
        if parent.get("image_grid_pinpoints") and is_int(side):
            parent["image_grid_pinpoints"] = [[side, side], [side, 2 * side], [2 * side, side]]
        if is_int(parent.get("mm_tokens_per_image")):
            parent["mm_tokens_per_image"] = (PATCHES_PER_SIDE // 2) ** 2
        layers = next((vision[k] for k in LAYER_KEYS if is_int(vision.get(k))), None)
        if layers is None:
            continue
        for sub in sub_dicts(parent):
            for key, value in sub.items():
                if "feature_layer" in key:
                    sub[key] = _clamp_layer_index(value, layers)


def _clamp_layer_index(value: Any, layers: int) -> Any:
    """A hidden-state index (or list of them) valid for a tower of ``layers`` layers.

    Kept within -layers .. layers - 1, valid whether the index counts layers or the
    ``layers + 1`` hidden states; a list keeps its length because projector widths depend on it.
    """
    if isinstance(value, list):
        return [_clamp_layer_index(v, layers) for v in value]
    if not is_int(value):
        return value
    return max(value, -layers) if value < 0 else min(value, layers - 1)
