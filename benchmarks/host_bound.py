"""Issue 43 ("No host stall"): what our fused linear cross-entropy costs a host-bound training step.

A training step's host runs ahead of the GPU; an op that reads a value back (the label-range
check) makes it wait for all the work queued before it, so small micro-batches, whose steps are
bound by the host, train slower patched than unpatched. This measures the issue's targets 1-3 on
one GPU, rows printed as JSON lines as they come:

* ``"part": "op"`` (targets 1 and 2): one forward + backward of ``fused_linear_cross_entropy``
  ("ours") and of the eager head + loss (``F.cross_entropy((hidden @ weight.T).float(), labels)``)
  at N tokens x (H, V) heads, bf16, logits spread like a trained model's (std 3), with a share
  ``ignored`` of the labels -100 at random positions. ``*_host_ms``: the host time of the call
  while the GPU still has about 20 ms of earlier work queued (a ``torch.cuda._sleep`` spin
  calibrated with events), no synchronisation until the call has returned;
  ``gpu_still_busy_after_*``: whether that spin was still running when the call returned in every
  repetition (for eager it must be: the measure's check; for ours it is the issue's target).
  ``*_wall_ms``: the synchronised wall time of one call. Medians over repetitions after warm-ups.
* ``"part": "distill"`` (target 1's distillation): the same for ``fused_linear_distillation``
  (generalized JSD, beta 0.5) against the eager loss over both sides' fp32 logits (TRL's
  generalized JSD written without its boolean index, which syncs), at N tokens x (student H,
  teacher H, V) head pairs; keys ``H_student`` and ``H_teacher`` in place of ``H``.
* ``"part": "step"`` (target 3): one AdamW (fused) training step of a random-init Qwen2.5-0.5B-,
  Qwen3-1.7B-, Llama-3.2-1B- and Llama-3.1-8B-shaped model (bf16, sdpa; the 8B to 4,096 tokens)
  on a 1 x ``tokens`` batch whose first ``ignored`` share of labels is -100 (a prompt),
  synchronised only at the step's boundaries: unpatched, patched (``apply_liger_to`` on the same
  instance, then ``revert_liger``) and liger-kernel's fused head (null when ``liger_kernel`` is
  not importable), in alternating segments on one model with the same batch and seeds, the order
  reversed every other round. ``*_step_ms``: medians of every timed step; ``paired_ratio``: the
  median over rounds of patched over unpatched (each a segment's median), which a drift of the
  machine during the row moves less; ``loss_rel_diff``: the largest relative difference of a
  patched step's loss from the unpatched step's of the same round (learning rate 0: the optimizer
  does all its work and the weights do not move, so every step's loss is the same model's; with
  1e-6 an 8B model's first steps moved its loss by over 1 %).

With ``--out`` the rows go there as JSON (the environment's keys and ``"rows"``, a list) and as
markdown tables beside it (``.md``), both rewritten after every row so
that a cut-off run keeps what it measured. Everything runs in this one process for that reason.

    python benchmarks/host_bound.py --out docs/results/host_bound.json
    python benchmarks/host_bound.py --parts step
    python benchmarks/host_bound.py --smoke --out /tmp/hb.json   # tiny shapes on the CPU: a script check
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from common import (
    LLAMA_3_1_8B,
    LLAMA_3_2_1B,
    QWEN2_5_05B,
    QWEN3_1_7B,
    cpu_triton_refusal,
    environment,
    fwd_bwd,
    make_inputs,
    need_cuda,
    write_json,
)

LOGIT_STD = 3.0  # a trained model's logits spread (docs/benchmarks.md)
BUSY_MS = 20.0  # GPU work queued ahead of each host-timed call
LOSS_REL_TOL = 1e-2  # bf16, patched against unpatched, relative, per step
LR = 0.0  # AdamW's whole step is run, the weights stay: each step's loss is of the same model

TINY_LLAMA = dict(vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                  tie_word_embeddings=True)  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """What one run measures: the device and dtype, the op's shapes, the models and token counts
    of the steps, and the repetition counts."""

    device: str
    dtype: torch.dtype
    op_n: tuple[int, ...]
    op_heads: tuple[tuple[int, int], ...]
    models: dict[str, tuple[str, dict]]  # name: (family, config keywords)
    tokens: tuple[int, ...]
    ignored: tuple[float, ...] = (0.0, 0.25)
    op_warmup: int = 3
    op_reps: int = 10
    step_warmup: int = 3
    rounds: int = 6  # segments per variant and row, the variants' order reversed every other round
    segment_steps: int = 2  # timed steps per segment (after one untimed): 12 per variant in all
    max_tokens: dict[str, int] = dataclasses.field(default_factory=dict)  # a model's largest batch
    distill_n: tuple[int, ...] = ()
    distill_heads: tuple[tuple[int, int, int], ...] = ()  # (student H, teacher H, V)
    call_graphs: bool = False  # the op and distill rows' "ours" with Tuning(call_graphs=True)


GPU_PLAN = Plan(
    device="cuda",
    dtype=torch.bfloat16,
    op_n=(256, 1024, 4096, 16384),
    # Qwen2.5-0.5B, Llama-3.2-1B, -3.1-8B; Mistral-7B (V 32k), Gemma-3-4B (V 262k), Llama-3.1-70B (H 8192)
    op_heads=((896, 151936), (2048, 128256), (4096, 128256), (4096, 32768), (2560, 262144), (8192, 128256)),
    models={
        "qwen2.5-0.5b": ("qwen2", QWEN2_5_05B),
        "qwen3-1.7b": ("qwen3", QWEN3_1_7B),
        "llama-3.2-1b": ("llama", LLAMA_3_2_1B),
        "llama-3.1-8b": ("llama", LLAMA_3_1_8B),
    },
    tokens=(256, 1024, 4096, 16384),
    max_tokens={"llama-3.1-8b": 4096},  # its weights, gradients and AdamW states take 64 GB
    distill_n=(256, 1024, 4096),
    # Qwen2.5-0.5B from Qwen2.5-1.5B, Llama-3.2-1B from Llama-3.1-8B
    distill_heads=((896, 1536, 151936), (2048, 4096, 128256)),
)
SMOKE_PLAN = Plan(
    device="cpu",
    dtype=torch.float32,
    op_n=(32,),
    op_heads=((16, 97),),
    models={"tiny-llama": ("llama", TINY_LLAMA)},
    tokens=(32,),
    distill_n=(32,),
    distill_heads=((16, 24, 97),),
)


def synchronize(device: str) -> None:
    """Wait for the GPU (nothing to wait for on the CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    """Drop what the last row left behind, so that the next row starts from an empty cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- the GPU work queued ahead of a host-timed call ----


def sleep_cycles(busy_ms: float) -> int:
    """``torch.cuda._sleep`` cycles that keep the GPU busy for about ``busy_ms``: the spin's rate
    measured with events (median of three), as the SM clock sets it."""
    probe = 10_000_000
    torch.cuda._sleep(probe)  # the first launch loads the kernel
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return int(probe * busy_ms / statistics.median(times))


class Backlog:
    """Queues about ``BUSY_MS`` of GPU work (one spin kernel) and returns an event recorded right
    after it; on the CPU queues nothing and returns ``None``."""

    def __init__(self, device: str) -> None:
        self.cycles = sleep_cycles(BUSY_MS) if device == "cuda" else 0

    def queue(self) -> torch.cuda.Event | None:
        """Launch the spin; the event that completes when it has run (``None`` on the CPU)."""
        if not self.cycles:
            return None
        torch.cuda._sleep(self.cycles)
        done = torch.cuda.Event()
        done.record()
        return done


def steady_host_ms(call: Callable[[], object], backlog: Backlog, calls: int = 10) -> float:
    """Host ms per call of ``calls`` calls in a row behind about 100 ms of queued GPU work (CUDA):
    a training loop's host, busy without pause, rather than one call just after a sync; the
    deferred label checks read after it (the probes in ``experiments/`` use it)."""
    from liger_patch.ops.core import deferred_checks

    torch.cuda.synchronize()
    for _ in range(5):
        backlog.queue()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    ms = 1e3 * (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    deferred_checks.raise_pending()
    return ms


# ---- part "op": one forward + backward, host time and wall time ----


def eager_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The unpatched head + loss: fp32 logits, then ``F.cross_entropy`` (as transformers' loss)."""
    return F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=-100)


