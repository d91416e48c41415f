"""Deferred logits: what the captured output projection returns inside a fused forward.

The patched forward runs the model's *own* forward with its output projection swapped for a
capture (``capture.HeadCapture``). Instead of ``tokens x vocab`` logits the capture returns
:class:`DeferredLogits`: the head's input hidden states plus a record of what the model then
does to its logits. The ops a forward applies between its head and its loss are few, and each
has an exact counterpart (``logits_ops.OPS``, which says what each does to real logits and to
the loss):

* scaling by a constant (``* logit_scale``, ``/ logits_scaling``) -> the op's ``logit_scale``;
* a final softcap ``tanh(x / c) * c`` -> the op's ``softcap``;
* a constant added (BART's ``+ final_logits_bias``) -> the op's ``bias``;
* casts (``.float()``, ``.to(dtype)``), ``.contiguous()``, a log-softmax over the vocabulary
  (cross-entropy of log-probs is that of the logits) -> nothing for the loss;
* indexing, reshaping and transposing the token dimensions -> applied to the hidden states;
* the loss: transformers' ``ForCausalLMLoss`` (swapped for ``causal_loss.causal_lm_loss`` during
  the call), ``F.cross_entropy`` / ``nn.CrossEntropyLoss`` on the logits, or ``F.nll_loss`` on
  their log-softmax -> the fused loss, asked for with a ``seam.LossRequest``
  (:meth:`DeferredLogits.loss`).

So the model's own code decides the hidden states (any prediction-head transform, any
``logits_to_keep`` slicing), its head math, its label shift, its MoE aux loss and its output
class. Anything else done to the logits has no exact counterpart: it is **refused**, and the
refusal does not stop the forward. The real logits of that head call are made right there
(``head(hidden)``, the recorded ops replayed in the model's order: :meth:`DeferredLogits.real`),
the use is applied to them, the reason is recorded on the call (``CapturedCall.refuse``), and
from then on every deferred logits of that head call *is* its real logits. The forward goes on
exactly as unpatched (its body runs once: the same dropout draws, memory and time), and the
patched forward says why, once. Nothing is ever guessed.

With ``LIGER_RETURN_LOGITS=1`` the real logits are made the same way after the forward.
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

__all__ = ["DeferredLogits", "HeadCall", "fused_or_real", "replace_deferred"]


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
    """Whether ``.to(a)`` leaves a tensor on ``b`` where it is: ``"cuda"`` without an index is the
    current device, as ``Tensor.to`` takes it (a model split over GPUs moves its logits so)."""
    if a.type == "cuda" and a.index is None:
        a = torch.device("cuda", torch.cuda.current_device())
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


class HeadCall:
    """One call of the captured head: the module the model called and its input, and, once a use
    with no fused counterpart (or ``LIGER_RETURN_LOGITS``) needs them, the real logits, made once
    by that module as the model's own call would have made them."""

    def __init__(self, module: nn.Module, hidden: torch.Tensor) -> None:
        self.module, self.hidden = module, hidden
        self.logits: torch.Tensor | None = None

    def real(self) -> torch.Tensor:
        if self.logits is None:
            self.logits = self.module(self.hidden)
        return self.logits


def _refused(operator: str) -> Callable[..., Any]:
    """A method that refuses ``operator`` on deferred logits, naming it, and applies it to the
    real logits."""

    def refuse(self: DeferredLogits, *args: Any) -> Any:
        return getattr(self.real(f"it applies {operator} to the logits"), operator)(*args)

    refuse.__name__ = operator
    return refuse


def _refusing_operators(cls: type) -> type:
    """``cls`` with one method per name in its ``REFUSED_OPERATORS`` (Python looks operators up on
    the class, never through ``__getattr__``, so each needs a method of its own)."""
    for operator in cls.REFUSED_OPERATORS:
        setattr(cls, operator, _refused(operator))
    return cls


def _real_values(value: Any, reason: str) -> Any:
    """``value`` with every deferred logits in it (top level, or in a tuple / list / dict) made real."""
    if isinstance(value, DeferredLogits):
        return value.real(reason)
    if isinstance(value, (tuple, list)):
        return type(value)(_real_values(v, reason) for v in value)
    if isinstance(value, dict):
        return {k: _real_values(v, reason) for k, v in value.items()}
    return value


