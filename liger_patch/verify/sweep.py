"""The verification sweep: :func:`verify_type` for one model type (refused when derivation
declines its class, else a tiny random model of it, built here, then
:func:`~liger_patch.verify.compare.verify_model`), :func:`sweep` for every causal-LM and
image-text-to-text type of the installed transformers.

The tiny-model factory is imported on use: it imports transformers, which ``python -m
liger_patch`` need not pay for its other commands (this module is imported to build the parser).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from liger_patch.patching.derive import CAUSAL_LM, TASKS, spec_for
from liger_patch.patching.registry import UnsupportedModelError
from liger_patch.verify.compare import batch_to, verify_model
from liger_patch.verify.verdicts import BUILDER_ERROR, FAILED, REFUSED, UNBUILDABLE, Verdict, brief

__all__ = ["sweep", "verify_type"]


def verify_type(
    model_type: str,
    task: str = CAUSAL_LM,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    options: dict[str, Any] | None = None,
) -> Verdict:
    """**refused** with derivation's reason when ``apply_liger_to`` declines the type's class
    (nothing is built for it); else build a tiny ``model_type`` model for ``task`` and
    :func:`verify_model` it. A model that cannot be built here is **unbuildable** (a known
    reason: :class:`TinyModelError`) or a **builder-error** (any other exception), with the
    reason."""
    start = time.perf_counter()
    verdict = _refused(model_type, task)
    if verdict is None:
        verdict = _built_and_checked(model_type, task, dtype, device, seed, options)
    verdict.seconds = round(time.perf_counter() - start, 3)
    return verdict


def _refused(model_type: str, task: str) -> Verdict | None:
    """The **refused** verdict when derivation declines the class ``task`` maps ``model_type`` to
    (``derive.spec_for``, the question ``apply_liger_to`` asks of a model's class: one rule, in
    ``derive.py``, asked before anything is built), else ``None``. A type with no class here is
    left to the build, which says why."""
    from liger_patch.verify.models import model_class

    try:
        cls = model_class(model_type, task)
    except Exception:  # reported by the build with the same error
        return None
    try:
        spec_for(cls)
    except UnsupportedModelError as error:
        return Verdict(model_type, task, REFUSED, reason=str(error), class_name=cls.__name__)
    return None


def _built_and_checked(
    model_type: str,
    task: str,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int,
    options: dict[str, Any] | None,
) -> Verdict:
    """A tiny model and its batch built, then :func:`verify_model`; or why they could not be."""
    from liger_patch.verify.batches import example_batch
    from liger_patch.verify.models import tiny_model

    try:
        model = tiny_model(model_type, task, seed=seed)  # the batch is built for it in fp32 on CPU
        batch = batch_to(example_batch(model, seed=seed), torch.device(device), dtype)
        model.to(device=device, dtype=dtype)
    except Exception as error:  # any failure to build is a reason to report, not a crash
        return _not_built(model_type, task, error)
    verdict = _checked(model, batch, seed, options)
    verdict.model_type, verdict.task = model_type, task
    return verdict


def _not_built(model_type: str, task: str, error: Exception) -> Verdict:
    """The verdict for a type whose tiny model or batch could not be made, and why."""
    from liger_patch.verify.config_rules import TinyModelError

    if isinstance(error, TinyModelError):
        return Verdict(model_type, task, UNBUILDABLE, reason=" ".join(str(error).split())[:300])
    return Verdict(model_type, task, BUILDER_ERROR, reason=brief(error))


def _checked(model: nn.Module, batch: dict[str, Any], seed: int, options: dict[str, Any] | None) -> Verdict:
    """:func:`verify_model`, with an exception from the patched run reported as a failure."""
    try:
        return verify_model(model, batch, seed=seed, options=options)
    except Exception as error:  # the sweep reports every type, whatever happens
        return Verdict("", "", FAILED, reason=brief(error), class_name=type(model).__name__)


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
    from liger_patch.verify.models import model_types as mapped_types

    verdicts, by_class = [], {}
    for task in tasks:
        wanted = mapped_types(task)
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
    from liger_patch.verify.models import model_class

    try:
        return model_class(model_type, task)
    except Exception:  # unknown here: run it and let verify_type report why
        return (model_type, task)
