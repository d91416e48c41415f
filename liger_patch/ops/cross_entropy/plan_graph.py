"""A call plan's launches captured once as a CUDA graph, then replayed: one launch instead of several.

A call that a plan serves (``one_chunk.OneChunk``) still issues its launches one by one, each
Triton launch binding its arguments on the host. Replayed as a CUDA graph they cost the host one
graph launch and three copies: on an H200 the op's host time a call went from 1.67-2.12 to
1.54-1.89 ms (ten in a row: 1.98-2.04 to 1.62-1.76), eager's being 1.10-1.25 (docs/perf-notes.md
item 66). ``run`` does this for a plain eager call on CUDA:

* The plan's first run notes where the weight is. The next call that finds it there again
  captures the same launches into a graph on a side stream before it runs anything of its own
  (after one warm-up run there: what a stream and thread set up at their first use, such as
  cuBLAS's workspace, must not be captured), reading hidden states, labels and row weights of its
  own, and then replays it for itself: no result of the call is alive while the capture makes
  the graph's, so the capturing call holds no more memory than any other.
* Each later call on the stream the graph was captured for copies its hidden states, labels and
  row weights into the graph's, replays it, and returns the graph's outputs as new tensors that
  share their storage: the same kernels on the same values, so the same bits as ``plan.run``.
* A replay rewrites those outputs, so it is refused (the plan runs as usual) while anything but
  the graph still holds one of them (the use counts of their storages say so: a gradient being
  accumulated in grad_W's buffer, a loss kept from an earlier call), while the weight is not where
  the graph reads it (FSDP2 and ZeRO-3 gather it anew), and on any other stream (whose work the
  caller need not order after the graph's). After ``_MAX_MISSES`` refusals in a row the graph is
  dropped and its signature is not captured again. The use counts see only what the host holds:
  a caller that reads an output on another stream must keep it until that work is done
  (``record_stream`` does not guard a graph's pool).

``GraphCache`` keeps that bookkeeping behind one lock, so that the check that no output is held
and the replay that rewrites them are one step for every thread. What a graph keeps between calls
is its own memory pool: the plan's logits chunk, its row results and gradients. At most
``_MAX_GRAPHS`` are kept: a new one drops the least recently replayed, which may be captured
again (at most ``_MAX_CAPTURES`` times, so that more signatures than graphs taking turns do not
capture at every call); a capture that fails leaves its signature to the plan (with a warning),
and one that runs out of memory also drops every graph. What is known of a signature lasts while
it is among the ``_MAX_ENTRIES`` signatures called last (``bounded``). ``Tuning.call_graphs``
turns graphs on (off by default: see its docstring); a call made while a graph is being captured
by the caller, or on the CPU, never uses them.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from liger_patch.ops.core.bounded import keep_bounded, touched
from liger_patch.ops.cross_entropy.chunk_call import ChunkResult
from liger_patch.ops.cross_entropy.options import LossOptions


class OneChunk(Protocol):
    """What a graph captures: a call plan (``one_chunk.OneChunk``, which imports this module)."""

    def run(
        self, hidden: Tensor, weight: Tensor, labels: Tensor, coef: Tensor | None, opts: LossOptions
    ) -> ChunkResult: ...


class Graph(Protocol):
    """What ``GraphCache`` asks of a captured graph (``PlanGraph``)."""

    plan: OneChunk

    def serves(self, weight: Tensor, stream: Any) -> bool: ...

    def replay(self, hidden: Tensor, labels: Tensor, coef: Tensor | None) -> ChunkResult: ...


_MAX_GRAPHS = 4
_MAX_MISSES = 8
_MAX_CAPTURES = 3
_MAX_ENTRIES = 256


def _use_count(t: Tensor) -> int:
    """How many holders ``t``'s storage has (counted the same way every time: the temporary
    storage object asked counts one)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _static_like(t: Tensor) -> Tensor:
    """An input buffer of ``t``'s shape, strides and dtype on its device (what the plan was made for)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # made under ``GraphCache``'s lock


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream graphs are captured on for ``device``, made once."""
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return side


