"""The generic config rules: one (sub)config dict shrunk by attribute name, and the relations
between sizes that the modeling code relies on restored after it.

Also walking a config's dict form (its nested sub-config dicts and their types), the sizes a
config class derives itself (left for it to recompute), the generic keys an older sub-config
class rejects, and the values a default config leaves None that the modeling code divides by.
The relations: key/value heads dividing the heads, Mamba heads x head dim equal to the inner
size, MLA rope dims, RoPE sections and per-frequency factors for the new head dim, small images,
a VQ-GAN the GroupNorm accepts, and image settings fitted to the shrunk vision tower.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Iterator
from typing import Any

from transformers import PretrainedConfig

from liger_patch.verify.sizes import (
    DROPOUT_RE,
    EXPERT_KEYS,
    EXPERTS,
    FFN,
    HEAD_DIM,
    HEAD_DIM_KEYS,
    HEAD_KEYS,
    HEADS,
    HIDDEN,
    INT_CEILINGS,
    KV_HEAD_KEYS,
    KV_HEADS,
    LAYER_KEYS,
    PATCHES_PER_SIDE,
    TOKEN_ID_RE,
    TOP_K,
    TOP_K_KEYS,
    VOCAB,
    VQ_CODES,
    WIDTH_KEYS,
)


class TinyModelError(RuntimeError):
    """A tiny model or batch cannot be made for a type; the message says what did not fit."""


def short(err: BaseException, limit: int = 300) -> str:
    """A one-line, bounded rendering of an exception."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:limit]}"


def model_type_of(config: Any) -> str:
    """``model_type`` of a config object or dict."""
    if isinstance(config, dict):
        return str(config.get("model_type", "?"))
    return str(getattr(config, "model_type", "?"))


def type_key(config: Any) -> str:
    """``model_type`` as the tables here spell it: lower case, "_" for "-", no "Model" suffix.

    Versions spell a few types differently (``lfm2-vl`` / ``lfm2_vl``, ``EvollaModel`` /
    ``evolla``, ``Glm4vMoe_text`` / ``glm4v_moe_text``).
    """
    key = model_type_of(config).lower().replace("-", "_")
    return key[: -len("model")] if key.endswith("model") and not key.endswith("_model") else key


