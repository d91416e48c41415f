"""The generic size rules: the tiny value of one config attribute, judged by its name.

Also which sizes the config class derives itself (left for it to recompute), which generic
keys an older sub-config class rejects, and the values a default config leaves None that the
modeling code divides by.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

from transformers import PretrainedConfig

from liger_patch.patching.tiny.config_names import (
    DROPOUT_RE,
    EXPERT_KEYS,
    HEAD_DIM_KEYS,
    HEAD_KEYS,
    INT_CEILINGS,
    TOKEN_ID_RE,
    TOP_K_KEYS,
    WIDTH_KEYS,
)
from liger_patch.patching.tiny.config_tree import is_int
from liger_patch.patching.tiny.sizes import EXPERTS, FFN, HEADS, HIDDEN, KV_HEADS, TOP_K, VOCAB


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
