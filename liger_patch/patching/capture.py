"""The capture that stands at the head's path during one fused forward (:class:`HeadCapture`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from liger_patch.patching.deferred import DeferredLogits, HeadCall
from liger_patch.patching.seam import CapturedCall

__all__ = ["HeadCapture"]


class HeadCapture(nn.Module):
    """Stands in for the output projection during one fused forward: calling it returns
    :class:`DeferredLogits` instead of computing the logits.

    Everything else answers as the module it replaces does, so a forward never notices the swap:
    the capture shares that module's parameter, buffer and submodule dicts (``lm_head.weight``,
    ``named_parameters()``, and the model's own ``parameters()`` during the call are unchanged),
    reads every other attribute off it (``in_features``, ``out_features``, a custom head's own
    fields, properties and methods), reports its class to ``isinstance``, and raises the same
    ``AttributeError`` for a name the module lacks. Only calling it differs; a call it cannot
    defer (extra arguments) is refused: the replaced module computes it (``CapturedCall.refuse``
    records why). The module stays registered where it was outside the call; the capture lives
    for the call only. Real logits made from deferred ones come from the replaced module too, as
    the model's own call would.
    """

    def __init__(self, head: nn.Module, call: CapturedCall, replaced: nn.Module | None = None) -> None:
        super().__init__()
        replaced = head if replaced is None else replaced
        # ``head`` is what the fused loss reads (a PEFT modules_to_save copy, say); ``replaced`` is
        # the module registered at the head's path, whose face the capture wears.
        for name, value in (("_head", head), ("_call", call), ("_replaced", replaced)):
            self.__dict__[name] = value
        for name in ("_parameters", "_buffers", "_modules"):
            self.__dict__[name] = getattr(replaced, name)
        self.__dict__["training"] = replaced.training

    @property
    def __class__(self) -> type:  # isinstance(model.lm_head, nn.Linear) stays True
        replaced = self.__dict__.get("_replaced")
        return HeadCapture if replaced is None else type(replaced)

    @property
    def weight(self) -> torch.Tensor:  # code such as ``hidden.to(self.lm_head.weight.dtype)``
        self._call.weight_reads += 1  # (a forward that never calls the head says why with it)
        return self._head.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self._head.bias

    def __getattr__(self, name: str) -> Any:
        """What the replaced module answers for ``name`` (its parameters and buffers come first,
        through the shared dicts): the same value, or the same ``AttributeError``."""
        replaced = self.__dict__.get("_replaced")
        if replaced is None or name.startswith("__"):
            return super().__getattr__(name)
        return getattr(replaced, name)

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> DeferredLogits | torch.Tensor:
        if args or kwargs:
            self._call.refuse("it calls its output projection with extra arguments")
            return self._replaced(hidden, *args, **kwargs)
        self._call.head_calls += 1
        return DeferredLogits(self._call, self._head, hidden, source=HeadCall(self._replaced, hidden))

    def _get_name(self) -> str:
        return "HeadCapture"

    def extra_repr(self) -> str:
        return f"capturing {self._replaced!r}"
