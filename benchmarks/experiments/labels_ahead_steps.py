"""Probe: what beginning the loss's label check before the model's body does to training steps
(issue 43; ``patching/labels_ahead.py``, ``Tuning.check_labels_ahead``).

A patched forward whose loss waits for its label check to skip the ignored rows (1,024 tokens
and more at a quarter ignored for the 1-2B models here: ``Tuning.wait_to_skip_gflop``) waited,
with the check queued by the loss, for the whole body's GPU work; begun ahead, the check has run
before the body's kernels. Three variants of ``host_bound.py``'s models (random init, bf16, fused
AdamW at learning rate 0, one 1 x tokens sequence, ``--ignored`` of it ignored as a prompt):
unpatched, patched with the check queued by the loss (``Tuning(check_labels_ahead=False)``),
and patched with it begun ahead (the default).

Every variant warmed up, then ``--rounds`` rounds of three steps a variant (the first untimed),
the order reversed every other round. A step runs from a synchronised start to a synchronised
end; within it the forward's host ms (the patched forward's wait, where it waits, is in it) is
timed too. Per row: the median step ms and forward host ms of each variant, the paired ratios of
the patched variants' step ms against unpatched and of ahead against the loss's check, and the
losses of the last step of each (equal bits for the two patched variants).

    python benchmarks/experiments/labels_ahead_steps.py \
        --out benchmarks/experiments/results/labels_ahead_steps.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common, host_bound
from common import environment, git_head, need_cuda, write_json  # noqa: E402
from host_bound import GPU_PLAN, LR, build_model, free_memory, make_batch, ours_applied  # noqa: E402

from liger_patch.ops.core.tuning import Tuning  # noqa: E402


def variants(model: torch.nn.Module) -> dict:
    return {
        "unpatched": contextlib.nullcontext,
        "loss_check": partial(ours_applied, model, tuning=Tuning(check_labels_ahead=False)),
        "ahead": partial(ours_applied, model),
    }


def steps(model, opt, batch, n: int) -> tuple[list[float], list[float], float]:
    """``n`` steps: each one's ms, its forward's host ms, and the last loss."""
    step_ms, forward_ms, loss = [], [], None
    for _ in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model(**batch)
        forward_ms.append(1e3 * (time.perf_counter() - start))
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        step_ms.append(1e3 * (time.perf_counter() - start))
        loss = out.loss.detach()
    return step_ms, forward_ms, float(loss)


def timed(model, opt, batch, kinds: dict, rounds: int) -> dict:
    for enter in kinds.values():
        with enter():
            steps(model, opt, batch, 3)
    runs = {kind: {"step": [], "forward": [], "loss": None} for kind in kinds}
    for round_ in range(rounds):
        order = list(kinds.items())
        for kind, enter in order if round_ % 2 == 0 else reversed(order):
            with enter():
                step_ms, forward_ms, loss = steps(model, opt, batch, 3)
            runs[kind]["step"].append(statistics.median(step_ms[1:]))
            runs[kind]["forward"].append(statistics.median(forward_ms[1:]))
            runs[kind]["loss"] = loss
    out = {}
    for kind, run in runs.items():
        out[f"{kind}_step_ms"] = statistics.median(run["step"])
        out[f"{kind}_forward_host_ms"] = statistics.median(run["forward"])
        out[f"{kind}_loss"] = run["loss"]

    def paired(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(runs[a]["step"], runs[b]["step"], strict=True))

    out["loss_check_paired_ratio"] = paired("loss_check", "unpatched")
    out["ahead_paired_ratio"] = paired("ahead", "unpatched")
    out["ahead_over_loss_check"] = paired("ahead", "loss_check")
    return out


def model_rows(name: str, tokens_list: list[int], ignored: float, rounds: int):
    family, config = GPU_PLAN.models[name]
    model = build_model(family, config, GPU_PLAN)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    for tokens in tokens_list:
        batch = make_batch(tokens, model.config.vocab_size, ignored, "cuda")
        row = {"model": name, "tokens": tokens, "ignored": ignored}
        row.update(timed(model, opt, batch, variants(model), rounds))
        print(row, flush=True)
        yield row
    del model, opt
    free_memory()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "llama-3.2-1b", "qwen3-1.7b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[256, 1024, 4096, 16384])
    parser.add_argument("--ignored", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    if not need_cuda("labels_ahead_steps.py"):
        raise SystemExit(2)
    rows = [r for m in args.models for r in model_rows(m, args.tokens, args.ignored, args.rounds)]
    head = {**environment("transformers"), "commit": args.commit or git_head()}
    write_json(args.out, {**head, "rows": rows})


if __name__ == "__main__":
    main()
