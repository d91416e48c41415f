"""What a patch attaches to a model or class (:class:`PatchState`), and how to find it.

``apply_liger_to`` sets a ``PatchState`` on the patched object under :data:`STATE_ATTR`: the
registry row, the user's loss options (one :class:`~liger_patch.ops.cross_entropy.options.LossOptions`),
what ``revert_liger`` puts back, and the z-loss tracker the Trainer callback logs from.
:func:`patch_state` is the public way to read it, through PEFT and ``torch.compile`` wrappers.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from liger_patch import env
from liger_patch.ops.core.budget import BATCH_BUDGET
from liger_patch.ops.cross_entropy.options import DEFAULT_OPTIONS, LossOptions
from liger_patch.patching.registry import ModelSpec

__all__ = [
    "STATE_ATTR",
    "LigerBypassWarning",
    "PatchState",
    "ZLossTracker",
    "base_model_of",
    "own_state",
    "patch_state",
]

STATE_ATTR = "_liger_patch_state"


class LigerBypassWarning(UserWarning):
    """Something computed a patched model's loss without the fused op."""


class ZLossTracker:
    """Accumulates the detached z-loss terms of training forwards for the Trainer callback.

    It only adds tensors (no ``.item()``, so no host sync in the training step); the callback
    turns the sum into a number when it logs.
    """

    def __init__(self) -> None:
        # this optimizer step's forwards so far: one running sum per device (not a list: under
        # torch.compile a growing list's length is a guard, and every call would recompile)
        self._pending: dict[torch.device, torch.Tensor] = {}
        self._step_sum: torch.Tensor | None = None
        self._steps = 0

    def add(self, z_loss: torch.Tensor) -> None:
        """Record one forward's z-loss term (the part already inside its loss). ``nn.DataParallel``
        replicas call this from their own threads with terms on their own GPUs: each thread
        updates its own device's entry, and nothing is added across devices here."""
        term = z_loss.detach().float()
        previous = self._pending.get(term.device)
        self._pending[term.device] = term if previous is None else previous + term

    def end_step(self) -> None:
        """Close an optimizer step: its micro-batches' terms add up to the step's z-loss. Under
        ``nn.DataParallel`` every GPU's replica saw a slice of each micro-batch and the Trainer
        averages the replicas' losses, so the step's z-loss is the mean over GPUs of each GPU's
        sum (with one device, just the sum)."""
        if not self._pending:
            return
        sums, self._pending = list(self._pending.values()), {}
        home = sums[0].device
        step = torch.stack([s.to(home) for s in sums]).mean()
        self._step_sum = step if self._step_sum is None else self._step_sum + step
        self._steps += 1

    def pop_mean(self) -> float | None:
        """Mean z-loss per optimizer step since the last call, or ``None`` if none was recorded."""
        self.end_step()
        if self._step_sum is None or self._steps == 0:
            return None
        value = float(self._step_sum) / self._steps
        self._step_sum, self._steps = None, 0
        return value


@dataclass
class PatchState:
    """What ``apply_liger_to`` attaches to a patched model or class.

    ``spec`` is the registry row; ``options`` are the user's loss options (the patched forward
    adds what it sets per call: ``forward.FORWARD_SETS``); ``previous_forward`` is what
    ``revert_liger`` puts back (``None`` when the object had no forward of its own);
    ``unfusable_reason`` is set when a forward used its logits in a way with no fused
    counterpart (that call went on with its real logits): this patch then runs the original
    path. The ``fused_ran`` / ``bypass_*``
    fields feed the warning that something computed the loss without the fused op.
    """

    spec: ModelSpec
    options: LossOptions = DEFAULT_OPTIONS
    had_own_forward: bool = False
    previous_forward: Any = None
    z_loss_tracker: ZLossTracker = field(default_factory=ZLossTracker)
    warned_unfusable_head: bool = False
    unfusable_reason: str | None = None
    # Whether the fused op ran since the Trainer callback last cleared it (a training step that
    # leaves it False bypassed the op), and what is known of why it did not.
    fused_ran: bool = False
    bypass_reason: str | None = None
    warned_bypass: bool = False
    # Set when a label check begun ahead (labels_ahead.py) was taken by no loss: none is begun again.
    labels_ahead_missed: bool = False

    def budget_changes(self) -> dict[str, str]:
        """``{"memory_budget": "batch"}`` when neither the patch's options nor
        ``LIGER_MEMORY_BUDGET`` (read now) name a budget, else ``{}``: in a training step the
        head's working memory is sized by the batch so that it stays under what the decoder's
        backward allocates (``ops.core.budget.batch_budget``)."""
        if self.options.memory_budget is None and env.memory_budget() is None:
            return {"memory_budget": BATCH_BUDGET}
        return {}

    def warn_bypass_once(self, message: str, stacklevel: int) -> None:
        """Say ``message`` as a :class:`LigerBypassWarning`, unless this patch said one already
        (``stacklevel`` counted from the caller)."""
        if not self.warned_bypass:
            self.warned_bypass = True
            warnings.warn(message, LigerBypassWarning, stacklevel=stacklevel + 1)


def base_model_of(model: Any) -> Any:
    """The causal-LM module inside wrappers: a PEFT model's base model, a compiled module's original."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):  # torch.compile
            model = model._orig_mod
        elif callable(getattr(model, "get_base_model", None)):  # peft.PeftModel
            model = model.get_base_model()
    return model


def own_state(obj: Any) -> PatchState | None:
    """The PatchState set on ``obj`` itself (not inherited from a patched class)."""
    return vars(obj).get(STATE_ATTR)


def patch_state(model: Any) -> PatchState | None:
    """The :class:`PatchState` in force for ``model`` (a model, also PEFT-wrapped or compiled, or
    a class): its own, else its class's; ``None`` when it is not patched or ``model`` is ``None``."""
    if model is None:
        return None
    return getattr(base_model_of(model), STATE_ATTR, None)
