"""Worker processes for tests/ops/distillation/test_vocab_parallel.py: the vocabulary-parallel
distillation op on 2 ranks.

Run by :func:`tests.distributed.launch.run_workers` (one process per rank, gloo on CPU) as

    python -m tests.ops.distillation.vocab_parallel_workers --out DIR

Every rank builds every case from the same seed, runs ``vocab_parallel_distillation`` on its rows
of both heads (``torch.chunk``'s split, as a DTensor ``Shard(0)`` holds them: V = 1001 gives 501
and 500 rows) and ``fused_linear_distillation`` on the whole heads, and backpropagates the same
upstream gradient through both. Rank 0 saves ``DIR/results.pt``: per case and rank, both losses,
both hidden gradients and the rank's rows of both weight and bias gradients. The error cases
record what each rank raised. The pytest side compares.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from liger_patch.ops.core.vocab_shard import VocabShard
from liger_patch.ops.distillation import vocab_parallel as distillation_vocab_parallel
from liger_patch.ops.distillation.functional import fused_linear_distillation
from liger_patch.ops.distillation.vocab_parallel import vocab_parallel_distillation
from tests.distributed.workers import leave_rank

V, H_S, H_T, LEAD = 1001, 16, 24, (3, 7)
BOUNDARY_LABELS = (0, 500, 501, 1000)  # first and last row of each shard
ALL_MATH = dict(
    beta=0.4, temperature=1.7, ce_weight=0.3, student_softcap=6.0, teacher_softcap=4.0,
    student_logit_scale=0.8, teacher_logit_scale=1.25,
)  # fmt: skip

CASES: dict[str, dict] = {
    "forward_kl": dict(opts=dict(beta=0.0)),
    "reverse_kl": dict(opts=dict(beta=1.0)),
    "jsd": dict(opts=dict(beta=0.5)),
    "jsd_temperature": dict(opts=dict(beta=0.3, temperature=2.5)),
    "forward_kl_ce": dict(opts=dict(beta=0.0, ce_weight=0.5, temperature=0.5)),
    "reverse_kl_ce": dict(opts=dict(beta=1.0, ce_weight=0.2, temperature=2.0)),
    "ce_alone": dict(opts=dict(beta=0.5, ce_weight=1.0, temperature=3.0)),
    "softcaps_scales_biases": dict(bias=True, opts=ALL_MATH),
    "student_softcap_reverse_kl": dict(opts=dict(beta=1.0, student_softcap=3.0)),
    "sum": dict(bias=True, opts=dict(ALL_MATH, reduction="sum")),
    "none": dict(bias=True, opts=dict(ALL_MATH, reduction="none")),
    "num_items_int": dict(num_items=40, opts=dict(beta=0.5, ce_weight=0.5)),
    "num_items_tensor": dict(num_items=torch.tensor(40.0), opts=dict(beta=1.0)),
    "ignore_index_0": dict(ignore_index=0, opts=dict(beta=0.5, ce_weight=0.5)),
    "all_ignored": dict(ignore="all", bias=True, opts=ALL_MATH),
    "empty_batch": dict(lead=(0,), bias=True, opts=ALL_MATH),
    "chunks": dict(bias=True, opts=dict(ALL_MATH, memory_budget=2**21 + 80_000)),  # 5 rows a chunk
    # 21120 working bytes: 4 rows of the 501-column shard, 5 of the 500-column one (4232 and 4224
    # bytes a row, the Triton row math's); both walk 4
    "uneven_chunks": dict(opts=dict(beta=0.5, ce_weight=0.3, memory_budget=2**21 + 21_960)),
    "empty_shard": dict(vocab=1, bias=True, opts=dict(ALL_MATH, ce_weight=0.5)),
    "hidden_grad_only": dict(student_grad=("hidden",), opts=dict(beta=0.5, ce_weight=0.5)),
    "weight_grad_only": dict(student_grad=("weight", "bias"), bias=True, opts=dict(beta=1.0)),
    "inference_teacher": dict(inference_teacher=True, opts=dict(beta=0.5, reduction="none")),
    "bf16": dict(dtype=torch.bfloat16, bias=True, opts=dict(beta=0.5, ce_weight=0.3)),
    "autocast": dict(autocast=True, opts=dict(beta=0.5, ce_weight=0.3)),
    # no cross-entropy term: the shard's log-sum-exps from the fused GEMM's partials where it takes
    # the chunk (Hopper or the interpreter, 16-byte aligned rows: 501 and 500 bf16 columns are not)
    "bf16_no_ce": dict(dtype=torch.bfloat16, bias=True, opts=dict(ALL_MATH, ce_weight=0.0)),
    # 512-column bf16 shards: rows 16-byte aligned, as the fused GEMM takes them
    "bf16_aligned_no_ce": dict(vocab=1024, dtype=torch.bfloat16, bias=True, opts=dict(beta=0.5)),
    "autocast_forward_kl": dict(autocast=True, opts=dict(beta=0.0, temperature=2.0)),
    # the PyTorch row math (the cases above run the default backend: Triton, interpreted on the CPU)
    "torch_math": dict(backend="torch", bias=True, opts=ALL_MATH),
    "torch_math_none": dict(backend="torch", bias=True, opts=dict(ALL_MATH, reduction="none")),
    "torch_math_forward_kl": dict(backend="torch", opts=dict(beta=0.0, ce_weight=0.5, temperature=0.5)),
    "torch_math_reverse_kl": dict(backend="torch", opts=dict(beta=1.0, student_softcap=3.0)),
    "torch_math_bf16": dict(
        backend="torch", dtype=torch.bfloat16, bias=True, opts=dict(beta=0.5, ce_weight=0.3)
    ),
    # 14252 and 14224 bytes a row (the PyTorch row math's): 4 and 5 rows of 71120
    "torch_math_uneven_chunks": dict(
        backend="torch", opts=dict(beta=0.5, ce_weight=0.3, memory_budget=2**21 + 71_960)
    ),
}


def shard_rows(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """``(offset, rows)`` of ``rank``'s part of ``vocab`` rows, split as ``torch.chunk`` does."""
    sizes = [len(c) for c in torch.arange(vocab).chunk(world)] + [0] * world
    return sum(sizes[:rank]), sizes[rank]


