"""Derived specs: any model type patches with no row, refusals carry their reason, and what
cannot be fused exactly keeps the original path with a warning that says why."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import transformers

import liger_patch as lp
from liger_patch.patching import derive
from liger_patch.patching.forward import is_liger_forward
from liger_patch.patching.registry import BUILTIN_ROWS
from tests.patching_helpers import make_batch, tiny_model

BUILTIN = {row.model_type: row for row in BUILTIN_ROWS}


def test_supported_models_reports_derived_specs_apart_from_rows():
    specs = lp.supported_models()
    assert len(specs) >= 150
    assert all(spec.derived for model_type, spec in specs.items() if model_type not in BUILTIN)
    assert specs["llama"].class_name == "LlamaForCausalLM" and specs["llama"].head is None
    assert lp.supported_models(derived=False) == BUILTIN


def test_a_model_type_names_its_causal_lm_and_its_vlm_class():
    classes = derive.classes_for_model_type("gemma3")
    if len(classes) < 1:
        pytest.skip("this transformers has no gemma3")
    vlm = transformers.Gemma3ForConditionalGeneration
    assert vlm in classes
    lp.apply_liger_to("gemma3")
    try:
        assert all(is_liger_forward(cls.forward) for cls in classes)
    finally:
        lp.revert_liger("gemma3")
    assert not any(is_liger_forward(cls.forward) for cls in classes)


def test_a_refused_type_is_refused_with_its_reason(monkeypatch):
    monkeypatch.setitem(derive.KNOWN_MISMATCHES, "llama", "the sweep found its gradients differ")
    model = tiny_model("llama")
    with pytest.raises(
        lp.UnsupportedModelError, match="'llama' is refused: the sweep found its gradients differ"
    ):
        lp.apply_liger_to(model)
    with pytest.warns(UserWarning, match="left unpatched"):
        lp.apply_liger_to(model, strict=False)
    assert not is_liger_forward(model.forward)


def test_something_that_is_not_a_model_class_is_refused():
    with pytest.raises(lp.UnsupportedModelError, match="not an nn.Module class"):
        derive.derived_spec(int)


class ScaledHead(nn.Module):
    """A non-linear output head (a linear layer followed by a learnable scale)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, hidden):
        return self.linear(hidden) * self.scale


def test_a_non_linear_head_keeps_the_original_path_with_a_warning():
    model = tiny_model("llama")
    model.lm_head = ScaledHead(model.lm_head)
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="lm_head is a ScaledHead, not a plain nn.Linear"):
        lp.apply_liger_to(model)
    batch = make_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model(**batch)
    assert out.logits is not None
    torch.testing.assert_close(out.loss, reference(**batch).loss)


def test_a_forward_using_its_logits_unsupportedly_falls_back_once_naming_the_op():
    class LogSoftmaxLlama(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            hidden = self.model(input_ids=input_ids).last_hidden_state
            logprobs = torch.log_softmax(self.lm_head(hidden), dim=-1)
            loss = -logprobs[:, :-1].gather(-1, labels[:, 1:, None]).mean()
            return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logprobs)

    llama = tiny_model("llama")
    model = LogSoftmaxLlama(llama.config).train().to(llama.lm_head.weight)
    reference = copy.deepcopy(model)
    lp.apply_liger_to(model)
    batch = {"input_ids": make_batch()["input_ids"], "labels": make_batch()["input_ids"]}
    with pytest.warns(UserWarning, match="logits.gather"):
        out = model(**batch)
    torch.testing.assert_close(out.loss, reference(**batch).loss)
    with warnings.catch_warnings():  # said once; the patch now runs the original path directly
        warnings.simplefilter("error")
        assert model(**batch).logits is not None


def test_a_head_whose_weight_does_not_fit_the_hidden_states_is_refused_clearly():
    """Tied weights of a different shape: the op names the shapes, before any kernel runs."""
    model = tiny_model("llama")
    model.lm_head = nn.Linear(16, model.config.vocab_size, bias=False)  # hidden size is 32
    lp.apply_liger_to(model)
    with pytest.raises((ValueError, RuntimeError), match="16|32"):
        model(**make_batch())


