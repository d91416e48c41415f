"""The transformers / peft names the patched forward uses, imported on first use.

Importing transformers (or peft) costs about a second, and ``import liger_patch`` must not pay
it. ``make_liger_forward`` fills the cache eagerly, so the patched forward (also when
torch.compile traces it) only reads a dict.
"""

from __future__ import annotations

from typing import Any

_LAZY: dict[str, Any] = {}


def lazy_imports() -> dict[str, Any]:
    """``causal_lm_loss`` (transformers' stock ``ForCausalLMLoss``) and ``peft_tuner_layer``
    (``()`` without peft), imported once and cached."""
    if not _LAZY:
        from transformers.loss.loss_utils import LOSS_MAPPING

        try:
            from peft.tuners.tuners_utils import BaseTunerLayer
        except ImportError:
            BaseTunerLayer = ()  # noqa: N806 - peft absent: nothing can be a peft layer
        _LAZY.update(causal_lm_loss=LOSS_MAPPING["ForCausalLM"], peft_tuner_layer=BaseTunerLayer)
    return _LAZY
