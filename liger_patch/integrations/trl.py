"""TRL's trainers (SFT, DPO, GRPO, KTO, RLOO) computing their log-probs through the fused op.

TRL (1.15 onwards) never calls a model's LM head while training: each trainer's ``__init__``
calls ``trl.trainer.utils.add_fused_lm_head(model, ...)``, which puts a forward on the model
instance that, on ``model(..., labels=..., fused_lm_head=True)``, runs the decoder body, shifts
the labels, and hands the hidden states, ``lm_head.weight`` and the labels to one kernel,
``trl.trainer.utils._ChunkedLogProbFunction``, looked up at every call. It returns per-token
``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``; every loss (SFT's NLL and
DFT, DPO's sequence log-probs, GRPO's policy ratio and entropy bonus) and every metric
(``mean_token_accuracy``, ``entropy``) is computed from those.

So that kernel is the one place to take over: :func:`install` puts :class:`FusedLogProbHead`
in its place. For a call whose model is patched (``apply_liger_to`` or ``LigerPatchCallback``)
it computes the same five fields with the fused op; for any other model (a reference model left
unpatched) it calls TRL's own kernel, so with no patch TRL behaves exactly as it does without
liger_patch. The model is the ``self`` of TRL's fused forward, the caller's frame (the kernel
receives only tensors).

Under DeepSpeed ZeRO-3 TRL calls the kernel inside ``maybe_gather_lm_head_ctx`` (the head
gathered there if DeepSpeed has not gathered it already), and the head may be an empty
partition again by the backward: the op then runs through ``gathered_backward.GatheredBackward``,
which enters TRL's same helper again around the op's backward, as TRL's kernel does in its own.

TRL's head math is kept: logits ``z = softcap(logit_scale * (h W^T + b)) / temperature``, the
scale and softcap TRL read from the model's config. The patch's options of the loss-math kind
(``OptionKind.LOSS``: z-loss, label smoothing, token scaling, ...) do not apply there: TRL's loss
is built from the log-probs alone (said once, naming those set), and its output options neither
(TRL asks for its own fields). Its runtime options (tuning, backend, memory budget) do.

:func:`install` runs when ``apply_liger_to`` patches something with TRL imported; if TRL is
installed but not yet imported, an import hook runs it when ``trl.trainer.utils`` loads. This
module registers that with ``apply_liger_to`` (``patching.apply.after_apply``) when it is
imported, which ``import liger_patch`` does (``liger_patch.integrations``): patching never
imports an integration.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from liger_patch.integrations.gathered_backward import GatheredBackward
from liger_patch.ops.core.final_logits import final_logits, temperature_options
from liger_patch.ops.core.options import constant_changes
from liger_patch.ops.core.validation import autocast_inputs
from liger_patch.ops.cross_entropy.functional import fused_loss
from liger_patch.ops.cross_entropy.options import (
    LOSS_OPTIONS,
    LossOptions,
    OptionKind,
    build_options,
    option_defaults,
)
from liger_patch.patching.apply import after_apply
from liger_patch.patching.head import adapter_term
from liger_patch.patching.sharded_head import is_zero3_partitioned
from liger_patch.patching.state import LigerBypassWarning, PatchState, patch_state

__all__ = [
    "FusedLogProbHead",
    "LigerBypassWarning",
    "install",
    "install_on_import",
    "install_when_imported",
    "installed",
]

TRL_MODULE = "trl.trainer.utils"
KERNEL_ATTR = "_ChunkedLogProbFunction"
FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
_STATS_ELEMENTS = 1 << 24  # rows x vocab of fp32 logits per chunk for the metric-only statistics


class FusedLogProbHead:
    """Stands in for TRL's ``_ChunkedLogProbFunction``: ``apply`` takes its arguments and returns
    its five fields, from the fused op for a patched model, from TRL's kernel otherwise."""

    def __init__(self, original: Any):
        self.original = original

    def apply(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
        final_logit_softcapping: float | None = None,
        logit_scale: float = 1.0,
        outputs: Sequence[str] = FIELDS[1:],
    ) -> tuple[torch.Tensor | None, ...]:
        model = _calling_model(sys._getframe(1))
        state = patch_state(model)
        reason = _why_trl_kernel(state)
        if reason is not None:
            if state is not None:
                _note_bypass(state, f"TRL's own log-prob kernel ran because {reason}")
            return self.original.apply(
                hidden, weight, bias, targets, temperature, chunk_size,
                final_logit_softcapping, logit_scale, outputs,
            )  # fmt: skip
        low_rank, reason = adapter_term(model, state.spec, hidden)  # TRL's weight lacks a LoRA head's term
        if reason:
            _note_bypass(
                state, f"TRL's own log-prob kernel ran (without the head's adapter) because {reason}"
            )
            return self.original.apply(
                hidden, weight, bias, targets, temperature, chunk_size,
                final_logit_softcapping, logit_scale, outputs,
            )  # fmt: skip
        state.fused_ran = True
        _warn_unused_loss_options(state)
        math_options = temperature_options(
            temperature, None if logit_scale == 1.0 else logit_scale, final_logit_softcapping
        )
        return fused_log_prob_fields(hidden, weight, bias, targets, state, math_options, outputs, low_rank)


