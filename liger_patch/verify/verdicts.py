"""What the verification sweep says about a type: its status, the reason, the measured errors,
and the tolerance they are judged by.

* **verified**: the fused path ran (no logits built) and matched;
* **refused**: ``apply_liger_to`` refuses it, or the patched forward falls back to the original
  path, with the reason (nothing is patched on a guess);
* **failed**: the fused path ran and did not match, or raised. A failed type goes into
  ``derive.REFUSED`` until it is fixed: no silent wrong loss, ever.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["FAILED", "REFUSED", "VERIFIED", "Tolerance", "Verdict", "brief"]

VERIFIED, REFUSED, FAILED = "verified", "refused", "failed"


@dataclass(frozen=True)
class Tolerance:
    """How close patched must be to unpatched: the loss (relative) and each gradient (the norm
    of the difference over the norm of the unpatched gradient)."""

    loss: float
    grad: float

    @staticmethod
    def for_dtype(dtype: torch.dtype) -> Tolerance:
        return Tolerance(loss=1e-5, grad=1e-4) if dtype == torch.float32 else Tolerance(loss=2e-2, grad=1e-1)


@dataclass
class Verdict:
    """One type's result; ``loss_error`` / ``grad_error`` are the measured relative errors."""

    model_type: str
    task: str
    status: str
    reason: str = ""
    class_name: str = ""
    loss_error: float | None = None
    grad_error: float | None = None
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def brief(error: BaseException) -> str:
    """``Type: first line of the message`` (cut to 300 characters)."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {message}"[:300]
