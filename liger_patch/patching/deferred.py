"""Deferred logits: what the output projection returns inside a fused forward.

The patched forward runs the model's *own* forward with its output projection swapped for a
:class:`HeadCapture`. Instead of ``tokens x vocab`` logits the capture returns
:class:`DeferredLogits`: the head's input hidden states plus a record of what the model then
does to its logits. The ops a causal-LM forward applies between its head and its loss are few,
and each has an exact counterpart:

* scaling by a constant (``* logit_scale``, ``/ logits_scaling``) -> the op's ``logit_scale``;
* a final softcap ``tanh(x / c) * c`` -> the op's ``softcap``;
* casts (``.float()``, ``.to(dtype)``), ``.contiguous()`` -> nothing for the loss;
* indexing and reshaping of the token dimensions -> applied to the hidden states;
* the loss: transformers' ``ForCausalLMLoss`` (swapped for :func:`causal_lm_loss` during the
  call) or ``F.cross_entropy`` / ``nn.CrossEntropyLoss`` on the logits -> the fused loss.

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
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["DeferredLogits", "FusedCall", "HeadCapture", "UnfusableLogitsUse", "causal_lm_loss"]


class UnfusableLogitsUse(RuntimeError):
    """The model's forward used its logits in a way the fused loss cannot reproduce exactly."""


@dataclass
class FusedCall:
    """One fused forward's context: how to compute the loss, and what happened.

    ``loss_fn(deferred, targets, ignore_index, reduction, num_items_in_batch, label_smoothing)``
    returns ``(loss, outputs)``, ``outputs`` the op's other outputs by name (``z_loss``,
    ``token_accuracy``, ...); the patched forward supplies it (with the head module, so that a
    sharded head is gathered through its own call, and the user's options). ``z_losses`` collects
    every loss's z-loss; ``outputs`` holds the other outputs of the last loss.
    """

    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    head_calls: int = 0
    losses: int = 0
    z_losses: list = field(default_factory=list)
    outputs: dict = field(default_factory=dict)


_Op = tuple[str, Any]  # ("mul" | "div", operand), ("tanh", None) or ("cast", dtype)


def _scalar(operand: Any, what: str) -> float:
    """``operand`` as a Python float for the fused loss; a learnable or non-scalar one is refused."""
    if isinstance(operand, numbers.Real) and not isinstance(operand, bool):
        return float(operand)
    if torch.is_tensor(operand) and operand.numel() == 1 and not operand.is_complex():
        if operand.requires_grad:
            raise UnfusableLogitsUse(
                f"it {what} the logits by a learnable tensor (the fused loss takes a constant)"
            )
        return float(operand)
    raise UnfusableLogitsUse(f"it {what} the logits by {type(operand).__name__} (not a scalar constant)")


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


