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
    sub_dicts_with_config,
    type_key,
)
from liger_patch.verify.overrides import CONFIG_FIXES, MROPE_SECTIONS, NEEDED_TOKEN_IDS, OVERRIDES
from liger_patch.verify.sizes import LAYER_KEYS, LAYERS, TOKEN_ID_RE, VOCAB, VQ_CODES


def tiny_config(config: PretrainedConfig) -> PretrainedConfig:
    """A shrunk copy of ``config`` (nested sub-configs included) that builds a tiny model.

    Works on the config's dict form and rebuilds the config from it, so that the config's own
    ``__init__`` recomputes whatever it derives (default layer types, head dims, sub-configs).
    """
    tree = copy.deepcopy(config.to_dict())
    tokens = TokenIds(text_vocab_after_shrink(tree), tree)
    for sub, sub_config in sub_dicts_with_config(tree, config):
        _shrink_dict(sub, sub_config)
    _fit_tree(tree, tokens)
    return _rebuilt(config, tree)


def _fit_tree(tree: dict[str, Any], tokens: TokenIds) -> None:
    """After every dict is shrunk: token ids and code ranges into the tiny vocabulary, image
    settings fitted to the shrunk vision tower, then the per-type tables (they have the last
    word)."""
    for sub in sub_dicts(tree):
        remap_token_ids(sub, tokens)
    add_missing_token_ids(tree, tokens)
    place_code_ranges(tree)
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


def _shrink_dict(d: dict[str, Any], config: PretrainedConfig | None) -> None:
    """Apply the generic size rules to one (sub)config dict of the object ``config``, in place."""
    old = dict(d)
    old_head_dim = head_dim_of(d)
    defaults = declared_defaults(type(config)) if config is not None else {}
    drop_base_defaults(d, defaults)
    select_layers(d, _entries_per_layer(d, config))
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


