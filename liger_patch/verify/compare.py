"""One model patched against unpatched: a training step of each from the same weights on the
same batch, the loss and every parameter's gradient compared at the dtype's tolerance.

:func:`verify_model` is what the sweep runs on each tiny model, and what ``--model`` runs on a
user's own architecture.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import torch
import torch.nn as nn

from liger_patch.patching.apply import apply_liger_to
from liger_patch.patching.head import fusable_head
from liger_patch.patching.registry import UnsupportedModelError
from liger_patch.patching.state import patch_state
from liger_patch.verify.verdicts import (
    FAILED,
    REFUSED,
    UNPATCHED_FAILS,
    VERIFIED,
    Tolerance,
    Verdict,
    brief,
)

__all__ = ["batch_to", "verify_model"]


def batch_to(batch: dict[str, Any], device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The batch on ``device``; floating inputs (pixels) in the model's ``dtype``."""
    moved = {}
    for key, value in batch.items():
        if torch.is_tensor(value):
            value = value.to(device, dtype=dtype if value.is_floating_point() else None)
        moved[key] = value
    return moved


def _train_step(model: nn.Module, batch: dict[str, Any], seed: int) -> tuple[Any, torch.Tensor]:
    """``(output, loss)`` of one forward + backward from a fixed RNG state (a forward that draws
    random numbers, e.g. router jitter, then draws the same ones patched and unpatched)."""
    _seed_all(seed)
    output = model(**batch)
    loss = output.get("loss") if isinstance(output, dict) else output[0]
    if loss is None or not torch.is_tensor(loss):
        raise ValueError(f"{type(model).__name__} returned no loss for a batch with labels")
    loss.backward()
    return output, loss.detach()


def _seed_all(seed: int) -> None:
    """torch's, NumPy's and Python's random state from ``seed`` (SpeechT5 draws its SpecAugment
    masks with NumPy)."""
    import random

    import numpy as np

    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _relative(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """``|a - b| / max(|b|, floor)`` in norms, in fp64 (0 for two zero tensors)."""
    a, b = a.double(), b.double()
    scale = max(b.norm().item(), floor)
    diff = (a - b).norm().item()
    return diff / scale if scale > 0 else diff


GRAD_FLOOR = 1e-3
"""A gradient is judged relative to ``max(its norm, GRAD_FLOOR x the largest gradient norm)``: some
gradients are zero in exact arithmetic (an attention key bias: softmax ignores a constant shift)
and hold rounding noise only, which a purely relative test would flag."""


def _grad_error(patched: nn.Module, reference: nn.Module) -> tuple[float, str]:
    """The largest relative gradient error over all parameters, and the name where it is."""
    named = dict(reference.named_parameters())
    norms = [p.grad.double().norm().item() for p in named.values() if p.grad is not None]
    floor = GRAD_FLOOR * max(norms, default=0.0)
    worst, where = 0.0, ""
    for name, param in patched.named_parameters():
        ref = named[name].grad
        if (param.grad is None) != (ref is None):
            return math.inf, f"{name}: gradient {'missing' if param.grad is None else 'extra'} when patched"
        if ref is None:
            continue
        error = _relative(param.grad, ref, floor)
        if not error <= worst:
            worst, where = error, name
    return worst, where


def _first_unfinite_grad(model: nn.Module) -> str | None:
    """The name of the first parameter whose gradient holds inf or NaN, else ``None``."""
    for name, param in model.named_parameters():
        if param.grad is not None and not torch.isfinite(param.grad).all():
            return name
    return None


def _fallback_reason(model: nn.Module, output: Any) -> str | None:
    """Why the patched forward did not take the fused path, or ``None`` when it did."""
    state = patch_state(model)
    if state is None:
        return "the model is not patched"
    if state.unfusable_reason is not None:
        return state.unfusable_reason
    head, reason, _ = fusable_head(model, state.spec)
    if head is None:
        return reason
    logits = output.get("logits") if isinstance(output, dict) else None
    if logits is not None:
        return "the patched forward returned logits: the fused path did not run"
    return None


def verify_model(
    model: nn.Module,
    batch: dict[str, Any],
    *,
    tolerance: Tolerance | None = None,
    seed: int = 0,
    options: dict[str, Any] | None = None,
) -> Verdict:
    """Train ``model`` (left untouched: copies are used) one step unpatched and patched (with
    ``apply_liger_to``'s ``options``) on ``batch`` and compare: **refused** when the patch
    declines the model (``apply_liger_to`` refuses it, asked first, or the forward falls back),
    **unpatched-fails** when the unpatched step gives nothing to compare with, else **verified**
    or **failed**. The verdict's ``model_type`` / ``task`` are left for the caller."""
    tolerance = tolerance or Tolerance.for_dtype(next(model.parameters()).dtype)
    reference, patched = copy.deepcopy(model).train(), copy.deepcopy(model).train()
    verdict = Verdict(model_type="", task="", status=REFUSED, class_name=type(model).__name__)
    try:
        apply_liger_to(patched, **(options or {}))
    except UnsupportedModelError as error:
        verdict.reason = str(error)
        return verdict
    ref_loss, verdict.reason = _reference_step(reference, batch, seed)
    if ref_loss is None:
        verdict.status = UNPATCHED_FAILS
        return verdict
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        output, loss = _train_step(patched, batch, seed)
    verdict.reason = _fallback_reason(patched, output) or ""
    if not verdict.reason:
        _compare(verdict, (patched, loss), (reference, ref_loss), tolerance)
    return verdict


def _reference_step(
    reference: nn.Module, batch: dict[str, Any], seed: int
) -> tuple[torch.Tensor | None, str]:
    """``(loss, "")`` of the unpatched step, or ``(None, why it gives nothing to compare with)``:
    it raises, or its loss or a gradient is not finite (the model's own trouble, not the patch's)."""
    try:
        _, loss = _train_step(reference, batch, seed)
    except Exception as error:
        return None, f"the unpatched model fails on this batch: {brief(error)}"
    if not torch.isfinite(loss).all():
        return None, f"the unpatched loss is not finite on this batch ({loss.item()})"
    unfinite = _first_unfinite_grad(reference)
    if unfinite is not None:
        return None, f"the unpatched gradient of {unfinite} is not finite on this batch"
    return loss, ""


def _compare(verdict: Verdict, patched: tuple, reference: tuple, tolerance: Tolerance) -> None:
    """Set the verdict from ``(model, loss)`` patched against unpatched: errors and status."""
    (model, loss), (ref_model, ref_loss) = patched, reference
    verdict.loss_error = abs(loss.double().item() - ref_loss.double().item()) / max(
        abs(ref_loss.item()), 1e-12
    )
    verdict.grad_error, where = _grad_error(model, ref_model)
    if not verdict.loss_error <= tolerance.loss:
        verdict.status, verdict.reason = FAILED, f"loss {loss.item()!r} vs unpatched {ref_loss.item()!r}"
    elif not verdict.grad_error <= tolerance.grad:
        verdict.status = FAILED
        verdict.reason = f"gradient of {where} differs (relative error {verdict.grad_error:.2e})"
    else:
        verdict.status = VERIFIED
