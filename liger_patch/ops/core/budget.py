"""Memory budget -> chunk plan: pure arithmetic, no tensors, tested directly.

The fused loss holds at most one ``rows x V`` logits chunk at a time (or, on the two-pass path,
one ``tokens x cols`` vocabulary block). How many rows a chunk gets follows from the working
memory budget; this module turns a budget into that plan, and ``chunked.run_chunks`` executes it.

The budget a call uses (``resolve_budget``) is its ``memory_budget`` option, else the
``LIGER_MEMORY_BUDGET`` environment variable (read on every call), else ``"default"``; a patched
model's forward passes ``"batch"`` when neither names one (``batch_budget``). It covers
everything the op allocates beyond its inputs, outputs and gradients: the chunk buffers, about
``PER_TOKEN_BYTES`` per token of per-token vectors and ``SLACK_BYTES``; ``working_bytes`` is what
is left for the chunk buffers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from liger_patch import env
from liger_patch.ops.core.tuning import Tuning

MiB = 1 << 20
MEMORY_BUDGETS = {"default": 512 * MiB, "lean": 32 * MiB}
"""Named memory budgets: bytes of working memory the op may use beyond its inputs, outputs and
gradients. ``default`` gives token chunks large enough for cuBLAS to run near its peak; ``lean``
is cut-cross-entropy's memory class (docs/loss.md has the measured speed of each)."""
DEFAULT_MEMORY_BUDGET = "default"
"""The budget of a call that passes none while ``LIGER_MEMORY_BUDGET`` is unset: 512 MiB."""
BATCH_BUDGET = "batch"
"""The named budget sized by the call's hidden states (:func:`batch_budget`)."""
BATCH_FACTOR = 6
BATCH_RANGE = (256 * MiB, 1024 * MiB)

PER_TOKEN_BYTES = 40
"""Per-token vectors the op keeps beside its chunks (labels, masks, row weights, loss terms, the
kept rows' index)."""
SLACK_BYTES = 2 << 20
"""Allocator rounding and cuBLAS workspace seen beside the chunks on an H200 (about 1 MiB)."""

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": MiB, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


def batch_budget(hidden_bytes: int | None, whole_bytes: int | None = None) -> int:
    """The ``"batch"`` budget of a call whose hidden states take ``hidden_bytes``: six times
    that, within 256 MiB to 1 GiB (1 GiB, its most, when the size is not known); and at least
    ``whole_bytes``, what the call needs to run as one chunk (:func:`one_chunk_bytes`), when that
    is within 1 GiB.

    In a training step the loss head runs while the decoder's activations are held, and the
    decoder's backward later peaks at about eight times the hidden states' bytes above the live
    set the forward leaves (Llama-1B at 16k tokens, Qwen2.5-0.5B at 32k; docs/perf-notes.md item
    30). The head holds the hidden states themselves beside its working memory, so six times
    keeps it under that peak, where a fixed 512 MiB set the step's peak in both; and a large
    batch gets larger chunks, which are faster, at no cost to the step's peak. The floor keeps
    small batches out of small chunks, which cost more time than their memory saves.

    A small call runs as one chunk: each chunk costs about 0.3 ms of host time (launches and
    Python; ``benchmarks/experiments/op_host_time.py``), which a CPU-bound step (DeepSpeed at a
    small model) pays in full. At 4x1024 tokens with H=1024 under ZeRO-3 on two GPUs, one
    chunk made the step 3-5 % faster than four at 256 MiB, for 0.56 GiB more at its peak
    (docs/perf-notes.md item 31)."""
    low, high = BATCH_RANGE
    if hidden_bytes is None:
        return high
    sized = min(high, max(low, BATCH_FACTOR * hidden_bytes))
    if whole_bytes is not None and whole_bytes <= high:
        return max(sized, whole_bytes)
    return sized


def one_chunk_bytes(
    n_rows: int, n_tokens: int, vocab: int, logit_bytes: int, hidden: int, operand_bytes: int
) -> int:
    """The budget under which a call of ``n_tokens`` tokens runs the ``n_rows`` rows it walks as
    one chunk: their logits, the gathered rows' hidden states and grad_h, log-sum-exp partials
    (at most three fp32 per 256 columns: under ``vocab // 16`` bytes a row), and the per-token
    vectors and the slack that :func:`working_bytes` sets aside."""
    per_row = vocab * logit_bytes + vocab // 16 + 2 * hidden * operand_bytes
    return n_rows * per_row + n_tokens * PER_TOKEN_BYTES + SLACK_BYTES


