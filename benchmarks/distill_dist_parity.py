"""The parity parts of ``distill_dist_gpu.py`` (its docstring says what each scenario runs and
how it is judged): the gloo tests' scenarios on the GPUs, with their own code, each judged
against TRL's path and the unsharded reference (``judge_*``), and a few SGD steps of each
trainer's ``compute_loss`` (``few_steps``)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from distill_dist_common import (
    FUSED_ONCE,
    SMOKE_VP_CASES,
    TRL_ONLY,
    VOCAB,
    VP_TOL,
    Run,
    Verdicts,
    free_memory,
    loss_of,
    scenarios,
    stand_in,
)

# ------------------------------------------------------------------ parity: the gloo tests' asserts


def _step(v: Verdicts, what: str, got: dict, want: dict, truth: dict | None, skip: tuple = ()) -> None:
    """One ``compute_loss`` and backward against another: the loss and every student gradient."""
    v.close("loss", f"loss {what}", got["loss"], want["loss"], truth and truth["loss"])
    v.tensors("grad", f"grads {what}", got["grads"], want["grads"], truth and truth["grads"], skip)


def judge_fsdp2(wrap: str, v: Verdicts, out: dict, truth: dict | None) -> int:
    """``fsdp2_<wrap>``; returns the op calls expected."""
    patched, unpatched = out["patched"], out["unpatched"]
    _step(v, "vs reference", patched, out["reference"], truth and truth["reference"])
    # TRL's own path all-gathers a DTensor head with full_tensor(), whose backward keeps each rank's
    # gradient rows unreduced (the gloo test's finding): the reference says what is right there
    skip = ("lm_head.weight",) if wrap == "head_unit" else ()
    _step(v, "vs TRL", patched, unpatched, truth and truth["unpatched"], skip)
    entropy_truth = truth and truth["unpatched"]["entropy"]
    v.close("metric", "entropy vs TRL", patched["entropy"], unpatched["entropy"], entropy_truth)
    v.fact("ran, patched", patched["ran"], FUSED_ONCE)
    v.fact("ran, unpatched", unpatched["ran"], TRL_ONLY)
    v.fact("bypass", patched["bypass"], None)
    v.fact("lm_head calls", patched["head_calls"], int(wrap == "head_unit"))
    return 1


def judge_fsdp2_gkd(v: Verdicts, out: dict, truth: dict | None) -> int:
    patched = out["patched"]
    _step(v, "vs reference", patched, out["reference"], truth and truth["reference"])
    _step(v, "vs TRL", patched, out["unpatched"], truth and truth["unpatched"])
    v.fact("ran, patched", patched["ran"], FUSED_ONCE)
    v.fact("bypass", patched["bypass"], None)
    v.fact("lm_head calls", patched["head_calls"], 1)
    return 1


TEACHER_GATHERS = {"mean": [True], "none": [True, False], "tp_student": [True, False]}


def judge_teacher_unit(v: Verdicts, out: dict, truth: dict | None) -> int:
    for run, got in out.items():
        t = truth and truth[run]
        v.close("loss", f"{run}: loss", got["loss"], got["ref_loss"], t and t["ref_loss"])
        v.close("grad", f"{run}: grad_h", got["grad_h"], got["ref_grad_h"], t and t["ref_grad_h"])
        v.close("grad", f"{run}: grad_w", got["grad_w"], got["ref_grad_w"], t and t["ref_grad_w"])
        v.fact(f"{run}: teacher all-gathers (grad mode)", got["teacher_gathers"], TEACHER_GATHERS[run])
        tp = run == "tp_student"
        v.fact(f"{run}: ran", got["ran"], {"fused": int(not tp), "vocab_parallel": int(tp), "trl": 0})
    return sum(run != "tp_student" for run in out) + len(out)  # and each run's reference, the whole op


def judge_tp(v: Verdicts, out: dict, truth: dict | None) -> int:
    for trainer in ("distillation", "gkd"):
        runs = {run: found[trainer] for run, found in out.items()}
        t = truth and {run: found[trainer] for run, found in truth.items()}
        patched, unpatched = runs["patched"], runs["unpatched"]
        _step(v, f"{trainer} vs reference", patched, runs["reference"], t and t["reference"])
        _step(v, f"{trainer} vs TRL", patched, unpatched, t and t["unpatched"])
        if trainer == "distillation":
            e_truth = t and t["unpatched"]["entropy"]
            v.close("metric", "entropy vs TRL", patched["entropy"], unpatched["entropy"], e_truth)
        v.fact(f"{trainer} ran, patched", patched["ran"], {"fused": 0, "vocab_parallel": 1, "trl": 0})
        v.fact(f"{trainer} bypass", patched["bypass"], None)
        v.fact(f"{trainer} lm_head calls", patched["head_calls"], 0)
    return 0


def judge_rowwise(v: Verdicts, out: dict, truth: dict | None) -> int:
    patched, unpatched = out["patched"], out["unpatched"]
    v.fact("ran, patched", patched["ran"], TRL_ONLY)
    v.fact("ran, unpatched", unpatched["ran"], TRL_ONLY)
    why = patched["bypass"] or ""
    v.holds("bypass says why", "not sharded over the vocabulary alone" in why, patched["bypass"])
    warned = patched["warnings"]
    named = len(warned) == 1 and "TRL's own chunked divergence kernel" in warned[0]
    v.holds("one warning, naming TRL's kernel", named, warned)
    _step(v, "vs TRL", patched, unpatched, truth and truth["unpatched"])
    return 0


def judge_zero3_trainer(v: Verdicts, trainer: str, runs: dict, truth: dict | None, every_step: bool) -> None:
    """One trainer's ZeRO-3 runs: logged values, parameters, what ran, heads partitioned again.
    Steps after the first (and the parameters) are judged where ``every_step``, else reported."""
    patched, unpatched = runs["patched"], runs["unpatched"]
    for key, values in unpatched["logged"].items():
        mine = patched["logged"][key]
        v.fact(f"{trainer}: {key} logged steps", [len(mine), len(values)], [2, 2])
        for i in range(min(len(values), len(mine))):
            kind = "loss" if key == "loss" else "metric"
            t = truth and truth["logged"][key][i]
            v.close(kind, f"{trainer}: step {i + 1} {key}", mine[i], values[i], t, gate=i == 0 or every_step)
    t = truth and truth["params"]
    v.tensors("param", f"{trainer}: parameters after 2 steps", patched["params"], unpatched["params"], t,
              gate=every_step)  # fmt: skip
    trl_calls = 2 if trainer == "distillation" else 0  # GKD's loss is no kernel of TRL's
    for run, want in (("patched", {"fused": 2, "trl": 0}), ("unpatched", {"fused": 0, "trl": trl_calls})):
        v.fact(f"{trainer}: ran, {run}", {k: runs[run]["ran"][k] for k in want}, want)
        after = runs[run]["head_numel_after"]
        v.fact(f"{trainer}: {run}: heads' partitions after", after, {"student": 0, "teacher": 0})
    v.fact(f"{trainer}: bypass", patched["bypass"], None)


def judge_zero3(every_step: bool, v: Verdicts, out: dict, truth: dict | None) -> int:
    """Both trainers (``DistillationTrainer`` generates its batches: in bf16 they may differ after
    the first step, so ``every_step`` is False there) and the teacher engine."""
    for trainer in ("distillation", "gkd"):
        same_batches = truth and trainer == "gkd"  # the fp32 run's are the same batches
        t = truth[trainer]["unpatched"] if same_batches else None
        judge_zero3_trainer(v, trainer, out[trainer], t, every_step or trainer == "gkd")
    for reduction, numel in (("mean", 0), ("none", VOCAB * 96)):
        got = out["teacher_engine"][reduction]
        t = truth and truth["teacher_engine"][reduction]
        v.close("loss", f"engine {reduction}: loss", got["loss"], got["ref_loss"], t and t["ref_loss"])
        for i, name in enumerate(("hidden", "weight")):
            grad_truth = t and t["ref_grads"][i]
            v.close(
                "grad", f"engine {reduction}: grad {name}", got["grads"][i], got["ref_grads"][i], grad_truth
            )
        v.fact(f"engine {reduction}: teacher head numel after", got["teacher_numel_after"], numel)
        v.fact(f"engine {reduction}: fused calls", got["ran"]["fused"], 1)
    return 2 + 2 + 2 * 2  # each trainer's two steps, the engine's two runs and their references


def judge_vocab_parallel(v: Verdicts, out: dict, truth: dict | None) -> int:
    from tests.ops.distillation.vocab_parallel_workers import CASES

    for name, case in out.items():
        spec = CASES[name]
        tol = VP_TOL["bf16" if spec.get("dtype") == torch.bfloat16 or spec.get("autocast") else "fp32"]
        sharded, whole = case["sharded"], case["whole"]
        v.elementwise(f"{name}: loss", sharded["loss"], whole["loss"], **tol)
        for tensor, grad in sharded["grads"].items():
            expected = whole["grads"][tensor]
            if expected is None or grad is None:
                v.fact(f"{name}: grad {tensor} given", grad is not None, expected is not None)
            else:
                v.elementwise(f"{name}: grad {tensor}", grad, expected, **tol)
    return len(out)  # the whole op once a case


# ------------------------------------------------------------------ parity: a few SGD steps

STEPS = 3


def step_batches(trainer_name: str, place, world: int) -> list[list[dict]]:
    """Per step, every rank's batch (``world`` 1: one batch for all ranks, tensor parallelism);
    ``DistillationTrainer``'s ``num_items_in_batch`` counted over all of them."""
    steps = []
    for step in range(STEPS):
        seeds = [50 + world * step + r for r in range(world)]
        if trainer_name == "gkd":
            steps.append([scenarios.gkd_batch(seed, place) for seed in seeds])
            continue
        every = [scenarios.distillation_batch(seed, 0.0, place) for seed in seeds]
        total = sum(b["completion_mask"].sum() for b in every).float()
        steps.append([b | {"num_items_in_batch": total} for b in every])
    return steps


