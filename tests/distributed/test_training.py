"""DDP and FSDP2 on 2 ranks: patched training equals unpatched and single-process training.

One launch (2 processes, gloo on CPU, nccl with 2 GPUs; see tests/distributed/workers.py) runs
every scenario; the tests below check its results. Each scenario trains a tiny fp32 Llama
for 3 SGD steps with ``num_items_in_batch`` counted across ranks (the Trainer's
``average_tokens_across_devices``), so the distributed run must also equal one process trained
on the union of the ranks' batches.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import run_workers
from tests.distributed.workers import SCENARIOS
from tests.patching_helpers import Tolerances, tolerances

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


# Forwards under bf16 autocast: patched and unpatched round differently (our GEMMs accumulate a
# chunk in fp32, autocast's store bf16), and measured 1.5-2.0e-3 apart in the parameters after 3
# steps on CPU; a 10 % error in the head's grad_W moves them 7-8e-3 (the loss hardly at all).
AMP_TOL = Tolerances(loss=1e-3, grad=8e-2, param=4e-3)


def tol_for(scenario: str) -> Tolerances:
    """fp32 tolerances, ``AMP_TOL`` for a scenario whose forwards run under bf16 autocast."""
    return AMP_TOL if SCENARIOS.get(scenario, {}).get("amp") else tolerances(torch.float32)


FSDP2_SCENARIOS = [name for name in SCENARIOS if "fsdp2" in name]
# accelerate keeps FSDP off on CPU (it stays MULTI_CPU): the Trainer's FSDP2 run needs 2 GPUs
TRAINER_SCENARIOS = ["trainer_ddp", "trainer_fsdp2"] if TWO_GPUS else ["trainer_ddp"]


# Its module-scoped fixture (processes launched, or a sweep) runs once per pytest-xdist worker
# that gets one of its tests: under `-n N --dist loadgroup` they all go to one worker.
pytestmark = pytest.mark.xdist_group(__name__)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("distributed")
    names = [*SCENARIOS, *TRAINER_SCENARIOS]
    run_workers("tests.distributed.workers", ["--out", str(out), *names], out, timeout=300)
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in names}


def assert_same_training(run: dict, reference: dict, what: str, tol) -> None:
    torch.testing.assert_close(run["losses"], reference["losses"], rtol=tol.loss, atol=tol.loss, msg=what)
    assert run["params"].keys() == reference["params"].keys()
    for name, expected in reference["params"].items():
        err = (run["params"][name] - expected).abs().max().item()
        assert err <= tol.param, f"{what}: parameter {name} differs by {err:.2e}"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_patched_trains_like_unpatched(results, scenario):
    result = results[scenario]
    what = f"{scenario}: patched vs unpatched"
    assert_same_training(result["patched"], result["unpatched"], what, tol_for(scenario))
    assert all(result["patched"]["logits_none"]), "the fused path did not run"
    assert not any(result["unpatched"]["logits_none"])


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_distributed_equals_single_process_on_union_of_batches(results, scenario):
    result = results[scenario]
    what = f"{scenario}: patched vs one process"
    assert_same_training(result["patched"], result["single"], what, tol_for(scenario))


@pytest.mark.parametrize("scenario", FSDP2_SCENARIOS)
def test_fsdp2_head_weight_was_a_sharded_dtensor(results, scenario):
    """Outside forward the head weight is a DTensor shard: the fused path had to gather it."""
    assert results[scenario]["patched"]["head_weight_type"] == "DTensor"


@pytest.mark.parametrize("scenario", ["ddp_all_ignored_rank", "fsdp2_all_ignored_rank"])
def test_all_ignored_rank_gives_exact_zero_and_no_hang(results, scenario):
    patched = results[scenario]["patched"]
    rank_losses = patched["rank_losses"]  # (steps, world); rank 1 had every label ignored
    assert torch.equal(rank_losses[:, 1], torch.zeros_like(rank_losses[:, 1]))
    assert torch.isfinite(rank_losses).all() and (rank_losses[:, 0] > 0).all()
    assert patched["finite"]


@pytest.mark.parametrize("scenario", TRAINER_SCENARIOS)
def test_trainer_with_callback_trains_like_plain_trainer(results, scenario):
    result = results[scenario]
    what = f"{scenario}: Trainer + callback vs Trainer"
    assert_same_training(result["patched"], result["unpatched"], what, tol_for(scenario))
    assert len(result["patched"]["losses"]) == 2
    if scenario == "trainer_fsdp2":
        assert result["patched"]["sharded"], "the Trainer did not shard the model with FSDP2"
