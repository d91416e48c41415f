"""``autocast_off``, ``without_grad`` and ``on_device``: the modes the ops set, only where they
change something, and exactly the modes the context managers they stand for would give. The ops
on a GPU other than the current one (a model split over GPUs) give the bits they give with
their device current."""

from __future__ import annotations

import inspect

import pytest
import torch

import liger_patch as lp
from liger_patch.ops.core import deferred_checks, early_checks
from liger_patch.ops.core.contexts import autocast_off, on_device, on_inputs_device, without_grad
from liger_patch.ops.core.tuning import Tuning
from liger_patch.ops.cross_entropy.functional import check_labels_ahead
from tests.op_helpers import TWO_GPUS, assert_same_bits, checks_taken_ahead, count_replays


def _mm_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    return (a @ b).dtype


def test_autocast_off_turns_autocast_off_inside_it_and_back_on_after():
    a = torch.randn(3, 5)
    b = torch.randn(5, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _mm_dtype(a, b) == torch.bfloat16
        with autocast_off("cpu"):
            assert not torch.is_autocast_enabled("cpu")
            assert _mm_dtype(a, b) == torch.float32
        assert torch.is_autocast_enabled("cpu")
        assert _mm_dtype(a, b) == torch.bfloat16


def test_autocast_off_outside_autocast_sets_nothing():
    assert not torch.is_autocast_enabled("cpu")
    manager = autocast_off("cpu")
    assert not isinstance(manager, torch.autocast)
    with manager:
        assert not torch.is_autocast_enabled("cpu")
    with manager:  # one instance serves every call
        assert (torch.randn(2, 3) @ torch.randn(3, 2)).dtype == torch.float32


def test_autocast_off_where_another_device_type_has_autocast_on():
    """The cast cache is the thread's, shared by every device type: with autocast switched on by
    hand for CUDA (no region, nesting 0), turning it off for the CPU must still enter and leave
    the manager, whose exit clears that cache, as ``torch.autocast`` did before."""
    torch.set_autocast_enabled("cuda", True)
    try:
        manager = autocast_off("cpu")
        assert isinstance(manager, torch.autocast)
        with manager:
            assert not torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cuda")
    finally:
        torch.set_autocast_enabled("cuda", False)


def test_autocast_off_for_a_device_type_autocast_does_not_know():
    """What ``torch.autocast`` itself does there (it refuses "meta") while autocast is on; with
    autocast off everywhere there is nothing to turn off, and nothing is refused."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError) as theirs:
            torch.autocast("meta", enabled=False)
        with pytest.raises(RuntimeError) as ours:
            autocast_off("meta")
    assert str(ours.value) == str(theirs.value)
    with autocast_off("meta"):
        pass


def test_autocast_off_compiles_without_a_graph_break():
    def scaled(x):
        with autocast_off("cpu"):
            return x @ x.t()

    compiled = torch.compile(scaled, backend="eager", fullgraph=True)
    x = torch.randn(3, 4)
    assert compiled(x).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compiled(x).dtype == torch.float32


def test_without_grad_runs_without_grad_and_restores_the_mode():
    seen = []

    @without_grad
    def body(x, *, scale):
        """Doubles."""
        seen.append(torch.is_grad_enabled())
        return x * scale

    x = torch.randn(4, requires_grad=True)
    out = body(x, scale=2.0)
    assert not out.requires_grad
    assert seen == [False]
    assert torch.is_grad_enabled()
    with torch.no_grad():
        body(x, scale=2.0)
        assert not torch.is_grad_enabled()
    assert seen == [False, False]
    assert body.__name__ == "body" and body.__doc__ == "Doubles."


def test_without_grad_under_inference_mode():
    @without_grad
    def body(x):
        return x * 2

    x = torch.randn(3, requires_grad=True)
    with torch.inference_mode():
        out = body(x)
        assert out.is_inference() and not out.requires_grad
        assert torch.is_inference_mode_enabled()


def test_without_grad_restores_the_mode_when_the_body_raises():
    @without_grad
    def fails():
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        fails()
    assert torch.is_grad_enabled()


def test_on_device_off_cuda_or_on_the_current_device_sets_nothing():
    assert on_device(torch.device("cpu")) is on_device(torch.device("meta"))  # the one do-nothing context
    if torch.cuda.is_available():
        assert on_device(torch.device("cuda", torch.cuda.current_device())) is on_device(torch.device("cpu"))
        assert on_device(torch.device("cuda")) is on_device(torch.device("cpu"))  # no index: the current one


def test_on_inputs_device_keeps_the_function_its_signature_and_results():
    seen = []

    @on_inputs_device
    def body(x: torch.Tensor, scale: float) -> torch.Tensor:
        """Scales."""
        seen.append(x.device)
        return x * scale

    x = torch.randn(3)
    torch.testing.assert_close(body(x, 2.0), x * 2.0)
    assert body(x, scale=1.0).shape == (3,) and seen == [x.device, x.device]
    torch.testing.assert_close(body(x=x, scale=3.0), x * 3.0)  # every argument by keyword
    assert body.__name__ == "body" and body.__doc__ == "Scales."
    signature = inspect.signature(body)
    assert signature.parameters["x"].annotation is torch.Tensor  # resolved, not the string
    assert signature.return_annotation is torch.Tensor


def test_on_inputs_device_takes_a_list_or_anything_else_first():
    @on_inputs_device
    def count(items, *rest):
        return len(items) if isinstance(items, list) else items

    assert count([torch.randn(2), torch.randn(3)]) == 2
    assert count([]) == 0
    assert count(5, torch.randn(2)) == 5


def test_the_operators_schemas_are_their_implementations():
    """The guarded implementations are registered with the schemas their annotations give."""
    schema = str(torch.ops.liger_patch.flce.default._schema)
    assert schema.startswith("liger_patch::flce(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels")
    assert "str options, bool[] needs" in schema
    assert str(torch.ops.liger_patch.scale_grads_.default._schema).startswith(
        "liger_patch::scale_grads_(Tensor(a0!)[] grads, Tensor scale, str backend)"
    )
    assert "Tensor student_hidden" in str(torch.ops.liger_patch.fused_distill.default._schema)
    assert "Tensor lse" in str(torch.ops.liger_patch.flce_backward.default._schema)


def _head(device, n=300, h=256, v=5003, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).to(device, torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * 0.05).to(device, torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < 0.25] = -100
    return hidden, weight, labels.to(device)


def _results(call, hidden, weight):
    """The call's value and its gradients of hidden and weight, after a sync of their device."""
    out = call()
    value = out if torch.is_tensor(out) else out[0]
    grads = torch.autograd.grad(value.sum(), (hidden, weight))
    torch.cuda.synchronize(hidden.device)
    return value.detach(), *grads


def _on_each_device_current(call, hidden, weight):
    """The results with cuda:0 current (the inputs on cuda:1), then with cuda:1 current."""
    with torch.cuda.device(0):
        other = _results(call, hidden, weight)
    with torch.cuda.device(1):
        own = _results(call, hidden, weight)
    return other, own


CALLS = {
    "mean": lambda h, w, y: lp.fused_linear_cross_entropy(h, w, y, z_loss_scale=1e-3, return_z_loss=True),
    "none": lambda h, w, y: lp.fused_linear_cross_entropy(h, w, y, reduction="none"),
    "outputs": lambda h, w, y: lp.fused_linear_cross_entropy(h, w, y, return_token_accuracy=True).loss,
    "logprobs": lambda h, w, y: lp.fused_linear_logprobs(h, w, y.clamp(min=0), return_entropy=True).logprobs,
}


@TWO_GPUS
@pytest.mark.parametrize("name", list(CALLS))
def test_an_op_on_another_gpu_than_the_current_one(name):
    """A head on cuda:1 called while cuda:0 is current: the kernels run on cuda:1, in order with
    the work that made their inputs there, and give the bits they give with cuda:1 current."""
    hidden, weight, labels = _head("cuda:1")
    call = CALLS[name]
    other, own = _on_each_device_current(lambda: call(hidden, weight, labels), hidden, weight)
    assert_same_bits(other, own)


@TWO_GPUS
def test_a_distillation_on_another_gpu_than_the_current_one():
    hidden, weight, labels = _head("cuda:1")
    teacher_hidden, teacher_weight, _ = _head("cuda:1", h=128, seed=1)

    def call():
        return lp.fused_linear_distillation(
            hidden, weight, teacher_hidden.detach(), teacher_weight.detach(), labels, beta=0.5, ce_weight=0.3
        )

    other, own = _on_each_device_current(call, hidden, weight)
    assert_same_bits(other, own)


@TWO_GPUS
def test_graphs_of_a_head_on_another_gpu_replay_its_bits(monkeypatch):
    replays = count_replays(monkeypatch)
    hidden, weight, labels = _head("cuda:1")
    tuning = Tuning(call_graphs=True)
    with torch.cuda.device(1):
        own = _results(lambda: lp.fused_linear_cross_entropy(hidden, weight, labels), hidden, weight)

    def graphed():
        return lp.fused_linear_cross_entropy(hidden, weight, labels, tuning=tuning)

    with torch.cuda.device(0):
        for _ in range(4):
            assert_same_bits(_results(graphed, hidden, weight), own)
    assert len(replays) >= 2


@TWO_GPUS
def test_a_bad_label_on_another_gpu_raises():
    hidden, weight, labels = _head("cuda:1")
    labels[7] = weight.shape[0] + 3
    with torch.cuda.device(0), pytest.raises(IndexError, match="label 5006 at flat position 7"):
        lp.fused_linear_cross_entropy(hidden, weight, labels).backward()
        torch.cuda.synchronize(1)
        deferred_checks.raise_pending()


@TWO_GPUS
def test_a_check_begun_ahead_on_another_gpu_is_taken_by_its_call(monkeypatch):
    """The label check a patched forward begins before its body, for labels on cuda:1 with cuda:0
    current: queued on cuda:1's stream (the key names that stream), taken by the call, the same
    bits as the call alone."""
    hidden, weight, labels = _head("cuda:1")
    with torch.cuda.device(1):
        alone = _results(lambda: lp.fused_linear_cross_entropy(hidden, weight, labels), hidden, weight)
    found = checks_taken_ahead(monkeypatch)
    with torch.cuda.device(0):
        key = check_labels_ahead(labels, weight.shape[0])
        assert key is not None
        got = _results(lambda: lp.fused_linear_cross_entropy(hidden, weight, labels), hidden, weight)
    assert found == [True] and not early_checks.drop(key)
    assert_same_bits(got, alone)
