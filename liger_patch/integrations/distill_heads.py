"""The fused distillation loss on the student's and the teacher's output heads as they are: whole,
sharded by FSDP2 or DeepSpeed ZeRO-3, or sharded over the vocabulary (tensor parallelism). What
TRL's two distillation hooks (``trl_distillation.py``, ``trl_gkd.py``) share beyond TRL's arguments.

* A head whose weight FSDP2 or ZeRO-3 gathers only around the head's call gets the loss computed
  inside that call, as the cross-entropy head does (``sharded_head.call_as_forward``; the
  teacher's call nested in the student's): the wrappers gather the weight before it, and for the
  student re-gather it for the backward and reduce(-scatter) its gradient after it with their own
  hooks. The teacher gets no gradient: its call returns the loss detached, so that its wrapper
  registers nothing for the backward and lets its head go after the call, as TRL's own gathering
  does, unless the op kept the teacher's gathered tensors for a backward that recomputes from them
  (an fp16 student, reduction "none", the vocabulary-parallel op): then the wrapper gathers it
  again for the backward (and DeepSpeed holds it until the teacher's head is called next).
* A student head sharded over the vocabulary (a ``Shard(0)`` DTensor: transformers' ``tp_plan``,
  torch's ``ColwiseParallel``) gets ``vocab_parallel_distillation`` on its rows, with the
  teacher's same rows: its own shard when it is sharded the same way, else cut from its whole
  weight (a DTensor teacher is all-gathered for that, without gradient).
* A whole student head with a sharded teacher head gets the teacher's weight all-gathered.

TRL's logged ``entropy`` (the student's, at the temperature) comes from one forward-only pass of
the log-prob op on the same operands, inside the same calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from liger_patch.ops.core.final_logits import temperature_options
from liger_patch.ops.core.tuning import DEFAULT_TUNING
from liger_patch.ops.core.vocab_shard import VocabShard
from liger_patch.ops.cross_entropy.logprobs import fused_linear_logprobs
from liger_patch.ops.cross_entropy.vocab_parallel import vocab_parallel_loss
from liger_patch.ops.distillation.functional import fused_linear_distillation
from liger_patch.ops.distillation.vocab_parallel import vocab_parallel_distillation
from liger_patch.patching.sharded_head import (
    HeadShard,
    call_as_forward,
    check_plain_hidden,
    gathered_tensors,
    head_weight_is_managed,
    is_dtensor,
    vocab_shard,
    vocab_shard_problem,
)

__all__ = ["DistillSide", "distill_on_heads"]

IGNORE = -100
"""TRL's mark of a token that counts for nothing (GKD compares ``labels != -100``)."""


@dataclass(frozen=True)
class DistillSide:
    """One side of the loss: hidden states (N, H) and either the head module whose tensors the
    loss reads (at the moment it runs: gathered or a vocabulary shard) or, with ``head=None``,
    the weight (V, H) and bias to use as they are."""

    hidden: torch.Tensor
    head: nn.Module | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias now: the head's whole tensors (gathered inside its call), or the given."""
        return (self.weight, self.bias) if self.head is None else gathered_tensors(self.head)

    def student_operands(self) -> tuple[torch.Tensor, torch.Tensor | None, HeadShard | None]:
        """The weight and bias the op reads (this rank's rows of a vocabulary shard) and the shard."""
        found = None if self.head is None else vocab_shard(self.head)
        if found is not None:
            return found.weight, found.bias, found
        weight, bias = self.tensors()
        if is_dtensor(weight):
            raise ValueError("a DTensor student weight needs its head module (DistillSide.head)")
        return weight, bias, None


def _same_rows(found: HeadShard, shard: VocabShard, rows: int) -> bool:
    return (
        found.shard.offset == shard.offset
        and found.shard.vocab == shard.vocab
        and found.weight.shape[0] == rows
        and dist.get_process_group_ranks(found.shard.group) == dist.get_process_group_ranks(shard.group)
    )


@torch.no_grad()
def _whole(t: torch.Tensor | None) -> torch.Tensor | None:
    """A teacher tensor whole on this rank: a DTensor all-gathered (it needs no gradient)."""
    return t.full_tensor() if is_dtensor(t) else t


def _teacher_operands(teacher: DistillSide, shard: VocabShard | None, rows: int):
    """The teacher's weight and bias for the student's rows: all of them (``shard`` None), else
    rows ``[shard.offset, shard.offset + rows)``, its own shard when it holds exactly those."""
    if shard is not None and teacher.head is not None and not vocab_shard_problem(teacher.head):
        found = vocab_shard(teacher.head)
        if found is not None and _same_rows(found, shard, rows):
            return found.weight, found.bias
    weight, bias = map(_whole, teacher.tensors())
    if shard is None:
        return weight, bias
    cut = slice(shard.offset, shard.offset + rows)
    return weight[cut], None if bias is None else bias[cut]


