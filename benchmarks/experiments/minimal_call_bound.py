"""Probe: the host time a per-call plan could reach with today's kernels (issue 43, target 1).

The fused loss's common small call (bf16, reduction "mean", nothing else asked for, one token
chunk, the label check not waited for) issued as a call plan would issue it once every decision
is bound per signature: one ``autograd.Function`` whose forward launches the op's own label
check and queues its pinned copy and event, the fused logits GEMM with its partials, the row
kernel (the gradient written over the logits), grad_h and grad_W (cuBLAS) and the loss's dot
product, and whose backward launches the in-place scaling. No option records, plans, checks of
the tensors or twin dispatch: only the launches, their allocations and the autograd node.

At each ``--shapes`` N,H,V (25 % of the labels ignored, logit std 3) prints and writes to
``--out`` (JSON): host ms of one forward + backward queued behind about 20 ms of GPU work
(``host_bound.host_time``, median of ``--reps``) and per call of ten in a row
(``host_bound.steady_host_ms``), for eager (``F.cross_entropy`` on the full logits), the op, the
op with ``Tuning(call_plans=False)`` ("ours_unplanned": its chunk loop's decisions taken at every
call) and this minimal sequence, the same without the check's pinned copy and event
("minimal_no_copy") and without the check at all (its outputs made before the timing:
"minimal_no_check"), all alternated in every repetition; and the minimal sequence's largest
difference from the op in loss, grad_h and grad_W (the same kernels, so 0 is expected). The JSON
names the commit (``--commit``, else ``git rev-parse``).
Where minimal is more than eager + 0.5 ms, a call plan alone cannot meet target 1 with these
launches.

    python benchmarks/experiments/minimal_call_bound.py \
        --out benchmarks/experiments/results/minimal_call_bound.json
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
from host_bound import Backlog, eager_loss, host_time, ours_loss, steady_host_ms  # noqa: E402

from liger_patch.ops.core import deferred_checks, validation  # noqa: E402
from liger_patch.ops.core.triton.label_check import label_check  # noqa: E402
from liger_patch.ops.core.triton.logits import logits_with_partials, supported  # noqa: E402
from liger_patch.ops.core.triton.scale import scale_  # noqa: E402
from liger_patch.ops.core.tuning import Tuning  # noqa: E402
from liger_patch.ops.cross_entropy.functional import fused_linear_cross_entropy  # noqa: E402
from liger_patch.ops.cross_entropy.options import LossOptions  # noqa: E402
from liger_patch.ops.cross_entropy.row_io import RowGrad  # noqa: E402
from liger_patch.ops.cross_entropy.triton.rows import ce_rows_triton  # noqa: E402

OPTS = LossOptions()
UNPLANNED = Tuning(call_plans=False)
IGNORE = -100


class _Minimal(torch.autograd.Function):
    """The op's launches for one chunk of every row, nothing else (see the module doc). ``check``:
    "full" launches the label check and queues its copy and event, "no_copy" only launches it,
    "none" takes ``static``'s (a check made before the timing) and launches nothing for it."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, check: str = "full", static=None) -> torch.Tensor:
        vocab = weight.shape[0]
        checked = static if check == "none" else label_check(labels, vocab, IGNORE, "mean")
        if check == "full":
            PENDING_CHECKS.append(validation.check_from_stats(labels, vocab, IGNORE, None, checked.stats))
        logits = torch.empty(hidden.shape[0], vocab, dtype=hidden.dtype, device=hidden.device)
        partials = logits_with_partials(hidden, weight, None, OPTS, logits)
        weights = checked.row_weight
        ce, _ = ce_rows_triton(
            logits, checked.labels, OPTS, grad=RowGrad(logits, weights, weights), partials=partials
        )
        ctx.grads = [torch.mm(logits, weight), torch.mm(logits.t(), hidden)]  # logits now hold g
        return torch.dot(ce, weights)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grads, ctx.grads = ctx.grads, None
        scale_(grads, grad_loss)
        return grads[0], grads[1], None, None, None


def unplanned_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The op with ``Tuning(call_plans=False)``: every call takes its chunk loop's decisions again."""
    return fused_linear_cross_entropy(hidden, weight, labels, tuning=UNPLANNED)


def minimal_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return _Minimal.apply(hidden, weight, labels)


