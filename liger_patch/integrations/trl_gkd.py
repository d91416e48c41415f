"""TRL's ``GKDTrainer`` (``trl.experimental.gkd``) computing its divergence with
``fused_linear_distillation`` for a patched student.

TRL 1.16's ``GKDTrainer.compute_loss`` calls the student and (in eval mode, without gradients) the
teacher on ``input_ids`` and ``attention_mask`` for their full logits, drops each one's last
position, shifts the labels by one, and returns ``generalized_jsd_loss(student, teacher, labels,
beta=self.beta, num_items_in_batch=...)``: at that function's default temperature (1.0;
``GKDConfig.temperature`` is the sampling temperature of its generation only), over the tokens
whose label is not -100, summed and divided by their number (or by ``num_items_in_batch``).
Its ``training_step`` may first replace the batch by completions the student (``lmbda``) or
the teacher (``seq_kd``) generates; the loss of whatever batch arrives is the same function.

:func:`install` wraps ``GKDTrainer.compute_loss``. For a patched student the wrapper runs the
same steps with both models' own forwards called with their output projection captured
(``patching.capture.HeadCapture``, as the patched forward does): each returns deferred logits,
the head's input hidden states plus what the forward does to its logits (a scale, a softcap),
indexed as TRL indexes the logits; the fused op gets both heads' tensors, TRL's ``beta`` and
temperature, the mask and ``num_items_in_batch`` (``distill_heads``: a head that FSDP2 or ZeRO-3
shards is called once, after the forwards, with the loss as its forward, so that its wrapper
gathers it; a tensor-parallel head's loss runs on its vocabulary shard). Neither model's
``tokens x V`` logits are built. With an unpatched student, TRL's ``compute_loss`` runs.

TRL's own ``compute_loss`` runs for a patched student, with a ``LigerBypassWarning`` naming the
reason, when the caller asks for the student's outputs (``return_outputs=True``: the Trainer's
evaluation ``prediction_step``, which wants the logits), a subclass overrides
``generalized_jsd_loss``, either head cannot be fused (``head.fusable_head``: quantized or
custom, sharded other than as above, LoRA on a sharded head, an architecture the patch refuses),
or a forward does to its logits what has no fused counterpart (then for the rest of that
trainer's life).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from liger_patch.integrations.distill_heads import IGNORE, DistillSide, distill_on_heads
from liger_patch.integrations.trl import install_on_import
from liger_patch.integrations.trl_distillation import distill_runtime, fall_back, used_by_fused_path
from liger_patch.patching.capture import HeadCapture
from liger_patch.patching.deferred import DeferredLogits
from liger_patch.patching.derive import spec_for
from liger_patch.patching.head import fusable_head
from liger_patch.patching.registry import UnsupportedModelError
from liger_patch.patching.seam import CapturedCall, UnfusableLogitsUse
from liger_patch.patching.state import PatchState, base_model_of, patch_state

__all__ = ["install", "installed"]

TRL_MODULE = "trl.experimental.gkd.gkd_trainer"
ORIGINAL_ATTR = "__liger_original__"

# Trainers whose models' forwards used their logits in a way with no fused counterpart: their
# reason, so that they are not tried again (each try runs a forward for nothing).
_REFUSED: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _fused_compute_loss(original: Callable) -> Callable:
    """``GKDTrainer.compute_loss`` with the fused path for a patched student."""

    @functools.wraps(original)
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        state = patch_state(self.accelerator.unwrap_model(model))
        if state is None:
            return original(self, model, inputs, return_outputs, num_items_in_batch)
        reason = _why_trl_loss(self, model, state, return_outputs)
        if reason is None:
            try:
                return _fused_loss(self, model, inputs, num_items_in_batch, state)
            except UnfusableLogitsUse as why:
                reason = _REFUSED[self] = f"a forward used its logits so: {why} (no exact fused counterpart)"
        fall_back(state, "GKD loss (full logits)", reason)
        return original(self, model, inputs, return_outputs, num_items_in_batch)

    setattr(compute_loss, ORIGINAL_ATTR, original)
    return compute_loss


def _why_trl_loss(trainer: Any, model: nn.Module, state: PatchState, return_outputs: bool) -> str | None:
    """Why TRL's own ``compute_loss`` must run (``None``: the fused op computes it)."""
    if return_outputs:
        return "the caller asked for the student's outputs, logits included (evaluation's prediction_step)"
    gkd = sys.modules[TRL_MODULE].GKDTrainer
    if type(trainer).generalized_jsd_loss is not gkd.generalized_jsd_loss:
        return f"{type(trainer).__name__} overrides generalized_jsd_loss"
    if trainer in _REFUSED:
        return _REFUSED[trainer]
    if state.unfusable_reason is not None:
        return f"the patch runs the student's original path ({state.unfusable_reason})"
    for side, side_model in (("student", model), ("teacher", trainer.teacher_model)):
        head, reason, _ = _capturable_head(trainer, side_model)
        if head is None:
            return f"the {side}'s head cannot be fused: {reason}"
    return None


