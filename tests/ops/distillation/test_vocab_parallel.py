"""The vocabulary-parallel distillation op (liger_patch/ops/distillation/vocab_parallel.py) on 2
gloo ranks against ``fused_linear_distillation`` on the whole heads: the loss and the student's
gradients (hidden, and each rank's rows of the weight and bias).

One launch (tests/ops/distillation/vocab_parallel_workers.py, 2 CPU processes) runs every case;
the tests below check its results. V = 1001 is split 501/500 (``torch.chunk``, as a DTensor
``Shard(0)``), labels sit on both sides of the shard boundary (the cross-entropy term's target
logit lives on one rank), and the heads are scaled so that the logits spread. The cases: every
beta (0, 1, between), temperatures, ``ce_weight``, both sides' softcaps and logit scales with
biases, each reduction, ``num_items_in_batch``, another ``ignore_index``, nothing kept, an empty
batch, several token chunks, a rank without rows (V = 1), partial gradients, inference-mode teacher
tensors, bf16 and autocast. Bad inputs raise on every rank and the group keeps working.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import run_workers
from tests.ops.distillation.vocab_parallel_workers import CASES

# The sharded and whole ops differ in the order of fp32 sums only (a row's log-sum-exp over shards,
# then ranks): the last bit of a log-sum-exp shifts every log-prob, which the gradients' cancelling
# terms amplify (seen: up to 1.2e-5 of the largest value, mostly below 3e-6; bf16 5.4e-3). A wrong
# row sum or a missing all-reduce is 1e-2 or worse.
TOL = {torch.float32: dict(rtol=5e-5, atol=2e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-3)}


# Its module-scoped fixture (processes launched, or a sweep) runs once per pytest-xdist worker
# that gets one of its tests: under `-n N --dist loadgroup` they all go to one worker.
pytestmark = pytest.mark.xdist_group(__name__)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("distillation_vocab_parallel")
    run_workers("tests.ops.distillation.vocab_parallel_workers", ["--out", str(out)], out, timeout=240)
    return torch.load(out / "results.pt", weights_only=False)


def _tol(name: str) -> dict:
    bf16 = CASES[name].get("dtype") == torch.bfloat16 or CASES[name].get("autocast")
    return TOL[torch.bfloat16 if bf16 else torch.float32]


def _close(what: str, got, expected, tol: dict) -> None:
    scale = expected.abs().max().item() if expected.numel() else 0.0
    atol = tol["atol"] + tol["rtol"] * scale  # relative to the tensor's largest value
    torch.testing.assert_close(got, expected, rtol=tol["rtol"], atol=atol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_gradients_equal_the_whole_op(results, name):
    for rank, result in enumerate(results):
        case = result["cases"][name]
        sharded, whole = case["sharded"], case["whole"]
        _close(f"{name} rank {rank}: loss", sharded["loss"], whole["loss"], _tol(name))
        for tensor, grad in sharded["grads"].items():
            expected = whole["grads"][tensor]
            if expected is None:
                assert grad is None, f"{name}: {tensor} got a gradient it did not ask for"
                continue
            assert grad.dtype == expected.dtype and grad.shape == expected.shape, (name, tensor)
            _close(f"{name} rank {rank}: grad {tensor}", grad, expected, _tol(name))


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_gets_the_same_loss_and_hidden_gradient(results, name):
    first, *others = (r["cases"][name]["sharded"] for r in results)
    for other in others:
        assert torch.equal(first["loss"], other["loss"]), name
        h0, h1 = first["grads"]["hidden"], other["grads"]["hidden"]
        assert (h0 is None and h1 is None) or torch.equal(h0, h1), name


def test_the_cases_test_what_they_say(results):
    """The heads' logits spread (a near-uniform softmax would make every divergence ~0), a
    rank of ``empty_shard`` holds no row, and nothing kept gives exact zeros."""
    assert results[0]["cases"]["jsd"]["whole"]["loss"] > 0.1
    assert [r["cases"]["empty_shard"]["rows"] for r in results] == [1, 0]
    for name in ("all_ignored", "empty_batch"):
        for result in results:
            sharded = result["cases"][name]["sharded"]
            assert torch.equal(sharded["loss"], torch.zeros_like(sharded["loss"])), name
            assert all(torch.equal(g, torch.zeros_like(g)) for g in sharded["grads"].values()), name


def test_refused_inputs_raise_on_every_rank_and_the_group_keeps_working(results):
    for result in results:
        errors = result["errors"]
        assert errors["rows_mismatch"].startswith("ValueError") and "same rows" in errors["rows_mismatch"]
        assert errors["bad_label_one_rank"].startswith("IndexError"), errors
        assert (
            errors["second_backward"].startswith("RuntimeError")
            and "reduction='none'" in errors["second_backward"]
        ), errors
        assert errors["then_works"] > 0
        assert errors["gradient_walks"] == [1, 0], errors["gradient_walks"]  # none under no_grad
        kept_mismatch = errors["kept_mismatch"]
        assert kept_mismatch.startswith("ValueError") and "different tokens" in kept_mismatch
        assert errors["logits_dtype"].startswith("ValueError") and "logits_dtype" in errors["logits_dtype"]
