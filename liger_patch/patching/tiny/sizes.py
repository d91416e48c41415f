"""The sizes of every tiny model.

One set for every family so that widths agree across sub-configs without bookkeeping: a
projector reading ``vision_config.hidden_size`` and writing ``text_config.hidden_size`` sees 64
on both sides.
"""

from __future__ import annotations

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
ROPE_HEAD_DIM = 8
FFN = 128
LAYERS = 2
VOCAB = 256
EXPERTS = 4
TOP_K = 2
LORA_RANK = 32
SMALL_RANK = 8
MAX_POSITIONS = 4096
PATCHES_PER_SIDE = 4
# Images of VQ tokenizers (Chameleon, Emu3): 16 px, 4 x 4 codes after 4x downsampling, 32 codes.
VQ_SIDE = 16
VQ_CODES = 32
# Leading positions of a batch's last row that are padding (attention_mask 0, label -100).
LEFT_PAD = 2
