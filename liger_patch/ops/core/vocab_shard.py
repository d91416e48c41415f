"""A vocabulary shard of a head (tensor parallelism) and what every vocabulary-parallel loss does
with its process group before computing anything: where the shard's rows sit (``VocabShard``),
the checks of its tensors (``check_shard_tensors``), the agreement of the ranks on their tokens and
labels (``check_ranks_agree``, raised on every rank or on none) and the all-gather of per-token
statistics (``all_gather_stats``).

The vocabulary-parallel cross-entropy (``cross_entropy/vocab_parallel.py``) and distillation
(``distillation/vocab_parallel.py``) both run on these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from liger_patch.ops.core import validation


@dataclass(frozen=True)
class VocabShard:
    """Where this rank's rows of a vocabulary-sharded weight sit: rows ``[offset, offset + V_r)``
    of ``vocab`` (V_r is the local weight's row count), the other shards held by the other ranks
    of ``group`` (``None``: the default group). An empty shard (V_r = 0) is allowed."""

    offset: int
    vocab: int
    group: Any = None

    def check(self, rows: int) -> None:
        """Raise unless ``rows`` rows from ``offset`` fit in ``vocab``."""
        if not (self.offset >= 0 and self.offset + rows <= self.vocab):
            raise ValueError(
                f"a vocabulary shard of {rows} rows at offset {self.offset} does not fit in V={self.vocab}"
            )


def _flags(
    labels: Tensor,
    vocab: int,
    ignore_index: int,
    user_divisor: Tensor | None,
    needs: list[bool],
    maxima: tuple[int, ...],
):
    """This rank's ``[*maxima, bad label, bad divisor, *same, *(-same)]`` (int64), ``same`` being
    what every rank of the group must agree on: the token count, the labels' sum, the kept
    tokens' count (the distillation op walks the kept tokens' chunks with a collective each),
    the gradients wanted."""
    device = labels.device
    keep = labels != ignore_index
    bad_label = (keep & ((labels < 0) | (labels >= vocab))).any()
    bad_divisor = torch.zeros((), dtype=torch.bool, device=device)
    if user_divisor is not None:
        bad_divisor = ~(torch.isfinite(user_divisor) & (user_divisor >= 0))
    same = torch.stack([torch.tensor(labels.shape[0], device=device), labels.sum(), keep.sum()])
    same = torch.cat([same, torch.tensor([int(x) for x in needs], device=device)])
    flags = torch.stack([bad_label, bad_divisor]).long()
    return torch.cat([torch.tensor(maxima, dtype=torch.long, device=device), flags, same, -same])


def check_ranks_agree(
    labels: Tensor,
    shard: VocabShard,
    ignore_index: int,
    user_divisor: Tensor | None,
    needs: list[bool],
    maxima: tuple[int, ...] = (),
) -> list[int]:
    """Raise on every rank of the group, never on some only (the others would wait in the next
    collective): for a label outside [0, V) (IndexError, as ``validation.check_values``), a bad
    ``num_items_in_batch`` tensor (ValueError), or ranks that passed different tokens (count,
    labels or kept count) or want different gradients (ValueError). One all-reduce (max) of a few integers and
    one host sync: the values that must agree travel as v and -v, so max(-v) = -min(v). Returns
    the group's largest value of each of this rank's ``maxima`` (what every rank must size alike,
    such as the chunks of a pass with a collective per chunk)."""
    flags = _flags(labels, shard.vocab, ignore_index, user_divisor, needs, maxima)
    reduced = flags.clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=shard.group)
    mine, group = torch.stack([flags, reduced]).tolist()
    agreed, mine, group = group[: len(maxima)], mine[len(maxima) :], group[len(maxima) :]
    if mine[0] or mine[1]:
        validation.check_values(labels, shard.vocab, ignore_index, user_divisor)  # raises, saying which
    if group[0]:
        raise IndexError(
            f"a label on another rank of the vocabulary-parallel group is outside [0, {shard.vocab}) and "
            f"is not ignore_index={ignore_index}"
        )
    if group[1]:
        raise ValueError(
            "num_items_in_batch on another rank of the vocabulary-parallel group is not finite and >= 0"
        )
    k = (len(group) - 2) // 2
    if group[2 : 2 + k] != [-x for x in group[2 + k :]]:
        raise ValueError(
            "the ranks of a vocabulary-parallel group passed different tokens (counts or labels) or want "
            f"different gradients (here {labels.shape[0]} tokens): every rank of a tensor-parallel group "
            "must compute the loss of the same tokens"
        )
    return agreed


def all_gather_stats(stats: Tensor, group: Any) -> Tensor:
    """Every rank's ``(k, N)`` statistics, as ``(ranks, k, N)`` (ranks in the group's order)."""
    world = dist.get_world_size(group)
    out = stats.new_empty((world * stats.shape[0], stats.shape[1]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13
    gather(out, stats.contiguous(), group=group)
    return out.view(world, *stats.shape)


def check_shard_tensors(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    class_weight: Tensor | None,
    shard: VocabShard,
) -> None:
    """``validation``'s checks, for a shard: it may have no rows (V not much larger than the group),
    and class weights are one per class of all V."""
    rows = weight.shape[0] if weight.dim() == 2 else 1
    stand_in = weight.new_zeros(()).expand(1, weight.shape[-1]) if rows == 0 else weight
    validation.check_tensors(hidden, stand_in, labels, bias if rows else None)
    if rows == 0 and bias is not None and tuple(bias.shape) != (0,):
        raise ValueError(f"bias must have shape (0,) like the shard's weight; got {tuple(bias.shape)}")
    shard.check(rows)
    if class_weight is not None:  # checked against a (V, H) stand-in for the whole weight
        validation.check_class_weight(
            class_weight, weight.new_zeros(()).expand(shard.vocab, weight.shape[-1])
        )