def ours_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Our fused op at its defaults (``backend="auto"``: Triton on CUDA, PyTorch on the CPU)."""
    import liger_patch as lp

    return lp.fused_linear_cross_entropy(hidden, weight, labels)


def ours_with_graphs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The op with ``Tuning(call_graphs=True)``: its eager forward replayed as a CUDA graph
    (``core/call_graph.py``; off by default), for the probes that weigh graphs."""
    return _ours_tuned(hidden, weight, labels, _tuning(True))


def ours_ungraphed(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The op with ``Tuning(call_graphs=False)``: every call runs its forward's Python and
    launches, the other side of ``ours_with_graphs`` whatever the default."""
    return _ours_tuned(hidden, weight, labels, _tuning(False))


@functools.cache
def _tuning(call_graphs: bool):
    """``Tuning(call_graphs=...)``, made once: a caller passes the same settings at every call
    (a patched model builds its options once), and making them is host time of the caller's."""
    from liger_patch.ops.core.tuning import Tuning

    return Tuning(call_graphs=call_graphs)


def _ours_tuned(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, tuning) -> torch.Tensor:
    """The op with these ``Tuning`` settings."""
    from liger_patch.ops.cross_entropy.functional import fused_linear_cross_entropy

    return fused_linear_cross_entropy(hidden, weight, labels, tuning=tuning)


def host_time(call: Callable[[], object], backlog: Backlog, device: str) -> tuple[float, bool]:
    """Host ms of ``call()`` queued behind the backlog (timed without synchronising), and whether
    the backlog was still running when it returned (always ``False`` on the CPU)."""
    synchronize(device)
    queued = backlog.queue()
    start = time.perf_counter()
    call()
    ms = 1e3 * (time.perf_counter() - start)
    busy = queued is not None and not queued.query()
    synchronize(device)
    return ms, busy


def wall_time(call: Callable[[], object], device: str) -> float:
    """Synchronised wall ms of ``call()``."""
    synchronize(device)
    start = time.perf_counter()
    call()
    synchronize(device)
    return 1e3 * (time.perf_counter() - start)


def timed_pair(calls: dict[str, Callable[[], object]], plan: Plan, backlog: Backlog) -> dict:
    """``calls["ours"]`` and ``calls["eager"]`` alternated in every repetition, so both see the
    same card state: their median host ms behind the backlog and synchronised wall ms, and
    whether the backlog was still running when each returned, in every repetition."""
    for _ in range(plan.op_warmup):
        for call in calls.values():
            call()
    host: dict[str, list[float]] = {name: [] for name in calls}
    busy: dict[str, list[bool]] = {name: [] for name in calls}
    wall: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(plan.op_reps):
        for name, call in calls.items():
            ms, still_busy = host_time(call, backlog, plan.device)
            host[name].append(ms)
            busy[name].append(still_busy)
    for _ in range(plan.op_reps):
        for name, call in calls.items():
            wall[name].append(wall_time(call, plan.device))
    med = {f"{name}_{kind}_ms": statistics.median(times[name]) for kind, times in
           (("host", host), ("wall", wall)) for name in calls}  # fmt: skip
    return {
        "ours_host_ms": med["ours_host_ms"], "eager_host_ms": med["eager_host_ms"],
        "ours_wall_ms": med["ours_wall_ms"], "eager_wall_ms": med["eager_wall_ms"],
        "ours_over_eager_wall": med["ours_wall_ms"] / med["eager_wall_ms"],
        "gpu_still_busy_after_eager": all(busy["eager"]),
        "gpu_still_busy_after_ours": all(busy["ours"]),
    }  # fmt: skip


def op_row(n: int, h: int, v: int, ignored: float, plan: Plan, backlog: Backlog) -> dict:
    """One op row: one forward + backward of ours and of the eager head + loss."""
    hidden, weight, labels = make_inputs(
        n, h, v, plan.dtype, ignore_frac=ignored, logit_std=LOGIT_STD, device=plan.device
    )
    ours = ours_with_graphs if plan.call_graphs else ours_loss
    calls = {
        "ours": partial(fwd_bwd, ours, hidden, weight, labels),
        "eager": partial(fwd_bwd, eager_loss, hidden, weight, labels),
    }
    timed = timed_pair(calls, plan, backlog)
    hidden.grad = weight.grad = None
    row = {"part": "op", "N": n, "H": h, "V": v, "ignored": ignored, **timed}
    return {**row, "call_graphs": True} if plan.call_graphs else row


def op_rows(plan: Plan) -> Iterator[dict]:
    """Every op row, N by N (smallest first); a row that fails is a row with ``error`` (the run
    goes on)."""
    backlog = Backlog(plan.device)
    for n in plan.op_n:
        for h, v in plan.op_heads:
            for ignored in plan.ignored:
                where = {"part": "op", "N": n, "H": h, "V": v, "ignored": ignored}
                yield guarded(where, lambda n=n, h=h, v=v, i=ignored: op_row(n, h, v, i, plan, backlog))
                free_memory()


# ---- part "distill": the fused distillation, host time and wall time ----

DISTILL_BETA = 0.5  # the generalized JSD's mixture, both KL terms (TRL's GKD default)


def eager_distill(hidden, weight, labels, *, teacher: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The unpatched distillation loss: both sides' fp32 logits, then TRL's generalized JSD at
    ``DISTILL_BETA`` (temperature 1) over the kept tokens, written without a host sync (TRL's own
    picks the kept rows with a boolean index, which waits for the GPU; this does not)."""
    student = F.log_softmax((hidden @ weight.T).float(), dim=-1)
    with torch.no_grad():
        teacher_lp = F.log_softmax((teacher[0] @ teacher[1].T).float(), dim=-1)
    logs = torch.stack([student + math.log(1 - DISTILL_BETA), teacher_lp + math.log(DISTILL_BETA)])
    mixture = torch.logsumexp(logs, dim=0)
    kl_teacher = (teacher_lp.exp() * (teacher_lp - mixture)).sum(-1)
    kl_student = (student.exp() * (student - mixture)).sum(-1)
    per_token = DISTILL_BETA * kl_teacher + (1 - DISTILL_BETA) * kl_student
    keep = labels != -100
    return (per_token * keep).sum() / keep.sum().clamp_min(1)


def ours_distill(
    hidden, weight, labels, *, teacher: tuple[torch.Tensor, torch.Tensor], tuning=None
) -> torch.Tensor:
    """Our fused distillation at its defaults (or with ``tuning``), the same loss."""
    import liger_patch as lp

    return lp.fused_linear_distillation(hidden, weight, *teacher, labels, beta=DISTILL_BETA, tuning=tuning)


def distill_row(n: int, hs: int, ht: int, v: int, ignored: float, plan: Plan, backlog: Backlog) -> dict:
    """One distillation row: one forward + backward of ours and of the eager loss (the student's
    hidden states and weight get gradients, the teacher's do not)."""
    hidden, weight, labels = make_inputs(
        n, hs, v, plan.dtype, ignore_frac=ignored, logit_std=LOGIT_STD, device=plan.device
    )
    gen = torch.Generator(device=plan.device).manual_seed(2)
    t_h = torch.randn(n, ht, generator=gen, device=plan.device).to(plan.dtype)
    t_w = (torch.randn(v, ht, generator=gen, device=plan.device) * (LOGIT_STD / math.sqrt(ht))).to(plan.dtype)
    tuning = _tuning(True) if plan.call_graphs else None
    calls = {
        "ours": partial(
            fwd_bwd, partial(ours_distill, teacher=(t_h, t_w), tuning=tuning), hidden, weight, labels
        ),
        "eager": partial(fwd_bwd, partial(eager_distill, teacher=(t_h, t_w)), hidden, weight, labels),
    }
    timed = timed_pair(calls, plan, backlog)
    hidden.grad = weight.grad = None
    row = {"part": "distill", "N": n, "H_student": hs, "H_teacher": ht, "V": v, "ignored": ignored, **timed}
    return {**row, "call_graphs": True} if plan.call_graphs else row


def distill_rows(plan: Plan) -> Iterator[dict]:
    """Every distillation row, N by N (smallest first); a row that fails is a row with ``error``."""
    backlog = Backlog(plan.device)
    for n in plan.distill_n:
        for hs, ht, v in plan.distill_heads:
            for ignored in plan.ignored:
                where = {
                    "part": "distill",
                    "N": n,
                    "H_student": hs,
                    "H_teacher": ht,
                    "V": v,
                    "ignored": ignored,
                }
                yield guarded(where, partial(distill_row, n, hs, ht, v, ignored, plan, backlog))
                free_memory()


# ---- part "step": training steps of a whole model ----


def build_model(family: str, config: dict, plan: Plan) -> torch.nn.Module:
    """The random-init model in train mode, made on the device (a 1B model initialises in seconds
    there, in a minute on the CPU), sdpa attention."""
    from transformers import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        AutoModelForCausalLM,
        LlamaConfig,
        Qwen2Config,
        Qwen3Config,
    )

    torch.manual_seed(0)
    cfg = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family](**config)
    MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]  # its modules imported outside the device context (e2e.py)
    with torch.device(plan.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=plan.dtype, attn_implementation="sdpa")
    return model.train()


