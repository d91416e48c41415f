"""Fused distillation, fwd+bwd, side by side on one GPU, as ratios to the four-GEMM floor (issue 30).

The loss is TRL's generalized Jensen-Shannon divergence (``--beta``, default 0.5; ``--temperature``,
default 1) between a student head (N x H_s, V x H_s; its hidden states and weight get gradients)
and a frozen teacher head (N x H_t, V x H_t), mean over the kept tokens. The floor is the four
GEMMs no exact method avoids, timed through cuBLAS in the same run on all N tokens: the student's
and the teacher's logits, grad_h = G W_s and grad_W = G^T h_s (2 N V (H_t + 3 H_s) flops, 29.6 ms
at the issue's shape on an H100). Ours and TRL's chunked divergence skip the ignored tokens'
GEMMs, so they may go below 1x. Timing is ``triton.testing.do_bench`` medians and extra peak
memory (beyond the inputs and the student's gradients) is read from the CUDA allocator, both from
``benchmarks/common.py``, as ``flce.py`` does.

Implementations (``--impls``, a comma list or ``all``, the default):

- ``ours``: ``lp.fused_linear_distillation`` (``--backend``, default ``auto``);
- ``dense_eager``: both logits by matmul, cast to fp32 (as a head that upcasts its logits), then
  TRL's own ``GKDTrainer.generalized_jsd_loss`` (``trl.experimental.gkd``; the loss of
  ``DistillationTrainer`` in its dense form), ignored tokens dropped by its ``labels`` mask;
- ``dense_compile``: ``torch.compile`` of ``dense_eager``, compiled for each point;
- ``trl_chunked``: TRL 1.16 ``DistillationTrainer``'s chunked divergence, the module function
  ``trl.trainer.distillation_trainer._chunked_divergence_loss`` (no trainer needed), called with
  ``completion_mask = labels != -100``;
- ``liger_jsd``: liger-kernel's ``chunked_loss.LigerFusedLinearJSDLoss`` with
  ``weight_hard_loss=0, weight_soft_loss=1`` (the divergence alone), ``ignore_index=-100``; its
  ``beta`` weighs KL(teacher || m) as TRL's does (same mixture m), so it is passed unchanged;
- ``liger_fused_jsd``: liger-kernel's Triton ``transformers.LigerFusedLinearJSD`` (``jsd_beta``,
  the same convention).

Every implementation's loss is compared with ours at each point (``rel_diff_vs_ours`` in the
JSON) and, once per run, loss and student gradients against an fp64 reference on a small slice
(``fp64_check``). A missing package or an out-of-memory is the cell's reason string; the run goes
on.

Inputs (``make_distill_inputs``): the student as ``common.make_inputs`` draws it (hidden ~ N(0, 1),
weight scaled so the logits have a standard deviation of 3, ``--ignore-frac`` of the labels set to
-100, default 20 %); the teacher is the student plus noise, so the divergence is that of a
teacher and student that mostly agree: the teacher's hidden states are the student's followed
by H_t - H_s fresh N(0, 1) columns, and its weight is ``rho`` times the student's followed by
noise columns, so that the teacher's logits are ``rho * z_s + sqrt(1 - rho^2) * noise`` (std 3,
correlation ``rho`` = ``--teacher-corr``, default 0.9: a JSD of about 0.18 nats at beta 0.5;
``--teacher-corr 0`` gives two independent heads, the issue's 0.6468).

Points (``POINTS``, index order; ``--points START:STOP`` or ``I,J,...``): three student/teacher
head pairs at N = 2048, 4096, 8192, 16384 each; index 2 is the issue's shape.

    python benchmarks/distill.py --points 2 --out distill_issue.json       # the issue's shape
    python benchmarks/distill.py --points 0:4 --out docs/results/distill_0_4.json
    python benchmarks/distill.py --points 4:8 --no-fp64-check --out docs/results/distill_4_8.json
    python benchmarks/distill.py --points 8:12 --no-fp64-check --out docs/results/distill_8_12.json
    python benchmarks/distill.py --smoke      # tiny shapes on the CPU: every peer runs and agrees

Run time (estimated, not yet measured on a GPU): at ``--rep-ms 300`` timing an implementation
takes 1-10 s per point (dense_eager, the slowest, at about 7x the floor); the compiles dominate:
dense_compile compiles for each point (static shapes, some 20-40 s), liger_jsd once per pair (its
chunk of 1024 tokens has one shape), the fp64 check compiles both once more. A pair of heads
(four points) per call, as above, takes a few minutes; each row's ``wall_s`` and each cell's
``warmup_s`` (first call, compile included) in the JSON say what a run took. dense_eager holds
about eleven fp32 N x V tensors (47.6 GB at the issue's shape), so at N = 16384 its cell is an
out-of-memory on an 80 GB card, which costs no time.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from common import (
    bench,
    cpu_triton_refusal,
    environment,
    extra_memory_mib,
    fwd_bwd,
    make_inputs,
    need_cuda,
    report_row,
)

IGNORE = -100


@dataclass(frozen=True)
class DistillPoint:
    pair: str
    n: int
    h_s: int
    h_t: int
    v: int

    @property
    def name(self) -> str:
        return f"{self.n}x{self.h_s}/{self.h_t}x{self.v}"


# (pair, H_student, H_teacher, V): the heads of the models people distil between.
PAIRS = (
    ("Llama-3.1-8B -> Llama-3.2-1B", 2048, 4096, 128256),  # the shape at N = 8192
    ("Qwen3-32B -> Qwen3-4B", 2560, 5120, 151936),
    ("Llama-3.1-70B -> Llama-3.1-8B", 4096, 8192, 128256),
)
TOKENS = (2048, 4096, 8192, 16384)
POINTS = tuple(DistillPoint(pair, n, h_s, h_t, v) for pair, h_s, h_t, v in PAIRS for n in TOKENS)


@dataclass(frozen=True)
class Setting:
    """What every implementation is called with besides the tensors."""

    beta: float = 0.5
    temperature: float = 1.0
    backend: str = "auto"  # ours
    compile_backend: str = "inductor"  # dense_compile (the smoke test uses "aot_eager")
    liger_compiled: bool = True  # liger_jsd's own torch.compile (off in the smoke test)
    teacher: tuple = field(default=(), compare=False)  # (hidden, weight), bound per point


# ---- inputs -------------------------------------------------------------------------------------


def make_distill_inputs(point: DistillPoint, dtype, ignore_frac: float, corr: float, device: str, seed=0):
    """Student (hidden, weight: both require grad), labels, and a teacher that is the student
    plus noise (the module docstring says how); the teacher's tensors require no grad."""
    if point.h_t <= point.h_s:
        raise ValueError(f"the teacher is built as the student plus noise columns: H_t {point.h_t} <= H_s")
    logit_std = 3.0
    s_h, s_w, labels = make_inputs(
        point.n, point.h_s, point.v, dtype, ignore_frac, seed, logit_std=logit_std, device=device
    )
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    extra = point.h_t - point.h_s
    noise_h = torch.randn(point.n, extra, device=device, dtype=dtype, generator=gen)
    noise_w = torch.randn(point.v, extra, device=device, dtype=dtype, generator=gen)
    noise_w = (noise_w * (logit_std * math.sqrt(1 - corr**2) / math.sqrt(extra))).to(dtype)
    t_h = torch.cat([s_h.detach(), noise_h], dim=1)
    t_w = torch.cat([(corr * s_w.detach()).to(dtype), noise_w], dim=1)
    return s_h, s_w, labels, t_h, t_w


