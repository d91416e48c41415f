"""Offline stand-ins for the TRL examples (and their tests): a byte-level tokenizer with a chat
template, a tiny random Llama that covers it, and small SFT, preference and prompt datasets.
Nothing is downloaded. Not an example itself: the TRL examples (``trl_*.py``) import it."""

from __future__ import annotations

from datasets import Dataset
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (3 special tokens + 256 bytes) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", *sorted(alphabet)])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
    )


def tiny_model(vocab_size: int = 1000, hidden_size: int = 64, seed: int = 0):
    """A tiny random Llama whose vocabulary covers :func:`tiny_tokenizer`."""
    import torch

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(config)


def tiny_checkpoint(folder: str, seed: int = 0) -> str:
    """:func:`tiny_model` and :func:`tiny_tokenizer` saved to ``folder``: a path to pass as the
    model name, as users pass a hub name (DPO and GRPO load their reference model from it)."""
    tiny_model(seed=seed).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def arithmetic_chats(n: int) -> Dataset:
    """``n`` two-turn conversations in TRL's conversational format (SFT)."""
    return Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "user", "content": f"What is {i} + {i}?"},
                    {"role": "assistant", "content": f"{i} + {i} = {2 * i}."},
                ]
            }
            for i in range(n)
        ]
    )


def arithmetic_preferences(n: int) -> Dataset:
    """``n`` preference pairs (prompt, chosen, rejected) in TRL's standard format (DPO)."""
    return Dataset.from_list(
        [
            {"prompt": f"What is {i} + {i}? ", "chosen": f"{2 * i}.", "rejected": f"{2 * i + 1 + i % 3}."}
            for i in range(n)
        ]
    )


def arithmetic_labelled(n: int) -> Dataset:
    """``n`` prompts, each with a right and a wrong completion in turn, labelled desirable or not
    (TRL's unpaired preference format: KTO)."""
    return Dataset.from_list(
        [
            {"prompt": row["prompt"], "completion": row[side], "label": side == "chosen"}
            for row in arithmetic_preferences(n)
            for side in ("chosen", "rejected")
        ]
    )


def arithmetic_prompts(n: int) -> Dataset:
    """``n`` prompts (GRPO)."""
    return Dataset.from_list([{"prompt": f"What is {i} + {i}? "} for i in range(n)])


def digit_reward(completions: list[str], **_: object) -> list[float]:
    """A toy reward (GRPO): the share of digits in each completion."""
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]
