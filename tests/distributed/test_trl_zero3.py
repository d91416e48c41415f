"""TRL's ``SFTTrainer`` under DeepSpeed ZeRO-3, run for real (2 ranks, gloo, DeepSpeed's CPU
accelerator): the fused op behind TRL's fused LM head against TRL's own kernel.

One launch (tests/distributed/trl_zero3_workers.py) trains two SGD steps of a tiny fp32 Llama
with every parameter partitioned, for each head (untied, tied, and a frozen head that only TRL's
``maybe_gather_lm_head_ctx`` gathers, in the forward and again in the backward), once with
``LigerPatchCallback`` and once without. Rank 1's first micro-batch has every label ignored.
DeepSpeed and TRL's fused head (1.15+) are needed; without them these tests are skipped.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (.ci/run shows how)")
trl = pytest.importorskip("trl")
if not hasattr(trl.trainer.utils, "add_fused_lm_head"):
    pytest.skip("this TRL has no fused LM head (before 1.15)", allow_module_level=True)

from tests.distributed.launch import run_workers  # noqa: E402
from tests.distributed.trl_zero3_workers import HEADS, METRICS  # noqa: E402
from tests.patching_helpers import TINY_CONFIG  # noqa: E402

# fp32 on the CPU: the two heads differ by rounding only (seen: logged values 6e-8, parameters
# 1.2e-8); a gradient 1 % off moves grad_norm by 1e-2
LOGGED = dict(rtol=2e-6, atol=2e-6)
PARAM_ATOL = 1e-6
HEAD_NUMEL = TINY_CONFIG["vocab_size"] * TINY_CONFIG["hidden_size"]


# Its module-scoped fixture (processes launched, or a sweep) runs once per pytest-xdist worker
# that gets one of its tests: under `-n N --dist loadgroup` they all go to one worker.
pytestmark = pytest.mark.xdist_group(__name__)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("trl_zero3")
    run_workers("tests.distributed.trl_zero3_workers", ["--out", str(out)], out, timeout=300)
    return torch.load(out / "trl_zero3.pt", weights_only=False)


@pytest.mark.parametrize("head", HEADS)
def test_patched_sft_trains_like_trls_kernel(results, head):
    patched, unpatched = results[f"{head}_patched"], results[f"{head}_unpatched"]
    for key in METRICS:
        assert len(patched["logged"][key]) == 2, key
        torch.testing.assert_close(
            patched["logged"][key], unpatched["logged"][key], **LOGGED, msg=lambda m, k=key: f"{k}: {m}"
        )
    assert patched["params"].keys() == unpatched["params"].keys()
    for name, expected in unpatched["params"].items():
        err = (patched["params"][name] - expected).abs().max().item()
        assert err <= PARAM_ATOL, f"{head}: parameter {name} differs by {err:.2e}"


@pytest.mark.parametrize("head", HEADS)
def test_the_fused_op_computes_every_call_on_both_ranks(results, head):
    """Patched: the op on every micro-batch of each rank, TRL's kernel never (no bypass), and each
    of its backwards inside TRL's gathering helper with the head whole there. Unpatched: the
    reverse. The head is an empty partition after training."""
    for patch, ours in (("patched", True), ("unpatched", False)):
        for rank, info in enumerate(results[f"{head}_{patch}"]["ranks"]):
            micro_batches = len(info["seen_labels"])
            assert micro_batches == 2, info
            assert (info["op_calls"], info["trl_calls"]) == ((2, 0) if ours else (0, 2)), (patch, rank, info)
            backwards = [inside for phase, _, inside in info["gathers"] if phase == "backward"]
            assert backwards == [HEAD_NUMEL] * micro_batches, (patch, rank, info)
            assert info["head_numel_after"] == 0 and info["tied"] == (head == "tied"), info


def test_a_head_left_to_trl_is_gathered_by_trl_forward_and_backward(results):
    """The frozen head is an empty partition at each entry into TRL's helper, forward and
    backward, so the fused op's backward ran on the head that the helper gathered again."""
    for patch in ("patched", "unpatched"):
        for info in results[f"frozen_left_to_trl_{patch}"]["ranks"]:
            assert [g[0] for g in info["gathers"]] == ["forward", "backward"] * 2, info
            assert all(before == 0 and inside == HEAD_NUMEL for _, before, inside in info["gathers"]), info


@pytest.mark.parametrize("head", HEADS)
def test_a_rank_with_every_label_ignored(results, head):
    """Rank 1's first micro-batch trains no label: the ranks still meet in every collective (no
    hang), the losses are finite, and they match TRL's above."""
    ranks = results[f"{head}_patched"]["ranks"]
    assert ranks[1]["seen_labels"][0] == 0 and ranks[0]["seen_labels"][0] > 0, ranks
    assert torch.isfinite(results[f"{head}_patched"]["logged"]["loss"]).all()