# ---- the implementations: fn(student_hidden, student_weight, labels, setting) -> loss ------------


def ours(s_h, s_w, labels, setting: Setting, memory_budget=None, logits_dtype=None):
    import liger_patch as lp

    t_h, t_w = setting.teacher
    return lp.fused_linear_distillation(
        s_h, s_w, t_h, t_w, labels, beta=setting.beta, temperature=setting.temperature,
        ignore_index=IGNORE, backend=setting.backend, memory_budget=memory_budget,
        logits_dtype=logits_dtype,
    )  # fmt: skip


def ours_1gib(s_h, s_w, labels, setting: Setting):
    """Ours at a 1 GiB working-memory budget: what twice the default buys."""
    return ours(s_h, s_w, labels, setting, memory_budget=1 << 30)


def ours_fp32_logits(s_h, s_w, labels, setting: Setting):
    """Ours with fp32 logits chunks (``logits_dtype=torch.float32``), as TRL's chunked kernel keeps
    its tiles: what our TRL ``DistillationTrainer`` hook runs."""
    return ours(s_h, s_w, labels, setting, logits_dtype=torch.float32)


def _trl_generalized_jsd() -> Callable:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # trl.experimental warns on import
    from trl.experimental.gkd import GKDTrainer

    return GKDTrainer.generalized_jsd_loss


