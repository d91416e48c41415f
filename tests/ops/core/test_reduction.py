"""``reduction.weighted_total``, the loss of "mean" and "sum" in one launch: equal to
``reduce_rows`` (to fp32 rounding, against fp64) for rows that are 0 where ignored, with the
divisor and the poison factor carried by the row weights; NaN when poisoned."""

import pytest
import torch

from liger_patch.ops.core.reduction import reduce_rows, row_weights, weighted_total


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("n", [1, 7, 333, 4099])
def test_weighted_total_is_the_reduced_loss(gen, reduction, n):
    keep = torch.rand(n, generator=gen) < 0.7
    keep[n // 2] = True
    rows = torch.where(keep, torch.rand(n, generator=gen) * 12.0, 0.0)
    divisor = keep.sum().float()
    weights = row_weights(keep, reduction, divisor)
    got = weighted_total(rows, weights)
    want = rows.double().sum() / (divisor.double() if reduction == "mean" else 1.0)
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=0.0)
    torch.testing.assert_close(got, reduce_rows(rows, reduction, divisor), rtol=2e-6, atol=0.0)


def test_weighted_total_of_poisoned_weights_is_nan(gen):
    keep = torch.rand(50, generator=gen) < 0.5
    rows = torch.where(keep, torch.rand(50, generator=gen), 0.0)
    weights = row_weights(keep, "mean", keep.sum().float()) * torch.tensor(float("nan"))
    assert torch.isnan(weighted_total(rows, weights))
    assert weighted_total(rows, row_weights(keep, "mean", keep.sum().float()) * torch.tensor(1.0)).isfinite()


def test_weighted_total_of_no_rows_is_zero():
    assert weighted_total(torch.empty(0), torch.empty(0)).item() == 0.0
