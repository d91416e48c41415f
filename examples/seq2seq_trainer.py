"""An encoder-decoder (T5, mT5, BART, NLLB, Marian, ...) with Seq2SeqTrainer: one callback.

    python examples/seq2seq_trainer.py                          # tiny T5, CPU or GPU, offline
    python examples/seq2seq_trainer.py --model google/mt5-base  # a hub checkpoint or a local path

The callback patches ``T5ForConditionalGeneration`` like any model with a vocabulary head: the
decoder's loss is the fused op (mT5's 250112-entry vocabulary never becomes a tokens x vocab
tensor); evaluation with ``predict_with_generate`` runs the model's own forward and ``generate``.
The default model is built from a config and learns to reverse random word sequences.
"""

from __future__ import annotations

import argparse

import torch
from tiny_families import CopyTask, tiny_t5
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, default_data_collator

from liger_patch import LigerPatchCallback


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="hub name or local path (default: tiny random T5)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    parser.add_argument("--output-dir", default="out/seq2seq_trainer")
    args = parser.parse_args(argv)

    model = tiny_t5(args.model)
    vocab = model.config.vocab_size
    training_args = Seq2SeqTrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        max_steps=args.steps,
        logging_steps=max(1, args.steps // 5),
        learning_rate=3e-3,
        predict_with_generate=True,
        generation_max_length=14,
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        save_strategy="no",
        report_to=[],
    )
    trainer = Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=CopyTask(64, vocab),
        eval_dataset=CopyTask(16, vocab, seed=1),
        data_collator=default_data_collator,  # equal lengths: no padding needed
        callbacks=[LigerPatchCallback()],
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    print(f"last logged step: loss {logged[-1]['loss']:.4f}")
    # Evaluation generates with the model's own forward: its eval_loss is the unpatched one.
    print(f"eval (predict_with_generate): loss {trainer.evaluate()['eval_loss']:.4f}")


if __name__ == "__main__":
    main()