def _dense(s_h, s_w, labels, t_h, t_w, beta: float, temperature: float):
    student = (s_h @ s_w.t()).float()
    teacher = (t_h @ t_w.t()).float()
    return _trl_generalized_jsd()(student, teacher, labels, beta=beta, temperature=temperature)


def dense_eager(s_h, s_w, labels, setting: Setting):
    return _dense(s_h, s_w, labels, *setting.teacher, setting.beta, setting.temperature)


_compiled: dict[str, Callable] = {}


def dense_compile(s_h, s_w, labels, setting: Setting):
    """``torch.compile`` of the dense loss with static shapes: compiled for each point, as a
    training run of one shape gets it (``reset_compiled`` between head pairs keeps the number of
    compiled shapes under dynamo's recompile limit)."""
    _trl_generalized_jsd()  # import outside the compiled region
    backend = setting.compile_backend
    if backend not in _compiled:
        _compiled[backend] = torch.compile(_dense, dynamic=False, backend=backend)
    return _compiled[backend](s_h, s_w, labels, *setting.teacher, setting.beta, setting.temperature)


def reset_compiled() -> None:
    _compiled.clear()
    torch._dynamo.reset()


def trl_chunked(s_h, s_w, labels, setting: Setting):
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    t_h, t_w = setting.teacher
    loss, _entropy_sum, _n_valid = _chunked_divergence_loss(
        s_h, t_h, s_w, t_w, labels != IGNORE, setting.beta, temperature=setting.temperature
    )
    return loss


def liger_jsd(s_h, s_w, labels, setting: Setting):
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

    loss_fn = LigerFusedLinearJSDLoss(
        weight_hard_loss=0.0, weight_soft_loss=1.0, beta=setting.beta, ignore_index=IGNORE,
        temperature=setting.temperature, compiled=setting.liger_compiled,
    )  # fmt: skip
    return loss_fn(s_h, s_w, *setting.teacher, labels)


def liger_fused_jsd(s_h, s_w, labels, setting: Setting):
    from liger_kernel.transformers import LigerFusedLinearJSD

    loss_fn = LigerFusedLinearJSD(jsd_beta=setting.beta, ignore_index=IGNORE, temperature=setting.temperature)
    return loss_fn(s_h, s_w, *setting.teacher, labels)


IMPLS: dict[str, Callable] = {
    "ours": ours,
    "ours_1gib": ours_1gib,
    "ours_fp32_logits": ours_fp32_logits,
    "dense_eager": dense_eager,
    "dense_compile": dense_compile,
    "trl_chunked": trl_chunked,
    "liger_jsd": liger_jsd,
    "liger_fused_jsd": liger_fused_jsd,
}
TRITON_PEERS = ("liger_fused_jsd",)  # a peer's Triton kernels: on CPU tensors under the interpreter only


def bound(impl: str, setting: Setting) -> Callable:
    """``IMPLS[impl]`` as ``fn(hidden, weight, labels)``, the form ``common``'s helpers call."""
    return functools.partial(IMPLS[impl], setting=setting)


def reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


# ---- the floor and the fp64 reference -----------------------------------------------------------


def floor_fn(s_h, s_w, t_h, t_w, grad_logits):
    """The four GEMMs an exact method cannot avoid."""
    return s_h @ s_w.t(), t_h @ t_w.t(), grad_logits @ s_w, grad_logits.t() @ s_h


def time_floor(s_h, s_w, t_h, t_w, rep_ms: int) -> float:
    """Median ms of the four GEMMs on random gradient logits (freed afterwards)."""
    grad_logits = torch.randn(s_h.shape[0], s_w.shape[0], device="cuda", dtype=s_h.dtype) * 1e-4
    ms = bench(functools.partial(floor_fn, s_h, s_w, t_h, t_w, grad_logits), rep_ms)
    del grad_logits
    torch.cuda.empty_cache()
    return ms


