"""On CUDA the op makes at most one host synchronisation per call (the label range check), in the
forward and none in the backward: the training loop keeps running ahead of the GPU."""

import warnings

import pytest
import torch
from op_helpers import call_op, make_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _count_syncs(fn) -> int:
    """Synchronising CUDA calls made by ``fn`` (torch reports each one under sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_at_most_one_sync_in_forward_and_none_in_backward(gen, device, backend, reduction):
    case = make_case(gen, (4, 33), 64, 1000, dtype=torch.bfloat16, device=device, bias=True)
    opts = dict(backend=backend, reduction=reduction, z_loss_scale=1e-4)
    if reduction == "mean":
        opts["num_items_in_batch"] = torch.tensor(100, device=device)
    call_op(case, **opts).sum().backward()  # warm-up: kernel compilation may synchronise
    out = {}

    def forward():
        out["loss"] = call_op(case, **opts)

    assert _count_syncs(forward) <= 1
    upstream = torch.randn_like(out["loss"])
    assert _count_syncs(lambda: (out["loss"] * upstream).sum().backward()) == 0
