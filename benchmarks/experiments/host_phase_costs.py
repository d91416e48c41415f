"""Probe: where the host time of one fused-loss call goes, phase by phase, in a busy loop (issue 43).

For each ``--shapes`` N,H,V (bf16, ``--ignored`` share of labels -100), ten calls in a row behind
about 100 ms of queued GPU work (the host of a training loop that never waits), five times:
* ``eager_us`` / ``ours_us``: host µs per forward + backward (median of the five);
* ``phases``: µs per call inside each of the op's phases (functions wrapped with a timer in every
  ``liger_patch`` module that binds them; nested phases count in their parents too);
* ``units``: µs of single host actions on this machine (an allocation, a small launch, an event,
  an environment read, a Triton launch of ours, a trivial autograd.Function), each repeated 200
  times behind the backlog.
JSON lines to ``--out``.

    python benchmarks/experiments/host_phase_costs.py --out /tmp/phases.jsonl
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common, host_bound
from common import append_jsonl, fwd_bwd, make_inputs, need_cuda  # noqa: E402
from host_bound import Backlog, eager_loss, ours_loss, steady_host_ms  # noqa: E402

from liger_patch import env  # noqa: E402

PHASES = [
    ("liger_patch.ops.core.deferred_checks", "raise_ready"),
    ("liger_patch.ops.core.kept_rows", "begin_label_check"),
    ("liger_patch.ops.core.kept_rows", "finish_label_check"),
    ("liger_patch.ops.core.validation", "check_from_stats"),
    ("liger_patch.ops.cross_entropy.options", "LossOptions.from_key"),
    ("liger_patch.ops.cross_entropy.operator", "_forward_call"),
    ("liger_patch.ops.cross_entropy.operator", "_checked_call"),
    ("liger_patch.ops.cross_entropy.operator", "_forward_outputs"),
    ("liger_patch.ops.cross_entropy.chunks", "run_chunks"),
    ("liger_patch.ops.cross_entropy.chunks", "_token_pass"),
    ("liger_patch.ops.cross_entropy.chunks", "_chunk_logits"),
    ("liger_patch.ops.cross_entropy.pass_state", "pass_state"),
    ("liger_patch.ops.core.triton.logits", "logits_with_partials"),
    ("liger_patch.ops.cross_entropy.triton.rows", "ce_rows_triton"),
    ("liger_patch.ops.core.forward_grads", "ForwardGrads.scaled"),
    ("liger_patch.ops.core.eager_call", "runs_plainly"),
    ("liger_patch.ops.cross_entropy.functional", "fused_linear_cross_entropy"),
    ("liger_patch.ops.cross_entropy.functional", "_fused"),
    ("liger_patch.ops.core.validation", "check_tensors"),
    ("liger_patch.ops.core.validation", "autocast_inputs"),
    ("liger_patch.ops.cross_entropy.outputs", "pack"),
    ("liger_patch.ops.cross_entropy.operator", "_forward"),
    ("liger_patch.ops.cross_entropy.operator", "_losses"),
    ("liger_patch.ops.core.triton.label_check", "label_check"),
    ("liger_patch.ops.cross_entropy.pass_state", "_new_result"),
    ("liger_patch.ops.cross_entropy.chunk_plan", "plan_for"),
    ("liger_patch.ops.core.grad_weight_layout", "grad_weight_buffers"),
    ("liger_patch.ops.core.grad_weight_layout", "weight_operand"),
    ("liger_patch.ops.core.gemm", "chunk_logits"),
    ("liger_patch.ops.core.triton.logits", "supported"),
    ("liger_patch.ops.cross_entropy.triton.rows", "_launch"),
    ("liger_patch.ops.core.grad_sums", "GradSums.add"),
    ("liger_patch.ops.cross_entropy.chunks", "_set_losses"),
    ("liger_patch.ops.cross_entropy.autograd", "setup_context"),
    ("liger_patch.ops.cross_entropy.autograd", "backward"),
    ("liger_patch.ops.core.eager_call", "EagerOp.__call__"),
]


def _resolve(module: str, name: str):
    owner = importlib.import_module(module)
    *path, attr = name.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


class PhaseTimer:
    """Wraps each phase's function in a timer wherever a ``liger_patch`` module binds it."""

    def __init__(self) -> None:
        self.total = defaultdict(float)
        self.undo: list[tuple[object, str, object]] = []

    def __enter__(self) -> PhaseTimer:
        for module, name in PHASES:
            owner, attr = _resolve(module, name)
            fn = owner.__dict__[attr]
            raw = fn.__func__ if isinstance(fn, classmethod) else fn
            wrapped = self._timed(name, raw)
            new = classmethod(wrapped) if isinstance(fn, classmethod) else wrapped
            self._swap(owner, attr, new)
            if not isinstance(fn, classmethod):
                for mod in list(sys.modules.values()):
                    ours = getattr(mod, "__name__", "").startswith("liger_patch")
                    if mod is not owner and ours and mod.__dict__.get(attr) is fn:
                        self._swap(mod, attr, wrapped)
        return self

    def _swap(self, owner, attr, new) -> None:
        self.undo.append((owner, attr, owner.__dict__[attr]))
        setattr(owner, attr, new)

    def _timed(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] += time.perf_counter() - start

        return timed

    def __exit__(self, *exc) -> None:
        for owner, attr, old in reversed(self.undo):
            setattr(owner, attr, old)


