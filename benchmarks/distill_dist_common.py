"""What the parts of ``distill_dist_gpu.py`` share: the tolerances and shapes, the checks
(``Verdicts``: a scenario's values within their tolerance, facts as expected), the counter of
the fused operator's calls, TRL's trainers as the gloo scenarios stand them in, DeepSpeed's
leftovers let go between runs, and ``Run`` (where the parts run, their records, the clock).

The parity parts are in ``distill_dist_parity.py``, the size parts (peak memory and step time)
in ``distill_dist_sizes.py``; ``distill_dist_gpu.py`` runs them and writes the results.
"""

from __future__ import annotations

import gc
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO), str(REPO / "examples")]

from common import log  # noqa: E402

from tests.integrations import trl_distillation_sharded_workers as scenarios  # noqa: E402

VOCAB = 1008
TOL = {
    "fp32": {"loss": 2e-5, "metric": 2e-5, "grad": 1e-4, "param": 1e-5},
    "bf16": {"loss": 2e-2, "metric": 2e-2, "grad": 5e-2, "param": 1e-2},
}
VP_TOL = {"fp32": dict(rtol=5e-5, atol=2e-6), "bf16": dict(rtol=2e-2, atol=2e-3)}  # as the op's test
SMOKE_VP_CASES = ("jsd", "none", "chunks", "empty_shard", "bf16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

SIZE = dict(
    vocab=128256, dtype="bf16", batch=4, warmup=1, steps=3, prompt=32, completion=1024, seq=1024,
    generate=256,
    student=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
                 num_key_value_heads=4),
    teacher=dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=4, num_attention_heads=32,
                 num_key_value_heads=8),
)  # fmt: skip
SMOKE_SIZE = dict(
    SIZE, vocab=VOCAB, dtype="fp32", batch=2, steps=2, prompt=4, completion=12, seq=16, generate=4,
    student=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    teacher=dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
)  # fmt: skip
TRL_ONLY = {"fused": 0, "vocab_parallel": 0, "trl": 1}
FUSED_ONCE = {"fused": 1, "vocab_parallel": 0, "trl": 0}


# ------------------------------------------------------------------ checks


def rel_err(got: Any, want: Any) -> float:
    """|got - want| / |want| (L2 over a tensor's elements), in fp64 on the CPU."""
    a = torch.as_tensor(got).detach().double().cpu()
    b = torch.as_tensor(want).detach().double().cpu()
    diff = (a - b).norm().item()
    return 0.0 if diff == 0 else diff / max(b.norm().item(), 1e-30)


