"""Deferred logits: what the captured output projection returns inside a fused forward.

The patched forward runs the model's *own* forward with its output projection swapped for a
capture (``capture.HeadCapture``). Instead of ``tokens x vocab`` logits the capture returns
:class:`DeferredLogits`: the head's input hidden states plus a record of what the model then
does to its logits. The ops a causal-LM forward applies between its head and its loss are few,
and each has an exact counterpart:

* scaling by a constant (``* logit_scale``, ``/ logits_scaling``) -> the op's ``logit_scale``;
* a final softcap ``tanh(x / c) * c`` -> the op's ``softcap``;
* casts (``.float()``, ``.to(dtype)``), ``.contiguous()`` -> nothing for the loss;
  (these three: ``logits_ops.OPS``, which says what each does to real logits and to the loss)
* indexing and reshaping of the token dimensions -> applied to the hidden states;
* the loss: transformers' ``ForCausalLMLoss`` (swapped for ``causal_loss.causal_lm_loss`` during
  the call) or ``F.cross_entropy`` / ``nn.CrossEntropyLoss`` on the logits -> the fused loss,
  asked for with a ``seam.LossRequest`` (:meth:`DeferredLogits.loss`).

So the model's own code decides the hidden states (any prediction-head transform, any
``logits_to_keep`` slicing), its head math, its label shift, its MoE aux loss and its output
class. Anything else done to the logits raises :class:`UnfusableLogitsUse` naming the op; the
patched forward then runs the original path (full logits) and says why, once. Nothing is ever
guessed: a use of the logits that has no exact fused counterpart is refused.

With ``LIGER_RETURN_LOGITS=1`` the real logits are computed by replaying the recorded ops on
``head(hidden)``, in the model's own op order (:meth:`DeferredLogits.materialize`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from liger_patch.patching import logits_ops
from liger_patch.patching.logits_ops import LogitsOp
from liger_patch.patching.seam import CapturedCall, LossRequest, UnfusableLogitsUse
from liger_patch.patching.sharded_head import head_tensor

__all__ = ["DeferredLogits", "replace_deferred"]


def _expand_ellipsis(index: tuple, ndim: int) -> tuple:
    """``index`` with its ``...`` written out as full slices (one ``...`` at most, as torch)."""
    if not any(i is Ellipsis for i in index):
        return index
    at = next(n for n, i in enumerate(index) if i is Ellipsis)
    fill = ndim - (len(index) - 1)
    return (*index[:at], *(slice(None),) * max(fill, 0), *index[at + 1 :])


def _resolve_shape(shape: tuple[int, ...], numel: int) -> tuple[int, ...] | None:
    """``shape`` with its one ``-1`` worked out for ``numel`` elements; ``None`` if none fits.
    (Plain loops, no generators: torch.compile traces them.)"""
    known, unknown = 1, 0
    for n in shape:
        if n == -1:
            unknown += 1
        else:
            known *= n
    if unknown > 1 or known <= 0 or numel % known:
        return None
    resolved = tuple(numel // known if n == -1 else n for n in shape) if unknown else shape
    total = 1
    for n in resolved:
        total *= n
    return resolved if total == numel else None


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _refused(operator: str) -> Callable[..., Any]:
    """A method that refuses ``operator`` on deferred logits, naming it."""

    def refuse(self: Any, *args: Any) -> Any:
        raise UnfusableLogitsUse(f"it applies {operator} to the logits")

    refuse.__name__ = operator
    return refuse


def _refusing_operators(cls: type) -> type:
    """``cls`` with one method per name in its ``REFUSED_OPERATORS``, raising
    :class:`UnfusableLogitsUse` that names the operator. (Python looks operators up on the class,
    never through ``__getattr__``, so each needs a method of its own.)"""
    for operator in cls.REFUSED_OPERATORS:
        setattr(cls, operator, _refused(operator))
    return cls


@_refusing_operators
class DeferredLogits:
    """``head(hidden)`` followed by ``ops``, not computed. Looks like the logits tensor to the
    code that receives it (``shape``, ``dtype``, ``device``, ``size()``, ``dim()``) and records
    the supported ops; every other use raises :class:`UnfusableLogitsUse`."""

    REFUSED_OPERATORS: ClassVar[tuple[str, ...]] = (
        *("__add__", "__radd__", "__sub__", "__rsub__", "__rtruediv__", "__neg__", "__pos__", "__abs__"),
        *("__pow__", "__rpow__", "__matmul__", "__rmatmul__", "__floordiv__", "__mod__"),
        *("__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__"),
        *("__iter__", "__len__", "__float__", "__int__", "__index__", "__setitem__"),
    )
    """Arithmetic, comparisons, conversions and writes: no fused counterpart."""

    def __init__(
        self,
        call: CapturedCall,
        head: nn.Module,
        hidden: torch.Tensor,
        ops: tuple[LogitsOp, ...] = (),
        dtype: torch.dtype | None = None,
    ) -> None:
        self._call, self._head, self.hidden, self.ops = call, head, hidden, ops
        self.dtype = dtype if dtype is not None else hidden.dtype
        self.device = hidden.device
        self.shape = torch.Size((*hidden.shape[:-1], head.out_features))
        self.requires_grad = hidden.requires_grad or head_tensor(head, "weight").requires_grad

    def _then(
        self, op: LogitsOp | None = None, *, hidden: torch.Tensor | None = None, dtype=None
    ) -> DeferredLogits:
        ops = self.ops if op is None else (*self.ops, op)
        hidden = self.hidden if hidden is None else hidden
        return DeferredLogits(self._call, self._head, hidden, ops, dtype if dtype is not None else self.dtype)

    # --- tensor metadata -------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return math.prod(self.shape)

    def is_floating_point(self) -> bool:
        return True

    # --- casts and layout --------------------------------------------------------------------
    def float(self) -> DeferredLogits:
        return self._then(logits_ops.recorded("cast", torch.float32), dtype=torch.float32)

    def to(self, *args: Any, **kwargs: Any) -> DeferredLogits:
        """A cast (``.to(torch.float32)``, ``.to(other_tensor)``); a move to another device is refused."""
        result = self
        for value in (*args, *kwargs.values()):
            if torch.is_tensor(value):
                value = value.dtype
            if isinstance(value, torch.dtype):
                result = result._then(logits_ops.recorded("cast", value), dtype=value)
            elif isinstance(value, (str, torch.device)) and _same_device(torch.device(value), self.device):
                continue
            elif value is not None and not isinstance(value, bool):  # non_blocking / copy flags
                raise UnfusableLogitsUse(f"it moves the logits with .to({value!r})")
        return result

    def contiguous(self, *args: Any, **kwargs: Any) -> DeferredLogits:
        return self

    def view(self, *shape: Any) -> DeferredLogits:
        """Reshape the token dimensions; the vocabulary must stay the last dimension, whole."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = tuple(shape[0])
        resolved = _resolve_shape(tuple(map(int, shape)), self.numel())
        vocab = self.shape[-1]
        if resolved is None or len(resolved) < 2 or resolved[-1] != vocab:
            raise UnfusableLogitsUse(
                f"it reshapes the logits {tuple(self.shape)} to {shape}, which does not keep the "
                f"vocabulary ({vocab}) as the last dimension"
            )
        return self._then(hidden=self.hidden.reshape(*resolved[:-1], self.hidden.shape[-1]))

    reshape = view

    def __getitem__(self, index: Any) -> DeferredLogits:
        """Index the token dimensions (``logits[:, k:-1, :]``, ``logits[..., :-1, :]``); the
        vocabulary must stay whole."""
        index = _expand_ellipsis(index if isinstance(index, tuple) else (index,), self.ndim)
        if any(i is None for i in index) or len(index) > self.ndim:
            raise UnfusableLogitsUse(
                f"it indexes the logits with {index!r} (only token dimensions can be fused)"
            )
        if len(index) == self.ndim:
            if not (isinstance(index[-1], slice) and index[-1] == slice(None)):
                raise UnfusableLogitsUse(f"it slices the vocabulary dimension of the logits ({index[-1]!r})")
            index = index[:-1]
        return self._then(hidden=self.hidden[index])

    # --- elementwise head math (logits_ops.OPS) -------------------------------------------
    def __mul__(self, other: Any) -> DeferredLogits:
        return self._then(logits_ops.recorded("mul", other))

    __rmul__ = __mul__

    def __truediv__(self, other: Any) -> DeferredLogits:
        return self._then(logits_ops.recorded("div", other))

    def tanh(self) -> DeferredLogits:
        return self._then(logits_ops.recorded("tanh"))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """``torch.tanh`` / ``F.tanh``, ``torch.mul`` / ``torch.div`` by a scalar, and
        ``F.cross_entropy`` on deferred logits; every other torch function is refused."""
        kwargs = kwargs or {}
        if func in (torch.tanh, torch.Tensor.tanh, F.tanh):
            return args[0].tanh()
        if func in (torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__):
            deferred, other = (
                (args[0], args[1]) if isinstance(args[0], DeferredLogits) else (args[1], args[0])
            )
            return deferred * other
        dividing = func in (torch.div, torch.Tensor.div, torch.Tensor.__truediv__)
        if dividing and isinstance(args[0], DeferredLogits) and kwargs.get("rounding_mode") is None:
            return args[0] / args[1]
        if func is F.cross_entropy:
            return _cross_entropy(*args, **kwargs)
        name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
        raise UnfusableLogitsUse(f"it calls {name} on the logits")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_call", "_head", "hidden", "ops"):
            raise AttributeError(name)
        raise UnfusableLogitsUse(f"it uses logits.{name}")

    def __bool__(self) -> bool:
        raise UnfusableLogitsUse("it tests the logits' truth value")

    def __repr__(self) -> str:
        kinds = [op.kind for op in self.ops]
        return f"DeferredLogits(shape={tuple(self.shape)}, dtype={self.dtype}, ops={kinds})"

    # --- what the fused loss and LIGER_RETURN_LOGITS need -------------------------------------
    @property
    def head(self) -> nn.Module:
        return self._head

    def loss_math(self) -> tuple[float | None, float | None]:
        """``(logit_scale, softcap)`` for the fused loss, equal to the recorded ops."""
        return logits_ops.loss_math(self.ops)

    def materialize(self) -> torch.Tensor:
        """The real logits: ``head(hidden)`` and the recorded ops replayed in the model's order."""
        return logits_ops.replay(self._head(self.hidden), self.ops)

    def loss(self, request: LossRequest) -> torch.Tensor:
        """The loss of these logits for ``request`` (targets of their token shape), computed by
        the call's ``compute_loss`` and recorded on the call."""
        if request.targets.shape != self.shape[:-1]:
            raise UnfusableLogitsUse(
                f"its loss pairs logits {tuple(self.shape)} with targets {tuple(request.targets.shape)}"
            )
        logit_scale, softcap = self.loss_math()
        result = self._call.compute_loss(
            head=self._head, hidden=self.hidden, logit_scale=logit_scale, softcap=softcap, request=request
        )
        return self._call.record_loss(result)


def _cross_entropy(
    input: Any,
    target: torch.Tensor,
    weight: Any = None,
    size_average: Any = None,
    ignore_index: int = -100,
    reduce: Any = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``F.cross_entropy`` of deferred logits ``(N, V)`` (no shift: the caller's targets as given)."""
    if (
        not isinstance(input, DeferredLogits)
        or weight is not None
        or size_average is not None
        or reduce is not None
    ):
        raise UnfusableLogitsUse("it calls cross_entropy with class weights or legacy reduction arguments")
    if input.ndim != 2:
        raise UnfusableLogitsUse(
            f"it calls cross_entropy on logits of shape {tuple(input.shape)} (not (N, V))"
        )
    return input.loss(
        LossRequest(
            targets=target, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing
        )
    )


def replace_deferred(value: Any, materialize: bool) -> Any:
    """``value`` with every :class:`DeferredLogits` (top level, or inside a tuple / list) replaced
    by ``None``, or by the real logits when ``materialize``."""
    if isinstance(value, DeferredLogits):
        return value.materialize() if materialize else None
    if isinstance(value, (tuple, list)) and any(isinstance(v, DeferredLogits) for v in value):
        return type(value)(replace_deferred(v, materialize) for v in value)
    return value
