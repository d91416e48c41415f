"""The label range check of a forward, which also gives the rows its token pass walks and their
weights in the reduced loss; and, when the forward reads the check's answer first, how many
labels are kept and, when enough are ignored (``Tuning.skips_ignored``), the index of the kept
rows that the token pass then walks alone.

In two steps: ``begin_label_check`` queues the check's device work and the copy of its answer
to the host; ``finish_label_check`` takes the answer. It reads it first (``reads_first``) on the
CPU, where it is already there, and on CUDA only where skipping the ignored rows pays for a wait
at the share the last check of that shape read first saw (``Tuning.waits_to_skip``): the caller
then queues the start of its first chunk over the kept rows (``head_start``) before the wait, so
the GPU computes while the host waits. Otherwise the host does not wait and every row is walked,
ignored ones weighing 0: if the answer has come, it is read (an error raised) at once; if not,
out-of-range labels are turned into ``ignore_index`` (kernels never index with them), the loss
and every gradient are multiplied by a 0-d ``poison`` factor, NaN when anything was bad and 1
otherwise, and the check is left to ``deferred_checks``, which raises its error before any
optimizer steps. Which rows are walked never depends on how far the GPU has got, so neither do
the results' bits. While a CUDA graph is captured (no sync allowed) no check is kept: a replay
with a bad label poisons (docs/loss.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from liger_patch.ops.core import deferred_checks, early_checks, validation
from liger_patch.ops.core.reduction import counted_divisor, loss_divisor, mean_divisor, row_weights
from liger_patch.ops.core.tuning import Tuning


def capturing(labels: Tensor) -> bool:
    """Whether the current CUDA stream is capturing a graph (no host sync allowed)."""
    return labels.is_cuda and torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True)
class NumItems:
    """``num_items_in_batch`` as the registered operators take it: a tensor or a float (the
    other ``None``; both ``None`` when none was given)."""

    tensor: Tensor | None = None
    value: float | None = None


class FusedCheck(Protocol):
    """A backend's label check in one launch (``triton/label_check.py``'s ``label_check``)."""

    def __call__(
        self,
        labels: Tensor,
        vocab: int,
        ignore_index: int,
        reduction: str,
        num_items: Tensor | None,
        num_items_value: float | None,
    ) -> FusedLabels: ...


class FusedLabels(Protocol):
    """What a ``FusedCheck`` leaves on the device (``triton/label_check.LabelCheck``)."""

    labels: Tensor
    row_weight: Tensor
    stats: Tensor
    divisor: Tensor
    poison: Tensor


class LabelCheck(NamedTuple):
    """What a forward's label check checks, and how: the labels (N,) (int64 and contiguous once
    ``normalized``), the vocabulary size, ``ignore_index``, the reduction, the
    ``num_items_in_batch`` operands and the backend's one-launch check (``Backend.label_check``,
    ``None`` where it has none)."""

    labels: Tensor
    vocab: int
    ignore_index: int
    reduction: str
    num_items: NumItems = NumItems()
    fused_check: FusedCheck | None = None

    @classmethod
    def of_call(cls, args: Any, vocab: int, opts: Any, fused_check: FusedCheck | None) -> LabelCheck:
        """A forward's check: ``args``' labels and ``num_items_in_batch`` operands (its fields
        ``labels``, ``num_items``, ``num_items_value``), against ``vocab`` classes, with ``opts``'
        ``ignore_index`` and reduction and the backend's one launch."""
        items = NumItems(args.num_items, args.num_items_value)
        return cls(args.labels, vocab, opts.ignore_index, opts.reduction, items, fused_check)

    def normalized(self) -> LabelCheck:
        """The same check with the labels int64 and contiguous (kernels index them by row)."""
        labels = self.labels
        if labels.dtype == torch.int64 and labels.is_contiguous():
            return self
        return self._replace(labels=labels.long().contiguous())

    def ahead_key(self) -> tuple | None:
        """The key a check begun ahead for these very labels is kept under (``early_checks``)."""
        items = (self.num_items.tensor, self.num_items.value)
        return early_checks.labels_key(
            self.labels, self.vocab, self.ignore_index, self.reduction, items, self.fused_check
        )


