"""A lower bound for any token-chunked exact method within a memory budget, at every grid point
with no ignored label, against torch.compile and ours in the same run (issue 29).

Within a budget B an exact method that keeps every token's full row of logits while it uses them
walks the tokens in chunks of at most B / (2 V) rows (bf16 logits alone, nothing else counted),
so it runs the three GEMMs chunk by chunk, accumulating grad_W once per chunk, and it must at
least read each logit and write its gradient once (4 bytes a position in bf16). ``bound`` times
exactly that and nothing else, through cuBLAS: per chunk the logits GEMM into a buffer, one
in-place elementwise pass over it (``mul_``: one read, one write), grad_h = G W into its rows and
grad_W (``mm`` for the first chunk, ``addmm_`` after). No log-sum-exp, no label, no launch of a
row kernel, no host sync. Two chunk plans are timed and the faster kept: the fewest chunks of
equal rows (a multiple of 8), and the rows ours plans (``budget.plan_chunks``, read off a call).
``bound_gemms`` is the same without the elementwise pass.

``--distill`` does the same for the distillation op (issue 30) at ``benchmarks/distill.py``'s
twelve points, nothing ignored, two independent heads (the issue's setting): a chunk holds both
sides' bf16 logits (at most B / (4 V) rows); per chunk the student's and the teacher's logits
GEMMs, the 10 bytes a position the mixture's row math must move for 0 < beta < 1 (both logits read
to sum the divergence before any gradient column is known, then both read again and the gradient
written: here two reductions and one in-place add), grad_h and grad_W; the floor is
``distill.py``'s four GEMMs over all tokens.

Where ``bound`` (the median, the faster plan) is above 0.99 x torch.compile's median time, a
chunked method built on these GEMMs cannot be 1 % faster than torch.compile there; a faster one
needs a GEMM faster than cuBLAS's at the chunk shapes (docs/perf-notes.md items 41-42 tried
Triton ones) or more memory. Where it is below, the difference between ``bound`` and ``ours`` is
ours to close. bf16 points only (the AMP points add autocast's casts to every method). The floor,
``bound``, ours and torch.compile are timed once per round, each round starting with another one;
medians (``bound_best``, the bound's best round over its floor of the same round, is kept too, but
the floor's own spread makes it noisy). The distillation part is judged the same way against 1.15x.

    python benchmarks/experiments/chunked_bound.py --rounds 2 \\
        --out benchmarks/experiments/results/chunked_bound.json
    python benchmarks/experiments/chunked_bound.py --points 0,4,8 ...   # grid indices (benchmarks/grid.py)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import distill  # noqa: E402
from common import MiB, bench, environment, fwd_bwd, make_inputs, need_cuda, time_floor, write_json  # noqa: E402
from flce import IMPLS, reset_compiled  # noqa: E402
from grid import GRID, GRID_INPUTS  # noqa: E402
from zero_ignored_ab import planned_rows  # noqa: E402

BUDGET = 512 * MiB


def equal_rows(n: int, v: int, budget: int) -> int:
    """The rows of the fewest equal chunks whose bf16 logits fit ``budget`` (a multiple of 8)."""
    most = budget // (2 * v)
    chunks = math.ceil(n / most)
    rows = math.ceil(n / chunks / 8) * 8
    return rows if rows <= most else most


def chunked_gemms(hidden: torch.Tensor, weight: torch.Tensor, rows: int, elementwise: bool):
    """The bound's work for one call: per chunk the logits GEMM, optionally one in-place pass over
    them, grad_h and grad_W (accumulated after the first chunk), all through cuBLAS."""
    n, v = hidden.shape[0], weight.shape[0]
    buf = torch.empty(rows, v, device=hidden.device, dtype=hidden.dtype)
    grad_h = torch.empty_like(hidden)
    grad_w = torch.empty_like(weight)
    starts = range(0, n, rows)

    def run():
        for start in starts:
            x = hidden[start : start + rows]
            g = buf[: x.shape[0]]
            torch.mm(x, weight.t(), out=g)
            if elementwise:
                g.mul_(0.5)
            gradient_gemms(g, x, weight, grad_h[start : start + rows], grad_w, start == 0)

    return run


def gradient_gemms(g, x, weight, grad_h_rows, grad_w, first: bool) -> None:
    """One chunk's two gradient GEMMs: grad_h's rows, and grad_W overwritten by the first chunk,
    accumulated after it."""
    torch.mm(g, weight, out=grad_h_rows)
    if first:
        torch.mm(g.t(), x, out=grad_w)
    else:
        grad_w.addmm_(g.t(), x)


def point_row(index: int, rounds: int, rep_ms: int) -> dict:
    point = GRID[index]
    n, h, v, softcap = point.n, point.h, point.v, point.softcap
    hidden, weight, labels = make_inputs(n, h, v, torch.bfloat16, 0.0, logit_std=GRID_INPUTS["logit_std"])
    plans = {"equal": equal_rows(n, v, BUDGET), "ours_plan": planned_rows(n, h, v, BUDGET)}
    hd, wd = hidden.detach(), weight.detach()
    work = {f"bound_{name}": chunked_gemms(hd, wd, rows, True) for name, rows in plans.items()}
    work |= {f"bound_gemms_{name}": chunked_gemms(hd, wd, rows, False) for name, rows in plans.items()}
    for impl in ("ours", "torch_compile"):
        work[impl] = lambda impl=impl: fwd_bwd(
            lambda a, b, c: IMPLS[impl](a, b, c, softcap=softcap), hidden, weight, labels
        )
    reset_compiled()
    names = list(work)
    floors, times = [], {k: [] for k in names}
    for r in range(rounds):
        floors.append(time_floor(hd, wd, rep_ms))
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            work[name]()  # warm-up (and compile)
            times[name].append(bench(work[name], rep_ms))
            hidden.grad = weight.grad = None
            torch.cuda.empty_cache()
    floor = statistics.median(floors)
    x = {k: statistics.median([t / f for t, f in zip(ts, floors, strict=True)]) for k, ts in times.items()}
    row = {
        "index": index,
        "shape": point.name,
        "model": point.model,
        "N": n,
        "H": h,
        "V": v,
        "softcap": softcap,
        "ignore_frac": 0.0,
        "rows": plans,
        "floor_ms": floor,
        "ms": {k: statistics.median(ts) for k, ts in times.items()},
        "x_floor": x,
        "ms_rounds": times,
    }
    best = {k: min(t / f for t, f in zip(ts, floors, strict=True)) for k, ts in times.items()}
    row["bound"] = min(x["bound_equal"], x["bound_ours_plan"])
    row["bound_gemms"] = min(x["bound_gemms_equal"], x["bound_gemms_ours_plan"])
    row["bound_best"] = min(best["bound_equal"], best["bound_ours_plan"])  # noisy: the floor is too
    return judge(row)


def judge(row: dict) -> dict:
    """The verdict from the stored medians: the bound against 0.99 x torch.compile (cross-entropy)
    or against 1.15 (distillation)."""
    x = row["x_floor"]
    if "torch_compile" in x:
        row["one_pct_ahead_possible"] = row["bound"] <= 0.99 * x["torch_compile"]
        row["ours_ahead_by"] = 1 - x["ours"] / x["torch_compile"]
    else:
        row["within_1_15_possible"] = x["bound"] <= 1.15
    return row


def equal_distill_rows(n: int, v: int, budget: int) -> int:
    """As ``equal_rows`` with both sides' bf16 logits in the budget."""
    return equal_rows(n, 2 * v, budget)


