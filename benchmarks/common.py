"""What the benchmark scripts share: shapes, inputs, timing, memory measuring, result files (and
the commit they name), the label checks a probe queues, and the process-per-variant runner.

Used by the kept suite (``flce.py``, ``distill.py``, ``e2e*.py``, ``distributed_gpu.py``, ...)
and by the probes in ``experiments/`` (which put this folder on ``sys.path`` to import it).
Importing it needs torch only; triton is imported where a function times something.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from liger_patch.ops.core.validation import ValueCheck

MiB = 1 << 20
GiB = 1 << 30

# The four headline shapes (N tokens, H hidden, V vocabulary) of docs/benchmarks.md.
SHAPES = {
    "8192x4096x128256": (8192, 4096, 128256),
    "16384x4096x128256": (16384, 4096, 128256),
    "8192x2304x256000": (8192, 2304, 256000),
    "32768x4096x151936": (32768, 4096, 151936),
}

# Models the end-to-end benchmarks train (random init; keyword arguments of the transformers config).
LLAMA_3_2_1B = dict(  # LlamaConfig
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)

QWEN2_5_05B = dict(  # Qwen2Config
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
)

QWEN3_1_7B = dict(  # Qwen3Config
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)

LLAMA_3_1_8B = dict(  # LlamaConfig
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)

QWEN2_5_7B = dict(  # Qwen2Config
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
)


def need_cuda(script: str) -> bool:
    """True when a CUDA GPU is there; otherwise says so on stderr (the script then exits 2)."""
    if torch.cuda.is_available():
        return True
    print(f"{script} needs a CUDA GPU", file=sys.stderr)
    return False


def cpu_triton_refusal(package: str) -> str | None:
    """Why ``package``'s Triton kernels cannot run on CPU tensors in this process, else ``None``.
    A peer's kernels are Triton's JIT functions, compiled for the GPU unless ``TRITON_INTERPRET=1``
    was set when they were defined (the peer imported): the smoke modes, on the CPU, run a peer's
    Triton path only under the interpreter (CI), and report it missing on a GPU machine, where
    it would be handed CPU tensors ("cannot be accessed from Triton"). Ours choose per call."""
    if os.environ.get("TRITON_INTERPRET", "").strip() == "1":
        return None
    return f"{package}: its Triton kernels run on CPU tensors only under TRITON_INTERPRET=1"


def make_inputs(
    n: int,
    h: int,
    v: int,
    dtype: torch.dtype = torch.bfloat16,
    ignore_frac: float = 0.0,
    seed: int = 0,
    logit_std: float = 1.0,
    device: str = "cuda",
):
    """Random ``hidden`` (N, H) and ``weight`` (V, H), both requiring grad, and labels (N,).

    ``hidden`` ~ N(0, 1) and ``weight`` ~ N(0, 1/H) scaled so that the logits have a standard
    deviation of about ``logit_std`` (a trained model's are about 3: docs/benchmarks.md); a
    fraction ``ignore_frac`` of the labels is set to -100. Never zeros: some kernels' speed
    depends on the values.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, device=device, dtype=dtype, generator=gen)
    scale = math.sqrt(h) / logit_std  # exactly sqrt(H) at the default std of 1
    weight = (torch.randn(v, h, device=device, dtype=dtype, generator=gen) / scale).to(dtype)
    labels = torch.randint(0, v, (n,), device=device, generator=gen)
    if ignore_frac:
        drop = torch.rand(n, device=device, generator=gen) < ignore_frac
        labels[drop] = -100
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def bench(fn, rep_ms: int) -> float:
    """Median ms of ``fn()`` over ``rep_ms`` of repetitions (``triton.testing.do_bench``, which
    warms up and flushes L2 between repetitions)."""
    import triton.testing

    return triton.testing.do_bench(fn, rep=rep_ms, return_mode="median")


def fwd_bwd(fn, hidden, weight, labels):
    """One forward and backward of ``fn(hidden, weight, labels)`` from cleared gradients."""
    hidden.grad = weight.grad = None
    loss = fn(hidden, weight, labels)
    loss.backward()
    return loss


def floor_fn(hidden, weight, grad_logits):
    """The three GEMMs an exact method cannot avoid."""
    logits = hidden @ weight.t()
    grad_h = grad_logits @ weight
    grad_w = grad_logits.t() @ hidden
    return logits, grad_h, grad_w


def time_floor(hidden, weight, rep_ms: int) -> float:
    """Median ms of the three GEMMs on random gradient logits (freed afterwards)."""
    grad_logits = torch.randn(hidden.shape[0], weight.shape[0], device="cuda", dtype=hidden.dtype) * 1e-4
    ms = bench(functools.partial(floor_fn, hidden, weight, grad_logits), rep_ms)
    torch.cuda.empty_cache()
    return ms


