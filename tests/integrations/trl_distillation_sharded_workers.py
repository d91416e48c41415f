"""TRL's distillation trainers with sharded heads, one rank per process (started by
tests/integrations/test_trl_distillation_sharded.py through tests/distributed/launch.py; gloo on CPU).

    python -m tests.integrations.trl_distillation_sharded_workers --out DIR {torch,zero3}

``torch`` (FSDP2 and tensor parallelism; accelerate runs neither on a CPU, so TRL's own
``compute_loss`` runs on a stand-in trainer holding what it reads: the models, a stand-in
accelerator, ``beta``, ``temperature``):

* ``fsdp2_<wrap>``: ``DistillationTrainer.compute_loss`` on each rank's batch, the student wrapped
  by FSDP2 as :data:`FSDP2_WRAPS` says, the teacher a plain module (accelerate's
  ``prepare_model(evaluation_mode=True)`` leaves it so); one forward and backward patched, one
  unpatched (TRL's own path), and the reference: TRL's path on an unsharded student, each rank's
  batch in turn, gradients averaged as FSDP2 averages them;
* ``fsdp2_gkd``: ``GKDTrainer.compute_loss`` likewise, ``lm_head`` its own unit;
* ``fsdp2_teacher_unit``: ``distill_on_heads`` with the teacher's head an FSDP2 unit and the
  student's one too, reduction "mean" (the op keeps nothing of the teacher: its unit must not
  gather it for the backward) and "none" (it recomputes from the teacher's gathered weight: its
  unit must gather it again), or the student tensor-parallel (the vocabulary-parallel op recomputes
  from the teacher's rows, cut from its gathered weight);
* ``tp_<teacher>``: both trainers' ``compute_loss`` with a student loaded by transformers with
  ``tp_plan="auto"`` (``lm_head`` a ``Shard(0)`` DTensor, V = 1001 split 501/500), the teacher
  loaded the same way or plain, the same batch on both ranks; reference: the unsharded models;
* ``tp_rowwise_student``: a student ``lm_head`` sharded over the hidden dimension, which the hook
  leaves to TRL's own path (saying why).

``zero3``: ``DistillationTrainer`` and ``GKDTrainer`` themselves under DeepSpeed ZeRO-3 (every
parameter partitioned, the teacher through TRL's ``prepare_deepspeed``), two SGD steps, with
``LigerPatchCallback`` and without; and ``distill_on_heads`` with a ZeRO-3 teacher engine's head,
reduction "mean" and "none" (which recomputes from the teacher's head in the backward).

The ranks run on the CPU over gloo on any machine (GPUs hidden). Rank 0 saves
``DIR/<launch>.pt``: per scenario and rank, the losses, metrics, gradients or parameters
(gathered whole), and what ran (the fused op, the vocabulary-parallel op, TRL's kernel, the
student's ``lm_head`` call, the patch's bypass reason).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import os
import sys
import types
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tests.distributed.tp_workers import transformers_has_distributed_config
from tests.distributed.workers import leave_rank, wrap_accelerate_fsdp2

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

V = 1001  # odd: the tensor-parallel shards differ in size
BETA, TEMPERATURE = 0.5, 2.0
FSDP2_WRAPS = {
    "head_unit": 0.5,  # lm_head its own unit, resharded after its call: a DTensor at TRL's hook
    "tail_unit": 1.0,  # accelerate's: final norm + lm_head, gathered by the norm's call, plain at the hook
    "root_unit": 0.0,  # lm_head in the root unit: plain inside the root's forward
}
"""How the student is wrapped, and the beta it is trained with."""


@dataclass(frozen=True)
class Place:
    """Where and how the scenarios run: by default the tests' CPU ranks, fp32, the op's PyTorch
    backend, V = 1001. ``benchmarks/distill_dist_gpu.py`` runs them on GPUs over NCCL, with the
    default backend, in fp32 and bf16, and a vocabulary the tensor-parallel size divides
    (transformers 5.17 refuses any other)."""

    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    backend: str = "torch"
    vocab: int = V


CPU = Place()


def sharpened(model):
    """``model`` with its head scaled so that its logits spread as a trained model's."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(10.0)
    return model


def models(hidden: int = 64, seed: int = 1, place: Place = CPU):
    from tiny_trl import tiny_model

    model = sharpened(tiny_model(vocab_size=place.vocab, seed=seed, hidden_size=hidden))
    return model.to(place.device, place.dtype)


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


