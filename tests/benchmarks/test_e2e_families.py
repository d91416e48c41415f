"""``benchmarks/e2e_families.py`` end to end on the CPU (``--smoke``: every row at tiny shapes):
the segments alternate, the patched ones fuse and equal the unpatched ones, and the JSON and the
markdown table are written."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="module")
def families(import_script):
    return import_script("e2e_families")


def test_every_row_runs_fused_and_equal_to_unpatched(families, tmp_path):
    out = tmp_path / "families.json"
    status = families.main(["--smoke", "--rounds", "1", "--segment-steps", "2", "--out", str(out)])
    assert status == 0
    written = json.loads(out.read_text())
    assert written["smoke"] and [r["row"] for r in written["results"]] == list(families.ROWS)
    for result in written["results"]:
        assert result["parity_ok"] and result["fused_ran"], result
        assert result["max_loss_diff"] <= 1e-5, result  # fp32 on the CPU
    table = (tmp_path / "families.md").read_text()
    assert all(f"| {row} |" in table for row in families.ROWS)


def test_the_rows_are_the_issues_shapes(families):
    rows = families.ROWS
    assert rows["xlmr_large_mlm"].config["vocab_size"] == 250002 and rows["xlmr_large_mlm"].labelled == 0.15
    assert (rows["xlmr_large_mlm"].batch, rows["xlmr_large_mlm"].source) == (16, 512)
    assert rows["mt5_base_seq2seq"].config["vocab_size"] == 250112
    assert rows["nllb_600m_seq2seq"].config["vocab_size"] == 256206
    assert (rows["whisper_small"].source, rows["whisper_small"].target) == (3000, 448)  # 30 s, 448 tokens
    assert rows["modernbert_base_mlm"].config["hidden_size"] == 768


def test_a_masked_batch_labels_its_share_and_corrupts_those_inputs(families):
    row = families.Row("mlm", "xlm-roberta", {}, batch=8, source=500, labelled=0.15)
    batch = families.make_batch(row, 1000, "cpu", torch.float32)
    kept = batch["labels"] != -100
    assert abs(kept.float().mean().item() - 0.15) < 0.02
    assert (batch["input_ids"][kept] != batch["labels"][kept]).float().mean() > 0.9


def test_parity_is_relative_to_a_large_loss(families):
    """A random-init T5 head gives a loss of ~500, where bf16 logits round by ~0.1: a difference
    of 0.21 there is within 1e-3 of the loss; the same difference at a loss of 6 is not."""
    row = families.ROWS["mt5_base_seq2seq"]

    def runs(loss, diff):
        seg = {"ms": [1.0, 1.0], "peak_gib": None}
        return {"unpatched": [dict(seg, losses=[loss, loss], fused=False)],
                "patched": [dict(seg, losses=[loss + diff, loss], fused=True)]}  # fmt: skip

    assert families.summary("mt5", row, runs(516.0, 0.21))["parity_ok"]
    assert not families.summary("mt5", row, runs(6.0, 0.21))["parity_ok"]
    assert families.summary("mt5", row, runs(6.0, 0.01))["loss"] == 6.0