@dataclass(frozen=True)
class PendingLabels:
    """A label check begun: the labels (N,) int64, the reduction's inputs, the divisor of "mean"
    (``None`` when it is the kept count, read in the sync), the check's device work (``None``
    while a CUDA graph is captured) and, when a backend's one launch did it, what that left
    (``fused``: the sanitized labels, the poison factor, the row weights)."""

    labels: Tensor
    vocab: int
    ignore_index: int
    reduction: str
    class_weights: Tensor | None
    num_items: NumItems
    divisor: Tensor | float | None
    started: validation.ValueCheck | None
    shape_key: tuple = ()
    work_gflop: float = 0.0
    fused: FusedLabels | None = None
    keep_mask: Tensor | None = None
    ahead: bool = False  # begun ahead of its call (``begin_ahead``)

    @functools.cached_property
    def keep(self) -> Tensor:
        """(N,) bool: the labels that are not ``ignore_index`` (made when first asked for)."""
        return self.keep_mask if self.keep_mask is not None else self.labels != self.ignore_index

    def expected_share(self) -> float:
        """The share of ignored labels the last read check of this shape saw (``expected_share``)."""
        return expected_share(self.shape_key)

    @property
    def user_divisor(self) -> Tensor | None:
        """The ``num_items_in_batch`` tensor's divisor, whose value the check checks."""
        return self.divisor if self.num_items.tensor is not None else None


@dataclass(frozen=True)
class CheckedLabels:
    """A label check's answer: the labels (sanitized where it was not read), the kept rows' index
    when the pass walks only those (``kept_rows``, else ``None``), their number (``n_kept``,
    ``None`` where not read), the 0-d ``poison`` factor (where not read), the divisor of "mean"
    and each row's weight in the reduced loss (poison included)."""

    labels: Tensor
    kept_rows: Tensor | None
    n_kept: int | None
    poison: Tensor | None
    divisor: Tensor | float
    row_weight: Tensor


def begin_label_check(
    check: LabelCheck,
    class_weights: Tensor | None = None,
    shape_key: tuple = (),
    work_gflop: float = 0.0,
) -> PendingLabels:
    """Queue ``check`` (of the labels against the vocabulary, and of a ``num_items`` tensor), with
    the divisor of "mean" unless it is the kept count (no launches for it: read with the check).
    First, raise a deferred check's error if its answer has come (``deferred_checks``).
    ``shape_key`` names calls alike enough to expect the same share of ignored labels;
    ``work_gflop``: the GEMMs of the call's token pass over every row. The backend's one-launch
    check (``LabelCheck.fused_check``) also computes the divisor, the sanitized labels, the
    poison factor and the row weights (without class weights)."""
    deferred_checks.raise_ready()
    check = check.normalized()
    if class_weights is None:
        ahead = _taken_ahead(check)
        if ahead is not None:  # begun ahead by the caller (``begin_ahead``): the same check
            return dataclasses.replace(ahead, shape_key=shape_key, work_gflop=work_gflop, ahead=True)
    return _queue_check(check, class_weights, shape_key, work_gflop)


def _taken_ahead(check: LabelCheck) -> PendingLabels | None:
    """The check begun ahead (``begin_ahead``) for these very labels (int64, contiguous) and
    arguments, out of ``early_checks``' table; ``None`` where there is none (or while a CUDA graph
    is captured)."""
    if not early_checks.waiting() or capturing(check.labels):
        return None
    return early_checks.take(check.ahead_key())


def _queue_check(
    check: LabelCheck, class_weights: Tensor | None, shape_key: tuple, work_gflop: float
) -> PendingLabels:
    """``begin_label_check``'s own ``check`` (labels int64, contiguous), queued now."""
    labels, num_items = check.labels, check.num_items
    if check.fused_check is not None and class_weights is None and labels.numel() > 0:
        return _begin_fused(check, shape_key=shape_key, work_gflop=work_gflop)
    keep = labels != check.ignore_index
    divisor = None
    if not counted_divisor(check.reduction, class_weights, num_items.tensor, num_items.value):
        divisor = loss_divisor(
            check.reduction, keep, labels, class_weights, num_items.tensor, num_items.value
        )
    user_divisor = divisor if num_items.tensor is not None else None
    started = None
    if not capturing(labels):
        started = validation.start_value_check(labels, check.vocab, check.ignore_index, user_divisor)
    return PendingLabels(
        labels, check.vocab, check.ignore_index, check.reduction, class_weights, num_items, divisor,
        started, shape_key, work_gflop, keep_mask=keep,
    )  # fmt: skip


def _begin_fused(
    check: LabelCheck, *, shape_key: tuple, work_gflop: float, read: bool = True
) -> PendingLabels:
    """``begin_label_check`` by the backend's one-launch check: the divisor is its device scalar
    unless it is a number (reduction "sum"/"none", a ``num_items_in_batch`` number). ``read``
    false: the answer is neither copied back nor kept (``begin_unread_check``)."""
    labels, vocab, ignore_index, reduction, num_items, fused_check = check
    done = fused_check(labels, vocab, ignore_index, reduction, num_items.tensor, num_items.value)
    what = mean_divisor(reduction, num_items.tensor, num_items.value)
    divisor = done.divisor if what.on_device else what.fixed
    user_divisor = done.divisor if num_items.tensor is not None else None
    started = None
    if read and not capturing(labels):
        started = validation.check_from_stats(labels, vocab, ignore_index, user_divisor, done.stats)
    return PendingLabels(
        labels, vocab, ignore_index, reduction, None, num_items, divisor, started, shape_key, work_gflop,
        fused=done,
    )  # fmt: skip


