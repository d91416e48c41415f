"""A call plan's launches captured once as a CUDA graph, then replayed: one launch instead of several.

A call that a plan serves (``one_chunk.OneChunk``) still issues its launches one by one, each
Triton launch binding its arguments on the host. Replayed as a CUDA graph they cost the host one
graph launch and three copies: on an H200 the op's host time a call went from 1.67-2.12 to
1.54-1.89 ms (ten in a row: 1.98-2.04 to 1.62-1.76), eager's being 1.10-1.25 (docs/perf-notes.md
item 66). ``run`` does this for a plain eager call on CUDA:

* The plan's first run notes where the weight is. A later run that finds it there again first
  runs as usual (its own results), then captures the same launches into a graph on a side stream
  (nothing runs during a capture), reading hidden states, labels and row weights of its own.
* Each later call copies its hidden states, labels and row weights into the graph's, replays it,
  and returns the graph's outputs as new tensors that share their storage: the same kernels on the
  same values, so the same bits as ``plan.run``.
* A replay rewrites those outputs, so it is refused (the plan runs as usual) while anything but
  the graph still holds one of them (the use counts of their storages say so: a gradient being
  accumulated in grad_W's buffer, a loss kept from an earlier call), and while the weight is not
  where the graph reads it (FSDP2 and ZeRO-3 gather it anew). After ``_MAX_MISSES`` refusals in a
  row the graph is dropped and its signature is not captured again.

What a graph keeps between calls is its own memory pool: the plan's logits chunk, its row results
and gradients. At most ``_MAX_GRAPHS`` are kept; the oldest is dropped (and its signature not
captured again) for a new one. ``Tuning.call_graphs`` turns graphs on (they are off by default:
a replay is not yet tied to one stream and one thread, see its docstring); a call made while a
graph is being captured by the caller, or on the CPU, never uses them.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from liger_patch.ops.cross_entropy.chunk_call import ChunkResult
from liger_patch.ops.cross_entropy.options import LossOptions


class OneChunk(Protocol):
    """What a graph captures: a call plan (``one_chunk.OneChunk``, which imports this module)."""

    def run(
        self, hidden: Tensor, weight: Tensor, labels: Tensor, coef: Tensor | None, opts: LossOptions
    ) -> ChunkResult: ...


_MAX_GRAPHS = 4
_MAX_MISSES = 8
_MAX_ENTRIES = 256


def _use_count(t: Tensor) -> int:
    """How many holders ``t``'s storage has (counted the same way every time: the temporary
    storage object asked counts one)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _static_like(t: Tensor) -> Tensor:
    """An input buffer of ``t``'s shape, strides and dtype on its device (what the plan was made for)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


class PlanGraph:
    """One signature's graph: its plan, the weight's address it reads, its input buffers, its
    outputs (a ``ChunkResult`` of its pool's tensors) and their storages' use counts when nothing
    but the graph held them."""

    def __init__(self, plan: OneChunk, hidden: Tensor, weight: Tensor, labels: Tensor, coef, opts) -> None:
        self.plan, self.weight_ptr, self.misses = plan, weight.data_ptr(), 0
        self.hidden, self.labels = _static_like(hidden), _static_like(labels)
        self.coef = None if coef is None else _static_like(coef)
        device = hidden.device
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                self.result = plan.run(self.hidden, weight, self.labels, self.coef, opts)
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(side)
        self.outputs = [t for t in vars(self.result).values() if t is not None and t.numel()]
        self.counts = [_use_count(t) for t in self.outputs]

    def serves(self, weight: Tensor) -> bool:
        """Whether a replay may run now: the weight where the graph reads it, and no output held
        by anything but the graph."""
        if weight.data_ptr() != self.weight_ptr:
            return False
        return all(_use_count(t) <= n for t, n in zip(self.outputs, self.counts, strict=True))

    def replay(self, hidden: Tensor, labels: Tensor, coef: Tensor | None) -> ChunkResult:
        """The plan's result for these inputs: copied in, the graph replayed, its outputs shared."""
        self.hidden.copy_(hidden)
        self.labels.copy_(labels)
        if coef is not None:
            self.coef.copy_(coef)
        self.graph.replay()
        shared = {name: None if t is None else t.detach() for name, t in vars(self.result).items()}
        return ChunkResult(**shared)


_ENTRIES: dict[tuple, PlanGraph | int | None] = {}
"""signature -> its graph, the weight's address its plan's last run found (no graph yet), or
``None`` (never captured again)."""


def run(
    plan: OneChunk,
    key: tuple,
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    coef: Tensor | None,
    opts: LossOptions,
) -> ChunkResult:
    """``plan.run``'s result for a plain eager call of signature ``key``: replayed from its graph
    where one serves it, else run (and captured, the second time the weight is found in one place)."""
    if not (opts.tuning.call_graphs and hidden.is_cuda) or torch.cuda.is_current_stream_capturing():
        return plan.run(hidden, weight, labels, coef, opts)
    entry = _ENTRIES.get(key)
    if isinstance(entry, PlanGraph) and entry.plan is plan:
        if entry.serves(weight):
            entry.misses = 0
            return entry.replay(hidden, labels, coef)
        entry.misses += 1
        if entry.misses >= _MAX_MISSES:
            _ENTRIES[key] = None
        return plan.run(hidden, weight, labels, coef, opts)
    res = plan.run(hidden, weight, labels, coef, opts)
    if key in _ENTRIES and entry is None:
        return res
    if entry == weight.data_ptr():
        _capture(key, plan, hidden, weight, labels, coef, opts)
    else:
        _keep(key, weight.data_ptr())
    return res


def _capture(key: tuple, plan: OneChunk, hidden, weight, labels, coef, opts: LossOptions) -> None:
    """``key``'s graph, made room for; ``None`` for the key where the capture fails."""
    graphs = [k for k, v in _ENTRIES.items() if isinstance(v, PlanGraph)]
    if len(graphs) >= _MAX_GRAPHS:
        _ENTRIES[graphs[0]] = None
    try:
        made = PlanGraph(plan, hidden, weight, labels, coef, opts)
    except RuntimeError:  # something in the plan cannot be captured here: it runs as usual
        made = None
    _keep(key, made)


def _keep(key: tuple, value: PlanGraph | int | None) -> None:
    if key not in _ENTRIES and len(_ENTRIES) >= _MAX_ENTRIES:
        del _ENTRIES[next(iter(_ENTRIES))]
    _ENTRIES[key] = value


def forget() -> None:
    """Drop every graph and what the plans' runs noted."""
    _ENTRIES.clear()
