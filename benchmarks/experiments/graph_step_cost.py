"""Probe: what the op's own graphs do to a training step's time and peak memory (issue 43).

``Tuning.call_graphs`` is off by default because the memory a graph keeps between calls (its
pool: the logits chunk, partials, row results and gradients, grad_W included) is not counted
against the budget. This weighs it where it matters, in whole steps of ``host_bound.py``'s
models (random init, bf16, fused AdamW at learning rate 0, one 1 x tokens sequence, ``--ignored``
of it ignored), three variants: unpatched, patched, and patched with
``tuning=Tuning(call_graphs=True)``.

* Time: ``host_bound.py``'s method. Every variant warmed up, then ``--rounds`` rounds of one
  segment a variant (three steps each, timed from a synchronised start to a synchronised end, the
  first untimed), the order rotated every round; the median step ms, and the paired ratio
  against unpatched with a 95 % bootstrap interval of that median (so that a row says whether
  its difference is resolved), and the same for the host ms of a step (from its start to the
  return of ``opt.zero_grad``, before the final sync) and for the main thread's CPU ms over that
  span (``time.thread_time``: what that thread computed; on CUDA the autograd engine runs the
  backward on a thread of its own while the main thread waits, so this is the forward's and the
  optimizer's host work, not the backward's: ``step_host_phases.py`` splits the process's CPU
  time by phase). Every round's figures are kept in the row. The graphs of the graphs variant
  stay made while the others run.
* Memory: then each variant alone, from no graph and an emptied cache, four steps (so that a
  graph is made) and then three with the peak statistics reset: the peak allocated and reserved
  GiB of those three, and for the graphs variant how many graphs were kept and replays run.
* ``--accumulate k``: each step ``k`` micro-batches of the batch, each loss divided by ``k`` and
  its backward run, then the optimizer's step (the gradients accumulate in ``.grad``).

    python benchmarks/experiments/graph_step_cost.py \
        --out benchmarks/experiments/results/graph_step_cost.json
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common, host_bound
from common import environment, git_head, need_cuda, write_json  # noqa: E402
from host_bound import (  # noqa: E402
    GPU_PLAN,
    LR,
    build_model,
    free_memory,
    make_batch,
    ours_applied,
    synchronize,
)

from liger_patch.ops.core import call_graph  # noqa: E402
from liger_patch.ops.core.tuning import Tuning  # noqa: E402

GiB = float(1 << 30)


def variants(model: torch.nn.Module) -> dict:
    return {
        "unpatched": contextlib.nullcontext,
        "patched": partial(ours_applied, model),
        "graphs": partial(ours_applied, model, tuning=Tuning(call_graphs=True)),
    }


def replay_counter() -> list:
    """Counts every replay of the op's graphs (for the row's record)."""
    calls, real = [], call_graph.CallGraph.replay

    def counted(self, *args):
        calls.append(None)
        return real(self, *args)

    call_graph.CallGraph.replay = counted
    return calls


def accumulated(model, opt, batch, steps: int, k: int) -> dict:
    """``host_bound.segment``'s steps, each of ``k`` micro-batches accumulated (``k`` 1: its own
    batch), with the host ms of each (before the final sync) and the main thread's CPU ms."""
    times, host, cpu = [], [], []
    for _ in range(steps):
        synchronize("cuda")
        start, start_cpu = time.perf_counter(), time.thread_time()
        for _ in range(k):
            (model(**batch).loss / k).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        host.append(1e3 * (time.perf_counter() - start))
        cpu.append(1e3 * (time.thread_time() - start_cpu))
        synchronize("cuda")
        times.append(1e3 * (time.perf_counter() - start))
    return {"ms": times, "host_ms": host, "cpu_ms": cpu}


def timed(model, opt, batch, kinds: dict, rounds: int, k: int) -> dict:
    """Median step ms of each variant and the paired ratios against unpatched."""
    for enter in kinds.values():
        with enter():
            accumulated(model, opt, batch, 3, k)
    runs = {kind: {"ms": [], "host_ms": [], "cpu_ms": []} for kind in kinds}
    order = list(kinds.items())
    for round_ in range(rounds):
        turn = round_ % len(order)
        for kind, enter in order[turn:] + order[:turn]:
            with enter():
                seg = accumulated(model, opt, batch, 3, k)
            for key in ("ms", "host_ms", "cpu_ms"):
                runs[kind][key].append(statistics.median(seg[key][1:]))
    out = {}
    for kind, got in runs.items():
        out[f"{kind}_step_ms"] = statistics.median(got["ms"])
        out[f"{kind}_host_ms"] = statistics.median(got["host_ms"])
        out[f"{kind}_cpu_ms"] = statistics.median(got["cpu_ms"])
    for kind in [name for name in kinds if name != "unpatched"]:
        labels = (("ms", "paired_ratio"), ("host_ms", "host_paired_ratio"), ("cpu_ms", "cpu_paired_ratio"))
        for key, label in labels:
            ratios = [b / a for a, b in zip(runs["unpatched"][key], runs[kind][key], strict=True)]
            out[f"{kind}_{label}"] = statistics.median(ratios)
            out[f"{kind}_{label}_ci95"] = median_interval(ratios)
    out["rounds"] = runs
    return out


def median_interval(values: list[float], resamples: int = 2000) -> list[float]:
    """A 95 % percentile-bootstrap interval of the median of ``values`` (seeded: reruns agree)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return [medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]]


def peak(model, opt, batch, enter, replays: list, k: int) -> dict:
    """Peak allocated and reserved GiB of three steps after four, from no graph and an emptied cache."""
    call_graph.forget()
    free_memory()
    with enter():
        accumulated(model, opt, batch, 4, k)
        synchronize("cuda")
        torch.cuda.reset_peak_memory_stats()
        before = len(replays)
        accumulated(model, opt, batch, 3, k)
        synchronize("cuda")
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / GiB,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GiB,
        "graphs_kept": len(call_graph._GRAPHS.graphs()),
        "replays": len(replays) - before,
    }


def model_rows(name: str, tokens_list: list[int], ignored: float, rounds: int, replays: list, k: int):
    family, config = GPU_PLAN.models[name]
    model = build_model(family, config, GPU_PLAN)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    for tokens in tokens_list:
        batch = make_batch(tokens, model.config.vocab_size, ignored, "cuda")
        kinds = variants(model)
        row = {"model": name, "tokens": tokens, "ignored": ignored, "accumulate": k}
        row.update(timed(model, opt, batch, kinds, rounds, k))
        for kind, enter in kinds.items():
            row.update({f"{kind}_{key}": v for key, v in peak(model, opt, batch, enter, replays, k).items()})
        print({key: value for key, value in row.items() if key != "rounds"}, flush=True)
        yield row
    del model, opt
    call_graph.forget()
    free_memory()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "llama-3.2-1b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[256, 1024, 4096])
    parser.add_argument("--ignored", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches a step")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    if not need_cuda("graph_step_cost.py"):
        raise SystemExit(2)
    replays = replay_counter()
    rows = [
        r
        for m in args.models
        for r in model_rows(m, args.tokens, args.ignored, args.rounds, replays, args.accumulate)
    ]
    head = {**environment("transformers"), "commit": args.commit or git_head()}
    write_json(args.out, {**head, "rows": rows})


if __name__ == "__main__":
    main()
