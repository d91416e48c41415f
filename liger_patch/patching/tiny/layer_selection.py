"""Keeping a few layers of a config, one of each kind, with its per-layer lists cut to match."""

from __future__ import annotations

from typing import Any

from liger_patch.patching.tiny.config_names import LAYER_KEYS
from liger_patch.patching.tiny.config_tree import is_int
from liger_patch.patching.tiny.relations import fit_kv_heads
from liger_patch.patching.tiny.shrink_rules import shrunk_value
from liger_patch.patching.tiny.sizes import LAYERS


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
