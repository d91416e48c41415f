"""DeepSpeed ZeRO-3 through the HF Trainer, one rank per process (started by
tests/distributed/test_deepspeed.py through launch.py; gloo on CPU, DeepSpeed's CPU accelerator).

    python -m tests.distributed.deepspeed_workers --out DIR {zero3,zero3_init} {patched,unpatched}

One process trains one variant: two SGD steps of a tiny fp32 Llama under ZeRO-3 (every
parameter partitioned, none kept whole), ``num_items_in_batch`` counted across ranks. Batches
are dealt in order, so rank 1's first micro-batch has every label ignored. ``zero3`` builds the
model before the Trainer (DeepSpeed partitions it at ``deepspeed.initialize``); ``zero3_init``
builds it under ``zero.Init`` (transformers does so once ``TrainingArguments(deepspeed=...)``
exists), so the head weight is never whole outside a gathering hook. Rank 0 saves the losses,
the gathered parameters, and per rank: the head weight's partition outside forward, whether
the fused op ran, and the labels each micro-batch had.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from tests.distributed.workers import IGNORE, LR

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
VOCAB = 128


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


def _trainer_class():
    from transformers import Trainer

    class InOrderTrainer(Trainer):
        """Deals batches in order (rank r gets batches r, r + 2, ...), and records each
        micro-batch's count of trained labels on this rank."""

        seen_labels: list[int]

        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, *args, **kwargs):
            self.seen_labels.append(int((inputs["labels"][:, 1:] != IGNORE).sum()))
            return super().compute_loss(model, inputs, *args, **kwargs)

    return InOrderTrainer


def _model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(config)


def train(variant: str, patched: bool, out_dir: Path) -> dict:
    import deepspeed
    from transformers import TrainingArguments

    import liger_patch as lp
    from liger_patch.patching.state import patch_state

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
    trainer = _trainer_class()(model=model, args=args, train_dataset=OrderedRows(), callbacks=callbacks)
    trainer.seen_labels = []
    trainer.train()
    weight = trainer.model_wrapped.module.lm_head.weight
    state = patch_state(trainer.model_wrapped.module)
    with deepspeed.zero.GatheredParameters(list(trainer.model_wrapped.module.parameters())):
        params = {n: p.detach().float().clone() for n, p in trainer.model_wrapped.module.named_parameters()}
    rank_info = {
        "engine": type(trainer.model_wrapped).__name__,
        "head_numel_built": head_numel_built,
        "head_numel_after": weight.numel(),
        "head_ds_status": str(getattr(weight, "ds_status", None)),
        "fused_ran": None if state is None else state.fused_ran,
        "seen_labels": trainer.seen_labels,
    }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rank_info)
    logged = [e for e in trainer.state.log_history if "loss" in e]
    losses = torch.tensor([e["loss"] for e in logged])
    grad_norms = torch.tensor([float(e["grad_norm"]) for e in logged])  # clipping at 1 hides a scale
    return {"losses": losses, "grad_norms": grad_norms, "params": params, "ranks": gathered}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("variant", choices=["zero3", "zero3_init"])
    parser.add_argument("patch", choices=["patched", "unpatched"])
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rank = int(os.environ["RANK"])
    try:
        result = train(args.variant, args.patch == "patched", args.out)
        if rank == 0:
            torch.save(result, args.out / f"{args.variant}_{args.patch}.pt")
        dist.barrier()
        dist.destroy_process_group()  # else a rank can abort at exit ("terminate called ...")
    except BaseException:
        (args.out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
