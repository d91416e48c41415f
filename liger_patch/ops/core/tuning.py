"""``Tuning``: the measured knobs of the fused loss, in one object that callers pass in.

Every default here was measured on an H200 (the item numbers are those of docs/perf-notes.md).
Nothing reads a module-level switch: tests and benchmarks that want another setting pass
``tuning=Tuning(...)`` to the op (or to ``apply_liger_to``) instead of patching a module.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Tuning:
    """How the fused loss runs; never what it computes (every setting gives the same result to
    rounding).

    Attributes:
        fused_logits: compute token chunks' logits with the Triton GEMM that also leaves the
            log-sum-exp partials, where the hardware and the chunk allow it. Items 19-20: the
            whole op gained 0.4-0.9 ms at the four benchmark shapes (interleaved A/B,
            ``benchmarks/experiments/results/chunk_sweep.json``, key ``fused_ab``).
        reverse_pass2: the Triton row kernel's second pass walks each row backwards, so the
            blocks its first pass read last are still in L2 (``benchmarks/experiments/chunk_sweep.py``).
        row_block: the Triton row kernel's largest block of columns per step; a row narrower
            than this uses the next power of two (at least 128).
        row_warps: ``(block at least, warps)`` pairs, first match wins: the warps per row for
            a given block. Measured at V=128256: 8192 x 16 warps was the best of five.
        logits_tiles: the fused logits GEMM's ``(BM, BN, BK, stages, warps)``; item 19: the
            best of those tried on an H100 and an H200.
        min_token_chunk_rows: below this many rows per token chunk the two-pass path computes
            grad_W instead: a grad_W GEMM over 512-row chunks already costs ~30 % more than one
            over all tokens, and each halving of the chunk adds a full extra pass over grad_W.
        chunk_rows: when set, every chunk the budget would size gets exactly this many rows
            (token chunks) or columns (pass B's vocabulary blocks). For tests and sweeps.
        two_pass: force the two-pass path on (``True``) or off (``False``); ``None`` applies
            ``min_token_chunk_rows``.
        balanced_chunks: split the tokens into as few chunks as the budget allows, all of
            nearly one size (a multiple of 128 rows), instead of budget-sized chunks (a multiple
            of 256 rows) and a remainder: N=8192 at V=152064 runs as 5 chunks of 1664 rows
            rather than 5 of 1536 and one of 512. Item 26: no consistent gain over the grid
            (-5 % to +3 %), so off.
        fp32_grad_weight: accumulate grad_W across token chunks in fp32 (``True``) or in the
            weight's dtype (``False``); ``None``: fp32 where the GEMMs run in fp32 (the CPU),
            the weight's dtype elsewhere (item 3: the weight-dtype sum saved 3.7 ms and 1.5 GiB
            at N=8192, V=128256; item 25: at H=2048, V=49152, where an fp32 copy fits beside
            the chunks, it cost 1.22-1.34x the floor against 1.15x for the weight-dtype sum).
        skip_ignored_share: when at least this share of a forward's labels is ``ignore_index``,
            its token chunks gather the kept rows and skip the ignored ones, so every GEMM
            shrinks by that share (item 28); below it, the gathers would cost more than the rows
            they save. ``1.0`` or more turns skipping off; ``0.0`` skips any ignored row.
        wait_to_skip_gflop: on CUDA, a forward whose label check has not answered when its token
            pass starts waits for it (a host sync: the host loses its lead on the GPU) only to
            skip the ignored rows, and only when that saves at least this many GFLOP of its
            GEMMs at the share of ignored labels the last read check of its shape saw (unknown:
            all); otherwise it walks every row, weighing ignored ones 0, and the check is read
            later (``kept_rows``). Issue 43 (benchmarks/experiments/wait_to_skip_ab.py, H200, 20 %
            ignored): waiting to skip gained 8-15 % of a call from about 330-650 GFLOP saved and
            lost up to 27 % below. ``0``: always wait for the check, as before issue 43.
        head_start_gflop: about this many GFLOP of the first token chunk's fused logits GEMM
            are launched before the forward waits for its label check (``head_start.py``), so
            the GPU computes while the host waits and sets up the chunk loop; ``0`` turns it
            off. Item 37: the wait cost 0.3-0.5 ms a call on an H100 (item 35); 300 GFLOP is
            about 0.5 ms of the GEMM there.
        call_plans: a forward that runs as one token chunk of every row on the fused logits
            GEMM takes its chunk loop's decisions once per signature and then issues only its
            launches (``cross_entropy/one_chunk.py``): the same bits, less host time a call
            (item 63). ``False``: every call takes them again.
        call_graphs: on CUDA, a plain eager forward of either loss that does not wait for its
            label check is captured whole (label check, chunk loop, loss) as a CUDA graph at
            its signature's second call, and later calls replay it (``core/call_graph.py``,
            ``core/graphed_forward.py``): the same bits, and on an H200 a cross-entropy call's
            host time 0.1-0.5 ms above eager's instead of 0.9-2.1 ms at 256-1,024 tokens
            (items 70, 74), a distillation call's 1.5-1.8 ms, below eager's 2.2-2.8, instead
            of 2.3-5.2 (item 75), at the cost of the memory each graph keeps between calls
            (what its forward allocates: its logits chunks, row results and grad_h, and
            grad_W for a forward of several chunks; at most four graphs) and a capture for
            each signature seen twice (item 78). A replay runs only on the stream its graph was
            captured for, one thread at a time. Off by default, for that memory and those
            captures.
        check_labels_ahead: a caller that knows a forward's labels before its loss (a patched
            model, before its body runs: ``functional.check_labels_ahead``) queues the loss's
            label check then (``core/early_checks.py``), so a forward that waits for it to skip
            the ignored rows finds it answered instead of waiting for the whole body's GPU
            work. The same check, decisions and bits; ``False``: the check is queued by the
            loss's own forward.
    """

    fused_logits: bool = True
    reverse_pass2: bool = True
    row_block: int = 8192
    row_warps: tuple[tuple[int, int], ...] = ((8192, 16), (2048, 8), (0, 4))
    logits_tiles: tuple[int, int, int, int, int] = (128, 256, 64, 3, 8)
    min_token_chunk_rows: int = 512
    chunk_rows: int | None = None
    two_pass: bool | None = None
    fp32_grad_weight: bool | None = None
    balanced_chunks: bool = False
    skip_ignored_share: float = 0.05
    wait_to_skip_gflop: float = 400.0
    head_start_gflop: float = 300.0
    call_plans: bool = True
    call_graphs: bool = False
    check_labels_ahead: bool = True

    def __post_init__(self) -> None:
        flags = ("fused_logits", "reverse_pass2", "balanced_chunks", "call_plans", "call_graphs")
        for name in (*flags, "check_labels_ahead"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Tuning.{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("two_pass", "fp32_grad_weight"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"Tuning.{name} must be None, True or False, got {getattr(self, name)!r}")
        for name in ("row_block", "min_token_chunk_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Tuning.{name} must be an int >= 0, got {value!r}")
        if self.chunk_rows is not None and (
            isinstance(self.chunk_rows, bool) or not isinstance(self.chunk_rows, int) or self.chunk_rows < 1
        ):
            raise ValueError(f"Tuning.chunk_rows must be None or an int >= 1, got {self.chunk_rows!r}")
        if not self.row_warps or any(len(pair) != 2 for pair in self.row_warps):
            raise ValueError(
                f"Tuning.row_warps must be (block at least, warps) pairs, got {self.row_warps!r}"
            )
        share = self.skip_ignored_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not share >= 0:
            raise ValueError(f"Tuning.skip_ignored_share must be a number >= 0, got {share!r}")
        gflop = self.head_start_gflop
        if isinstance(gflop, bool) or not isinstance(gflop, (int, float)) or not 0 <= gflop < math.inf:
            raise ValueError(f"Tuning.head_start_gflop must be a finite number >= 0, got {gflop!r}")
        saved = self.wait_to_skip_gflop
        if isinstance(saved, bool) or not isinstance(saved, (int, float)) or not saved >= 0:
            raise ValueError(f"Tuning.wait_to_skip_gflop must be a number >= 0 (inf: never), got {saved!r}")
        if len(self.logits_tiles) != 5:
            raise ValueError(
                f"Tuning.logits_tiles must be (BM, BN, BK, stages, warps), got {self.logits_tiles!r}"
            )

        # Every setting as one string (not a field): how options travel into a compiled graph,
        # where torch 2.11's dynamo cannot rebuild a frozen dataclass passed as a constant.
        object.__setattr__(self, "key", json.dumps(dataclasses.asdict(self), sort_keys=True))

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def from_key(key: str) -> Tuning:
        """The tuning ``key`` was made from (``Tuning(...).key``)."""
        values = json.loads(key)
        values["row_warps"] = tuple(map(tuple, values["row_warps"]))
        values["logits_tiles"] = tuple(values["logits_tiles"])
        return Tuning(**values)

    def __repr__(self) -> str:
        changed = (f for f in dataclasses.fields(self) if getattr(self, f.name) != f.default)
        return f"Tuning({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in changed)})"

    def skips_ignored(self, n_rows: int, n_kept: int) -> bool:
        """Whether a forward over ``n_rows`` labels of which ``n_kept`` are kept walks only the
        kept rows: some are ignored, at least ``skip_ignored_share`` of them."""
        n_ignored = n_rows - n_kept
        return n_ignored > 0 and n_ignored >= self.skip_ignored_share * n_rows

    def waits_to_skip(self, ignored_share: float, work_gflop: float) -> bool:
        """Whether a forward of ``work_gflop`` GFLOP of GEMMs over every row, expecting
        ``ignored_share`` of its labels ignored, waits for its unanswered label check to skip
        them (``wait_to_skip_gflop``)."""
        if ignored_share <= 0 or ignored_share < self.skip_ignored_share:
            return False
        return work_gflop * ignored_share >= self.wait_to_skip_gflop

    def warps_for(self, block: int) -> int:
        """Warps for a row-kernel block of ``block`` columns (``row_warps``, first match)."""
        return next((warps for at_least, warps in self.row_warps if block >= at_least), self.row_warps[-1][1])


DEFAULT_TUNING = Tuning()
