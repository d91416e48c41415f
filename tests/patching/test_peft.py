"""PEFT: LoRA on attention fuses; modules_to_save on lm_head fuses with the trainable copy.
(LoRA and the other wrappers on lm_head: test_peft_head.py.)"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import liger_patch as lp
from tests.patching_helpers import (
    assert_records_match,
    device_and_dtype,
    make_batch,
    tiny_model,
    tolerances,
    train_steps,
)

peft = pytest.importorskip("peft")


def lora_pair(**lora_kwargs):
    base = tiny_model("llama")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **lora_kwargs)
    reference = peft.get_peft_model(base, config)
    patched = copy.deepcopy(reference)
    return reference, patched


def test_lora_on_attention_is_fused_and_trains_identically():
    reference, patched = lora_pair(target_modules=["q_proj", "v_proj"])
    assert lp.apply_liger_to(patched) is patched  # the PeftModel comes back; its base model is patched
    assert patched(**make_batch()).logits is None
    assert_records_match(train_steps(patched), train_steps(reference), tolerances(device_and_dtype()[1]))


def test_lora_added_to_lm_head_after_patching_is_fused():
    base = tiny_model("llama", dtype=torch.float32)  # fp32 on any device: compared at 1e-5
    lp.apply_liger_to(base)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, target_modules=["lm_head"], init_lora_weights=False, lora_dropout=0.0)
    )
    reference = copy.deepcopy(model)
    lp.revert_liger(reference)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model(**make_batch())
    assert out.logits is None
    torch.testing.assert_close(out.loss, reference(**make_batch()).loss, rtol=1e-5, atol=1e-5)


def test_modules_to_save_lm_head_fuses_with_the_trainable_copy():
    reference, patched = lora_pair(target_modules=["q_proj"], modules_to_save=["lm_head"])
    lp.apply_liger_to(patched)
    head = patched.get_base_model().lm_head
    with torch.no_grad():  # make the copy differ from the frozen original, so using the wrong one shows
        for wrapper in (head, reference.get_base_model().lm_head):
            wrapper.modules_to_save["default"].weight.mul_(1.5)
    out = patched(**make_batch())
    assert out.logits is None
    record, expected = train_steps(patched), train_steps(reference)
    assert_records_match(record, expected, tolerances(device_and_dtype()[1]))
    assert any("modules_to_save" in name and "lm_head" in name for name in record.grads[0])
    assert not any("original_module" in name for name in record.grads[0])
    with patched.disable_adapter():  # adapters off: the frozen original head is what runs
        base = copy.deepcopy(patched.get_base_model())
        lp.revert_liger(base)
        batch = make_batch()
        torch.testing.assert_close(patched(**batch).loss, base(**batch).loss, rtol=1e-5, atol=1e-5)


def test_revert_on_a_peft_model():
    _, patched = lora_pair(target_modules=["q_proj"])
    lp.apply_liger_to(patched)
    lp.revert_liger(patched)
    assert patched(**make_batch()).logits is not None
