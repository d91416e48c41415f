"""Argument checks for the fused op: every bad input gets an error that names the problem."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_num_items(num_items_in_batch: object, reduction: str) -> None:
    """``num_items_in_batch``: None, or a non-negative finite int, float or scalar tensor given
    with reduction "mean" (a tensor's value is checked on the device, in ``check_values``)."""
    if num_items_in_batch is None:
        return
    if reduction != "mean":
        raise ValueError(
            f"num_items_in_batch replaces the divisor of reduction='mean'; it has no meaning with "
            f"reduction={reduction!r}"
        )
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1:
            raise ValueError(
                "num_items_in_batch must be a scalar, got a tensor of shape "
                f"{tuple(num_items_in_batch.shape)}"
            )
        if num_items_in_batch.dtype == torch.bool or num_items_in_batch.is_complex():
            raise TypeError(
                f"num_items_in_batch must be an int or float tensor, got {num_items_in_batch.dtype}"
            )
    elif isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, (int, float)):
        raise TypeError(
            f"num_items_in_batch must be an int, a float or a scalar tensor, got {num_items_in_batch!r}"
        )
    # Comparisons, not math.isfinite: under torch.compile an int or float may be a symbol. NaN
    # fails ">= 0".
    elif not (num_items_in_batch >= 0 and num_items_in_batch != math.inf):
        raise ValueError(f"num_items_in_batch must be finite and >= 0, got {num_items_in_batch}")


def num_items_operands(num_items_in_batch: object) -> tuple[torch.Tensor | None, float | None]:
    """``num_items_in_batch`` (checked by ``check_num_items``) as the registered operators take
    it: a tensor, or a float, the other ``None``."""
    if isinstance(num_items_in_batch, torch.Tensor):
        return num_items_in_batch, None
    return None, None if num_items_in_batch is None else float(num_items_in_batch)


def check_tensors(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None
) -> None:
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels), ("bias", bias)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t is not None and hasattr(t, "placements") and hasattr(t, "to_local"):  # a DTensor
            raise TypeError(
                f"{name} is a DTensor (placements {tuple(t.placements)}); the fused loss needs full local "
                "tensors. Call it through a patched model (which gathers an FSDP2-sharded head inside "
                "lm_head's own call) or pass t.full_tensor()"
            )
    if getattr(weight, "ds_status", None) is not None and weight.numel() == 0:
        raise ValueError(
            f"weight is a DeepSpeed ZeRO-3 partition that is not gathered (ds_status={weight.ds_status}); "
            "call the loss inside the head module's call (as a patched model does) or under "
            "deepspeed.zero.GatheredParameters"
        )
    if any(t is not None and t.device.type == "meta" for t in (hidden, weight, labels, bias)):
        raise ValueError(
            "tensors on the meta device hold no values, and the fused loss needs them (it checks the "
            "labels and computes the loss); materialise the model or inputs on a real device first"
        )
    if hidden.dim() < 1:
        raise ValueError("hidden must have shape (..., H); got a 0-d tensor")
    if weight.dim() != 2:
        raise ValueError(f"weight must have shape (V, H); got shape {tuple(weight.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden size mismatch: hidden has H={hidden.shape[-1]} (shape {tuple(hidden.shape)}) but "
            f"weight has H={weight.shape[1]} (shape {tuple(weight.shape)})"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight has V=0 rows: a cross-entropy needs at least one class")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels shape {tuple(labels.shape)} does not match hidden's leading shape "
            f"{tuple(hidden.shape[:-1])} (hidden is {tuple(hidden.shape)})"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape (V,) = ({weight.shape[0]},); got {tuple(bias.shape)}")

    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"labels must be an integer tensor (int64 class ids), got {labels.dtype}")
    for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")

    devices = {t.device for t in (hidden, weight, labels, bias) if t is not None}
    if len(devices) > 1:
        named = ", ".join(
            f"{n}={t.device}"
            for n, t in (("hidden", hidden), ("weight", weight), ("labels", labels), ("bias", bias))
            if t is not None
        )
        raise ValueError(f"all tensors must be on one device; got {named}")


def check_class_weight(class_weight: torch.Tensor | None, weight: torch.Tensor) -> None:
    """``class_weight``: None, or a float tensor of shape (V,) on the weight's device."""
    if class_weight is None:
        return
    if not isinstance(class_weight, torch.Tensor):
        raise TypeError(
            f"class_weight must be a torch.Tensor of shape (V,), got {type(class_weight).__name__}"
        )
    if tuple(class_weight.shape) != (weight.shape[0],):
        raise ValueError(
            f"class_weight must have shape (V,) = ({weight.shape[0]},), one weight per class; got "
            f"{tuple(class_weight.shape)}"
        )
    if class_weight.dtype not in FLOAT_DTYPES and class_weight.dtype != torch.float64:
        raise TypeError(f"class_weight must be a float tensor, got {class_weight.dtype}")
    if class_weight.device != weight.device:
        raise ValueError(f"class_weight is on {class_weight.device} but weight is on {weight.device}")
    if class_weight.requires_grad:
        raise ValueError("class_weight gets no gradient from the fused loss; pass class_weight.detach()")