class DeferredLogits:
    """``head(hidden)`` followed by ``ops``, not computed. Looks like the logits tensor to the
    code that receives it (``shape``, ``dtype``, ``device``, ``size()``, ``dim()``) and records
    the supported ops; every other use raises :class:`UnfusableLogitsUse`."""

    def __init__(self, call: FusedCall, head: nn.Module, hidden: torch.Tensor, ops: tuple = (), dtype=None):
        self._call, self._head, self.hidden, self.ops = call, head, hidden, ops
        self.dtype = dtype if dtype is not None else hidden.dtype
        self.device = hidden.device
        self.shape = torch.Size((*hidden.shape[:-1], head.out_features))
        self.requires_grad = hidden.requires_grad or head.weight.requires_grad

    def _then(
        self, op: _Op | None = None, *, hidden: torch.Tensor | None = None, dtype=None
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
        return self._then(("cast", torch.float32), dtype=torch.float32)

    def to(self, *args: Any, **kwargs: Any) -> DeferredLogits:
        """A cast (``.to(torch.float32)``, ``.to(other_tensor)``); a move to another device is refused."""
        result = self
        for value in (*args, *kwargs.values()):
            if torch.is_tensor(value):
                value = value.dtype
            if isinstance(value, torch.dtype):
                result = result._then(("cast", value), dtype=value)
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

    # --- elementwise head math ------------------------------------------------------------
    def __mul__(self, other: Any) -> DeferredLogits:
        _scalar(other, "multiplies")
        return self._then(("mul", other))

    __rmul__ = __mul__

    def __truediv__(self, other: Any) -> DeferredLogits:
        _scalar(other, "divides")
        return self._then(("div", other))

    def tanh(self) -> DeferredLogits:
        return self._then(("tanh", None))

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
        return (
            f"DeferredLogits(shape={tuple(self.shape)}, dtype={self.dtype}, ops={[o for o, _ in self.ops]})"
        )

    # --- what the fused loss and LIGER_RETURN_LOGITS need -------------------------------------
    @property
    def head(self) -> nn.Module:
        return self._head

    def loss_math(self) -> tuple[float | None, float | None]:
        """``(logit_scale, softcap)`` equal to the recorded ops: ``q * tanh(p * x)`` is the op's
        ``softcap(s * x)`` with ``c = q`` and ``s = p * q``; without tanh, ``s = p``."""
        before, after, tanh_seen = 1.0, 1.0, False
        for kind, operand in self.ops:
            if kind == "tanh":
                if tanh_seen:
                    raise UnfusableLogitsUse("it applies tanh to the logits twice")
                tanh_seen = True
            elif kind in ("mul", "div"):
                value = _scalar(operand, "multiplies" if kind == "mul" else "divides")
                value = value if kind == "mul" else 1.0 / value
                if tanh_seen:
                    after *= value
                else:
                    before *= value
        if not tanh_seen:
            return (None if before == 1.0 else before), None
        if not after > 0:
            raise UnfusableLogitsUse(f"it scales tanh of the logits by {after} (a softcap must be > 0)")
        return before * after, after

    def materialize(self) -> torch.Tensor:
        """The real logits: ``head(hidden)`` and the recorded ops replayed in the model's order."""
        logits = self._head(self.hidden)
        for kind, operand in self.ops:
            if kind == "cast":
                logits = logits.to(operand)
            elif kind == "tanh":
                logits = torch.tanh(logits)
            elif kind == "mul":
                logits = logits * operand
            else:
                logits = logits / operand
        return logits

    def fused_loss(
        self,
        targets: torch.Tensor,
        *,
        ignore_index: int,
        reduction: str,
        num_items_in_batch: Any = None,
        label_smoothing: float = 0.0,
    ) -> torch.Tensor:
        """The loss of these logits against ``targets`` (same token shape), through the fused op."""
        if targets.shape != self.shape[:-1]:
            raise UnfusableLogitsUse(
                f"its loss pairs logits {tuple(self.shape)} with targets {tuple(targets.shape)}"
            )
        loss, outputs = self._call.loss_fn(
            self, targets, ignore_index, reduction, num_items_in_batch, label_smoothing
        )
        self._call.losses += 1
        z_loss = outputs.pop("z_loss", None)
        if z_loss is not None:
            self._call.z_losses.append(z_loss)
        self._call.outputs.update(outputs)
        return loss


_REFUSED_OPERATORS = (
    *("add", "radd", "sub", "rsub", "rtruediv", "neg", "pos", "abs", "pow", "rpow"),
    *("matmul", "rmatmul", "floordiv", "mod", "lt", "le", "gt", "ge", "eq", "ne"),
    *("iter", "len", "float", "int", "index", "setitem"),
)
for _operator in _REFUSED_OPERATORS:  # arithmetic, comparisons, conversions, writes: no fused counterpart
    setattr(DeferredLogits, f"__{_operator}__", _refused(f"__{_operator}__"))


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
    return input.fused_loss(
        target, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing
    )


def causal_lm_loss(
    logits: Any,
    labels: torch.Tensor | None = None,
    vocab_size: int | None = None,
    num_items_in_batch: Any = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` (same arguments, same label shift) on deferred logits.

    Position t predicts token t+1: labels are shifted left by one and the last position gets
    ``ignore_index``; ``shift_labels`` (already shifted, e.g. by context parallelism) wins.
    ``num_items_in_batch`` divides the sum, as there, and 0 of them gives 0, not NaN.
    """
    if not isinstance(logits, DeferredLogits):
        from transformers.loss.loss_utils import ForCausalLMLoss

        return ForCausalLMLoss(
            logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs
        )
    if vocab_size is not None and vocab_size != logits.shape[-1]:
        raise UnfusableLogitsUse(
            f"its loss reads vocab_size={vocab_size} but the head gives {logits.shape[-1]} logits per token"
        )
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.to(logits.device)
    if targets.numel() * logits.shape[-1] != logits.numel():
        raise ValueError(
            f"liger_patch: labels give {targets.numel()} targets but the model produced "
            f"{logits.numel() // logits.shape[-1]} positions (logits {tuple(logits.shape)}); labels must "
            "cover the kept positions"
        )
    flat = logits.view(-1, logits.shape[-1])
    return flat.fused_loss(
        targets.reshape(-1),
        ignore_index=ignore_index,
        reduction="mean",
        num_items_in_batch=num_items_in_batch,
    )


class HeadCapture(nn.Module):
    """Stands in for the output projection during one fused forward: calling it returns
    :class:`DeferredLogits` instead of computing the logits.

    Everything else answers as the module it replaces does, so a forward never notices the swap:
    the capture shares that module's parameter, buffer and submodule dicts (``lm_head.weight``,
    ``named_parameters()``, and the model's own ``parameters()`` during the call are unchanged),
    reads every other attribute off it (``in_features``, ``out_features``, a custom head's own
    fields, properties and methods), reports its class to ``isinstance``, and raises the same
    ``AttributeError`` for a name the module lacks. Only calling it differs; a call it cannot
    defer (extra arguments) is refused with :class:`UnfusableLogitsUse`. The module stays
    registered where it was outside the call; the capture lives for the call only.
    """

    def __init__(self, head: nn.Module, call: FusedCall, replaced: nn.Module | None = None) -> None:
        super().__init__()
        replaced = head if replaced is None else replaced
        # ``head`` is what the fused loss reads (a PEFT modules_to_save copy, say); ``replaced`` is
        # the module registered at the head's path, whose face the capture wears.
        for name, value in (("_head", head), ("_call", call), ("_replaced", replaced)):
            self.__dict__[name] = value
        for name in ("_parameters", "_buffers", "_modules"):
            self.__dict__[name] = getattr(replaced, name)
        self.__dict__["training"] = replaced.training

    @property
    def __class__(self) -> type:  # isinstance(model.lm_head, nn.Linear) stays True
        replaced = self.__dict__.get("_replaced")
        return HeadCapture if replaced is None else type(replaced)

    @property
    def weight(self) -> torch.Tensor:  # code such as ``hidden.to(self.lm_head.weight.dtype)``
        return self._head.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self._head.bias

    def __getattr__(self, name: str) -> Any:
        """What the replaced module answers for ``name`` (its parameters and buffers come first,
        through the shared dicts): the same value, or the same ``AttributeError``."""
        replaced = self.__dict__.get("_replaced")
        if replaced is None or name.startswith("__"):
            return super().__getattr__(name)
        return getattr(replaced, name)

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> DeferredLogits:
        if args or kwargs:
            raise UnfusableLogitsUse("it calls its output projection with extra arguments")
        self._call.head_calls += 1
        return DeferredLogits(self._call, self._head, hidden)

    def _get_name(self) -> str:
        return "HeadCapture"

    def extra_repr(self) -> str:
        return f"capturing {self._replaced!r}"


def replace_deferred(value: Any, materialize: bool) -> Any:
    """``value`` with every :class:`DeferredLogits` (top level, or inside a tuple / list) replaced
    by ``None``, or by the real logits when ``materialize``."""
    if isinstance(value, DeferredLogits):
        return value.materialize() if materialize else None
    if isinstance(value, (tuple, list)) and any(isinstance(v, DeferredLogits) for v in value):
        return type(value)(replace_deferred(v, materialize) for v in value)
    return value