def reference_loss(z_s, z_t, labels, beta: float, temperature: float):
    """The generalized JSD of docs/distillation.md, written out, mean over the kept tokens."""
    keep = labels != IGNORE
    log_s = torch.log_softmax(z_s[keep] / temperature, dim=-1)
    log_t = torch.log_softmax(z_t[keep] / temperature, dim=-1)
    if beta == 0:
        div = (log_t.exp() * (log_t - log_s)).sum(-1)
    elif beta == 1:
        div = (log_s.exp() * (log_s - log_t)).sum(-1)
    else:
        log_m = torch.logaddexp(log_s + math.log(1 - beta), log_t + math.log(beta))
        div = beta * (log_t.exp() * (log_t - log_m)).sum(-1) + (1 - beta) * (
            log_s.exp() * (log_s - log_m)
        ).sum(-1)
    return div.sum() / keep.sum().clamp_min(1)


def check_against_fp64(impl: str, point: DistillPoint, setting: Setting, dtype, ignore_frac, corr, device):
    """The loss of ``impl`` and its relative errors (loss, grad of the student's hidden states and
    weight) against fp64 on the same inputs."""
    s_h, s_w, labels, t_h, t_w = make_distill_inputs(point, dtype, ignore_frac, corr, device, seed=1)
    setting = replace(setting, teacher=(t_h, t_w))
    loss = fwd_bwd(bound(impl, setting), s_h, s_w, labels).detach()
    hr = s_h.detach().double().requires_grad_()
    wr = s_w.detach().double().requires_grad_()
    ref = reference_loss(
        hr @ wr.t(), t_h.double() @ t_w.double().t(), labels, setting.beta, setting.temperature
    )
    ref.backward()
    ref = ref.detach()
    return {
        "loss": float(loss),
        "loss_err": float((loss.double() - ref).abs() / ref.abs()),
        "grad_h_err": float((s_h.grad.double() - hr.grad).norm() / hr.grad.norm()),
        "grad_w_err": float((s_w.grad.double() - wr.grad).norm() / wr.grad.norm()),
    }


FP64_POINT = DistillPoint("fp64 check slice", 1024, 512, 768, 8191)


def fp64_checks(impls: list[str], setting: Setting, ignore_frac: float, corr: float) -> dict:
    out = {}
    for impl in impls:
        reset_compiled()
        try:
            out[impl] = check_against_fp64(
                impl, FP64_POINT, setting, torch.bfloat16, ignore_frac, corr, "cuda"
            )
        except Exception as exc:
            out[impl] = reason(exc)
        gc.collect()
        torch.cuda.empty_cache()
    return out


# ---- one point ----------------------------------------------------------------------------------


def bench_point(point: DistillPoint, impls: list[str], setting: Setting, args) -> dict:
    """The floor and each implementation's median ms, ratio, extra MiB and loss at one point. With
    ``--rounds`` > 1 the floor and every implementation are timed once per round, each round
    starting with another implementation; the medians over the rounds are reported."""
    s_h, s_w, labels, t_h, t_w = make_distill_inputs(
        point, torch.bfloat16, args.ignore_frac, args.teacher_corr, "cuda"
    )
    setting = replace(setting, teacher=(t_h, t_w))
    row = {**vars(point), "name": point.name, "kept": int((labels != IGNORE).sum()), "impls": {}}
    floors, times = [], {}
    for round_ in range(args.rounds):
        floors.append(time_floor(s_h.detach(), s_w.detach(), t_h, t_w, args.rep_ms))
        shift = round_ % max(1, len(impls))
        for impl in impls[shift:] + impls[:shift]:
            cell = row["impls"].setdefault(impl, {})
            if "error" not in cell:
                _time_impl(impl, setting, (s_h, s_w, labels), cell, times, args.rep_ms)
            s_h.grad = s_w.grad = None
            gc.collect()
            torch.cuda.empty_cache()
    row["floor_ms"] = statistics.median(floors)
    row["floor_tflops"] = 2 * point.n * point.v * (point.h_t + 3 * point.h_s) / row["floor_ms"] / 1e9
    _summarize(row, impls, floors, times)
    return row


