"""Special token ids of a config tree, moved into (or added to) the tiny vocabulary."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from liger_patch.patching.tiny.config_names import TOKEN_ID_RE
from liger_patch.patching.tiny.config_tree import is_int, sub_dicts, type_key
from liger_patch.patching.tiny.errors import TinyModelError
from liger_patch.patching.tiny.overrides import NEEDED_TOKEN_IDS
from liger_patch.patching.tiny.sizes import VOCAB


def text_vocab_after_shrink(tree: dict[str, Any]) -> int:
    """The text vocabulary size the shrunk config will have (token ids must stay below it)."""
    sizes = [sub["vocab_size"] for sub in sub_dicts(tree) if isinstance(sub.get("vocab_size"), int)]
    if not sizes:
        return VOCAB
    return min(max(sizes), VOCAB)


class TokenIds:
    """Special token ids moved into the tiny vocabulary: one map for the whole config tree, so an
    id shared by the top config and its text config (``image_token_id``) moves to the same new
    value in both; new ids are taken from the top of the vocabulary, skipping ids in use."""

    def __init__(self, vocab: int, tree: dict[str, Any]) -> None:
        self.vocab = vocab
        self.moved: dict[int, int] = {}
        self.used = {i for i in token_id_values(tree) if 0 <= i < vocab}
        self.next_free = vocab - 1

    def remap(self, value: int) -> int:
        """``value`` if it is a valid id, else the id it moves to."""
        if 0 <= value < self.vocab:
            return value
        if value not in self.moved:
            self.moved[value] = self.fresh()
        return self.moved[value]

    def fresh(self) -> int:
        """An id no special token uses yet."""
        while self.next_free in self.used:
            self.next_free -= 1
        if self.next_free < 0:
            raise TinyModelError(f"more special tokens than the {self.vocab} ids of the tiny vocabulary")
        self.used.add(self.next_free)
        return self.next_free


def token_id_values(tree: dict[str, Any]) -> Iterator[int]:
    """Every special token id named in a config dict tree."""
    for sub in sub_dicts(tree):
        for key, value in sub.items():
            if not TOKEN_ID_RE.search(key) or "layer" in key:
                continue
            if is_int(value):
                yield value
            elif isinstance(value, list):
                yield from (v for v in value if is_int(v))


def remap_token_ids(d: dict[str, Any], tokens: TokenIds) -> None:
    """Move the special token ids of one (sub)config dict into the tiny vocabulary."""
    for key, value in list(d.items()):
        if not TOKEN_ID_RE.search(key) or "layer" in key:
            continue
        if is_int(value):
            d[key] = tokens.remap(value)
        elif isinstance(value, list) and all(is_int(v) for v in value):
            d[key] = [tokens.remap(v) for v in value]


def add_missing_token_ids(tree: dict[str, Any], tokens: TokenIds) -> None:
    """Give a fresh id to placeholder tokens a model needs but its default config leaves unset.

    Blip-2 style models match ``image_token_index`` in the ids: left None, no image is placed.
    """
    for sub in sub_dicts(tree):
        names = [*NEEDED_TOKEN_IDS.get(type_key(sub), ())]
        if sub is tree and "vision_config" in tree:
            names += [k for k in ("image_token_id", "image_token_index") if k in sub]
        for name in names:
            if sub.get(name) is None:
                sub[name] = tokens.fresh()