def sub_dicts(tree: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """``tree`` and every nested sub-config dict in it, parents first."""
    yield tree
    for key, value in tree.items():
        if isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
            yield from sub_dicts(value)


def sub_dicts_with_config(
    tree: dict[str, Any], config: Any
) -> Iterator[tuple[dict[str, Any], PretrainedConfig | None]]:
    """Like ``sub_dicts``, each dict paired with the config object it came from (None for a
    sub-config held as a plain dict)."""
    yield tree, config if isinstance(config, PretrainedConfig) else None
    for key, value in tree.items():
        if isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
            yield from sub_dicts_with_config(value, getattr(config, key, None))


def is_int(value: Any) -> bool:
    """True for a plain int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def drop_base_defaults(d: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Drop generic ``PretrainedConfig`` keys the class does not declare and that hold the
    generic default: some older sub-config classes reject them as unknown keyword arguments."""
    if not defaults:
        return
    for key, value in _base_config_dict().items():
        if key != "model_type" and key not in defaults and key in d and d[key] == value:
            del d[key]


@functools.lru_cache(maxsize=1)
def _base_config_dict() -> dict[str, Any]:
    """The dict form of a bare ``PretrainedConfig``."""
    return PretrainedConfig().to_dict()


def derived_sizes(d: dict[str, Any], defaults: dict[str, Any]) -> set[str]:
    """Size attributes the config class computes from others, to be left for it to recompute.

    A field declared ``= None`` that holds a number in a default config was computed by the
    config's ``__init__`` (``head_dim = hidden_size // num_attention_heads``), and so was a size
    that is not a declared field at all (Zamba2's ``attention_hidden_size = 2 * hidden_size``).
    Resetting the first to None and dropping the second lets the config compute them again from
    the tiny sizes, which keeps the relations the modeling code relies on.
    """
    if not defaults:
        return set()
    return {
        key
        for key, value in d.items()
        if defaults.get(key) is None and is_int(value) and _is_dimension(key) and not TOKEN_ID_RE.search(key)
    }


def _is_dimension(key: str) -> bool:
    """Whether ``key`` names a width (hidden, intermediate, head dim), not a count or a vocab."""
    if key in HEAD_DIM_KEYS or key in WIDTH_KEYS:
        return True
    return any(part in key for part in ("hidden", "intermediate", "ffn")) and not key.startswith("num_")


def declared_defaults(cls: type) -> dict[str, Any]:
    """Declared default of each config field (dataclass fields, or ``__init__`` keywords)."""
    if dataclasses.is_dataclass(cls):
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def head_dim_of(d: dict[str, Any]) -> int | None:
    """The attention head dim a config dict implies (explicit or hidden / heads)."""
    if is_int(d.get("head_dim")):
        return d["head_dim"]
    hidden, heads = d.get("hidden_size"), d.get("num_attention_heads")
    if is_int(hidden) and is_int(heads) and heads > 0:
        return hidden // heads
    return None


def shrunk_value(key: str, value: Any) -> Any:
    """The tiny value of one config attribute, or ``value`` itself when no rule applies."""
    if isinstance(value, bool):
        return value
    if isinstance(value, float) and DROPOUT_RE.search(key):
        return 0.0
    if isinstance(value, list) and value and all(is_int(v) for v in value):
        if "intermediate" in key or key in WIDTH_KEYS or key.endswith("channels"):
            return [shrunk_value(key, v) for v in value]
        if key.endswith("_sizes") and "hidden" in key:
            return [min(v, HIDDEN) for v in value]
        if key in HEAD_KEYS or key.endswith("heads_per_layer"):
            return [min(v, HEADS) for v in value]
        return value
    if not is_int(value):
        return value
    rule = _int_rule(key)
    return value if rule is None else min(value, rule) if value > 0 else value


def _int_rule(key: str) -> int | None:
    """The ceiling for an int attribute named ``key``, or None when it is not a size."""
    if key in INT_CEILINGS:
        return INT_CEILINGS[key]
    if key.startswith("num_") and key.endswith("layers"):
        return None
    if "vocab" in key and not key.endswith("offset"):
        return VOCAB
    if "intermediate" in key or "ffn" in key or key in ("d_ff", "dff", "d_inner", "dim_ff", "mlp_dim"):
        return FFN
    if key.endswith("channels") and key not in ("num_channels", "in_channels", "out_channels"):
        return HIDDEN
    if "hidden" in key and key.endswith(("_size", "_dim")):
        return HIDDEN
    return None


def fill_missing(d: dict[str, Any]) -> None:
    """Fill what the default config leaves None (head dim, key-value heads, expert counts).

    Several default configs rely on a checkpoint to set these, and the modeling code then
    divides by None. Also turns the KV cache off: a training step does not use it.
    """
    if d.get("use_cache") is True:
        d["use_cache"] = False
    experts = [k for k in EXPERT_KEYS if k in d]
    top_k = [k for k in TOP_K_KEYS if k in d]
    if any(is_int(d[k]) for k in experts + top_k):
        for key in experts + top_k:
            if d[key] is None:
                d[key] = EXPERTS if key in EXPERT_KEYS else TOP_K
    hidden, heads = d.get("hidden_size"), d.get("num_attention_heads")
    if "head_dim" in d and d["head_dim"] is None and is_int(hidden) and is_int(heads):
        d["head_dim"] = hidden // heads
    if "num_key_value_heads" in d and d["num_key_value_heads"] is None and is_int(heads):
        d["num_key_value_heads"] = min(KV_HEADS, heads)


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
