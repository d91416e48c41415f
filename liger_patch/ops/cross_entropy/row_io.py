"""What a row kernel takes and gives beyond the logits, labels and loss terms: where its gradient
goes (``RowGrad``), the rows' log-sum-exp when it is given (``GivenLse``), and the records of
class weights, per-row outputs and the entropy's gradient (``ChunkRecords``).

Both row kernels (``rows.ce_rows_torch``, ``triton/rows.ce_rows_triton``) take these records and
honour them the same way; the chunk loops slice (or gather) them per token chunk
(``RowRecords``).

Notation (``docs/loss.md``): z = softcap(s * x) are a row's final logits, p = softmax(z),
lse = logsumexp(z), y the label, w the class weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from liger_patch.ops.core.walked_rows import Chunk, chunks, walked


@dataclass
class RowOutputs:
    """Per-row results the forward asks for besides ``(ce, lse)``; each is a (rows,) tensor the
    kernel writes, or ``None`` when not wanted. Kept rows only: ignored rows get 0 (-1 for
    ``argmax``).

    * ``argmax`` (int64): the first column of the row's largest z (``torch.argmax``'s ties).
    * ``entropy`` (fp32): the entropy of p, summed as ``sum_j p_j (lse - z_j)`` (every term >= 0: no
      cancellation, whatever the logits' offset).
    * ``token_scale`` (fp32): p_y, the detached probability of the label (TRL's ``dft`` loss).
      Giving it turns token scaling on: the whole row's loss is multiplied by it, so the returned
      ce and both gradient coefficients (``coef_ce`` and ``coef_z``) are (the caller scales the
      z-loss rows it builds from lse).
    """

    argmax: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    token_scale: torch.Tensor | None = None

    @classmethod
    def empty(
        cls, n: int, device: torch.device, argmax: bool, entropy: bool, token_scale: bool
    ) -> RowOutputs:
        """Uninitialised (n,) buffers for the outputs asked for (the row kernels write every row)."""

        def rows(wanted: bool, dtype: torch.dtype) -> torch.Tensor | None:
            return torch.empty(n, dtype=dtype, device=device) if wanted else None

        return cls(rows(argmax, torch.int64), rows(entropy, torch.float32), rows(token_scale, torch.float32))

    def rows(self, start: int, stop: int) -> RowOutputs:
        """The same record for rows ``[start, stop)`` (views, written in place)."""
        return RowOutputs(*(None if t is None else t[start:stop] for t in self.tensors()))

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """``(argmax, entropy, token_scale)``, the fields in order (spelled out: this runs at every
        call, and ``dataclasses.fields`` is host time)."""
        return self.argmax, self.entropy, self.token_scale

    def any(self) -> bool:
        return self.argmax is not None or self.entropy is not None or self.token_scale is not None


NO_OUTPUTS = RowOutputs()
"""The record of a call that asks for no per-row output (never written: every field is ``None``)."""


@dataclass(frozen=True)
class ClassWeight:
    """``F.cross_entropy``'s ``weight=``: ``weight`` (V,) fp32 contiguous, ``total`` its sum (0-d
    fp32, on the device: no host sync). With label smoothing e the row's ce is
    ``(1-e) w_y (lse - z_y) + e/V (total * lse - sum_j w_j z_j)``; without, ``w_y (lse - z_y)``."""

    weight: torch.Tensor
    total: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor | None) -> ClassWeight | None:
        """The record of a (V,) float ``weight`` (``F.cross_entropy``'s ``weight=``), or ``None``."""
        if weight is None:
            return None
        weight = weight.to(torch.float32).contiguous()
        return cls(weight, weight.sum())


@dataclass(frozen=True)
class EntropyGrad:
    """The entropy's part of the backward: ``coef`` (rows,) fp32 is d(loss)/d(entropy_i) and
    ``entropy`` (rows,) fp32 the forward's entropy H_i. Adds ``coef_i * p_j (lse_i - z_j - H_i)``
    (= d H_i / dz_j) to d(loss)/dz_j, before the softcap and scale derivatives."""

    coef: torch.Tensor
    entropy: torch.Tensor


@dataclass(frozen=True)
class RowGrad:
    """Where a row kernel writes d(loss)/d(logits), and each row's coefficients of it: ``out``
    (rows, V) in any dtype (it may alias the logits: ``gemm.grad_view``), ``coef_ce`` and ``coef_z``
    (rows,) fp32, the weights of d ce / dx and of d (z_loss_scale lse^2) / dx (0 at ignored rows)."""

    out: torch.Tensor
    coef_ce: torch.Tensor
    coef_z: torch.Tensor


@dataclass(frozen=True)
class GivenLse:
    """The whole rows' log-sum-exp ``lse`` (rows,), given to a row kernel that then computes only
    the gradient (the backward, pass B, a vocabulary shard), and where the chunk's columns sit in
    those rows: ``[col_offset, col_offset + V)`` of ``vocab_total`` (``None``: the chunk's V)."""

    lse: torch.Tensor
    col_offset: int = 0
    vocab_total: int | None = None


@dataclass(frozen=True)
class ChunkRecords:
    """The records above for one chunk's rows, each ``None`` when not used."""

    class_weight: ClassWeight | None = None
    outputs: RowOutputs | None = None
    entropy_grad: EntropyGrad | None = None


NO_RECORDS = ChunkRecords()


def check_records(records: ChunkRecords, lse_given: bool, vocab_total: int) -> None:
    """A row kernel's per-row outputs need whole rows computed from scratch (no given
    log-sum-exp), and class weights are one fp32 weight per class of the full rows."""
    outputs, class_weight = records.outputs, records.class_weight
    if lse_given and outputs is not None and outputs.any():
        raise ValueError("per-row outputs (argmax, entropy, token scale) are computed without lse_in")
    if class_weight is not None and (
        tuple(class_weight.weight.shape) != (vocab_total,) or class_weight.weight.dtype != torch.float32
    ):
        raise ValueError(
            f"class weights must be fp32 of shape ({vocab_total},), got {class_weight.weight.dtype} "
            f"{tuple(class_weight.weight.shape)}"
        )


@dataclass(frozen=True)
class RowRecords:
    """The row kernel's extra records of one call (``row_io``), with one row per walked row, and
    ``index``: the rows the token pass walks (``run_chunks``'s ``row_index``), ``None`` for every
    row. With ``index`` the per-row records are gathered once (``entropy_grad``) or written into
    walked-length buffers (``outputs``) that :meth:`finish` scatters into the caller's
    whole-length ``scatter_to``: a few launches per call instead of per chunk."""

    class_weight: ClassWeight | None
    outputs: RowOutputs | None
    entropy_grad: EntropyGrad | None
    index: torch.Tensor | None = None
    scatter_to: RowOutputs | None = None

    @classmethod
    def walking(
        cls,
        class_weight: ClassWeight | None,
        outputs: RowOutputs | None,
        entropy_grad: EntropyGrad | None,
        index: torch.Tensor | None,
    ) -> RowRecords:
        if index is None:
            return cls(class_weight, outputs if outputs is not None and outputs.any() else None, entropy_grad)
        walked_outputs = None
        if outputs is not None and outputs.any():
            n = index.shape[0]
            walked_outputs = RowOutputs(*(None if t is None else t.new_empty(n) for t in outputs.tensors()))
        grad = None
        if entropy_grad is not None:
            grad = EntropyGrad(walked(entropy_grad.coef, index), walked(entropy_grad.entropy, index))
        return cls(class_weight, walked_outputs, grad, index, outputs if walked_outputs is not None else None)

    def chunks(self, n_rows: int, chunk_rows: int) -> Iterator[Chunk]:
        """The token pass's chunks of ``chunk_rows`` rows: of all ``n_rows``, or of ``index``."""
        return chunks(n_rows, self.index, chunk_rows)

    def for_chunk(self, chunk: Chunk) -> ChunkRecords:
        """The row kernel's records for ``chunk`` (views of the walked records)."""
        grad = self.entropy_grad
        return ChunkRecords(
            self.class_weight,
            None if self.outputs is None else self.outputs.rows(chunk.start, chunk.stop),
            None if grad is None else EntropyGrad(chunk.rows(grad.coef), chunk.rows(grad.entropy)),
        )

    def finish(self) -> None:
        """Write the walked outputs into the caller's; the rows not walked get an ignored row's
        value (row_io: 0, -1 for argmax)."""
        if self.scatter_to is None:
            return
        for dst, values in zip(self.scatter_to.tensors(), self.outputs.tensors(), strict=True):
            if dst is not None:
                dst.fill_(-1 if dst is self.scatter_to.argmax else 0)
                dst.index_copy_(0, self.index, values.to(dst.dtype))