def _capturable_head(trainer: Any, model: nn.Module) -> tuple[nn.Module | None, str, str]:
    """``(head, "", path)`` of ``model``'s output projection if the fused op can read its
    tensors after its forward, else ``(None, reason, path)``."""
    base = base_model_of(trainer.accelerator.unwrap_model(model))
    state = patch_state(base)
    try:
        spec = state.spec if state is not None else spec_for(type(base))
    except UnsupportedModelError as refusal:
        return None, str(refusal), ""
    return fusable_head(base, spec)


def _fused_loss(
    trainer: Any, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any, state: PatchState
) -> torch.Tensor:
    """TRL's GKD loss of this batch through the fused op (see the module doc)."""
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    with _captured(trainer, model) as student_call:
        # skip_logits=False: the patched forward's original path (no labels), which the capture fuses
        student_outputs = model(input_ids=ids, attention_mask=mask, skip_logits=False)
    trainer.teacher_model.eval()
    with torch.no_grad(), _captured(trainer, trainer.teacher_model) as teacher_call:
        teacher_outputs = trainer.teacher_model(input_ids=ids, attention_mask=mask)
    student = _deferred_logits(student_outputs, student_call)[:, :-1, :]
    teacher = _deferred_logits(teacher_outputs, teacher_call)[:, :-1, :]
    loss = _divergence(trainer, student, teacher, inputs["labels"][:, 1:], num_items_in_batch, state)
    sys.modules[TRL_MODULE].empty_cache()
    used_by_fused_path(state)
    return loss


def _divergence(
    trainer: Any,
    student: DeferredLogits,
    teacher: DeferredLogits,
    labels: torch.Tensor,
    num_items_in_batch: Any,
    state: PatchState,
) -> torch.Tensor:
    """``generalized_jsd_loss`` as TRL's ``compute_loss`` calls it, on deferred logits."""
    student_scale, student_softcap = student.loss_math()
    teacher_scale, teacher_softcap = teacher.loss_math()
    device = student.hidden.device
    labels = torch.where(labels.to(device) != IGNORE, 0, IGNORE)  # which tokens count, nothing more
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(device)
    loss, _ = distill_on_heads(
        DistillSide(student.hidden, student.head), DistillSide(teacher.hidden.to(device), teacher.head),
        labels, num_items_in_batch=num_items_in_batch,
        beta=trainer.beta, temperature=_default_temperature(type(trainer).generalized_jsd_loss),
        reduction="mean", student_softcap=student_softcap, teacher_softcap=teacher_softcap,
        student_logit_scale=student_scale, teacher_logit_scale=teacher_scale,
        **distill_runtime(state),
    )  # fmt: skip
    return loss


@functools.cache
def _default_temperature(jsd_loss: Callable) -> float:
    """The temperature ``generalized_jsd_loss`` applies when called without one, as TRL calls it."""
    return inspect.signature(jsd_loss).parameters["temperature"].default


def _no_loss(**_: Any) -> Any:
    raise UnfusableLogitsUse("it computed a loss from its logits in a call without labels")


@contextlib.contextmanager
def _captured(trainer: Any, model: nn.Module) -> Iterator[CapturedCall]:
    """``model``'s output projection captured for the block: calling it returns deferred logits."""
    base = base_model_of(trainer.accelerator.unwrap_model(model))
    head, _, path = _capturable_head(trainer, model)
    call = CapturedCall(compute_loss=_no_loss, strict=True)  # a refused use raises: TRL's own loss runs
    parent_path, _, name = path.rpartition(".")
    parent = base.get_submodule(parent_path) if parent_path else base
    registered = parent._modules[name]
    parent._modules[name] = HeadCapture(head, call, registered)
    try:
        yield call
    finally:
        parent._modules[name] = registered


def _deferred_logits(outputs: Any, call: CapturedCall) -> DeferredLogits:
    """The deferred logits a captured forward returned (its head called once, nothing else)."""
    logits = getattr(outputs, "logits", None)
    if call.head_calls != 1 or not isinstance(logits, DeferredLogits):
        raise UnfusableLogitsUse(
            f"its forward called its output projection {call.head_calls} time(s) and returned "
            f"{type(logits).__name__} as its logits"
        )
    return logits


def installed() -> bool:
    """Whether ``GKDTrainer.compute_loss`` is wrapped."""
    trainer = getattr(sys.modules.get(TRL_MODULE), "GKDTrainer", None)
    return trainer is not None and hasattr(vars(trainer).get("compute_loss"), ORIGINAL_ATTR)


def install(module: Any = None) -> bool:
    """Wrap the TRL module's ``GKDTrainer.compute_loss`` (idempotent); False when it has none."""
    module = module if module is not None else sys.modules.get(TRL_MODULE)
    trainer = getattr(module, "GKDTrainer", None)
    original = vars(trainer).get("compute_loss") if isinstance(trainer, type) else None
    if original is None:
        return False
    if not hasattr(original, ORIGINAL_ATTR):
        trainer.compute_loss = _fused_compute_loss(original)
    return True


install_on_import(TRL_MODULE, install)
