"""The patched forward's extra outputs (token accuracy, entropy, predicted tokens) and TRL's
per-call keywords, against what the unpatched model's logits give."""

from __future__ import annotations

import copy

import pytest
import torch

import liger_patch as lp
from tests.patching_helpers import device_and_dtype, make_batch, tiny_model

TOL = 1e-5 if device_and_dtype()[1] == torch.float32 else 2e-2


def close(a, b, tol=TOL):
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.fixture
def pair():
    reference = tiny_model("gemma2")  # a softcap: the outputs are of the capped logits
    patched = copy.deepcopy(reference)
    lp.apply_liger_to(patched)
    return reference, patched


def _shifted(model, batch):
    """The unpatched model's logits and labels, shifted as its causal-LM loss shifts them."""
    logits = model(**batch).logits.float()[:, :-1].reshape(-1, model.config.vocab_size)
    labels = batch["labels"][:, 1:].reshape(-1)
    return logits, labels


def test_per_call_keywords_give_accuracy_and_entropy_of_the_real_logits(pair):
    reference, patched = pair
    batch = make_batch(seed=3)
    logits, labels = _shifted(reference, batch)
    keep = labels != -100
    p = logits.softmax(-1)
    entropy = -(p * logits.log_softmax(-1)).sum(-1)[keep].mean()
    accuracy = (logits.argmax(-1) == labels)[keep].float().mean()

    out = patched(**batch, return_token_accuracy=True, return_entropy=True, return_predicted_tokens=True)
    assert out.logits is None
    close(out.token_accuracy, accuracy)
    close(out.entropy, entropy)
    # one per position (flat); the last position of each row predicts nothing: -1
    predicted = out.predicted_tokens.reshape(batch["labels"].shape)
    assert (predicted[:, -1] == -1).all()
    assert torch.equal(predicted[:, :-1].reshape(-1), torch.where(keep, logits.argmax(-1), -1))
    out.entropy.backward()  # differentiable: an entropy bonus
    assert all(p.grad is not None for p in patched.parameters() if p.requires_grad)


def test_outputs_are_attributes_that_default_to_none(pair):
    _, patched = pair
    out = patched(**make_batch())
    assert out.token_accuracy is None and out.entropy is None and out.predicted_tokens is None
    assert "token_accuracy" not in out and len(out.to_tuple()) == len(out.keys())


def test_apply_option_turns_outputs_on_for_every_call():
    model = tiny_model("llama")
    lp.apply_liger_to(model, return_token_accuracy=True, return_entropy=True)
    out = model(**make_batch())
    assert out.token_accuracy is not None and out.entropy is not None and out.z_loss is None


def test_token_scaling_keyword_is_trl_dft(pair):
    reference, patched = pair
    batch = make_batch(seed=4)
    logits, labels = _shifted(reference, batch)
    keep = labels != -100
    logp = logits.log_softmax(-1).gather(-1, torch.where(keep, labels, 0)[:, None]).squeeze(-1)
    dft = (-(logp.exp().detach() * logp) * keep).sum() / keep.sum()  # TRL's dft_loss
    close(patched(**batch, use_token_scaling=True).loss, dft)
    close(patched(**batch).loss, reference(**batch).loss)  # a per-call keyword is for that call only


def test_keywords_never_reach_the_model_body(pair):
    """TRL's keywords are taken out of the call, on the fused path and the original path alike."""
    _, patched = pair
    seen = []
    hook = patched.model.register_forward_pre_hook(lambda m, a, kw: seen.append(set(kw)), with_kwargs=True)
    try:
        kwargs = dict(return_token_accuracy=True, use_token_scaling=False, skip_logits=True)
        patched(**make_batch(), **kwargs)
        patched.eval()
        patched(**make_batch(), return_token_accuracy=True, use_token_scaling=False)
    finally:
        hook.remove()
    assert len(seen) == 2 and not any(names & set(kwargs) for names in seen)


def test_call_flags_are_the_on_off_options_the_forward_leaves_to_the_call():
    """A patched model takes TRL's and liger-kernel's per-call keywords (derived from the
    options' types, minus what the forward sets itself)."""
    from liger_patch.patching.forward import CALL_FLAGS

    assert CALL_FLAGS == (
        "return_token_accuracy",
        "return_predicted_tokens",
        "return_entropy",
        "use_token_scaling",
    )