def fused_log_prob_fields(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    state: PatchState,
    math_options: dict[str, float | None],
    outputs: Sequence[str],
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """TRL's five per-token fields through the fused op (log-probs and entropy differentiable):
    TRL's head math and fields, the patch's runtime options; ``low_rank``: a LoRA head's term
    (``patching.head.adapter_term``)."""
    want_top1 = "is_top1" in outputs
    changes = dict(
        option_defaults(OptionKind.LOSS, OptionKind.OUTPUT),
        reduction="none",
        return_entropy="entropy" in outputs,
        return_predicted_tokens=want_top1,
        **math_options,
        **state.budget_changes(),
    )
    options = build_options(state.options.key, **constant_changes(changes))

    def per_token(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple:
        result = fused_loss(h, w, targets, b, options=options, low_rank=low_rank)
        loss = result if torch.is_tensor(result) else result.loss
        is_top1 = result.predicted_tokens == targets if want_top1 else None
        return -loss, getattr(result, "entropy", None), is_top1

    if _backward_needs_gathering(hidden, weight, bias):
        gather = sys.modules[TRL_MODULE].maybe_gather_lm_head_ctx
        log_probs, entropy, is_top1 = GatheredBackward.apply(per_token, gather, hidden, weight, bias)
    else:
        log_probs, entropy, is_top1 = per_token(hidden, weight, bias)
    log_sum_sq, mean_logits = _vocab_statistics(hidden, weight, bias, options, outputs, low_rank)
    return log_probs, entropy, log_sum_sq, mean_logits, is_top1


def _backward_needs_gathering(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a backward will follow on a head that DeepSpeed ZeRO-3 partitions: unless DeepSpeed
    keeps it gathered, it is whole only inside TRL's ``maybe_gather_lm_head_ctx``, so the op's
    backward runs inside that helper again (a null context where the head is gathered already)."""
    tensors = [t for t in (hidden, weight, bias) if t is not None]
    return (
        torch.is_grad_enabled()
        and any(t.requires_grad for t in tensors)
        and any(is_zero3_partitioned(t) for t in tensors[1:])
    )


@torch.no_grad()
def _vocab_statistics(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    options: LossOptions,
    outputs: Sequence[str],
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``log sum_v p_v^2`` and the mean logit per token, where asked for (metrics only, no
    gradient). Without a softcap the mean logit is linear in the hidden state, so it needs one
    matrix-vector product; otherwise, and for ``log_sum_sq_probs``, the logits are rebuilt in
    row chunks of at most 64 MiB."""
    want_sq, want_mean = "log_sum_sq_probs" in outputs, "mean_logits" in outputs
    if not (want_sq or want_mean):
        return None, None
    h, w, _ = autocast_inputs(hidden.detach(), weight.detach(), None)  # the head's matmul dtype
    u, b_lr = (None, None) if low_rank is None else (t.detach().to(h.dtype) for t in low_rank)
    if want_mean and not want_sq and options.softcap is None:
        mean = h.float() @ w.float().mean(0)
        if u is not None:
            mean = mean + u.float() @ b_lr.float().mean(0)
        if bias is not None:
            mean = mean + bias.float().mean()
        return None, mean * options.scale
    log_sum_sq, mean_logits = [], []
    rows = max(1, _STATS_ELEMENTS // max(1, w.shape[0]))
    for start in range(0, h.shape[0], rows):
        x = (h[start : start + rows] @ w.T).float()
        if u is not None:
            x = x + (u[start : start + rows] @ b_lr.T).float()
        if bias is not None:
            x = x + bias.float()
        z, _ = final_logits(x, options)
        if want_sq:
            log_sum_sq.append(torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1))
        if want_mean:
            mean_logits.append(z.mean(-1))
    return (torch.cat(log_sum_sq) if want_sq else None), (torch.cat(mean_logits) if want_mean else None)


def _calling_model(frame: Any) -> nn.Module | None:
    """The model whose fused forward called the kernel: ``self`` of the nearest caller frame
    (TRL's ``_fused_forward``), within three frames."""
    for _ in range(3):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, nn.Module):
            return candidate
        frame = frame.f_back
    return None


def _why_trl_kernel(state: PatchState | None) -> str | None:
    """Why this call must run TRL's own kernel (``None``: the fused op runs it)."""
    if state is None:
        return "the model is not patched"
    if state.unfusable_reason is not None:
        return f"the patch runs the original path ({state.unfusable_reason})"
    return None


def _note_bypass(state: PatchState, reason: str) -> None:
    state.bypass_reason = reason
    state.warn_bypass_once(f"liger_patch: {reason}; the fused loss is not used for it.", stacklevel=4)


# The patches already told that their loss options do not apply under TRL's head, by id (a
# PatchState is unhashable); an entry leaves with its patch, so an id is never mistaken.
_WARNED_OPTIONS: weakref.WeakValueDictionary[int, PatchState] = weakref.WeakValueDictionary()


def warn_unused_loss_options(
    state: PatchState,
    warned: weakref.WeakValueDictionary,
    because: str,
    where: str,
    stacklevel: int = 5,
) -> None:
    """Say once per patch (``warned``: the patches already told, one registry per TRL path) which
    of its loss-math options a TRL loss does not apply: ``because`` says why, ``where`` where."""
    changed = state.options.changed()
    unused = [name for name in LOSS_OPTIONS if name in changed]
    if unused and warned.get(id(state)) is not state:
        warned[id(state)] = state
        warnings.warn(
            f"liger_patch: {because}; the patch's {', '.join(unused)} do not apply {where} "
            "(use TRL's own settings).",
            UserWarning,
            stacklevel=stacklevel,
        )


def _warn_unused_loss_options(state: PatchState) -> None:
    """Say once per patch which of its loss-math options TRL's fused head does not apply."""
    warn_unused_loss_options(
        state,
        _WARNED_OPTIONS,
        "TRL computes its loss from the per-token log-probs alone",
        "under TRL's fused LM head",
    )


def installed() -> bool:
    """Whether TRL's kernel is ours (TRL imported and :func:`install` ran)."""
    module = sys.modules.get(TRL_MODULE)
    return module is not None and isinstance(getattr(module, KERNEL_ATTR, None), FusedLogProbHead)


def install(module: Any = None) -> bool:
    """Put :class:`FusedLogProbHead` in place of TRL's kernel (idempotent). False when this TRL
    has no such kernel (older than 1.15: its trainers call the model's forward with labels,
    which the patch fuses directly)."""
    module = module if module is not None else sys.modules.get(TRL_MODULE)
    if module is None or not hasattr(module, KERNEL_ATTR) or not hasattr(module, "add_fused_lm_head"):
        return False
    current = getattr(module, KERNEL_ATTR)
    if not isinstance(current, FusedLogProbHead):
        setattr(module, KERNEL_ATTR, FusedLogProbHead(current))
    return True


_INSTALLERS: dict[str, Callable[[Any], bool]] = {}
"""TRL module name -> what puts our hook into it (given the module), run once it is imported."""


def install_on_import(name: str, installer: Callable[[Any], bool]) -> None:
    """Have :func:`install_when_imported` run ``installer(module)`` for TRL's module ``name`` (how
    ``integrations.trl_distillation`` and ``integrations.trl_gkd`` hook TRL's distillation trainers)."""
    _INSTALLERS[name] = installer


class _InstallOnImport(importlib.abc.MetaPathFinder):
    """Runs a module's installer right after it is imported (``trl.trainer.utils``: :func:`install`)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        installer = _INSTALLERS.get(name)
        if installer is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            loader_exec(module)
            installer(module)

        spec.loader.exec_module = exec_module
        return spec


def install_when_imported() -> None:
    """Each TRL module's installer (:func:`install`, and those :func:`install_on_import` added) now
    if the module is imported, else when it is (nothing if TRL is not installed)."""
    waiting = False
    for name, installer in _INSTALLERS.items():
        if name in sys.modules:
            installer(sys.modules[name])
        else:
            waiting = True
    if (
        waiting
        and importlib.machinery.PathFinder.find_spec("trl") is not None
        and not any(isinstance(finder, _InstallOnImport) for finder in sys.meta_path)
    ):
        sys.meta_path.insert(0, _InstallOnImport())


install_on_import(TRL_MODULE, install)
after_apply(install_when_imported)  # TRL's trainers call their own kernel, not the forward: route it to us
