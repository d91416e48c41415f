"""``benchmarks/distill_dist_gpu.py --smoke``: the GPU script's own code on 2 CPU ranks (gloo,
DeepSpeed's CPU accelerator, tiny shapes), started as the distributed tests start their workers.
It must finish with exit status 0 and write a JSON whose parity records are all there (every
scenario of the smoke selection, each dtype), judged on every rank and passed, with what ran
counted; and a size run per scenario, trainer and variant, whose checks passed; and the table.

Without TRITON_INTERPRET the op's default backend ("auto") is its PyTorch one on the CPU, as
it is Triton on the GPUs the script is for (under the interpreter the smoke would take minutes).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (.ci/run shows how)")
pytest.importorskip("trl.trainer.distillation_trainer")
pytest.importorskip("datasets")

from tests.distributed.launch import run_workers  # noqa: E402
from tests.distributed.tp_workers import transformers_has_distributed_config  # noqa: E402

FSDP2 = ("fsdp2_head_unit", "fsdp2_tail_unit", "fsdp2_root_unit", "fsdp2_gkd", "fsdp2_head_unit_3_steps")
TP = ("tp_tp", "tp_tp_3_steps") if transformers_has_distributed_config() else ()
PARITY = {
    ("vocab_parallel_op", "fp32"),
    *((name, dtype) for name in FSDP2 + TP for dtype in ("fp32", "bf16")),
    ("zero3", "fp32"),
}
SIZE_SCENARIOS = ("fsdp2_head_unit", "zero3", *(("tp_tp",) if transformers_has_distributed_config() else ()))
SIZE = {(scenario, trainer) for scenario in SIZE_SCENARIOS for trainer in ("distillation", "gkd")}


# Its module-scoped fixture (processes launched, or a sweep) runs once per pytest-xdist worker
# that gets one of its tests: under `-n N --dist loadgroup` they all go to one worker.
pytestmark = pytest.mark.xdist_group(__name__)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("distill_dist_gpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        run_workers(
            "benchmarks.distill_dist_gpu", ["--smoke", "--out", str(out / "smoke.json")], out, timeout=240
        )
    return json.loads((out / "smoke.json").read_text()), (out / "smoke.md").read_text()


def test_every_parity_scenario_ran_and_passed_on_every_rank(smoke):
    results, _ = smoke
    assert results["finished"] and results["passed"] and not results["skipped"], results["skipped"]
    assert results["backend"] == "auto: torch" and results["world_size"] == 2
    assert {(r["scenario"], r["dtype"]) for r in results["parity"]} == PARITY
    for record in results["parity"]:
        assert record["passed"] and len(record["ranks"]) == 2, record["scenario"]
        for rank in record["ranks"]:
            assert "error" not in rank, rank.get("traceback")
            kinds = {row["kind"] for row in rank["checks"]}
            assert all(row["ok"] is not False for row in rank["checks"]), record["scenario"]
            assert "fact" in kinds and kinds & {"loss", "elementwise"}, (record["scenario"], kinds)
            op_calls = [row for row in rank["checks"] if row["what"] == "fused_distill calls"]
            assert len(op_calls) == 1 and op_calls[0]["ok"], op_calls


def test_the_patched_runs_ran_the_fused_op_and_trls_runs_did_not(smoke):
    results, _ = smoke
    fsdp2 = next(r for r in results["parity"] if (r["scenario"], r["dtype"]) == ("fsdp2_head_unit", "fp32"))
    facts = {row["what"]: row["got"] for row in fsdp2["ranks"][0]["checks"] if row["kind"] == "fact"}
    assert facts["ran, patched"] == {"fused": 1, "vocab_parallel": 0, "trl": 0}
    assert facts["ran, unpatched"] == {"fused": 0, "vocab_parallel": 0, "trl": 1}
    assert facts["fused_distill calls"] == 1


def test_every_size_run_is_there_and_its_checks_passed(smoke):
    results, table = smoke
    runs = {(r["scenario"], r["trainer"], r["variant"]) for r in results["size"]}
    assert runs == {(s, t, v) for s, t in SIZE for v in ("unpatched", "patched")}
    assert all("error" not in r and r["median_step_ms"] >= 0 for r in results["size"]), results["size"]
    assert {(c["scenario"], c["trainer"]) for c in results["size_checks"]} == SIZE
    assert all(c["passed"] for c in results["size_checks"]), results["size_checks"]
    assert "| scenario | dtype | loss | grads |" in table and "| scenario | trainer | variant |" in table


def test_no_run_leaves_a_deepspeed_engine_behind(smoke):
    """DeepSpeed keeps every ZeRO-3 model it ran (a module-global stack and an unbounded cache),
    and with them the engines and the optimizer: ~3.1 GiB a run on the GPUs, which the next run's
    peak counted. ``release_deepspeed_leftovers`` lets them go between runs."""
    results, _ = smoke
    zero3 = [r for r in results["size"] if r["scenario"] == "zero3"]
    assert len(zero3) == 4
    left = {(r["scenario"], r["trainer"], r["variant"]): r["deepspeed_engines_left_per_rank"] for r in zero3}
    assert all(counts == [0, 0] for counts in left.values()), left
    assert all(r["deepspeed_engines_left_per_rank"] == [0, 0] for r in results["size"])
