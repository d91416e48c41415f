"""TRL's ``DistillationTrainer`` computing its divergence with ``fused_linear_distillation`` for a
patched student; and what TRL's two distillation trainers' hooks share (``trl_gkd.py`` has GKD's).

Both trainers train the student towards the teacher's next-token distribution under TRL's
generalized JSD (``beta``: 0 forward KL, 1 reverse KL, else the mixture), the op's own math
(docs/distillation.md).

``DistillationTrainer`` (``trl.trainer.distillation_trainer``; ``trl.experimental.distillation``
subclasses it) never builds the logits either: its ``_compute_loss`` runs each model's decoder
body and hands both hidden states (the completion's positions), both ``lm_head`` weights and
biases, the completion mask, ``beta``, the temperature, ``num_items_in_batch`` and each head's
logit scale and softcap (read from the configs) to the module's ``_chunked_divergence_loss``,
which returns ``(loss, entropy_sum, n_valid)``: the divergence summed over the kept tokens and
divided by their number (or by ``num_items_in_batch``), the student's entropy at the
temperature summed over them (the logged ``entropy`` metric), and their number.

:class:`FusedDivergence` takes that function's place. When the trainer calling it (``self`` of
the calling frame) trains a patched student (``apply_liger_to`` or ``LigerPatchCallback``), the
same three come from the fused op, with TRL's own arguments: the loss from
``fused_linear_distillation`` (four GEMMs per kept token, no ``tokens x V`` buffer beyond the
memory budget's chunks), the entropy from one forward-only pass of ``fused_linear_logprobs`` at
the temperature (one more logits GEMM: the distillation op does not return the entropy). With an
unpatched student, TRL's function runs. Sharded heads go through the op too (``distill_heads``):
for a tensor TRL passes that FSDP2, ZeRO-3 or tensor parallelism shards, the hook finds the head
module of the trainer's student or teacher that owns it, and the loss runs where that head's
tensors are whole (inside its call) or on its vocabulary shard. TRL's function runs, with a
``LigerBypassWarning`` naming the reason, for a sharded tensor that is no such head's, a student
head that is a DTensor sharded other than over the vocabulary (``RowwiseParallel``), and a zero
logit scale or non-positive softcap (the op refuses them).

The installers run when ``apply_liger_to`` patches something, through ``integrations.trl``'s
import hook (now if the TRL module is imported, else when it is); this package imports this module.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from typing import Any

import torch
import torch.nn as nn

from liger_patch.integrations.distill_heads import IGNORE, DistillSide, distill_on_heads
from liger_patch.integrations.trl import install_on_import, warn_unused_loss_options
from liger_patch.patching.sharded_head import (
    head_tensor,
    head_weight_is_managed,
    is_dtensor,
    is_zero3_partitioned,
    vocab_shard_problem,
)
from liger_patch.patching.state import PatchState, patch_state

__all__ = [
    "FusedDivergence",
    "distill_runtime",
    "fall_back",
    "install",
    "installed",
    "is_sharded",
    "used_by_fused_path",
]

TRL_MODULE = "trl.trainer.distillation_trainer"
DIVERGENCE_ATTR = "_chunked_divergence_loss"
_ARGUMENTS = frozenset(
    (
        *("student_hidden_states", "teacher_hidden_states", "student_lm_head_weight"),
        *("teacher_lm_head_weight", "completion_mask", "beta", "num_items_in_batch"),
        *("student_lm_head_bias", "teacher_lm_head_bias", "student_logit_scale", "teacher_logit_scale"),
        *("student_final_logit_softcapping", "teacher_final_logit_softcapping", "temperature"),
    )
)
"""The arguments of TRL 1.16's ``_chunked_divergence_loss`` (another set: TRL's function runs)."""


class FusedDivergence:
    """Stands in for TRL's ``_chunked_divergence_loss``: takes its arguments and returns its
    ``(loss, entropy_sum, n_valid)``, from the fused op for a patched student, from TRL's
    function otherwise."""

    def __init__(self, original: Any) -> None:
        self.original = original
        self.signature = inspect.signature(original)

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        trainer = _calling_trainer(sys._getframe(1))
        state = None if trainer is None else patch_state(trainer.model)
        if state is None:
            return self.original(*args, **kwargs)
        arguments = self._arguments(args, kwargs)
        reason = _why_trl_divergence(arguments)
        heads: tuple = ()
        if reason is None:
            heads, reason = _sharded_heads(trainer, arguments)
        if reason is not None:
            fall_back(state, "chunked divergence kernel", reason)
            return self.original(*args, **kwargs)
        used_by_fused_path(state)
        return fused_divergence(state, heads, **arguments)

    def _arguments(self, args: tuple, kwargs: dict) -> dict[str, Any] | None:
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError:
            return None
        bound.apply_defaults()
        return bound.arguments


def fused_divergence(
    state: PatchState,
    heads: tuple[nn.Module | None, nn.Module | None],
    *,
    student_hidden_states: torch.Tensor,
    teacher_hidden_states: torch.Tensor,
    student_lm_head_weight: torch.Tensor,
    teacher_lm_head_weight: torch.Tensor,
    completion_mask: torch.Tensor,
    beta: float,
    num_items_in_batch: torch.Tensor | int | None,
    student_lm_head_bias: torch.Tensor | None,
    teacher_lm_head_bias: torch.Tensor | None,
    student_logit_scale: float,
    teacher_logit_scale: float,
    student_final_logit_softcapping: float | None,
    teacher_final_logit_softcapping: float | None,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's ``(loss, entropy_sum, n_valid)`` through the fused ops, with the patch's runtime options.
    ``heads``: the student's and the teacher's head module where its tensors are sharded (the loss
    then reads them where they are whole: ``distill_heads``), else ``None``."""
    valid = completion_mask.reshape(-1) != 0
    labels = torch.where(valid, 0, IGNORE)  # which tokens count: there is no cross-entropy term
    student = student_hidden_states.reshape(-1, student_hidden_states.shape[-1])
    teacher = teacher_hidden_states.reshape(-1, teacher_hidden_states.shape[-1])
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(student.device)
    loss, entropy = distill_on_heads(
        DistillSide(student, heads[0], student_lm_head_weight, student_lm_head_bias),
        DistillSide(teacher, heads[1], teacher_lm_head_weight, teacher_lm_head_bias),
        labels, entropy_backend=state.options.backend, num_items_in_batch=num_items_in_batch,
        beta=beta, temperature=temperature, reduction="mean",
        student_softcap=student_final_logit_softcapping, teacher_softcap=teacher_final_logit_softcapping,
        student_logit_scale=None if student_logit_scale == 1.0 else student_logit_scale,
        teacher_logit_scale=None if teacher_logit_scale == 1.0 else teacher_logit_scale,
        # TRL's kernel keeps its logits tiles in fp32 (``mm(out_dtype=float32)``): so do we here,
        # so that the patched trainer's gradients are as exact as its own (docs/distillation.md).
        logits_dtype=torch.float32, **distill_runtime(state),
    )  # fmt: skip
    return loss, entropy.sum(), valid.sum()