def make_batch(tokens: int, vocab: int, ignored: float, device: str) -> dict[str, torch.Tensor]:
    """One 1 x ``tokens`` sequence of random ids, its labels the ids with the first ``ignored``
    share set to -100 (a prompt)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    labels = ids.clone()
    labels[:, : round(tokens * ignored)] = -100
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict) -> tuple[torch.Tensor, bool]:
    """One optimizer step; the loss (detached, not read back: no sync) and whether the fused path
    ran (the logits came back ``None``)."""
    out = model(**batch)  # no dropout in these configs: every step of a row computes the same loss
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out.loss.detach(), out.logits is None


def segment(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict, steps: int, device: str) -> dict:
    """``steps`` steps each timed from a synchronised start to a synchronised end (ms), their
    losses, and whether the fused path ran in every one."""
    times, losses, fused = [], [], True
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        loss, fused_step = train_step(model, opt, batch)
        synchronize(device)
        times.append(1e3 * (time.perf_counter() - start))
        losses.append(loss.float().item())
        fused = fused and fused_step
    return {"ms": times, "losses": losses, "fused": fused}


@contextlib.contextmanager
def ours_applied(model: torch.nn.Module, **options) -> Iterator[None]:
    """The model patched by ``apply_liger_to`` on the instance (with ``options``), reverted on exit."""
    import liger_patch as lp

    lp.apply_liger_to(model, **options)
    try:
        yield
    finally:
        lp.revert_liger(model)


@contextlib.contextmanager
def liger_kernel_applied(model: torch.nn.Module, family: str) -> Iterator[None]:
    """liger-kernel's fused linear cross-entropy only (rope, rms_norm, swiglu and its plain
    cross-entropy off, as benchmarks/e2e.py runs it). Its patch replaces the class's ``forward``
    for the process: the class's own is put back on exit."""
    from liger_kernel import transformers as lk

    patch = lk.apply_liger_kernel_to_llama if family == "llama" else lk.apply_liger_kernel_to_qwen2
    cls = type(model)
    original = cls.forward
    patch(rope=False, rms_norm=False, swiglu=False, cross_entropy=False, fused_linear_cross_entropy=True)
    try:
        yield
    finally:
        cls.forward = original


