"""The batches of the families beyond the causal LM: an encoder-decoder's labels are its decoder's
(shifted into its inputs from its start token), a speech model's encoder gets audio of the shape
it takes, a masked LM labels about 15 % of its positions; and the sweep checks them."""

from __future__ import annotations

import pytest
import torch

from liger_patch.patching import logits_ops
from liger_patch.patching.derive import MASKED_LM, SEQ2SEQ_LM, SPEECH_SEQ2SEQ
from liger_patch.verify.batches import example_batch
from liger_patch.verify.lm_batches import MASKED_SHARE, TARGET_LEN, masked_labels, task_of
from liger_patch.verify.models import model_types, tiny_model
from liger_patch.verify.sweep import verify_type
from liger_patch.verify.verdicts import FAILED, VERIFIED


def test_masked_labels_keep_about_fifteen_percent():
    ids = torch.arange(4000).view(40, 100)
    labels = masked_labels(ids, torch.Generator().manual_seed(0))
    kept = labels != -100
    assert abs(kept.float().mean().item() - MASKED_SHARE) < 0.02
    assert torch.equal(labels[kept], ids[kept]) and kept.any(dim=1).all()


def test_a_masked_lm_batch_labels_a_few_positions():
    model = tiny_model("bert", MASKED_LM)
    batch = example_batch(model, task=MASKED_LM, seq_len=64)
    kept = batch["labels"] != -100
    assert 0 < kept.sum() < 0.4 * kept.numel()
    # the labelled inputs are corrupted (mostly), as a masked-LM collator does; the others kept
    assert (batch["labels"][kept] != batch["input_ids"][kept]).float().mean() > 0.9


@pytest.mark.parametrize("model_type", ["t5", "bart", "m2m_100"])
def test_an_encoder_decoder_batch_gives_labels_its_decoder_starts_from(model_type):
    model = tiny_model(model_type, SEQ2SEQ_LM)
    assert model.config.decoder_start_token_id is not None
    batch = example_batch(model, task=SEQ2SEQ_LM)
    assert "decoder_input_ids" not in batch and batch["labels"].shape == batch["input_ids"].shape
    output = model(**batch)
    assert torch.isfinite(output.loss) and output.logits.shape[:2] == batch["labels"].shape


@pytest.mark.parametrize("model_type", ["whisper", "speech_to_text"])
def test_a_speech_batch_has_audio_of_the_encoders_shape(model_type):
    model = tiny_model(model_type, SPEECH_SEQ2SEQ)
    batch = example_batch(model, task=SPEECH_SEQ2SEQ)
    assert "input_ids" not in batch and batch["input_features"].dtype == torch.float32
    assert batch["labels"].shape == (2, TARGET_LEN)
    assert torch.isfinite(model(**batch).loss)


def test_a_models_family_is_read_off_its_class():
    assert task_of(tiny_model("t5", SEQ2SEQ_LM)) == SEQ2SEQ_LM
    assert task_of(tiny_model("whisper", SPEECH_SEQ2SEQ)) == SPEECH_SEQ2SEQ
    assert task_of(tiny_model("roberta", MASKED_LM)) == MASKED_LM
    assert task_of(tiny_model("llama")) is None


@pytest.mark.parametrize(
    ("model_type", "task"),
    [("t5", SEQ2SEQ_LM), ("bart", SEQ2SEQ_LM), ("whisper", SPEECH_SEQ2SEQ), ("roberta", MASKED_LM)],
)
def test_the_families_verify(model_type, task):
    verdict = verify_type(model_type, task, options={"backend": "torch"})
    assert verdict.status == VERIFIED, verdict


def test_a_dropped_logits_bias_is_caught(monkeypatch):
    """The planted bug: BART's final_logits_bias (random in the tiny model) left out of the loss."""
    real = logits_ops.head_math
    monkeypatch.setattr(logits_ops, "head_math", lambda *args: (*real(*args)[:2], None))
    verdict = verify_type("bart", SEQ2SEQ_LM, options={"backend": "torch"})
    assert verdict.status == FAILED and "loss" in verdict.reason, verdict


def test_every_family_has_types():
    for task in (SEQ2SEQ_LM, SPEECH_SEQ2SEQ, MASKED_LM):
        assert len(model_types(task)) >= 10, task
