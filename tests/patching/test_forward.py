"""The generic forward's call handling: the paths it picks and the HF arguments it honours."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

import liger_patch as lp
from tests.op_helpers import TWO_GPUS, raises_by_step
from tests.patching_helpers import available_model_types, device_and_dtype, make_batch, tiny_model

TOL = 1e-5 if device_and_dtype()[1] == torch.float32 else 2e-2


def close(a, b, tol=TOL):
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.fixture
def pair():
    """(unpatched, patched) copies of one tiny Llama."""
    reference = tiny_model("llama")
    patched = copy.deepcopy(reference)
    lp.apply_liger_to(patched)
    return reference, patched


def test_signature_is_kept(pair):
    reference, patched = pair
    assert inspect.signature(patched.forward) == inspect.signature(reference.forward)
    kinds = [p.kind for p in inspect.signature(patched.forward).parameters.values()]
    assert inspect.Parameter.VAR_KEYWORD in kinds  # the Trainer passes num_items_in_batch only then


@pytest.mark.parametrize(
    "num_items", [7, torch.tensor(7), torch.tensor(7.0), torch.tensor(7, dtype=torch.int32)], ids=str
)
def test_num_items_in_batch_forms(pair, num_items):
    reference, patched = pair
    batch = make_batch()
    close(
        patched(**batch, num_items_in_batch=num_items).loss,
        reference(**batch, num_items_in_batch=num_items).loss,
    )


def test_shift_labels_are_used_as_given(pair):
    reference, patched = pair
    batch = make_batch()
    shift_labels = torch.roll(batch["labels"], -2, dims=1)
    expected = reference(**batch, shift_labels=shift_labels).loss
    close(patched(**batch, shift_labels=shift_labels).loss, expected)


def test_logits_to_keep_with_matching_shift_labels(pair):
    reference, patched = pair
    batch = make_batch()
    shift_labels = batch["labels"][:, -4:].contiguous()
    expected = reference(**batch, logits_to_keep=4, shift_labels=shift_labels).loss
    close(patched(**batch, logits_to_keep=4, shift_labels=shift_labels).loss, expected)


def assert_same_values(a, b, where="output"):
    """Tensors close, tuples/lists slot for slot, anything else (a cache) of the same type."""
    if torch.is_tensor(b):
        assert torch.is_tensor(a), f"{where}: {type(a).__name__} where the original has a tensor"
        close(a, b)
    elif isinstance(b, (tuple, list)):
        assert isinstance(a, (tuple, list)) and len(a) == len(b), f"{where}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_values(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"


RETURN_DICT_CALLS = {
    "defaults": {},
    "no-cache": {"use_cache": False},
    "hidden-states": {"output_hidden_states": True},
    "no-router-logits": {"output_router_logits": False},  # MoE only: no aux_loss / router_logits slots
}
RETURN_DICT_CASES = [
    pytest.param(model_type, kwargs, id=f"{model_type}-{name}")
    for model_type in ("llama", "qwen2_moe", "mixtral")
    if model_type in available_model_types()
    for name, kwargs in RETURN_DICT_CALLS.items()
    if "output_router_logits" not in kwargs or model_type != "llama"
]


@pytest.mark.parametrize("return_logits", [False, True], ids=["fused", "return-logits"])
@pytest.mark.parametrize(("model_type", "kwargs"), RETURN_DICT_CASES)
def test_return_dict_false_tuple_matches_the_original_slot_for_slot(
    model_type, kwargs, return_logits, monkeypatch
):
    """Same length and order as the unpatched tuple for the same call; the logits slot holds
    None (fused) or the real logits (LIGER_RETURN_LOGITS=1), never the next field."""
    reference = tiny_model(model_type, seed=1)
    patched = copy.deepcopy(reference)
    lp.apply_liger_to(patched)
    monkeypatch.setenv("LIGER_RETURN_LOGITS", "1" if return_logits else "0")
    batch = make_batch(seed=4)
    expected = reference(**batch, return_dict=False, **kwargs)
    logits_slot = list(reference(**batch, **kwargs).keys()).index("logits")
    out = patched(**batch, return_dict=False, **kwargs)

    assert isinstance(out, tuple) and len(out) == len(expected), (
        f"{len(out)} slots {[type(v).__name__ for v in out]}, the original has {len(expected)}"
    )
    for slot, (value, original) in enumerate(zip(out, expected, strict=True)):
        if slot == logits_slot and not return_logits:
            assert value is None, f"slot {slot} (logits) must be None in the fused path"
        else:
            assert_same_values(value, original, f"slot {slot}")


def test_positional_arguments(pair):
    reference, patched = pair
    batch = make_batch()
    out = patched(batch["input_ids"], batch["attention_mask"], labels=batch["labels"])
    assert out.logits is None
    close(out.loss, reference(**batch).loss)


def test_eval_mode_runs_the_original(pair):
    reference, patched = pair
    reference.eval(), patched.eval()
    batch = make_batch()
    with torch.no_grad():
        out, ref = patched(**batch), reference(**batch)
    assert out.logits is not None
    close(out.logits, ref.logits)
    close(out.loss, ref.loss)


def test_no_labels_in_training_returns_logits(pair):
    reference, patched = pair
    batch = make_batch()
    del batch["labels"]
    out = patched(**batch)
    assert out.loss is None
    close(out.logits, reference(**batch).logits)


def test_skip_logits_flag(pair):
    reference, patched = pair
    batch = make_batch()
    patched.eval()
    out = patched(**batch, skip_logits=True)  # HF Trainer's prediction step with use_liger_kernel
    assert out.logits is None
    close(out.loss, reference(**batch).loss)
    patched.train()
    out = patched(**batch, skip_logits=False)
    assert out.logits is not None
    with pytest.raises(ValueError, match="skip_logits=True needs labels"):
        patched(input_ids=batch["input_ids"], skip_logits=True)


def test_return_logits_env_flag_gives_real_logits_and_same_loss(pair, monkeypatch):
    reference, patched = pair
    batch = make_batch()
    fused = patched(**batch).loss
    monkeypatch.setenv("LIGER_RETURN_LOGITS", "1")
    out = patched(**batch)
    ref = reference(**batch)
    assert out.logits is not None
    close(out.logits, ref.logits)
    close(out.loss, fused, tol=0)  # the very same fused loss
    close(out.loss, ref.loss)
    monkeypatch.setenv("LIGER_RETURN_LOGITS", "0")  # read on every call
    assert patched(**batch).logits is None


@pytest.mark.parametrize("model_type", ["gemma2", "granite", "cohere", "phi"])
def test_return_logits_env_flag_reproduces_head_math(model_type, monkeypatch):
    reference = tiny_model(model_type)
    patched = copy.deepcopy(reference)
    lp.apply_liger_to(patched)
    monkeypatch.setenv("LIGER_RETURN_LOGITS", "1")
    batch = make_batch()
    out, ref = patched(**batch), reference(**batch)
    close(out.logits, ref.logits)
    close(out.loss, ref.loss)


def test_all_ignored_batch_gives_zero_loss_and_zero_grads(pair):
    _, patched = pair
    batch = make_batch()
    batch["labels"].fill_(-100)
    out = patched(**batch)
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert patched.lm_head.weight.grad is not None
    assert torch.count_nonzero(patched.lm_head.weight.grad) == 0


@TWO_GPUS
def test_a_model_split_over_two_gpus(pair):
    """``device_map`` style: the body's first layer on cuda:0, the rest and the head on cuda:1,
    cuda:0 current (as accelerate leaves it). The patched head runs on cuda:1 and the loss and
    every gradient match the unpatched split model's."""
    from accelerate import dispatch_model

    split = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0}
    split |= {"model.layers.1": 1, "model.norm": 1, "lm_head": 1}
    reference, patched = (dispatch_model(m, device_map=split) for m in pair)
    batch = {k: v.to("cuda:0") for k, v in make_batch().items()}
    torch.cuda.set_device(0)
    losses = []
    for model in (reference, patched):
        out = model(**batch)
        out.loss.backward()
        losses.append(out.loss)
    assert losses[1].device == torch.device("cuda", 1)
    close(losses[1], losses[0])
    for (name, a), (_, b) in zip(reference.named_parameters(), patched.named_parameters(), strict=True):
        ratio = ((a.grad.float() - b.grad.float()).norm() / a.grad.float().norm()).item()
        assert ratio < 8e-2, name