def select_layers(d: dict[str, Any], span: int = 1) -> None:
    """Keep a few layers, one of each distinct kind, and cut the per-layer lists to match.

    A layer's kind is its entry in every per-layer list (``layer_types``, ``no_rope_layers``,
    ...) plus its membership in every layer-index list (``cross_attention_layers``, ...), so a
    hybrid model keeps one attention and one mamba layer and index lists stay non-trivial. A
    layer is ``span`` consecutive entries of those lists (:func:`_entries_per_layer`). Counts
    that split the layers into sections keep adding up to the kept number, each section keeping
    a layer (:func:`_section_counts`).
    """
    key = next((k for k in LAYER_KEYS if is_int(d.get(k))), None)
    if key is None:
        return
    total = d[key]
    per_layer = {k: v for k, v in d.items() if _is_per_layer(k, v, total)}
    index_lists = {k: v for k, v in d.items() if k not in per_layer and _is_index_list(k, v, total)}
    overrides = {int(k): v for k, v in (d.get("per_layer_config") or {}).items()}
    sections = _section_counts(d, total)
    wanted = max(LAYERS, len(sections))
    keep = _layers_to_keep(total, (per_layer, index_lists, overrides), span, wanted)
    _cut_layer_lists(d, keep, per_layer, index_lists)
    if overrides:
        d["per_layer_config"] = {
            str(new): _shrunk_layer(overrides[old], d) for new, old in enumerate(keep) if old in overrides
        }
    _cut_layer_counts(d, keep, total)
    if len(keep) < total:
        _split_sections(d, sections, len(keep) // span, span)


def _entries_per_layer(d: dict[str, Any], config: PretrainedConfig | None) -> int:
    """How many consecutive entries of the dict's per-layer lists make one layer of ``config``.

    1, except where the dict form counts blocks rather than layers: Dory writes each layer as an
    attention entry and an MLP entry and doubles its layer counts to match, which its config
    halves back. Told apart by the main layer count: the dict's over the config object's.
    """
    key = next((k for k in LAYER_KEYS if is_int(d.get(k))), None)
    layers = getattr(config, key, None) if key is not None and config is not None else None
    if not is_int(layers) or layers <= 0 or d[key] <= layers or d[key] % layers:
        return 1
    return d[key] // layers


def _section_counts(d: dict[str, Any], total: int) -> dict[str, int]:
    """Counts that split the layers into consecutive sections (Dory: input, recurrent and output
    layers): two or more ``*layers`` counts besides the layer counts, adding up to ``total``;
    empty when the dict has none."""
    counts = {k: v for k, v in d.items() if "layers" in k and k not in LAYER_KEYS and is_int(v) and v > 0}
    return counts if len(counts) > 1 and sum(counts.values()) == total else {}


def _split_sections(d: dict[str, Any], sections: dict[str, int], layers: int, span: int) -> None:
    """The section counts over the ``layers`` kept layers: one layer each, the rest to the
    largest section."""
    if not sections:
        return
    largest = max(sections, key=sections.__getitem__)
    for key in sections:
        d[key] = span * (1 + (layers - len(sections) if key == largest else 0))


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


def _layers_to_keep(total: int, lists: tuple[dict, dict, dict], span: int, wanted: int) -> list[int]:
    """Entry indices of the first layer of each kind, topped up to ``wanted`` layers, a layer
    being ``span`` entries; ``lists`` are the per-layer lists, the index lists and the per-layer
    config overrides."""
    layers = total // span
    if layers <= wanted:
        return list(range(total))
    kinds: dict[tuple, int] = {}
    for layer in range(layers):
        kinds.setdefault(_layer_kind(range(layer * span, (layer + 1) * span), *lists), layer)
    keep = sorted(kinds.values())
    extra = [layer for layer in range(layers) if layer not in keep]
    keep = sorted(keep + extra[: max(0, wanted - len(keep))])
    return [layer * span + j for layer in keep for j in range(span)]


def _layer_kind(
    entries: range, per_layer: dict[str, Any], index_lists: dict[str, list[int]], overrides: dict[int, Any]
) -> tuple:
    """What tells a layer (its ``entries``) apart: its values in every per-layer list, whether
    each index list names it, and its per-layer config override."""
    kind: tuple = ()
    for i in entries:
        kind += tuple(tuple(v[i]) if isinstance(v[i], list) else v[i] for v in per_layer.values())
        kind += tuple(i in v for v in index_lists.values())
        kind += (repr(overrides.get(i)),)
    return kind


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
    An encoder-decoder shifts its labels right into the decoder's inputs, starting from
    ``decoder_start_token_id`` and writing ``pad_token_id`` for ignored labels (T5's default config
    in transformers 5 leaves the first to the checkpoint's generation config).
    """
    for sub in sub_dicts(tree):
        names = [*NEEDED_TOKEN_IDS.get(type_key(sub), ())]
        if sub is tree and "vision_config" in tree:
            names += [k for k in ("image_token_id", "image_token_index") if k in sub]
        if sub is tree and tree.get("is_encoder_decoder"):  # the decoder's first input, from labels
            names += ["decoder_start_token_id", "pad_token_id"]
        for name in names:
            if sub.get(name) is None:
                sub[name] = tokens.fresh()


def place_code_ranges(tree: dict[str, Any]) -> None:
    """Lay the vocabulary's code ranges end to end below the middle of the tiny vocabulary.

    A ``*_token_offset`` is where a codebook's codes (an image or audio tokenizer's) start in the
    vocabulary. Every codebook is shrunk to ``VQ_CODES`` codes, so each range gets that many
    ids, in the ranges' original order: the codes map inside the tiny vocabulary, and ranges
    that met still meet (Apertus 1.5 checks both).
    """
    offsets = [
        (sub[key], key, sub)
        for sub in sub_dicts(tree)
        for key in sub
        if key.endswith("_token_offset") and is_int(sub[key])
    ]
    offsets.sort(key=lambda offset: offset[0])
    first = VOCAB // 2 - len(offsets) * VQ_CODES
    for index, (_, key, sub) in enumerate(offsets):
        sub[key] = first + index * VQ_CODES
