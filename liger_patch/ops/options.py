"""``LossOptions``: every option of the fused loss, validated once, in one frozen object.

The public functional, the Module, ``apply_liger_to`` and ``LigerPatchCallback`` all take the
options as keywords and build one ``LossOptions`` from them; that object travels unchanged to
the chunk loop and the row kernels. Adding an option is a field here (its default, its check
in ``_checked``, its line in ``OPTION_DOCS``) plus its math in the row kernels; every entry
point picks it up (docs/architecture.md walks through it).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from liger_patch.ops.budget import parse_memory_budget
from liger_patch.ops.tuning import DEFAULT_TUNING, Tuning
from liger_patch.ops.validation import FLOAT_DTYPES

Reduction = Literal["mean", "sum", "none"]
BackendName = Literal["auto", "triton", "torch"]
REDUCTIONS = ("mean", "sum", "none")
BACKEND_NAMES = ("auto", "triton", "torch")


def option_float(name: str, value: object) -> float:
    """``float(value)`` for a numeric option; a string or a non-number is refused, naming ``name``
    (``float("0.1")`` would quietly accept text, ``float("abc")`` fail without saying which option)."""
    if not isinstance(value, (str, bytes)):
        try:
            return float(value)
        except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of several elements
            pass
    raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class LossOptions:
    """The options of one fused linear cross-entropy call (docs/loss.md has the math).

    Built from keywords (``LossOptions(z_loss_scale=1e-4)``), checked and normalised on
    construction (numbers become floats; a bad value raises, naming the option). Frozen and
    hashable, so autograd and ``torch.compile`` can carry it as a constant.
    """

    ignore_index: int = -100
    reduction: Reduction = "mean"
    label_smoothing: float = 0.0
    z_loss_scale: float = 0.0
    softcap: float | None = None
    logit_scale: float | None = None
    return_z_loss: bool = False
    backend: BackendName = "auto"
    memory_budget: int | str | None = None
    logits_dtype: torch.dtype | None = None
    tuning: Tuning = DEFAULT_TUNING

    def __post_init__(self) -> None:
        for name, value in _checked(self).items():
            object.__setattr__(self, name, value)

    @property
    def scale(self) -> float:
        """The logit multiplier as a number (1 without ``logit_scale``)."""
        return 1.0 if self.logit_scale is None else self.logit_scale

    @classmethod
    def from_kwargs(cls, where: str = "fused_linear_cross_entropy", **kwargs: Any) -> LossOptions:
        """``LossOptions(**kwargs)``, with an unknown name refused by a message that lists the options."""
        _refuse_unknown(kwargs, where)
        return cls(**kwargs)

    def replace(self, **changes: Any) -> LossOptions:
        """A copy with ``changes`` applied and checked."""
        _refuse_unknown(changes, "LossOptions.replace")
        return dataclasses.replace(self, **changes) if changes else self

    def changed(self) -> dict[str, Any]:
        """The options that differ from their defaults (for reprs and logs)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        }


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(LossOptions))


def _refuse_unknown(kwargs: dict[str, Any], where: str) -> None:
    unknown = sorted(set(kwargs) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"{where} got unknown option(s) {unknown}; the options are {list(OPTION_NAMES)}")


OPTION_DOCS = {
    "ignore_index": "label value of tokens that do not count",
    "reduction": '"mean" over kept tokens (or over ``num_items_in_batch``), "sum", or "none" (per-token '
    "losses in the leading shape, 0 at ignored tokens)",
    "label_smoothing": "epsilon in [0, 1], as in ``F.cross_entropy``",
    "z_loss_scale": "weight (>= 0) of the z-loss ``lse^2`` added per kept token",
    "softcap": "c > 0: ``c * tanh(x / c)`` on the logits (Gemma 2/3's ``final_logit_softcapping``)",
    "logit_scale": "s != 0 multiplies the logits before the softcap (Cohere; Granite is 1 / logits_scaling)",
    "return_z_loss": "also return the z-loss term (reduced like the loss, already inside it)",
    "backend": '"auto" (Triton on CUDA or under TRITON_INTERPRET=1, else torch), "triton", "torch"',
    "memory_budget": 'working memory beyond inputs, outputs and gradients: bytes, a size ("256MiB"), '
    '"default" (512 MiB) or "lean" (32 MiB); None reads LIGER_MEMORY_BUDGET, else "default"',
    "logits_dtype": "how logits chunks are stored: None (the input dtype, as an unpatched head stores "
    "them) or torch.float32 (more exact, slower)",
    "tuning": "a ``Tuning``: measured knobs of how the op runs (never what it computes)",
}
"""One line per option, for the docstrings of every entry point (``options_docstring``)."""
assert set(OPTION_DOCS) == set(OPTION_NAMES), "every LossOptions field needs its line in OPTION_DOCS"