class PeakMemory:
    """CUDA memory over a ``with`` block: ``start`` (allocated on entry), ``peak`` and
    ``peak_reserved`` (the allocator's maxima inside the block), in bytes. Synchronises on
    entry and exit; empties no cache (callers that want that do it before).

    ``peak_requested`` is the peak of the bytes the tensors asked for: ``peak`` counts whole
    allocator blocks, and a cached block reused without being split (its spare under 1 MiB)
    counts in full, so two runs holding the same tensors can differ there by up to 1 MiB
    per reused block."""

    def __enter__(self) -> PeakMemory:
        torch.cuda.synchronize()
        self.start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated()
        self.peak_requested = torch.cuda.memory_stats().get("requested_bytes.all.peak", 0)
        self.peak_reserved = torch.cuda.max_memory_reserved()
        self.end = torch.cuda.memory_allocated()


def extra_memory_mib(fn, hidden, weight, labels) -> float:
    """Peak bytes allocated during fwd+bwd beyond the inputs and their gradients, in MiB."""
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    with PeakMemory() as mem:
        fwd_bwd(fn, hidden, weight, labels)
    grads = hidden.numel() * hidden.element_size() + weight.numel() * weight.element_size()
    hidden.grad = weight.grad = None
    return (mem.peak - mem.start - grads) / MiB


def environment(*packages: str) -> dict:
    """Device and versions (torch, triton, python, then each of ``packages``), for the head of a
    result file."""
    import triton

    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        **{name: importlib.import_module(name).__version__ for name in packages},
    }