class Verdicts:
    """One scenario's checks on this rank: values within their tolerance (``TOL`` by kind), facts
    as expected. A check with ``gate=False`` is reported, not judged (``ok`` None)."""

    def __init__(self, dtype: str) -> None:
        self.tol, self.rows = TOL[dtype], []

    def _judge(self, kind: str, got, want, truth) -> dict:
        """``got`` against ``want``; with ``truth`` (the fp32 run's value, for a bf16 row) it also
        passes within the tolerance of ``truth``, or nearer to it than ``want`` is."""
        tol = self.tol[kind]
        out = {"err": rel_err(got, want), "tol": tol}
        out["ok"] = out["err"] <= tol
        if not out["ok"] and truth is not None:
            out["err_vs_fp32"], out["expected_err_vs_fp32"] = rel_err(got, truth), rel_err(want, truth)
            out["ok"] = out["err_vs_fp32"] <= max(tol, out["expected_err_vs_fp32"])
        return out

    def close(self, kind: str, what: str, got, want, truth=None, gate: bool = True) -> None:
        row = {"kind": kind, "what": what, **self._judge(kind, got, want, truth)}
        row["ok"] = row["ok"] if gate else None
        self.rows.append(row)

    def tensors(
        self, kind: str, what: str, got: dict, want: dict, truth: dict | None = None, skip: tuple = (),
        gate: bool = True,
    ) -> None:  # fmt: skip
        """Each named tensor of ``got`` (gradients, parameters) against ``want``'s: the worst error,
        and every one that failed."""
        if got.keys() != want.keys():
            self.fact(f"{what}: names", sorted(got), sorted(want))
            return
        judged = {n: self._judge(kind, got[n], want[n], truth and truth[n]) for n in got if n not in skip}
        worst = max(judged, key=lambda n: judged[n]["err"])
        failed = {n: j for n, j in judged.items() if not j["ok"]}
        row = {"kind": kind, "what": what, "err": judged[worst]["err"], "worst": worst, "tol": self.tol[kind]}
        row.update(ok=not failed if gate else None, **({"failed": failed} if failed else {}))
        self.rows.append(row | ({"skipped": list(skip)} if skip else {}))

    def elementwise(self, what: str, got, want, rtol: float, atol: float) -> None:
        """The vocabulary-parallel op's test's check: |got - want| <= atol + rtol (max|want| + |want|)."""
        if got.shape != want.shape or got.dtype != want.dtype:
            self.fact(f"{what}: shape, dtype", [list(got.shape), str(got.dtype)],
                      [list(want.shape), str(want.dtype)])  # fmt: skip
            return
        a, b = got.detach().double().cpu(), want.detach().double().cpu()
        scale = b.abs().max().item() if b.numel() else 0.0
        ratio = ((a - b).abs() / (atol + rtol * scale + rtol * b.abs())).max().item() if b.numel() else 0.0
        err = (a - b).abs().max().item() / max(scale, 1e-30) if b.numel() else 0.0
        row = {"kind": "elementwise", "what": what, "err": err, "tol": rtol, "bound_ratio": ratio}
        self.rows.append(row | {"ok": ratio <= 1.0})

    def fact(self, what: str, got, want) -> None:
        self.rows.append({"kind": "fact", "what": what, "got": got, "want": want, "ok": got == want})

    def holds(self, what: str, ok: bool, got) -> None:
        self.rows.append({"kind": "fact", "what": what, "got": got, "ok": bool(ok)})

    @property
    def passed(self) -> bool:
        return all(row["ok"] is not False for row in self.rows)


class OpCalls:
    """Calls of the fused distillation operator, ``liger_patch.ops.distillation.operator
    .FUSED_DISTILL`` (the registered ``torch.ops.liger_patch.fused_distill`` or, in a plain eager
    call, its eager twin): the functional looks it up there at every call, so a counting stand-in
    put there sees each one."""

    def __init__(self) -> None:
        from liger_patch.ops.distillation import operator

        self.count, op, calls = 0, operator.FUSED_DISTILL, self

        def counted(*args):
            calls.count += 1
            return op(*args)

        operator.FUSED_DISTILL = counted

    def take(self) -> int:
        taken, self.count = self.count, 0
        return taken


def bypass_of(model) -> str | None:
    """Why the patch let TRL's own path run (None: it did not)."""
    from liger_patch.patching.state import patch_state

    state = patch_state(model)
    return None if state is None else state.bypass_reason


def stand_in(trainer_name: str, student, teacher, beta: float, world: int):
    """TRL's trainer ``trainer_name`` as the gloo scenarios stand it in (``compute_loss``'s reads)."""
    if trainer_name == "distillation":
        return scenarios.distillation_trainer(student, teacher, beta, world)
    return scenarios.gkd_trainer(student, teacher, beta)


def loss_of(trainer_name: str, trainer, student, batch: dict) -> torch.Tensor:
    """TRL's ``compute_loss`` on ``batch`` (GKD: ``num_items_in_batch`` counted as the Trainer does)."""
    if trainer_name == "distillation":
        return trainer.compute_loss(student, batch)
    return trainer.compute_loss(
        student, batch, num_items_in_batch=(batch["labels"][:, 1:] != -100).sum().float()
    )


# ------------------------------------------------------------------ size parts: memory and step time


