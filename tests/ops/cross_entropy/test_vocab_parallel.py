"""The vocabulary-parallel op (liger_patch/ops/cross_entropy/vocab_parallel.py) on 2 gloo ranks against the
unsharded op and the fp64 reference: the loss, every optional output and every gradient (hidden,
the weight shards and bias shards assembled).

One launch (tests/ops/cross_entropy/vocab_parallel_workers.py, 2 CPU processes) runs every case; the tests
below check its results. V = 1001 is split 501/500 (``torch.chunk``, as a DTensor ``Shard(0)``)
and labels sit on both sides of the shard boundary. The cases are the op tests' own
``OPTION_CASES`` (tests/op_helpers.py: every loss-math and output option of ``LossOptions``, class
weights, every reduction, ``num_items_in_batch``, ignore_index values, alone and combined; a test
in tests/ops/cross_entropy/test_parity.py keeps them complete) and what is particular to a sharded vocabulary:
a batch with every label ignored, an empty batch, labels all in one shard, argmax ties across
shards, an empty shard (V = 1), several token chunks with the two-pass backward, bf16, autocast,
partial gradients, a second backward and both backends. Bad labels and ranks that disagree raise
on every rank, and the group keeps working.
"""

from __future__ import annotations

import pytest
import torch
from op_helpers import TOL, assert_close, near_max, top2_gap

from tests.distributed.launch import run_workers
from tests.ops.cross_entropy.vocab_parallel_workers import CASES

GAP_EPS = {torch.float32: 1e-5, torch.bfloat16: 2.0**-6}
# The sharded and unsharded ops differ only in the order of the final fp32 sums over ranks:
# a few ulps in fp32; in bf16 the gradients are rounded once to bf16 by each.
VS_UNSHARDED = {torch.float32: 5e-6, torch.bfloat16: 1e-2}


# The ranks run on CPU (gloo) on any machine, so their Triton cases need Triton's interpreter,
# which tests/conftest.py turns on only where there is no GPU (CI). A GPU machine runs the Triton
# kernels natively in every other test and leaves these out: its image's interpreter (triton 3.6
# with NumPy 2.5) fails on the row kernel ("only 0-dimensional arrays can be converted to Python
# scalars").
TRITON_CASES = [name for name, case in CASES.items() if case.get("backend") == "triton"]
RUN_CASES = [n for n in CASES if n not in TRITON_CASES] if torch.cuda.is_available() else list(CASES)


# Its module-scoped fixture (processes launched, or a sweep) runs once per pytest-xdist worker
# that gets one of its tests: under `-n N --dist loadgroup` they all go to one worker.
pytestmark = pytest.mark.xdist_group(__name__)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vocab_parallel")
    args = ["--out", str(out), *RUN_CASES]
    run_workers("tests.ops.cross_entropy.vocab_parallel_workers", args, out, timeout=240)
    return torch.load(out / "results.pt", weights_only=False)


def _case_result(results: dict, name: str) -> dict:
    if name not in RUN_CASES:
        pytest.skip("a Triton case on CPU ranks: run where there is no GPU (CI), see TRITON_CASES")
    return results["cases"][name]


def _dtype(name: str, result: dict) -> torch.dtype:
    return torch.bfloat16 if CASES[name].get("autocast") else result["dtype"]


def _check_predictions(name: str, result: dict, predicted: torch.Tensor) -> None:
    """Predicted tokens: -1 at ignored tokens; elsewhere a near-maximum of the fp64 logits, and
    the reference's argmax wherever the top-2 gap is wider than the rounding."""
    labels = result["labels"].reshape(-1)
    keep = labels != result["ignore_index"]
    predicted = predicted.reshape(-1)
    assert (predicted[~keep] == -1).all()
    logits = result["reference"]["logits"][keep]
    if not keep.any():
        return
    gap_tol = GAP_EPS[_dtype(name, result)] * logits.abs().amax(dim=-1).clamp_min(1.0)
    assert near_max(logits, predicted[keep], gap_tol).all(), f"{name}: a predicted token is not a maximum"
    clear = top2_gap(logits) > gap_tol
    expected = result["reference"]["outputs"]["predicted_tokens"].reshape(-1)[keep]
    assert torch.equal(predicted[keep][clear], expected[clear])