def _why_trl_divergence(arguments: dict[str, Any] | None) -> str | None:
    """Why TRL's own function must compute this call (``None``: the fused op does)."""
    if arguments is None or set(arguments) != _ARGUMENTS:
        return f"this TRL's {DIVERGENCE_ATTR} takes other arguments than TRL 1.16's"
    for side in ("student", "teacher"):
        if arguments[f"{side}_logit_scale"] == 0:
            return f"the {side}'s logit scale is 0 (all its logits are 0), which the fused op refuses"
        softcap = arguments[f"{side}_final_logit_softcapping"]
        if softcap is not None and not softcap > 0:
            return f"the {side}'s softcap is {softcap}, which the fused op refuses (it must be > 0)"
    return None


def _calling_trainer(frame: Any) -> Any:
    """The ``DistillationTrainer`` whose method called (within three frames), or ``None``: its
    ``model`` is the student, ``teacher_model`` the teacher."""
    trainer_class = getattr(sys.modules.get(TRL_MODULE), "DistillationTrainer", None)
    for _ in range(3):
        if frame is None or trainer_class is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, trainer_class):
            return candidate
        frame = frame.f_back
    return None


def _sharded_heads(trainer: Any, arguments: dict[str, Any]) -> tuple[tuple, str | None]:
    """For each side, the head module owning the tensors TRL passed where they are sharded (the
    loss then reads them where they are whole), ``None`` where they are plain; or the reason
    TRL's function must run instead."""
    heads = []
    for side in ("student", "teacher"):
        weight, bias = arguments[f"{side}_lm_head_weight"], arguments[f"{side}_lm_head_bias"]
        head, reason = _head_owning(trainer, side, weight, bias) if is_sharded(weight, bias) else (None, None)
        if reason is not None:
            return (), reason
        heads.append(head)
    return tuple(heads), None


