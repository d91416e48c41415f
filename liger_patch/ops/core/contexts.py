"""The two modes every call of the fused losses sets around its chunk loops, set only where they
change something.

``torch.autocast(..., enabled=False)`` and ``torch.no_grad()`` are Python context managers that
cost a few microseconds of host time each to build, enter and leave: in every training step, for
nothing when autocast is already off (outside any autocast region) or gradients are already
disabled (inside an ``autograd.Function``'s forward). Leaving an outermost autocast region also
clears its cast cache, which outside autocast is empty, so skipping the manager there changes
nothing (docs/perf-notes.md item 60).
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


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """``torch.autocast(device_type, enabled=False)`` where autocast is on for ``device_type``,
    else a context that does nothing."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (meta): as before, the manager decides
        enabled = True
    return torch.autocast(device_type, enabled=False) if enabled else _NOTHING


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
