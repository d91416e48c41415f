"""A call's device work captured once as a CUDA graph, then replayed: one launch instead of many.

A plain eager call of a fused loss issues its launches one by one, and around them the host runs
the call's Python: its label check, its chunk plan, its loss. Where a call's signature (the
``signature`` of ``cross_entropy/graphed_forward.py`` or ``distillation/graphed_forward.py``)
says that every call like it takes the same decisions, the whole forward is captured as a CUDA
graph and later calls replay it: the host copies the call's inputs into the graph's, launches the
graph and reads its outputs, and none of that Python runs (docs/perf-notes.md item 74). ``run``
does this for a plan (``Graphable``: ``core/graphed_forward.GraphedForward``) of a call on CUDA:

* The plan's first plain run of a signature notes where the weight is. The next call that finds
  it there again captures the plan on a side stream before it runs anything of its own (after
  one warm-up run there: what a stream and thread set up at their first use, such as cuBLAS's
  workspace, must not be captured; the warm-up allocates from the graph's own pool, whose freed
  blocks the capture then takes, so that none stays cached for the side stream), reading inputs
  of its own, and then replays it for itself: no result of the call is alive while the capture
  makes the graph's, so the capturing call holds no more memory than any other.
* Each later call on the stream the graph was captured for copies its inputs into the graph's,
  replays it, and gets the graph's outputs as new tensors that share their storage (the plan's
  ``replayed`` copies what a caller keeps, such as the loss): the same kernels on the same
  values, so the same bits as the plain run.
* A replay rewrites those outputs, so it is refused (the plan runs plainly) while anything but
  the graph still holds one of them (the use counts of their storages say so: a leaf's kept
  gradient, a node's saved tensors before its backward; outputs a plan makes after each replay,
  such as a weight's gradient, ``graphed_forward.Later``, are not the graph's), while the weight
  is not where the graph reads it (FSDP2 and ZeRO-3 gather it anew), and on any other stream
  (whose work the caller need not order after the graph's). A weight that moved and is found
  where it moved to by the next call too, with no replay between (a model loaded anew), has the
  graph captured again there. After ``_MAX_MISSES`` refusals in a row the graph is dropped and
  its signature is not captured again. The use counts see only what the host holds: a caller
  that reads an output on another stream must keep it until that work is done
  (``record_stream`` does not guard a graph's pool).

``GraphCache`` keeps that bookkeeping behind one lock, so that the check that no output is held
and the replay that rewrites them are one step for every thread. What a graph keeps between calls
is its own memory pool: what the forward allocated, its logits chunks, row results and gradients.
At most ``_MAX_GRAPHS`` are kept: a new one drops the least recently replayed, which may be
captured again (at most ``_MAX_CAPTURES`` times, so that more signatures than graphs taking turns
do not capture at every call); a capture that fails leaves its signature to the plain run (with a
warning), and one that runs out of memory also drops every graph. What is known of a signature
lasts while it is among the ``_MAX_ENTRIES`` signatures called last (``bounded``).
``Tuning.call_graphs`` turns graphs on (off by default: see its docstring).
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
from liger_patch.ops.core.contexts import on_device


class Graphable(Protocol):
    """What a graph captures, for calls whose inputs are a tuple
    (``graphed_forward.GraphedForward``).

    ``run(*inputs)``: the plain run. ``static(*inputs)``: inputs of the graph's own, with the
    call's values (what a replay copies new values into); ``copy_in(static, inputs)``: copies
    them. ``captured(*static)``: the run as a graph captures it, its result (what ``replayed``
    reads) and the tensors of it that a replay hands out (each refused while held).
    ``replayed(inputs, result)``: the call's outputs from a replay's result. ``buffers(static)``:
    what of ``static`` the graph keeps once captured, what ``copy_in`` writes: a tensor it only
    reads where it is (a weight) must not be kept alive by the graph, or a weight made anew at
    each call (an autocast copy, a gathered shard) could never come back to that address."""

    def run(self, *inputs: Any) -> Any: ...

    def static(self, *inputs: Any) -> tuple: ...

    def copy_in(self, static: tuple, inputs: tuple) -> None: ...

    def captured(self, *static: Any) -> tuple[Any, list[Tensor]]: ...

    def replayed(self, inputs: tuple, result: Any) -> Any: ...

    def buffers(self, static: tuple) -> tuple: ...


class Graph(Protocol):
    """What ``GraphCache`` asks of a captured graph (``CallGraph``)."""

    plan: Graphable
    weight_ptr: int

    def serves(self, weight: Tensor, stream: Any) -> bool: ...

    def replay(self, inputs: tuple) -> Any: ...


_MAX_GRAPHS = 4
_MAX_MISSES = 8
_MAX_CAPTURES = 3
_MAX_ENTRIES = 256


def _use_count(t: Tensor) -> int:
    """How many holders ``t``'s storage has (counted the same way every time: the temporary
    storage object asked counts one)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # made under ``GraphCache``'s lock


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream graphs are captured on for ``device``, made once."""
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return side


def _warm_blas(weight: Tensor) -> None:
    """cuBLAS's workspace for the current stream, made now by a tiny GEMM (once a stream: later
    calls find it): made inside a graph's warm-up, it would stay in the graph's pool for good."""
    tiny = torch.ones(2, 2, dtype=weight.dtype, device=weight.device)
    torch.mm(tiny, tiny)


class CallGraph:
    """One signature's graph: its plan, the stream it replays on, the weight's address it reads,
    its inputs, its result, the tensors a replay hands out and their storages' use counts when
    nothing but the graph held them."""

    def __init__(self, plan: Graphable, weight: Tensor, stream: torch.cuda.Stream, inputs: tuple) -> None:
        self.plan, self.stream, self.weight_ptr = plan, stream, weight.data_ptr()
        self.static = plan.static(*inputs)  # with the call's values, for the warm-up
        side = _side_stream(weight.device)
        side.wait_stream(stream)
        with on_device(weight.device):  # a pool belongs to the device current at its making
            self.pool = torch.cuda.MemPool()  # the warm-up's memory and then the graph's
        try:
            with torch.cuda.stream(side):
                _warm_blas(weight)
                # What this stream and thread set up at first use; its memory, freed, is what
                # the capture reuses (elsewhere it would stay cached for the side stream).
                with torch.cuda.use_mem_pool(self.pool, device=weight.device):
                    plan.captured(*self.static)
                self.graph = torch.cuda.CUDAGraph()
                self.graph.capture_begin(pool=self.pool.id, capture_error_mode="thread_local")
                try:
                    self.result, handed = plan.captured(*self.static)
                finally:
                    self.graph.capture_end()
        finally:
            stream.wait_stream(side)  # the warm-up's work
        self.static = plan.buffers(self.static)
        self.outputs = [t for t in handed if t.numel()]
        self.counts = [_use_count(t) for t in self.outputs]

    def serves(self, weight: Tensor, stream: torch.cuda.Stream) -> bool:
        """Whether a replay may run now: on the graph's stream, the weight where the graph reads
        it, and no output held by anything but the graph."""
        if weight.data_ptr() != self.weight_ptr or stream != self.stream:
            return False
        return all(_use_count(t) <= n for t, n in zip(self.outputs, self.counts, strict=True))

    def replay(self, inputs: tuple) -> Any:
        """The plan's outputs for these inputs: copied in, the graph replayed, its result read."""
        self.plan.copy_in(self.static, inputs)
        self.graph.replay()
        return self.plan.replayed(inputs, self.result)