def parse_memory_budget(
    value: int | str, hidden_bytes: int | None = None, whole_bytes: int | None = None
) -> int:
    """Bytes for a memory budget given as a positive int (bytes), a name in ``MEMORY_BUDGETS``,
    ``"batch"`` (:func:`batch_budget` of ``hidden_bytes`` and ``whole_bytes``), or a size string such as
    ``"256MiB"``, ``"1GiB"``, ``"64MB"``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"memory_budget must be an int number of bytes or a string, got {value!r}")
    name = value.strip().lower() if isinstance(value, str) else None
    if isinstance(value, int):
        nbytes = value
    elif name in MEMORY_BUDGETS:
        return MEMORY_BUDGETS[name]
    elif name == BATCH_BUDGET:
        return batch_budget(hidden_bytes, whole_bytes)
    else:
        match = _SIZE.match(value.lower())
        if match is None or match.group(2) not in _UNITS:
            names = sorted([*MEMORY_BUDGETS, BATCH_BUDGET])
            raise ValueError(f"memory_budget {value!r} is not one of {names} or a size such as '256MiB'")
        nbytes = int(float(match.group(1)) * _UNITS[match.group(2)])
    if nbytes <= 0:
        raise ValueError(f"memory_budget must be positive, got {value!r}")
    return nbytes


def resolve_budget(
    memory_budget: int | str | None, hidden_bytes: int | None = None, whole_bytes: int | None = None
) -> int:
    """Bytes of a call's budget: its option, else ``LIGER_MEMORY_BUDGET`` (read now), else the
    default; ``hidden_bytes`` (the call's hidden states) and ``whole_bytes`` (one chunk of the
    call) size ``"batch"``."""
    if memory_budget is not None:
        return parse_memory_budget(memory_budget, hidden_bytes, whole_bytes)
    from_env = env.memory_budget()
    if from_env is None:
        return parse_memory_budget(DEFAULT_MEMORY_BUDGET)
    try:
        return parse_memory_budget(from_env, hidden_bytes, whole_bytes)
    except ValueError as exc:
        raise ValueError(f"environment variable LIGER_MEMORY_BUDGET={from_env!r}: {exc}") from None


def working_bytes(
    memory_budget: int | str | None,
    n_tokens: int,
    hidden_bytes: int | None = None,
    whole_bytes: int | None = None,
) -> int:
    """What the chunk buffers may use: the resolved budget less the per-token vectors and the
    slack, so that everything the op allocates stays inside it (at least one byte: one row)."""
    resolved = resolve_budget(memory_budget, hidden_bytes, whole_bytes)
    return max(1, resolved - PER_TOKEN_BYTES * n_tokens - SLACK_BYTES)


def chunk_rows(
    width: int, budget_bytes: int, element_bytes: int, tuning: Tuning, n_rows: int | None = None
) -> int:
    """Rows of ``width`` elements that fit ``budget_bytes`` (at least one), or ``tuning.chunk_rows``.

    With ``tuning.balanced_chunks`` and the ``n_rows`` to split: :func:`balanced_rows`.

    Unless they hold all ``n_rows``, rounded down to a multiple of 256 from 512 rows up (of 128
    from 256): cuBLAS tiles the chunk GEMMs 256 rows at a time, and a part-filled tile row costs
    a whole one. Measured on an H200
    at N=32768, H=4096, V=151936 (docs/perf-notes.md): 1664 rows 202 ms, 1536 rows 192 ms.
    """
    if tuning.chunk_rows is not None:
        return tuning.chunk_rows
    rows = max(1, budget_bytes // (element_bytes * max(width, 1)))
    if n_rows is not None and rows >= n_rows:
        return rows  # one chunk of every row: rounding down would only add a remainder chunk
    if tuning.balanced_chunks and n_rows is not None:
        return balanced_rows(n_rows, rows)
    if rows >= 512:
        return rows - rows % 256
    return rows - rows % 128 if rows >= 256 else rows


def balanced_rows(n_rows: int, max_rows: int, align: int = 128) -> int:
    """Rows per chunk that split ``n_rows`` into the fewest chunks of at most ``max_rows`` rows
    (a multiple of ``align`` from 256 rows up): the smallest such size that keeps that count,
    so the last chunk is as little short of the others as the alignment allows. ``max_rows``
    when everything fits in one chunk."""
    if n_rows <= max_rows:
        return max_rows
    chunks = -(-n_rows // max_rows)
    while True:
        rows = -(-n_rows // chunks)
        if rows >= 256:
            rows = -(-rows // align) * align
        if rows <= max_rows:
            return rows
        chunks += 1


@dataclass(frozen=True)
class ChunkShape:
    """What the planner needs to know of a call: sizes, byte widths and which gradients it computes."""

    n_rows: int
    vocab: int
    weight_numel: int
    weight_bytes: int  # bytes per weight element (also grad_W's)
    logit_bytes: int  # bytes per stored logit
    gemm_fp32: bool  # the GEMMs run in fp32 (the CPU)
    partial_bytes_per_row: int = 0  # log-sum-exp partials the fused logits GEMM leaves per row
    grad_weight: bool = False  # grad_W is computed here
    gather_bytes_per_row: int = 0  # a chunk of gathered rows' hidden states and grad_h, per row
    operand_bytes: int = 0  # bytes per element of the hidden states, which the GEMMs round the
    # weight to (narrower than the weight under autocast: an fp32 weight, bf16 GEMMs); 0: weight_bytes

    @property
    def hidden_bytes(self) -> int:
        """Bytes per element of the hidden states (``operand_bytes``, else the weight's)."""
        return self.operand_bytes or self.weight_bytes

    @property
    def gemm_bytes(self) -> int:
        """Bytes per element of the GEMMs' copy of the weight (fp32 on the CPU)."""
        return 4 if self.gemm_fp32 else self.hidden_bytes


@dataclass(frozen=True)
class ChunkPlan:
    """How ``run_chunks`` walks the tokens.

    ``rows`` per token chunk. ``two_pass``: token chunks compute the loss and grad_h only, and
    pass B walks ``vocab_blocks`` ``(v0, v1, in_grad_weight)`` for grad_W. ``logits_in_grad_weight``:
    pass A keeps its logits chunks in grad_W's bytes (free until pass B), which allows larger
    chunks. ``grad_weight_fp32``: the token-chunk sum of grad_W is kept in fp32 (else in the
    hidden states' dtype, whose first chunk overwrites instead of adding: ``overwrite_first``).

    ``weight_in_grad_weight``: the GEMMs' copy of a weight twice as wide as they are (an fp32
    weight under bf16 autocast) lives in grad_W's second half, and grad_W's first half holds
    the token chunks' sum (one pass, widened in place at the end) or pass A's logits (two
    passes, whose pass B overwrites the copy only behind the block it has used). The copy then
    costs no memory beyond grad_W.
    """

    rows: int
    two_pass: bool = False
    logits_in_grad_weight: bool = False
    grad_weight_fp32: bool = True
    overwrite_first: bool = False
    vocab_blocks: tuple[tuple[int, int, bool], ...] = ()
    weight_in_grad_weight: bool = False


ALIGN = 16
"""Bytes: a chunk buffer laid over grad_W starts at this boundary (``grad_weight_layout.buffer_in``),
which keeps cuBLAS on its vectorised kernels and any dtype view legal; pass B's plan leaves room
for it."""


def _rows_within(shape: ChunkShape, budget: int, tuning: Tuning) -> int:
    """Token rows per chunk within ``budget``, where the fused GEMM's partials and the gathered
    rows' buffers share it with the chunk."""
    part = shape.partial_bytes_per_row + shape.gather_bytes_per_row
    chunk_budget = budget - budget * part // (shape.vocab * shape.logit_bytes + part)
    return chunk_rows(shape.vocab, chunk_budget, shape.logit_bytes, tuning, shape.n_rows)


def _copy_fits_half(shape: ChunkShape) -> bool:
    """Whether the GEMMs' copy of the weight can fill exactly grad_W's second half, starting at
    an ``ALIGN``-byte boundary: it is half as wide as grad_W (an fp32 weight under bf16
    autocast, or fp64 with fp32 GEMMs)."""
    half = shape.weight_numel * shape.gemm_bytes
    return shape.grad_weight and shape.weight_bytes == 2 * shape.gemm_bytes and half % ALIGN == 0


def plan_chunks(shape: ChunkShape, budget_bytes: int, tuning: Tuning) -> ChunkPlan:
    """The chunk plan of a call that may use ``budget_bytes`` of working memory."""
    rows = _rows_within(shape, budget_bytes, tuning)
    two_pass = tuning.two_pass
    if two_pass is None:
        two_pass = rows < tuning.min_token_chunk_rows < shape.n_rows
    if not shape.grad_weight:
        return ChunkPlan(rows=rows)
    if two_pass:
        # Pass A may keep its chunks in grad_W's bytes (the first half of them when the weight's
        # copy takes the second); the partials still come out of the budget.
        copy_inside = _copy_fits_half(shape)
        scratch_bytes = shape.weight_numel * (shape.gemm_bytes if copy_inside else shape.weight_bytes)
        scratch_rows = min(shape.n_rows, scratch_bytes // (shape.vocab * shape.logit_bytes))
        if shape.partial_bytes_per_row:
            scratch_rows = min(scratch_rows, max(1, budget_bytes // shape.partial_bytes_per_row))
        in_grad_weight = scratch_rows > rows
        return ChunkPlan(
            rows=scratch_rows if in_grad_weight else rows,
            two_pass=True,
            logits_in_grad_weight=in_grad_weight,
            grad_weight_fp32=False,
            vocab_blocks=vocab_blocks(shape, budget_bytes, tuning, grad_weight_room=not copy_inside),
            weight_in_grad_weight=copy_inside,
        )
    # Half GEMMs on a GPU sum grad_W in the hidden states' dtype (one rounding per chunk; one
    # chunk is one rounding, as in an unpatched head), with chunks as large as the budget allows:
    # an fp32 copy would take budget from the chunks and double grad_W's traffic per chunk (item 25).
    fp32 = tuning.fp32_grad_weight
    if fp32 is None:
        fp32 = shape.gemm_fp32
    if fp32 and not shape.gemm_fp32 and shape.weight_bytes != 4:  # an fp32 sum beside grad_W
        rest = budget_bytes - 4 * shape.weight_numel
        rows = max(1, _rows_within(shape, rest, tuning) if rest > 0 else 0)
    sum_bytes = 4 if fp32 else shape.hidden_bytes
    return ChunkPlan(
        rows=rows,
        grad_weight_fp32=fp32,
        overwrite_first=not fp32 and shape.n_rows > 0,
        weight_in_grad_weight=_copy_fits_half(shape) and sum_bytes == shape.gemm_bytes,
    )


def vocab_blocks(
    shape: ChunkShape, budget_bytes: int, tuning: Tuning, grad_weight_room: bool = True
) -> tuple[tuple[int, int, bool], ...]:
    """Pass B's vocabulary blocks ``(v0, v1, in_grad_weight)``.

    A block's ``tokens x cols`` logits live in the rows of grad_W that are still unwritten (those
    after the block) while they are large enough, which makes the early blocks wide; the last
    ones use a buffer of ``budget_bytes``. Without ``grad_weight_room`` (the weight's copy fills
    those rows) every block uses the buffer.
    """
    n_rows, vocab = shape.n_rows, shape.vocab
    row_bytes = shape.weight_numel // max(vocab, 1) * shape.weight_bytes
    budget_cols = chunk_rows(n_rows, budget_bytes, shape.logit_bytes, tuning)
    if not grad_weight_room:
        return tuple((v0, min(v0 + budget_cols, vocab), False) for v0 in range(0, vocab, budget_cols))
    blocks = []
    v0 = 0
    while v0 < vocab:
        # cols * tokens * logit_bytes + alignment <= (vocab - v0 - cols) * row_bytes
        cols = max(0, (vocab - v0) * row_bytes - ALIGN) // (n_rows * shape.logit_bytes + row_bytes)
        cols -= cols % 128 if cols >= 256 else 0
        if cols > budget_cols:
            blocks.append((v0, v0 + cols, True))
        else:
            blocks.append((v0, min(v0 + budget_cols, vocab), False))
        v0 = blocks[-1][1]
    return tuple(blocks)
