"""Probe: the host time one call could reach if its launches were one CUDA graph (issue 43, target 1).

Items 62-64 of docs/perf-notes.md found that a call issuing nothing but the op's launches
(``minimal_call_bound.py``) is already 0.3-0.9 ms of host time above eager's whole call: Triton's
launches, the allocations and the autograd node. A CUDA graph per signature would replace the
launches by one graph launch each way. This probe bounds what that could give before anything is
built: ``torch.cuda.make_graphed_callables`` over the op (captured on its sync-free capture path,
which poisons a bad label with NaN instead of raising) and, for reference, over eager's head; each
replay copies the call's hidden states and labels into the graph's inputs (two input sets are
alternated, so every call copies, as a training step's fresh tensors would), launches the forward
graph, and in the backward copies the upstream gradient and launches the backward graph.

At each ``--shapes`` N,H,V (bf16, 25 % of the labels ignored, logit std 3) prints and writes to
``--out`` (JSON): host ms of one forward + backward queued behind about 20 ms of GPU work
(``host_bound.host_time``, median of ``--reps``), per call of ten in a row
(``host_bound.steady_host_ms``) and synchronised wall ms (``host_bound.wall_time``) for eager, the
op with graphs of its own (``Tuning(call_graphs=True)``: ``call_graph``, ``plan_graph`` until
item 74 of docs/perf-notes.md; at 992ead4 the default,
off since), the op with ``Tuning(call_graphs=False)``, both graphed whole and the op graphed with
its check (below), all alternated in every repetition; and the graphed op's largest difference from
the op in loss, grad_h and grad_W on an input set the graph was not captured with (the same
kernels: about 0).

"ours_graphed_checked" adds the host work a real design adds to each replay: the label check's
launch captured too, its answer's pinned copy and event queued after the replay
(``validation.check_from_stats``, read after the timing as the op's deferred check is), and a
look at the use count of five storages (a design's test that no caller still holds an output
the replay would overwrite). Left out: the test that the weight is where the graph reads it (one
pointer comparison), and the graph's memory (the logits chunk stays allocated in its pool).

    python benchmarks/experiments/graphed_call_bound.py \
        --out benchmarks/experiments/results/graphed_call_bound.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common, host_bound
from common import (  # noqa: E402
    PENDING_CHECKS,
    environment,
    fwd_bwd,
    git_head,
    make_inputs,
    need_cuda,
    read_checks,
    write_json,
)
from host_bound import (  # noqa: E402
    Backlog,
    eager_loss,
    host_time,
    ours_loss,
    ours_ungraphed,
    ours_with_graphs,
    steady_host_ms,
    wall_time,
)

from liger_patch.ops.core import deferred_checks, validation  # noqa: E402
from liger_patch.ops.core.triton.label_check import label_check  # noqa: E402

IGNORE = -100


def _loss_and_stats(hidden, weight, labels):
    """The op's loss and a label check's statistics, to be captured together."""
    stats = label_check(labels, weight.shape[0], IGNORE, "mean").stats
    return ours_loss(hidden, weight, labels), stats


def _checked(graphed):
    """``graphed`` (``_loss_and_stats`` as graphs) with the host work a real design adds to a
    replay: the storages' use counts looked at, the check's answer copied to the host."""

    def call(hidden, weight, labels):
        for t in (hidden, weight, labels, hidden, weight):  # five storages, as a design's outputs
            torch._C._storage_Use_Count(t.untyped_storage()._cdata)
        loss, stats = graphed(hidden, weight, labels)
        PENDING_CHECKS.append(validation.check_from_stats(labels, weight.shape[0], IGNORE, None, stats))
        return loss

    return call


def _input_sets(n: int, h: int, v: int):
    """Two (hidden, labels) sets of the same shapes and one weight: alternated, every graphed call
    copies its inputs into the graph's."""
    hidden, weight, labels = make_inputs(n, h, v, ignore_frac=0.25, logit_std=3.0)
    other, _, other_labels = make_inputs(n, h, v, ignore_frac=0.25, logit_std=3.0, seed=1)
    return weight, [(hidden, labels), (other, other_labels)]


