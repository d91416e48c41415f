"""``row_io``'s records: the spelled-out field lists agree with the dataclasses' fields."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from liger_patch.ops.cross_entropy.row_io import RowOutputs


def test_row_outputs_tensors_are_its_fields_in_order():
    names = [f.name for f in dataclasses.fields(RowOutputs)]
    for wanted in itertools.product([False, True], repeat=len(names)):
        values = {n: torch.randn(3) if w else None for n, w in zip(names, wanted, strict=True)}
        outputs = RowOutputs(**values)
        assert outputs.tensors() == tuple(values[n] for n in names)
        assert outputs.any() == any(wanted)
        sliced = outputs.rows(1, 3)
        for mine, whole in zip(sliced.tensors(), outputs.tensors(), strict=True):
            assert (mine is None) == (whole is None)
            if mine is not None:
                assert torch.equal(mine, whole[1:3])