class PlanGraph:
    """One signature's graph: its plan, the stream it replays on, the weight's address it reads,
    its input buffers, its outputs (a ``ChunkResult`` of its pool's tensors) and their storages'
    use counts when nothing but the graph held them."""

    def __init__(
        self,
        plan: OneChunk,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        coef: Tensor | None,
        opts: LossOptions,
        stream: torch.cuda.Stream,
    ) -> None:
        self.plan, self.stream, self.weight_ptr = plan, stream, weight.data_ptr()
        self.hidden, self.labels = _static_like(hidden), _static_like(labels)
        self.coef = None if coef is None else _static_like(coef)
        self._copy_in(hidden, labels, coef)  # valid values for the warm-up
        side = _side_stream(hidden.device)
        side.wait_stream(stream)
        try:
            with torch.cuda.stream(side):
                self.result = self._captured(weight, opts)
        finally:
            stream.wait_stream(side)  # the warm-up's work
        self.outputs = [t for t in vars(self.result).values() if t is not None and t.numel()]
        self.counts = [_use_count(t) for t in self.outputs]

    def _captured(self, weight: Tensor, opts: LossOptions) -> ChunkResult:
        """The plan run once on the current (side) stream, then captured there: its outputs."""
        args = (self.hidden, weight, self.labels, self.coef, opts)
        self.plan.run(*args)  # what this stream and thread set up at first use is not captured
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(capture_error_mode="thread_local")
        try:
            return self.plan.run(*args)
        finally:
            self.graph.capture_end()

    def serves(self, weight: Tensor, stream: torch.cuda.Stream) -> bool:
        """Whether a replay may run now: on the graph's stream, the weight where the graph reads
        it, and no output held by anything but the graph."""
        if weight.data_ptr() != self.weight_ptr or stream != self.stream:
            return False
        return all(_use_count(t) <= n for t, n in zip(self.outputs, self.counts, strict=True))

    def replay(self, hidden: Tensor, labels: Tensor, coef: Tensor | None) -> ChunkResult:
        """The plan's result for these inputs: copied in, the graph replayed, its outputs shared."""
        self._copy_in(hidden, labels, coef)
        self.graph.replay()
        shared = {name: None if t is None else t.detach() for name, t in vars(self.result).items()}
        return ChunkResult(**shared)

    def _copy_in(self, hidden: Tensor, labels: Tensor, coef: Tensor | None) -> None:
        self.hidden.copy_(hidden)
        self.labels.copy_(labels)
        if coef is not None:
            self.coef.copy_(coef)


@dataclass
class Entry:
    """What ``GraphCache`` knows of one signature: its graph, where its plan's last run found the
    weight (no graph yet), how often it was captured, its refusals in a row, its last replay."""

    graph: Graph | None = None
    weight_ptr: int | None = None
    captures: int = 0
    misses: int = 0
    used: int = 0


