"""Tiny random models of any transformers model type, and a training batch for them.

The verification sweep runs one forward + backward of every causal-LM and every
image-text-to-text type the installed transformers knows, on CPU, in seconds per type. This
package makes that possible without downloads: it shrinks a type's default config (or a user's
config) to a few thousand parameters per layer, builds the model from it with a fixed seed,
and makes a batch (token ids, mask, labels with ignored positions and, for vision-language
models, images with the right number of placeholder tokens) that the model's forward accepts.

The modules, in the order a model and its batch are made:

- ``tasks``: the tasks and the model types / classes transformers maps to each.
- ``sizes``: the one set of tiny sizes; ``config_names``: which attribute names hold which size.
- ``configs``: shrinking a config. Generic first -- rules on attribute names applied to every
  nested sub-config dict (``shrink_rules``; ``layer_selection`` keeps one layer of each kind)
  --, then the relations the modeling code relies on (``relations``), special token ids moved
  into the vocabulary (``token_ids``), then what the rules cannot guess, per type
  (``overrides``: values; ``config_fixes``: code). The config class recomputes what it derives.
- ``models``: the model built from the shrunk config, float32, eager attention, train mode.
- ``batches``: the batch; ``batch_tokens`` (vocabulary and special ids), ``images`` (image
  inputs and their placeholder count), ``image_builders`` / ``pixels`` (per-layout images),
  ``batch_hooks`` (per-type batches and fixups).

Image placeholders are counted, not guessed: the batch builder runs the model's own
``get_image_features`` on the images and inserts one placeholder per feature vector.

Types that cannot run here (a package or hub download the machine lacks, no LM loss) raise
:class:`TinyModelError` with the reason. Nothing is downloaded. Importing this package imports
transformers: ``liger_patch.patching`` imports it lazily, only for the verification sweep.
"""

from __future__ import annotations

from liger_patch.patching.tiny.batches import example_batch
from liger_patch.patching.tiny.configs import tiny_config
from liger_patch.patching.tiny.errors import TinyModelError
from liger_patch.patching.tiny.models import tiny_model, tiny_model_from_config
from liger_patch.patching.tiny.sizes import (
    EXPERTS,
    FFN,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    LORA_RANK,
    MAX_POSITIONS,
    PATCHES_PER_SIDE,
    ROPE_HEAD_DIM,
    SMALL_RANK,
    TOP_K,
    VOCAB,
)
from liger_patch.patching.tiny.tasks import CAUSAL_LM, IMAGE_TEXT_TO_TEXT, model_class, model_types

__all__ = [
    "CAUSAL_LM",
    "EXPERTS",
    "FFN",
    "HEADS",
    "HEAD_DIM",
    "HIDDEN",
    "IMAGE_TEXT_TO_TEXT",
    "KV_HEADS",
    "LAYERS",
    "LORA_RANK",
    "MAX_POSITIONS",
    "PATCHES_PER_SIDE",
    "ROPE_HEAD_DIM",
    "SMALL_RANK",
    "TOP_K",
    "TinyModelError",
    "VOCAB",
    "example_batch",
    "model_class",
    "model_types",
    "tiny_config",
    "tiny_model",
    "tiny_model_from_config",
]
