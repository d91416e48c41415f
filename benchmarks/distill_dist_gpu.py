"""TRL's distillation trainers on two GPUs over NCCL (issue 30): FSDP2, DeepSpeed ZeRO-3 and
tensor parallelism, patched against unpatched: parity, then peak memory and step time.

Launch (one node, 2 GPUs; trl, datasets and deepspeed on ``/tmp/site``):

    NCCL_NVLS_ENABLE=0 PYTHONPATH=/tmp/site:$PWD torchrun --nproc_per_node 2 \\
        benchmarks/distill_dist_gpu.py --out docs/results/distill_dist_gpu.json

It writes the JSON and a markdown table beside it (``.md``), after each part (a run cut short
keeps what it finished), and exits 1 when a parity check failed (after writing both). Expected
wall time on 2 H100s: 3 to 5 minutes, imports and Triton compiles included (``--budget-s``).

**Parity** runs the gloo tests' scenarios on the GPUs, with their own code
(``tests/integrations/trl_distillation_sharded_workers.py`` and
``tests/ops/distillation/vocab_parallel_workers.py``, given a ``Place``): CUDA tensors, NCCL,
the op's default backend (``"auto"``: Triton), tiny Llamas (hidden 64, teacher 96, heads scaled
so that their logits spread) with V = 1008 (transformers 5.17 loads no ``tp_plan`` model whose
vocabulary the tensor-parallel size does not divide; 1008 is not a power of two, and its bf16
rows are 16-byte aligned, as the fused logits GEMM wants), in fp32 and in bf16:

* ``vocab_parallel_op``: every case of the vocabulary-parallel op against the whole op (fp32;
  the bf16 and autocast cases in bf16);
* ``fsdp2_<wrap>`` (``lm_head`` its own unit, accelerate's tail unit, in the root unit) and
  ``fsdp2_gkd``: ``DistillationTrainer.compute_loss`` / ``GKDTrainer.compute_loss`` (TRL's code,
  on a stand-in trainer holding what it reads) on each rank's batch, patched (``apply_liger_to``)
  against unpatched and against TRL's path on the unsharded student; ``fsdp2_teacher_unit``: the
  teacher's head an FSDP2 unit (gathered again only where the op recomputes from it);
  ``fsdp2_<wrap>_3_steps`` (head unit, root unit): three SGD steps of both trainers' stand-ins,
  against the same on the unsharded student (every rank's batch) and against TRL's path;
* ``tp_<teacher>``: both trainers with a ``tp_plan="auto"`` student (a ``ColwiseParallel``
  ``lm_head``, sharded over the vocabulary), the teacher loaded the same way or plain;
  ``tp_tp_3_steps``: three SGD steps so; ``tp_rowwise_student``: a head sharded over the hidden
  dimension, which TRL's path computes (the patch says why);
* ``zero3``: both trainers themselves under ZeRO-3 (the teacher through TRL's
  ``prepare_deepspeed``), two SGD steps, ``LigerPatchCallback`` against none; and the op on a
  ZeRO-3 teacher engine's head.

Each compares the first step's loss, TRL's logged metrics (``entropy``; under ZeRO-3 the logged
``loss``, ``grad_norm``, ``entropy``), the student's gradients (relative L2 error per parameter,
the worst reported) and the parameters after the steps (``*_3_steps``, ZeRO-3); and checks what
ran, on every rank: the fused op (``operator.FUSED_DISTILL``, the registered operator or its eager twin,
its calls counted, and the hooks' calls of it), the vocabulary-parallel op, never TRL's chunked
kernel where the patch computes the loss (and TRL's kernel where it does not).

Tolerances, on relative errors (|a - b| / |b|, L2 for tensors): fp32 as the gloo tests (both
paths compute in fp32 and differ in the order of sums; the CPU saw 1e-7): loss and metrics
2e-5, gradients 1e-4, parameters 1e-5; the vocabulary-parallel cases elementwise, as their test.
bf16: loss and metrics 2e-2, gradients 5e-2, parameters 1e-2. bf16 keeps 8 significant bits
(one rounding: 2e-3 relative); the two paths round logits, log-probabilities and gradients at
different places, and a gradient sums many such terms, some cancelling (``distributed_gpu.py``
saw 6.5e-3 on the cross-entropy's); a wrong shard, reduction or temperature is off by 1e-1 or
more. TRL's ``GKDTrainer`` computes its log-softmax and divergence in bf16 (log-probabilities
near -10 keep steps of 0.06), which can put TRL's own result beyond these; so a bf16 value also
passes when it is within the tolerance of the fp32 run of the same scenario (same models, same
batches), or nearer to it than the unpatched value is (both reported). Under ZeRO-3 bf16,
``DistillationTrainer`` generates its batches: after the first step the two runs' weights
differ by bf16 rounding and a sampled token may differ, so only its first step is judged there
(the second and the parameters reported).

**Size** (bf16, the op's default backend): a Llama-shaped student (V = 128256, hidden 1024,
4 layers) and a wider teacher (hidden 2048, 4 layers), each trainer patched and unpatched:
FSDP2 (``lm_head`` its own unit, in the root unit) and tensor parallelism (both models
``tp_plan="auto"``) on the stand-in trainer (``compute_loss``, backward, AdamW; 4 x 1024
completion tokens per rank for ``DistillationTrainer``, 4 x 1024 tokens, a quarter prompt, for
GKD), ZeRO-3 through the trainers themselves (GKD offline on 4 x ~1024-token conversations;
``DistillationTrainer`` generating 256 tokens for 4 prompts each step). Per run: the peak
allocated memory of each rank over the timed steps (and what was allocated at the run's start),
the median step time (one warm-up step left out), the logged losses, what ran. The first step's
loss is judged (bf16 tolerance); the rest is reported.

The parts live beside this script: parity in ``distill_dist_parity.py``, size in
``distill_dist_sizes.py``, what both use (checks, tolerances, ``Run``) in ``distill_dist_common.py``; this
script runs them and writes the results.

``--smoke`` runs the same code on the CPU over gloo (DeepSpeed's CPU accelerator), tiny shapes,
fewer cases, no memory figures: a check of the script (``tests/benchmarks/test_distill_dist_gpu.py``
runs it). ``--budget-s``: parts not started by then are skipped and listed (parity parts come
first, then the size parts); ``--deadline-s``: every rank exits (124) then, whatever it is doing;
``--parts`` runs some of them.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parent)]  # the parts' modules, beside this one

import distill_dist_parity  # noqa: E402
import distill_dist_sizes  # noqa: E402
from common import log, write_json  # noqa: E402
from distill_dist_common import TOL, VOCAB, VP_TOL, Run  # noqa: E402

PARTS: dict[str, Callable[[Run], None]] = {
    "vocab_parallel_op": distill_dist_parity.part_vocab_parallel,
    "fsdp2": distill_dist_parity.part_fsdp2,
    "tp": distill_dist_parity.part_tp,
    "zero3": distill_dist_parity.part_zero3,
    "size_fsdp2": distill_dist_sizes.part_size_fsdp2,
    "size_tp": distill_dist_sizes.part_size_tp,
    "size_zero3": distill_dist_sizes.part_size_zero3,
}


# ------------------------------------------------------------------ results


def gathered(run: Run) -> dict:
    """Every rank's records side by side (a collective: every rank calls it)."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (run.records, run.sizes))
    parity = []
    for per_rank in zip(*(records for records, _ in every), strict=True):
        first = per_rank[0]
        ranks = [{k: r[k] for k in r if k not in ("scenario", "dtype")} for r in per_rank]
        passed = all(r["passed"] for r in per_rank)
        parity.append(
            {"scenario": first["scenario"], "dtype": first["dtype"], "passed": passed, "ranks": ranks}
        )
    every_size = [s for _, s in every]
    return {
        "parity": parity,
        "size": distill_dist_sizes.size_table(every_size),
        "size_checks": distill_dist_sizes.judge_sizes(every_size),
        "size_runs": every_size,
    }