def build_case(name: str, spec: dict) -> dict:
    """The case's inputs, the same on every rank: the heads scaled so that the logits spread."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    vocab, lead, dtype = spec.get("vocab", V), spec.get("lead", LEAD), spec.get("dtype", torch.float32)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    ignore_index = spec.get("ignore_index", -100)
    labels = torch.randint(0, vocab, lead, generator=gen)
    flat = labels.view(-1)
    if flat.numel() > 8 and vocab == V:
        flat[1:5] = torch.tensor(BOUNDARY_LABELS)
        flat[6:9] = ignore_index
    if spec.get("ignore") == "all":
        labels.fill_(ignore_index)
    bias = spec.get("bias", False)
    return dict(
        sh=randn(*lead, H_S), sw=randn(vocab, H_S, scale=0.8), sb=randn(vocab) if bias else None,
        th=randn(*lead, H_T), tw=randn(vocab, H_T, scale=0.8), tb=randn(vocab) if bias else None,
        labels=labels, ignore_index=ignore_index,
        upstream=torch.randn(lead if spec["opts"].get("reduction") == "none" else (), generator=gen),
    )  # fmt: skip


def _leaf(t: torch.Tensor | None, grad: bool, rows: slice | None = None) -> torch.Tensor | None:
    if t is None:
        return None
    part = t if rows is None else t[rows]
    return part.detach().clone().requires_grad_(grad)


def _run(fn, case: dict, spec: dict, rows: slice | None) -> dict:
    """``fn(student leaves, teacher tensors)``'s loss and the student's gradients (rows of the weight)."""
    wanted = spec.get("student_grad", ("hidden", "weight", "bias"))
    sh = _leaf(case["sh"], "hidden" in wanted)
    sw, sb = _leaf(case["sw"], "weight" in wanted, rows), _leaf(case["sb"], "bias" in wanted, rows)
    teacher = [None if t is None else (t if rows is None else t[rows]) for t in (case["tw"], case["tb"])]
    if spec.get("inference_teacher"):
        with torch.inference_mode():
            th, tw = case["th"].clone(), teacher[0].clone()
        teacher = [tw, teacher[1]]
    else:
        th = case["th"]
    with torch.autocast(sh.device.type, dtype=torch.bfloat16, enabled=spec.get("autocast", False)):
        loss = fn(sh, sw, sb, th, *teacher)
    leaves = {"hidden": sh, "weight": sw, "bias": sb}
    asked = [t for t in leaves.values() if t is not None and t.requires_grad]
    grads = torch.autograd.grad((loss * case["upstream"]).sum(), asked)
    found = dict(zip([n for n, t in leaves.items() if t is not None and t.requires_grad], grads, strict=True))
    return {"loss": loss.detach(), "grads": {n: found.get(n) for n in leaves}}


def run_case(name: str, spec: dict, device: str = "cpu", backend: str = "auto") -> dict:
    """This rank's sharded and unsharded results for one case, its tensors on ``device``, both
    ops on the case's backend, else ``backend``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    case = {k: v.to(device) if torch.is_tensor(v) else v for k, v in build_case(name, spec).items()}
    opts = dict(spec["opts"], ignore_index=case["ignore_index"], backend=spec.get("backend", backend))
    offset, rows = shard_rows(case["sw"].shape[0], rank, world)
    part = slice(offset, offset + rows)
    shard = VocabShard(offset, case["sw"].shape[0], dist.group.WORLD)
    num_items = spec.get("num_items")
    kwargs = dict(opts, num_items_in_batch=num_items.to(device) if torch.is_tensor(num_items) else num_items)
    labels = case["labels"]
    sharded = _run(
        lambda sh, sw, sb, th, tw, tb: vocab_parallel_distillation(
            sh, sw, th, tw, labels, sb, tb, shard=shard, **kwargs
        ),
        case,
        spec,
        part,
    )
    whole = _run(
        lambda sh, sw, sb, th, tw, tb: fused_linear_distillation(sh, sw, th, tw, labels, sb, tb, **kwargs),
        case,
        spec,
        None,
    )
    for key in ("weight", "bias"):  # this rank's rows of the whole op's gradients
        if whole["grads"][key] is not None:
            whole["grads"][key] = whole["grads"][key][part]
    return {"sharded": sharded, "whole": whole, "rows": rows}


