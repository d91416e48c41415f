"""The cross-entropy's backends: each backend of ``core.backends`` with the row kernel it runs
between the GEMMs of every chunk (``RowBackend.row_kernel``: loss terms and d(loss)/d(logits) of
one logits chunk, ``rows.ce_rows_torch``'s contract; ``triton/rows.py``'s on Triton).

The Triton row kernel is imported only when the Triton backend is first asked for.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from liger_patch.ops.core.backends import Backend, pick
from liger_patch.ops.cross_entropy.rows import ce_rows_torch

RowKernel = Callable[..., tuple[torch.Tensor | None, torch.Tensor]]


@dataclass(frozen=True)
class RowBackend(Backend):
    """A backend and its cross-entropy row kernel."""

    row_kernel: RowKernel


def row_backend(name: str, device: torch.device) -> RowBackend:
    """The backend ``backends.pick`` gives for ``name`` on ``device`` (raising why it cannot run
    there), with its row kernel."""
    return _with_rows(pick(name, device))


@functools.cache
def _with_rows(base: Backend) -> RowBackend:
    if base.name == "torch":
        kernel = ce_rows_torch
    else:
        from liger_patch.ops.cross_entropy.triton.rows import ce_rows_triton

        kernel = ce_rows_triton
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Backend)}
    return RowBackend(**fields, row_kernel=kernel)