class Counts:
    """Calls of the fused op, the vocabulary-parallel op and TRL's divergence kernel, by wrapping
    them where the code looks them up (the ops: in ``distill_heads``, the hooks' one caller)."""

    def __init__(self) -> None:
        from trl.trainer import distillation_trainer

        from liger_patch.integrations import distill_heads

        self.calls = dict.fromkeys(("fused", "vocab_parallel", "trl"), 0)
        found = {
            "fused": (distill_heads, "fused_linear_distillation"),
            "vocab_parallel": (distill_heads, "vocab_parallel_distillation"),
        }
        for key, (home, name) in found.items():
            setattr(home, name, self._counted(key, getattr(home, name)))
        # TRL 1.16 imports the kernel into the trainer's module; 1.15 looks it up in its kernels
        # module at each call: count it where this version looks it up.
        home = distillation_trainer
        if not hasattr(home, "ChunkedDivergenceFunction"):
            home = importlib.import_module("trl.kernels.chunked_divergence")
        kernel = home.ChunkedDivergenceFunction
        home.ChunkedDivergenceFunction = types.SimpleNamespace(apply=self._counted("trl", kernel.apply))

    def _counted(self, key: str, fn):
        def counted(*args, **kwargs):
            self.calls[key] += 1
            return fn(*args, **kwargs)

        return counted

    def take(self) -> dict[str, int]:
        taken, self.calls = self.calls, dict.fromkeys(self.calls, 0)
        return taken


# ------------------------------------------------------------------ stand-in trainers


def distillation_trainer(student, teacher, beta: float, data_parallel: int):
    """A ``DistillationTrainer`` holding what its ``compute_loss`` reads (``__init__`` not run)."""
    from trl.models.utils import _ForwardRedirection
    from trl.trainer.distillation_trainer import DistillationTrainer

    trainer = DistillationTrainer.__new__(DistillationTrainer)
    trainer.model, trainer.teacher_model = student, teacher
    trainer.accelerator = types.SimpleNamespace(
        unwrap_model=lambda m: m,
        num_processes=data_parallel,
        is_main_process=True,
        gather_for_metrics=lambda t: t,
    )
    trainer._forward_redirection = _ForwardRedirection()
    trainer.beta, trainer.temperature = beta, TEMPERATURE
    trainer.model_kwarg_keys = inspect.signature(student.forward).parameters.keys()
    trainer._is_vlm = False
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    return trainer


def gkd_trainer(student, teacher, beta: float):
    """A ``GKDTrainer`` holding what its ``compute_loss`` reads (``__init__`` not run)."""
    from trl.experimental.gkd import GKDTrainer

    trainer = GKDTrainer.__new__(GKDTrainer)
    trainer.model, trainer.teacher_model, trainer.beta = student, teacher, beta
    trainer.accelerator = types.SimpleNamespace(unwrap_model=lambda m: m)
    return trainer


def distillation_batch(seed: int, n_total: float, place: Place = CPU) -> dict:
    """Prompt and completion ids as ``DistillationTrainer._generate_and_score_completions`` leaves
    them; completion positions masked at the ends of some rows; ``num_items_in_batch`` counted on
    every rank."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, place.vocab, (2, 5), generator=g)
    completion = torch.randint(3, place.vocab, (2, 7), generator=g)
    mask = torch.ones_like(completion)
    mask[0, 5:] = 0
    mask[1, 4:] = seed % 2
    batch = dict(
        prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), completion_ids=completion,
        completion_mask=mask, num_items_in_batch=torch.tensor(n_total),
    )  # fmt: skip
    return {k: t.to(place.device) for k, t in batch.items()}


def gkd_batch(seed: int, place: Place = CPU) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, place.vocab, (2, 9), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100
    labels[1, 7:] = -100
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
    return {k: t.to(place.device) for k, t in batch.items()}


def _distillation_step(trainer, student, batch: dict, counts: Counts) -> dict:
    """One ``compute_loss`` and backward: loss, TRL's logged entropy, gradients, what ran."""
    head_calls = []
    hook = student.get_output_embeddings().register_forward_pre_hook(lambda *_: head_calls.append(1))
    loss = trainer.compute_loss(student, batch)
    loss.backward()
    hook.remove()
    return {
        "loss": loss.detach(),
        "entropy": trainer._metrics["train"]["entropy"][-1],
        "grads": grads_of(student),
        "ran": counts.take(),
        "head_calls": len(head_calls),
        "bypass": _bypass(student),
    }