def test_generate_is_unchanged(pair):
    reference, patched = pair
    prompt = make_batch()["input_ids"][:1, :5]
    for model in (reference, patched):
        model.eval()
        model.generation_config.pad_token_id = 0
    kwargs = dict(max_new_tokens=5, do_sample=False)
    assert torch.equal(patched.generate(prompt, **kwargs), reference.generate(prompt, **kwargs))
    patched.train(), reference.train()  # generate in train mode has no labels: original path too
    assert torch.equal(patched.generate(prompt, **kwargs), reference.generate(prompt, **kwargs))


def test_z_loss_attribute(pair):
    _, patched = pair
    batch = make_batch()
    assert patched(**batch).z_loss is None
    lp.apply_liger_to(patched, z_loss_scale=1e-3)
    out = patched(**batch)
    assert out.z_loss is not None and out.z_loss.item() > 0
    assert "z_loss" not in out  # an attribute: tuples and the Trainer's logits stay as HF's


def test_labels_that_do_not_cover_the_positions_are_rejected(pair):
    _, patched = pair
    batch = make_batch()
    with pytest.raises(ValueError, match="labels"):
        patched(**batch, logits_to_keep=4)  # 4 kept positions, 12 labels


def test_bad_labels_are_rejected(pair):
    _, patched = pair
    batch = make_batch()
    batch["labels"] = batch["labels"].float()
    with pytest.raises((TypeError, ValueError)):
        patched(**batch)
    batch = make_batch()
    batch["labels"][0, 5] = 10_000  # outside the vocabulary
    with raises_by_step((IndexError, ValueError)):
        patched(**batch)