def write_json(path: str | Path, data: object, indent: int = 1) -> None:
    """Write ``data`` as JSON to ``path``, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + "\n")  # a text file ends its last line


def git_head() -> str | None:
    """The checked-out commit (``git rev-parse --short HEAD``), or ``None`` without git or outside
    a checkout: what a probe's result file names as its commit when ``--commit`` is not given."""
    try:
        cmd = ["git", "rev-parse", "--short", "HEAD"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


PENDING_CHECKS: list[ValueCheck] = []  # label checks a probe queued while timing, read after it


def read_checks() -> None:
    """Wait for the answer of every check in ``PENDING_CHECKS`` (raising for a bad label) and
    empty it: the probes that queue the op's deferred check themselves read it between timings,
    as the op reads its own, so that the wait is not timed."""
    while PENDING_CHECKS:
        PENDING_CHECKS.pop().result()


def append_jsonl(path: str | Path, row: dict) -> None:
    """Print ``row`` as one JSON line and append it to ``path`` (a probe's rows, kept as they come
    so that a cut-off run keeps what it measured)."""
    line = json.dumps(row)
    print(line, flush=True)
    with open(path, "a") as f:
        f.write(line + "\n")


def update_json(path: str | Path, key: str, value: object, **head: object) -> None:
    """Set ``key`` in the JSON object at ``path`` (created with ``head`` when missing), keeping
    its other keys: one result file per probe, one key per mode of it."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.exists() else dict(head)
    data[key] = value
    write_json(path, data)


def report_row(result: dict, table: str, out: str | None) -> None:
    """After each point of a sweep: print the markdown ``table``'s newest row (the whole table
    after the first point) and, with ``out``, write ``result`` there as JSON and ``table`` beside
    it (``.md`` for the suffix) under a line naming the device and versions, so that a cut-off run
    keeps what it measured."""
    print(table.splitlines()[-1] if len(result["rows"]) > 1 else table, flush=True)
    if out:
        write_json(out, result)
        with open(out.rsplit(".", 1)[0] + ".md", "w") as f:
            f.write(f"{result['device']}, torch {result['torch']}, triton {result['triton']}\n\n{table}\n")


# ---- shared by the end-to-end scripts (e2e.py, e2e_trl.py, e2e_distill.py) ----


def run_in_processes(script: str, runs: list[dict], args: list[str], echo_stderr: bool = True) -> list[dict]:
    """Each run in its own process, so that patches and allocator state do not leak between runs:
    ``python script --one <the run's values> <args>``, whose last stdout line is its JSON result.
    A failed run's result is the run itself with ``error``, its stderr's last line (with
    ``echo_stderr`` its stderr's tail is printed too). Each result is printed as it comes."""
    results = []
    for run in runs:
        cmd = [sys.executable, script, "--one", *run.values(), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy(), timeout=900)
        if proc.returncode == 0:
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        else:
            if echo_stderr:
                print(proc.stderr[-3000:], file=sys.stderr)
            results.append({**run, "error": proc.stderr.strip().splitlines()[-1:]})
        print(json.dumps(results[-1]), flush=True)
    return results


def report_runs(results: list[dict], table: str, out: str | None, packages: tuple = (), **head) -> None:
    """Print the markdown ``table`` of ``results`` and, with ``out``, write both there as JSON
    after the ``environment`` (with the versions of ``packages``) and the ``head`` fields."""
    print(table)
    if out:
        write_json(out, {**environment(*packages), **head, "results": results, "table": table})


# ---- shared by the multi-process scripts (distributed_gpu.py, tp_gpu.py) ----

LOSS_TOL = 2e-2  # bf16 patched vs unpatched, absolute, per step (losses are ~8.3)
GRAD_TOL = 5e-2  # step-0 gradient, relative L2 error of the worst parameter


def log(*args) -> None:
    """Print on rank 0 only."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(*args, flush=True)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (gathered when a DTensor), detached, fp32, on the CPU."""
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().float().cpu()


def batch_for(step: int, seed: int, vocab: int, batch: int, seq: int, device: torch.device) -> dict:
    """Random ids for one step, the first quarter of each sequence an ignored "prompt"; ``seed``
    tells data-parallel replicas apart."""
    g = torch.Generator().manual_seed(1000 * step + seed)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = input_ids.clone()
    labels[:, : seq // 4] = -100  # a "prompt"
    return {"input_ids": input_ids.to(device), "labels": labels.to(device)}


def worst_relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest relative L2 error of ``a``'s tensors against ``b``'s, and its name."""
    assert a.keys() == b.keys(), f"different parameters: {sorted(set(a) ^ set(b))}"
    errors = {n: ((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-12)).item() for n in b}
    name = max(errors, key=errors.get)
    return errors[name], name


def max_abs_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


HOST_WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


def profiled_step(step: Callable[[], None]) -> dict:
    """``step()`` once under ``torch.profiler`` (CPU and CUDA), from a synchronised start: its wall
    ms (synchronised), ``kernel_ms`` (a Counter: each kernel's summed GPU ms, by name),
    ``host_wait_ms`` (a Counter: the host's ms inside the CUDA calls that wait for the GPU, by
    call) and the kernel count."""
    import collections
    import time

    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - start)
    kernels: collections.Counter = collections.Counter()
    waits: collections.Counter = collections.Counter()
    count = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name[:90]] += event.device_time_total / 1e3
            count += 1
        elif event.name.startswith(HOST_WAITS):
            waits[event.name] += event.cpu_time_total / 1e3
    return {"wall_ms": wall, "kernel_ms": kernels, "host_wait_ms": waits, "kernels": count}


def alternating_rounds(run: Callable[[bool], dict], rounds: int) -> list[dict]:
    """``rounds`` rounds of ``run(patched)`` for unpatched and patched, the order alternating
    (unpatched first in even rounds), so that a drift of the machine over the launch falls on
    both alike (separate launches of the 2-GPU scripts differed by up to 40 %). Returns the two
    records of the first round, unpatched then patched, each with ``round_step_s`` (every
    round's ``median_step_s``) and ``median_step_s`` now their median; the patched one also with
    ``round_ratios`` (patched / unpatched in each round) and ``paired_ratio``, their median; where
    the runs give ``step_s`` (every step's time), ``round_steps_s`` keeps every round's."""
    import statistics

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    done: list[dict[bool, dict]] = []
    for r in range(rounds):
        done.append({patched: run(patched) for patched in ((False, True) if r % 2 == 0 else (True, False))})
    records = [dict(done[0][False]), dict(done[0][True])]
    for record, patched in zip(records, (False, True), strict=True):
        record["round_step_s"] = [runs[patched]["median_step_s"] for runs in done]
        record["median_step_s"] = statistics.median(record["round_step_s"])
        if "step_s" in record:  # every step of every round, to tell a drift from a mode
            record["round_steps_s"] = [runs[patched]["step_s"] for runs in done]
    ratios = [p / u for u, p in zip(records[0]["round_step_s"], records[1]["round_step_s"], strict=True)]
    records[1]["round_ratios"] = ratios
    records[1]["paired_ratio"] = statistics.median(ratios)
    return records


def training_steps(
    model, vocab: int, seed: int, device: torch.device, args, foreach: bool | None = None
) -> dict:
    """``args.mem_steps`` AdamW steps of an already patched / sharded ``model`` on ``batch_for``
    batches (``seed`` tells data-parallel replicas apart): the losses, every step's time and their
    median (the first step left out), whether the fused path ran, and on CUDA the memory before the
    steps, the peak allocated and reserved during them, and every rank's peak. ``foreach``:
    AdamW's (``False`` for a model whose parameters mix DTensors and plain tensors)."""
    import contextlib
    import statistics
    import time

    import torch.distributed as dist

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=foreach)
    times, losses = [], []
    with PeakMemory() if device.type == "cuda" else contextlib.nullcontext() as mem:
        for step in range(args.mem_steps):
            batch = batch_for(step, seed, vocab, args.batch, args.seq, device)
            start = time.perf_counter()
            out = model(**batch)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            losses.append(out.loss.detach().float().item())
    result = {
        "losses": losses,
        "median_step_s": statistics.median(times[1:] or times),
        "step_s": times,
        "fused_path_ran": out.logits is None,
    }
    if device.type == "cuda":
        peak = torch.tensor([mem.peak / GiB], device=device)
        peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
        dist.all_gather(peaks, peak)
        result.update(
            allocated_before_steps_gib=mem.start / GiB,
            peak_allocated_gib=mem.peak / GiB,
            peak_reserved_gib=mem.peak_reserved / GiB,
            peak_allocated_gib_per_rank=[p.item() for p in peaks],
        )
    return result