def _once_real(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` on deferred logits, or, once the head call's real logits exist, the tensor
    method of the same name on them."""

    def method_or_real(self: DeferredLogits, *args: Any, **kwargs: Any) -> Any:
        if self.source.logits is not None:
            return getattr(self.materialize(), method.__name__)(*args, **kwargs)
        return method(self, *args, **kwargs)

    method_or_real.__name__ = method.__name__
    method_or_real.__doc__ = method.__doc__
    return method_or_real


@_refusing_operators
class DeferredLogits:
    """``head(hidden)`` followed by ``ops``, not computed. Looks like the logits tensor to the
    code that receives it (``shape``, ``dtype``, ``device``, ``size()``, ``dim()``) and records
    the supported ops; every other use makes the real logits (:meth:`real`) and is applied to them."""

    REFUSED_OPERATORS: ClassVar[tuple[str, ...]] = (
        *("__rsub__", "__rtruediv__", "__neg__", "__pos__", "__abs__"),
        *("__pow__", "__rpow__", "__matmul__", "__rmatmul__", "__floordiv__", "__mod__"),
        *("__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__"),
        *("__float__", "__int__", "__index__", "__setitem__"),
    )
    """Arithmetic, comparisons, conversions and writes: no fused counterpart."""

    def __init__(
        self,
        call: CapturedCall,
        head: nn.Module,
        hidden: torch.Tensor,
        ops: tuple[LogitsOp, ...] = (),
        dtype: torch.dtype | None = None,
        source: HeadCall | None = None,
    ) -> None:
        """``head`` is what the fused loss reads; ``source`` the head call these logits come from
        (default: ``head`` called on ``hidden``); ``ops`` everything done to them since, token
        ops included, and ``hidden`` the hidden states those token ops leave."""
        self._call, self._head, self.hidden, self.ops = call, head, hidden, ops
        self.source = source if source is not None else HeadCall(head, hidden)
        self._real: torch.Tensor | None = None
        self.dtype = dtype if dtype is not None else hidden.dtype
        self.device = hidden.device
        self.shape = torch.Size((*hidden.shape[:-1], head.out_features))
        self.requires_grad = hidden.requires_grad or head_tensor(head, "weight").requires_grad

    def _then(
        self, op: LogitsOp | None = None, *, hidden: torch.Tensor | None = None, dtype=None
    ) -> DeferredLogits:
        ops = self.ops if op is None else (*self.ops, op)
        hidden = self.hidden if hidden is None else hidden
        dtype = dtype if dtype is not None else self.dtype
        return DeferredLogits(self._call, self._head, hidden, ops, dtype, self.source)

    def _record(self, kind: str, operand: Any = None, **then: Any) -> Any:
        """These logits followed by the op ``kind``, or, when it cannot be fused, the op applied
        to the real logits (the reason recorded)."""
        try:
            op = logits_ops.recorded(kind, operand)
        except UnfusableLogitsUse as why:
            return logits_ops.OPS[kind].replay(self.real(str(why)), operand)
        return self._then(op, **then)

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

    def __len__(self) -> int:
        return self.shape[0]

    def __iter__(self) -> Any:
        """The first (token) dimension's rows, each deferred (ModelOutput tries ``iter`` on a
        first field that is not a tensor: FSMT's decoder returns its logits so)."""
        if self.source.logits is not None:
            return iter(self.materialize())
        return (self[i] for i in range(self.shape[0]))

    def is_contiguous(self, *args: Any, **kwargs: Any) -> bool:
        """True: deferred logits have no layout yet (ProphetNet asks before calling ``.view``)."""
        return True if self.source.logits is None else self.materialize().is_contiguous(*args, **kwargs)

    # --- casts and layout --------------------------------------------------------------------
    @_once_real
    def float(self) -> DeferredLogits:
        return self._record("cast", torch.float32, dtype=torch.float32)

    @_once_real
    def to(self, *args: Any, **kwargs: Any) -> Any:
        """A cast (``.to(torch.float32)``, ``.to(other_tensor)``); a move to another device is refused."""
        result = self
        for value in (*args, *kwargs.values()):
            if torch.is_tensor(value):
                value = value.dtype
            if isinstance(value, torch.dtype):
                result = result._record("cast", value, dtype=value)
            elif isinstance(value, (str, torch.device)) and _same_device(torch.device(value), self.device):
                continue
            elif value is not None and not isinstance(value, bool):  # non_blocking / copy flags
                return self.real(f"it moves the logits with .to({value!r})").to(*args, **kwargs)
        return result

    @_once_real
    def contiguous(self, *args: Any, **kwargs: Any) -> DeferredLogits:
        return self

    @_once_real
    def view(self, *shape: Any) -> Any:
        """Reshape the token dimensions; the vocabulary must stay the last dimension, whole."""
        return self._reshaped("view", shape)

    @_once_real
    def reshape(self, *shape: Any) -> Any:
        return self._reshaped("reshape", shape)

    def _reshaped(self, kind: str, shape: tuple) -> Any:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = tuple(shape[0])
        resolved = _resolve_shape(tuple(map(int, shape)), self.numel())
        vocab = self.shape[-1]
        if resolved is None or len(resolved) < 2 or resolved[-1] != vocab:
            reason = (
                f"it reshapes the logits {tuple(self.shape)} to {shape}, which does not keep the "
                f"vocabulary ({vocab}) as the last dimension"
            )
            return getattr(self.real(reason), kind)(*shape)
        hidden = self.hidden.reshape(*resolved[:-1], self.hidden.shape[-1])
        return self._then(LogitsOp(kind, resolved), hidden=hidden)

    @_once_real
    def transpose(self, dim0: int, dim1: int) -> Any:
        """Swap two token dimensions (ProphetNet's n-gram streams); the vocabulary stays last."""
        a, b = (d % self.ndim if -self.ndim <= d < self.ndim else None for d in (dim0, dim1))
        if a is None or b is None or self.ndim - 1 in (a, b):
            return self.real("it uses logits.transpose on the vocabulary dimension").transpose(dim0, dim1)
        return self._then(LogitsOp("transpose", (a, b)), hidden=self.hidden.transpose(a, b))

    def __getitem__(self, index: Any) -> Any:
        """Index the token dimensions (``logits[:, k:-1, :]``, ``logits[..., :-1, :]``); the
        vocabulary must stay whole."""
        if self.source.logits is not None:
            return self.materialize()[index]
        token_index = _expand_ellipsis(index if isinstance(index, tuple) else (index,), self.ndim)
        reason = ""
        if any(i is None for i in token_index) or len(token_index) > self.ndim:
            reason = f"it indexes the logits with {token_index!r} (only token dimensions can be fused)"
        elif len(token_index) == self.ndim:
            if not (isinstance(token_index[-1], slice) and token_index[-1] == slice(None)):
                reason = f"it slices the vocabulary dimension of the logits ({token_index[-1]!r})"
            token_index = token_index[:-1]
        if reason:
            return self.real(reason)[index]
        return self._then(LogitsOp("index", token_index), hidden=self.hidden[token_index])

    # --- elementwise head math (logits_ops.OPS) -------------------------------------------
    @_once_real
    def __mul__(self, other: Any) -> Any:
        return self._record("mul", other)

    @_once_real
    def __rmul__(self, other: Any) -> Any:
        return self._record("mul", other)

    @_once_real
    def __truediv__(self, other: Any) -> Any:
        return self._record("div", other)

    @_once_real
    def __add__(self, other: Any) -> Any:
        """A constant added to every token's logits (one value per vocabulary entry, or one)."""
        if torch.is_tensor(other) and other.dim() > self.ndim:
            return self.real("it adds a tensor with more dimensions than the logits") + other
        return self._record("add", other)

    @_once_real
    def __radd__(self, other: Any) -> Any:
        return self.__add__(other)

    @_once_real
    def __sub__(self, other: Any) -> Any:
        if torch.is_tensor(other) and other.dim() > self.ndim:
            return self.real("it subtracts a tensor with more dimensions than the logits") - other
        return self._record("sub", other)

    @_once_real
    def tanh(self) -> Any:
        return self._record("tanh")

    @_once_real
    def log_softmax(self, dim: int, dtype: torch.dtype | None = None) -> Any:
        """Log-probabilities over the vocabulary (the last dimension); any other is refused."""
        if dim % self.ndim != self.ndim - 1:
            return self.real(f"it applies log_softmax over dimension {dim}").log_softmax(dim, dtype=dtype)
        return self._record("log_softmax", dtype, dtype=dtype or self.dtype)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """The torch spellings of the supported ops (``torch.tanh``, ``torch.mul`` / ``div`` /
        ``add`` / ``sub`` by a constant, ``log_softmax`` over the vocabulary), and
        ``F.cross_entropy`` / ``F.nll_loss`` on deferred logits; every other torch function is
        applied to the real logits."""
        kwargs = kwargs or {}
        deferred = next(a for a in (*args, *kwargs.values()) if isinstance(a, DeferredLogits))
        if deferred.source.logits is None:
            handled = _supported_call(func, args, kwargs)
            if handled is not NotImplemented:
                return handled
        name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
        reason = f"it calls {name} on the logits"
        return func(*_real_values(args, reason), **_real_values(kwargs, reason))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_call", "_head", "hidden", "ops", "source", "_real"):
            raise AttributeError(name)
        return getattr(self.real(f"it uses logits.{name}"), name)

    def __bool__(self) -> bool:
        return bool(self.real("it tests the logits' truth value"))

    def __repr__(self) -> str:
        kinds = [op.kind for op in self.ops]
        return f"DeferredLogits(shape={tuple(self.shape)}, dtype={self.dtype}, ops={kinds})"

    # --- the fused loss, and real logits ---------------------------------------------------
    @property
    def head(self) -> nn.Module:
        return self._head

    def loss_math(self) -> tuple[float | None, float | None]:
        """``(logit_scale, softcap)`` for a fused loss equal to the recorded ops; refused when they
        add a constant (a loss that takes only these two: the distillation's)."""
        scale, softcap, bias = self.head_math()
        if bias is not None:
            raise UnfusableLogitsUse("it adds a constant to the logits (this loss takes no bias)")
        return scale, softcap

    def head_math(self) -> tuple[float | None, float | None, torch.Tensor | None]:
        """``(logit_scale, softcap, bias)`` for the fused loss equal to the recorded ops."""
        return logits_ops.head_math(self.ops, self.shape[-1], self.device)

    def materialize(self) -> torch.Tensor:
        """The real logits: the head call's, the recorded ops replayed in the model's order (made
        once per deferred logits)."""
        if self._real is None:
            self._real = logits_ops.replay(self.source.real(), self.ops)
        return self._real

    def real(self, reason: str) -> torch.Tensor:
        """The real logits for a use with no fused counterpart, ``reason``: recorded on the call
        (``CapturedCall.refuse``, which raises instead for a call that cannot go on with them)."""
        self._call.refuse(reason)
        return self.materialize()

    def loss(self, request: LossRequest) -> torch.Tensor:
        """The fused loss of these logits for ``request`` (targets of their token shape), computed
        by the call's ``compute_loss`` and recorded on the call; :class:`UnfusableLogitsUse` when
        it cannot be (the caller then takes its loss from :meth:`real` logits)."""
        if self.source.logits is not None:
            raise UnfusableLogitsUse("its loss reads logits that were already made")
        if request.targets.shape != self.shape[:-1]:
            raise UnfusableLogitsUse(
                f"its loss pairs logits {tuple(self.shape)} with targets {tuple(request.targets.shape)}"
            )
        logit_scale, softcap, bias = self.head_math()
        result = self._call.compute_loss(
            head=self._head,
            hidden=self.hidden,
            logit_scale=logit_scale,
            softcap=softcap,
            bias=bias,
            request=request,
        )
        return self._call.record_loss(result)


def fused_or_real(
    logits: DeferredLogits, request: LossRequest, real_loss: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The fused loss of ``logits`` for ``request``, or, where it has no fused counterpart,
    ``real_loss`` of the real logits (the loss call the model made, on them: the reason recorded)."""
    try:
        return logits.loss(request)
    except UnfusableLogitsUse as why:
        return real_loss(logits.real(str(why)))


def _supported_call(func: Any, args: tuple, kwargs: dict) -> Any:
    """The torch function ``func`` on deferred logits where it is a supported op; else
    ``NotImplemented``."""
    first = args[0] if args else None
    if func in (torch.tanh, torch.Tensor.tanh, F.tanh):
        return first.tanh()
    if func in (torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__):
        deferred, other = (first, args[1]) if isinstance(first, DeferredLogits) else (args[1], first)
        return deferred * other
    if func in (torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__) and not kwargs:
        deferred, other = (first, args[1]) if isinstance(first, DeferredLogits) else (args[1], first)
        return deferred + other
    subtracting = func in (torch.sub, torch.Tensor.sub, torch.Tensor.__sub__)
    if subtracting and isinstance(first, DeferredLogits) and not kwargs:
        return first - args[1]
    dividing = func in (torch.div, torch.Tensor.div, torch.Tensor.__truediv__)
    if dividing and isinstance(first, DeferredLogits) and kwargs.get("rounding_mode") is None:
        return first / args[1]
    if func in (F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax) and isinstance(
        first, DeferredLogits
    ):
        return _log_softmax(*args, **kwargs)
    if func is F.cross_entropy:
        return _cross_entropy(*args, **kwargs)
    if func is F.nll_loss:
        return _nll_loss(*args, **kwargs)
    return NotImplemented


def _log_softmax(input: DeferredLogits, dim: Any = None, _stacklevel: int = 3, dtype: Any = None) -> Any:
    if dim is None:
        return NotImplemented
    return input.log_softmax(dim, dtype=dtype)


def _plain_loss_call(input: Any, weight: Any, size_average: Any, reduce: Any) -> str:
    """Why a loss call on deferred logits is not the plain one the fused loss computes (``""``)."""
    if not isinstance(input, DeferredLogits):
        return "it passes the logits to a loss as other than its input"
    if weight is not None or size_average is not None or reduce is not None:
        return "it calls its loss with class weights or legacy reduction arguments"
    if input.ndim != 2:
        return f"it calls its loss on logits of shape {tuple(input.shape)} (not (N, V))"
    return ""


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
    """``F.cross_entropy`` of deferred logits ``(N, V)`` (no shift: the caller's targets as given);
    with what the fused loss does not take, that call on the real logits."""

    def real_loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            logits, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing
        )

    problem = _plain_loss_call(input, weight, size_average, reduce)
    if problem:
        return real_loss(input.real(problem) if isinstance(input, DeferredLogits) else input)
    request = LossRequest(
        targets=target, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing
    )
    return fused_or_real(input, request, real_loss)


def _nll_loss(
    input: Any,
    target: torch.Tensor,
    weight: Any = None,
    size_average: Any = None,
    ignore_index: int = -100,
    reduce: Any = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.nll_loss`` of deferred log-probabilities ``(N, V)``: the cross-entropy of their logits.
    Of logits that are not log-probabilities (no log-softmax recorded last), that call on the real
    ones."""

    def real_loss(logits: torch.Tensor) -> torch.Tensor:
        return F.nll_loss(logits, target, weight, size_average, ignore_index, reduce, reduction)

    problem = _plain_loss_call(input, weight, size_average, reduce)
    if not problem and not logits_ops.normalized(input.ops):
        problem = "it calls nll_loss on logits that are not log-probabilities"
    if problem:
        return real_loss(input.real(problem) if isinstance(input, DeferredLogits) else input)
    request = LossRequest(targets=target, ignore_index=ignore_index, reduction=reduction)
    return fused_or_real(input, request, real_loss)


def replace_deferred(value: Any, materialize: bool) -> Any:
    """``value`` with every :class:`DeferredLogits` (top level, or inside a tuple / list) replaced
    by ``None``, or by the real logits when ``materialize``."""
    if isinstance(value, DeferredLogits):
        return value.materialize() if materialize else None
    if isinstance(value, (tuple, list)) and any(isinstance(v, DeferredLogits) for v in value):
        return type(value)(replace_deferred(v, materialize) for v in value)
    return value