def begin_unread_check(check: LabelCheck, shape_key: tuple, work_gflop: float) -> PendingLabels:
    """The check of a forward that a CUDA graph captures (``call_graph``): the backend's one
    launch (``check.fused_check``, required), its answer neither copied back nor kept, so that
    the forward walks every row with the sanitized labels and the poison factor, as under any
    capture; a replay reads the launch's values (``check_replayed``). Nothing else: no deferred
    check raised, none begun ahead taken."""
    return _begin_fused(check.normalized(), shape_key=shape_key, work_gflop=work_gflop, read=False)


def begin_ahead(check: LabelCheck) -> tuple | None:
    """Queue now the check that a later ``begin_label_check`` of this very ``check`` (labels int64
    and contiguous) with no class weights will take instead of queuing its own
    (``early_checks``), and return its key for ``early_checks.drop``; ``None`` where nothing is
    begun: other labels, no labels, inference tensors, or while a CUDA graph is captured (whose
    check is not kept)."""
    labels = check.labels
    if labels.dtype != torch.int64 or not labels.is_contiguous() or labels.numel() == 0 or capturing(labels):
        return None
    key = check.ahead_key()
    if key is None:
        return None
    deferred_checks.raise_ready()  # as begin_label_check does first
    # Queued directly: begin_label_check would look for a check begun ahead for these very labels.
    early_checks.put(key, _queue_check(check, None, (), 0.0))
    return key


def arrived_ahead(pending: PendingLabels) -> bool:
    """Whether the check was begun ahead of its call (``begin_ahead``) and its answer, copied back
    from the GPU, has arrived, so that reading it costs no wait (a head start would gain nothing).
    ``False`` on the CPU, whose answer is never copied back, and for a check the call began: a
    head start is begun or not by shapes and earlier reads only, as for a call alone."""
    started = pending.started
    return pending.ahead and started is not None and started.ready is not None and started.ready.query()


_IGNORED_SHARE: dict[tuple, float] = {}  # shape key -> share of ignored labels at its last read check


def expected_share(shape_key: tuple) -> float:
    """The share of ignored labels the last read check of shape ``shape_key`` saw (unknown: 1)."""
    return _IGNORED_SHARE.get(shape_key, 1.0)


def _remember_share(key: tuple, n_rows: int) -> Callable[[int], None]:
    def remember(n_kept: int) -> None:
        if len(_IGNORED_SHARE) >= 256 and key not in _IGNORED_SHARE:
            _IGNORED_SHARE.clear()
        _IGNORED_SHARE[key] = (n_rows - n_kept) / max(n_rows, 1)

    return remember


def reads_first(pending: PendingLabels, tuning: Tuning) -> bool:
    """Whether the forward reads its check's answer before its token pass, to skip the ignored
    rows: always where the answer is already on the host when it is begun (the CPU); on CUDA as
    ``waits_for_check`` says. The choice never depends on how far the GPU has got, so neither do
    the results."""
    started = pending.started
    if started is None:
        return False
    return started.ready is None or waits_for_check(pending.shape_key, pending.work_gflop, tuning)


def waits_for_check(shape_key: tuple, work_gflop: float, tuning: Tuning) -> bool:
    """Whether a CUDA forward of shape ``shape_key`` with ``work_gflop`` GFLOP of GEMMs over every
    row reads its label check first: always with ``Tuning.wait_to_skip_gflop`` 0 (as before issue
    43), else only where waiting for it pays (``Tuning.waits_to_skip``) at the share the last
    check of its shape read here saw."""
    if tuning.wait_to_skip_gflop == 0:
        return True
    return tuning.waits_to_skip(expected_share(shape_key), work_gflop)


def check_replayed(check: LabelCheck, done: FusedLabels, shape_key: tuple) -> None:
    """The label check of a forward replayed from a CUDA graph (``call_graph``), which ran the
    check's launch (``check.fused_check``; ``done``: what it left in the graph's buffers,
    rewritten by the next replay) and walked every row without reading it: handled as
    ``finish_label_check`` handles a check it does not read first. A check begun ahead for these
    labels is taken instead of copying the graph's; its error is raised now if its answer has
    come, else the check is deferred (``deferred_checks``)."""
    check = check.normalized()
    labels, items = check.labels, check.num_items
    ahead = _taken_ahead(check)
    started = None if ahead is None else ahead.started
    if started is None:
        user_divisor = None if items.tensor is None else done.divisor.clone()
        started = validation.check_from_stats(
            labels, check.vocab, check.ignore_index, user_divisor, done.stats
        )
    if started.is_ready():
        started.result()
    else:
        deferred_checks.defer(started, _remember_share(shape_key, labels.shape[0]))