def _entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, found: HeadShard | None,
    labels: torch.Tensor, options: dict[str, Any], backend: str,
) -> torch.Tensor:  # fmt: skip
    """The student's entropy per token at the temperature (TRL's metric), without gradient."""
    math = temperature_options(
        options["temperature"], options.get("student_logit_scale"), options.get("student_softcap")
    )
    runtime = dict(
        backend=backend,
        memory_budget=options["memory_budget"],
        logits_dtype=options.get("logits_dtype"),
        tuning=options.get("tuning", DEFAULT_TUNING),
    )
    with torch.no_grad():
        if found is None:
            return fused_linear_logprobs(
                hidden, weight, labels, bias, temperature=options["temperature"], return_entropy=True,
                ignore_index=IGNORE, softcap=options.get("student_softcap"),
                logit_scale=options.get("student_logit_scale"), **runtime,
            ).entropy  # fmt: skip
        return vocab_parallel_loss(
            hidden, weight, labels, bias, shard=found.shard, reduction="none", return_entropy=True,
            ignore_index=IGNORE, **math, **runtime,
        ).entropy  # fmt: skip


def _storages(head: nn.Module) -> set[int]:
    """Where the head's tensors' data live now (inside its call: gathered)."""
    tensors = (t.to_local() if is_dtensor(t) else t for t in gathered_tensors(head) if t is not None)
    return {t.untyped_storage().data_ptr() for t in tensors}


def _detached(out: Any) -> Any:
    return tuple(t.detach() if torch.is_tensor(t) else t for t in out) if isinstance(out, tuple) else out


def _frozen_call(head: nn.Module, hidden: torch.Tensor, compute: Callable[[torch.Tensor], Any]) -> Any:
    """``compute``'s result, computed inside ``head``'s call (a head that gets no gradient): the
    call returns it detached, and this the result itself, unless ``compute`` saved, for its
    backward, a tensor on the storage of the head's gathered tensors; then the call's own result,
    with the wrapper's backward hooks (see the module doc)."""
    result, kept = [], []

    def forward(seen: torch.Tensor) -> Any:
        gathered = _storages(head)

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not kept and t.untyped_storage().data_ptr() in gathered:
                kept.append(True)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result.append(compute(seen))
        return result[0] if kept else _detached(result[0])

    out = call_as_forward(head, hidden, forward)
    return out if kept else result[0]


def _on_whole_heads(student: DistillSide, teacher: DistillSide, compute: Callable[..., Any]) -> Any:
    """``compute(student hidden, teacher hidden)`` where both heads' tensors can be read whole (or
    as a vocabulary shard), each hidden as its head's hooks passed it."""

    def with_teacher(hs: torch.Tensor) -> Any:
        if teacher.head is None or not head_weight_is_managed(teacher.head):
            return compute(hs, teacher.hidden)
        return _frozen_call(teacher.head, teacher.hidden, functools.partial(compute, hs))

    if student.head is None or not head_weight_is_managed(student.head):
        return with_teacher(student.hidden)
    return call_as_forward(student.head, student.hidden, with_teacher)


def distill_on_heads(
    student: DistillSide,
    teacher: DistillSide,
    labels: torch.Tensor,
    *,
    entropy_backend: str | None = None,
    num_items_in_batch: Any = None,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fused_linear_distillation`` of the two sides (see the module doc) with ``options``
    (``memory_budget`` among them), and with ``entropy_backend`` the student's entropy per token,
    computed with that backend (labels: ``IGNORE`` at tokens that do not count), else ``None``."""

    def compute(hs: torch.Tensor, ht: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        sw, sb, found = student.student_operands()
        shard = None if found is None else found.shard
        tw, tb = _teacher_operands(teacher, shard, sw.shape[0])
        kwargs = dict(num_items_in_batch=num_items_in_batch, **options)
        if found is None:
            loss = fused_linear_distillation(hs, sw, ht, tw, labels, sb, tb, **kwargs)
        else:
            check_plain_hidden(hs)
            loss = vocab_parallel_distillation(hs, sw, ht, tw, labels, sb, tb, shard=shard, **kwargs)
        entropy = None
        if entropy_backend is not None:
            entropy = _entropy(hs, sw, sb, found, labels, options, entropy_backend)
        return loss, entropy

    return _on_whole_heads(student, teacher, compute)
