"""TRL's distillation trainers with sharded heads, through the fused op (2 ranks, gloo, CPU).

Two launches (tests/integrations/trl_distillation_sharded_workers.py says what each runs):

* FSDP2 and tensor parallelism, on TRL's own ``compute_loss`` (``DistillationTrainer``,
  ``GKDTrainer``) with a stand-in trainer (accelerate runs neither on a CPU): the loss and every
  student gradient patched, unpatched (TRL's own path) and against the reference (TRL's path on the
  unsharded models); what ran (the fused op or the vocabulary-parallel op, never TRL's kernel, no
  bypass) and whether the student's head was called (a sharded head: the loss runs inside its call);
* DeepSpeed ZeRO-3: both trainers themselves, two SGD steps with ``LigerPatchCallback`` against
  the same run without: the logged loss, ``grad_norm`` and (``DistillationTrainer``) ``entropy``,
  every trained parameter, and both heads partitioned again after training.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("trl.trainer.distillation_trainer")

from tests.distributed.launch import run_workers  # noqa: E402
from tests.distributed.tp_workers import transformers_has_distributed_config  # noqa: E402
from tests.integrations.trl_distillation_sharded_workers import FSDP2_WRAPS  # noqa: E402

NEEDS_TP_PLAN = pytest.mark.skipif(
    not transformers_has_distributed_config(), reason="no DistributedConfig(tp_plan=...) here"
)

# fp32 on the CPU: the fused op and TRL's kernel differ by rounding only (seen: gradients 3e-8,
# losses 1e-7 relative); a gradient off by 1 % is 10x this tolerance for every head here.
FP32 = dict(rtol=1e-5, atol=1e-7)


def _launch(tmp_path_factory, launch: str) -> list[dict]:
    out = tmp_path_factory.mktemp(f"trl_distillation_{launch}")
    run_workers(
        "tests.integrations.trl_distillation_sharded_workers", ["--out", str(out), launch], out, timeout=300
    )
    return torch.load(out / f"{launch}.pt", weights_only=False)


# Its module-scoped fixture (processes launched, or a sweep) runs once per pytest-xdist worker
# that gets one of its tests: under `-n N --dist loadgroup` they all go to one worker.
pytestmark = pytest.mark.xdist_group(__name__)


@pytest.fixture(scope="module")
def torch_results(tmp_path_factory) -> list[dict]:
    return _launch(tmp_path_factory, "torch")


@pytest.fixture(scope="module")
def zero3_results(tmp_path_factory) -> list[dict]:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (.ci/run shows how)")
    return _launch(tmp_path_factory, "zero3")


def _close(what: str, got, expected) -> None:
    scale = expected.abs().max().item() if torch.is_tensor(expected) and expected.numel() else 0.0
    atol = FP32["atol"] + FP32["rtol"] * scale
    torch.testing.assert_close(got, expected, rtol=FP32["rtol"], atol=atol, msg=lambda m: f"{what}: {m}")


def _same_step(what: str, got: dict, expected: dict, skip: tuple = ()) -> None:
    _close(f"{what} loss", got["loss"], expected["loss"])
    assert got["grads"].keys() == expected["grads"].keys(), what
    for name, grad in got["grads"].items():
        if name not in skip:
            _close(f"{what} grad {name}", grad, expected["grads"][name])


@pytest.mark.parametrize("wrap", list(FSDP2_WRAPS))
def test_fsdp2_distillation_trainer_equals_trls_path(torch_results, wrap):
    """The student's gradient reaches its FSDP2 shards as on one process; with ``lm_head`` its
    own unit the loss runs inside the head's call (the unit gathers and reduce-scatters)."""
    for rank, result in enumerate(torch_results):
        runs = result[f"fsdp2_{wrap}"]
        patched, unpatched = runs["patched"], runs["unpatched"]
        _same_step(f"{wrap} rank {rank} vs reference", patched, runs["reference"])
        # TRL's own path all-gathers a DTensor head with full_tensor(), whose backward keeps each
        # rank's own gradient rows unreduced; the reference shows what FSDP2 should reduce to.
        skip = ("lm_head.weight",) if wrap == "head_unit" else ()
        _same_step(f"{wrap} rank {rank} vs TRL", patched, unpatched, skip)
        _close(f"{wrap} entropy", torch.tensor(patched["entropy"]), torch.tensor(unpatched["entropy"]))
        assert patched["ran"] == {"fused": 1, "vocab_parallel": 0, "trl": 0}, patched["ran"]
        assert unpatched["ran"] == {"fused": 0, "vocab_parallel": 0, "trl": 1}, unpatched["ran"]
        assert patched["bypass"] is None
        assert patched["head_calls"] == (1 if wrap == "head_unit" else 0), patched["head_calls"]


