"""Shrinking a config (nested sub-configs included) to one that builds a tiny model.

Generic rules first, applied to every sub-config dict (``shrink_rules``, ``layer_selection``),
then the relations the modeling code relies on (``relations``), special token ids moved into
the tiny vocabulary (``token_ids``), the per-type tables (``overrides``, ``config_fixes``), and
last the config class rebuilds itself from the dict, recomputing what it derives.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

from transformers import PretrainedConfig

from liger_patch.patching.tiny.config_fixes import CONFIG_FIXES
from liger_patch.patching.tiny.config_tree import model_type_of, sub_dicts, sub_dicts_with_class, type_key
from liger_patch.patching.tiny.errors import TinyModelError, short
from liger_patch.patching.tiny.layer_selection import select_layers
from liger_patch.patching.tiny.overrides import MROPE_SECTIONS, OVERRIDES
from liger_patch.patching.tiny.relations import (
    fit_image_layout,
    fit_kv_heads,
    fit_mamba,
    fit_mla,
    fit_rope,
    fit_vision,
    fit_vqgan,
)
from liger_patch.patching.tiny.shrink_rules import (
    declared_defaults,
    derived_sizes,
    drop_base_defaults,
    fill_missing,
    head_dim_of,
    shrunk_value,
)
from liger_patch.patching.tiny.token_ids import (
    TokenIds,
    add_missing_token_ids,
    remap_token_ids,
    text_vocab_after_shrink,
)


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
