"""The one-launch label bookkeeping (``ops/core/triton/label_check.py``) against what the torch
path of ``kept_rows`` computes with PyTorch ops: the same sanitized labels, divisor, poison,
stats and row weights, bit for bit, for every reduction and divisor, bad labels at any
position, bad ``num_items_in_batch`` tensors, and sizes around the kernel's block."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from liger_patch.ops.core.reduction import loss_divisor, row_weights
from liger_patch.ops.core.triton.label_check import label_check

V, IGNORE = 40, -100


def _expected(labels, reduction, items, value):
    """What the torch path gives: (sanitized labels, row weights, divisor, poison, stats)."""
    keep = labels != IGNORE
    bad_rows = keep & ((labels < 0) | (labels >= V))
    safe = torch.where(bad_rows, IGNORE, labels)
    kept = safe != IGNORE
    divisor = loss_divisor(reduction, kept, safe, None, items, value)
    bad_divisor = items is not None and not bool(torch.isfinite(divisor) & (divisor >= 0))
    poison = math.nan if bool(bad_rows.any()) or bad_divisor else 1.0
    weights = row_weights(kept, reduction, divisor) * poison
    kept_values = torch.where(keep, labels, 0)
    stats = [
        int(kept.sum()),
        min(0, int(kept_values.min())),
        max(0, int(kept_values.max())),
        int(bad_divisor),
    ]
    return safe, weights, divisor, poison, stats


def _check(labels, reduction="mean", items=None, value=None):
    got = label_check(labels, V, IGNORE, reduction, items, value)
    safe, weights, divisor, poison, stats = _expected(
        labels.cpu(), reduction, None if items is None else items.cpu(), value
    )
    assert torch.equal(got.labels.cpu(), safe)
    assert torch.equal(got.row_weight.cpu(), weights.float()) or (
        math.isnan(poison) and got.row_weight.isnan().all()
    )
    assert got.stats.tolist() == stats
    assert math.isnan(got.poison.item()) == math.isnan(poison)
    if reduction == "mean" and value is None and not stats[3]:
        assert got.divisor.item() == float(divisor)


def _labels(gen, device, n, share=0.3):
    labels = torch.randint(0, V, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < share] = IGNORE
    return labels.to(device)


@pytest.mark.parametrize("n", [1, 7, 255, 256, 257, 1000])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_the_torch_path(gen, device, n, reduction):
    _check(_labels(gen, device, n), reduction)


@pytest.mark.parametrize(
    "items",
    [torch.tensor(37), torch.tensor(3.5), torch.tensor(0.0), torch.tensor(1e30, dtype=torch.float64)],
    ids=["int", "float", "zero", "fp64"],
)
def test_num_items_tensor_divides(gen, device, items):
    _check(_labels(gen, device, 300), items=items.to(device))
    _check(_labels(gen, device, 300), items=items)  # on the CPU, whatever the labels' device


@pytest.mark.parametrize("value", [5.0, 0.0, 1e-3])
def test_num_items_number_divides(gen, device, value):
    _check(_labels(gen, device, 300), value=value)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_bad_num_items_tensor_poisons_and_is_flagged(gen, device, bad):
    _check(_labels(gen, device, 50), items=torch.tensor(bad, device=device))


@pytest.mark.parametrize("position", [0, 130, 299])
@pytest.mark.parametrize("value", [V, -1, 10**12])
def test_bad_label_is_made_ignored_and_poisons(gen, device, position, value):
    labels = _labels(gen, device, 300)
    labels[position] = value
    _check(labels)


def test_every_label_ignored_divides_by_one(device):
    got = label_check(torch.full((70,), IGNORE, device=device), V, IGNORE, "mean")
    assert got.divisor.item() == 1.0 and got.stats.tolist() == [0, 0, 0, 0]
    assert torch.equal(got.row_weight.cpu(), torch.zeros(70))


@given(
    n=st.integers(1, 600),
    share=st.floats(0.0, 1.0),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    bad_at=st.one_of(st.none(), st.integers(0, 599)),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_the_torch_path_on_any_labels(device, n, share, reduction, bad_at, seed):
    gen = torch.Generator().manual_seed(seed)
    labels = _labels(gen, "cpu", n, share)
    if bad_at is not None:
        labels[bad_at % n] = V + bad_at
    _check(labels.to(device), reduction)
