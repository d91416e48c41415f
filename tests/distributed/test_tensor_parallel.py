"""Tensor parallelism: a patched model whose ``lm_head`` is sharded over the vocabulary trains
exactly like the unpatched one, through the vocabulary-parallel fused loss (never the logits).

Two launches (tests/distributed/tp_workers.py): 2 ranks for transformers' ``tp_plan="auto"``
(untied and tied embeddings, V = 1001 split 501/500) and for ``lm_head`` parallelized with
torch's own ``ColwiseParallel`` (without and with a bias) or ``RowwiseParallel`` (not a vocabulary
shard: the original head runs, with one warning); 4 ranks for transformers' 2-D mesh (FSDP2 x
tensor parallelism). gloo on CPU; nccl where every rank has a GPU. fp32, 3 SGD steps, losses and
every (gathered) parameter compared.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import run_workers
from tests.distributed.tp_workers import TP_VOCAB, transformers_has_distributed_config
from tests.patching_helpers import tolerances

TOL = tolerances(torch.float32)
NEEDS_TP_PLAN = pytest.mark.skipif(
    not transformers_has_distributed_config(), reason="no DistributedConfig(tp_plan=...) here"
)
TWO_RANKS = ["colwise_head", "colwise_head_bias", "rowwise_head"]
if transformers_has_distributed_config():
    TWO_RANKS += ["tp_plan", "tp_plan_tied"]


# Its module-scoped fixture (processes launched, or a sweep) runs once per pytest-xdist worker
# that gets one of its tests: under `-n N --dist loadgroup` they all go to one worker.
pytestmark = pytest.mark.xdist_group(__name__)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("tensor_parallel")
    run_workers("tests.distributed.tp_workers", ["--out", str(out), *TWO_RANKS], out, timeout=300)
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in TWO_RANKS}


@pytest.fixture(scope="module")
def results_2d(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tensor_parallel_2d")
    run_workers(
        "tests.distributed.tp_workers", ["--out", str(out), "tp_fsdp2"], out, world_size=4, timeout=300
    )
    return torch.load(out / "tp_fsdp2.pt", weights_only=False)


def assert_same_training(patched: dict, unpatched: dict, what: str) -> None:
    torch.testing.assert_close(patched["losses"], unpatched["losses"], rtol=TOL.loss, atol=TOL.loss, msg=what)
    assert patched["params"].keys() == unpatched["params"].keys()
    for name, expected in unpatched["params"].items():
        err = (patched["params"][name] - expected).abs().max().item()
        assert err <= TOL.param, f"{what}: parameter {name} differs by {err:.2e}"


def assert_fused_on_vocab_shard(run: dict, offset_rows: set[tuple[int, int]], vocab: int) -> None:
    """The fused path ran, every step, as the vocabulary-parallel op on this rank's rows (rank 0
    recorded its calls) of a head whose weight is a DTensor sharded over the vocabulary."""
    assert all(run["logits_none"]), "the fused path did not run"
    assert run["head"]["type"] == "DTensor" and run["head"]["placements"][-1] == "Shard(dim=0)", run["head"]
    calls = run["vocab_parallel_calls"]
    assert len(calls) == len(run["logits_none"]), calls
    for call in calls:
        assert (call["offset"], call["rows"]) in offset_rows and call["vocab"] == vocab and call["group"] == 2


@NEEDS_TP_PLAN
@pytest.mark.parametrize("scenario", ["tp_plan", "tp_plan_tied"])
def test_tp_plan_auto_patched_trains_like_unpatched(results, scenario):
    result = results[scenario]
    assert_same_training(result[True], result[False], f"{scenario}: patched vs unpatched")
    assert_fused_on_vocab_shard(result[True], {(0, 501)}, TP_VOCAB)
    assert not any(result[False]["logits_none"]) and result[False]["vocab_parallel_calls"] == []


@pytest.mark.parametrize("scenario", ["colwise_head", "colwise_head_bias"])
def test_torch_colwise_head_patched_trains_like_unpatched(results, scenario):
    result = results[scenario]
    assert_same_training(result[True], result[False], f"{scenario}: patched vs unpatched")
    assert_fused_on_vocab_shard(result[True], {(0, 64)}, 128)  # the tiny Llama's V = 128 over 2 ranks
    assert result[True]["warnings"] == [] and result["forced_error"] == ""
    dtensor_error = result["forced_dtensor_hidden_error"]
    assert "hidden states reaching the tensor-parallel lm_head are a DTensor" in dtensor_error
    if scenario == "colwise_head_bias":
        assert "lm_head.bias" in result[True]["params"]


def test_head_sharded_over_hidden_keeps_original_path_and_fused_call_says_why(results):
    result = results["rowwise_head"]
    assert_same_training(result[True], result[False], "rowwise_head: patched vs unpatched")
    assert not any(result[True]["logits_none"])  # original path: real logits
    assert len(result[True]["warnings"]) == 1 and "Shard(dim=1)" in result[True]["warnings"][0]
    assert "Shard(dim=1)" in result["forced_error"] and "over the vocabulary" in result["forced_error"]
    assert "Shard(dim=1)" in result["forced_dtensor_hidden_error"]  # the head's problem comes first


@NEEDS_TP_PLAN
def test_fsdp2_times_tensor_parallel_patched_trains_like_unpatched(results_2d):
    assert_same_training(results_2d[True], results_2d[False], "tp_fsdp2: patched vs unpatched")
    # outside forward FSDP2 shards the tensor-parallel shard again; inside lm_head's call (the
    # fused loss runs there) the weight it gathered is rank 0's tensor-parallel shard
    assert_fused_on_vocab_shard(results_2d[True], {(0, 501)}, TP_VOCAB)
    assert results_2d[True]["head"]["head_class"].startswith("FSDP"), results_2d[True]["head"]
