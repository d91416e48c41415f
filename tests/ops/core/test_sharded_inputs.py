"""Sharded parameters handed straight to the op get a clear error, not a shape error deep in a
GEMM: a DTensor (FSDP2 shard or tensor-parallel weight) and an ungathered DeepSpeed ZeRO-3
partition. (The patched model gathers them; tests/distributed/ covers that.)"""

import pytest
import torch

import liger_patch as lp


class _FakeDTensor(torch.Tensor):
    """Stands in for torch.distributed.tensor.DTensor: what the op looks at is its interface."""

    placements = ("Shard(dim=0)",)

    def to_local(self):
        return torch.Tensor._make_subclass(torch.Tensor, self)


def test_dtensor_weight_is_named(gen):
    hidden = torch.randn(4, 8, generator=gen)
    weight = torch.Tensor._make_subclass(_FakeDTensor, torch.randn(16, 8, generator=gen))
    with pytest.raises(TypeError, match="weight is a DTensor.*full_tensor"):
        lp.fused_linear_cross_entropy(hidden, weight, torch.randint(0, 16, (4,), generator=gen))


def test_ungathered_zero3_partition_is_named(gen):
    hidden = torch.randn(4, 8, generator=gen)
    weight = torch.nn.Parameter(torch.empty(0, 8))
    weight.ds_status = "ZeroParamStatus.NOT_AVAILABLE"
    with pytest.raises(ValueError, match="ZeRO-3.*GatheredParameters"):
        lp.fused_linear_cross_entropy(hidden, weight, torch.randint(0, 16, (4,), generator=gen))
