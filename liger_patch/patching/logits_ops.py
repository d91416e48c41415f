"""The ops a forward may apply to its logits between its head and its loss, each defined once.

Each entry of :data:`OPS` says both what the op does to real logits (``replay``: the model's own
expression, so that real logits made from deferred ones, for ``LIGER_RETURN_LOGITS=1`` or for a
use with no fused counterpart, are the model's bit for bit) and what it means for the fused loss
(``fold``: its contribution to ``logit_scale``, ``softcap`` and the constant ``bias``). Deferred
logits record :class:`LogitsOp` entries; :func:`replay` and :func:`head_math` read them, through
this table only. Token-dimension ops (indexing, reshapes, a transpose of two token dimensions)
are recorded too: the loss applies them to the hidden states, replay to the real logits.

The fused loss computes ``softcap(s * (x + b)) = c * tanh(s * (x + b) / c)``. Scales multiply up
to ``p`` before one tanh and to ``q`` after it; ``q * tanh(p * x)`` is that with ``c = q`` and
``s = p * q`` (``q > 0``). Without a tanh, ``s = p`` and there is no softcap. A constant ``a``
added while the scale so far is ``p`` is ``p * (x + a / p)``: ``b`` gathers ``a / p`` (BART's
``final_logits_bias``); one added after the tanh has no counterpart. A log-softmax over the
vocabulary changes no cross-entropy (``lse`` of log-probs is 0), so it folds to nothing, but
nothing may follow it but a cast.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from liger_patch.patching.seam import UnfusableLogitsUse

__all__ = [
    "OPS",
    "HeadMath",
    "LogitsOp",
    "OpKind",
    "head_math",
    "loss_math",
    "normalized",
    "recorded",
    "replay",
]


class LogitsOp(NamedTuple):
    """One recorded op: its ``kind`` (a key of :data:`OPS`) and its operand as the model gave it."""

    kind: str
    operand: Any = None


# Not frozen, as seam.LossRequest (torch 2.11's dynamo).
@dataclass
class HeadMath:
    """Ops folded so far: the scale before the tanh, the scale after it, whether it came, the
    constants added (each with the scale it is divided by) and whether a log-softmax came."""

    before: float = 1.0
    after: float = 1.0
    capped: bool = False
    added: tuple[tuple[Any, float], ...] = field(default_factory=tuple)
    normalized: bool = False

    def _open(self, what: str) -> None:
        if self.normalized:
            raise UnfusableLogitsUse(f"it {what} the log-probabilities (after a log_softmax)")

    def scaled(self, value: float) -> HeadMath:
        self._open("scales")
        if self.capped:
            return HeadMath(self.before, self.after * value, True, self.added)
        return HeadMath(self.before * value, self.after, False, self.added)

    def tanh(self) -> HeadMath:
        self._open("applies tanh to")
        if self.capped:
            raise UnfusableLogitsUse("it applies tanh to the logits twice")
        return HeadMath(self.before, self.after, True, self.added)

    def plus(self, constant: Any) -> HeadMath:
        self._open("adds to")
        if self.capped:
            raise UnfusableLogitsUse("it adds a constant to the logits after their tanh softcap")
        return HeadMath(self.before, self.after, False, (*self.added, (constant, self.before)))

    def log_softmax(self) -> HeadMath:
        self._open("applies log_softmax to")
        return HeadMath(self.before, self.after, self.capped, self.added, True)


def _scalar(operand: Any, what: str) -> float:
    """``operand`` as a Python float for the fused loss; a learnable, non-scalar, zero or
    non-finite one is refused (the model's own path then runs, whatever it makes of it)."""
    if isinstance(operand, numbers.Real) and not isinstance(operand, bool):
        return _usable(float(operand), what)
    if torch.is_tensor(operand) and operand.numel() == 1 and not operand.is_complex():
        if operand.requires_grad:
            raise UnfusableLogitsUse(
                f"it {what} the logits by a learnable tensor (the fused loss takes a constant)"
            )
        return _usable(float(operand), what)
    raise UnfusableLogitsUse(f"it {what} the logits by {type(operand).__name__} (not a scalar constant)")


def _usable(value: float, what: str) -> float:
    # ``value - value == 0`` is False exactly for inf and NaN; unlike math.isfinite it also
    # traces when torch.compile(dynamic=True) makes the constant a symbolic float.
    if value == 0.0 or not value - value == 0.0:
        raise UnfusableLogitsUse(
            f"it {what} the logits by {value} (the fused loss takes a finite, non-zero one)"
        )
    return value


def _constant(operand: Any) -> Any:
    """``operand`` of an addition as the fused loss takes it: a finite real number, or a floating
    tensor that is the same for every token (its dimensions before the last are 1; the last is
    the vocabulary or 1). A learnable tensor is fine: its gradient comes back through the loss's
    bias gradient."""
    if isinstance(operand, numbers.Real) and not isinstance(operand, bool):
        if not float(operand) - float(operand) == 0.0:
            raise UnfusableLogitsUse(f"it adds {operand} to the logits (not finite)")
        return operand
    if torch.is_tensor(operand) and operand.is_floating_point():
        if all(size == 1 for size in operand.shape[:-1]):
            return operand
        raise UnfusableLogitsUse(
            f"it adds a tensor of shape {tuple(operand.shape)} to the logits "
            "(not one constant per vocabulary entry)"
        )
    raise UnfusableLogitsUse(f"it adds {type(operand).__name__} to the logits (not a constant)")


def _negated(operand: Any) -> Any:
    return -_constant(operand)


def _same(folded: HeadMath, _: Any) -> HeadMath:
    return folded


@dataclass(frozen=True)
class OpKind:
    """One kind of op: ``replay(logits, operand)`` on real logits, ``fold(math, operand)`` for the loss."""

    replay: Callable[[torch.Tensor, Any], torch.Tensor]
    fold: Callable[[HeadMath, Any], HeadMath]


OPS: dict[str, OpKind] = {
    "mul": OpKind(replay=operator.mul, fold=lambda folded, x: folded.scaled(_scalar(x, "multiplies"))),
    "div": OpKind(replay=operator.truediv, fold=lambda folded, x: folded.scaled(1.0 / _scalar(x, "divides"))),
    "tanh": OpKind(replay=lambda logits, _: torch.tanh(logits), fold=lambda folded, _: folded.tanh()),
    # a constant added after the head (BART's final_logits_bias): the loss's bias
    "add": OpKind(replay=operator.add, fold=lambda folded, x: folded.plus(_constant(x))),
    "sub": OpKind(replay=operator.sub, fold=lambda folded, x: folded.plus(_negated(x))),
    # a cast changes what the model computes in, not the loss: the fused op computes in fp32
    "cast": OpKind(replay=lambda logits, dtype: logits.to(dtype), fold=_same),
    # log-probs over the vocabulary: the same cross-entropy (ProphetNet's log_softmax + nll_loss)
    "log_softmax": OpKind(
        replay=lambda logits, dtype: F.log_softmax(logits, dim=-1, dtype=dtype),
        fold=lambda folded, _: folded.log_softmax(),
    ),
    # token dimensions: applied to the hidden states for the loss, to the real logits on replay
    "index": OpKind(replay=lambda logits, index: logits[index], fold=_same),
    "view": OpKind(replay=lambda logits, shape: logits.view(shape), fold=_same),
    "reshape": OpKind(replay=lambda logits, shape: logits.reshape(shape), fold=_same),
    "transpose": OpKind(replay=lambda logits, dims: logits.transpose(*dims), fold=_same),
}


def recorded(kind: str, operand: Any = None) -> LogitsOp:
    """The op to record, refused at once when no chain could fuse it (a learnable or non-scalar
    factor): its fold is tried on its own."""
    OPS[kind].fold(HeadMath(), operand)
    return LogitsOp(kind, operand)


def replay(logits: torch.Tensor, ops: tuple[LogitsOp, ...]) -> torch.Tensor:
    """``ops`` applied to real ``logits`` in the model's order."""
    for op in ops:
        logits = OPS[op.kind].replay(logits, op.operand)
    return logits


def _folded(ops: tuple[LogitsOp, ...]) -> HeadMath:
    folded = HeadMath()
    for op in ops:
        folded = OPS[op.kind].fold(folded, op.operand)
    return folded


def normalized(ops: tuple[LogitsOp, ...]) -> bool:
    """Whether ``ops`` end in log-probabilities (a log-softmax over the vocabulary, then at most
    casts and token ops), which ``F.nll_loss`` turns into the cross-entropy of the logits."""
    try:
        return _folded(ops).normalized
    except UnfusableLogitsUse:
        return False


def loss_math(ops: tuple[LogitsOp, ...]) -> tuple[float | None, float | None]:
    """``(logit_scale, softcap)`` for the fused loss equal to ``ops`` (``None``: not applied)."""
    folded = _folded(ops)
    if not folded.capped:
        return (None if folded.before == 1.0 else _usable(folded.before, "scales")), None
    if not folded.after > 0:
        raise UnfusableLogitsUse(f"it scales tanh of the logits by {folded.after} (a softcap must be > 0)")
    return _usable(folded.before * folded.after, "scales"), _usable(folded.after, "scales tanh of")


def head_math(
    ops: tuple[LogitsOp, ...], vocab: int, device: torch.device
) -> tuple[float | None, float | None, torch.Tensor | None]:
    """``(logit_scale, softcap, bias)`` for the fused loss equal to ``ops``: :func:`loss_math`
    and the constants they add, as one ``(vocab,)`` tensor (``None`` when none is added)."""
    scale, softcap = loss_math(ops)
    terms = [
        (constant.to(device).reshape(-1) if torch.is_tensor(constant) else constant) / divisor
        for constant, divisor in _folded(ops).added
    ]
    if not terms:
        return scale, softcap, None
    bias = torch.zeros(vocab, device=device, dtype=torch.float32)
    for term in terms:
        bias = bias + term  # a (1,) or (vocab,) tensor, or a number: broadcast over the vocabulary
    return scale, softcap, bias
