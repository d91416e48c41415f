"""``GatheredBackward``: the fused op on a head that is whole only inside a gathering context, its
backward run inside that context again (a one-process ZeRO-3 stand-in, tests/integrations/fake_zero3.py)."""

from __future__ import annotations

import pytest
import torch

from liger_patch.integrations.gathered_backward import GatheredBackward
from liger_patch.ops.cross_entropy.logprobs import fused_linear_logprobs
from tests.integrations.fake_zero3 import FakeZero3, storage_holders

N, H, V = 9, 16, 37


def _inputs(rows: int = N, bias: bool = True, head_grad: bool = True):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, H, generator=gen).requires_grad_()
    weight = torch.nn.Parameter(torch.randn(V, H, generator=gen) * 0.3, requires_grad=head_grad)
    b = torch.nn.Parameter(torch.randn(V, generator=gen), requires_grad=head_grad) if bias else None
    labels = torch.randint(0, V, (rows,), generator=gen)
    labels[rows // 3 :: 4] = -100
    return hidden, weight, b, labels


def _compute(labels):
    """The fused op's log-probs and entropy (both differentiable) as TRL asks for them."""

    def compute(h, w, b):
        return tuple(fused_linear_logprobs(h, w, labels, b, return_entropy=True, backend="torch"))

    return compute


def _on_partitioned_head(hidden, weight, bias, labels):
    """The two outputs through ``GatheredBackward`` on the head partitioned by a ``FakeZero3``,
    called inside its gathering context as TRL calls its kernel."""
    fake = FakeZero3(*(t for t in (weight, bias) if t is not None))
    with fake.gather(weight, bias):
        outs = GatheredBackward.apply(_compute(labels), fake.gather, hidden, weight, bias)
    return fake, outs


def _whole(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]


def test_values_and_gradients_equal_the_op_on_the_whole_head():
    """The head is an empty partition outside the gathering; the backward gathers it once more
    (both tensors), and the values and the gradients of hidden, weight and bias equal the op's on
    whole tensors bit for bit. A hook on each head parameter sees its gradient once."""
    hidden, weight, bias, labels = _inputs()
    expected_inputs = _whole(hidden, weight, bias)
    expected = _compute(labels)(*expected_inputs)
    seen = []
    for p in (weight, bias):
        p.register_hook(lambda g, p=p: seen.append(p is weight))
    fake, outs = _on_partitioned_head(hidden, weight, bias, labels)
    assert weight.numel() == 0 and bias.numel() == 0
    for got, want in zip(outs, expected, strict=True):
        assert torch.equal(got, want.detach())
    up = torch.randn(2, N, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((outs[0] * up[0] + outs[1] * up[1]).sum(), (hidden, weight, bias))
    want = torch.autograd.grad((expected[0] * up[0] + expected[1] * up[1]).sum(), expected_inputs)
    for name, g, w in zip(("hidden", "weight", "bias"), grads, want, strict=True):
        assert torch.equal(g, w), name
    assert fake.entries == [(True, 2), (False, 2)]
    assert sorted(seen) == [False, True]


def test_nothing_holds_the_gathered_head_after_the_forward():
    """Once TRL's context exits, the forward's gathered buffers have no other holder (the op's
    saved tensors let go of them), so DeepSpeed may free or reuse them."""
    hidden, weight, bias, labels = _inputs()
    fake, outs = _on_partitioned_head(hidden, weight, bias, labels)
    assert len(fake.buffers) == 2
    assert [storage_holders(b) for b in fake.buffers] == [1, 1]
    outs[0].sum().backward(inputs=[hidden])
    assert [storage_holders(b) for b in fake.buffers] == [1] * 4
    assert torch.isfinite(hidden.grad).all()  # the forward's buffers are NaN by now


def test_a_frozen_head_trains_the_layers_below():
    """A head that does not train (frozen, or LoRA elsewhere) and has no bias: ``backward()`` runs
    through, and the hidden states get the gradient the op gives them on the whole head."""
    hidden, weight, _, labels = _inputs(bias=False, head_grad=False)
    expected_inputs = _whole(hidden, weight, None)
    fake, (logprobs, entropy) = _on_partitioned_head(hidden, weight, None, labels)
    (-logprobs.sum() + 0.1 * entropy.sum()).backward()
    want_logprobs, want_entropy = _compute(labels)(*expected_inputs)
    (-want_logprobs.sum() + 0.1 * want_entropy.sum()).backward()
    assert torch.equal(hidden.grad, expected_inputs[0].grad)
    assert weight.grad is None and fake.entries == [(True, 1), (False, 1)]


def test_no_rows_and_no_upstream_gradient_give_zero_gradients():
    """No rows (TRL's micro-batch with every label ignored, on a GPU), and an upstream that
    sends nothing back: every input that requires a gradient gets zeros of its full shape, so
    each parameter's reduce hook fires on every rank."""

    class Drop(torch.autograd.Function):
        forward = staticmethod(lambda ctx, x: x.clone())
        backward = staticmethod(lambda ctx, grad: None)

    hidden, weight, bias, labels = _inputs(rows=0)
    _, (logprobs, _) = _on_partitioned_head(hidden, weight, bias, labels)
    grads = torch.autograd.grad(logprobs.sum(), (hidden, weight, bias))
    assert [tuple(g.shape) for g in grads] == [(0, H), (V, H), (V,)]
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    hidden, weight, bias, labels = _inputs()
    _, (logprobs, _) = _on_partitioned_head(hidden, weight, bias, labels)
    grads = torch.autograd.grad(Drop.apply(logprobs).sum(), (hidden, weight, bias))
    assert [tuple(g.shape) for g in grads] == [(N, H), (V, H), (V,)]
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_a_second_backward_says_why_it_cannot_run():
    hidden, weight, bias, labels = _inputs()
    _, (logprobs, _) = _on_partitioned_head(hidden, weight, bias, labels)
    logprobs.sum().backward(retain_graph=True, inputs=[hidden])
    with pytest.raises(RuntimeError, match="second time"):
        logprobs.sum().backward(inputs=[hidden])


def test_a_head_not_gathered_in_the_backward_is_refused_with_a_reason():
    hidden, weight, bias, labels = _inputs()
    fake = FakeZero3(weight, bias)
    with fake.gather(weight, bias):
        logprobs, _ = GatheredBackward.apply(_compute(labels), lambda *_: fake.gather(), hidden, weight, bias)
    with pytest.raises(RuntimeError, match="was not gathered"):
        logprobs.sum().backward(inputs=[hidden])
