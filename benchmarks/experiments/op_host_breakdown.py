"""Probe: the host time of one fused-loss call, piece by piece, behind a busy GPU (issue 43).

For each ``--shapes`` N,H,V (bf16, ``--ignored`` share of labels -100): the median host ms
(``host_bound.host_time``: timed without synchronising, about 20 ms of GPU work queued first) of
eager's forward + backward, ours, ours' forward alone, and pieces of ours: the label check begun
and finished (``kept_rows``), one elementwise launch (``labels != -100``) and the check's pinned
copy and event; ``*_steady_host_ms``: host ms per call of ten calls in a row behind about 100 ms
of queued work (a busy loop's host, warm, rather than one call just after a sync). Then
``torch.profiler``'s host-side table of five calls of ours (self CPU time per aten op and CUDA
runtime call) and a cProfile of twenty (the Python). Rows as JSON lines, the tables as text, to
``--out`` (a folder).

    python benchmarks/experiments/op_host_breakdown.py --out /tmp/breakdown
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common, host_bound
from common import append_jsonl, fwd_bwd, make_inputs, need_cuda  # noqa: E402
from host_bound import Backlog, eager_loss, host_time, ours_loss, steady_host_ms  # noqa: E402

import liger_patch as lp  # noqa: E402
from liger_patch.ops.core import deferred_checks, kept_rows, validation  # noqa: E402
from liger_patch.ops.core.tuning import Tuning  # noqa: E402

REPS = 15


def _label_check(labels: torch.Tensor, vocab: int) -> None:
    check = kept_rows.LabelCheck(labels, vocab, -100, "mean")
    pending = kept_rows.begin_label_check(check, None, ("probe", labels.shape[0], vocab), 1.0)
    kept_rows.finish_label_check(pending, Tuning())


def _pinned_copy(labels: torch.Tensor, vocab: int, stats: torch.Tensor) -> None:
    """The label check's copy of its four values to pinned memory and its event, as it makes them."""
    validation.check_from_stats(labels, vocab, -100, None, stats)


def _forward(hidden, weight, labels) -> None:
    lp.fused_linear_cross_entropy(hidden, weight, labels)


def pieces(hidden, weight, labels) -> dict:
    vocab = weight.shape[0]
    return {
        "eager_fwd_bwd": partial(fwd_bwd, eager_loss, hidden, weight, labels),
        "ours_fwd_bwd": partial(fwd_bwd, ours_loss, hidden, weight, labels),
        "ours_fwd": partial(_forward, hidden, weight, labels),
        "label_check": partial(_label_check, labels, vocab),
        "one_elementwise": partial(torch.ne, labels, -100),
        "pinned_copy_event": partial(_pinned_copy, labels, vocab, labels.new_ones(4)),
    }


def measure(n: int, h: int, v: int, ignored: float, backlog: Backlog, out: Path) -> dict:
    hidden, weight, labels = make_inputs(n, h, v, ignore_frac=ignored, logit_std=3.0)
    calls = pieces(hidden, weight, labels)
    for _ in range(3):
        for call in calls.values():
            host_time(call, backlog, "cuda")  # warm, behind the spin as measured
    deferred_checks.raise_pending()
    host = {name: [] for name in calls}
    for _ in range(REPS):
        for name, call in calls.items():
            host[name].append(host_time(call, backlog, "cuda")[0])
        deferred_checks.raise_pending()
    row = {"N": n, "H": h, "V": v, "ignored": ignored}
    row.update({f"{name}_host_ms": round(statistics.median(ms), 4) for name, ms in host.items()})
    for name in ("eager_fwd_bwd", "ours_fwd_bwd"):
        steady = [steady_host_ms(calls[name], backlog) for _ in range(5)]
        row[f"{name}_steady_host_ms"] = round(statistics.median(steady), 4)
    torch.cuda.synchronize()
    backlog.queue()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            calls["ours_fwd_bwd"]()
    torch.cuda.synchronize()
    deferred_checks.raise_pending()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=60)
    with open(out / "tables.txt", "a") as f:
        f.write(f"\n=== ours fwd+bwd x5, N={n} H={h} V={v} ignored={ignored} ===\n{table}\n")
    _python_profile(calls["ours_fwd_bwd"], backlog, out / f"cprofile_{n}_{ignored}.txt")
    return row


def _python_profile(call, backlog: Backlog, path: Path, calls: int = 20) -> None:
    """cProfile of ``calls`` calls behind the spin: where the host's Python time goes."""
    torch.cuda.synchronize()
    for _ in range(3):
        backlog.queue()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    torch.cuda.synchronize()
    deferred_checks.raise_pending()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(60)
    stats.sort_stats("cumulative").print_stats("liger_patch|triton", 80)
    path.write_text(f"{calls} calls\n" + text.getvalue())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes", nargs="+", default=["256,896,151936", "1024,896,151936", "4096,2048,128256"]
    )
    parser.add_argument("--ignored", type=float, nargs="+", default=[0.0, 0.25])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not need_cuda(__file__):
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    backlog = Backlog("cuda")
    for shape in args.shapes:
        for ignored in args.ignored:
            row = measure(*map(int, shape.split(",")), ignored, backlog, args.out)
            append_jsonl(args.out / "rows.jsonl", row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