def _gkd_step(trainer, student, batch: dict, counts: Counts) -> dict:
    n = (batch["labels"][:, 1:] != -100).sum().float()
    head_calls = []
    hook = student.get_output_embeddings().register_forward_pre_hook(lambda *_: head_calls.append(1))
    loss = trainer.compute_loss(student, batch, num_items_in_batch=n)
    loss.backward()
    hook.remove()
    ran = counts.take()
    return {"loss": loss.detach(), "grads": grads_of(student), "ran": ran, "head_calls": len(head_calls),
            "bypass": _bypass(student)}  # fmt: skip


def _bypass(model) -> str | None:
    from liger_patch.patching.state import patch_state

    state = patch_state(model)
    return None if state is None else state.bypass_reason


# ------------------------------------------------------------------ FSDP2


def wrap_fsdp2(model, wrap: str, place: Place = CPU):
    from torch.distributed.fsdp import fully_shard

    if wrap == "tail_unit":
        return wrap_accelerate_fsdp2(model, torch.device(place.device))
    for layer in model.model.layers:
        fully_shard(layer)
    if wrap == "head_unit":
        fully_shard(model.lm_head)
    fully_shard(model)
    return model


def fsdp2_distillation(wrap: str, counts: Counts, place: Place = CPU) -> dict:
    import liger_patch as lp

    rank, world = dist.get_rank(), dist.get_world_size()
    beta = FSDP2_WRAPS[wrap]
    batches = [distillation_batch(10 + r, 0.0, place) for r in range(world)]
    n_total = float(sum(int(b["completion_mask"].sum()) for b in batches))
    for b in batches:
        b["num_items_in_batch"] = torch.tensor(n_total, device=place.device)
    out = {}
    for patched in (False, True):
        student, teacher = models(place=place), models(96, seed=2, place=place)
        if patched:
            lp.apply_liger_to(student, backend=place.backend)
        wrap_fsdp2(student, wrap, place).train()
        trainer = distillation_trainer(student, teacher, beta, world)
        out["patched" if patched else "unpatched"] = _distillation_step(
            trainer, student, batches[rank], counts
        )
    student, teacher = models(place=place), models(96, seed=2, place=place)
    trainer = distillation_trainer(student.train(), teacher, beta, world)
    losses = [trainer.compute_loss(student, b) for b in batches]  # TRL's path, unsharded
    torch.stack(losses).mean().backward()  # FSDP2 averages the ranks' gradients
    out["reference"] = {"loss": losses[rank].detach(), "grads": grads_of(student), "ran": counts.take()}
    return out


def fsdp2_gkd(counts: Counts, place: Place = CPU) -> dict:
    import liger_patch as lp

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for patched in (False, True):
        student, teacher = models(place=place), models(96, seed=2, place=place)
        if patched:
            lp.apply_liger_to(student, backend=place.backend)
        wrap_fsdp2(student, "head_unit", place).train()
        out["patched" if patched else "unpatched"] = _gkd_step(
            gkd_trainer(student, teacher, BETA), student, gkd_batch(20 + rank, place), counts
        )
    student, teacher = models(place=place), models(96, seed=2, place=place)
    trainer = gkd_trainer(student.train(), teacher, BETA)
    batches = [gkd_batch(20 + r, place) for r in range(world)]
    counted = [(b, (b["labels"][:, 1:] != -100).sum().float()) for b in batches]
    losses = [trainer.compute_loss(student, b, num_items_in_batch=n) for b, n in counted]
    torch.stack(losses).mean().backward()
    out["reference"] = {"loss": losses[rank].detach(), "grads": grads_of(student), "ran": counts.take()}
    return out


def count_unshards(unit) -> list[bool]:
    """Each all-gather of an FSDP2 unit from now on, as whether grad mode was on (forward) or off."""
    group = unit._get_fsdp_state()._fsdp_param_group
    gathers, unshard = [], group.unshard

    def counted(*args, **kwargs):
        gathers.append(torch.is_grad_enabled())
        return unshard(*args, **kwargs)

    group.unshard = counted
    return gathers


