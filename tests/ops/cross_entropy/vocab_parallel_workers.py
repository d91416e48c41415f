"""Worker processes for tests/ops/cross_entropy/test_vocab_parallel.py: the vocabulary-parallel op on 2 ranks.

Run by :func:`tests.distributed.launch.run_workers` (one process per rank, gloo on CPU) as

    python -m tests.ops.cross_entropy.vocab_parallel_workers --out DIR

Every rank builds every case from the same seed, runs ``vocab_parallel_loss`` on its rows of the
weight (``torch.chunk``'s split, as a DTensor ``Shard(0)`` holds them: V=1001 gives 501 and 500
rows) and backpropagates the same random upstream gradients through every differentiable output.
Rank 0 also runs the unsharded op on the whole weight and the fp64 reference, and saves
``DIR/results.pt``: per case, every rank's outputs and hidden gradient, the weight and bias
gradients assembled from the ranks' shards, the unsharded op's and the reference's. The error
cases record what each rank raised. The pytest side compares.
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
from liger_patch.ops.cross_entropy.vocab_parallel import vocab_parallel_loss
from tests.op_helpers import (
    ALL_OPTIONS,
    COMBINED,
    OPTION_CASES,
    OUTPUTS,
    make_case,
    materialize_options,
    reference_outputs_for,
    upstream_like,
)

H, LEAD, V = 16, (2, 13), 1001
BOUNDARY_LABELS = (0, 500, 501, 1000)  # first and last row of each shard, at positions 1..4


def _option_case(case_kw: dict, op_kw: dict) -> dict:
    """A case of ``OPTION_CASES`` (make_case kwargs, op kwargs) as a case spec here."""
    return dict(bias=case_kw.get("bias", False), ignore_index=case_kw.get("ignore_index", -100), opts=op_kw)


CASES: dict[str, dict] = {
    # every option, alone and combined: the op tests' own list
    **{name: _option_case(*spec) for name, spec in OPTION_CASES.items()},
    # ... and what is particular to a sharded vocabulary
    "ties_across_shards": dict(tie_rows=(100, 600), opts=dict(OUTPUTS, reduction="none")),
    "labels_in_first_shard": dict(labels_below=501, opts=dict(ALL_OPTIONS)),
    "labels_in_last_shard": dict(labels_from=501, opts=dict(ALL_OPTIONS)),
    "all_ignored": dict(bias=True, ignore="all", opts=dict(ALL_OPTIONS)),
    "all_ignored_sum": dict(ignore="all", opts=dict(reduction="sum", z_loss_scale=1e-2, return_z_loss=True)),
    "empty_batch": dict(lead=(0,), bias=True, opts=dict(ALL_OPTIONS)),
    "empty_batch_none": dict(lead=(0,), opts=dict(OUTPUTS, reduction="none")),
    "chunks_and_two_pass": dict(bias=True, chunk_rows=5, opts=dict(ALL_OPTIONS)),
    "bf16": dict(dtype=torch.bfloat16, bias=True, opts=dict(ALL_OPTIONS)),
    "bf16_fp32_logits": dict(dtype=torch.bfloat16, opts=dict(logits_dtype=torch.float32)),
    "tiny_vocab": dict(vocab=3, bias=True, opts=dict(ALL_OPTIONS)),
    # shards wider than the 4096 columns the label-smoothing sum takes at a time
    "wide_vocab": dict(vocab=8301, opts=dict(ALL_OPTIONS)),
    "empty_shard": dict(vocab=1, bias=True, opts=dict(ALL_OPTIONS)),
    "hidden_grad_only": dict(requires_grad=("hidden",), opts=dict(label_smoothing=0.1)),
    "weight_grad_only": dict(bias=True, requires_grad=("weight", "bias"), opts=dict(reduction="none")),
    "second_backward": dict(bias=True, backward_twice=True, opts=dict(ALL_OPTIONS)),
    "autocast": dict(autocast=True, bias=True, opts=dict(label_smoothing=0.1)),
    "triton": dict(backend="triton", bias=True, opts=dict(COMBINED, **OUTPUTS)),
    "triton_none": dict(backend="triton", opts=dict(ALL_OPTIONS, reduction="none")),
}


def shard_rows(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """``(offset, rows)`` of ``rank``'s part of ``vocab`` rows, split as ``torch.chunk`` does."""
    sizes = [len(c) for c in torch.arange(vocab).chunk(world)] + [0] * world
    return sum(sizes[:rank]), sizes[rank]