def _tiny_pair(kind: str, variant: str, place, paths: dict):
    """The tiny student (``variant``: patched, unpatched, or the unsharded reference) and teacher."""
    import liger_patch as lp

    tp, sharded = kind.startswith("tp"), variant != "reference"
    if tp:
        student = scenarios.load(paths["student"], sharded, place)
        teacher = scenarios.load(paths["teacher"], sharded, place).requires_grad_(False)
    else:
        student, teacher = scenarios.models(place=place), scenarios.models(96, seed=2, place=place)
    if variant == "patched":
        lp.apply_liger_to(student, backend=place.backend)
    if sharded and not tp:
        scenarios.wrap_fsdp2(student, kind.removeprefix("fsdp2_"), place)
    return student.train(), teacher


def few_steps(kind: str, place, paths: dict, counts) -> dict:
    """``STEPS`` SGD steps of each trainer's ``compute_loss`` with the ``kind`` student
    (``fsdp2_<wrap>``: each rank its batch; ``tp``: the same batch), patched and unpatched, and
    the reference: the unsharded student on every rank's batch, the losses averaged as FSDP2
    averages gradients. Per run: each step's loss (this rank's), then every parameter (whole)."""
    world = 1 if kind.startswith("tp") else dist.get_world_size()
    beta = scenarios.BETA if kind.startswith("tp") else scenarios.FSDP2_WRAPS[kind.removeprefix("fsdp2_")]
    out: dict = {}
    for trainer_name in ("distillation", "gkd"):
        batches = step_batches(trainer_name, place, world)
        for variant in ("unpatched", "patched", "reference"):
            student, teacher = _tiny_pair(kind, variant, place, paths)
            trainer = stand_in(trainer_name, student, teacher, beta, world)
            optimizer = torch.optim.SGD(student.parameters(), lr=0.05, foreach=False)
            losses = []
            for every in batches:
                mine = every if variant == "reference" else [every[dist.get_rank() % world]]
                step = [loss_of(trainer_name, trainer, student, b) for b in mine]
                torch.stack(step).mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(step[dist.get_rank() % len(step)].detach().float())
            params = {n: scenarios.full(p).float() for n, p in student.named_parameters()}
            out.setdefault(trainer_name, {})[variant] = {
                "losses": torch.stack(losses),
                "params": params,
                "ran": counts.take(),
            }
    return out