@dataclass
class Entry:
    """What ``GraphCache`` knows of one signature: its graph, where its plan's last plain run found
    the weight (``None`` once a capture or a replay came after it), how often it was captured,
    its refusals in a row, its last replay."""

    graph: Graph | None = None
    weight_ptr: int | None = None
    captures: int = 0
    misses: int = 0
    used: int = 0


class GraphCache:
    """Every signature's graph and what its runs noted, behind one lock. ``capture(plan, weight,
    stream, inputs)`` makes a graph (``CallGraph`` on CUDA; the tests give stand-ins, so this
    bookkeeping is tested on the CPU too)."""

    def __init__(self, capture: Callable[..., Graph]) -> None:
        self.capture = capture
        self.entries: OrderedDict[tuple, Entry] = OrderedDict()
        self.lock = threading.Lock()
        self.clock = 0

    def run(self, plan: Graphable, key: tuple, weight: Tensor, stream: Any, inputs: tuple) -> Any:
        """``plan.run(*inputs)``'s result for a call of signature ``key`` on ``stream`` reading
        ``weight``: replayed from its graph where one serves it (captured first where the last
        plain run found the weight in the same place), else run."""
        with self.lock:
            entry = touched(self.entries, key)
            if self._due(entry, plan, weight):
                # Captured before this call runs anything of its own, then replayed for it: no
                # result of the call is alive while the capture makes the graph's.
                self._capture(entry, plan, weight, stream, inputs)
            graphed = entry is not None and entry.graph is not None
            if graphed and entry.graph.serves(weight, stream):
                self.clock += 1  # and a weight noted elsewhere before is no longer "found twice"
                entry.used, entry.misses, entry.weight_ptr = self.clock, 0, None
                return entry.graph.replay(inputs)
            if graphed:
                self._missed(entry)
        res = plan.run(*inputs)
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

    def _due(self, entry: Entry | None, plan: Graphable, weight: Tensor) -> bool:
        """Whether a call of ``plan`` captures a graph now: none reads the weight where it is now
        (none was made, or the one made reads it elsewhere), the signature's last plain run found
        it there too with no replay since, and the signature has not been captured too often. A
        graph made for a plan since replaced is dropped."""
        if entry is None:
            return False
        if entry.graph is not None and entry.graph.plan is not plan:
            entry.graph = None
        here = weight.data_ptr()
        if entry.graph is not None and entry.graph.weight_ptr == here:
            return False
        return entry.captures < _MAX_CAPTURES and entry.weight_ptr == here

    def _note(self, key: tuple, weight: Tensor) -> None:
        """A plain run of ``key``'s plan: where it found the weight (its next call captures if it
        finds it there again and no graph reads it there)."""
        entry = self.entries.get(key)
        if entry is None:
            keep_bounded(self.entries, key, Entry(weight_ptr=weight.data_ptr()), _MAX_ENTRIES)
        else:
            entry.weight_ptr = weight.data_ptr()

    def _capture(self, entry: Entry, plan: Graphable, weight: Tensor, stream: Any, inputs: tuple) -> None:
        """``entry``'s graph (one it had, reading the weight elsewhere, dropped first: its memory
        is freed before the new one takes its own); then the least recently replayed graph beyond
        ``_MAX_GRAPHS`` dropped."""
        entry.graph, entry.captures, entry.weight_ptr = None, entry.captures + 1, None
        try:
            graph = self.capture(plan, weight, stream, inputs)
        except torch.cuda.OutOfMemoryError:  # the memory is wanted elsewhere: keep no graph
            for other in self.entries.values():
                other.graph = None
            entry.captures = _MAX_CAPTURES
            return
        except Exception as error:  # something in the plan cannot be captured here
            entry.captures = _MAX_CAPTURES
            warnings.warn(
                f"liger_patch: a call could not be captured as a CUDA graph ({error!r}); "
                "its calls run without one",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        self.clock += 1
        entry.graph, entry.misses, entry.used = graph, 0, self.clock
        kept = [e for e in self.entries.values() if e.graph is not None]
        if len(kept) > _MAX_GRAPHS:
            min(kept, key=lambda e: e.used).graph = None


_GRAPHS = GraphCache(CallGraph)


def run(plan: Graphable, key: tuple, weight: Tensor, inputs: tuple) -> Any:
    """``plan.run(*inputs)``'s result for a plain eager CUDA call of signature ``key`` (one that
    ``Tuning.call_graphs`` lets use graphs, made while nothing is captured), reading ``weight``:
    from its graph where one serves it."""
    return _GRAPHS.run(plan, key, weight, torch.cuda.current_stream(weight.device), inputs)


def forget() -> None:
    """Drop every graph and what the plans' runs noted."""
    _GRAPHS.forget()
