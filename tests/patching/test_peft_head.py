"""PEFT wrappers on the output head (liger_patch/patching/adapters.py): LoRA fuses exactly as the
op's low-rank term, with PEFT's own adapters, dropout, scaling, switching and merging; the
wrappers with no exact fused form fall back with a warning that names them.

Every comparison trains a patched copy and an unpatched copy of the same PEFT model (losses, every
gradient, final weights), and checks which path ran by counting the op's calls."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import liger_patch as lp
from liger_patch.ops.cross_entropy import operator as ce_operator
from liger_patch.patching.state import patch_state
from tests.patching_helpers import assert_records_match, make_batch, tiny_model, tolerances, train_steps

peft = pytest.importorskip("peft")

# Every model here is fp32 on any device (tiny_model would make it bf16 on a GPU): the checks see
# the adapters, the dropout masks and the merges at fp32 tolerances.
TOL = tolerances(torch.float32)


@pytest.fixture
def op_calls(monkeypatch):
    """Each call of the fused op (``operator.FLCE``, the registered operator or its eager twin,
    every argument positional): whether it carried a low-rank term (the tenth), its rank."""
    calls = []
    original = ce_operator.FLCE

    def counted(*args):
        calls.append(args[9].shape[-1] if len(args) > 9 else None)
        return original(*args)

    monkeypatch.setattr(ce_operator, "FLCE", counted)
    return calls


def peft_pair(tied=False, model=None, **config):
    """An unpatched PEFT model and a patched deep copy of it (adapters initialised non-trivially)."""
    config = {"r": 3, "lora_alpha": 7, "lora_dropout": 0.0, "init_lora_weights": False, **config}
    base = model if model is not None else tiny_model("llama", dtype=torch.float32, tie_word_embeddings=tied)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's notes on tied weights
        reference = peft.get_peft_model(base, peft.LoraConfig(**config))
    patched = copy.deepcopy(reference)
    return reference, patched


def _apply_quietly(model):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fused head says nothing
        lp.apply_liger_to(model)


def _train_both(patched, reference, seed=0, **kwargs):
    """Both trained from the same random state, at a step size that stays stable (rsLoRA's larger
    scale made the default one diverge, which amplifies rounding)."""
    kwargs.setdefault("lr", 0.1)
    torch.manual_seed(seed)
    ours = train_steps(patched, **kwargs)
    torch.manual_seed(seed)
    theirs = train_steps(reference, **kwargs)
    return ours, theirs


def _head_adapter_grads(record, adapter="default"):
    return {n for n in record.grads[0] if "lm_head" in n and "lora_" in n and adapter in n}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("rslora", [False, True], ids=["lora", "rslora"])
def test_lora_on_lm_head_is_fused_and_trains_identically(op_calls, tied, rslora):
    reference, patched = peft_pair(tied, target_modules=["q_proj", "v_proj", "lm_head"], use_rslora=rslora)
    _apply_quietly(patched)
    ours, theirs = _train_both(patched, reference)
    assert_records_match(ours, theirs, TOL)
    assert all(out.logits is None for out in ours.outputs)
    assert op_calls == [3, 3, 3]  # every step fused, with the head's rank-3 term
    assert _head_adapter_grads(ours) == {
        "base_model.model.lm_head.lora_A.default.weight",
        "base_model.model.lm_head.lora_B.default.weight",
    }
    assert any("q_proj.lora_A" in n for n in ours.grads[0])  # the other layers' adapters too
    assert patch_state(patched).fused_ran


def test_lora_dropout_draws_the_same_masks(op_calls):
    """Seeded: the same random stream gives the same dropout masks as PEFT's forward (a different
    seed gives different results, so the comparison sees the masks)."""
    reference, patched = peft_pair(target_modules=["lm_head", "q_proj"], lora_dropout=0.3)
    _apply_quietly(patched)
    ours, theirs = _train_both(patched, reference, seed=5)
    assert_records_match(ours, theirs, TOL)
    assert op_calls == [3, 3, 3]
    other_seed = train_steps(copy.deepcopy(reference))
    assert not torch.allclose(other_seed.losses[0], theirs.losses[0], rtol=1e-4)


def test_base_weight_that_trains_gets_its_gradient(op_calls):
    """A trainable base weight (unusual under LoRA) gets grad_W from the op as well."""
    reference, patched = peft_pair(target_modules=["lm_head"])
    for model in (reference, patched):
        model.get_base_model().lm_head.base_layer.weight.requires_grad_(True)
    _apply_quietly(patched)
    ours, theirs = _train_both(patched, reference)
    assert_records_match(ours, theirs, TOL)
    assert "base_model.model.lm_head.base_layer.weight" in ours.grads[0]
    assert op_calls == [3, 3, 3]


def _add_second_adapter(model):
    config = peft.LoraConfig(r=2, lora_alpha=5, target_modules=["lm_head"], init_lora_weights=False)
    torch.manual_seed(7)
    model.add_adapter("second", config)


def test_several_active_adapters_switching_and_disabling(op_calls):
    reference, patched = peft_pair(target_modules=["lm_head", "q_proj"])
    for model in (reference, patched):
        _add_second_adapter(model)
    _apply_quietly(patched)
    for model in (reference, patched):
        model.base_model.set_adapter(["default", "second"])  # both active: their terms add up
    ours, theirs = _train_both(patched, reference)
    assert_records_match(ours, theirs, TOL)
    assert op_calls == [5, 5, 5] and _head_adapter_grads(ours, "second")
    op_calls.clear()
    for model in (reference, patched):
        model.set_adapter("second")  # switched: only the second one
    ours, theirs = _train_both(patched, reference)
    assert_records_match(ours, theirs, TOL)
    assert op_calls == [2, 2, 2] and not _head_adapter_grads(ours, "default")
    op_calls.clear()
    batch = make_batch()
    with patched.disable_adapter(), reference.disable_adapter():  # no term at all
        torch.testing.assert_close(patched(**batch).loss, reference(**batch).loss, rtol=1e-5, atol=1e-5)
    assert op_calls == [None]


def test_merged_adapters_add_no_second_term(op_calls):
    reference, patched = peft_pair(target_modules=["lm_head", "q_proj"])
    _apply_quietly(patched)
    batch = make_batch()
    before = reference(**batch).loss
    for model in (reference, patched):
        model.merge_adapter()
    assert patched.get_base_model().lm_head.merged
    with torch.no_grad():
        torch.testing.assert_close(patched(**batch).loss, reference(**batch).loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(patched(**batch).loss, before, rtol=1e-5, atol=1e-5)
    assert op_calls == [None, None]  # fused, on the merged base weight alone
    for model in (reference, patched):
        model.unmerge_adapter()
    ours, theirs = _train_both(patched, reference)
    assert_records_match(ours, theirs, TOL)


def test_merge_and_unload_gives_the_same_model(op_calls):
    _, patched = peft_pair(target_modules=["lm_head", "q_proj"])
    _apply_quietly(patched)
    batch = make_batch()
    with torch.no_grad():
        adapted = patched(**batch).loss
        merged = patched.merge_and_unload()
        assert isinstance(merged.lm_head, nn.Linear) and patch_state(merged) is not None
        torch.testing.assert_close(merged(**batch).loss, adapted, rtol=1e-5, atol=1e-5)
    assert op_calls == [3, None]


def _fallback(reference, patched, match):
    """The patch warns once, naming the wrapper; the original path runs and trains identically."""
    with pytest.warns(UserWarning, match=match):
        lp.apply_liger_to(patched)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, at apply time
        ours, theirs = _train_both(patched, reference)
    assert all(out.logits is not None for out in ours.outputs)
    assert_records_match(ours, theirs, TOL)


def test_dora_falls_back_naming_it(op_calls):
    _fallback(*peft_pair(target_modules=["lm_head"], use_dora=True), match="DoRA")
    assert op_calls == []


def test_lora_bias_falls_back_naming_it(op_calls):
    _fallback(*peft_pair(target_modules=["lm_head"], lora_bias=True), match="lora_bias")
    assert op_calls == []


def test_trainable_tokens_on_a_tied_head_fall_back_naming_them(op_calls):
    reference, patched = peft_pair(
        tied=True, target_modules=["q_proj"], trainable_token_indices={"embed_tokens": [3, 5]}
    )
    _fallback(reference, patched, match="trainable tokens")
    assert op_calls == []


class StandInQuantizedLinear(nn.Linear):
    """Stands in for a quantized layer (bitsandbytes, torchao): a Linear with its own forward."""

    def forward(self, x):
        return super().forward(x)


def test_lora_over_a_quantized_base_falls_back_naming_it(op_calls):
    model = tiny_model("llama", dtype=torch.float32)
    head = model.lm_head
    model.lm_head = StandInQuantizedLinear(head.in_features, head.out_features, bias=False)
    model.lm_head.weight = head.weight
    _fallback(
        *peft_pair(model=model, target_modules=["lm_head"]), match="LoRA base layer is a StandInQuantized"
    )
    assert op_calls == []


def test_prompt_tuning_is_fused(op_calls):
    base = tiny_model("llama", dtype=torch.float32)
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    reference = peft.get_peft_model(base, config)
    patched = copy.deepcopy(reference)
    _apply_quietly(patched)
    ours, theirs = _train_both(patched, reference)
    assert_records_match(ours, theirs, TOL)
    assert op_calls == [None] * 3 and any("prompt_encoder" in n for n in ours.grads[0])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_trainer_with_gradient_accumulation_and_dropout(tmp_path, op_calls, tied):
    """The HF Trainer (gradient accumulation 2, num_items_in_batch, its own seeding) trains the
    patched LoRA-headed model as it trains the unpatched one, dropout included."""
    from tests.integrations.test_trainer import run_trainer

    reference, patched = peft_pair(tied, target_modules=["lm_head", "q_proj"], lora_dropout=0.2)
    runs = []
    for model, callbacks in ((reference, []), (patched, [lp.LigerPatchCallback()])):
        # fp32 without autocast on any device (run_trainer's GPU default is bf16): fp32 tolerances
        trainer = run_trainer(model, tmp_path / str(len(runs)), callbacks=callbacks, bf16=False)
        trainer.train()
        runs.append([e["loss"] for e in trainer.state.log_history if "loss" in e])
    assert len(runs[1]) == 3 and runs[1] == pytest.approx(runs[0], rel=1e-5, abs=1e-5)
    assert op_calls == [3] * 6  # 3 optimizer steps of 2 micro-batches, all fused with the term
    for (name, p), q in zip(patched.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4, msg=name)


def test_compiled_fullgraph_lora_head_equals_eager():
    """``torch.compile(fullgraph=True)`` of the patched PEFT model: PEFT's adapter modules, the term
    and the op trace into one graph, and give eager's loss and gradients."""
    import gc

    gc.collect()
    torch._dynamo.reset()
    _, model = peft_pair(target_modules=["lm_head", "q_proj"])
    _apply_quietly(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    batch = make_batch()
    results = []
    for fn in (model, compiled):
        out = fn(**batch)
        assert out.logits is None
        out.loss.backward()
        results.append(
            (
                out.loss.detach(),
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            )
        )
        model.zero_grad(set_to_none=True)
    (eager, eager_grads), (comp, comp_grads) = results
    torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-5)
    assert comp_grads.keys() == eager_grads.keys() and any("lm_head.lora_A" in n for n in comp_grads)
    for name, g in eager_grads.items():
        torch.testing.assert_close(comp_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    torch._dynamo.reset()