def expects_skip(pending: PendingLabels, tuning: Tuning) -> bool:
    """Whether the forward reads its check first and expects it to say skip, from the share the
    last check of its shape read here saw: it then begins its first chunk over the kept rows
    before it waits (``head_start``)."""
    share = pending.expected_share()
    return reads_first(pending, tuning) and share > 0 and share >= tuning.skip_ignored_share


def finish_label_check(pending: PendingLabels, tuning: Tuning) -> CheckedLabels:
    """The check's answer and the rows to walk. Where the forward ``reads_first``: raise as
    ``validation.check_values`` does, and walk the kept rows' index when enough labels are
    ignored (``Tuning.skips_ignored``). Otherwise every row: if the answer has come, read and
    raised from now; if not, no sync: the sanitized labels, the poison factor, the check
    deferred (see the module doc)."""
    labels, poison, kept_rows, n_kept = pending.labels, None, None, None
    started, n_rows, fused = pending.started, labels.shape[0], pending.fused
    learn = _remember_share(pending.shape_key, n_rows)
    if reads_first(pending, tuning):
        n_kept = started.result()
        learn(n_kept)
        if tuning.skips_ignored(n_rows, n_kept):
            kept_rows = torch.nonzero_static(pending.keep, size=n_kept).view(-1)
    elif started is not None and started.is_ready():  # raised from, nothing else: timing
        started.result()
    else:
        labels, poison = (fused.labels, fused.poison) if fused is not None else _sanitized(pending)
        if started is not None:
            deferred_checks.defer(started, learn)
    if fused is not None:
        return CheckedLabels(labels, kept_rows, n_kept, poison, pending.divisor, fused.row_weight)
    keep = pending.keep if poison is None else labels != pending.ignore_index
    divisor = pending.divisor
    if divisor is None:
        divisor = loss_divisor(pending.reduction, keep, labels, pending.class_weights, None, None, n_kept)
    row_weight = row_weights(keep, pending.reduction, divisor)
    if poison is not None:
        row_weight = row_weight * poison
    return CheckedLabels(labels, kept_rows, n_kept, poison, divisor, row_weight)


def _sanitized(pending: PendingLabels) -> tuple[Tensor, Tensor]:
    """The labels with every out-of-range one made ``ignore_index``, and the poison factor: NaN
    when a label or the ``num_items_in_batch`` tensor was bad, else 1 (no sync)."""
    labels, ignore_index = pending.labels, pending.ignore_index
    bad_rows = validation.out_of_range(labels, pending.vocab, ignore_index)
    bad = bad_rows.any()
    user_divisor = pending.user_divisor
    if user_divisor is not None:
        bad = bad | ~(torch.isfinite(user_divisor) & (user_divisor >= 0))
    nan, one = (torch.full((), v, device=labels.device) for v in (float("nan"), 1.0))
    return torch.where(bad_rows, ignore_index, labels), torch.where(bad, nan, one)


def walks_every_row(labels: Tensor) -> bool:
    """Whether the forward over ``labels`` may have walked every row without reading its check
    (on CUDA, or while a graph is captured), so that its backward walks every row too."""
    return labels.is_cuda or capturing(labels)


def in_range_unless_read(labels: Tensor, vocab: int, ignore_index: int) -> Tensor:
    """``labels`` for a recomputing backward: on CUDA, where its forward may not have read its
    check (see the module doc), with every out-of-range label made ``ignore_index`` as that
    forward did (its coefficients carry the poison), so no kernel indexes with one; on the CPU,
    whose forward always read it (unless captured), as they are."""
    if not walks_every_row(labels):
        return labels
    return torch.where(validation.out_of_range(labels, vocab, ignore_index), ignore_index, labels)


def kept_index(labels: Tensor, ignore_index: int) -> Tensor | None:
    """The kept rows' index for a pass that walks only them, read with a host sync (``nonzero``),
    on the CPU only; ``None`` (every row) when every row is kept, and on CUDA, whose host must
    not wait for the GPU."""
    if walks_every_row(labels):
        return None
    kept = torch.nonzero(labels != ignore_index).view(-1)
    return None if kept.shape[0] == labels.shape[0] else kept