def liger_kernel_available(device: str) -> bool:
    """Whether ``liger_kernel`` imports (it is not a dependency: its column stays null without)
    and its Triton kernels can run on ``device`` (``common.cpu_triton_refusal``)."""
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return False
    return device != "cpu" or cpu_triton_refusal("liger_kernel") is None


def variants(
    model: torch.nn.Module, family: str
) -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    """The variants a step row alternates: each a context in which the model is that variant."""
    out = {
        "unpatched": contextlib.nullcontext,
        "patched": partial(ours_applied, model),
    }
    if liger_kernel_available(next(model.parameters()).device.type):
        out["liger"] = partial(liger_kernel_applied, model, family)
    return out


def step_row(
    name: str, family: str, model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: int,
    ignored: float, plan: Plan,
) -> dict:  # fmt: skip
    """One step row: every variant warmed up, then ``plan.rounds`` rounds of one segment per
    variant (the segment's first step untimed), the order reversed every other round so that a
    drift of the machine weighs on every variant alike, on one batch."""
    batch = make_batch(tokens, model.config.vocab_size, ignored, plan.device)
    opt.zero_grad(set_to_none=True)  # nothing left over from a row that failed
    kinds = variants(model, family)
    for enter in kinds.values():
        with enter():
            segment(model, opt, batch, plan.step_warmup, plan.device)
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for round_ in range(plan.rounds):
        order = list(kinds.items())
        for kind, enter in order if round_ % 2 == 0 else reversed(order):
            with enter():
                runs[kind].append(segment(model, opt, batch, plan.segment_steps + 1, plan.device))
    return summarise(name, tokens, ignored, runs)