@pytest.mark.parametrize("model_type", ["llava", "qwen2_vl", "gemma3"])
def test_a_vlm_fuses_in_training_and_keeps_the_original_path_for_eval_and_generate(model_type):
    from liger_patch.verify.batches import example_batch
    from liger_patch.verify.models import model_types
    from liger_patch.verify.models import tiny_model as tiny_vlm

    if model_type not in model_types(derive.IMAGE_TEXT_TO_TEXT):
        pytest.skip(f"this transformers has no {model_type}")
    reference = tiny_vlm(model_type, derive.IMAGE_TEXT_TO_TEXT)
    batch = example_batch(reference)
    patched = copy.deepcopy(reference)
    lp.apply_liger_to(patched)
    out = patched(**batch)
    assert out.logits is None
    torch.testing.assert_close(out.loss, reference(**batch).loss, rtol=1e-5, atol=1e-6)
    patched.eval(), reference.eval()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        torch.testing.assert_close(patched(**inputs).logits, reference(**inputs).logits, rtol=0, atol=0)
        kwargs = dict(max_new_tokens=3, do_sample=False)
        assert torch.equal(patched.generate(**inputs, **kwargs), reference.generate(**inputs, **kwargs))


def test_a_model_type_string_patches_every_lm_head_class_of_the_type_and_says_which(caplog):
    """``"bert"`` is BERT's causal LM and its masked LM; ``"t5"`` its seq2seq LM; ``"whisper"``
    its causal LM and its speech seq2seq class: each patched, and the log names them."""
    import logging

    expected = {
        "bert": {"BertLMHeadModel": "causal-lm", "BertForMaskedLM": "masked-lm"},
        "t5": {"T5ForConditionalGeneration": "seq2seq-lm"},
        "whisper": {"WhisperForCausalLM": "causal-lm", "WhisperForConditionalGeneration": "speech-seq2seq"},
        "modernbert": {"ModernBertForMaskedLM": "masked-lm"},
    }
    for model_type, classes in expected.items():
        with caplog.at_level(logging.INFO, logger="liger_patch"):
            caplog.clear()
            lp.apply_liger_to(model_type)
        try:
            for name, family in classes.items():
                cls = getattr(transformers, name)
                assert is_liger_forward(cls.forward), name
                assert f"{name} ({family}" in caplog.text, caplog.text
        finally:
            lp.revert_liger(model_type)
        assert not any(is_liger_forward(getattr(transformers, name).forward) for name in classes)


def test_a_model_type_string_leaves_a_class_it_cannot_patch_and_names_it(monkeypatch):
    refused = transformers.BertLMHeadModel
    real = derive.spec_for

    def spec_for(cls):
        if cls is refused:
            raise lp.UnsupportedModelError("liger_patch cannot patch BertLMHeadModel: a test says so.")
        return real(cls)

    monkeypatch.setattr(derive, "spec_for", spec_for)
    with pytest.warns(UserWarning, match="a test says so. apply_liger_to\\('bert'\\) leaves it unpatched"):
        lp.apply_liger_to("bert")
    try:
        assert is_liger_forward(transformers.BertForMaskedLM.forward)
        assert not is_liger_forward(refused.forward)
    finally:
        lp.revert_liger("bert")


def test_an_unknown_model_type_string_is_refused_clearly():
    with pytest.raises(lp.UnsupportedModelError, match="maps model_type 'no_such_type' to no class"):
        lp.apply_liger_to("no_such_type")


def test_supported_models_lists_every_family():
    families = lp.supported_models(by_family=True)
    assert tuple(families) == derive.TASKS
    assert families["seq2seq-lm"]["t5"].class_name == "T5ForConditionalGeneration"
    assert families["masked-lm"]["bert"].class_name == "BertForMaskedLM"
    assert families["speech-seq2seq"]["whisper"].class_name == "WhisperForConditionalGeneration"
    assert families["causal-lm"]["bert"].class_name == "BertLMHeadModel"
    flat = lp.supported_models()
    assert (
        flat["bert"].class_name == "BertLMHeadModel" and flat["t5"].class_name == "T5ForConditionalGeneration"
    )