TEACHER_UNIT_RUNS = {"mean": ("mean", False), "none": ("none", False), "tp_student": ("mean", True)}
"""``fsdp2_teacher_unit``'s runs: the reduction, and whether the student is tensor-parallel (the
vocabulary-parallel op, whose backward recomputes from the teacher's rows)."""


def fsdp2_teacher_unit(paths: dict, counts: Counts, place: Place = CPU) -> dict:
    """``distill_on_heads`` with the teacher's head an FSDP2 unit (its all-gathers counted), the
    student's an FSDP2 unit too or tensor-parallel."""
    from torch.distributed.fsdp import fully_shard

    from liger_patch.integrations.distill_heads import DistillSide, distill_on_heads
    from liger_patch.ops.distillation.functional import fused_linear_distillation

    g = torch.Generator().manual_seed(30)  # the same on both ranks: FSDP2's averaged gradient is each one's
    hs, ht = torch.randn(2, 6, 64, generator=g), torch.randn(2, 6, 96, generator=g)
    labels = torch.where(torch.rand(2, 6, generator=g) > 0.3, 0, -100)
    upstream = {"mean": torch.tensor(1.0), "none": torch.rand(2, 6, generator=g)}
    hs, ht = hs.to(place.device, place.dtype), ht.to(place.device, place.dtype)
    labels, upstream = labels.to(place.device), {k: u.to(place.device) for k, u in upstream.items()}
    out = {}
    for run, (reduction, tp_student) in TEACHER_UNIT_RUNS.items():
        if tp_student and not transformers_has_distributed_config():
            continue  # transformers 4.57 loads no tp_plan="auto" model
        student, teacher = load(paths["student"], tp_student, place), models(96, seed=2, place=place)
        whole = {"s": full(student.lm_head.weight), "t": full(teacher.lm_head.weight)}
        for head in (teacher.lm_head,) if tp_student else (student.lm_head, teacher.lm_head):
            fully_shard(head, reshard_after_forward=True)  # (a root unit keeps its weight gathered)
        gathers = count_unshards(teacher.lm_head)
        h = hs.clone().requires_grad_()
        options = dict(
            beta=BETA, temperature=TEMPERATURE, reduction=reduction, backend=place.backend, memory_budget=None
        )
        loss, _ = distill_on_heads(
            DistillSide(h, student.lm_head), DistillSide(ht, teacher.lm_head), labels, **options
        )
        (loss * upstream[reduction]).sum().backward()
        ran = counts.take()
        h_ref, w_ref = hs.clone().requires_grad_(), whole["s"].clone().requires_grad_()
        ref = fused_linear_distillation(h_ref, w_ref, ht, whole["t"], labels, **options)
        (ref * upstream[reduction]).sum().backward()
        out[run] = {
            "loss": loss.detach(), "ref_loss": ref.detach(), "grad_h": h.grad, "ref_grad_h": h_ref.grad,
            "grad_w": full(student.lm_head.weight.grad), "ref_grad_w": w_ref.grad,
            "teacher_gathers": gathers, "ran": ran,
        }  # fmt: skip
    return out


# ------------------------------------------------------------------ tensor parallelism


def checkpoints(out_dir: Path, place: Place = CPU) -> dict[str, Path]:
    """The student and the teacher saved (fp32, on the CPU) for every rank to load."""
    paths = {"student": out_dir / "student", "teacher": out_dir / "teacher"}
    cpu = Place(vocab=place.vocab)
    if dist.get_rank() == 0:
        models(place=cpu).save_pretrained(paths["student"])
        models(96, seed=2, place=cpu).save_pretrained(paths["teacher"])
    dist.barrier()
    return paths