def summarise(name: str, tokens: int, ignored: float, runs: dict[str, list[dict]]) -> dict:
    """A step row from its segments: the medians of the timed steps, parity of the losses."""

    def median_ms(kind: str) -> float | None:
        if kind not in runs:
            return None
        return statistics.median(t for s in runs[kind] for t in s["ms"][1:])

    def segment_median(s: dict) -> float:
        return statistics.median(s["ms"][1:])

    pairs = zip(runs["unpatched"], runs["patched"], strict=True)
    paired = statistics.median(segment_median(p) / segment_median(u) for u, p in pairs)
    pairs = zip(runs["unpatched"], runs["patched"], strict=True)
    rel = max(abs(p - u) / abs(u) for a, b in pairs for u, p in zip(a["losses"], b["losses"], strict=True))
    fused = all(s["fused"] for s in runs["patched"]) and not any(s["fused"] for s in runs["unpatched"])
    row = {
        "part": "step", "model": name, "tokens": tokens, "ignored": ignored,
        "patched_step_ms": median_ms("patched"), "unpatched_step_ms": median_ms("unpatched"),
        "liger_step_ms": median_ms("liger"),
        "paired_ratio": paired,
        "loss_rel_diff": rel,
        "fused_ran": fused,
    }  # fmt: skip
    row["parity_ok"] = rel <= LOSS_REL_TOL and row["fused_ran"]
    return row


