"""``LossOptions``: every option of the fused loss, validated once, in one frozen object.

The public functional, the Module, ``apply_liger_to`` and ``LigerPatchCallback`` all take the
options as keywords and build one ``LossOptions`` from them; that object travels unchanged to
the chunk loop and the row kernels. Adding an option is a field here (its default, its check
in ``_checked``, its line in ``OPTION_DOCS``) plus its math in the row kernels; every entry
point picks it up (docs/architecture.md walks through it).

Every field carries its kind (:class:`OptionKind`: loss math, output or runtime), and every list
of "the options of kind X" is derived from those tags (:func:`options_of_kind`): what TRL's
log-prob head leaves out, what the vocabulary-parallel loss must know how to compute, ...
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch

from liger_patch.ops.core.options import (
    BackendName,
    Reduction,
    cached_build,
    check_shared,
    compile_constant,
    docstring_lines,
    from_constant,
    keyword_parameters,
    option_float,
    optional_nonzero,
    optional_positive,
    options_from_key,
    options_key,
    refuse_unknown,
    unit_interval,
)
from liger_patch.ops.core.tuning import DEFAULT_TUNING, Tuning


class OptionKind(enum.Enum):
    """What an option changes. Every ``LossOptions`` field carries one (``_option``)."""

    LOSS = "loss math"  # the value or the gradient of the loss
    OUTPUT = "output"  # adds an output; the loss and its gradients are unchanged
    RUNTIME = "runtime"  # how the op runs (backend, memory, tuning): never what it computes


def _option(default: Any, kind: OptionKind) -> Any:
    """A ``LossOptions`` field: its default and its kind."""
    return dataclasses.field(default=default, metadata={"kind": kind})


@dataclass(frozen=True)
class LossOptions:
    """The options of one fused linear cross-entropy call (docs/loss.md has the math).

    Built from keywords (``LossOptions(z_loss_scale=1e-4)``), checked and normalised on
    construction (numbers become floats; a bad value raises, naming the option). Frozen and
    hashable, so autograd and ``torch.compile`` can carry it as a constant. ``key`` is every
    option as one string, which the registered operator takes (``LossOptions.from_key``).
    """

    ignore_index: int = _option(-100, OptionKind.LOSS)
    reduction: Reduction = _option("mean", OptionKind.LOSS)
    label_smoothing: float = _option(0.0, OptionKind.LOSS)
    z_loss_scale: float = _option(0.0, OptionKind.LOSS)
    softcap: float | None = _option(None, OptionKind.LOSS)
    logit_scale: float | None = _option(None, OptionKind.LOSS)
    return_z_loss: bool = _option(False, OptionKind.OUTPUT)
    return_token_accuracy: bool = _option(False, OptionKind.OUTPUT)
    return_predicted_tokens: bool = _option(False, OptionKind.OUTPUT)
    return_entropy: bool = _option(False, OptionKind.OUTPUT)
    use_token_scaling: bool = _option(False, OptionKind.LOSS)
    backend: BackendName = _option("auto", OptionKind.RUNTIME)
    memory_budget: int | str | None = _option(None, OptionKind.RUNTIME)
    logits_dtype: torch.dtype | None = _option(None, OptionKind.RUNTIME)
    tuning: Tuning = _option(DEFAULT_TUNING, OptionKind.RUNTIME)

    def __post_init__(self) -> None:
        for name, value in _checked(self).items():
            object.__setattr__(self, name, value)
        # Every option as one string (not a field): how the registered operator carries them.
        object.__setattr__(self, "key", options_key(self))

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def from_key(key: str) -> LossOptions:
        """The options ``key`` was made from (``LossOptions(...).key``)."""
        return options_from_key(LossOptions, key)

    @property
    def scale(self) -> float:
        """The logit multiplier as a number (1 without ``logit_scale``)."""
        return 1.0 if self.logit_scale is None else self.logit_scale

    @classmethod
    def from_kwargs(cls, where: str = "fused_linear_cross_entropy", **kwargs: Any) -> LossOptions:
        """``LossOptions(**kwargs)``, with an unknown name refused by a message that lists the options."""
        refuse_unknown(kwargs, OPTION_NAMES, where)
        return cls(**kwargs)

    def replace(self, **changes: Any) -> LossOptions:
        """A copy with ``changes`` applied and checked."""
        refuse_unknown(changes, OPTION_NAMES, "LossOptions.replace")
        return dataclasses.replace(self, **changes) if changes else self

    def changed(self) -> dict[str, Any]:
        """The options that differ from their defaults (for reprs and logs)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        }


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(LossOptions))


def option_kinds(cls: type) -> dict[str, OptionKind]:
    """Each field of the dataclass ``cls`` and its kind; a field without one is refused, naming it."""
    kinds = {f.name: f.metadata.get("kind") for f in dataclasses.fields(cls)}
    untagged = [name for name, kind in kinds.items() if not isinstance(kind, OptionKind)]
    if untagged:
        raise TypeError(
            f"{cls.__name__} fields without a kind: {untagged}; declare them as _option(default, kind)"
        )
    return kinds


OPTION_KINDS = option_kinds(LossOptions)


def options_of_kind(*kinds: OptionKind) -> tuple[str, ...]:
    """The options of any of ``kinds``, in field order."""
    return tuple(name for name, kind in OPTION_KINDS.items() if kind in kinds)