def load(path: Path, tensor_parallel: bool, place: Place = CPU):
    """A checkpoint in ``place``'s dtype, whole on its device or with ``tp_plan="auto"`` (which
    puts it on this rank's device)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    kwargs = {"distributed_config": DistributedConfig(tp_plan="auto")} if tensor_parallel else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=place.dtype, **kwargs)
    return (model if tensor_parallel else model.to(place.device)).train()


def tensor_parallel(teacher_kind: str, paths: dict, counts: Counts, place: Place = CPU) -> dict:
    """Both trainers with a tensor-parallel student; the teacher ``tp`` (frozen, as TRL's own path
    needs: its backward through a DTensor teacher weight's all-gather fails) or ``plain``."""
    import liger_patch as lp

    out = {}
    for run in ("reference", "unpatched", "patched"):
        sharded = run != "reference"
        results = {}
        for trainer_name in ("distillation", "gkd"):
            student = load(paths["student"], sharded, place)
            teacher = load(paths["teacher"], sharded and teacher_kind == "tp", place).requires_grad_(False)
            if run == "patched":
                lp.apply_liger_to(student, backend=place.backend)
            if trainer_name == "distillation":
                batch = distillation_batch(40, 0.0, place)
                batch["num_items_in_batch"] = batch["completion_mask"].sum().float()
                results[trainer_name] = _distillation_step(
                    distillation_trainer(student, teacher, BETA, 1), student, batch, counts
                )
            else:
                results[trainer_name] = _gkd_step(
                    gkd_trainer(student, teacher, BETA), student, gkd_batch(41, place), counts
                )
        out[run] = results
    return out


def tp_rowwise_student(paths: dict, counts: Counts, place: Place = CPU) -> dict:
    """A student ``lm_head`` sharded over the hidden dimension (torch's ``RowwiseParallel``):
    ``DistillationTrainer``'s own path, patched (which falls back, saying why) and unpatched."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    import liger_patch as lp

    mesh = init_device_mesh(torch.device(place.device).type, (dist.get_world_size(),))
    out = {}
    for patched in (False, True):
        student = load(paths["student"], False, place)
        teacher = load(paths["teacher"], False, place).requires_grad_(False)
        if patched:
            # before the head is sharded, as a patch finds it
            lp.apply_liger_to(student, backend=place.backend)
        parallelize_module(student.lm_head, mesh, RowwiseParallel(input_layouts=Replicate()))
        batch = distillation_batch(60, 0.0, place)
        batch["num_items_in_batch"] = batch["completion_mask"].sum().float()
        trainer = distillation_trainer(student, teacher, BETA, 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = _distillation_step(trainer, student, batch, counts)
        step["warnings"] = [str(w.message) for w in caught if "liger_patch" in str(w.message)]
        out["patched" if patched else "unpatched"] = step
    return out


# ------------------------------------------------------------------ DeepSpeed ZeRO-3


def zero3_train(
    trainer_name: str, student, teacher, patched: bool, out_dir: Path, counts: Counts, place: Place = CPU
) -> dict:
    import deepspeed
    import trl
    from tiny_trl import arithmetic_chats, arithmetic_prompts, tiny_tokenizer
    from trl.experimental import gkd

    import liger_patch as lp
    from tests.distributed.deepspeed_workers import DS_CONFIG

    bf16 = place.dtype == torch.bfloat16
    common = dict(
        output_dir=str(out_dir / f"{trainer_name}_{patched}"), per_device_train_batch_size=2, max_steps=2,
        logging_steps=1, optim="sgd", learning_rate=0.05, lr_scheduler_type="constant", save_strategy="no",
        report_to=[], seed=0, data_seed=0, use_cpu=place.device == "cpu", bf16=bf16, disable_tqdm=True,
        deepspeed=dict(DS_CONFIG, bf16={"enabled": bf16}), beta=BETA,
    )  # fmt: skip
    callbacks = [lp.LigerPatchCallback(backend=place.backend)] if patched else []
    if trainer_name == "distillation":
        config = trl.DistillationConfig(**common, temperature=TEMPERATURE, max_completion_length=6)
        trainer = trl.DistillationTrainer(
            model=student, teacher_model=teacher, args=config, train_dataset=arithmetic_prompts(16),
            processing_class=tiny_tokenizer(), callbacks=callbacks,
        )  # fmt: skip
    else:
        trainer = gkd.GKDTrainer(
            model=student, teacher_model=teacher, args=gkd.GKDConfig(**common, lmbda=0.0),
            train_dataset=arithmetic_chats(16), processing_class=tiny_tokenizer(), callbacks=callbacks,
        )  # fmt: skip
    trainer.train()
    module = trainer.model_wrapped.module
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        params = {n: p.detach().clone() for n, p in module.named_parameters()}
    keys = ("loss", "grad_norm", "entropy") if trainer_name == "distillation" else ("loss", "grad_norm")
    return {
        "logged": {
            k: torch.tensor([float(e[k]) for e in trainer.state.log_history if "loss" in e]) for k in keys
        },
        "params": params,
        "ran": counts.take(),
        "bypass": _bypass(module),
        "head_numel_after": {
            "student": module.get_output_embeddings().weight.numel(),
            "teacher": trainer.teacher_model.module.get_output_embeddings().weight.numel(),
        },
    }


def zero3_teacher_engine(student, teacher, counts: Counts, place: Place = CPU) -> dict:
    """``distill_on_heads`` with a whole student head and the head of a ZeRO-3 teacher engine (as
    TRL's ``prepare_deepspeed`` makes it), reduction "mean" and "none"; the teacher's head after."""
    import deepspeed

    from liger_patch.integrations.distill_heads import DistillSide, distill_on_heads
    from liger_patch.ops.distillation.functional import fused_linear_distillation

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": place.dtype == torch.bfloat16},
    }
    engine, *_ = deepspeed.initialize(model=teacher, config=config)
    head = engine.module.get_output_embeddings()
    with deepspeed.zero.GatheredParameters([head.weight]):
        teacher_weight = head.weight.detach().clone()
    g = torch.Generator().manual_seed(50)
    hs, ht, sw = (
        torch.randn(2, 6, 64, generator=g).to(place.device, place.dtype),
        torch.randn(2, 6, 96, generator=g).to(place.device, place.dtype),
        student.lm_head.weight,
    )
    labels = torch.where(torch.rand(2, 6, generator=g) > 0.3, 0, -100).to(place.device)
    out = {}
    for reduction in ("mean", "none"):
        options = dict(
            beta=BETA, temperature=TEMPERATURE, reduction=reduction, backend=place.backend, memory_budget=None
        )
        leaves = [t.detach().clone().requires_grad_() for t in (hs, sw)]
        loss, _ = distill_on_heads(
            DistillSide(leaves[0], weight=leaves[1]), DistillSide(ht, head), labels, **options
        )
        loss.sum().backward()
        numel_after, ran = head.weight.numel(), counts.take()
        ref_leaves = [t.detach().clone().requires_grad_() for t in (hs, sw)]
        ref = fused_linear_distillation(ref_leaves[0], ref_leaves[1], ht, teacher_weight, labels, **options)
        ref.sum().backward()
        out[reduction] = {
            "loss": loss.detach(), "ref_loss": ref.detach(), "grads": [t.grad for t in leaves],
            "ref_grads": [t.grad for t in ref_leaves], "teacher_numel_after": numel_after, "ran": ran,
        }  # fmt: skip
    return out


def zero3(out_dir: Path, counts: Counts, place: Place = CPU) -> dict:
    runs = [(name, patched) for name in ("distillation", "gkd") for patched in (False, True)]
    built = {run: (models(place=place), models(96, seed=2, place=place)) for run in runs}
    engine_models = models(place=place), models(96, seed=2, place=place)  # before any ZeRO-3 config exists
    out = defaultdict(dict)
    for name, patched in runs:
        result = zero3_train(name, *built[(name, patched)], patched, out_dir, counts, place)
        out[name]["patched" if patched else "unpatched"] = result
    out["teacher_engine"] = zero3_teacher_engine(*engine_models, counts, place)
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("launch", choices=("torch", "zero3"))
    args = parser.parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks on any machine (nothing touched CUDA yet)
    warnings.filterwarnings("ignore")
    import trl.experimental.gkd  # noqa: F401  (the hooks install on the TRL modules imported)
    import trl.trainer.distillation_trainer  # noqa: F401

    from liger_patch.integrations import trl_distillation, trl_gkd

    assert trl_distillation.install() and trl_gkd.install()
    if args.launch == "zero3":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    counts = Counts()
    if args.launch == "torch":
        paths = checkpoints(args.out)
        results = {f"fsdp2_{wrap}": fsdp2_distillation(wrap, counts) for wrap in FSDP2_WRAPS}
        results["fsdp2_gkd"] = fsdp2_gkd(counts)
        results["fsdp2_teacher_unit"] = fsdp2_teacher_unit(paths, counts)
        if transformers_has_distributed_config():  # transformers 5: tp_plan="auto" loading
            results |= {f"tp_{kind}": tensor_parallel(kind, paths, counts) for kind in ("tp", "plain")}
        results["tp_rowwise_student"] = tp_rowwise_student(paths, counts)
    else:
        results = zero3(args.out, counts)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, results)
    if dist.get_rank() == 0:
        torch.save(every, args.out / f"{args.launch}.pt")
    leave_rank()
    return 0


if __name__ == "__main__":
    sys.exit(main())
