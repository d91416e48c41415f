"""Host (CPU) time of one loss-head forward + backward: what the op costs a CPU-bound training step.

Under DeepSpeed ZeRO-3 at small models the step is bound by the host (issue 28): the GPU waits
for launches, so every microsecond the head spends on the CPU adds to the step. This measures,
per mode, the host time of a forward + backward (from a synchronised start until ``backward()``
returns, i.e. until the last kernel is queued) and the whole time once the GPU has finished, as
medians over repetitions; then one ``torch.profiler`` table of our op's CPU side.

Modes: ``unpatched`` (``F.linear``, fp32 upcast, ``F.cross_entropy``, as transformers' loss), ours
at the patched forward's default ``"batch"`` budget and at 1 GiB (fewer chunks), and a 1-layer
Llama with the same head trained unpatched and patched (the patching path's own host cost).

    python benchmarks/experiments/op_host_time.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
from common import environment, make_inputs, need_cuda  # noqa: E402

SHAPES = {"h1024_4x1024": (4, 1024, 1024), "h2048_4x2048": (4, 2048, 2048)}  # batch, seq, hidden
VOCAB, REPS = 128256, 30


def _labels(batch: int, seq: int, device) -> torch.Tensor:
    """Random labels with the first quarter of each sequence ignored (zero3_gpu.py's batches)."""
    labels = torch.randint(0, VOCAB, (batch, seq), device=device)
    labels[:, : seq // 4] = -100
    return labels.view(-1)


def _times(step) -> dict:
    for _ in range(3):
        step()
    host, whole = [], []
    for _ in range(REPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append(1e3 * (t1 - t0))
        whole.append(1e3 * (time.perf_counter() - t0))
    return {"host_ms": statistics.median(host), "whole_ms": statistics.median(whole)}


def _head_steps(batch: int, seq: int, hidden_size: int) -> dict:
    import liger_patch as lp

    hidden, weight, _ = make_inputs(batch * seq, hidden_size, VOCAB, logit_std=3.0)
    labels = _labels(batch, seq, hidden.device)

    def unpatched():
        hidden.grad = weight.grad = None
        F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="mean").backward()

    def ours(budget):
        def step():
            hidden.grad = weight.grad = None
            lp.fused_linear_cross_entropy(hidden, weight, labels, memory_budget=budget).backward()

        return step

    return {
        "unpatched": unpatched,
        "ours_batch": ours("batch"),
        "ours_1GiB": ours("1GiB"),
    }


def _model_step(batch: int, seq: int, hidden_size: int) -> tuple[object, object]:
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = hidden_size // 64
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    ids = torch.randint(0, VOCAB, (batch, seq), device="cuda")
    labels = ids.clone()
    labels[:, : seq // 4] = -100

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=labels).loss.backward()

    return step, model


def _profile(step, path: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    path.write_text(table)
    events = prof.key_averages()
    launches = sum(e.count for e in events if "LaunchKernel" in e.key)
    aten = sum(e.count for e in events if e.key.startswith("aten::"))
    return {"kernel_launches": launches, "aten_ops": aten}


def _host_us(fn, n: int = 200) -> float:
    """Host microseconds per call of ``fn`` over ``n`` calls queued back to back."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return host


def _launch_costs() -> dict:
    """Host cost of each piece of one chunk at the h1024 head (768 kept rows a chunk), and of the
    op's forward and backward apart: where the op's host time goes."""
    import liger_patch as lp
    from liger_patch.ops.core.triton import logits as tl_logits
    from liger_patch.ops.core.triton import scale as tl_scale
    from liger_patch.ops.core.triton.common import jitted
    from liger_patch.ops.cross_entropy.options import DEFAULT_OPTIONS as opts
    from liger_patch.ops.cross_entropy.triton import rows as tl_rows

    n, h_size, rows = 4096, 1024, 768
    hidden, weight, _ = make_inputs(n, h_size, VOCAB, logit_std=3.0)
    labels = _labels(4, 1024, hidden.device)
    kept = torch.nonzero(labels != -100).view(-1)[:rows]
    h, w = hidden.detach(), weight.detach()
    chunk = h.index_select(0, kept)
    out = torch.empty(rows, VOCAB, dtype=h.dtype, device=h.device)
    partials = tl_logits.logits_with_partials(chunk, w, None, opts, out)
    coef = torch.full((rows,), 1e-3, device=h.device)
    one = torch.ones((), device=h.device)
    grad_w = torch.empty_like(w)
    costs = {
        "index_select_rows": _host_us(lambda: h.index_select(0, kept)),
        "logits_kernel": _host_us(lambda: tl_logits.logits_with_partials(chunk, w, None, opts, out)),
        "rows_kernel": _host_us(
            lambda: tl_rows.ce_rows_triton(
                out, labels[kept], opts, grad=out, coef_ce=coef, coef_z=coef, partials=partials
            )
        ),
        "mm_grad_h": _host_us(lambda: out @ w),
        "addmm_grad_w": _host_us(lambda: grad_w.addmm_(out.t(), chunk)),
        "scale_shipped": _host_us(lambda: tl_scale.scale_([grad_w], one)),
        "scale_no_fn_constexpr": _host_us(
            lambda: jitted(tl_scale._scale_kernel)[(triton_cdiv(grad_w.numel(), 4096),)](
                grad_w,
                one.reshape(1),
                grad_w.numel(),
                BLOCK=4096,
                ROUND_BF16_NEAREST=False,
                ROUND_FN=None,
                num_warps=8,
            )
        ),  # fmt: skip
        "torch_mul_": _host_us(lambda: grad_w.mul_(one)),
    }
    losses = []

    def forward():
        losses.append(lp.fused_linear_cross_entropy(hidden, weight, labels, memory_budget="batch"))

    costs["op_forward"] = _host_us(forward, n=20)
    costs["op_backward"] = _host_us(lambda: losses.pop().backward(), n=20)
    return costs


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _python_profile(out: Path) -> None:
    """cProfile of 30 forward + backward calls of ours at the h1024 row's head: which Python
    functions (ours, Triton's launcher, torch's custom-op dispatch) the host time goes to."""
    import cProfile
    import pstats

    step = _head_steps(*SHAPES["h1024_4x1024"])["ours_batch"]
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(30):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    with open(out / "python_profile.txt", "w") as f:
        stats = pstats.Stats(profiler, stream=f)
        stats.sort_stats("tottime").print_stats(60)
        stats.sort_stats("cumulative").print_stats(80)


def main() -> int:
    if not need_cuda(__file__):
        return 2
    import liger_patch as lp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--python-profile", action="store_true", help="only the cProfile of ours")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.python_profile:
        _python_profile(out)
        return 0
    result = {"environment": environment(), "device": torch.cuda.get_device_name(), "rows": {}}
    result["launch_costs_us"] = _launch_costs()
    print("launch_costs_us", json.dumps(result["launch_costs_us"]), flush=True)
    for name, (batch, seq, hidden_size) in SHAPES.items():
        row = {}
        steps = _head_steps(batch, seq, hidden_size)
        for mode, step in steps.items():
            row[mode] = _times(step)
        row["profile_ours_batch"] = _profile(steps["ours_batch"], out / f"profile_{name}_ours.txt")
        row["profile_unpatched"] = _profile(steps["unpatched"], out / f"profile_{name}_unpatched.txt")
        del steps
        step, model = _model_step(batch, seq, hidden_size)
        row["model_unpatched"] = _times(step)
        with lp.liger_patched(model):
            row["model_patched"] = _times(step)
            row["profile_model_patched"] = _profile(step, out / f"profile_{name}_model.txt")
        del step, model
        torch.cuda.empty_cache()
        result["rows"][name] = row
        print(name, json.dumps(row), flush=True)
    (out / "op_host_time.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