def _steady_us(call, backlog: Backlog, calls: int = 10) -> float:
    return 1e3 * steady_host_ms(call, backlog, calls)


def _units(hidden, weight, labels) -> dict:
    from liger_patch.ops.core import validation
    from liger_patch.ops.core.triton.label_check import label_check
    from liger_patch.ops.core.triton.scale import scale_

    small = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
    grads = [torch.randn(256, 64, device="cuda"), torch.randn(64, 64, device="cuda")]
    one = torch.ones((), device="cuda")
    stats = labels.new_ones(4)  # the check's four int64 values
    ev = torch.cuda.Event()
    ev.record()

    class Trivial(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.sum()

        @staticmethod
        def backward(ctx, g):
            return g.expand(256, 64)

    x = small.float().requires_grad_()
    return {
        "empty_0": lambda: torch.empty(0, device="cuda"),
        "empty_4096": lambda: torch.empty(4096, device="cuda"),
        "zeros_like_0d": lambda: torch.zeros_like(one),
        "ne_labels": lambda: labels != -100,
        "mul_0d": lambda: one * one,
        "reshape_view": lambda: labels.reshape(-1),
        "event_record": lambda: torch.cuda.Event().record(),
        "event_query": ev.query,
        "env_flag": env.triton_interpret,
        "mm_256x64x256": lambda: small @ small.T,
        "triton_scale_2": lambda: scale_(grads, one),
        "triton_label_check": lambda: label_check(labels, weight.shape[0], -100, "mean"),
        "autograd_trivial_fwd_bwd": lambda: Trivial.apply(x).backward(),
        "is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "pinned_empty_4": lambda: torch.empty(4, dtype=torch.int64, pin_memory=True),
        "pinned_copy_event": lambda: validation.check_from_stats(labels, weight.shape[0], -100, None, stats),
        "triton_jit_run_overhead": lambda: scale_(grads[:1], one),
    }


def measure(n: int, h: int, v: int, ignored: float, backlog: Backlog) -> dict:
    hidden, weight, labels = make_inputs(n, h, v, ignore_frac=ignored, logit_std=3.0)
    eager = functools.partial(fwd_bwd, eager_loss, hidden, weight, labels)
    ours = functools.partial(fwd_bwd, ours_loss, hidden, weight, labels)
    for _ in range(3):
        _steady_us(eager, backlog), _steady_us(ours, backlog)
    row = {"N": n, "H": h, "V": v, "ignored": ignored}
    row["eager_us"] = round(statistics.median(_steady_us(eager, backlog) for _ in range(5)), 1)
    row["ours_us"] = round(statistics.median(_steady_us(ours, backlog) for _ in range(5)), 1)
    with PhaseTimer() as timer:
        calls = 0
        for _ in range(5):
            _steady_us(ours, backlog)
            calls += 10
    row["phases"] = {name: round(1e6 * t / calls, 1) for name, t in timer.total.items()}
    units = {}
    for name, fn in _units(hidden, weight, labels).items():
        fn()
        units[name] = round(_steady_us(fn, backlog, calls=200), 2)
    row["units"] = units
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["256,896,151936", "4096,2048,128256"])
    parser.add_argument("--ignored", type=float, nargs="+", default=[0.25])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not need_cuda(__file__):
        return 2
    backlog = Backlog("cuda")
    for shape in args.shapes:
        for ignored in args.ignored:
            row = measure(*map(int, shape.split(",")), ignored, backlog)
            append_jsonl(args.out, row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