def release_deepspeed_leftovers() -> None:
    """Let go of the ZeRO-3 models DeepSpeed 0.19.8 keeps after their run: its module-global
    ``parameter_offload.FWD_MODULE_STACK`` and the unbounded ``lru_cache`` of
    ``PartitionedParameterCoordinator.__params_to_release`` (keyed by coordinator and module) hold
    them, and their hooks the engines and the optimizer: about 3.1 GiB a run at the size part, which
    the next run's peak counted. An engine whose run did not destroy it (the parity scenarios') is
    destroyed here: its hooks on the parameters hold it from outside Python's collector. Only
    between runs: all of this is in use while an engine trains."""
    if "deepspeed" not in sys.modules:
        return
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    parameter_offload.FWD_MODULE_STACK.clear()
    wrapped = vars(PartitionedParameterCoordinator).get("_PartitionedParameterCoordinator__params_to_release")
    for cell in getattr(wrapped, "__closure__", None) or ():  # the lru_cache inside DeepSpeed's NVTX wrapper
        if hasattr(cell.cell_contents, "cache_clear"):
            cell.cell_contents.cache_clear()
    gc.collect()
    for engine in [o for o in gc.get_objects() if isinstance(o, DeepSpeedEngine)]:
        engine.destroy()


def deepspeed_engines_alive() -> int:
    """DeepSpeed engines still alive (after a collection): 0 once a run's were let go."""
    if "deepspeed" not in sys.modules:
        return 0
    from deepspeed.runtime.engine import DeepSpeedEngine

    gc.collect()
    return sum(isinstance(o, DeepSpeedEngine) for o in gc.get_objects())


def free_memory() -> None:
    """Between runs: DeepSpeed's leftovers released, then what nothing holds collected."""
    release_deepspeed_leftovers()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ the run


class Run:
    """What every part shares: where it runs, the counters, a scratch folder, the records, the clock."""

    def __init__(self, smoke: bool, device: str) -> None:
        base = scenarios.Place(device=device, backend="auto", vocab=VOCAB)
        self.places = {"fp32": base, "bf16": replace(base, dtype=torch.bfloat16)}
        self.smoke, self.device, self.cuda = smoke, device, device != "cpu"
        self.size = SMOKE_SIZE if smoke else SIZE
        self.counts, self.ops = scenarios.Counts(), OpCalls()
        self.started = time.perf_counter()
        found = [tempfile.mkdtemp(prefix="distill_dist_gpu_") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(found, src=0)
        self.scratch = Path(found[0])
        self.records: list[dict] = []
        self.sizes: list[dict] = []
        self.skipped: list[str] = []
        self._tiny: dict | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def tiny_checkpoints(self) -> dict[str, Path]:
        """The tiny student and teacher saved once, for the scenarios that load them."""
        if self._tiny is None:
            self._tiny = scenarios.checkpoints(self.scratch, self.places["fp32"])
        return self._tiny

    def scenario(self, name: str, dtype: str, run: Callable, judge: Callable, truth=None):
        """Run one scenario, judge it (``judge(verdicts, results, truth)`` returns the op calls it
        expects), keep its record; returns its raw results (an fp32 run's: the bf16 run's truth)."""
        started = time.perf_counter()
        self.counts.take(), self.ops.take()
        record: dict = {"scenario": name, "dtype": dtype}
        out = None
        try:
            out = run()
            v = Verdicts(dtype)
            expected_ops = judge(v, out, truth)
            v.fact("fused_distill calls", self.ops.take(), expected_ops)
            record.update(checks=v.rows, passed=v.passed)
        except Exception as exc:  # noqa: BLE001 - recorded; the run goes on with the next scenario
            record.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
            record["passed"] = False
            print(f"rank {dist.get_rank()}: {name} [{dtype}] failed:\n{record['traceback']}", flush=True)
        record["seconds"] = round(time.perf_counter() - started, 2)
        self.records.append(record)
        log(f"  {name} [{dtype}] {'ok' if record['passed'] else 'FAILED'} ({record['seconds']} s)")
        return out