def _differences(hidden, weight, labels) -> dict:
    """The minimal sequence against the op: largest absolute differences."""
    out = {}
    for name, fn in (("ours", ours_loss), ("minimal", minimal_loss)):
        loss = fwd_bwd(fn, hidden, weight, labels)
        out[name] = (loss.detach().clone(), hidden.grad.clone(), weight.grad.clone())
    torch.cuda.synchronize()
    read_checks()
    deferred_checks.raise_pending()
    keys = ("loss", "grad_hidden", "grad_weight")
    return {
        f"max_abs_diff_{k}": float((a.float() - b.float()).abs().max())
        for k, a, b in zip(keys, out["ours"], out["minimal"], strict=True)
    }


def measure(n: int, h: int, v: int, reps: int, backlog: Backlog) -> dict:
    hidden, weight, labels = make_inputs(n, h, v, ignore_frac=0.25, logit_std=3.0)
    if not supported(hidden.detach(), weight.detach(), hidden.dtype, OPTS.tuning):
        raise SystemExit(f"{n},{h},{v}: the fused logits GEMM does not take this shape here")
    if n * v * hidden.element_size() > 512 * 2**20:
        raise SystemExit(f"{n},{h},{v}: more than one chunk at the default budget; this probe runs one")
    static = label_check(labels, v, IGNORE, "mean")

    def minimal_without(check: str):
        return lambda h, w, y: _Minimal.apply(h, w, y, check, static)

    variants = (
        ("eager", eager_loss),
        ("ours", ours_loss),
        ("ours_unplanned", unplanned_loss),
        ("minimal", minimal_loss),
        ("minimal_no_copy", minimal_without("no_copy")),
        ("minimal_no_check", minimal_without("none")),
    )
    calls = {name: (lambda fn=fn: fwd_bwd(fn, hidden, weight, labels)) for name, fn in variants}
    row = {"N": n, "H": h, "V": v, "ignored": 0.25, **_differences(hidden, weight, labels)}
    for call in calls.values():  # warm, behind the spin as measured
        for _ in range(3):
            host_time(call, backlog, "cuda")
    one = {name: [] for name in calls}
    steady = {name: [] for name in calls}
    for _ in range(reps):
        for name, call in calls.items():
            one[name].append(host_time(call, backlog, "cuda")[0])
            read_checks()
            deferred_checks.raise_pending()
    for _ in range(5):
        for name, call in calls.items():
            steady[name].append(steady_host_ms(call, backlog))
            read_checks()
    for name in calls:
        row[f"{name}_host_ms"] = round(statistics.median(one[name]), 4)
        row[f"{name}_steady_host_ms"] = round(statistics.median(steady[name]), 4)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shapes = ["256,896,151936", "256,4096,32768", "1024,2048,128256", "1024,4096,32768"]
    parser.add_argument("--shapes", nargs="+", default=shapes)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", default=None, help="the tree's commit (default: git rev-parse HEAD)")
    args = parser.parse_args()
    if not need_cuda("minimal_call_bound.py"):
        raise SystemExit(2)
    backlog = Backlog("cuda")
    rows = []
    for shape in args.shapes:
        n, h, v = (int(x) for x in shape.split(","))
        rows.append(measure(n, h, v, args.reps, backlog))
        print(json.dumps(rows[-1]), flush=True)
    write_json(args.out, {**environment(), "commit": args.commit or git_head(), "rows": rows})
    head = "| N × H × V | eager | ours | unplanned | minimal | minimal − eager | no copy | no check |"
    print(f"\n{head} ten in a row: eager / ours / unplanned / minimal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        names = ("eager", "ours", "ours_unplanned", "minimal")
        steady = " / ".join(f"{r[f'{k}_steady_host_ms']:.2f}" for k in names)
        print(
            f"| {r['N']} × {r['H']} × {r['V']} | {r['eager_host_ms']:.2f} | {r['ours_host_ms']:.2f} | "
            f"{r['ours_unplanned_host_ms']:.2f} | "
            f"{r['minimal_host_ms']:.2f} | {r['minimal_host_ms'] - r['eager_host_ms']:+.2f} | "
            f"{r['minimal_no_copy_host_ms']:.2f} | {r['minimal_no_check_host_ms']:.2f} | {steady} |"
        )


if __name__ == "__main__":
    main()
