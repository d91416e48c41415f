"""The transformers / peft names the patched forward uses, imported on first use.

Importing transformers (or peft) costs about a second, and ``import liger_patch`` must not pay
it. ``make_liger_forward`` fills the cache eagerly, so the patched forward (also when
torch.compile traces it) only reads a dict.
"""

from __future__ import annotations

from typing import Any

_LAZY: dict[str, Any] = {}


def lazy_imports() -> dict[str, Any]:
    """``dense_output``, ``moe_output``, ``slice_logits_to_keep`` (or ``None``) and
    ``peft_tuner_layer`` (``()`` without peft), imported once and cached."""
    if not _LAZY:
        from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

        try:  # transformers 5.x names the slicing (and adds 2-D position/mask forms); 4.57 sliced inline
            from transformers.modeling_utils import slice_logits_to_keep
        except ImportError:
            slice_logits_to_keep = None
        try:
            from peft.tuners.tuners_utils import BaseTunerLayer
        except ImportError:
            BaseTunerLayer = ()  # noqa: N806 - peft absent: nothing can be a peft layer
        _LAZY.update(
            dense_output=CausalLMOutputWithPast,
            moe_output=MoeCausalLMOutputWithPast,
            slice_logits_to_keep=slice_logits_to_keep,
            peft_tuner_layer=BaseTunerLayer,
        )
    return _LAZY
