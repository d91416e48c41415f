"""The Trainer callback on the families beyond the causal LM, on the CPU: ``Seq2SeqTrainer`` with
``predict_with_generate`` on a T5 and the ``Trainer`` with ``DataCollatorForLanguageModeling`` on
an XLM-R masked LM train fused (the op computes every training loss) and equal to unpatched,
loss for loss and parameter for parameter; evaluation runs the model's own forward."""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import (
    DataCollatorForLanguageModeling,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

import liger_patch as lp
from liger_patch.patching import forward
from liger_patch.patching.state import LigerBypassWarning

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from tiny_families import CopyTask, WordSentences, tiny_t5, tiny_xlm_roberta, word_tokenizer  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)
COMMON = dict(
    max_steps=3, gradient_accumulation_steps=2, learning_rate=1e-2, optim="sgd", lr_scheduler_type="constant",
    logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
    dataloader_num_workers=0, disable_tqdm=True, per_device_train_batch_size=4, per_device_eval_batch_size=4,
)  # fmt: skip


@pytest.fixture
def op_losses(monkeypatch) -> list[torch.Tensor]:
    """Every loss the fused op computed through a patched forward."""
    losses, real = [], forward.fused_head_loss

    def counted(*args, **kwargs):
        result = real(*args, **kwargs)
        losses.append(result)
        return result

    monkeypatch.setattr(forward, "fused_head_loss", counted)
    return losses


def _run(make_trainer, patched: bool):
    """Train (our warnings are errors), evaluate; the log, the eval metrics and the parameters."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", LigerBypassWarning)
        trainer = make_trainer([lp.LigerPatchCallback()] if patched else [])
        trainer.train()
        metrics = trainer.evaluate()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return [e["loss"] for e in trainer.state.log_history if "loss" in e], metrics, params


def _assert_same(reference, ours) -> None:
    (ref_losses, ref_metrics, ref_params), (losses, metrics, params) = reference, ours
    assert len(losses) == len(ref_losses) == 3
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    torch.testing.assert_close(
        torch.tensor(metrics["eval_loss"]), torch.tensor(ref_metrics["eval_loss"]), **TOL
    )
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_seq2seq_trainer_with_predict_with_generate_trains_fused_as_unpatched(tmp_path, op_losses):
    model = tiny_t5()

    def make(callbacks, model=model):
        args = Seq2SeqTrainingArguments(
            output_dir=str(tmp_path), predict_with_generate=True, generation_max_length=14, **COMMON
        )
        return Seq2SeqTrainer(
            model=copy.deepcopy(model), args=args, train_dataset=CopyTask(24),
            eval_dataset=CopyTask(8, seed=1), data_collator=default_data_collator, callbacks=callbacks,
        )  # fmt: skip

    reference = _run(make, patched=False)
    assert not op_losses
    ours = _run(make, patched=True)
    assert len(op_losses) == 3 * 2  # every micro-batch of every step, none in evaluation
    _assert_same(reference, ours)
    assert "eval_loss" in ours[1] and ours[1]["eval_loss"] > 0


def test_masked_lm_trainer_with_the_mlm_collator_trains_fused_as_unpatched(tmp_path, op_losses):
    tokenizer = word_tokenizer()
    model = tiny_xlm_roberta(vocab_size=len(tokenizer))

    def make(callbacks, model=model):
        return Trainer(
            model=copy.deepcopy(model), args=TrainingArguments(output_dir=str(tmp_path), **COMMON),
            train_dataset=WordSentences(tokenizer, 24), eval_dataset=WordSentences(tokenizer, 8, seed=1),
            data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15),
            callbacks=callbacks,
        )  # fmt: skip

    reference = _run(make, patched=False)
    ours = _run(make, patched=True)
    assert len(op_losses) == 3 * 2
    _assert_same(reference, ours)
