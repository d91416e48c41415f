"""A masked LM (BERT, RoBERTa, XLM-R, ModernBERT, DeBERTa, ...) with the Trainer and
DataCollatorForLanguageModeling: one callback.

    python examples/masked_lm_trainer.py                     # tiny XLM-R, offline
    python examples/masked_lm_trainer.py --model FacebookAI/xlm-roberta-large \
        --tokenizer FacebookAI/xlm-roberta-large            # a hub checkpoint or a local path

The collator labels about 15 % of the tokens; the fused op skips the other 85 % of the head's rows
(none of their logits are made), and XLM-R's 250002-entry vocabulary never becomes a
tokens x vocab tensor. The default model and tokenizer are built here: nothing is downloaded.
"""

from __future__ import annotations

import argparse

import torch
from tiny_families import WordSentences, tiny_xlm_roberta, word_tokenizer
from transformers import AutoTokenizer, DataCollatorForLanguageModeling, Trainer, TrainingArguments

from liger_patch import LigerPatchCallback


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="hub name or local path (default: tiny random XLM-R)")
    parser.add_argument("--tokenizer", default=None, help="its tokenizer (default: a tiny word-level one)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    parser.add_argument("--output-dir", default="out/masked_lm_trainer")
    args = parser.parse_args(argv)

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else word_tokenizer()
    model = tiny_xlm_roberta(args.model, vocab_size=len(tokenizer))
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=8,
        max_steps=args.steps,
        logging_steps=max(1, args.steps // 5),
        learning_rate=1e-3,
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        save_strategy="no",
        report_to=[],
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=WordSentences(tokenizer, 64),
        eval_dataset=WordSentences(tokenizer, 16, seed=1),
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15),
        callbacks=[LigerPatchCallback()],
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    print(f"last logged step: loss {logged[-1]['loss']:.4f}")
    print(f"eval: loss {trainer.evaluate()['eval_loss']:.4f}")


if __name__ == "__main__":
    main()
