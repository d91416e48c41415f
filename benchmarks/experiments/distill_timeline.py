"""The distillation op's GPU timeline by stage, from CUDA events (docs/perf-notes.md item 43).

Under ``torch.profiler`` this op's kernels summed to 34.1 ms at the issue's pair
(``distill_profile.py``) where CUDA events around the same stages of an unprofiled call gave
37.9 ms, with no idle stretch to explain the difference, so this probe records CUDA events between the
stages of one unprofiled fwd+bwd instead: the prologue (call to the first chunk; the label
check's host sync is in it), then per chunk the teacher's and the student's logits GEMMs, the
row kernel, and the two gradient GEMMs, then the backward. The stages are found by wrapping the
chunk loop's functions (``walk_chunks``, ``StudentGrads.add``, ``chunk_logits`` and
``distill_rows_triton`` as ``distillation_triton`` calls them) for this process only. Also the
host's time at each mark, and the call's ``do_bench`` median against the four-GEMM floor.

    PYTHONPATH=.:benchmarks python benchmarks/experiments/distill_timeline.py \\
        --out benchmarks/experiments/results/distill_timeline.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import distill  # noqa: E402
from common import bench, environment, write_json  # noqa: E402


class Marks:
    """CUDA events and host times, in the order the host records them."""

    def __init__(self) -> None:
        self.items: list[tuple[str, torch.cuda.Event, float]] = []

    def __call__(self, name: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.items.append((name, event, time.perf_counter()))

    def after(self, name: str, fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            self(name)
            return out

        return wrapped


@contextlib.contextmanager
def marked(marks: Marks):
    """The chunk loop's functions wrapped so that each stage's end is marked."""
    from liger_patch.ops.distillation import chunks as chunks
    from liger_patch.ops.distillation import triton_chunk as triton_math

    walk = chunks.walk_chunks

    def walk_marked(*args, **kwargs):
        marks("prologue")
        return walk(*args, **kwargs)

    calls = 0

    def logits_marked(*args, **kwargs):  # a step makes the teacher's logits, then the student's
        nonlocal calls
        out = chunk_logits(*args, **kwargs)
        marks(("teacher logits GEMM", "student logits GEMM")[calls % 2])
        calls += 1
        return out

    chunk_logits, rows_kernel = triton_math.chunk_logits, triton_math.distill_rows_triton
    with (
        mock.patch.object(chunks, "walk_chunks", walk_marked),
        mock.patch.object(chunks.StudentGrads, "add", marks.after("gradient GEMMs", chunks.StudentGrads.add)),
        mock.patch.object(triton_math, "chunk_logits", logits_marked),
        mock.patch.object(triton_math, "distill_rows_triton", marks.after("row kernel", rows_kernel)),
    ):
        yield


def timeline(index: int, tokens: int, rep_ms: int) -> dict:
    pair, h_s, h_t, v = distill.PAIRS[index]
    point = distill.DistillPoint(pair, tokens, h_s, h_t, v)
    s_h, s_w, labels, t_h, t_w = distill.make_distill_inputs(point, torch.bfloat16, 0.0, 0.9, "cuda")
    fn = distill.bound("ours", distill.Setting(teacher=(t_h, t_w)))

    def call():
        s_h.grad = s_w.grad = None
        fn(s_h, s_w, labels).backward()

    ms = bench(call, rep_ms)
    floor = distill.time_floor(s_h.detach(), s_w.detach(), t_h, t_w, rep_ms)
    marks = Marks()
    with marked(marks):
        call()  # the wrapped functions' first call: not measured
        torch.cuda.synchronize()
        marks.items.clear()
        marks("start")
        s_h.grad = s_w.grad = None
        loss = fn(s_h, s_w, labels)
        marks("forward end")
        loss.backward()
        marks("backward")
        torch.cuda.synchronize()
    stages: dict[str, list] = {}
    start_host = marks.items[0][2]
    for (_, before, _), (name, event, _) in zip(marks.items, marks.items[1:], strict=False):
        entry = stages.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += before.elapsed_time(event)
    row = {
        "point": point.name,
        "ms": ms,
        "floor_ms": floor,
        "x_floor": ms / floor,
        "timeline_ms": marks.items[0][1].elapsed_time(marks.items[-1][1]),
        "stages": {name: {"count": c, "ms": t} for name, (c, t) in stages.items()},
        "host_ms_at": {name: 1e3 * (h - start_host) for name, _, h in marks.items if name != "start"},
    }
    print(point.name, f"{ms:.2f} ms ({ms / floor:.3f}x floor {floor:.2f}), one call {row['timeline_ms']:.2f}")
    for name, s in row["stages"].items():
        print(f"  {name:22s} x{s['count']:2d} {s['ms']:8.3f} ms", flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--pairs", default="0,1,2", help="indices into distill.PAIRS")
    p.add_argument("--rep-ms", type=int, default=500)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    result = {**environment(), "tokens": args.tokens, "beta": 0.5, "rows": []}
    for index in (int(x) for x in args.pairs.split(",")):
        result["rows"].append(timeline(index, args.tokens, args.rep_ms))
        torch.cuda.empty_cache()
        if args.out:
            write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
