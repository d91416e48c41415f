"""The ops a forward may apply to its logits between its head and its loss, each defined once.

Each entry of :data:`OPS` says both what the op does to real logits (``replay``: the model's own
expression, so that ``LIGER_RETURN_LOGITS=1`` gives its logits bit for bit) and what it means
for the fused loss (``fold``: its contribution to ``logit_scale`` and ``softcap``). Deferred
logits record :class:`LogitsOp` entries; :func:`replay` and :func:`loss_math` read them, through
this table only.

The fused loss computes ``softcap(s * x) = c * tanh(s * x / c)``. Scales multiply up to ``p``
before one tanh and to ``q`` after it; ``q * tanh(p * x)`` is that with ``c = q`` and
``s = p * q`` (``q > 0``). Without a tanh, ``s = p`` and there is no softcap.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from liger_patch.patching.seam import UnfusableLogitsUse

__all__ = ["OPS", "LogitsOp", "OpKind", "loss_math", "recorded", "replay"]


class LogitsOp(NamedTuple):
    """One recorded op: its ``kind`` (a key of :data:`OPS`) and its operand as the model gave it."""

    kind: str
    operand: Any = None


# Not frozen, as seam.LossRequest (torch 2.11's dynamo).
@dataclass
class HeadMath:
    """Ops folded so far: the scale before the tanh, the scale after it, whether it came."""

    before: float = 1.0
    after: float = 1.0
    capped: bool = False

    def scaled(self, value: float) -> HeadMath:
        if self.capped:
            return HeadMath(self.before, self.after * value, True)
        return HeadMath(self.before * value, self.after, False)

    def tanh(self) -> HeadMath:
        if self.capped:
            raise UnfusableLogitsUse("it applies tanh to the logits twice")
        return HeadMath(self.before, self.after, True)


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


@dataclass(frozen=True)
class OpKind:
    """One kind of op: ``replay(logits, operand)`` on real logits, ``fold(math, operand)`` for the loss."""

    replay: Callable[[torch.Tensor, Any], torch.Tensor]
    fold: Callable[[HeadMath, Any], HeadMath]


OPS: dict[str, OpKind] = {
    "mul": OpKind(replay=operator.mul, fold=lambda folded, x: folded.scaled(_scalar(x, "multiplies"))),
    "div": OpKind(replay=operator.truediv, fold=lambda folded, x: folded.scaled(1.0 / _scalar(x, "divides"))),
    "tanh": OpKind(replay=lambda logits, _: torch.tanh(logits), fold=lambda folded, _: folded.tanh()),
    # a cast changes what the model computes in, not the loss: the fused op computes in fp32
    "cast": OpKind(replay=lambda logits, dtype: logits.to(dtype), fold=lambda folded, _: folded),
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


def loss_math(ops: tuple[LogitsOp, ...]) -> tuple[float | None, float | None]:
    """``(logit_scale, softcap)`` for the fused loss equal to ``ops`` (``None``: not applied)."""
    folded = HeadMath()
    for op in ops:
        folded = OPS[op.kind].fold(folded, op.operand)
    if not folded.capped:
        return (None if folded.before == 1.0 else _usable(folded.before, "scales")), None
    if not folded.after > 0:
        raise UnfusableLogitsUse(f"it scales tanh of the logits by {folded.after} (a softcap must be > 0)")
    return _usable(folded.before * folded.after, "scales"), _usable(folded.after, "scales tanh of")
