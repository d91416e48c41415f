"""Tiny random models of the families beyond the causal LM, built from configs (nothing is
downloaded), and a word-level tokenizer with a mask token: what the seq2seq, masked-LM and speech
examples (and tests/integrations/test_trainer_families.py) train.

Each builder takes a hub name or local path instead (``from_pretrained``), for a real run.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerFast

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = 120


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer: five special tokens, then ``w0`` ... ``w119``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate([*SPECIALS, *(f"w{i}" for i in range(WORDS))])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def tiny_t5(name: str | None = None, seed: int = 0):
    """A T5 (the v1.1 layout: untied head, gated FFN) of 2 + 2 layers, vocabulary 128; or ``name``."""
    from transformers import AutoModelForSeq2SeqLM, T5Config

    if name:
        return AutoModelForSeq2SeqLM.from_pretrained(name)
    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return AutoModelForSeq2SeqLM.from_config(config)


def tiny_xlm_roberta(name: str | None = None, vocab_size: int = 128, seed: int = 0):
    """An XLM-RoBERTa masked LM of 2 layers, hidden 64 (its head: transform, then the tied
    projection with its bias); or ``name``."""
    from transformers import AutoModelForMaskedLM, XLMRobertaConfig

    if name:
        return AutoModelForMaskedLM.from_pretrained(name)
    torch.manual_seed(seed)
    config = XLMRobertaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=130, pad_token_id=0, bos_token_id=2, eos_token_id=3,
    )  # fmt: skip
    return AutoModelForMaskedLM.from_config(config)


def tiny_whisper(name: str | None = None, seed: int = 0):
    """A Whisper of 2 + 2 layers, 80 mel bins over 64 frames (32 source positions); or ``name``."""
    from transformers import AutoModelForSpeechSeq2Seq, WhisperConfig

    if name:
        return AutoModelForSpeechSeq2Seq.from_pretrained(name)
    torch.manual_seed(seed)
    config = WhisperConfig(
        vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80,
        max_source_positions=32, max_target_positions=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1, suppress_tokens=[], begin_suppress_tokens=[],
    )  # fmt: skip
    return AutoModelForSpeechSeq2Seq.from_config(config)


class CopyTask(torch.utils.data.Dataset):
    """``n`` random word sequences whose target is the sequence reversed (a task a seq2seq model
    learns): ``input_ids`` and ``labels`` (lists of ids, all of one length)."""

    def __init__(self, n: int, vocab: int = 128, length: int = 12, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(5, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        ids = self.rows[i].tolist()
        return {"input_ids": ids, "labels": ids[::-1]}


class WordSentences(torch.utils.data.Dataset):
    """``n`` sentences of :func:`word_tokenizer`'s words, tokenized: what
    ``DataCollatorForLanguageModeling`` masks."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, n: int, length: int = 24, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        words = torch.randint(0, WORDS, (n, length), generator=g)
        self.rows = [tokenizer(" ".join(f"w{w}" for w in row.tolist()))["input_ids"] for row in words]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.rows[i]}
