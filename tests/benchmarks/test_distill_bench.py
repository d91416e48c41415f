"""``benchmarks/distill.py`` on the CPU: its smoke mode runs every implementation on tiny fp32
inputs and each agrees with ours and with fp64 (loss and the student's gradients) at forward KL,
an asymmetric JSD and reverse KL, at temperature 2 with a fifth of the labels ignored; the
teacher its inputs build is the documented one. liger-kernel is optional (its two rows are then
reported missing); TRL is in the test extra."""

from __future__ import annotations

import pytest
import torch

REQUIRED = ("ours", "dense_eager", "dense_compile", "trl_chunked")  # liger-kernel's two are optional


@pytest.fixture(scope="module")
def distill(import_script):
    return import_script("distill")


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_every_implementation_agrees_with_ours_and_fp64(distill, beta):
    setting = distill.Setting(beta=beta, temperature=2.0, backend="torch")
    rows = distill.smoke_rows(list(distill.IMPLS), setting, ignore_frac=0.2, corr=0.9)
    for impl, row in rows.items():
        if "missing" in row:
            assert impl not in REQUIRED and "liger_kernel" in row["missing"], (impl, row)
            continue
        assert "error" not in row, (impl, row)
        errors = [row[k] for k in ("loss_err", "grad_h_err", "grad_w_err", "rel_diff_vs_ours")]
        assert max(errors) <= distill.SMOKE_TOL and row["ok"], (impl, row)


def test_smoke_exit_code_says_whether_values_agree(distill, monkeypatch, capsys):
    assert distill.main(["--smoke", "--impls", "ours,dense_eager", "--beta", "0.3"]) == 0
    assert "dense_eager" in capsys.readouterr().out
    eager = distill.IMPLS["dense_eager"]
    monkeypatch.setitem(distill.IMPLS, "dense_eager", lambda *a, **k: eager(*a, **k) * 1.001)
    assert distill.main(["--smoke", "--impls", "ours,dense_eager", "--beta", "0.3"]) == 1


def test_teacher_is_the_student_plus_noise(distill):
    point = distill.DistillPoint("test", 1024, 64, 192, 4000)
    s_h, s_w, labels, t_h, t_w = distill.make_distill_inputs(point, torch.float32, 0.2, 0.9, "cpu")
    z_s, z_t = (s_h @ s_w.t()).detach(), t_h @ t_w.t()
    assert s_h.requires_grad and s_w.requires_grad and not (t_h.requires_grad or t_w.requires_grad)
    assert t_h.shape == (1024, 192) and t_w.shape == (4000, 192)
    assert z_s.std().item() == pytest.approx(3.0, rel=0.05) and z_t.std().item() == pytest.approx(
        3.0, rel=0.05
    )
    corr = torch.corrcoef(torch.stack([z_s.flatten(), z_t.flatten()]))[0, 1].item()
    assert corr == pytest.approx(0.9, abs=0.01)
    assert (labels == -100).float().mean().item() == pytest.approx(0.2, abs=0.04)


def test_points_are_the_pairs_at_each_token_count(distill):
    assert len(distill.POINTS) == 12
    issue = distill.POINTS[2]
    assert (issue.n, issue.h_s, issue.h_t, issue.v) == (8192, 2048, 4096, 128256)
    assert distill.select_points("4:8") == [p for p in distill.POINTS if p.pair.startswith("Qwen3")]
    assert [p.n for p in distill.select_points("0,11")] == [2048, 16384]