def build_case(name: str, spec: dict):
    """The case's inputs (identical on every rank), its options and upstream generator."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    vocab, lead = spec.get("vocab", V), spec.get("lead", LEAD)
    case = make_case(
        gen,
        lead,
        H,
        vocab,
        dtype=spec.get("dtype", torch.float32),
        bias=spec.get("bias", False),
        ignore=spec.get("ignore", "mixed"),
        ignore_index=spec.get("ignore_index", -100),
        requires_grad=spec.get("requires_grad", ("hidden", "weight", "bias")),
    )
    if "tie_rows" in spec:  # two equal rows, one per shard, large enough to be most tokens' argmax
        with torch.no_grad():
            first, second = spec["tie_rows"]
            case.weight[first] = case.weight[second] = 6 * case.weight[first]
    flat = case.labels.view(-1)
    kept = flat != case.ignore_index
    if "labels_below" in spec:
        flat[kept] = flat[kept] % spec["labels_below"]
    if "labels_from" in spec:
        flat[kept] = spec["labels_from"] + flat[kept] % (vocab - spec["labels_from"])
    placed = "labels_below" in spec or "labels_from" in spec or spec.get("ignore") == "all"
    if vocab == V and flat.numel() > 4 and not placed:
        flat[1:5] = torch.tensor(BOUNDARY_LABELS)
    opts = dict(spec["opts"], backend=spec.get("backend", "torch"), ignore_index=case.ignore_index)
    opts = materialize_options(opts, "cpu", vocab)
    if "chunk_rows" in spec:
        from liger_patch.ops.core.tuning import Tuning

        rows = spec["chunk_rows"]
        opts["tuning"] = Tuning(chunk_rows=rows, min_token_chunk_rows=rows + 1)
        opts["memory_budget"] = 4 * vocab * rows
    return case, opts, gen


def _outputs(result, opts: dict) -> dict[str, torch.Tensor]:
    """The op's outputs by name (``loss`` and those asked for)."""
    if isinstance(result, torch.Tensor):
        return {"loss": result}
    return dict(zip(result._fields, result, strict=True))


def _objective(outs: dict, upstream: dict) -> torch.Tensor:
    """sum of every differentiable output times its upstream gradient."""
    total = 0.0
    for name in ("loss", "z_loss", "entropy"):
        if name in outs:
            total = total + (outs[name] * upstream[name].to(outs[name].dtype)).sum()
    return total


def _upstreams(case, opts: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    shape = case.labels.shape if opts.get("reduction") == "none" else ()
    return {name: upstream_like(torch.empty(shape), gen) for name in ("loss", "z_loss", "entropy")}


def _leaf(t: torch.Tensor | None, rows: slice | None = None) -> torch.Tensor | None:
    if t is None:
        return None
    part = t.detach() if rows is None else t.detach()[rows]
    return part.clone().requires_grad_(t.requires_grad)


def _run(loss_fn, leaves: dict, opts: dict, upstream: dict, spec: dict) -> dict:
    """Call ``loss_fn`` (hidden, weight, bias leaves -> outputs) under the spec's autocast,
    backprop the objective (twice over a retained graph when the spec says so), and return the
    outputs and the leaves' gradients."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.get("autocast", False)):
        outs = _outputs(loss_fn(leaves["hidden"], leaves["weight"], leaves["bias"]), opts)
    objective = _objective(outs, upstream)
    if objective.requires_grad:
        objective.backward(retain_graph=spec.get("backward_twice", False))
        if spec.get("backward_twice"):
            objective.backward()
    return {
        "outputs": {k: v.detach() for k, v in outs.items()},
        "grads": {n: None if t is None else t.grad for n, t in leaves.items()},
    }


def run_sharded(case, opts: dict, upstream: dict, spec: dict) -> dict:
    """This rank's sharded run: outputs, grad_h, and its shard's weight and bias gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    offset, rows = shard_rows(case.weight.shape[0], rank, world)
    part = slice(offset, offset + rows)
    leaves = {
        "hidden": _leaf(case.hidden),
        "weight": _leaf(case.weight, part),
        "bias": _leaf(case.bias, part),
    }
    shard = VocabShard(offset, case.weight.shape[0], dist.group.WORLD)
    return _run(
        lambda h, w, b: vocab_parallel_loss(h, w, case.labels, b, shard=shard, **opts),
        leaves,
        opts,
        upstream,
        spec,
    )


def run_unsharded(case, opts: dict, upstream: dict, spec: dict) -> dict:
    """The unsharded op on the same inputs and upstream gradients."""
    from liger_patch import fused_linear_cross_entropy

    leaves = {"hidden": _leaf(case.hidden), "weight": _leaf(case.weight), "bias": _leaf(case.bias)}
    return _run(
        lambda h, w, b: fused_linear_cross_entropy(h, w, case.labels, b, **opts), leaves, opts, upstream, spec
    )


def run_reference(case, opts: dict, upstream: dict, spec: dict, returned: list[str]) -> dict:
    """The fp64 reference's outputs (reduced as the op's) and the gradients of the objective
    made of the ``returned`` outputs, as the op's."""
    ref = reference_outputs_for(case, **opts)
    outs = {k: ref[k] for k in ("loss", "z_loss", "token_accuracy", "predicted_tokens", "entropy")}
    leaves = ref["leaves"]
    objective = _objective({k: outs[k] for k in returned}, upstream)
    wanted = [t for t in leaves.values() if t.requires_grad]
    found = (
        torch.autograd.grad(objective, wanted, allow_unused=True)
        if wanted and objective.requires_grad
        else []
    )
    grads = dict.fromkeys(leaves)
    for (name, t), g in zip(((n, t) for n, t in leaves.items() if t.requires_grad), found, strict=True):
        grads[name] = torch.zeros_like(t) if g is None else g
    factor = 2 if spec.get("backward_twice") else 1
    return {
        "outputs": {k: v.detach() for k, v in outs.items()},
        "grads": {k: None if g is None else factor * g for k, g in grads.items()},
        "logits": ref["logits"],
    }


def _gather(t: torch.Tensor | None) -> list:
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, t)
    return found