@pytest.mark.parametrize("model_type", ["gemma2", "granite", "cohere", "phi"])
def test_return_logits_are_bit_identical_to_the_original_head(model_type, monkeypatch):
    """The recorded head math is replayed on ``head(hidden)`` in the model's own op order."""
    reference = tiny_model(model_type)
    patched = copy.deepcopy(reference)
    lp.apply_liger_to(patched)
    monkeypatch.setenv("LIGER_RETURN_LOGITS", "1")
    batch = make_batch()
    assert torch.equal(patched(**batch).logits, reference(**batch).logits)


def test_a_forward_reading_its_heads_attributes_fuses_and_matches():
    """transformers 5.24's Apertus passes ``self.lm_head.out_features`` as the vocabulary size;
    remote code reads a head's parameters, class and other fields too. Patched, every such read
    answers as the head does and the step equals the unpatched one, through the fused path."""
    from tests.patching.custom_model import TinyMlpConfig, TinyMlpForCausalLM

    class HeadReadingLM(TinyMlpForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
            head = self.lm_head
            assert isinstance(head, torch.nn.Linear) and head.in_features == self.config.hidden_size
            assert getattr(head, "missing_field", "default") == "default"
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            hidden = hidden.to(next(head.parameters()).dtype)
            logits = head(hidden) * self.config.logit_scale
            loss = self.loss_function(logits, labels, vocab_size=head.out_features, **kwargs)
            return CausalLMOutput(loss=loss, logits=logits)

    from transformers.modeling_outputs import CausalLMOutput

    torch.manual_seed(0)
    reference = HeadReadingLM(TinyMlpConfig(vocab_size=97, hidden_size=24, num_hidden_layers=2)).train()
    patched = lp.apply_liger_to(copy.deepcopy(reference))
    batch = make_batch(device="cpu")
    batch["input_ids"] = batch["input_ids"] % 97
    batch["labels"] = torch.where(batch["labels"] >= 0, batch["labels"] % 97, batch["labels"])
    expected, got = reference(**batch), patched(**batch)
    expected.loss.backward()
    got.loss.backward()
    assert got.logits is None and lp.patching.state.patch_state(patched).fused_ran
    close(got.loss, expected.loss)
    for a, b in zip(patched.parameters(), reference.parameters(), strict=True):
        close(a.grad, b.grad)


def test_a_degenerate_head_constant_runs_the_original_path():
    """A forward dividing its logits by 0 (or scaling them by NaN) runs unpatched as it would
    without the patch, with the refusal said once: never a crash because it is patched."""
    from tests.patching.custom_model import TinyMlpConfig, TinyMlpForCausalLM

    torch.manual_seed(0)
    config = TinyMlpConfig(vocab_size=97, hidden_size=24, num_hidden_layers=2, logit_scale=float("nan"))
    reference = TinyMlpForCausalLM(config).train()
    patched = lp.apply_liger_to(copy.deepcopy(reference))
    batch = make_batch(device="cpu")
    batch["input_ids"] = batch["input_ids"] % 97
    batch["labels"] = torch.where(batch["labels"] >= 0, batch["labels"] % 97, batch["labels"])
    with pytest.warns(UserWarning, match="by nan"):
        got = patched(**batch)
    expected = reference(**batch)
    assert got.logits is not None and torch.isnan(got.loss) and torch.isnan(expected.loss)
