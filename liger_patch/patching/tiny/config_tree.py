"""Walking a config's dict form: its nested sub-config dicts, their types, plain int values."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from transformers import PretrainedConfig


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


def sub_dicts_with_class(tree: dict[str, Any], config: Any) -> Iterator[tuple[dict[str, Any], type | None]]:
    """Like ``sub_dicts``, each dict paired with the class of the config object it came from."""
    yield tree, type(config) if isinstance(config, PretrainedConfig) else None
    for key, value in tree.items():
        if isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
            yield from sub_dicts_with_class(value, getattr(config, key, None))


def is_int(value: Any) -> bool:
    """True for a plain int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)