def option_defaults(*kinds: OptionKind) -> dict[str, Any]:
    """``{name: default}`` of the options of any of ``kinds``."""
    return {f.name: f.default for f in dataclasses.fields(LossOptions) if OPTION_KINDS[f.name] in kinds}


LOSS_OPTIONS = options_of_kind(OptionKind.LOSS)
OUTPUT_OPTIONS = options_of_kind(OptionKind.OUTPUT)


OPTION_DOCS = {
    "ignore_index": "label value of tokens that do not count",
    "reduction": '"mean" over kept tokens (or over ``num_items_in_batch``), "sum", or "none" (per-token '
    "losses in the leading shape, 0 at ignored tokens)",
    "label_smoothing": "epsilon in [0, 1], as in ``F.cross_entropy``",
    "z_loss_scale": "weight (>= 0) of the z-loss ``lse^2`` added per kept token",
    "softcap": "c > 0: ``c * tanh(x / c)`` on the logits (Gemma 2/3's ``final_logit_softcapping``)",
    "logit_scale": "s != 0 multiplies the logits before the softcap (Cohere; Granite is 1 / logits_scaling)",
    "return_z_loss": "also return the z-loss term (reduced like the loss, already inside it)",
    "return_token_accuracy": "also return the share of kept tokens whose argmax is the label (per token "
    'for reduction "none"); no gradient',
    "return_predicted_tokens": "also return the argmax per token (int64, leading shape, -1 at ignored)",
    "return_entropy": "also return the entropy of the softmax: the mean over kept tokens (per token for "
    'reduction "none"), differentiable',
    "use_token_scaling": "multiply each token's loss (z-loss term included) by its detached predicted "
    'probability of the label (TRL\'s loss_type="dft")',
    "backend": '"auto" (Triton on CUDA or under TRITON_INTERPRET=1, else torch), "triton", "torch"',
    "memory_budget": 'working memory beyond inputs, outputs and gradients: bytes, a size ("256MiB"), '
    '"default" (512 MiB), "lean" (32 MiB) or "batch" (6x the hidden states\' bytes, 256 MiB-1 GiB); None '
    'reads LIGER_MEMORY_BUDGET, else "default" ("batch" in a patched model\'s forward)',
    "logits_dtype": "how logits chunks are stored: None (the input dtype, as an unpatched head stores "
    "them) or torch.float32 (more exact, slower)",
    "tuning": "a ``Tuning``: measured knobs of how the op runs (never what it computes)",
}
"""One line per option, for the docstrings of every entry point (``options_docstring``)."""
assert set(OPTION_DOCS) == set(OPTION_NAMES), "every LossOptions field needs its line in OPTION_DOCS"


def _checked(opts: LossOptions) -> dict[str, Any]:
    """The normalised value of every option; raises for a bad one, naming it."""
    check_shared(opts)
    label_smoothing = unit_interval("label_smoothing", opts.label_smoothing)
    z_loss_scale = option_float("z_loss_scale", opts.z_loss_scale)
    if not (math.isfinite(z_loss_scale) and z_loss_scale >= 0.0):
        raise ValueError(f"z_loss_scale must be finite and >= 0, got {z_loss_scale}")
    softcap = optional_positive("softcap", opts.softcap)
    logit_scale = optional_nonzero("logit_scale", opts.logit_scale)
    return dict(
        label_smoothing=label_smoothing,
        z_loss_scale=z_loss_scale,
        softcap=softcap,
        logit_scale=logit_scale,
        **{name: bool(getattr(opts, name)) for name in FLAG_NAMES},
    )


FLAG_NAMES = tuple(f.name for f in dataclasses.fields(LossOptions) if isinstance(f.default, bool))
"""The on/off options (a ``bool`` default), normalised by ``bool()``."""


DEFAULT_OPTIONS = LossOptions()


@compile_constant
def build_options(base_key: str, where: str = "LossOptions.replace", **changes: Any) -> LossOptions:
    """The options of ``base_key`` (a ``LossOptions.key``) with ``changes`` applied and checked
    (an unknown name refused, naming ``where``); cached, so a call repeated with the same
    options builds nothing.

    Under ``torch.compile`` this runs once while tracing and its result is a constant of the
    graph. It takes the base options as their key: a string stays a constant where the numbers
    inside an options object held by a compiled module would be traced as symbols."""
    return _build(base_key, where, changes=changes)


@cached_build
def _build(base_key: str, where: str, changes: dict[str, Any]) -> LossOptions:
    refuse_unknown(changes, OPTION_NAMES, where)
    changes = {name: from_constant(name, value) for name, value in changes.items()}
    base = LossOptions.from_key(base_key)
    return dataclasses.replace(base, **changes) if changes else base


def options_parameters(exclude: tuple[str, ...] = ()) -> list[inspect.Parameter]:
    """Keyword-only parameters, one per option, for the ``__signature__`` of an entry point that
    takes ``**options`` (``core.options.keyword_parameters``)."""
    return keyword_parameters(LossOptions, exclude)


def options_docstring(exclude: tuple[str, ...] = (), indent: str = "        ") -> str:
    """``name: meaning`` lines of the options, for an entry point's docstring."""
    return docstring_lines(OPTION_DOCS, OPTION_NAMES, exclude, indent)
