"""The loss options shared by every backend, validated once."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class LossOptions:
    """Per-token loss options (see docs/loss.md for the math).

    ``logit_scale`` multiplies the logits before the softcap; ``softcap`` c maps x to
    c * tanh(x / c). ``None`` disables either.
    """

    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss_scale: float = 0.0
    softcap: float | None = None
    logit_scale: float | None = None

    @property
    def scale(self) -> float:
        return 1.0 if self.logit_scale is None else float(self.logit_scale)


MiB = 1 << 20
MEMORY_BUDGETS = {"default": 512 * MiB, "lean": 32 * MiB}
"""Named memory budgets: bytes of working memory the op may use beyond its inputs, outputs and
gradients. ``default`` gives token chunks large enough for cuBLAS to run near its peak; ``lean``
is cut-cross-entropy's memory class (docs/loss.md has the measured speed of each)."""

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": MiB, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


def parse_memory_budget(value: int | str) -> int:
    """Bytes for a memory budget given as a positive int (bytes), a name in ``MEMORY_BUDGETS``,
    or a size string such as ``"256MiB"``, ``"1GiB"``, ``"64MB"``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"memory_budget must be an int number of bytes or a string, got {value!r}")
    if isinstance(value, int):
        nbytes = value
    elif value.strip().lower() in MEMORY_BUDGETS:
        return MEMORY_BUDGETS[value.strip().lower()]
    else:
        match = _SIZE.match(value.lower())
        if match is None or match.group(2) not in _UNITS:
            raise ValueError(
                f"memory_budget {value!r} is not one of {sorted(MEMORY_BUDGETS)} or a size such as '256MiB'"
            )
        nbytes = int(float(match.group(1)) * _UNITS[match.group(2)])
    if nbytes <= 0:
        raise ValueError(f"memory_budget must be positive, got {value!r}")
    return nbytes
