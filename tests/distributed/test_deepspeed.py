"""DeepSpeed ZeRO-3, run for real: the HF Trainer on 2 ranks (gloo, DeepSpeed's CPU accelerator),
patched with ``LigerPatchCallback`` against the same run unpatched.

Each variant and patch state runs in its own launch (tests/distributed/deepspeed_workers.py):
two SGD steps of a tiny fp32 Llama with every parameter partitioned, rank 1's first micro-batch
all ignored. ``zero3``: the model is built first and partitioned by ``deepspeed.initialize``;
``zero3_init``: built under ``zero.Init``, as ``from_pretrained`` does under a ZeRO-3 config;
``accelerate_zero3``: an accelerate loop (``Accelerator`` with a ZeRO-3 ``DeepSpeedPlugin``),
the model patched with ``apply_liger_to`` before ``prepare``.
DeepSpeed is not in the ``test`` extra (it builds from source against the installed torch):
``.ci/run`` installs it; without it these tests are skipped.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (.ci/run shows how)")

from tests.distributed.launch import run_workers  # noqa: E402
from tests.patching_helpers import tolerances  # noqa: E402

VARIANTS = ["zero3", "zero3_init", "accelerate_zero3"]
TOL = tolerances(torch.float32)


# Its module-scoped fixture (processes launched, or a sweep) runs once per pytest-xdist worker
# that gets one of its tests: under `-n N --dist loadgroup` they all go to one worker.
pytestmark = pytest.mark.xdist_group(__name__)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("deepspeed")
    found = {}
    for variant in VARIANTS:
        for patch in ("unpatched", "patched"):
            args = ["--out", str(out), variant, patch]
            run_workers("tests.distributed.deepspeed_workers", args, out, timeout=300)
            found[f"{variant}_{patch}"] = torch.load(out / f"{variant}_{patch}.pt", weights_only=False)
    return found


@pytest.mark.parametrize("variant", VARIANTS)
def test_zero3_patched_trains_like_unpatched(results, variant):
    patched, unpatched = results[f"{variant}_patched"], results[f"{variant}_unpatched"]
    torch.testing.assert_close(patched["losses"], unpatched["losses"], rtol=TOL.loss, atol=TOL.loss)
    assert len(patched["losses"]) == 2
    if variant != "accelerate_zero3":  # the Trainer clips at norm 1: compare the norms it logs
        norms = patched["grad_norms"], unpatched["grad_norms"]
        torch.testing.assert_close(*norms, rtol=TOL.loss, atol=TOL.loss)
    assert patched["params"].keys() == unpatched["params"].keys()
    for name, expected in unpatched["params"].items():
        err = (patched["params"][name] - expected).abs().max().item()
        assert err <= TOL.param, f"{variant}: parameter {name} differs by {err:.2e}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_zero3_runs_the_fused_op_on_a_partitioned_head(results, variant):
    for rank, info in enumerate(results[f"{variant}_patched"]["ranks"]):
        assert info["engine"] == "DeepSpeedEngine", info
        assert info["fused_ran"] is True, f"rank {rank}: the fused op never ran"
        # outside forward the head is an empty partition, gathered only for lm_head's call
        assert info["head_numel_after"] == 0 and "NOT_AVAILABLE" in info["head_ds_status"], info
        if variant == "zero3_init":
            assert info["head_numel_built"] == 0, "the model was not built under zero.Init"


@pytest.mark.parametrize("variant", VARIANTS)
def test_zero3_patched_forward_reads_no_head_outside_its_call(results, variant):
    """The fused path reads the head's tensors before the head's call (their flags), where a read
    through ZeRO-3's parameter dict would gather the head synchronously and register it as an
    external parameter of the model (gathered at every later forward's start): it must not."""
    for patch in ("unpatched", "patched"):
        for rank, info in enumerate(results[f"{variant}_{patch}"]["ranks"]):
            assert info["external_params"] == {}, f"{patch}, rank {rank}: {info['external_params']}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_zero3_rank_with_every_label_ignored(results, variant):
    """Rank 1's first micro-batch trains no label: its loss is an exact zero (no NaN), and the
    ranks still meet in every collective (no hang): the losses above match unpatched."""
    ranks = results[f"{variant}_patched"]["ranks"]
    assert ranks[1]["seen_labels"][0] == 0 and ranks[0]["seen_labels"][0] > 0, ranks
    assert torch.isfinite(results[f"{variant}_patched"]["losses"]).all()
