"""``benchmarks/host_bound.py`` on the CPU (``--smoke``): every part's rows with the fields issue
43 names, the patched steps fused and equal to the unpatched ones, the JSON and the tables."""

from __future__ import annotations

import json

import pytest

OP_FIELDS = {"part", "N", "H", "V", "ignored", "ours_host_ms", "eager_host_ms", "ours_wall_ms",
             "eager_wall_ms"}  # fmt: skip
DISTILL_FIELDS = (OP_FIELDS - {"H"}) | {"H_student", "H_teacher"}
STEP_FIELDS = {"part", "model", "tokens", "ignored", "patched_step_ms", "unpatched_step_ms", "liger_step_ms"}


@pytest.fixture(scope="module")
def host_bound(import_script):
    return import_script("host_bound")


def test_smoke_writes_every_part(host_bound, tmp_path):
    out = tmp_path / "hb.json"
    assert host_bound.main(["--smoke", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["smoke"] and written["device"]
    rows = written["rows"]
    ops = [r for r in rows if r["part"] == "op"]
    steps = [r for r in rows if r["part"] == "step"]
    distills = [r for r in rows if r["part"] == "distill"]
    assert [r["ignored"] for r in ops] == [0.0, 0.25] and [r["ignored"] for r in steps] == [0.0, 0.25]
    assert [r["ignored"] for r in distills] == [0.0, 0.25]
    for row in ops:
        assert row.keys() >= OP_FIELDS and all(row[k] > 0 for k in OP_FIELDS if k.endswith("_ms"))
    for row in distills:
        assert row.keys() >= DISTILL_FIELDS and all(row[k] > 0 for k in DISTILL_FIELDS if k.endswith("_ms"))
    for row in steps:
        assert row.keys() >= STEP_FIELDS and row["fused_ran"] and row["parity_ok"], row
        assert row["paired_ratio"] > 0
    table = (tmp_path / "hb.md").read_text()
    assert "ours host ms" in table and "H teacher" in table and "patched / unpatched" in table


def test_an_unknown_part_or_model_is_refused(host_bound):
    with pytest.raises(SystemExit):
        host_bound.main(["--smoke", "--parts", "op,steps"])
    with pytest.raises(SystemExit):
        host_bound.main(["--smoke", "--models", "llama-3.1-8b"])


def test_the_plot_takes_one_line_per_model_and_share(import_script):
    plot = import_script("plot_host_bound")
    rows = [
        {"part": "op", "N": 256},
        {"part": "step", "model": "m", "tokens": 2048, "ignored": 0.25, "patched_step_ms": 9.0,
         "unpatched_step_ms": 10.0},
        {"part": "step", "model": "m", "tokens": 512, "ignored": 0.25, "patched_step_ms": 11.0,
         "unpatched_step_ms": 10.0},
        {"part": "step", "model": "m", "tokens": 512, "ignored": 0.0, "patched_step_ms": None,
         "unpatched_step_ms": 10.0},
        {"part": "step", "model": "n", "tokens": 256, "ignored": 0.0, "patched_step_ms": 11.0,
         "unpatched_step_ms": 10.0, "paired_ratio": 0.95},
    ]  # fmt: skip
    lines = {"m, 25% ignored": [(512, 1.1), (2048, 0.9)], "n, 0% ignored": [(256, 0.95)]}
    assert plot.step_lines(rows) == lines


def test_the_eager_distillation_is_the_fused_ones_loss(host_bound):
    """The distillation part's eager side computes the loss the fused op does (values and the
    student's gradients), so their times are of the same work."""
    import torch

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 16, generator=gen, requires_grad=True)
    weight = (torch.randn(97, 16, generator=gen) * 0.7).requires_grad_()
    labels = torch.randint(0, 97, (40,), generator=gen)
    labels[::3] = -100
    teacher = (torch.randn(40, 24, generator=gen), torch.randn(97, 24, generator=gen) * 0.6)
    eager = host_bound.eager_distill(hidden, weight, labels, teacher=teacher)
    ours = host_bound.ours_distill(hidden, weight, labels, teacher=teacher)
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-6)
    expected = torch.autograd.grad(eager, (hidden, weight))
    for got, want in zip(torch.autograd.grad(ours, (hidden, weight)), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
