"""Probe: host time of one fused-loss call, two source trees of ``liger_patch`` alternated (issue 43).

An A/B of a host-time change: each round runs one fresh process per tree (``--trees A B``, each a
folder holding a ``liger_patch/`` package, e.g. a ``git worktree`` of the commit before), in
alternating order, on the same card. A process measures, at each ``--shapes`` N,H,V (bf16, 25 %
of labels ignored), the host ms of a forward + backward queued behind a GPU backlog (so the host
never waits: ``host_bound.host_time``) ``--reps`` times, and the host ms per call of ten calls in a
row behind a longer backlog (``host_bound.steady_host_ms``, the key "N,H,V steady") ``--reps``
times, and prints the medians; the parent prints
each tree's median over rounds, the difference, and the median of the rounds' differences (a
round runs both trees back to back), and appends one JSON line per shape to ``--out``.

With ``--ahead`` a process measures instead, at each shape, one forward + backward whose label
check was begun ahead (``check_labels_ahead``, as a patched model begins it before its body)
with the GPU caught up (a sync, then 3 ms of host time standing for the body): a host-bound
step's head, where a forward that skips its ignored rows reads that check at once. The keys
"N,H,V ahead" (host ms) and "N,H,V ahead cpu" (the thread's CPU ms over the same span).

    git worktree add /tmp/before HEAD~1
    python benchmarks/experiments/tree_host_ab.py --trees /tmp/before . --out results/x.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/, for common and host_bound
sys.path.insert(0, str(BENCH))
from common import append_jsonl  # noqa: E402


def measure(shapes: list[str], reps: int, graphs: bool) -> dict[str, float]:
    """In the child: median host ms per shape for the ``liger_patch`` first on ``sys.path``, with
    ``Tuning(call_graphs=True)`` where ``graphs``."""
    from functools import partial

    import torch
    from common import make_inputs
    from host_bound import LOGIT_STD, Backlog, fwd_bwd, host_time, ours_loss, ours_with_graphs, steady_host_ms

    backlog, result = Backlog("cuda"), {}
    for shape in shapes:
        n, h, v = map(int, shape.split(","))
        hidden, weight, labels = make_inputs(n, h, v, torch.bfloat16, ignore_frac=0.25, logit_std=LOGIT_STD)
        call = partial(fwd_bwd, ours_with_graphs if graphs else ours_loss, hidden, weight, labels)
        for _ in range(3):
            call()
        result[shape] = statistics.median(host_time(call, backlog, "cuda")[0] for _ in range(reps))
        result[f"{shape} steady"] = statistics.median(steady_host_ms(call, backlog) for _ in range(reps))
        del hidden, weight, labels, call
        torch.cuda.empty_cache()
    return result


def measure_ahead(shapes: list[str], reps: int) -> dict[str, float]:
    """In the child, with ``--ahead``: median host and CPU ms per shape of a call whose check was
    begun ahead, the GPU idle (see the module doc)."""
    import time

    import torch
    from common import make_inputs
    from host_bound import LOGIT_STD, ours_loss

    from liger_patch.ops.core import deferred_checks, early_checks
    from liger_patch.ops.cross_entropy.functional import check_labels_ahead

    def call(hidden, weight, labels) -> tuple[float, float]:
        torch.cuda.synchronize()
        key = check_labels_ahead(labels, weight.shape[0])
        time.sleep(0.003)
        start, start_cpu = time.perf_counter(), time.thread_time()
        ours_loss(hidden, weight, labels).backward()
        times = (1e3 * (time.perf_counter() - start), 1e3 * (time.thread_time() - start_cpu))
        early_checks.drop(key)
        hidden.grad = weight.grad = None
        return times

    result = {}
    for shape in shapes:
        n, h, v = map(int, shape.split(","))
        hidden, weight, labels = make_inputs(n, h, v, torch.bfloat16, ignore_frac=0.25, logit_std=LOGIT_STD)
        for _ in range(8):
            call(hidden, weight, labels)
        host, cpu = zip(*(call(hidden, weight, labels) for _ in range(reps)), strict=True)
        torch.cuda.synchronize()
        deferred_checks.raise_pending()
        result[f"{shape} ahead"] = statistics.median(host)
        result[f"{shape} ahead cpu"] = statistics.median(cpu)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs=2, help="two folders holding liger_patch/ (required)")
    shapes = ["256,896,151936", "1024,4096,32768", "16384,896,151936"]
    parser.add_argument("--shapes", nargs="+", default=shapes)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default=None, help="JSON lines, one per shape")
    parser.add_argument("--call-graphs", action="store_true", help="both trees with Tuning(call_graphs=True)")
    parser.add_argument("--ahead", action="store_true", help="a call whose check was begun ahead, GPU idle")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        shapes, reps = args.shapes, args.reps
        print(
            json.dumps(measure_ahead(shapes, reps) if args.ahead else measure(shapes, reps, args.call_graphs))
        )
        return 0
    if args.trees is None:
        parser.error("--trees A B is required")
    trees = [str(Path(t).resolve()) for t in args.trees]
    kinds = (" ahead", " ahead cpu") if args.ahead else ("", " steady")
    keys = [f"{s}{kind}" for s in args.shapes for kind in kinds]
    runs: dict[str, dict[str, list[float]]] = {t: {k: [] for k in keys} for t in trees}
    for r in range(args.rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")])}
            cmd = [sys.executable, __file__, "--child", "--reps", str(args.reps), "--shapes", *args.shapes]
            cmd += ["--call-graphs"] if args.call_graphs else []
            cmd += ["--ahead"] if args.ahead else []
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{tree}: the measuring process failed:\n{done.stderr[-3000:]}")
            out = done.stdout
            for shape, ms in json.loads(out.strip().splitlines()[-1]).items():
                runs[tree][shape].append(ms)
    for shape in keys:
        a, b = (statistics.median(runs[t][shape]) for t in trees)
        a_runs, b_runs = runs[trees[0]][shape], runs[trees[1]][shape]
        paired = statistics.median(y - x for x, y in zip(a_runs, b_runs, strict=True))
        row = {"shape": shape, "a": trees[0], "b": trees[1], "a_host_ms": a, "b_host_ms": b,
               "b_minus_a_us": 1e3 * (b - a), "paired_b_minus_a_us": 1e3 * paired,
               "rounds": args.rounds, "reps": args.reps, "call_graphs": args.call_graphs,
               "a_rounds": a_runs, "b_rounds": b_runs}  # fmt: skip
        print(f"{shape}: A {a:.3f} ms, B {b:.3f} ms, B - A {1e3 * (b - a):+.0f} us "
              f"(paired, the median of each round's B - A: {1e3 * paired:+.0f} us)")  # fmt: skip
        if args.out:
            append_jsonl(args.out, row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
