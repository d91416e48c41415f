"""The verification sweep: :func:`verify_type` for one model type (refused when derivation
declines its class, else a tiny random model of it, built here, then
:func:`~liger_patch.verify.compare.verify_model`), :func:`sweep` for every causal-LM,
image-text-to-text, seq2seq-LM, speech-seq2seq and masked-LM type of the installed transformers.

The tiny-model factory is imported on use: it imports transformers, which ``python -m
liger_patch`` need not pay for its other commands (this module is imported to build the parser).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

from liger_patch.patching.derive import CAUSAL_LM, TASKS, spec_for
from liger_patch.patching.registry import UnsupportedModelError
from liger_patch.verify.compare import batch_to, verify_model
from liger_patch.verify.verdicts import BUILDER_ERROR, FAILED, REFUSED, UNBUILDABLE, Verdict, brief

__all__ = ["sweep", "sweep_plan", "verify_built", "verify_type"]


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
        from liger_patch.verify.models import tiny_model

        def build() -> nn.Module:
            return tiny_model(model_type, task, seed=seed)

        verdict = verify_built(
            model_type, task, build, dtype=dtype, device=device, seed=seed, options=options
        )
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


def verify_built(
    model_type: str,
    task: str | None,
    build: Callable[[], nn.Module],
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    options: dict[str, Any] | None = None,
) -> Verdict:
    """The model ``build()`` makes (a tiny fp32 CPU model: its batch is built for it there) and
    its batch, moved to ``device`` and ``dtype``, then :func:`verify_model`; or, when building
    either raises, **unbuildable** / **builder-error** with the reason. Used for a type of the
    sweep and for a user's own architecture (``verify --model``, with ``task=None``: the family
    whose auto mapping names the model's class, ``lm_batches.task_of``, else causal LM)."""
    from liger_patch.verify.batches import example_batch
    from liger_patch.verify.lm_batches import task_of

    try:
        model = build()
        task = task or task_of(model) or CAUSAL_LM
        batch = batch_to(example_batch(model, seed=seed, task=task), torch.device(device), dtype)
        model.to(device=device, dtype=dtype)
    except Exception as error:  # any failure to build is a reason to report, not a crash
        return _not_built(model_type, task or CAUSAL_LM, error)
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


def sweep_plan(
    model_types: Iterable[str] | None = None, tasks: Iterable[str] = TASKS
) -> list[tuple[str, str]]:
    """The ``(task, model_type)`` pairs :func:`sweep` checks, in its order: every type the
    installed transformers maps for each task, or only those of ``model_types`` (a name no task
    maps is left out: the caller says so, see ``verify.cli``)."""
    from liger_patch.verify.models import model_types as mapped_types

    wanted_names = None if model_types is None else set(model_types)
    return [
        (task, model_type)
        for task in tasks
        for model_type in mapped_types(task)
        if wanted_names is None or model_type in wanted_names
    ]


def sweep(
    model_types: Iterable[str] | None = None,
    tasks: Iterable[str] = TASKS,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: Any = None,
    options: dict[str, Any] | None = None,
) -> list[Verdict]:
    """:func:`verify_type` for every pair of :func:`sweep_plan`. A class mapped by both tasks is
    run once and reported for both; ``progress(verdict)`` is called after each."""
    verdicts, by_class = [], {}
    for task, model_type in sweep_plan(model_types, tasks):
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
