"""DeepSpeed ZeRO-3 through the HF Trainer and accelerate, one rank per process (started by
tests/distributed/test_deepspeed.py through launch.py; gloo on CPU, DeepSpeed's CPU accelerator).

    python -m tests.distributed.deepspeed_workers --out DIR VARIANT {patched,unpatched}

One process trains one variant: two SGD steps of a tiny fp32 Llama under ZeRO-3 (every
parameter partitioned, none kept whole), ``num_items_in_batch`` counted across ranks. Batches
are dealt in order, so rank 1's first micro-batch has every label ignored. ``zero3`` builds the
model before the Trainer (DeepSpeed partitions it at ``deepspeed.initialize``); ``zero3_init``
builds it under ``zero.Init`` (transformers does so once ``TrainingArguments(deepspeed=...)``
exists), so the head weight is never whole outside a gathering hook; ``accelerate_zero3`` is the
same training as an accelerate loop. Rank 0 saves the losses,
the gathered parameters, and per rank: the head weight's partition outside forward, whether
the fused op ran, and the labels each micro-batch had.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from tests.distributed.workers import IGNORE, LR, leave_rank
from tests.patching_helpers import TINY_CONFIG, VOCAB

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,  # plain SGD, as the other distributed tests
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,  # partition every parameter, even tiny ones
        "stage3_prefetch_bucket_size": 0,
    },
    "bf16": {"enabled": False},
    "fp16": {"enabled": False},
}


class OrderedRows(torch.utils.data.Dataset):
    """Eight rows of 16 ids; rows 2 and 3 (rank 1's first micro-batch) have every label ignored,
    row 5 one half."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (8, 16), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        labels = self.ids[i].clone()
        if i in (2, 3):
            labels[:] = IGNORE
        if i == 5:
            labels[:8] = IGNORE
        return {"input_ids": self.ids[i], "labels": labels}


def in_order_trainer(base: type) -> type:
    """``base`` (transformers' Trainer, TRL's SFTTrainer) dealing batches in order (rank r gets
    batches r, r + 2, ...) and recording each micro-batch's count of trained labels on this rank."""

    class InOrderTrainer(base):
        seen_labels: list[int]

        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, *args, **kwargs):
            self.seen_labels.append(int((inputs["labels"][:, 1:] != IGNORE).sum()))
            return super().compute_loss(model, inputs, *args, **kwargs)

    return InOrderTrainer


def _model():
    """The tests' tiny Llama (tests/patching_helpers.py sizes), untied, built by ``from_config``:
    the call transformers runs under ``zero.Init`` once a ZeRO-3 config is active."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **{**TINY_CONFIG, "tie_word_embeddings": False})
    return AutoModelForCausalLM.from_config(config)


def train(variant: str, patched: bool, out_dir: Path) -> dict:
    import deepspeed
    from transformers import Trainer, TrainingArguments

    import liger_patch as lp

    if variant == "zero3_init":
        deepspeed.init_distributed(dist_backend="gloo")  # zero.Init needs deepspeed.comm first
    else:
        model = _model()  # before TrainingArguments(deepspeed=...): no zero.Init
    args = TrainingArguments(
        output_dir=str(out_dir / f"{variant}_{patched}"),
        per_device_train_batch_size=2,
        max_steps=2,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        average_tokens_across_devices=True,
        deepspeed=DS_CONFIG,
    )
    if variant == "zero3_init":
        model = _model()  # under zero.Init: the arguments above made transformers aware of ZeRO-3
    head_numel_built = model.lm_head.weight.numel()
    callbacks = [lp.LigerPatchCallback()] if patched else []
    trainer_class = in_order_trainer(Trainer)
    trainer = trainer_class(model=model, args=args, train_dataset=OrderedRows(), callbacks=callbacks)
    trainer.seen_labels = []
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    return report(
        trainer.model_wrapped,
        trainer.model_wrapped.module,
        losses=[e["loss"] for e in logged],
        grad_norms=[float(e["grad_norm"]) for e in logged],  # clipping at norm 1 hides a scale
        seen_labels=trainer.seen_labels,
        head_numel_built=head_numel_built,
    )


def report(engine, module, *, losses, grad_norms, seen_labels, head_numel_built) -> dict:
    """What the tests check: losses, every parameter gathered, and per rank the engine, the
    head's partition outside forward, whether the fused op ran and the labels each step had."""
    import deepspeed

    from liger_patch.patching.state import patch_state

    weight, state = module.lm_head.weight, patch_state(module)
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        params = {n: p.detach().float().clone() for n, p in module.named_parameters()}
    rank_info = {
        "engine": type(engine).__name__,
        "head_numel_built": head_numel_built,
        "head_numel_after": weight.numel(),
        "head_ds_status": str(getattr(weight, "ds_status", None)),
        "fused_ran": None if state is None else state.fused_ran,
        "seen_labels": seen_labels,
        # parameters DeepSpeed had to gather because a module read them outside their owner's call
        "external_params": {
            name: sorted(n for n, p in module.named_parameters() if id(p) in m._external_params)
            for name, m in module.named_modules()
            if getattr(m, "_external_params", None)
        },
    }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rank_info)
    return {
        "losses": torch.tensor(losses),
        "grad_norms": None if grad_norms is None else torch.tensor(grad_norms),
        "params": params,
        "ranks": gathered,
    }


def train_with_accelerate(patched: bool) -> dict:
    """The same two steps written as an accelerate loop (``Accelerator`` with a ZeRO-3
    ``DeepSpeedPlugin``), patched before ``prepare``; each rank takes the batches the Trainer
    gives it, and the loss is normalised by the tokens of every rank, as the Trainer does."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    import liger_patch as lp

    config = {**DS_CONFIG, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
    # no clipping: it would hide a gradient off by a factor, and no grad_norm is logged here
    config.update(train_batch_size=2 * int(os.environ["WORLD_SIZE"]), gradient_clipping=0.0)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = _model()
    if patched:
        lp.apply_liger_to(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, optimizer = accelerator.prepare(model, optimizer)
    rows, rank, world = OrderedRows(), dist.get_rank(), dist.get_world_size()
    losses, seen = [], []
    for step in range(2):
        first = 2 * (world * step + rank)  # batches dealt in order, as the Trainer deals them
        batch = [rows[i] for i in (first, first + 1)]
        ids = torch.stack([b["input_ids"] for b in batch])
        labels = torch.stack([b["labels"] for b in batch])
        local = (labels[:, 1:] != IGNORE).sum()
        total = local.clone()
        dist.all_reduce(total)
        seen.append(int(local))
        loss = engine(input_ids=ids, labels=labels, num_items_in_batch=total).loss * world
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        summed = loss.detach() / world
        dist.all_reduce(summed)
        losses.append(float(summed))
    module = accelerator.unwrap_model(engine)
    return report(engine, module, losses=losses, grad_norms=None, seen_labels=seen, head_numel_built=None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("variant", choices=["zero3", "zero3_init", "accelerate_zero3"])
    parser.add_argument("patch", choices=["patched", "unpatched"])
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    patched = args.patch == "patched"
    if args.variant == "accelerate_zero3":
        result = train_with_accelerate(patched)
    else:
        result = train(args.variant, patched, args.out)
    if dist.get_rank() == 0:
        torch.save(result, args.out / f"{args.variant}_{args.patch}.pt")
    leave_rank()
    return 0


if __name__ == "__main__":
    sys.exit(main())
