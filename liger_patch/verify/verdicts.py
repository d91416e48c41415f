"""What the verification sweep says about a type: its status, the reason, the measured errors,
and the tolerance they are judged by.

Each status has one meaning (``STATUS_MEANINGS``). Only **verified**, **refused** and
**failed** say something about the patch; the other three say why there was nothing to compare,
each for its own reason, so that "refused" always means the patch itself declined the type.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "BUILDER_ERROR",
    "FAILED",
    "REFUSED",
    "STATUSES",
    "STATUS_MEANINGS",
    "STATUS_SUMMARIES",
    "UNBUILDABLE",
    "UNPATCHED_FAILS",
    "VERIFIED",
    "Tolerance",
    "Verdict",
    "brief",
]

VERIFIED = "verified"
REFUSED = "refused"
FAILED = "failed"
UNBUILDABLE = "unbuildable"
BUILDER_ERROR = "builder-error"
UNPATCHED_FAILS = "unpatched-fails"

STATUS_MEANINGS: dict[str, str] = {
    VERIFIED: "the fused path ran (no logits built) and the loss and every parameter's gradient "
    "matched the unpatched step",
    REFUSED: "the patch itself declines the type: `apply_liger_to` refuses its class (asked first, "
    "before anything is built: a forward that takes no labels, say) or the tiny model, or its forward "
    "falls back to the original path; the reason says why (nothing is patched on a guess)",
    FAILED: "the fused path ran and did not match, or raised. A failed type goes into "
    "`derive.KNOWN_MISMATCHES` until it is fixed: no silent wrong loss, ever",
    UNBUILDABLE: "no tiny model of the type can be built here, for a known reason (a package or hub "
    "download this machine lacks, a config the tiny sizes cannot satisfy)",
    BUILDER_ERROR: "building the tiny model or its batch raised an unexpected exception: the "
    "tiny-model factory does not handle the type yet",
    UNPATCHED_FAILS: "the unpatched model fails on its own batch (it raises, or its loss or a "
    "gradient is not finite): the model's own trouble, nothing to compare the patch with",
}
"""Every status, in the order summaries list them, and what it means."""

STATUSES = tuple(STATUS_MEANINGS)

STATUS_SUMMARIES: dict[str, str] = {
    VERIFIED: "patched equals unpatched, loss and every gradient",
    REFUSED: "the patch declines the type, with a reason (nothing fused)",
    FAILED: "patched differs from unpatched, or raised",
    UNBUILDABLE: "no tiny model can be built here (a package or download missing)",
    BUILDER_ERROR: "building the tiny model raised (the factory's gap, not the patch's)",
    UNPATCHED_FAILS: "the unpatched model itself fails on its batch",
}
"""Each status in a few words, for the summary table (``STATUS_MEANINGS`` says it in full)."""


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
