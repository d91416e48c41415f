"""``benchmarks/e2e.py``'s PyTorch-head variants on the CPU: the decoder run as is, then
``flce.py``'s loss on the flat hidden states, the head's weight and the shifted labels, gives HF's
own ``model(input_ids, labels=labels).loss`` and gradients (tiny random Llama, fp32, one sequence's
prompt masked as ``--ignore-frac`` masks it); a torch without the chunked op gives the reason."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def e2e(import_script):
    return import_script("e2e")


@pytest.fixture
def flce(e2e):
    import flce  # benchmarks/ is on sys.path while the e2e fixture lives

    return flce


@pytest.fixture
def model_and_batch(e2e):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).train()
    ids = torch.randint(0, TINY["vocab_size"], (2, 16))
    labels = e2e.make_labels(ids, 0.25)  # the first 4 labels of each sequence ignored
    labels[1] = ids[1]  # but for the second: a shift that wraps its first label around would count it
    return model, ids, labels


def loss_and_grads(loss_fn, model):
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("variant", ["torch_compile", "torch_linear_ce"])
def test_the_variants_head_gives_hf_loss_and_grads(e2e, flce, model_and_batch, variant, monkeypatch):
    model, ids, labels = model_and_batch
    if variant == "torch_compile":  # what flce.torch_compile compiles, through aot_eager: no C++ build
        compiled = torch.compile(flce.torch_eager, backend="aot_eager", dynamic=False)
        monkeypatch.setattr(flce, "_compiled", compiled)
    elif not hasattr(torch.nn.functional, "linear_cross_entropy"):
        pytest.skip(f"torch {torch.__version__} has no F.linear_cross_entropy")
    head = e2e.peer_head(variant)
    assert head is getattr(flce, variant)
    try:
        ours, our_grads = loss_and_grads(lambda: e2e.split_head_loss(head, model, ids, labels), model)
    finally:
        torch._dynamo.reset()
    hf, hf_grads = loss_and_grads(lambda: model(input_ids=ids, labels=labels).loss, model)
    torch.testing.assert_close(ours, hf, rtol=1e-6, atol=1e-6)
    for name, grad in hf_grads.items():
        torch.testing.assert_close(
            our_grads[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_the_existing_variants_keep_the_models_own_forward(e2e):
    assert [e2e.peer_head(v) for v in e2e.VARIANTS] == [None] * len(e2e.VARIANTS)


def test_without_the_chunked_op_the_run_fails_with_the_reason(e2e, model_and_batch, monkeypatch):
    model, ids, labels = model_and_batch
    monkeypatch.delattr(torch.nn.functional, "linear_cross_entropy", raising=False)
    monkeypatch.delenv("TORCH_LCE_SOURCE", raising=False)
    reason = "has no F.linear_cross_entropy .* TORCH_LCE_SOURCE is unset"
    with pytest.raises(NotImplementedError, match=reason):
        e2e.split_head_loss(e2e.peer_head("torch_linear_ce"), model, ids, labels)