def _raised(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - recorded for the test to check
        return f"{type(exc).__name__}: {exc}"
    return ""


def gradient_walks(call) -> int:
    """How many times ``call()`` made the op walk its chunks for gradients."""
    walks = []
    original = distillation_vocab_parallel._walk_grads
    distillation_vocab_parallel._walk_grads = lambda *a, **k: walks.append(1) or original(*a, **k)
    try:
        call()
    finally:
        distillation_vocab_parallel._walk_grads = original
    return len(walks)


def run_errors() -> dict:
    """What each rank raises for inputs the op refuses, then that the group still works; and that
    a forward under ``no_grad`` computes no gradients (the forward computes them with "mean")."""
    rank, world = dist.get_rank(), dist.get_world_size()
    case = build_case("errors", CASES["jsd"])
    offset, rows = shard_rows(V, rank, world)
    part = slice(offset, offset + rows)
    shard = VocabShard(offset, V, dist.group.WORLD)
    sh, th, labels = case["sh"], case["th"], case["labels"]
    bad = labels.clone()
    bad.view(-1)[0] = V if rank == 1 else 0  # out of range on one rank only
    hidden = sh.clone().requires_grad_()
    loss = vocab_parallel_distillation(hidden, case["sw"][part], th, case["tw"][part], labels, shard=shard)
    loss.backward(retain_graph=True)  # "mean": the gradients came from the forward
    sw = case["sw"][part].clone().requires_grad_()

    tw = case["tw"][part]

    def forward(**opts):
        return vocab_parallel_distillation(hidden, sw, th, case["tw"][part], labels, shard=shard, **opts)

    def under_no_grad():
        with torch.no_grad():
            forward()

    # the same count and sum of labels, a different number kept: 2 kept tokens here, 3 there
    unlike = torch.tensor([-100, 50, 50]) if rank == 0 else torch.tensor([0, 0, 0])
    return {
        "second_backward": _raised(loss.backward),
        "gradient_walks": [gradient_walks(forward), gradient_walks(under_no_grad)],
        "kept_mismatch": _raised(
            lambda: vocab_parallel_distillation(sh[0, :3], sw, th[0, :3], tw, unlike, shard=shard)
        ),
        "logits_dtype": _raised(lambda: forward(logits_dtype=torch.float16)),
        "rows_mismatch": _raised(
            lambda: vocab_parallel_distillation(sh, case["sw"][part], th, case["tw"][:3], labels, shard=shard)
        ),
        "bad_label_one_rank": _raised(
            lambda: vocab_parallel_distillation(sh, case["sw"][part], th, case["tw"][part], bad, shard=shard)
        ),
        "then_works": float(
            vocab_parallel_distillation(sh, case["sw"][part], th, case["tw"][part], labels, shard=shard)
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    mine = {"cases": {name: run_case(name, spec) for name, spec in CASES.items()}, "errors": run_errors()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        torch.save(every, args.out / "results.pt")
    leave_rank()
    return 0


if __name__ == "__main__":
    sys.exit(main())