def chunked_distill(s_h, s_w, t_h, t_w, rows: int, elementwise: bool):
    """The distillation bound's work for one call (the module docstring says what)."""
    n, v = s_h.shape[0], s_w.shape[0]
    buf_s = torch.empty(rows, v, device=s_h.device, dtype=s_h.dtype)
    buf_t = torch.empty_like(buf_s)
    grad_h = torch.empty_like(s_h)
    grad_w = torch.empty_like(s_w)

    def run():
        for start in range(0, n, rows):
            x = s_h[start : start + rows]
            zs, zt = buf_s[: x.shape[0]], buf_t[: x.shape[0]]
            torch.mm(x, s_w.t(), out=zs)
            torch.mm(t_h[start : start + rows], t_w.t(), out=zt)
            if elementwise:
                zs.sum(dtype=torch.float32)
                zt.sum(dtype=torch.float32)
                zs.add_(zt)
            gradient_gemms(zs, x, s_w, grad_h[start : start + rows], grad_w, start == 0)

    return run


def distill_row(index: int, rounds: int, rep_ms: int) -> dict:
    point = distill.POINTS[index]
    s_h, s_w, labels, t_h, t_w = distill.make_distill_inputs(point, torch.bfloat16, 0.0, 0.0, "cuda")
    rows = equal_distill_rows(point.n, point.v, BUDGET)
    sd, wd = s_h.detach(), s_w.detach()
    setting = distill.Setting(teacher=(t_h, t_w))
    work = {
        "bound": chunked_distill(sd, wd, t_h, t_w, rows, True),
        "bound_gemms": chunked_distill(sd, wd, t_h, t_w, rows, False),
        "ours": lambda: fwd_bwd(distill.bound("ours", setting), s_h, s_w, labels),
    }
    names = list(work)
    floors, times = [], {k: [] for k in names}
    for r in range(rounds):
        floors.append(distill.time_floor(sd, wd, t_h, t_w, rep_ms))
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            work[name]()
            times[name].append(bench(work[name], rep_ms))
            s_h.grad = s_w.grad = None
            torch.cuda.empty_cache()
    x = {k: statistics.median([t / f for t, f in zip(ts, floors, strict=True)]) for k, ts in times.items()}
    bound_best = min(t / f for t, f in zip(times["bound"], floors, strict=True))
    row = {
        "index": index,
        "pair": point.pair,
        "N": point.n,
        "H_s": point.h_s,
        "H_t": point.h_t,
        "V": point.v,
        "ignore_frac": 0.0,
        "rows": rows,
        "floor_ms": statistics.median(floors),
        "ms": {k: statistics.median(ts) for k, ts in times.items()},
        "x_floor": x,
        "ms_rounds": times,
        "bound_best": bound_best,
    }
    return judge(row)