def judge_steps(kind: str, v: Verdicts, out: dict, truth: dict | None) -> int:
    """Against the reference and against TRL's path; but ``DistillationTrainer``'s own path with
    the head its own FSDP2 unit leaves the head's gradient rows unreduced (the gloo test's
    finding), so its later steps differ: that comparison is reported, not judged."""
    tp = kind.startswith("tp")
    for trainer in ("distillation", "gkd"):
        runs, t = out[trainer], truth and truth[trainer]
        patched = runs["patched"]
        for other in ("reference", "unpatched"):
            gate = other == "reference" or not (kind == "fsdp2_head_unit" and trainer == "distillation")
            losses, params = (t[other]["losses"], t[other]["params"]) if t else (None, None)
            what = f"{trainer}: vs {other}"
            v.close("loss", f"{what}, {STEPS} losses", patched["losses"], runs[other]["losses"], losses, gate)
            v.tensors("param", f"{what}, parameters after {STEPS} steps", patched["params"],
                      runs[other]["params"], params, gate=gate)  # fmt: skip
        ran = {"fused": 0, "vocab_parallel": STEPS} if tp else {"fused": STEPS, "vocab_parallel": 0}
        v.fact(f"{trainer}: ran, patched", patched["ran"], ran | {"trl": 0})
        trl = {"fused": 0, "vocab_parallel": 0, "trl": STEPS if trainer == "distillation" else 0}
        v.fact(f"{trainer}: ran, unpatched", runs["unpatched"]["ran"], trl)
    return 0 if tp else 2 * STEPS


