"""The two modes every call of the fused losses sets around its chunk loops, set only where they
change something.

``torch.autocast(..., enabled=False)`` and ``torch.no_grad()`` are Python context managers that
cost a few microseconds of host time each to build, enter and leave: in every training step, for
nothing when autocast is off for every device type or gradients are already disabled (inside an
``autograd.Function``'s forward). The manager is skipped only where no device type has autocast
on: its exit clears the thread's cast cache, shared by every device type, when it leaves the
outermost region, and that cache is empty only while autocast is off everywhere (a region of
another device type, or autocast switched on by ``torch.set_autocast_enabled``, fills it)
(docs/perf-notes.md item 60).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

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
