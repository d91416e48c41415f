"""The cross-entropy operators' arguments and outputs by name (``liger_patch::flce`` returns a
plain tuple, which is what ``torch.library`` allows; the Python side reads it by name)."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class ForwardInputs(NamedTuple):
    """``liger_patch::flce``'s arguments, as its autograd context receives them."""

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None
    labels: Tensor
    class_weight: Tensor | None
    num_items: Tensor | None
    num_items_value: float | None
    options: str
    needs: list[bool]
    low_rank_u: Tensor | None = None
    low_rank_b: Tensor | None = None


class ForwardOutputs(NamedTuple):
    """``liger_patch::flce``'s outputs, by name (the operator returns them as a plain tuple, which is
    what ``torch.library`` allows): the loss and z-loss (reduced, or per token for "none"), the
    argmax and entropy per token (empty unless asked for), the rows' log-sum-exp, their weights in
    the reduced loss and their token scales (empty without token scaling), and the gradients the
    forward computed (empty where it did not)."""

    loss: Tensor
    z_loss: Tensor
    argmax: Tensor
    entropy: Tensor
    lse: Tensor
    row_weight: Tensor
    token_scale: Tensor
    grad_hidden: Tensor
    grad_weight: Tensor
    grad_bias: Tensor
    grad_u: Tensor
    grad_b: Tensor


class SavedTensors(NamedTuple):
    """What ``flce``'s autograd node saves for its backward (``u`` and ``b``: the low-rank term's,
    ``None`` without one)."""

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None
    labels: Tensor
    class_weight: Tensor | None
    lse: Tensor
    row_weight: Tensor
    token_scale: Tensor
    entropy: Tensor
    u: Tensor | None
    b: Tensor | None


def low_rank_needs(needs: list[bool]) -> tuple[bool, bool]:
    """Whether u and B want gradients: ``needs``' entries 4 and 5 (absent: no)."""
    return (len(needs) > 3 and needs[3], len(needs) > 4 and needs[4])
