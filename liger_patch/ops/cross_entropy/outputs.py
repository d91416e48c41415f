"""What the fused op returns: the loss alone, or a named tuple of the loss and the outputs asked for.

``loss, z_loss = op(..., return_z_loss=True)`` unpacks as before; every output is also reachable
by name (``out.token_accuracy``). The tuple holds exactly the outputs asked for, in the order of
``OUTPUT_NAMES``; each combination is its own ``FusedLossOutput`` named-tuple class, all made at
import (so ``torch.compile`` sees plain named tuples).
"""

from __future__ import annotations

import itertools
from collections import namedtuple

import torch

from liger_patch.ops.cross_entropy.options import OUTPUT_OPTIONS, LossOptions

OUTPUT_NAMES = tuple(option.removeprefix("return_") for option in OUTPUT_OPTIONS)
"""The optional outputs, each returned when its ``return_<name>`` option (an option of the output
kind) is set, in the options' order."""

_TYPES = {
    names: namedtuple("FusedLossOutput", ("loss", *names))
    for k in range(1, len(OUTPUT_NAMES) + 1)
    for names in itertools.combinations(OUTPUT_NAMES, k)
}


def requested(opts: LossOptions) -> tuple[str, ...]:
    """The optional outputs ``opts`` asks for, in ``OUTPUT_NAMES`` order."""
    return tuple(name for name in OUTPUT_NAMES if getattr(opts, f"return_{name}"))


def pack(
    opts: LossOptions,
    labels: torch.Tensor,
    loss: torch.Tensor,
    z_loss: torch.Tensor,
    argmax: torch.Tensor,
    entropy_rows: torch.Tensor,
):
    """The op's result for ``labels`` (the caller's shape) from the operator's flat outputs.

    Token accuracy and entropy are per token for reduction "none" (0 at ignored tokens), else
    their mean over the kept tokens (0 when none is kept): the share of kept tokens whose argmax
    is the label, and the mean entropy, differentiable. Predicted tokens are per token, -1 at
    ignored tokens.
    """
    lead = labels.shape
    per_token = opts.reduction == "none"
    if per_token:
        loss, z_loss = loss.reshape(lead), z_loss.reshape(lead)
    names = requested(opts)
    if not names:
        return loss
    keep = labels.reshape(-1) != opts.ignore_index
    kept = keep.sum().clamp_min(1)
    values = {"loss": loss, "z_loss": z_loss}
    if opts.return_token_accuracy:
        correct = (
            argmax == labels.reshape(-1)
        ) & keep  # argmax is -1 at ignored tokens, and so may be a label
        values["token_accuracy"] = correct.float().reshape(lead) if per_token else correct.sum() / kept
    if opts.return_predicted_tokens:
        values["predicted_tokens"] = argmax.reshape(lead)
    if opts.return_entropy:
        values["entropy"] = entropy_rows.reshape(lead) if per_token else entropy_rows.sum() / kept
    return _TYPES[names](**{name: values[name] for name in ("loss", *names)})
