"""``LigerPatchCallback``: the fused loss in an HF ``Trainer`` by adding one callback.

Why a callback and not a call before ``Trainer(...)``: either works, but the callback patches in
``on_init_end``, which runs at the end of ``Trainer.__init__`` -- after the Trainer has its final
model (PEFT-wrapped or not) and *before* accelerate wraps ``model.forward`` for mixed precision
in ``train()``. Patching after that wrapping would silently put the fused loss outside autocast.
"""

from __future__ import annotations

import warnings
from typing import Any

from transformers import TrainerCallback

from liger_patch.patching.apply import apply_liger_to, base_model_of
from liger_patch.patching.forward import STATE_ATTR, PatchState

__all__ = ["LigerPatchCallback"]


class LigerPatchCallback(TrainerCallback):
    """Patch the Trainer's model with ``apply_liger_to(model, **options)`` and log its z-loss.

    Args:
        z_loss_scale, label_smoothing, memory_budget, strict: passed to
            :func:`liger_patch.apply_liger_to`.

    When ``z_loss_scale > 0`` every training log line gets ``z_loss``: the mean, per optimizer
    step since the last log, of the scaled z-loss term that is already inside ``loss``.
    """

    def __init__(
        self,
        *,
        z_loss_scale: float = 0.0,
        label_smoothing: float = 0.0,
        memory_budget: int | str | None = None,
        strict: bool = True,
    ):
        self.options: dict[str, Any] = {
            "z_loss_scale": z_loss_scale,
            "label_smoothing": label_smoothing,
            "memory_budget": memory_budget,
            "strict": strict,
        }

    def on_init_end(self, args, state, control, model=None, **kwargs):
        if getattr(args, "use_liger_kernel", False):
            warnings.warn(
                "liger_patch: TrainingArguments(use_liger_kernel=True) patches the model with "
                "liger-kernel too; use one of the two. Set use_liger_kernel=False to keep "
                "LigerPatchCallback.",
                UserWarning,
                stacklevel=2,
            )
        if model is None:
            raise ValueError("LigerPatchCallback: the Trainer passed no model to on_init_end")
        apply_liger_to(model, **self.options)
        return control

    @staticmethod
    def _patch_state(model: Any) -> PatchState | None:
        return getattr(base_model_of(model), STATE_ATTR, None) if model is not None else None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        patch_state = self._patch_state(model)
        if patch_state is not None:
            patch_state.z_loss_tracker.end_step()
        return control

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if self.options["z_loss_scale"] <= 0 or logs is None or "loss" not in logs:
            return control
        patch_state = self._patch_state(model)
        z_loss = patch_state.z_loss_tracker.pop_mean() if patch_state is not None else None
        if z_loss is None:
            return control
        logs["z_loss"] = z_loss
        # Trainer.log copied `logs` into log_history before calling callbacks: update that copy too.
        if state.log_history and state.log_history[-1].get("loss") == logs["loss"]:
            state.log_history[-1]["z_loss"] = z_loss
        return control