def test_fsdp2_gkd_equals_trls_path(torch_results):
    for rank, result in enumerate(torch_results):
        runs = result["fsdp2_gkd"]
        _same_step(f"rank {rank} vs reference", runs["patched"], runs["reference"])
        _same_step(f"rank {rank} vs TRL", runs["patched"], runs["unpatched"])
        assert runs["patched"]["ran"]["fused"] == 1 and runs["patched"]["bypass"] is None
        assert runs["patched"]["head_calls"] == 1  # the fused loss's, inside the unit's call


def test_a_frozen_teacher_unit_is_gathered_again_only_when_the_op_recomputes(torch_results):
    """The teacher's head an FSDP2 unit: "mean" keeps nothing of the teacher (its unit gathers it
    for the forward only), nor does the vocabulary-parallel op of a tensor-parallel student, which
    computes its gradients in the forward too; "none" recomputes from it in the backward (its unit
    gathers it again there)."""
    runs = (("mean", [True]), ("none", [True, False]), ("tp_student", [True]))
    for result in torch_results:
        for run, gathers in runs[: 3 if transformers_has_distributed_config() else 2]:
            got = result["fsdp2_teacher_unit"][run]
            _close(f"{run} loss", got["loss"], got["ref_loss"])
            _close(f"{run} grad_h", got["grad_h"], got["ref_grad_h"])
            _close(f"{run} grad_w", got["grad_w"], got["ref_grad_w"])
            assert got["teacher_gathers"] == gathers, (run, got["teacher_gathers"])
            assert got["ran"] == {
                "fused": run != "tp_student",
                "vocab_parallel": run == "tp_student",
                "trl": 0,
            }


@NEEDS_TP_PLAN
@pytest.mark.parametrize("trainer", ["distillation", "gkd"])
@pytest.mark.parametrize("teacher", ["tp", "plain"])
def test_tensor_parallel_student_runs_the_vocabulary_parallel_op(torch_results, teacher, trainer):
    for rank, result in enumerate(torch_results):
        runs = {run: found[trainer] for run, found in result[f"tp_{teacher}"].items()}
        patched = runs["patched"]
        _same_step(f"{trainer} rank {rank} vs reference", patched, runs["reference"])
        _same_step(f"{trainer} rank {rank} vs TRL", patched, runs["unpatched"])
        if trainer == "distillation":
            _close("entropy", torch.tensor(patched["entropy"]), torch.tensor(runs["unpatched"]["entropy"]))
        assert patched["ran"] == {"fused": 0, "vocab_parallel": 1, "trl": 0}, patched["ran"]
        assert patched["bypass"] is None and patched["head_calls"] == 0


def test_a_student_head_sharded_over_the_hidden_dimension_runs_trls_path_and_says_why(torch_results):
    for result in torch_results:
        patched, unpatched = (result["tp_rowwise_student"][run] for run in ("patched", "unpatched"))
        assert patched["ran"] == unpatched["ran"] == {"fused": 0, "vocab_parallel": 0, "trl": 1}
        assert "not sharded over the vocabulary alone" in patched["bypass"], patched["bypass"]
        assert (
            len(patched["warnings"]) == 1 and "TRL's own chunked divergence kernel" in patched["warnings"][0]
        )
        _same_step("rowwise", patched, unpatched)


@pytest.mark.parametrize("trainer", ["distillation", "gkd"])
def test_zero3_trains_like_trl(zero3_results, trainer):
    for rank, result in enumerate(zero3_results):
        patched, unpatched = result[trainer]["patched"], result[trainer]["unpatched"]
        for key, values in unpatched["logged"].items():
            assert len(values) == 2, key
            _close(f"{trainer} rank {rank} {key}", patched["logged"][key], values)
        for name, param in unpatched["params"].items():
            _close(f"{trainer} param {name}", patched["params"][name], param)
        assert patched["ran"]["fused"] == 2 and patched["ran"]["trl"] == 0, patched["ran"]
        assert patched["bypass"] is None
        for run in (patched, unpatched):  # both heads partitioned again: nothing left gathered
            assert run["head_numel_after"] == {"student": 0, "teacher": 0}, run["head_numel_after"]


def test_a_zero3_teacher_head_is_gathered_again_only_when_the_op_recomputes(zero3_results):
    """ "mean": the teacher's partition is gathered for the forward only and partitioned again;
    "none": the op recomputes from it in the backward, where DeepSpeed's hooks gather it again
    (and, with no gradient of its own to end its backward, hold it until its next call)."""
    for result in zero3_results:
        for reduction, numel_after in (("mean", 0), ("none", 1001 * 96)):
            got = result["teacher_engine"][reduction]
            _close(f"{reduction} loss", got["loss"], got["ref_loss"])
            for name, grad, expected in zip(
                ("hidden", "weight"), got["grads"], got["ref_grads"], strict=True
            ):
                _close(f"{reduction} grad {name}", grad, expected)
            assert got["teacher_numel_after"] == numel_after, (reduction, got["teacher_numel_after"])
            assert got["ran"]["fused"] == 1