def _head_owning(trainer: Any, side: str, weight: Any, bias: Any) -> tuple[nn.Module | None, str | None]:
    """The head module of the trainer's ``side`` model that owns these sharded tensors, or why none
    can serve: no head owns them, or the student's is a DTensor not sharded over the vocabulary
    (the teacher's is all-gathered whatever its sharding: it needs no gradient)."""
    model = trainer.model if side == "student" else trainer.accelerator.unwrap_model(trainer.teacher_model)
    head = _owner(model.get_output_embeddings(), weight)
    if head is None or head_tensor(head, "bias") is not bias:
        return None, (
            f"the {side}'s lm_head tensors are sharded (FSDP2, DeepSpeed ZeRO-3 or tensor parallelism) "
            f"and are not those of the {side} model's output embeddings, which the fused op would gather"
        )
    problem = "" if side == "teacher" or head_weight_is_managed(head) else vocab_shard_problem(head)
    return (None, f"the student's lm_head cannot be fused: {problem}") if problem else (head, None)


def _owner(root: nn.Module | None, weight: torch.Tensor) -> nn.Module | None:
    """The module under ``root`` (itself included) that registers ``weight`` as its ``weight``
    (read past ZeRO-3's gathering parameter dict, as ``sharded_head.head_tensor`` reads it)."""
    modules = root.modules() if root is not None else ()
    return next((m for m in modules if dict.get(vars(m).get("_parameters", {}), "weight") is weight), None)


# --- what the two distillation hooks share ------------------------------------------------------


def distill_runtime(state: PatchState) -> dict[str, Any]:
    """The patch's runtime options as the distillation op takes them: its memory budget (the
    batch budget of a training step when none is named), its backend and its ``Tuning``."""
    budget = state.budget_changes().get("memory_budget", state.options.memory_budget)
    return dict(backend=state.options.backend, memory_budget=budget, tuning=state.options.tuning)


def is_sharded(*tensors: Any) -> bool:
    """Whether any of ``tensors`` is an FSDP2 / tensor-parallel shard or a ZeRO-3 partition."""
    return any(t is not None and (is_dtensor(t) or is_zero3_partitioned(t)) for t in tensors)


def fall_back(state: PatchState, what: str, reason: str) -> None:
    """Record and say (once per patch) that TRL's own ``what`` computed a patched student's loss."""
    state.bypass_reason = f"TRL's own {what} ran because {reason}"
    state.warn_bypass_once(
        f"liger_patch: {state.bypass_reason}; the fused distillation op is not used for it.", stacklevel=4
    )


# The patches already told that their loss options do not apply to TRL's divergence, by id (a
# PatchState is unhashable); an entry leaves with its patch, so an id is never mistaken.
_WARNED_OPTIONS: weakref.WeakValueDictionary[int, PatchState] = weakref.WeakValueDictionary()


def used_by_fused_path(state: PatchState) -> None:
    """Mark that the op computed this step's loss (the Trainer callback checks it), and say once
    which of the patch's loss options (z-loss, label smoothing, ...) TRL's divergence has no use for."""
    state.fused_ran = True
    warn_unused_loss_options(
        state, _WARNED_OPTIONS, "TRL's distillation loss is its divergence alone", "to it"
    )


# --- the hook --------------------------------------------------------------------------------


def installed() -> bool:
    """Whether ``DistillationTrainer``'s divergence function is ours."""
    module = sys.modules.get(TRL_MODULE)
    return module is not None and isinstance(getattr(module, DIVERGENCE_ATTR, None), FusedDivergence)


def install(module: Any = None) -> bool:
    """Put :class:`FusedDivergence` in place of the TRL module's ``_chunked_divergence_loss``
    (idempotent); False when this TRL has none."""
    module = module if module is not None else sys.modules.get(TRL_MODULE)
    current = getattr(module, DIVERGENCE_ATTR, None) if module is not None else None
    if current is None:
        return False
    if not isinstance(current, FusedDivergence):
        setattr(module, DIVERGENCE_ATTR, FusedDivergence(current))
    return True


install_on_import(TRL_MODULE, install)
