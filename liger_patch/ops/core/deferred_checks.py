"""Label checks that a forward did not wait for, raised before an optimizer can use their gradients.

On CUDA a forward that does not read its label check first (``kept_rows.reads_first``: only where
skipping the ignored rows pays for the wait) and finds its answer not yet on the host does not
wait for it (``kept_rows.finish_label_check``): the host keeps running ahead of the GPU. It walks
every row with out-of-range labels made ``ignore_index`` and the loss and gradients multiplied by
NaN when one was bad, and leaves the check here. The check's answer is read, and its error
raised, at the first of:

* the next call of either loss, if the answer has arrived by then (no wait);
* the next ``step`` of any ``torch.optim.Optimizer`` (a global step pre-hook, registered with
  the first deferred check): it waits for the answers still missing, so no optimizer ever steps
  on a poisoned gradient without the error;
* ``raise_pending()``, for a caller that wants the answers now.

A good answer read by ``raise_pending`` (at a point of the program, not of the GPU's progress)
also tells the forward the share of ignored labels of its shape (``learn``), which decides
whether a later call of that shape waits to skip them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from liger_patch.ops.core.validation import ValueCheck


@dataclass(frozen=True, eq=False)  # compared by identity
class _Deferred:
    check: ValueCheck
    learn: Callable[[int], None]


_PENDING: list[_Deferred] = []
_LOCK = threading.Lock()
_HOOK: list[object] = []  # the optimizer hook's handle, once registered


def defer(check: ValueCheck, learn: Callable[[int], None]) -> None:
    """Keep ``check`` until its answer is read; ``learn(n_kept)`` gets its kept count when
    ``raise_pending`` reads it."""
    with _LOCK:
        _PENDING.append(_Deferred(check, learn))
        if not _HOOK:  # made here: torch.optim and torch.compiler import FSDP, DTensor, dynamo
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            hook = torch.compiler.disable(_before_optimizer_step)
            _HOOK.append(register_optimizer_step_pre_hook(hook))


def pending() -> int:
    """How many deferred checks have not been read yet."""
    return len(_PENDING)


def raise_ready() -> None:
    """Read the deferred checks whose answers have arrived, oldest first, up to the first that
    has not (a later one on its stream cannot have arrived before it; one on another stream is
    read at the next call or step), without waiting; raise the first error found (the checks
    read before it are done with). Every call of either loss begins here: it queries one event
    more than it reads, not one per pending check."""
    if _PENDING and not _capturing():
        _read(_answered_prefix, learn=False)


def raise_pending() -> None:
    """Wait for every deferred check's answer and raise the first error found."""
    if _PENDING and not _capturing():
        _read(len, learn=True)


def _answered_prefix(checks: list[_Deferred]) -> int:
    for i, deferred in enumerate(checks):
        if not deferred.check.is_ready():
            return i
    return len(checks)


def _capturing() -> bool:
    """Whether a CUDA graph is being captured: no event may be queried or waited for then (never
    before CUDA is initialized; asking that costs less than ``is_available``, at every call)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _read(how_many: Callable[[list[_Deferred]], int], learn: bool) -> None:
    """Read the oldest ``how_many(pending)`` checks (taken out first, put back if one raises)."""
    with _LOCK:
        n = how_many(_PENDING)
        ready = _PENDING[:n]
        del _PENDING[:n]
    for i, deferred in enumerate(ready):
        try:
            n_kept = deferred.check.result(deferred=True)
            if learn:
                deferred.learn(n_kept)
        except Exception:
            with _LOCK:  # the others were taken out unread: put them back
                _PENDING[:0] = ready[i + 1 :]
            raise


def _before_optimizer_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    raise_pending()
