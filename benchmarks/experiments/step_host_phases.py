"""Probe: where a host-bound patched training step spends the host time the unpatched one does not
(issue 43, target 3).

``host_bound.py``'s step rows put Qwen2.5-0.5B-shaped steps at 1.01-1.10x unpatched at 256-4,096
tokens while Llama-3.2-1B-shaped ones were at 0.88-0.99x (at 5aa9d5c). One steady step is split into phases
timed on the host with no synchronisation inside the step (the forward, ``loss.backward()``, the
optimizer's step with ``zero_grad``), then synchronised: the host ms of each phase, the step's
wall ms, and the ms the host waited at the end for the GPU (wall minus the phases); and in each
phase the CPU ms of the main thread and of the whole process (the backward's host work runs on
the autograd engine's device thread: only the process's CPU time sees it). A step whose
final wait is near zero is bound by the host: its wall time is the sum of its phases. Then, per
variant and after an untimed step in it, one step under ``torch.profiler``: the GPU's busy ms
(kernels summed), the host's waits inside CUDA calls, and the kernel count; and one more with
the host's events: their self ms summed, and the events (aten operators, CUDA runtime calls)
whose self ms differ most between the variants.

Per model (``--models``, ``host_bound``'s names) and token count (``--tokens``, a quarter of
each sequence ignored): ``--rounds`` rounds of ``--steps`` timed steps per variant (after
``--warmup``, and one untimed step at each switch), the variants' order reversed every other
round; medians per variant and phase.

    cd benchmarks && python experiments/step_host_phases.py --out experiments/results/step_host_phases.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from common import environment, need_cuda, profiled_step, write_json  # noqa: E402
from host_bound import GPU_PLAN, LR, build_model, make_batch, ours_applied, train_step  # noqa: E402

PHASES = ("forward", "backward", "optimizer")


def _clocks() -> tuple[float, float, float]:
    """Wall time, the main thread's CPU time and the process's CPU time over all its threads."""
    return time.perf_counter(), time.thread_time(), time.process_time()


def _phased_step(model, opt, batch) -> dict[str, float]:
    """One step from a synchronised start: each phase's host ms, the main thread's CPU ms in it
    (``<phase>_main_cpu``) and the whole process's (``<phase>_process_cpu``), then the wall ms.
    On CUDA the autograd engine runs the backward on a thread of its own while the calling thread
    waits, so the backward's host work shows in the process's CPU time only."""
    torch.cuda.synchronize()
    marks = [_clocks()]
    out = model(**batch)
    marks.append(_clocks())
    out.loss.backward()
    marks.append(_clocks())
    opt.step()
    opt.zero_grad(set_to_none=True)
    marks.append(_clocks())
    torch.cuda.synchronize()
    marks.append(_clocks())
    found = {}
    for name, a, b in zip((*PHASES, "final_wait"), marks[:-1], marks[1:], strict=True):
        found[name] = 1e3 * (b[0] - a[0])
        found[f"{name}_main_cpu"] = 1e3 * (b[1] - a[1])
        found[f"{name}_process_cpu"] = 1e3 * (b[2] - a[2])
    found["wall"] = 1e3 * (marks[-1][0] - marks[0][0])
    return found


def _host_self_ms(model, opt, batch) -> collections.Counter:
    """One step under ``torch.profiler``: each host event's self ms summed by name (aten
    operators, CUDA runtime calls such as ``cudaMalloc``, ``cudaFree``, launches)."""
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:  # CUDA: the runtime calls too
        train_step(model, opt, batch)
        torch.cuda.synchronize()
    found: collections.Counter = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CPU:
            found[event.name[:80]] += event.self_cpu_time_total / 1e3
    return found


def _largest_differences(before: collections.Counter, after: collections.Counter, top: int = 15) -> dict:
    """The ``top`` host events whose summed self ms differ most, after minus before."""
    diff = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in set(before) | set(after)}
    return {name: round(ms, 3) for name, ms in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]}


def _variants(model) -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    """The two variants, each a context in which the model is that one."""
    return {"unpatched": contextlib.nullcontext, "patched": lambda: ours_applied(model)}


def _timed(model, opt, batch, args) -> dict[str, list[dict]]:
    """Every variant warmed up, then ``args.rounds`` rounds of ``args.steps`` phased steps each,
    the order reversed every other round, the first step after each switch untimed."""
    variants = _variants(model)
    steps: dict[str, list[dict]] = {kind: [] for kind in variants}
    for enter in variants.values():
        with enter():
            for _ in range(args.warmup):
                _phased_step(model, opt, batch)
    for r in range(args.rounds):
        for kind in variants if r % 2 == 0 else reversed(list(variants)):
            with variants[kind]():
                _phased_step(model, opt, batch)  # untimed: the first step after a patch or revert
                steps[kind].extend(_phased_step(model, opt, batch) for _ in range(args.steps))
    return steps


def _profiled(model, opt, batch) -> dict[str, dict]:
    """Per variant, after an untimed step in it: one step under the profiler (wall, GPU busy ms,
    the host's waits, kernels), then one with the host's events (``_host_self_ms``)."""
    found = {}
    for kind, enter in _variants(model).items():
        with enter():
            train_step(model, opt, batch)  # not the first step after a patch or revert
            step = profiled_step(lambda: train_step(model, opt, batch))
            found[kind] = {
                "profiled": {
                    "wall_ms": step["wall_ms"],
                    "gpu_busy_ms": sum(step["kernel_ms"].values()),
                    "host_wait_ms": dict(step["host_wait_ms"]),
                    "kernels": step["kernels"],
                },
                "host_events": _host_self_ms(model, opt, batch),
            }
    return found


def _row(model, opt, tokens: int, ignored: float, args) -> dict:
    """One model and token count: each variant's median phases and wall, its profiled step, the
    host events' largest differences, and patched minus unpatched for each phase."""
    batch = make_batch(tokens, model.config.vocab_size, ignored, "cuda")
    steps = _timed(model, opt, batch, args)
    profiled = _profiled(model, opt, batch)
    row: dict = {"tokens": tokens, "ignored": ignored}
    for kind, done in steps.items():
        row[kind] = {key: statistics.median(s[key] for s in done) for key in done[0]}
        row[kind]["profiled"] = profiled[kind]["profiled"]
    host = {kind: found["host_events"] for kind, found in profiled.items()}
    row["host_self_ms"] = {kind: round(sum(found.values()), 3) for kind, found in host.items()}
    row["host_self_ms_largest_differences"] = _largest_differences(host["unpatched"], host["patched"])
    row["patched_minus_unpatched_ms"] = {
        key: row["patched"][key] - row["unpatched"][key] for key in steps["patched"][0]
    }
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "llama-3.2-1b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[256, 1024, 4096])
    parser.add_argument("--ignored", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--commit", default=None, help="the tree's commit, recorded in the JSON")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not need_cuda(__file__):
        return 2
    rows = []
    for name in args.models:
        family, config = GPU_PLAN.models[name]
        model = build_model(family, config, GPU_PLAN)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        for tokens in args.tokens:
            rows.append({"model": name, **_row(model, opt, tokens, args.ignored, args)})
            print(rows[-1], flush=True)
        del model, opt
        torch.cuda.empty_cache()
    if args.out:
        write_json(args.out, {**environment("transformers"), "commit": args.commit, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
