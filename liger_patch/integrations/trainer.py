"""``LigerPatchCallback``: the fused loss in an HF ``Trainer`` by adding one callback.

Why a callback and not a call before ``Trainer(...)``: either works, but the callback patches in
``on_init_end``, which runs at the end of ``Trainer.__init__`` -- after the Trainer has its final
model (PEFT-wrapped or not) and *before* accelerate wraps ``model.forward`` for mixed precision
in ``train()``. Patching after that wrapping would silently put the fused loss outside autocast.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

from transformers import TrainerCallback

from liger_patch.integrations.trl import installed as trl_head_installed
from liger_patch.patching.apply import apply_liger_to, checked_options, options_signature, with_options_doc
from liger_patch.patching.forward import bypass_message
from liger_patch.patching.state import PatchState, base_model_of, patch_state

__all__ = ["LigerPatchCallback"]


class LigerPatchCallback(TrainerCallback):
    """Patch the Trainer's model with ``apply_liger_to(model, strict=strict, **options)`` and log
    its z-loss.

    The options are checked when the callback is made, by ``apply_liger_to``'s rules. When
    ``z_loss_scale > 0`` every training log line gets ``z_loss``: the mean, per optimizer step
    since the last log, of the scaled z-loss term that is already inside ``loss``.
    """

    def __init__(self, *, strict: bool = True, **options: Any):
        self.strict = strict
        self.options = options
        self.loss_options = checked_options("LigerPatchCallback", options)

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
        apply_liger_to(model, strict=self.strict, **self.options)
        return control

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        patch = patch_state(model)
        if patch is not None:
            patch.fused_ran = False
        return control

    def on_step_end(self, args, state, control, model=None, **kwargs):
        patch = patch_state(model)
        if patch is not None:
            patch.z_loss_tracker.end_step()
            if not patch.fused_ran and not patch.warned_bypass:
                patch.warn_bypass_once(bypass_message(model, _why_bypassed(model, patch)), stacklevel=2)
        return control

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if self.loss_options.z_loss_scale <= 0 or logs is None or "loss" not in logs:
            return control
        patch = patch_state(model)
        z_loss = patch.z_loss_tracker.pop_mean() if patch is not None else None
        if z_loss is None:
            return control
        logs["z_loss"] = z_loss
        # Trainer.log copied `logs` into log_history before calling callbacks: update that copy too.
        if state.log_history and state.log_history[-1].get("loss") == logs["loss"]:
            state.log_history[-1]["z_loss"] = z_loss
        return control


def _why_bypassed(model: Any, patch: PatchState) -> str:
    """What is known of why a training step ran without the fused op."""
    if patch.bypass_reason is not None:
        return patch.bypass_reason
    forward = getattr(base_model_of(model), "forward", None)
    name = getattr(getattr(forward, "__func__", forward), "__qualname__", "")
    if "add_fused_lm_head" in name and not trl_head_installed():
        return (
            "TRL's fused LM head (trl.trainer.utils.add_fused_lm_head) computed it with TRL's own "
            "kernel, and liger_patch's hook on that kernel is not installed (call apply_liger_to "
            "after importing trl, or use LigerPatchCallback)"
        )
    return (
        "a whole training step ran and the model was never called with labels in training mode; "
        "something else computed the loss (another fused head such as liger-kernel's or Unsloth's, "
        "a trainer calling the decoder body directly, or a wrapper around a different model)"
    )


LigerPatchCallback.__init__.__signature__ = options_signature(
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
)
LigerPatchCallback.__doc__ = with_options_doc(LigerPatchCallback.__doc__)