def model_rows(name: str, family: str, config: dict, plan: Plan) -> Iterator[dict]:
    """One model's step rows: built once, with one fused AdamW for all its rows (a generator, so
    that the model goes with its frame when the rows are done)."""
    built = guarded({"part": "step", "model": name}, lambda: build_model(family, config, plan))
    if "error" in built:
        for tokens in plan.tokens:
            for ignored in plan.ignored:
                yield {**built, "tokens": tokens, "ignored": ignored}
        return
    model = built.pop("value")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    for tokens in [t for t in plan.tokens if t <= plan.max_tokens.get(name, t)]:
        for ignored in plan.ignored:
            where = {"part": "step", "model": name, "tokens": tokens, "ignored": ignored}
            yield guarded(where, partial(step_row, name, family, model, opt, tokens, ignored, plan))


def step_rows(plan: Plan) -> Iterator[dict]:
    """Every step row, model by model, the memory freed between models."""
    for name, (family, config) in plan.models.items():
        yield from model_rows(name, family, config, plan)
        free_memory()


# ---- running, reporting ----


def guarded(where: dict, fn: Callable[[], object]) -> dict:
    """``fn()``'s row (a dict), or ``{"value": result}`` for anything else; on an exception
    ``where`` with ``error`` (the traceback goes to stderr), so that one failure costs one row."""
    try:
        result = fn()
    except Exception as error:  # one run on a lent GPU: keep every other row
        traceback.print_exc()
        message = " ".join(f"{type(error).__name__}: {error}".split())  # one line: it goes in a table
        return {**where, "error": message[:500]}
    return result if isinstance(result, dict) else {"value": result}


