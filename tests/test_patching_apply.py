"""apply_liger_to / revert_liger / liger_patched / register_model: what gets patched, and undone."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import transformers

import liger_patch as lp
from liger_patch.patching.forward import STATE_ATTR, is_liger_forward
from tests.patching_helpers import class_patch, make_batch, tiny_model


def test_instance_patch_touches_only_that_instance():
    model, other = tiny_model("llama"), tiny_model("llama")
    assert lp.apply_liger_to(model) is model
    assert is_liger_forward(model.forward)
    assert not is_liger_forward(other.forward)
    assert not is_liger_forward(transformers.LlamaForCausalLM.forward)


def test_apply_is_idempotent_and_updates_options():
    model = tiny_model("llama")
    lp.apply_liger_to(model)
    first = model.forward.__func__
    lp.apply_liger_to(model, z_loss_scale=1e-3)
    assert model.forward.__func__ is first  # no wrapper stacked on the wrapper
    assert getattr(model, STATE_ATTR).z_loss_scale == 1e-3
    assert model(**make_batch()).z_loss is not None


def test_revert_restores_the_exact_original():
    model = tiny_model("llama")
    before = dict(vars(model))
    lp.apply_liger_to(model)
    lp.revert_liger(model)
    assert "forward" not in vars(model) and STATE_ATTR not in vars(model)
    assert vars(model).keys() == before.keys()
    assert model.forward.__func__ is transformers.LlamaForCausalLM.forward
    assert model(**make_batch()).logits is not None
    lp.revert_liger(model)  # reverting twice is harmless


def test_liger_patched_is_scoped():
    model = tiny_model("llama")
    with lp.liger_patched(model, z_loss_scale=1e-3) as patched:
        assert patched is model
        assert model(**make_batch()).logits is None
    assert not is_liger_forward(model.forward)
    lp.apply_liger_to(model)
    with lp.liger_patched(model, z_loss_scale=1e-2):
        assert getattr(model, STATE_ATTR).z_loss_scale == 1e-2
    assert is_liger_forward(model.forward)  # patched before the block: still patched, old options back
    assert getattr(model, STATE_ATTR).z_loss_scale == 0.0


def test_class_level_patch_covers_later_instances_and_reverts():
    original = transformers.LlamaForCausalLM.forward
    with class_patch(transformers.LlamaForCausalLM):
        model = tiny_model("llama")
        assert "forward" not in vars(model)
        out = model(**make_batch())
        assert out.logits is None
        lp.apply_liger_to(model, z_loss_scale=1e-3)  # instance options on top of a class patch
        assert model(**make_batch()).z_loss is not None
    assert transformers.LlamaForCausalLM.forward is original
    assert tiny_model("llama")(**make_batch()).logits is not None


def test_model_type_string_patches_the_class():
    original = transformers.Qwen2ForCausalLM.forward
    with class_patch("qwen2"):
        assert is_liger_forward(transformers.Qwen2ForCausalLM.forward)
        assert tiny_model("qwen2")(**make_batch()).logits is None
    assert transformers.Qwen2ForCausalLM.forward is original


def test_subclass_of_a_supported_class_uses_its_row():
    class MyLlama(transformers.LlamaForCausalLM):
        pass

    base = tiny_model("llama")
    model = MyLlama(base.config)
    model.load_state_dict(base.state_dict())
    model.to(base.lm_head.weight.device, base.lm_head.weight.dtype).train()
    lp.apply_liger_to(model)
    batch = make_batch()
    out = model(**batch)
    assert out.logits is None
    torch.testing.assert_close(out.loss, base(**batch).loss, rtol=1e-4, atol=1e-4)


def test_unknown_architecture_strict_raises_naming_class_and_fix():
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)
    )
    with pytest.raises(lp.UnsupportedModelError, match=r"GPT2LMHeadModel.*register_model"):
        lp.apply_liger_to(model)
    with pytest.warns(UserWarning, match="GPT2LMHeadModel"):
        assert lp.apply_liger_to(model, strict=False) is model
    assert not is_liger_forward(model.forward)
    with pytest.raises(lp.UnsupportedModelError, match="no_such_model"):
        lp.apply_liger_to("no_such_model")


def test_register_model_for_a_user_architecture():
    class TinyGPT2(transformers.GPT2LMHeadModel):
        pass

    spec = lp.register_model(
        TinyGPT2, lp.ModelSpec(model_type="tiny_gpt2", class_name="", body="transformer")
    )
    assert spec.class_name == "TinyGPT2"
    assert "tiny_gpt2" in lp.supported_models()
    torch.manual_seed(0)
    reference = TinyGPT2(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)).train()
    reference.config.attn_pdrop = reference.config.resid_pdrop = reference.config.embd_pdrop = 0.0
    for module in reference.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    patched = copy.deepcopy(reference)
    lp.apply_liger_to(patched)
    ids = torch.randint(0, 64, (2, 10))
    out = patched(input_ids=ids, labels=ids)
    assert out.logits is None
    torch.testing.assert_close(out.loss, reference(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-5)


def test_bad_targets_and_options():
    with pytest.raises(TypeError, match="apply_liger_to expects"):
        lp.apply_liger_to(42)
    with pytest.raises(ValueError, match="z_loss_scale"):
        lp.apply_liger_to(tiny_model("llama"), z_loss_scale=-1.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        lp.apply_liger_to(tiny_model("llama"), label_smoothing=1.5)
    with pytest.raises(TypeError, match="ModelSpec"):
        lp.register_model("x", {"body": "model"})


def test_patching_after_an_instance_level_wrapper_warns():
    model = tiny_model("llama")
    original = model.forward
    model.forward = lambda *a, **k: original(*a, **k)  # like accelerate's autocast wrapper
    with pytest.warns(UserWarning, match="already replaced"):
        lp.apply_liger_to(model)
    assert model(**make_batch()).logits is None
    lp.revert_liger(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert model(**make_batch()).logits is not None


def test_memory_budget_reaches_the_op_and_is_scoped(monkeypatch):
    """apply_liger_to(memory_budget=...) is what the fused loss gets; liger_patched restores the
    previous one; None leaves the choice to LIGER_MEMORY_BUDGET, read at call time."""
    from liger_patch.ops import fused_linear_ce

    seen = []
    real = fused_linear_ce.resolve_memory_budget

    def spy(value):
        seen.append(value)
        return real(value)

    monkeypatch.setattr(fused_linear_ce, "resolve_memory_budget", spy)
    model = tiny_model("llama")
    batch = make_batch()
    lp.apply_liger_to(model, memory_budget="lean")
    reference = model(**batch).loss
    with lp.liger_patched(model, memory_budget=4096):
        torch.testing.assert_close(model(**batch).loss, reference, rtol=1e-6, atol=1e-6)
    model(**batch)
    lp.apply_liger_to(model)
    monkeypatch.setenv("LIGER_MEMORY_BUDGET", "not a size")
    with pytest.raises(ValueError, match="LIGER_MEMORY_BUDGET"):
        model(**batch)
    assert seen == ["lean", 4096, "lean", None]


def test_bad_memory_budget_is_refused_at_apply():
    with pytest.raises(ValueError, match="memory_budget"):
        lp.apply_liger_to(tiny_model("llama"), memory_budget="huge")
    with pytest.raises(TypeError, match="memory_budget"):
        lp.LigerPatchCallback(memory_budget=1.5).on_init_end(None, None, None, model=tiny_model("llama"))
