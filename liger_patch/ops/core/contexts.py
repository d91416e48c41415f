"""The modes every call of the fused losses sets around its work, set only where they change
something: autocast off and gradients off around the chunk loops, and the inputs' CUDA device.

``torch.autocast(..., enabled=False)`` and ``torch.no_grad()`` are Python context managers that
cost a few microseconds of host time each to build, enter and leave: in every training step, for
nothing when autocast is off for every device type or gradients are already disabled (inside an
``autograd.Function``'s forward). The manager is skipped only where no device type has autocast
on: its exit clears the thread's cast cache, shared by every device type, when it leaves the
outermost region, and that cache is empty only while autocast is off everywhere (a region of
another device type, or autocast switched on by ``torch.set_autocast_enabled``, fills it)
(docs/perf-notes.md item 60).

The CUDA device: a Triton launch, an event's record, a stream made or asked whether it captures
all act on the current device, not on the tensors' (PyTorch's own operators switch to their
inputs' device; ours must). A model split over GPUs (``device_map="auto"``, pipeline stages) calls
its head on ``cuda:1`` while the current device is ``cuda:0``: without the switch the kernels
would run on device 0's stream, unordered with the work that made their inputs on device 1.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch
from torch import Tensor

P = ParamSpec("P")
R = TypeVar("R")

_NOTHING = contextlib.nullcontext()  # stateless: one instance serves every ``with``
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)  # None: always the manager


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """``torch.autocast(device_type, enabled=False)`` where autocast is on for any device type,
    else a context that does nothing (also for a device type ``torch.autocast`` would refuse:
    with autocast off everywhere there is nothing to turn off)."""
    if _ANY_AUTOCAST is None or _ANY_AUTOCAST():
        return torch.autocast(device_type, enabled=False)
    return _NOTHING


def without_grad(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run under ``torch.no_grad()`` where gradients are enabled, else as it is: the
    ``@torch.no_grad()`` decorator for functions that run at every call."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        with torch.no_grad():
            return fn(*args, **kwargs)

    return run


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """``torch.cuda.device(device)`` where ``device`` is a CUDA device other than the current one,
    else a context that does nothing (the common case costs a comparison)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return _NOTHING


def on_inputs_device(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run with its first argument's CUDA device current (``on_device``): the first
    argument is a tensor, or a list of tensors (the first one's device). For the operators'
    implementations, which every path reaches: the eager twin, the registered operator (under
    ``torch.compile`` too) and the backward operators."""
    signature = inspect.signature(fn, eval_str=True)
    first_name = next(iter(signature.parameters))

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        first = args[0] if args else kwargs.get(first_name)
        if isinstance(first, list):
            first = first[0] if first else None
        if isinstance(first, Tensor) and first.is_cuda:
            with on_device(first.device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    # Annotations resolved in fn's module: torch.library infers an operator's schema from them.
    run.__signature__ = signature  # type: ignore[attr-defined]
    return run