def _num(x: float | None, fmt: str = ".2f") -> str:
    """``x`` formatted, or ``n/a`` for a null (liger-kernel not installed)."""
    return "n/a" if x is None else format(x, fmt)


def markdown_table(columns: list[str], rows: list[dict], keys: Callable, values: Callable) -> str:
    """Markdown: a row's ``keys(row)`` cells, then its ``values(row)`` cells or, for a row that
    failed, its error padded to the table's width."""
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for r in rows:
        head = keys(r)
        if "error" in r:
            body = [f"error: {r['error']}", *[""] * (len(columns) - len(head) - 1)]
        else:
            body = values(r)
        lines.append("| " + " | ".join([*head, *body]) + " |")
    return "\n".join(lines)


def op_table(rows: list[dict]) -> str:
    """Markdown: the op rows."""
    columns = ["N", "H", "V", "ignored", "ours host ms", "eager host ms", "ours wall ms", "eager wall ms",
               "ours / eager wall", "GPU busy after eager / ours"]  # fmt: skip

    def keys(r: dict) -> list[str]:
        return [str(r["N"]), str(r["H"]), str(r["V"]), f"{r['ignored']:.2f}"]

    def values(r: dict) -> list[str]:
        times = [f"{r[k]:.2f}" for k in ("ours_host_ms", "eager_host_ms", "ours_wall_ms", "eager_wall_ms")]
        busy = f"{r['gpu_still_busy_after_eager']} / {r['gpu_still_busy_after_ours']}"
        return [*times, f"{r['ours_over_eager_wall']:.2f}x", busy]

    return markdown_table(columns, rows, keys, values)


def distill_table(rows: list[dict]) -> str:
    """Markdown: the distillation rows."""
    columns = ["N", "H student", "H teacher", "V", "ignored", "ours host ms", "eager host ms", "ours wall ms",
               "eager wall ms", "ours / eager wall", "GPU busy after eager / ours"]  # fmt: skip

    def keys(r: dict) -> list[str]:
        return [str(r["N"]), str(r["H_student"]), str(r["H_teacher"]), str(r["V"]), f"{r['ignored']:.2f}"]

    def values(r: dict) -> list[str]:
        times = [f"{r[k]:.2f}" for k in ("ours_host_ms", "eager_host_ms", "ours_wall_ms", "eager_wall_ms")]
        busy = f"{r['gpu_still_busy_after_eager']} / {r['gpu_still_busy_after_ours']}"
        return [*times, f"{r['ours_over_eager_wall']:.2f}x", busy]

    return markdown_table(columns, rows, keys, values)