def _time_impl(impl: str, setting: Setting, tensors, cell: dict, times: dict, rep_ms: int) -> None:
    fn = bound(impl, setting)
    try:
        start = time.perf_counter()
        loss = fwd_bwd(fn, *tensors)  # warm-up / compile
        torch.cuda.synchronize()
        cell.setdefault("warmup_s", time.perf_counter() - start)
        cell.setdefault("loss", float(loss.detach()))
        del loss
        times.setdefault(impl, []).append(bench(lambda: fwd_bwd(fn, *tensors), rep_ms))
        if "extra_mib" not in cell:
            cell["extra_mib"] = extra_memory_mib(fn, *tensors)
    except Exception as exc:  # a missing peer or an out-of-memory is one cell, not the run
        cell.clear()
        cell["error"] = reason(exc)
        times.pop(impl, None)


def _summarize(row: dict, impls: list[str], floors: list[float], times: dict) -> None:
    ours_loss = row["impls"].get("ours", {}).get("loss")
    for impl in impls:
        cell = row["impls"][impl]
        if "error" in cell:
            continue
        ratios = [t / f for t, f in zip(times[impl], floors, strict=True)]
        cell.update(
            ms=statistics.median(times[impl]), x_floor=statistics.median(ratios), ms_rounds=times[impl]
        )
        if ours_loss is not None:
            cell["rel_diff_vs_ours"] = abs(cell["loss"] - ours_loss) / abs(ours_loss)


def markdown(rows: list[dict]) -> str:
    impls = list(dict.fromkeys(k for r in rows for k in r["impls"]))
    lines = [
        "| pair | N | floor ms | loss (ours) | " + " | ".join(impls) + " | max rel diff vs ours |",
        "|---" * (len(impls) + 5) + "|",
    ]
    for r in rows:
        cells = []
        for k in impls:
            c = r["impls"].get(k, {})
            ok = "ms" in c
            cells.append(
                f"{c['ms']:.1f} ({c['x_floor']:.2f}x) {c['extra_mib']:.0f} MiB"
                if ok
                else c.get("error", "-")[:40]
            )
        diffs = [c["rel_diff_vs_ours"] for c in r["impls"].values() if "rel_diff_vs_ours" in c]
        loss = r["impls"].get("ours", {}).get("loss")
        head = f"| {r['pair']} | {r['n']} | {r['floor_ms']:.1f} | " + (
            f"{loss:.5f}" if loss is not None else "-"
        )
        lines.append(head + " | " + " | ".join(cells) + f" | {max(diffs, default=0):.1e} |")
    return "\n".join(lines)


# ---- the CPU smoke mode -------------------------------------------------------------------------

SMOKE_POINT = DistillPoint("smoke", 64, 32, 48, 500)
SMOKE_TOL = 1e-4  # fp32 on the CPU: every implementation agrees with fp64 to about 1e-6


def _quiet_check(impl: str, setting: Setting, ignore_frac: float, corr: float) -> dict:
    with warnings.catch_warnings():  # the Triton interpreter's, on liger's masked -inf lanes
        warnings.filterwarnings("ignore", "invalid value encountered", RuntimeWarning)
        return check_against_fp64(impl, SMOKE_POINT, setting, torch.float32, ignore_frac, corr, "cpu")


def smoke_rows(impls: list[str], setting: Setting, ignore_frac: float, corr: float) -> dict:
    """Each implementation on tiny fp32 CPU inputs: its fp64 check (loss and gradients) and its
    loss's relative difference to ours, or the reason it did not run. ``ok`` is False where a
    value is off by more than ``SMOKE_TOL``; a peer that is not installed is only reported."""
    setting = replace(setting, compile_backend="aot_eager", liger_compiled=False)
    rows = {}
    for impl in impls:
        refusal = cpu_triton_refusal("liger_kernel") if impl in TRITON_PEERS else None
        if refusal is not None:
            rows[impl] = {"missing": refusal, "ok": True}
            continue
        reset_compiled()
        try:
            rows[impl] = _quiet_check(impl, setting, ignore_frac, corr)
        except ModuleNotFoundError as exc:
            rows[impl] = {"missing": reason(exc), "ok": True}
        except Exception as exc:
            rows[impl] = {"error": reason(exc), "ok": False}
    ours_loss = rows.get("ours", {}).get("loss")
    for row in rows.values():
        if "loss" in row:
            errs = [row["loss_err"], row["grad_h_err"], row["grad_w_err"]]
            if ours_loss is not None:
                row["rel_diff_vs_ours"] = abs(row["loss"] - ours_loss) / abs(ours_loss)
                errs.append(row["rel_diff_vs_ours"])
            row["ok"] = max(errs) <= SMOKE_TOL
    return rows


