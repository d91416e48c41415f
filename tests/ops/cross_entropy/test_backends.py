"""The cross-entropy's backends: each backend ``core.backends.pick`` gives, with its row kernel."""

import pytest
import torch

from liger_patch.ops.core.backends import TORCH, pick
from liger_patch.ops.cross_entropy.backends import RowBackend, row_backend
from liger_patch.ops.cross_entropy.rows import ce_rows_torch


def test_torch_rows():
    rows = row_backend("torch", torch.device("cpu"))
    assert isinstance(rows, RowBackend) and rows.row_kernel is ce_rows_torch
    assert (rows.name, rows.scale_, rows.fused_logits) == (TORCH.name, TORCH.scale_, TORCH.fused_logits)
    assert row_backend("torch", torch.device("cpu")) is rows  # one record per backend


def test_triton_rows(monkeypatch):
    pytest.importorskip("triton")
    from liger_patch.ops.cross_entropy.triton.rows import ce_rows_triton

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rows = row_backend("auto", torch.device("cpu"))
    assert rows.name == "triton" and rows.row_kernel is ce_rows_triton
    assert rows.fused_logits is pick("triton", torch.device("cpu")).fused_logits


def test_refusals_are_the_core_backends():
    with pytest.raises(ValueError, match="unknown backend"):
        row_backend("cuda", torch.device("cpu"))