def step_table(rows: list[dict]) -> str:
    """Markdown: the step rows."""
    columns = ["model", "tokens", "ignored", "patched ms", "unpatched ms", "liger-kernel ms",
               "patched / unpatched", "paired ratio", "loss rel diff"]  # fmt: skip

    def keys(r: dict) -> list[str]:
        return [r["model"], str(r["tokens"]), f"{r['ignored']:.2f}"]

    def values(r: dict) -> list[str]:
        ratio = r["patched_step_ms"] / r["unpatched_step_ms"]
        parity = f"{r['loss_rel_diff']:.1e}" + ("" if r["parity_ok"] else " (PARITY FAILED)")
        return [f"{r['patched_step_ms']:.1f}", f"{r['unpatched_step_ms']:.1f}",
                _num(r["liger_step_ms"], ".1f"), f"{ratio:.3f}x", f"{r['paired_ratio']:.3f}x",
                parity]  # fmt: skip

    return markdown_table(columns, rows, keys, values)


def write_results(out: str, env: dict, rows: list[dict], seconds: float) -> None:
    """The JSON (the environment's keys and ``rows``) at ``out`` and the tables beside it."""
    write_json(out, {**env, "rows": rows})
    ops = [r for r in rows if r["part"] == "op"]
    steps = [r for r in rows if r["part"] == "step"]
    text = f"Measured on {env['device']} (torch {env['torch']}, triton {env['triton']}, transformers "
    text += f"{env['transformers']}), {seconds:.0f} s; issue 43 targets 1-3.\n"
    if ops:
        text += f"\nOne forward + backward; host time with the GPU about {BUSY_MS:.0f} ms behind.\n\n"
        text += op_table(ops) + "\n"
    distills = [r for r in rows if r["part"] == "distill"]
    if distills:
        text += f"\nOne distillation forward + backward (generalized JSD, beta {DISTILL_BETA}); host time "
        text += f"with the GPU about {BUSY_MS:.0f} ms behind.\n\n" + distill_table(distills) + "\n"
    if steps:
        text += "\nOne fused-AdamW training step, 1 x tokens, synchronised at its boundaries.\n\n"
        text += step_table(steps) + "\n"
    Path(out).with_suffix(".md").write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None, help="JSON rows (the markdown tables beside it, .md)")
    parser.add_argument("--parts", default="op,distill,step", help="comma-separated: op, distill, step")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: a check of the script")
    parser.add_argument("--models", nargs="+", default=None, help="the step part's models (default: all)")
    parser.add_argument(
        "--call-graphs",
        action="store_true",
        help="the op and distill rows' ours with Tuning(call_graphs=True)",
    )
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if unknown := set(parts) - {"op", "distill", "step"}:
        parser.error(f"unknown parts: {sorted(unknown)}")
    if not args.smoke and not need_cuda(__file__):
        return 2
    plan = SMOKE_PLAN if args.smoke else GPU_PLAN
    if args.models:
        if unknown := set(args.models) - set(plan.models):
            parser.error(f"unknown models: {sorted(unknown)}; known: {sorted(plan.models)}")
        plan = dataclasses.replace(plan, models={name: plan.models[name] for name in args.models})
    plan = dataclasses.replace(plan, call_graphs=args.call_graphs)
    env = {**environment("transformers"), "smoke": args.smoke}
    started = time.perf_counter()
    sources = {"op": op_rows, "distill": distill_rows, "step": step_rows}
    rows: list[dict] = []
    for part in parts:
        for row in sources[part](plan):
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                write_results(args.out, env, rows, time.perf_counter() - started)
    print(f"{time.perf_counter() - started:.1f} s", file=sys.stderr)
    failed = [r for r in rows if "error" in r or not r.get("parity_ok", True)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