def distill_markdown(rows: list[dict]) -> str:
    lines = [
        "| pair | N | rows | ours | bound | bound, best round | bound, GEMMs only | 1.15x possible |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: r["index"]):
        x = r["x_floor"]
        lines.append(
            f"| {r['pair']} | {r['N']} | {r['rows']} | {x['ours']:.3f} | {x['bound']:.3f} | "
            f"{r.get('bound_best', x['bound']):.3f} | "
            f"{x['bound_gemms']:.3f} | {'yes' if r['within_1_15_possible'] else 'no'} |"
        )
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    """One line a point: × the floor for ours, torch.compile and the bound, and what the bound allows."""
    lines = [
        "| N, H, V | rows (equal / ours) | ours | torch.compile | bound | bound, best round "
        "| bound, GEMMs only | 1 % ahead possible |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: r["index"]):
        x = r["x_floor"]
        shape = f"{r['N']}, {r['H']}, {r['V']}" + (", softcap" if r["softcap"] else "")
        lines.append(
            f"| {shape} | {r['rows']['equal']} / {r['rows']['ours_plan']} | {x['ours']:.3f} | "
            f"{x['torch_compile']:.3f} | {r['bound']:.3f} | {r.get('bound_best', r['bound']):.3f} | "
            f"{r['bound_gemms']:.3f} | "
            f"{'yes' if r['one_pct_ahead_possible'] else 'no'} |"
        )
    return "\n".join(lines)


def merge(parts: list[Path], out: Path) -> None:
    """One result file (and its .md table) from the files of several processes (one per GPU)."""
    import json

    loaded = [json.loads(p.read_text()) for p in parts]
    result = {k: v for k, v in loaded[0].items() if k != "rows"}
    result["parts"] = [str(p) for p in parts]
    result["rows"] = sorted((judge(r) for d in loaded for r in d["rows"]), key=lambda r: r["index"])
    write_json(out, result)
    head = f"{result['device']}, torch {result['torch']}, triton {result['triton']}"
    table = distill_markdown(result["rows"]) if result.get("distill") else markdown(result["rows"])
    out.with_suffix(".md").write_text(
        f"{head}; × the floor, 0 % ignored, budget {BUDGET // MiB} MiB; "
        "rows from `benchmarks/experiments/chunked_bound.py`\n\n" + table + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default=None, help="grid indices I,J,... (default: every bf16 point)")
    parser.add_argument("--distill", action="store_true", help="distill.py's points instead (issue 30)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rep-ms", type=int, default=150)
    parser.add_argument("--deadline-s", type=float, default=None, help="stop starting points after this")
    parser.add_argument("--merge", nargs="+", type=Path, default=None, help="files to merge into --out")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    if args.merge:
        merge(args.merge, args.out)
        return 0
    if not need_cuda("chunked_bound.py"):
        return 2
    indices = range(len(distill.POINTS)) if args.distill else [i for i, p in enumerate(GRID) if not p.amp]
    if args.points:
        indices = [int(i) for i in args.points.split(",")]
    measure = distill_row if args.distill else point_row
    began = time.monotonic()
    result = {**environment(), "budget_bytes": BUDGET, "distill": args.distill, "rows": []}
    for index in indices:
        if args.deadline_s is not None and time.monotonic() - began > args.deadline_s:
            result["stopped_before"] = index
            break
        result["rows"].append(measure(index, args.rounds, args.rep_ms))
        print({k: result["rows"][-1][k] for k in ("index", "rows", "x_floor")}, flush=True)
        write_json(args.out, result)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