@pytest.mark.parametrize("name", list(CASES))
def test_outputs_equal_unsharded_op_and_reference(results, name):
    result = _case_result(results, name)
    dtype = _dtype(name, result)
    sharded = result["ranks"][0]["outputs"]
    unsharded = result["unsharded"]["outputs"]
    reference = result["reference"]["outputs"]
    assert sharded.keys() == unsharded.keys()
    for key, value in sharded.items():
        if key == "predicted_tokens":
            assert torch.equal(value, unsharded[key]), f"{name}: predictions differ from the unsharded op"
            _check_predictions(name, result, value)
            continue
        assert value.dtype == unsharded[key].dtype and value.shape == unsharded[key].shape
        assert_close(f"{name}: {key} vs unsharded", value, unsharded[key], VS_UNSHARDED[dtype], floor=1e-6)
        if key == "token_accuracy" and dtype != torch.float32:
            continue  # a near-tie may flip under bf16 rounding (checked through the predictions)
        assert_close(f"{name}: {key} vs fp64", value, reference[key], TOL[dtype], floor=1e-6)


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_equal_unsharded_op_and_reference(results, name):
    result = _case_result(results, name)
    dtype = _dtype(name, result)
    for tensor in ("hidden", "weight", "bias"):
        grad = result["sharded_grads"][tensor]
        expected = result["unsharded"]["grads"][tensor]
        if expected is None:
            assert grad is None, f"{name}: {tensor} got a gradient it did not ask for"
            continue
        assert grad is not None, f"{name}: no gradient for {tensor}"
        assert grad.dtype == expected.dtype and grad.shape == expected.shape
        assert_close(f"{name}: grad {tensor} vs unsharded", grad, expected, VS_UNSHARDED[dtype], floor=1e-7)
        assert_close(f"{name}: grad {tensor} vs fp64", grad, result["reference"]["grads"][tensor], TOL[dtype])


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_gets_the_same_loss_outputs_and_hidden_gradient(results, name):
    ranks = _case_result(results, name)["ranks"]
    for other in ranks[1:]:
        for key, value in ranks[0]["outputs"].items():
            assert torch.equal(value, other["outputs"][key]), f"{name}: {key} differs between ranks"
        h0, h1 = ranks[0]["grads"]["hidden"], other["grads"]["hidden"]
        same = (h0 is None and h1 is None) or torch.equal(h0, h1)
        assert same, f"{name}: grad hidden differs between ranks"


@pytest.mark.parametrize("name", ["all_ignored", "all_ignored_sum", "empty_batch"])
def test_nothing_kept_gives_exact_zeros(results, name):
    result = _case_result(results, name)
    outputs = result["ranks"][0]["outputs"]
    for key in ("loss", "z_loss", "token_accuracy", "entropy"):
        if key in outputs:
            zero = torch.zeros_like(outputs[key])
            assert torch.equal(outputs[key], zero), f"{name}: {key} is not exactly 0"
    for tensor, grad in result["sharded_grads"].items():
        if grad is not None:
            assert torch.equal(grad, torch.zeros_like(grad)), f"{name}: grad {tensor} is not exactly 0"


def test_ties_across_shards_predict_the_first_column(results):
    """Columns 100 (rank 0) and 600 (rank 1) are equal and the largest: torch.argmax's first one."""
    result = results["cases"]["ties_across_shards"]
    predicted = result["ranks"][0]["outputs"]["predicted_tokens"].reshape(-1)
    keep = result["labels"].reshape(-1) != result["ignore_index"]
    tops = result["reference"]["logits"][keep].argmax(dim=-1)
    assert (tops == 100).sum() >= 5, "the case has too few tied maxima to test anything"
    assert (predicted[keep][tops == 100] == 100).all()


def test_empty_shard_case_really_had_an_empty_shard(results):
    """V = 1 over 2 ranks: rank 1 holds no row, yet gets the loss and the hidden gradient."""
    ranks = results["cases"]["empty_shard"]["ranks"]
    assert ranks[1]["grads"]["weight"].shape == (0, 16) and ranks[1]["grads"]["bias"].shape == (0,)
    assert ranks[0]["grads"]["weight"].shape == (1, 16)


@pytest.mark.parametrize("name", ["label_is_V", "label_above_V", "negative_label"])
def test_bad_label_raises_index_error_on_every_rank(results, name):
    for kind, message in results["errors"][name]:
        assert kind == "IndexError" and "outside [0, 1001)" in message and "flat position 6" in message


def test_bad_label_on_one_rank_raises_on_every_rank(results):
    (kind0, message0), (kind1, message1) = results["errors"]["bad_label_on_rank_0_only"]
    assert kind0 == "IndexError" and "label 1001 at flat position 3" in message0
    assert kind1 == "IndexError" and "another rank" in message1


@pytest.mark.parametrize("name", ["different_labels", "different_token_counts"])
def test_ranks_with_different_tokens_raise_on_every_rank(results, name):
    for kind, message in results["errors"][name]:
        assert kind == "ValueError" and "same tokens" in message


def test_bad_num_items_on_one_rank_raises_on_every_rank(results):
    (kind0, message0), (kind1, message1) = results["errors"]["bad_num_items_on_rank_1"]
    assert kind0 == "ValueError" and "another rank" in message0
    assert kind1 == "ValueError" and "num_items_in_batch must be finite" in message1


def test_group_still_works_after_the_errors(results):
    assert results["errors"]["after_errors"] == [("", ""), ("", "")]
