"""``DistillOptions``: every option of the fused distillation loss, checked once, in one frozen object.

The public functional and the Module build one from keywords (``build_distill_options``); the
registered operator receives it as one string (``key``) and rebuilds it (``from_key``, cached).
Each side's final logits at the temperature are described by a ``SideOptions`` (``student``,
``teacher``), which ``core.final_logits`` and the shared chunk machinery read: the temperature
folds into the logit scale and softcap exactly as for ``fused_linear_logprobs``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from liger_patch.ops.core.final_logits import temperature_options
from liger_patch.ops.core.options import (
    BackendName,
    Reduction,
    cached_build,
    check_logits_dtype,
    check_shared,
    compile_constant,
    docstring_lines,
    from_constant,
    option_float,
    optional_nonzero,
    optional_positive,
    options_from_key,
    options_key,
    refuse_unknown,
    unit_interval,
)
from liger_patch.ops.core.tuning import DEFAULT_TUNING, Tuning


@dataclass(frozen=True)
class SideOptions:
    """One side's final logits at the temperature as the shared machinery reads them
    (``core.final_logits.LogitsOptions``): the side's logit scale and softcap with the temperature
    folded in (``temperature_options``), and the call's tuning. The fused logits GEMM never sums
    a side's logits (that is the cross-entropy's label smoothing): ``label_smoothing`` is 0."""

    logit_scale: float | None
    softcap: float | None
    tuning: Tuning
    label_smoothing: float = 0.0

    @property
    def scale(self) -> float:
        """The logit multiplier as a number (1 without ``logit_scale``)."""
        return 1.0 if self.logit_scale is None else self.logit_scale


@dataclass(frozen=True)
class DistillOptions:
    """The options of one ``fused_linear_distillation`` call (docs/distillation.md has the math).

    Checked and normalised on construction (numbers become floats; a bad value raises, naming
    the option). ``key`` is every option as one string, ``student`` and ``teacher`` the
    ``SideOptions`` whose ``final_logits`` are that side's final logits divided by the
    temperature, with this call's tuning.
    """

    beta: float = 0.0
    temperature: float = 1.0
    ce_weight: float = 0.0
    ignore_index: int = -100
    reduction: Reduction = "mean"
    student_softcap: float | None = None
    teacher_softcap: float | None = None
    student_logit_scale: float | None = None
    teacher_logit_scale: float | None = None
    backend: BackendName = "auto"
    memory_budget: int | str | None = None
    logits_dtype: torch.dtype | None = None
    tuning: Tuning = DEFAULT_TUNING

    def __post_init__(self) -> None:
        for name, value in _checked(self).items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "key", options_key(self))
        object.__setattr__(self, "student", self._side(self.student_softcap, self.student_logit_scale))
        object.__setattr__(self, "teacher", self._side(self.teacher_softcap, self.teacher_logit_scale))

    def _side(self, softcap: float | None, logit_scale: float | None) -> SideOptions:
        return SideOptions(tuning=self.tuning, **temperature_options(self.temperature, logit_scale, softcap))

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def from_key(key: str) -> DistillOptions:
        """The options ``key`` was made from (``DistillOptions(...).key``)."""
        return options_from_key(DistillOptions, key)

    def logits_dtype_for(self, input_dtype: torch.dtype) -> torch.dtype:
        """The dtype a side's logits chunks are stored in: ``logits_dtype``, else its input's."""
        return self.logits_dtype or input_dtype


def check_logits_dtypes(opts: DistillOptions, student_dtype: torch.dtype, teacher_dtype: torch.dtype) -> None:
    """``opts.logits_dtype`` is None, fp32, or the input dtype of each side (the message names
    the side), as the cross-entropy op checks its own against its input."""
    for side, dtype in (("student", student_dtype), ("teacher", teacher_dtype)):
        try:
            check_logits_dtype(opts.logits_dtype, dtype)
        except ValueError as exc:
            raise ValueError(f"{side}: {exc}") from None


DISTILL_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(DistillOptions))

DISTILL_OPTION_DOCS = {
    "beta": "in [0, 1]: 0 is KL(teacher || student), 1 is KL(student || teacher), between them the "
    "generalized Jensen-Shannon divergence with mixture (1 - beta) p_student + beta p_teacher (TRL's)",
    "temperature": "T > 0 dividing both sides' final logits before the divergence",
    "ce_weight": "w in [0, 1]: each kept token's loss is (1 - w) divergence + w cross-entropy of the "
    "student's final logits (no temperature) against the label",
    "ignore_index": "label value of tokens that do not count",
    "reduction": '"mean" over kept tokens (or over ``num_items_in_batch``), "sum", or "none" (per-token '
    "losses in the leading shape, 0 at ignored tokens)",
    "student_softcap": "c > 0: ``c * tanh(x / c)`` on the student's logits (after its logit scale)",
    "teacher_softcap": "the same for the teacher's logits",
    "student_logit_scale": "s != 0 multiplies the student's logits before its softcap",
    "teacher_logit_scale": "the same for the teacher's logits",
    "backend": '"auto" (Triton on CUDA or under TRITON_INTERPRET=1, else torch), "triton", "torch"',
    "memory_budget": "working memory beyond inputs, outputs and gradients, as for "
    '``fused_linear_cross_entropy`` (bytes, a size such as "256MiB", or a named budget)',
    "logits_dtype": "how the Triton backend stores the logits chunks: None (each side's input dtype, as "
    "an unpatched half-precision head stores them) or torch.float32 (never rounded to half precision: "
    "TRL DistillationTrainer's chunked kernel; 4 bytes a logit, so smaller chunks). The torch backend "
    "keeps fp32 logits whatever this says",
    "tuning": "a ``Tuning``: measured knobs of how the op runs (never what it computes), as for "
    "``fused_linear_cross_entropy``",
}
"""One line per option, for the docstrings of the entry points."""
assert set(DISTILL_OPTION_DOCS) == set(DISTILL_OPTION_NAMES), "every option needs its line"


def _checked(opts: DistillOptions) -> dict[str, Any]:
    """The normalised value of every option; raises for a bad one, naming it. ``ignore_index``,
    ``reduction``, ``memory_budget``, ``logits_dtype`` and ``tuning`` are checked as the
    cross-entropy op checks them (a dtype against the inputs' at the call: ``check_logits_dtypes``)."""
    check_shared(opts)
    temperature = option_float("temperature", opts.temperature)
    if not (math.isfinite(temperature) and temperature > 0.0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    return dict(
        beta=unit_interval("beta", opts.beta),
        ce_weight=unit_interval("ce_weight", opts.ce_weight),
        temperature=temperature,
        student_softcap=optional_positive("student_softcap", opts.student_softcap),
        teacher_softcap=optional_positive("teacher_softcap", opts.teacher_softcap),
        student_logit_scale=optional_nonzero("student_logit_scale", opts.student_logit_scale),
        teacher_logit_scale=optional_nonzero("teacher_logit_scale", opts.teacher_logit_scale),
    )


@compile_constant
def build_distill_options(where: str = "fused_linear_distillation", **options: Any) -> DistillOptions:
    """``DistillOptions(**options)`` (floats possibly encoded by ``core.options.constant_changes``),
    an unknown name refused with the list of options, naming ``where``; cached, so a call repeated
    with the same options builds nothing, and a constant of the graph under ``torch.compile``."""
    refuse_unknown(options, DISTILL_OPTION_NAMES, where)
    return _build(changes=options)


@cached_build
def _build(changes: dict[str, Any]) -> DistillOptions:
    return DistillOptions(**{name: from_constant(name, value) for name, value in changes.items()})


@compile_constant
def distill_options_from_key(key: str) -> DistillOptions:
    """``DistillOptions.from_key``, a constant under ``torch.compile`` (for the Module's options)."""
    return DistillOptions.from_key(key)


def distill_options_docstring(indent: str = "        ") -> str:
    """``name: meaning`` lines of the options, for an entry point's docstring."""
    return docstring_lines(DISTILL_OPTION_DOCS, DISTILL_OPTION_NAMES, indent=indent)