class GraphCache:
    """Every signature's graph and what its runs noted, behind one lock. ``capture(plan, hidden,
    weight, labels, coef, opts, stream)`` makes a graph (``PlanGraph`` on CUDA; the tests give
    stand-ins, so this bookkeeping is tested on the CPU too)."""

    def __init__(self, capture: Callable[..., Graph]) -> None:
        self.capture = capture
        self.entries: OrderedDict[tuple, Entry] = OrderedDict()
        self.lock = threading.Lock()
        self.clock = 0

    def run(
        self,
        plan: OneChunk,
        key: tuple,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        coef: Tensor | None,
        opts: LossOptions,
        stream: Any,
    ) -> ChunkResult:
        """``plan.run``'s result for a call of signature ``key`` on ``stream``: replayed from its
        graph where one serves it (captured first where the last plain run found the weight in
        the same place), else run."""
        with self.lock:
            entry = touched(self.entries, key)
            graphed = entry is not None and entry.graph is not None and entry.graph.plan is plan
            if not graphed and self._due(entry, plan, weight):
                # Captured before this call runs anything of its own, then replayed for it: no
                # result of the call is alive while the capture makes the graph's.
                self._capture(entry, plan, (hidden, weight, labels, coef, opts, stream))
                graphed = entry.graph is not None
            if graphed and entry.graph.serves(weight, stream):
                self.clock += 1
                entry.used, entry.misses = self.clock, 0
                return entry.graph.replay(hidden, labels, coef)
            if graphed:
                self._missed(entry)
        res = plan.run(hidden, weight, labels, coef, opts)
        if not graphed:
            with self.lock:
                self._note(key, weight)
        return res

    def graphs(self) -> list[Graph]:
        """The graphs kept now."""
        with self.lock:
            return [e.graph for e in self.entries.values() if e.graph is not None]

    def forget(self) -> None:
        """Drop every graph and what the plans' runs noted."""
        with self.lock:
            self.entries.clear()

    def _missed(self, entry: Entry) -> None:
        """A replay refused: the graph dropped, and its signature not captured again, at the
        ``_MAX_MISSES``-th in a row."""
        entry.misses += 1
        if entry.misses >= _MAX_MISSES:  # the weight keeps moving, or the outputs stay held
            entry.graph, entry.captures = None, _MAX_CAPTURES

    def _due(self, entry: Entry | None, plan: OneChunk, weight: Tensor) -> bool:
        """Whether a call of ``plan`` that no graph serves captures one now: its signature's last
        plain run found the weight where it is now, and it has not been captured too often. A
        graph made for a plan since replaced is dropped."""
        if entry is None:
            return False
        if entry.graph is not None and entry.graph.plan is not plan:
            entry.graph = None
        return (
            entry.graph is None and entry.captures < _MAX_CAPTURES and entry.weight_ptr == weight.data_ptr()
        )

    def _note(self, key: tuple, weight: Tensor) -> None:
        """A plain run of ``key``'s plan: where it found the weight (its next call captures if it
        finds it there again), unless a graph was made for the signature meanwhile."""
        entry = self.entries.get(key)
        if entry is None:
            keep_bounded(self.entries, key, Entry(weight_ptr=weight.data_ptr()), _MAX_ENTRIES)
        elif entry.graph is None:
            entry.weight_ptr = weight.data_ptr()

    def _capture(self, entry: Entry, plan: OneChunk, inputs: tuple) -> None:
        """``entry``'s graph; then the least recently replayed graph beyond ``_MAX_GRAPHS`` dropped."""
        entry.captures, entry.weight_ptr = entry.captures + 1, None
        try:
            graph = self.capture(plan, *inputs)
        except torch.cuda.OutOfMemoryError:  # the memory is wanted elsewhere: keep no graph
            for other in self.entries.values():
                other.graph = None
            entry.captures = _MAX_CAPTURES
            return
        except Exception as error:  # something in the plan cannot be captured here
            entry.captures = _MAX_CAPTURES
            warnings.warn(
                f"liger_patch: a call plan could not be captured as a CUDA graph ({error!r}); "
                "its calls run the plan's launches one by one",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        self.clock += 1
        entry.graph, entry.misses, entry.used = graph, 0, self.clock
        kept = [e for e in self.entries.values() if e.graph is not None]
        if len(kept) > _MAX_GRAPHS:
            min(kept, key=lambda e: e.used).graph = None


_GRAPHS = GraphCache(PlanGraph)


def run(
    plan: OneChunk,
    key: tuple,
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    coef: Tensor | None,
    opts: LossOptions,
) -> ChunkResult:
    """``plan.run``'s result for a plain eager call of signature ``key``, from its graph where
    graphs are on (``Tuning.call_graphs``), the call is on CUDA and the caller is not capturing."""
    if not (opts.tuning.call_graphs and hidden.is_cuda) or torch.cuda.is_current_stream_capturing():
        return plan.run(hidden, weight, labels, coef, opts)
    stream = torch.cuda.current_stream(hidden.device)
    return _GRAPHS.run(plan, key, hidden, weight, labels, coef, opts, stream)


def forget() -> None:
    """Drop every graph and what the plans' runs noted."""
    _GRAPHS.forget()
