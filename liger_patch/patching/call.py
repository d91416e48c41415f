"""Reading a ``*ForCausalLM.forward`` call: its arguments, which path it asks for, its targets.

The patched forward receives ``(*args, **kwargs)`` in the original's signature. This module turns
them into one ``call`` dict (:func:`bind_call`), decides whether the call fuses
(:func:`wants_fused_path`), takes out the fields the loss consumes (:func:`pop_loss_fields`)
and passes the rest to the decoder body as far as it accepts them (:func:`body_arguments`).
Targets and kept positions are built exactly as transformers builds them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from liger_patch.patching.lazy import lazy_imports
from liger_patch.patching.registry import ModelSpec

__all__ = [
    "LossFields",
    "bind_call",
    "body_arguments",
    "causal_targets",
    "keep_positions",
    "pop_loss_fields",
    "positional_names",
    "set_router_logits_flag",
    "targets_for",
    "wants_fused_path",
]


def positional_names(original: Callable) -> list[str]:
    """The names an unbound ``forward`` takes positionally, after ``self``."""
    parameters = list(inspect.signature(original).parameters.values())[1:]
    return [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]


def bind_call(names: list[str], args: tuple, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """``args`` matched to ``names``, plus ``kwargs``, as one dict; ``None`` for a call the
    original must reject itself (too many positional arguments, or one given twice)."""
    if len(args) > len(names) or any(name in kwargs for name in names[: len(args)]):
        return None
    call = dict(zip(names, args, strict=False))
    call.update(kwargs)
    return call


def wants_fused_path(model: nn.Module, labels: Any, skip_logits: bool | None) -> bool:
    """Training with labels fuses; ``skip_logits`` (sent by HF's Trainer) overrides the mode."""
    if skip_logits is None:
        return model.training and labels is not None
    if skip_logits and labels is None:
        raise ValueError("liger_patch: skip_logits=True needs labels: without labels there is no loss")
    return bool(skip_logits)


class LossFields(NamedTuple):
    """The call's arguments that the loss consumes (the decoder body never sees them)."""

    labels: torch.Tensor
    logits_to_keep: int | torch.Tensor
    return_dict: bool
    num_items_in_batch: Any
    shift_labels: torch.Tensor | None
    ignore_index: int


def pop_loss_fields(call: dict[str, Any], config: Any) -> LossFields:
    """Take the loss's fields out of ``call``, with the original forward's defaults."""
    return_dict = call.pop("return_dict", None)
    return LossFields(
        labels=call.pop("labels"),
        logits_to_keep=call.pop("logits_to_keep", 0),
        return_dict=getattr(config, "return_dict", True) if return_dict is None else return_dict,
        num_items_in_batch=call.pop("num_items_in_batch", None),
        shift_labels=call.pop("shift_labels", None),
        ignore_index=call.pop("ignore_index", -100),
    )


def set_router_logits_flag(call: dict[str, Any], spec: ModelSpec, config: Any) -> bool:
    """For an MoE row, whether the body records router logits (the argument, else the config),
    written into ``call``; ``False`` for a dense row."""
    if spec.moe is None:
        return False
    flag = call.get("output_router_logits")
    if flag is None:
        flag = bool(getattr(config, "output_router_logits", False))
    call["output_router_logits"] = flag
    return flag


# body class -> (names its forward accepts, whether it takes **kwargs). A plain dict rather than
# functools.lru_cache: torch.compile traces through a dict lookup without warnings.
_BODY_PARAMETERS: dict[type, tuple[frozenset[str], bool]] = {}


def _accepted_parameters(body_cls: type) -> tuple[frozenset[str], bool]:
    """Names a body's forward accepts, and whether it takes ``**kwargs``."""
    if body_cls not in _BODY_PARAMETERS:
        params = inspect.signature(body_cls.forward).parameters.values()
        names = frozenset(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
        _BODY_PARAMETERS[body_cls] = (names, any(p.kind is p.VAR_KEYWORD for p in params))
    return _BODY_PARAMETERS[body_cls]


def body_arguments(body: nn.Module, call: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments that the decoder body takes (all of them when it has ``**kwargs``)."""
    names, takes_kwargs = _accepted_parameters(type(body))
    arguments = {k: v for k, v in call.items() if takes_kwargs or k in names}
    if "return_dict" in names:
        arguments["return_dict"] = True
    return arguments


def keep_positions(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """Slice hidden states exactly as the original forward slices them before its head."""
    slice_logits_to_keep = lazy_imports()["slice_logits_to_keep"]
    if slice_logits_to_keep is not None:
        return slice_logits_to_keep(hidden, logits_to_keep)
    positions = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return hidden[:, positions, :]


def causal_targets(
    labels: torch.Tensor, shift_labels: torch.Tensor | None, ignore_index: int
) -> torch.Tensor:
    """Per-position targets, as transformers' ``ForCausalLMLoss`` builds them.

    Position t predicts token t+1: labels are shifted left by one and the last position gets
    ``ignore_index``. ``shift_labels`` (already shifted, e.g. by context parallelism) wins.
    """
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def targets_for(hidden: torch.Tensor, fields: LossFields) -> torch.Tensor:
    """The kept positions' targets on ``hidden``'s device; refused unless there is one per position."""
    targets = causal_targets(fields.labels, fields.shift_labels, fields.ignore_index).to(hidden.device)
    if targets.numel() * hidden.shape[-1] != hidden.numel():
        raise ValueError(
            f"liger_patch: labels give {targets.numel()} targets but the model produced "
            f"{hidden.numel() // hidden.shape[-1]} positions (hidden states {tuple(hidden.shape)}, "
            f"logits_to_keep={fields.logits_to_keep!r}); labels must cover the kept positions"
        )
    return targets