def run_smoke(impls: list[str], setting: Setting, args) -> int:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # liger_fused_jsd's Triton kernels on the CPU
    rows = smoke_rows(impls, setting, args.ignore_frac, args.teacher_corr)
    for impl, row in rows.items():
        print(
            f"{impl:16s} "
            + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
        )
    return 0 if all(row["ok"] for row in rows.values()) else 1


# ---- the command line ---------------------------------------------------------------------------


def select_points(spec: str | None) -> list[DistillPoint]:
    if not spec:
        return list(POINTS)
    if ":" in spec:
        lo, _, hi = spec.partition(":")
        return list(POINTS[int(lo or 0) : int(hi) if hi else None])
    return [POINTS[int(i)] for i in spec.split(",")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--points", default=None, help="a slice START:STOP or indices I,J,... of POINTS")
    parser.add_argument("--impls", default="all", help="comma list or 'all': " + ",".join(IMPLS))
    parser.add_argument(
        "--beta", type=float, default=0.5, help="generalized JSD beta (0 forward KL, 1 reverse)"
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--ignore-frac", type=float, default=0.2, help="share of labels set to -100")
    parser.add_argument(
        "--teacher-corr", type=float, default=0.9, help="correlation of teacher and student logits"
    )
    parser.add_argument("--backend", default="auto", help="ours' backend")
    parser.add_argument("--rep-ms", type=int, default=300, help="do_bench repetition time per impl")
    parser.add_argument(
        "--rounds", type=int, default=1, help="time every impl this many times, rotating the order"
    )
    parser.add_argument(
        "--no-fp64-check", action="store_true", help="skip the fp64 check (done once per run)"
    )
    parser.add_argument("--out", default=None, help="write JSON here (a .md table is written beside it)")
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 shapes on the CPU (backend torch)")
    args = parser.parse_args(argv)
    args.impls = list(IMPLS) if args.impls == "all" else args.impls.split(",")
    if unknown := [impl for impl in args.impls if impl not in IMPLS]:
        parser.error(f"unknown --impls {unknown}; known: {', '.join(IMPLS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    impls = args.impls
    setting = Setting(beta=args.beta, temperature=args.temperature, backend=args.backend)
    if args.smoke:
        return run_smoke(impls, replace(setting, backend="torch"), args)
    if not need_cuda("benchmarks/distill.py"):
        return 2
    result = {
        **environment(),
        "method": "fwd+bwd, triton.testing.do_bench median; floor = 4 cuBLAS bf16 GEMMs on all N tokens "
        "(student and teacher logits, grad_h, grad_W); extra = peak allocated minus inputs and the "
        "student's grads",
        "settings": {
            k: getattr(args, k)
            for k in ("beta", "temperature", "ignore_frac", "teacher_corr", "backend", "rep_ms", "rounds")
        },
        "fp64_check": {}
        if args.no_fp64_check
        else fp64_checks(impls, setting, args.ignore_frac, args.teacher_corr),
        "rows": [],
    }
    heads = None
    for point in select_points(args.points):  # written after every point: a cut-off run keeps them
        if (point.h_s, point.h_t, point.v) != heads:  # a new pair: fresh compiles (under dynamo's
            heads = (point.h_s, point.h_t, point.v)  # recompile limit); within one, liger_jsd's
            reset_compiled()  # compiled chunk of 1024 tokens is reused, as in a training run
        start = time.perf_counter()
        result["rows"].append(bench_point(point, impls, setting, args))
        result["rows"][-1]["wall_s"] = time.perf_counter() - start
        report_row(result, markdown(result["rows"]), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
