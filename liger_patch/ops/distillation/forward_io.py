"""The distillation operator's arguments by name (``liger_patch::fused_distill`` takes them
positionally, which is what ``torch.library`` allows; the Python side reads them by name)."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class DistillInputs(NamedTuple):
    """``liger_patch::fused_distill``'s arguments, by name."""

    student_hidden: Tensor
    student_weight: Tensor
    student_bias: Tensor | None
    teacher_hidden: Tensor
    teacher_weight: Tensor
    teacher_bias: Tensor | None
    labels: Tensor
    num_items: Tensor | None
    num_items_value: float | None
    options: str
    needs: list[bool]