def worst(record: dict, kind: str) -> str:
    """The worst figure of ``kind`` over ranks: the relative error, or for the elementwise checks
    the error over its bound (what they are judged by: at most 1 passes; their relative error
    means nothing where the values are round-off around 0, as the empty shard's loss)."""
    field = "bound_ratio" if kind == "elementwise" else "err"
    errs = [row[field] for rank in record["ranks"] for row in rank.get("checks", []) if row["kind"] == kind]
    return f"{max(errs):.1e}" if errs else ""


def markdown(results: dict) -> str:
    """The parity and size tables."""
    tol = results["tolerances"]
    lines = [
        f"`benchmarks/distill_dist_gpu.py` on {results['device']} ({results['wall_s']} s); "
        f"{', '.join(f'{k} {v}' for k, v in results['versions'].items())}",
        "",
        f"Parity: the worst relative error over ranks (fp32 tolerances {tol['fp32']}, bf16 {tol['bf16']}; "
        "elementwise: the worst |error| over its bound, passed at most 1)",
        "",
        "| scenario | dtype | loss | grads | metrics | params | elementwise | passed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["parity"]:
        errs = " | ".join(worst(r, kind) for kind in ("loss", "grad", "metric", "param", "elementwise"))
        lines.append(f"| {r['scenario']} | {r['dtype']} | {errs} | {'yes' if r['passed'] else '**NO**'} |")
    lines += [
        "",
        f"Size ({results['size_shapes']['dtype']}): peak allocated per rank over the timed steps, and "
        "that peak above what the run found allocated (what an earlier run left behind counts in the "
        "first, not in the second), median step (rank 0), first loss",
        "",
        "| scenario | trainer | variant | step ms | peak GiB per rank | above start | first loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["size"]:
        head = f"| {r['scenario']} | {r['trainer']} | {r['variant']} |"
        if "error" in r:
            lines.append(f"{head} error: {r['error'][:100]} | | | |")
            continue
        peaks = ", ".join("n/a" if p is None else f"{p:.2f}" for p in r["peak_allocated_gib_per_rank"])
        starts = r.get("allocated_at_start_gib_per_rank") or [None] * len(r["peak_allocated_gib_per_rank"])
        above = ", ".join(
            "n/a" if p is None or a is None else f"{p - a:.2f}"
            for p, a in zip(r["peak_allocated_gib_per_rank"], starts, strict=True)
        )
        lines.append(f"{head} {r['median_step_ms']:.1f} | {peaks} | {above} | {r['first_loss']:.6f} |")
    checks = (
        f"{c['scenario']} {c['trainer']} {'ok' if c['passed'] else 'FAILED'}" for c in results["size_checks"]
    )
    lines += ["", "Size checks (first loss, what ran): " + ", ".join(checks)]
    if results["skipped"]:
        lines += ["", "Skipped: " + "; ".join(results["skipped"])]
    return "\n".join(lines) + "\n"


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import liger_patch

    found = {"python": platform.python_version(), "liger_patch": liger_patch.__version__}
    for name in ("torch", "transformers", "trl", "deepspeed", "accelerate", "triton", "datasets"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "missing"
    return found


def write(run: Run, path: Path, finished: bool) -> bool:
    """Gather and write the JSON and the table (rank 0); whether every check so far passed."""
    from liger_patch.ops.core.backends import pick

    results = gathered(run)
    passed = all(r["passed"] for r in results["parity"]) and all(c["passed"] for c in results["size_checks"])
    if dist.get_rank() == 0:
        device = torch.cuda.get_device_name() if run.cuda else "cpu (smoke)"
        results = {
            "script": "benchmarks/distill_dist_gpu.py", "command": " ".join(sys.argv), "smoke": run.smoke,
            "device": f"{dist.get_world_size()}x {device}", "world_size": dist.get_world_size(),
            "versions": versions(), "backend": f"auto: {pick('auto', torch.device(run.device)).name}",
            "vocab_parity": VOCAB, "size_shapes": run.size,
            "tolerances": TOL, "vocab_parallel_tolerances": VP_TOL, "finished": finished,
            "wall_s": round(run.elapsed(), 1), "skipped": run.skipped, "passed": passed, **results,
        }  # fmt: skip
        write_json(path, results, indent=1)
        path.with_suffix(".md").write_text(markdown(results))
    return passed


# ------------------------------------------------------------------ main


def start(smoke: bool) -> str:
    """The process group: NCCL on this rank's GPU, or gloo on the CPU (``--smoke``, GPUs hidden)."""
    if smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=3))
        return "cpu"
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 GEMMs in IEEE fp32 (TRL's and ours alike)
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=3), device_id=device)
    return "cuda"


