"""Routing of the fused loss for heads that a sharding wrapper owns, in one process.

DeepSpeed is not installed in CI (nor needed): a ZeRO-3 partitioned parameter is imitated by the
attributes liger_patch reads (``ds_id``, ``ds_status``) and an empty ``data`` tensor, and
DeepSpeed's gathering module hook by a forward pre-hook on the head. FSDP2 and tensor
parallelism need a process group and are covered in tests/distributed/test_training.py.
"""

from __future__ import annotations

import enum

import pytest
import torch
import torch.nn as nn

import liger_patch as lp
from liger_patch.patching.sharded_head import (
    ShardedHeadError,
    fused_head_loss,
    head_weight_is_managed,
    is_zero3_partitioned,
    zero3_unavailable,
)
from tests.patching_helpers import make_batch, tiny_model


class ZeroParamStatus(enum.Enum):  # the names DeepSpeed's enum uses
    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


def partition(param: nn.Parameter) -> torch.Tensor:
    """Make ``param`` look like a ZeRO-3 partition: empty data, NOT_AVAILABLE; returns the full data."""
    full = param.data
    param.ds_id = 0
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE
    param.data = torch.empty(0, dtype=full.dtype, device=full.device)
    return full


def gather_on_call(head: nn.Module, full: torch.Tensor) -> list[int]:
    """Imitate DeepSpeed's pre-forward module hook: the weight is gathered when the head is called."""
    calls = []

    def hook(module, args):
        module.weight.data = full
        module.weight.ds_status = ZeroParamStatus.AVAILABLE
        calls.append(1)

    head.register_forward_pre_hook(hook)
    return calls


def test_zero3_detection_reads_deepspeed_attributes():
    plain = nn.Parameter(torch.randn(4, 3))
    assert not is_zero3_partitioned(plain) and not zero3_unavailable(plain)
    param = nn.Parameter(torch.randn(4, 3))
    partition(param)
    assert is_zero3_partitioned(param) and zero3_unavailable(param)
    param.ds_status = ZeroParamStatus.AVAILABLE
    assert is_zero3_partitioned(param) and not zero3_unavailable(param)
    param.ds_status = ZeroParamStatus.INFLIGHT
    assert zero3_unavailable(param)


def test_plain_head_calls_the_op_directly(gen):
    head = nn.Linear(8, 16, bias=False)
    calls = []
    head.register_forward_hook(lambda *a: calls.append(1))
    hidden, labels = torch.randn(5, 8, generator=gen), torch.randint(0, 16, (5,), generator=gen)
    assert not head_weight_is_managed(head)
    loss = fused_head_loss(head, hidden, labels)
    torch.testing.assert_close(loss, lp.fused_linear_cross_entropy(hidden, head.weight, labels))
    assert calls == []  # no hook sees a loss where it expects logits


def test_zero3_head_is_gathered_by_its_own_call_and_matches_the_op(gen):
    head = nn.Linear(8, 16)
    reference = nn.Linear(8, 16)
    reference.load_state_dict(head.state_dict())
    full = partition(head.weight)
    calls = gather_on_call(head, full)
    assert head_weight_is_managed(head)
    hidden = torch.randn(5, 8, generator=gen, requires_grad=True)
    labels = torch.randint(0, 16, (5,), generator=gen)
    labels[1] = -100
    count = torch.tensor(7.0)  # a float num_items_in_batch reaches the op untouched
    loss = fused_head_loss(head, hidden, labels, num_items_in_batch=count)
    loss.backward()
    hidden_ref = hidden.detach().clone().requires_grad_()
    expected = lp.fused_linear_cross_entropy(
        hidden_ref, reference.weight, labels, reference.bias, num_items_in_batch=count
    )
    expected.backward()
    assert calls == [1]
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(hidden.grad, hidden_ref.grad)
    torch.testing.assert_close(head.weight.grad, reference.weight.grad)
    torch.testing.assert_close(head.bias.grad, reference.bias.grad)
    assert "forward" not in vars(head)  # the swapped forward is gone after the call


def test_ungathered_zero3_head_raises_a_clear_error_not_a_shape_error(gen):
    head = nn.Linear(8, 16, bias=False)
    partition(head.weight)  # no DeepSpeed engine: nothing gathers it
    hidden, labels = torch.randn(5, 8, generator=gen), torch.randint(0, 16, (5,), generator=gen)
    with pytest.raises(ShardedHeadError, match="DeepSpeed ZeRO-3.*deepspeed.initialize"):
        fused_head_loss(head, hidden, labels)
    assert "forward" not in vars(head)  # restored on the error path too


def test_patched_model_with_zero3_head_trains_like_unpatched():
    model = tiny_model("llama", dtype=torch.float32)
    reference = tiny_model("llama", dtype=torch.float32)
    lp.apply_liger_to(model)
    calls = gather_on_call(model.lm_head, partition(model.lm_head.weight))
    batch = make_batch(device=model.device)
    out, expected = model(**batch), reference(**batch)
    out.loss.backward()
    expected.loss.backward()
    assert out.logits is None and calls == [1]
    torch.testing.assert_close(out.loss, expected.loss, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(model.lm_head.weight.grad, reference.lm_head.weight.grad, rtol=2e-4, atol=2e-5)


def test_patched_model_with_ungathered_zero3_head_says_what_to_do():
    model = lp.apply_liger_to(tiny_model("llama", dtype=torch.float32))
    partition(model.lm_head.weight)
    with pytest.raises(ShardedHeadError, match="partitioned by DeepSpeed ZeRO-3"):
        model(**make_batch(device=model.device))


def test_instance_forward_of_the_head_is_restored(gen):
    head = nn.Linear(8, 16, bias=False)
    own = head.forward  # e.g. a wrapper that put its own forward on the instance
    head.forward = own
    full = partition(head.weight)
    gather_on_call(head, full)
    fused_head_loss(head, torch.randn(3, 8, generator=gen), torch.randint(0, 16, (3,), generator=gen))
    assert vars(head)["forward"] is own
