"""What a call of the cross-entropy's chunk loops asks (``ChunkCall``) and gets (``ChunkResult``).

The forward (``operator.flce``), the recomputing backward (``recompute.recompute_grads``) and the
vocabulary-parallel loss each describe their call as one ``ChunkCall`` and hand it to
``chunks.run_chunks``, which plans it (``chunk_plan``) and walks it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from liger_patch.ops.core.grad_weight_layout import GradWeightLater
from liger_patch.ops.core.head_start import HeadStart
from liger_patch.ops.cross_entropy.backends import RowBackend
from liger_patch.ops.cross_entropy.options import LossOptions
from liger_patch.ops.cross_entropy.row_io import ClassWeight, EntropyGrad, RowOutputs


@dataclass(frozen=True)
class HeadInputs:
    """The head's tensors: hidden states (N, H), weight (V, H) and bias (V,) or ``None``."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None


@dataclass(frozen=True)
class GradsWanted:
    """Which inputs want gradients: the head's hidden states, weight and bias, and the low-rank
    term's u and B."""

    hidden: bool = False
    weight: bool = False
    bias: bool = False
    u: bool = False
    b: bool = False

    @classmethod
    def of(cls, needs: list[bool] | tuple[bool, ...]) -> GradsWanted:
        """From an operator's ``needs`` (hidden, weight, bias, then u and B when given)."""
        return cls(*needs)

    def any(self) -> bool:
        return self.hidden or self.weight or self.bias or self.u or self.b


NO_GRADS = GradsWanted()


@dataclass(frozen=True)
class ChunkCall:
    """One call of the chunk loops (``chunks.run_chunks``): loss terms for every row of the head's
    hidden states, and gradients when coefficients are given.

    ``coef_ce`` / ``coef_z`` (N,) fp32 weight each row's d ce / dz and d z-term / dz; they are
    zero at ignored rows. ``lse_in`` (N,) skips the log-sum-exp pass (the backward passes the
    forward's). ``wanted``: the gradients wanted, computed only with coefficients.
    ``budget_bytes`` bounds the working memory (the logits chunk, or the vocabulary block in pass
    B, plus an fp32 grad_W accumulator when the plan keeps one); ``opts.logits_dtype`` is how
    chunks are stored and ``opts.tuning`` shapes the plan.

    ``class_weight``, ``outputs`` ((N,)-long per-row results to fill) and ``entropy_grad`` are the
    row kernel's records (``row_io``), passed on chunk by chunk.

    ``row_index`` (sorted int64 row numbers) are the rows that count, when the others are all
    ignored rows (the forward passes the kept rows): the token chunks then gather those rows and
    skip the rest, whose ce, lse, grad_h and outputs are what an ignored row gets. Every GEMM
    shrinks by the share of ignored rows. Not on the two-pass path.

    ``low_rank`` ``(u, B)`` adds ``u B^T`` to the logits (``low_rank.py``); ``wanted.u`` and
    ``wanted.b`` say whether u and B want gradients (``ChunkResult.grad_u`` / ``grad_b``).

    ``head_start``: ``chunk_plan.start_head``'s first chunk for this call, used where the call
    walks its rows with the plan it was started for, else dropped.
    """

    backend: RowBackend
    inputs: HeadInputs
    labels: torch.Tensor
    opts: LossOptions
    budget_bytes: int
    coef_ce: torch.Tensor | None = None
    coef_z: torch.Tensor | None = None
    lse_in: torch.Tensor | None = None
    wanted: GradsWanted = NO_GRADS
    class_weight: ClassWeight | None = None
    outputs: RowOutputs | None = None
    entropy_grad: EntropyGrad | None = None
    row_index: torch.Tensor | None = None
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None
    head_start: HeadStart | None = None

    @property
    def computes_grads(self) -> bool:
        """Whether the call computes gradients: coefficients given and some gradient wanted."""
        return self.coef_ce is not None and self.wanted.any()

    @property
    def logits_dtype(self) -> torch.dtype:
        """How logits chunks are stored: ``opts.logits_dtype``, else the input's dtype (not the
        GEMMs', fp32 on the CPU)."""
        return self.opts.logits_dtype or self.inputs.hidden.dtype

    @property
    def no_partials(self) -> bool:
        """Whether log-sum-exp partials of a fused logits GEMM cannot serve this call: class
        weights with label smoothing (the partials' sum of z is unweighted), or a low-rank term
        (the GEMM's partials would not include it)."""
        weighted_smoothing = self.class_weight is not None and self.opts.label_smoothing != 0.0
        return weighted_smoothing or self.low_rank is not None


@dataclass
class ChunkResult:
    """What a call gives: per-row ce and lse (N,) fp32 (``None`` when ``lse_in`` was given), and the
    gradients asked for in their inputs' dtypes (else ``None``); grad_W left to be made later
    where a call plan was asked to leave it (``one_chunk.OneChunk.run``)."""

    ce: torch.Tensor | None
    lse: torch.Tensor | None
    grad_hidden: torch.Tensor | None
    grad_weight: torch.Tensor | None
    grad_bias: torch.Tensor | None
    grad_u: torch.Tensor | None = None  # the low-rank term's (``low_rank.LowRank``)
    grad_b: torch.Tensor | None = None
    grad_weight_later: GradWeightLater | None = None