def check_dtypes_match(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Outside autocast, hidden, weight and bias must share one dtype (as nn.Linear requires)."""
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        bias_part = "" if bias is None else f", bias is {bias.dtype}"
        raise TypeError(
            f"dtype mismatch: hidden is {hidden.dtype}, weight is {weight.dtype}{bias_part}. Cast them to "
            "one dtype, or call inside torch.autocast, which casts all of them to the autocast dtype."
        )


def autocast_inputs(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, cast_weight: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Inside torch.autocast, cast like nn.Linear would; outside it, dtypes must already match.

    Without ``cast_weight`` the weight keeps its dtype: the fused op rounds it to the hidden
    states' dtype itself, inside grad_W's bytes, instead of holding a cast copy of the whole
    weight (1 GiB for a 150k x 3584 head) from the forward to the backward."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        w = weight.to(dtype) if cast_weight else weight
        return hidden.to(dtype), w, None if bias is None else bias.to(dtype)
    check_dtypes_match(hidden, weight, bias)
    return hidden, weight, bias


_LATE = (
    " (found after the call that took it had returned, as the GPU had not checked the labels yet: "
    "that call's loss and gradients are NaN)"
)


class ValueCheck(NamedTuple):
    """A label check started on the device (``start_value_check``) whose values come back to
    the host later, in ``result``: work enqueued in between runs while the host waits."""

    labels: torch.Tensor
    vocab: int
    ignore_index: int
    divisor: torch.Tensor | None
    host: torch.Tensor | None  # (n_kept, low, high[, bad divisor]) on the host, once ``ready``
    ready: torch.cuda.Event | None  # None: ``host`` was filled synchronously (CPU, or no labels)

    def is_ready(self) -> bool:
        """Whether ``result`` can be read without waiting for the GPU."""
        return self.ready is None or self.ready.query()

    def result(self, deferred: bool = False) -> int:
        """The number of labels that are not ``ignore_index``; raises for a bad label or
        ``num_items_in_batch`` as ``check_values`` says (``deferred``: the error says that it
        comes from a call that returned before its check was read, with NaN results)."""
        if self.host is None:  # no labels
            divisor = self.divisor
            if divisor is not None and not bool(torch.isfinite(divisor) & (divisor >= 0)):
                raise ValueError(f"num_items_in_batch must be finite and >= 0, got {divisor.item()}")
            return 0
        if self.ready is not None:
            self.ready.synchronize()
        n_kept, low, high, *bad_divisor = self.host.tolist()
        late = _LATE if deferred else ""
        if bad_divisor and bad_divisor[0]:
            raise ValueError(f"num_items_in_batch must be finite and >= 0, got {self.divisor.item()}{late}")
        if low >= 0 and high < self.vocab:
            return n_kept
        labels = self.labels
        bad_labels = out_of_range(labels, self.vocab, self.ignore_index)
        if not bool(bad_labels.any()):  # changed in place since the check
            value = low if low < 0 else high
            raise IndexError(
                f"label {value} is outside [0, {self.vocab}) and is not "
                f"ignore_index={self.ignore_index}{late}"
            )
        position = int(bad_labels.nonzero()[0, 0])
        value = int(labels[position])
        raise IndexError(
            f"label {value} at flat position {position} is outside [0, {self.vocab}) and is not "
            f"ignore_index={self.ignore_index}{late}"
        )


def out_of_range(labels: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    """(N,) bool: the labels outside [0, ``vocab``) that are not ``ignore_index``."""
    return (labels != ignore_index) & ((labels < 0) | (labels >= vocab))


def start_value_check(
    labels: torch.Tensor, vocab: int, ignore_index: int, divisor: torch.Tensor | None = None
) -> ValueCheck:
    """Enqueue ``check_values``'s device work and the copy of its few values to the host,
    without waiting for them: on CUDA into pinned memory, with an event to wait on."""
    if labels.numel() == 0:
        return ValueCheck(labels, vocab, ignore_index, divisor, None, None)
    keep = labels != ignore_index
    low, high = torch.aminmax(torch.where(keep, labels, 0))
    stats = [keep.sum(), low, high]
    if divisor is not None:
        stats.append((~(torch.isfinite(divisor) & (divisor >= 0))).long())
    return check_from_stats(labels, vocab, ignore_index, divisor, torch.stack(stats))


def check_from_stats(
    labels: torch.Tensor, vocab: int, ignore_index: int, divisor: torch.Tensor | None, stats: torch.Tensor
) -> ValueCheck:
    """The check whose device values ``stats`` (int64: the kept count, the least and greatest
    kept label, and 1 where ``divisor`` is bad) are computed already: their copy to the host
    enqueued, on CUDA into pinned memory with an event to wait on."""
    if not stats.is_cuda:
        return ValueCheck(labels, vocab, ignore_index, divisor, stats, None)
    host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
    host.copy_(stats, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(stats.device))  # the copy's stream, not the current device's
    return ValueCheck(labels, vocab, ignore_index, divisor, host, ready)


def check_values(
    labels: torch.Tensor, vocab: int, ignore_index: int, divisor: torch.Tensor | None = None
) -> int:
    """Raise for a label outside [0, V) that is not ``ignore_index`` (IndexError), or for a
    ``num_items_in_batch`` tensor that is negative or not finite (ValueError; ``divisor`` is it
    as ``reduction.loss_divisor`` made it, ``None`` when none was given as a tensor). Both are checked on the
    device and read back in one host sync, with the number of labels that are not
    ``ignore_index``, which is returned. Few launches: the kept labels' least and greatest value
    and their count come back together (each launch is host time the GPU may wait for)."""
    return start_value_check(labels, vocab, ignore_index, divisor).result()
