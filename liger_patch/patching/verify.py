"""Patched against unpatched, for any model type: ``python -m liger_patch verify``.

For each model type a tiny random model is built (``tiny/``: the type's own config class,
shrunk), and one training forward + backward runs unpatched and patched from the same weights
on the same batch (ignored labels in several positions; images for VLMs). The loss and every
parameter's gradient are compared at the dtype's tolerance, and the type is classified:

* **verified**: the fused path ran (no logits built) and matched;
* **refused**: ``apply_liger_to`` refuses it, or the patched forward falls back to the original
  path, with the reason (nothing is patched on a guess);
* **failed**: the fused path ran and did not match, or raised. A failed type goes into
  ``derive.REFUSED`` until it is fixed: no silent wrong loss, ever.

``--model`` checks a user's own architecture the same way (a tiny random model of its config).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from liger_patch.patching.apply import apply_liger_to
from liger_patch.patching.derive import CAUSAL_LM, TASKS
from liger_patch.patching.head import fusable_head
from liger_patch.patching.registry import UnsupportedModelError
from liger_patch.patching.state import patch_state

__all__ = [
    "FAILED",
    "REFUSED",
    "VERIFIED",
    "Tolerance",
    "Verdict",
    "batch_to",
    "sweep",
    "verify_model",
    "verify_type",
]

VERIFIED, REFUSED, FAILED = "verified", "refused", "failed"


@dataclass(frozen=True)
class Tolerance:
    """How close patched must be to unpatched: the loss (relative) and each gradient (the norm
    of the difference over the norm of the unpatched gradient)."""

    loss: float
    grad: float

    @staticmethod
    def for_dtype(dtype: torch.dtype) -> Tolerance:
        return Tolerance(loss=1e-5, grad=1e-4) if dtype == torch.float32 else Tolerance(loss=2e-2, grad=1e-1)


@dataclass
class Verdict:
    """One type's result; ``loss_error`` / ``grad_error`` are the measured relative errors."""

    model_type: str
    task: str
    status: str
    reason: str = ""
    class_name: str = ""
    loss_error: float | None = None
    grad_error: float | None = None
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
    torch.manual_seed(seed)
    output = model(**batch)
    loss = output.get("loss") if isinstance(output, dict) else output[0]
    if loss is None or not torch.is_tensor(loss):
        raise ValueError(f"{type(model).__name__} returned no loss for a batch with labels")
    loss.backward()
    return output, loss.detach()


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
    ``apply_liger_to``'s ``options``) on ``batch`` and compare; the verdict's ``model_type`` /
    ``task`` are left for the caller."""
    tolerance = tolerance or Tolerance.for_dtype(next(model.parameters()).dtype)
    reference, patched = copy.deepcopy(model).train(), copy.deepcopy(model).train()
    verdict = Verdict(model_type="", task="", status=REFUSED, class_name=type(model).__name__)
    ref_loss, verdict.reason = _reference_step(reference, batch, seed)
    if ref_loss is None:
        return verdict
    try:
        apply_liger_to(patched, **(options or {}))
    except UnsupportedModelError as error:
        verdict.reason = str(error)
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
        return None, f"the unpatched model fails on this batch: {_brief(error)}"
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


def verify_type(
    model_type: str,
    task: str = CAUSAL_LM,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    options: dict[str, Any] | None = None,
) -> Verdict:
    """Build a tiny ``model_type`` model for ``task`` and :func:`verify_model` it; a model that
    cannot be built here (or whose unpatched step fails) is refused with the reason."""
    from liger_patch.patching import tiny

    start = time.perf_counter()
    try:
        model = tiny.tiny_model(model_type, task, seed=seed)  # the batch is built for it in fp32 on CPU
        batch = batch_to(tiny.example_batch(model, seed=seed), torch.device(device), dtype)
        model.to(device=device, dtype=dtype)
    except Exception as error:  # any failure to build is a reason to report, not a crash
        verdict = Verdict(
            model_type, task, REFUSED, reason=f"no tiny model could be built here: {_brief(error)}"
        )
    else:
        verdict = _checked(model, batch, seed, options)
        verdict.model_type, verdict.task = model_type, task
    verdict.seconds = round(time.perf_counter() - start, 3)
    return verdict


def _checked(model: nn.Module, batch: dict[str, Any], seed: int, options: dict[str, Any] | None) -> Verdict:
    """:func:`verify_model`, with an exception from the patched run reported as a failure."""
    try:
        return verify_model(model, batch, seed=seed, options=options)
    except Exception as error:  # the sweep reports every type, whatever happens
        return Verdict("", "", FAILED, reason=_brief(error), class_name=type(model).__name__)


def _brief(error: BaseException) -> str:
    """``Type: first line of the message`` (cut to 300 characters)."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {message}"[:300]


def sweep(
    model_types: Iterable[str] | None = None,
    tasks: Iterable[str] = TASKS,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: Any = None,
    options: dict[str, Any] | None = None,
) -> list[Verdict]:
    """:func:`verify_type` for every (task, model_type) of the installed transformers, or for
    ``model_types`` only. A class mapped by both tasks is run once and reported for both;
    ``progress(verdict)`` is called after each."""
    from liger_patch.patching import tiny

    verdicts, by_class = [], {}
    for task in tasks:
        wanted = tiny.model_types(task)
        if model_types is not None:
            wanted = [mt for mt in wanted if mt in set(model_types)]
        for model_type in wanted:
            key = _class_key(model_type, task)
            if key in by_class:
                verdict = dataclasses.replace(by_class[key], model_type=model_type, task=task)
            else:
                verdict = verify_type(model_type, task, dtype=dtype, device=device, options=options)
                by_class[key] = verdict
            verdicts.append(verdict)
            if progress is not None:
                progress(verdict)
    return verdicts


def _class_key(model_type: str, task: str) -> Any:
    from liger_patch.patching import tiny

    try:
        return tiny.model_class(model_type, task)
    except Exception:  # unknown here: run it and let verify_type report why
        return (model_type, task)