def _checked(opts: LossOptions) -> dict[str, Any]:
    """The normalised value of every option; raises for a bad one, naming it."""
    if not isinstance(opts.ignore_index, int) or isinstance(opts.ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {type(opts.ignore_index).__name__}")
    if not -(2**63) <= opts.ignore_index < 2**63:
        raise ValueError(f"ignore_index must fit in int64 (labels are int64), got {opts.ignore_index}")
    if opts.reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {opts.reduction!r}; expected one of {REDUCTIONS}")
    if opts.backend not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {opts.backend!r}; expected one of {BACKEND_NAMES}")
    label_smoothing = option_float("label_smoothing", opts.label_smoothing)
    z_loss_scale = option_float("z_loss_scale", opts.z_loss_scale)
    softcap = None if opts.softcap is None else option_float("softcap", opts.softcap)
    logit_scale = None if opts.logit_scale is None else option_float("logit_scale", opts.logit_scale)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not (math.isfinite(z_loss_scale) and z_loss_scale >= 0.0):
        raise ValueError(f"z_loss_scale must be finite and >= 0, got {z_loss_scale}")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0.0):
        raise ValueError(f"softcap must be a finite number > 0 (or None), got {softcap}")
    if logit_scale is not None and not (math.isfinite(logit_scale) and logit_scale != 0.0):
        raise ValueError(f"logit_scale must be a finite non-zero number (or None), got {logit_scale}")
    if opts.memory_budget is not None:
        parse_memory_budget(opts.memory_budget)
    if opts.logits_dtype is not None and opts.logits_dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"logits_dtype must be None or a float dtype (torch.float32), got {opts.logits_dtype!r}"
        )
    if not isinstance(opts.tuning, Tuning):
        raise TypeError(f"tuning must be a liger_patch.ops.tuning.Tuning, got {type(opts.tuning).__name__}")
    return dict(
        label_smoothing=label_smoothing,
        z_loss_scale=z_loss_scale,
        softcap=softcap,
        logit_scale=logit_scale,
        return_z_loss=bool(opts.return_z_loss),
    )


DEFAULT_OPTIONS = LossOptions()


def check_logits_dtype(logits_dtype: torch.dtype | None, input_dtype: torch.dtype) -> None:
    """``logits_dtype`` is None (the input dtype), fp32, or the input dtype itself."""
    if logits_dtype is None or logits_dtype in (torch.float32, input_dtype):
        return
    raise ValueError(
        f"logits_dtype must be None (the input dtype, {input_dtype}) or torch.float32, got {logits_dtype!r}"
    )


def options_parameters(exclude: tuple[str, ...] = ()) -> list[inspect.Parameter]:
    """Keyword-only parameters, one per option (defaults and annotations from the fields), for
    the ``__signature__`` of an entry point that takes ``**options``: ``help()``, IDEs and
    ``inspect.signature`` then list every option."""
    return [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in dataclasses.fields(LossOptions)
        if f.name not in exclude
    ]


def options_docstring(exclude: tuple[str, ...] = (), indent: str = "        ") -> str:
    """``name: meaning`` lines of the options, for an entry point's docstring."""
    return "\n".join(f"{indent}{name}: {OPTION_DOCS[name]}" for name in OPTION_NAMES if name not in exclude)