def run_case(name: str, spec: dict) -> dict | None:
    case, opts, gen = build_case(name, spec)
    upstream = _upstreams(case, opts, gen)
    sharded = run_sharded(case, opts, upstream, spec)
    per_rank = _gather(sharded)
    if dist.get_rank() != 0:
        return None
    assembled = {
        name: None if per_rank[0]["grads"][name] is None else torch.cat([r["grads"][name] for r in per_rank])
        for name in ("weight", "bias")
    }
    return {
        "ranks": per_rank,
        "sharded_grads": {"hidden": per_rank[0]["grads"]["hidden"], **assembled},
        "unsharded": run_unsharded(case, opts, upstream, spec),
        "reference": run_reference(case, opts, upstream, spec, list(sharded["outputs"])),
        "labels": case.labels,
        "ignore_index": case.ignore_index,
        "dtype": case.hidden.dtype,
        "reduction": opts.get("reduction", "mean"),
    }


# --------------------------------------------------------------------------------------------
# Bad input: every rank must raise, and the group must still work afterwards
# --------------------------------------------------------------------------------------------


def _attempt(labels: torch.Tensor, n_rows: int | None = None, **opts) -> tuple[str, str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(5)
    n = labels.numel() if n_rows is None else n_rows
    hidden = torch.randn(n, H, generator=gen)
    weight = torch.randn(V, H, generator=gen)
    offset, rows = shard_rows(V, rank, world)
    try:
        vocab_parallel_loss(
            hidden, weight[offset : offset + rows], labels[:n], shard=VocabShard(offset, V), **opts
        )
    except (IndexError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    return "", ""


def error_cases() -> dict[str, list]:
    rank = dist.get_rank()
    good = torch.arange(20) * 50  # 0 .. 950
    results = {}
    for name, label in (("label_is_V", V), ("label_above_V", V + 7), ("negative_label", -3)):
        bad = good.clone()
        bad[6] = label
        results[name] = _gather(_attempt(bad))
    bad_here = good.clone()
    if rank == 0:
        bad_here[3] = V
    results["bad_label_on_rank_0_only"] = _gather(_attempt(bad_here))
    different = good.clone()
    different[2] += rank
    results["different_labels"] = _gather(_attempt(different))
    results["different_token_counts"] = _gather(_attempt(good, n_rows=20 - rank))
    bad_count = torch.tensor(float("nan") if rank == 1 else 10.0)
    results["bad_num_items_on_rank_1"] = _gather(_attempt(good, num_items_in_batch=bad_count))
    results["after_errors"] = _gather(_attempt(good))  # the group is still in step
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("cases", nargs="*", default=list(CASES))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results = {name: run_case(name, CASES[name]) for name in args.cases}
    errors = error_cases()
    if dist.get_rank() == 0:
        torch.save({"cases": results, "errors": errors}, args.out / "results.pt")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