def _graphed(fn, hidden, weight, labels):
    """``fn`` as forward and backward graphs, captured with these sample inputs."""
    torch.cuda.synchronize()
    graphed = torch.cuda.make_graphed_callables(fn, (hidden, weight, labels), num_warmup_iters=3)
    torch.cuda.synchronize()
    return graphed


def _differences(graphed, weight, inputs) -> dict:
    """The graphed op against the op on the input set the graph was not captured with."""
    hidden, labels = inputs[1]
    out = {}
    for name, fn in (("ours", ours_loss), ("graphed", graphed)):
        loss = fwd_bwd(fn, hidden, weight, labels)
        out[name] = (loss.detach().clone(), hidden.grad.clone(), weight.grad.clone())
    torch.cuda.synchronize()
    deferred_checks.raise_pending()
    keys = ("loss", "grad_hidden", "grad_weight")
    return {
        f"max_abs_diff_{k}": float((a.float() - b.float()).abs().max())
        for k, a, b in zip(keys, out["ours"], out["graphed"], strict=True)
    }


def measure(n: int, h: int, v: int, reps: int, backlog: Backlog) -> dict:
    weight, inputs = _input_sets(n, h, v)
    hidden0, labels0 = inputs[0]
    fns = {
        "eager": eager_loss,
        "ours": ours_with_graphs,
        "ours_ungraphed": ours_ungraphed,
        "ours_graphed": _graphed(ours_loss, hidden0, weight, labels0),
        "ours_graphed_checked": _checked(_graphed(_loss_and_stats, hidden0, weight, labels0)),
        "eager_graphed": _graphed(eager_loss, hidden0, weight, labels0),
    }
    row = {"N": n, "H": h, "V": v, "ignored": 0.25, **_differences(fns["ours_graphed"], weight, inputs)}
    turn = [0]

    def call_of(fn):
        def call():
            turn[0] += 1
            hidden, labels = inputs[turn[0] % 2]
            return fwd_bwd(fn, hidden, weight, labels)

        return call

    calls = {name: call_of(fn) for name, fn in fns.items()}
    for call in calls.values():  # warm, behind the spin as measured
        for _ in range(3):
            host_time(call, backlog, "cuda")
    one, steady, wall = ({name: [] for name in calls} for _ in range(3))
    for _ in range(reps):
        for name, call in calls.items():
            one[name].append(host_time(call, backlog, "cuda")[0])
            wall[name].append(wall_time(call, "cuda"))
            read_checks()
            deferred_checks.raise_pending()
    for _ in range(5):
        for name, call in calls.items():
            steady[name].append(steady_host_ms(call, backlog))
            read_checks()
    for name in calls:
        row[f"{name}_host_ms"] = round(statistics.median(one[name]), 4)
        row[f"{name}_steady_host_ms"] = round(statistics.median(steady[name]), 4)
        row[f"{name}_wall_ms"] = round(statistics.median(wall[name]), 4)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shapes = ["256,896,151936", "256,4096,32768", "1024,2048,128256", "1024,4096,32768"]
    parser.add_argument("--shapes", nargs="+", default=shapes)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", default=None, help="the tree's commit (default: git rev-parse HEAD)")
    args = parser.parse_args()
    if not need_cuda("graphed_call_bound.py"):
        raise SystemExit(2)
    backlog = Backlog("cuda")
    rows = []
    for shape in args.shapes:
        n, h, v = (int(x) for x in shape.split(","))
        rows.append(measure(n, h, v, args.reps, backlog))
        print(json.dumps(rows[-1]), flush=True)
    write_json(args.out, {**environment(), "commit": args.commit or git_head(), "rows": rows})
    names = ("eager", "ours", "ours_ungraphed", "ours_graphed", "ours_graphed_checked", "eager_graphed")
    print("\n| N × H × V | host ms one call | ten in a row, per call | wall ms |")
    print("|---|---|---|---|")
    for r in rows:
        whats = ("host_ms", "steady_host_ms", "wall_ms")
        cells = [" / ".join(f"{r[f'{k}_{what}']:.2f}" for k in names) for what in whats]
        print(f"| {r['N']} × {r['H']} × {r['V']} | " + " | ".join(cells) + " |")
    print("(each cell: " + " / ".join(names) + ")")


if __name__ == "__main__":
    main()
