"""Shrinking a config (nested sub-configs included) to one that builds a tiny model.

Generic rules first, applied to every sub-config dict (``config_rules``; a few layers kept, one
of each kind, with their per-layer lists cut to match), then the relations the modeling code
relies on, special token ids moved into the tiny vocabulary, the per-type tables
(``overrides``), and last the config class rebuilds itself from the dict, recomputing what it
derives.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any

from transformers import PretrainedConfig

from liger_patch.verify.config_rules import (
    TinyModelError,
    declared_defaults,
    derived_sizes,
    drop_base_defaults,
    fill_missing,
    fit_image_layout,
    fit_kv_heads,
    fit_mamba,
    fit_mla,
    fit_rope,
    fit_vision,
    fit_vqgan,
    head_dim_of,
    is_int,
    model_type_of,
    short,
    shrunk_value,
    sub_dicts,
    sub_dicts_with_class,
    type_key,
)
from liger_patch.verify.overrides import CONFIG_FIXES, MROPE_SECTIONS, NEEDED_TOKEN_IDS, OVERRIDES
from liger_patch.verify.sizes import LAYER_KEYS, LAYERS, TOKEN_ID_RE, VOCAB


def tiny_config(config: PretrainedConfig) -> PretrainedConfig:
    """A shrunk copy of ``config`` (nested sub-configs included) that builds a tiny model.

    Works on the config's dict form and rebuilds the config from it, so that the config's own
    ``__init__`` recomputes whatever it derives (default layer types, head dims, sub-configs).
    """
    tree = copy.deepcopy(config.to_dict())
    tokens = TokenIds(text_vocab_after_shrink(tree), tree)
    for sub, cls in sub_dicts_with_class(tree, config):
        _shrink_dict(sub, cls)
    _fit_tree(tree, tokens)
    return _rebuilt(config, tree)


def _fit_tree(tree: dict[str, Any], tokens: TokenIds) -> None:
    """After every dict is shrunk: token ids into the tiny vocabulary, image settings fitted to
    the shrunk vision tower, then the per-type tables (they have the last word)."""
    for sub in sub_dicts(tree):
        remap_token_ids(sub, tokens)
    add_missing_token_ids(tree, tokens)
    fit_image_layout(tree)
    for sub in sub_dicts(tree):
        _apply_overrides(sub)


def _rebuilt(config: PretrainedConfig, tree: dict[str, Any]) -> PretrainedConfig:
    """``config``'s class built from the shrunk dict, without the keys tied to a checkpoint."""
    for key in ("dtype", "torch_dtype", "_name_or_path", "transformers_version", "architectures"):
        tree.pop(key, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return type(config)(**tree)
        except Exception as err:
            raise TinyModelError(f"{model_type_of(config)}: tiny config rejected: {short(err)}") from err


def _shrink_dict(d: dict[str, Any], cls: type | None) -> None:
    """Apply the generic size rules to one (sub)config dict of config class ``cls``, in place."""
    old = dict(d)
    old_head_dim = head_dim_of(d)
    defaults = declared_defaults(cls) if cls is not None else {}
    drop_base_defaults(d, defaults)
    select_layers(d)
    _shrink_values(d, defaults)
    fill_missing(d)
    _fit_relations(d, old, old_head_dim)


def _shrink_values(d: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Every value to its tiny size; sizes the class derives are reset to None (a declared
    field) or dropped (not a field), for the class to compute again from the tiny sizes."""
    derived = derived_sizes(d, defaults)
    for key, value in list(d.items()):
        if key in derived and key not in defaults:
            del d[key]
            continue
        new = None if key in derived else shrunk_value(key, value)
        if new is not value:
            d[key] = new


def _fit_relations(d: dict[str, Any], old: dict[str, Any], old_head_dim: int | None) -> None:
    """The relations between sizes the modeling code relies on, against the dict before shrinking."""
    fit_kv_heads(d, old)
    fit_mamba(d)
    fit_mla(d, old)
    fit_rope(d, old_head_dim)
    fit_vision(d)
    fit_vqgan(d)


def _apply_overrides(d: dict[str, Any]) -> None:
    """The per-type values of ``OVERRIDES`` and ``MROPE_SECTIONS`` for this dict's type."""
    sections = MROPE_SECTIONS.get(type_key(d))
    if sections is not None:
        _set_rope_sections(d, sections)
    fix = CONFIG_FIXES.get(type_key(d))
    if fix is not None:
        fix(d)
    for path, value in OVERRIDES.get(type_key(d), {}).items():
        target = d
        *parents, leaf = path.split(".")
        for part in parents:
            target = target.setdefault(part, {})
        target[leaf] = value


def _set_rope_sections(d: dict[str, Any], sections: list[int]) -> None:
    """Put ``mrope_section`` in the rope dict: ``rope_parameters`` (transformers 5) or
    ``rope_scaling`` (4.x, where a None default must become a dict)."""
    key = "rope_parameters" if "rope_parameters" in d else "rope_scaling"
    rope = dict(d.get(key) or {})
    rope.setdefault("rope_type", "default")
    rope["mrope_section"] = sections
    d[key] = rope


def select_layers(d: dict[str, Any]) -> None:
    """Keep a few layers, one of each distinct kind, and cut the per-layer lists to match.

    A layer's kind is its entry in every per-layer list (``layer_types``, ``no_rope_layers``,
    ...) plus its membership in every layer-index list (``cross_attention_layers``, ...), so a
    hybrid model keeps one attention and one mamba layer and index lists stay non-trivial.
    """
    key = next((k for k in LAYER_KEYS if is_int(d.get(k))), None)
    if key is None:
        return
    total = d[key]
    per_layer = {k: v for k, v in d.items() if _is_per_layer(k, v, total)}
    index_lists = {k: v for k, v in d.items() if k not in per_layer and _is_index_list(k, v, total)}
    overrides = {int(k): v for k, v in (d.get("per_layer_config") or {}).items()}
    keep = _layers_to_keep(total, per_layer, index_lists, overrides)
    _cut_layer_lists(d, keep, per_layer, index_lists)
    if overrides:
        d["per_layer_config"] = {
            str(new): _shrunk_layer(overrides[old], d) for new, old in enumerate(keep) if old in overrides
        }
    _cut_layer_counts(d, keep, total)


def _cut_layer_lists(
    d: dict[str, Any], keep: list[int], per_layer: dict[str, Any], index_lists: dict[str, list[int]]
) -> None:
    """Per-layer lists reduced to the kept layers; index lists renumbered to them."""
    for k, v in per_layer.items():
        d[k] = type(v)(v[i] for i in keep) if isinstance(v, list) else "".join(v[i] for i in keep)
    for k, v in index_lists.items():
        d[k] = [keep.index(i) for i in v if i in keep]


def _cut_layer_counts(d: dict[str, Any], keep: list[int], total: int) -> None:
    """The layer counts: the main count (and any equal to it) becomes the kept number, the
    others (a sub-stack's count) at most ``LAYERS``."""
    for k in LAYER_KEYS:
        if is_int(d.get(k)):
            d[k] = len(keep) if d[k] == total else min(d[k], LAYERS)


def _layers_to_keep(
    total: int, per_layer: dict[str, Any], index_lists: dict[str, list[int]], overrides: dict[int, Any]
) -> list[int]:
    """Indices of the first layer of each kind, topped up to ``LAYERS`` layers."""
    if total <= LAYERS:
        return list(range(total))
    kinds: dict[tuple, int] = {}
    for i in range(total):
        kind = tuple(tuple(v[i]) if isinstance(v[i], list) else v[i] for v in per_layer.values())
        kind += tuple(i in v for v in index_lists.values())
        kind += (repr(overrides.get(i)),)
        kinds.setdefault(kind, i)
    keep = sorted(kinds.values())
    extra = [i for i in range(total) if i not in keep]
    return sorted(keep + extra[: max(0, LAYERS - len(keep))])


def _shrunk_layer(layer: dict[str, Any], parent: dict[str, Any]) -> dict[str, Any]:
    """One ``per_layer_config`` entry, shrunk like its parent config."""
    old = {**parent, **layer}
    new = {k: shrunk_value(k, v) for k, v in layer.items()}
    merged = {**parent, **new}
    fit_kv_heads(merged, old)
    return {k: merged[k] for k in layer}


def _is_per_layer(key: str, value: Any, total: int) -> bool:
    """Whether ``value`` holds one entry per layer (a list, or a pattern string)."""
    if isinstance(value, str):
        return len(value) == total and total > 1 and ("pattern" in key or "layout" in key)
    if not isinstance(value, list) or len(value) != total or "token" in key:
        return False
    return not _is_index_list(key, value, total) or total < 3


def _is_index_list(key: str, value: Any, total: int) -> bool:
    """Whether ``value`` is a strictly increasing list of layer indices."""
    if not isinstance(value, list) or not value or not all(is_int(v) for v in value) or "token" in key:
        return False
    if not any(part in key for part in ("layer", "idx", "index", "indexes", "indices", "ids")):
        return False
    return all(0 <= v < total for v in value) and all(a < b for a, b in zip(value, value[1:], strict=False))


def text_vocab_after_shrink(tree: dict[str, Any]) -> int:
    """The text vocabulary size the shrunk config will have (token ids must stay below it)."""
    sizes = [sub["vocab_size"] for sub in sub_dicts(tree) if isinstance(sub.get("vocab_size"), int)]
    if not sizes:
        return VOCAB
    return min(max(sizes), VOCAB)


class TokenIds:
    """Special token ids moved into the tiny vocabulary: one map for the whole config tree, so an
    id shared by the top config and its text config (``image_token_id``) moves to the same new
    value in both; new ids are taken from the top of the vocabulary, skipping ids in use."""

    def __init__(self, vocab: int, tree: dict[str, Any]) -> None:
        self.vocab = vocab
        self.moved: dict[int, int] = {}
        self.used = {i for i in token_id_values(tree) if 0 <= i < vocab}
        self.next_free = vocab - 1

    def remap(self, value: int) -> int:
        """``value`` if it is a valid id, else the id it moves to."""
        if 0 <= value < self.vocab:
            return value
        if value not in self.moved:
            self.moved[value] = self.fresh()
        return self.moved[value]

    def fresh(self) -> int:
        """An id no special token uses yet."""
        while self.next_free in self.used:
            self.next_free -= 1
        if self.next_free < 0:
            raise TinyModelError(f"more special tokens than the {self.vocab} ids of the tiny vocabulary")
        self.used.add(self.next_free)
        return self.next_free


def token_id_values(tree: dict[str, Any]) -> Iterator[int]:
    """Every special token id named in a config dict tree."""
    for sub in sub_dicts(tree):
        for key, value in sub.items():
            if not TOKEN_ID_RE.search(key) or "layer" in key:
                continue
            if is_int(value):
                yield value
            elif isinstance(value, list):
                yield from (v for v in value if is_int(v))


def remap_token_ids(d: dict[str, Any], tokens: TokenIds) -> None:
    """Move the special token ids of one (sub)config dict into the tiny vocabulary."""
    for key, value in list(d.items()):
        if not TOKEN_ID_RE.search(key) or "layer" in key:
            continue
        if is_int(value):
            d[key] = tokens.remap(value)
        elif isinstance(value, list) and all(is_int(v) for v in value):
            d[key] = [tokens.remap(v) for v in value]


def add_missing_token_ids(tree: dict[str, Any], tokens: TokenIds) -> None:
    """Give a fresh id to placeholder tokens a model needs but its default config leaves unset.

    Blip-2 style models match ``image_token_index`` in the ids: left None, no image is placed.
    """
    for sub in sub_dicts(tree):
        names = [*NEEDED_TOKEN_IDS.get(type_key(sub), ())]
        if sub is tree and "vision_config" in tree:
            names += [k for k in ("image_token_id", "image_token_index") if k in sub]
        for name in names:
            if sub.get(name) is None:
                sub[name] = tokens.fresh()