def watchdog(seconds: float) -> None:
    """End this rank (exit 124) after ``seconds`` whatever it is doing, a hung collective
    included: the JSON of the parts finished by then stays."""

    def expire() -> None:
        print(f"distill_dist_gpu: deadline of {seconds:.0f} s passed; exiting", file=sys.stderr, flush=True)
        os._exit(124)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON (and beside it the table, .md)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"some of {','.join(PARTS)}")
    parser.add_argument("--budget-s", type=float, default=330.0, help="no part starts after this")
    parser.add_argument("--deadline-s", type=float, default=450.0, help="every rank exits (124) at this")
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny shapes: checks the script")
    args = parser.parse_args(argv)
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}")
    watchdog(args.deadline_s)
    device = start(args.smoke)
    warnings.filterwarnings("ignore")
    import datasets
    import transformers
    import trl.experimental.gkd  # noqa: F401  (the hooks install on the TRL modules imported)
    import trl.trainer.distillation_trainer  # noqa: F401

    transformers.utils.logging.disable_progress_bar()  # loading and saving bars, on every rank
    transformers.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()

    from liger_patch.integrations import trl_distillation, trl_gkd

    assert trl_distillation.install() and trl_gkd.install()
    run = Run(args.smoke, device)
    log(f"{versions()}, world {dist.get_world_size()}, {device}")
    for name in args.parts.split(","):
        go = [run.elapsed() < args.budget_s]
        dist.broadcast_object_list(go, src=0)  # every rank takes rank 0's decision
        if not go[0]:
            run.skipped.append(f"{name}: not started by {args.budget_s:.0f} s")
            continue
        log(f"{name} ({run.elapsed():.0f} s)")
        PARTS[name](run)
        write(run, args.out, finished=False)
    passed = write(run, args.out, finished=True)
    log(f"wrote {args.out} (.md beside it): {'passed' if passed else 'FAILED'}, {run.elapsed():.0f} s")
    if dist.get_rank() == 0:
        shutil.rmtree(run.scratch, ignore_errors=True)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if passed else 1)  # no interpreter teardown: tests/distributed/workers.leave_rank says why


if __name__ == "__main__":
    sys.exit(main())