# ------------------------------------------------------------------ parity parts


def part_vocab_parallel(run: Run) -> None:
    from tests.ops.distillation import vocab_parallel_workers as vp

    names = SMOKE_VP_CASES if run.smoke else tuple(vp.CASES)

    def cases() -> dict:
        return {name: vp.run_case(name, vp.CASES[name], run.device, "auto") for name in names}

    run.scenario("vocab_parallel_op", "fp32", cases, judge_vocab_parallel)


def part_fsdp2(run: Run) -> None:
    truth: dict = {}
    for dtype, place in run.places.items():
        for wrap in scenarios.FSDP2_WRAPS:
            name = f"fsdp2_{wrap}"
            work = functools.partial(scenarios.fsdp2_distillation, wrap, run.counts, place)
            out = run.scenario(name, dtype, work, functools.partial(judge_fsdp2, wrap), truth.get(name))
            truth.setdefault(name, out)
        work = functools.partial(scenarios.fsdp2_gkd, run.counts, place)
        truth.setdefault("gkd", run.scenario("fsdp2_gkd", dtype, work, judge_fsdp2_gkd, truth.get("gkd")))
        for kind in ("fsdp2_head_unit",) if run.smoke else ("fsdp2_head_unit", "fsdp2_root_unit"):
            work = functools.partial(few_steps, kind, place, {}, run.counts)
            name = f"{kind}_{STEPS}_steps"
            truth.setdefault(name, run.scenario(name, dtype, work, functools.partial(judge_steps, kind),
                                                truth.get(name)))  # fmt: skip
        if not run.smoke:
            work = functools.partial(scenarios.fsdp2_teacher_unit, run.tiny_checkpoints(), run.counts, place)
            out = run.scenario("fsdp2_teacher_unit", dtype, work, judge_teacher_unit, truth.get("unit"))
            truth.setdefault("unit", out)


def part_tp(run: Run) -> None:
    from tests.distributed.tp_workers import transformers_has_distributed_config

    if not transformers_has_distributed_config():
        run.skipped.append("tp: this transformers loads no tp_plan='auto' model")
        return
    paths = run.tiny_checkpoints()
    kinds = {"fp32": ("tp",) if run.smoke else ("tp", "plain"), "bf16": ("tp",)}
    truth: dict = {}
    for dtype, place in run.places.items():
        for kind in kinds[dtype]:
            work = functools.partial(scenarios.tensor_parallel, kind, paths, run.counts, place)
            truth.setdefault(kind, run.scenario(f"tp_{kind}", dtype, work, judge_tp, truth.get(kind)))
        name = f"tp_tp_{STEPS}_steps"
        work = functools.partial(few_steps, "tp", place, paths, run.counts)
        truth.setdefault(
            name, run.scenario(name, dtype, work, functools.partial(judge_steps, "tp"), truth.get(name))
        )
    if not run.smoke:
        work = functools.partial(scenarios.tp_rowwise_student, paths, run.counts, run.places["fp32"])
        run.scenario("tp_rowwise_student", "fp32", work, judge_rowwise)


def part_zero3(run: Run) -> None:
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    truth = None
    for dtype, place in run.places.items():
        if dtype == "bf16" and run.smoke:
            break
        unset_hf_deepspeed_config()  # the models are built whole; deepspeed.initialize partitions them
        work = functools.partial(scenarios.zero3, run.scratch / f"zero3_{dtype}", run.counts, place)
        out = run.scenario("zero3", dtype, work, functools.partial(judge_zero3, dtype == "fp32"), truth)
        truth = truth or out
        free_memory()
