"""``LigerBypassWarning``: a training step whose loss the fused op did not compute is said, once,
with what took over. Each trainer here bypasses on purpose; the plain one does not warn."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments

import liger_patch as lp
from liger_patch.patching.state import LigerBypassWarning
from tests.integrations.test_trainer import TinyDataset
from tests.patching_helpers import tiny_model


class LogitsLossTrainer(Trainer):
    """Calls the model without labels and takes the loss from its logits (a custom loss)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        logits = model(**inputs).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


class OwnHeadTrainer(Trainer):
    """Runs the decoder body and the head itself (as another fused head would): the patched
    forward is never called."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        hidden = model.model(**inputs).last_hidden_state
        logits = model.lm_head(hidden[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), labels[:, 1:].flatten())


def _train(trainer_class, tmp_path, callbacks):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=2,
        optim="sgd",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    model = tiny_model("llama", seed=0, dtype=torch.float32)
    trainer = trainer_class(model=model, args=args, train_dataset=TinyDataset(), callbacks=callbacks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return [w for w in caught if issubclass(w.category, LigerBypassWarning)]


def test_loss_from_logits_in_training_warns_once(tmp_path):
    found = _train(LogitsLossTrainer, tmp_path, [lp.LigerPatchCallback(backend="torch")])
    assert len(found) == 1, [str(w.message) for w in found]
    assert "called in training without labels" in str(found[0].message)


def test_a_patched_model_called_without_labels_warns_once():
    model = tiny_model("llama", seed=0, dtype=torch.float32)
    lp.apply_liger_to(model, backend="torch")
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 7), device=model.device)
    with pytest.warns(LigerBypassWarning, match="without labels"):
        model(input_ids=ids).logits.sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LigerBypassWarning)
        model(input_ids=ids)  # once only
        with torch.no_grad():
            model(input_ids=ids)  # generation / scoring: never a bypass
        model(input_ids=ids, labels=ids).loss.backward()


def test_the_filter_the_warning_names_exists():
    """The message says how to silence it: ``category=liger_patch.LigerBypassWarning``."""
    model = tiny_model("llama", seed=0, dtype=torch.float32)
    lp.apply_liger_to(model, backend="torch")
    model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=lp.LigerBypassWarning)
        model(input_ids=torch.randint(0, model.config.vocab_size, (2, 7), device=model.device))
    assert not caught, [str(w.message) for w in caught]
    assert model._liger_patch_state.warned_bypass  # it was raised, and filtered


def test_a_step_that_never_calls_the_op_warns_at_its_end(tmp_path):
    found = _train(OwnHeadTrainer, tmp_path, [lp.LigerPatchCallback(backend="torch")])
    assert len(found) == 1, [str(w.message) for w in found]
    assert "never called with labels" in str(found[0].message)


def test_the_plain_trainer_does_not_warn(tmp_path):
    assert _train(Trainer, tmp_path, [lp.LigerPatchCallback(backend="torch")]) == []
