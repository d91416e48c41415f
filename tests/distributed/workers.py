"""Worker processes for the distributed tests: DDP and FSDP2 training, patched against unpatched.

Run by :func:`tests.distributed.launch.run_workers`, one process per rank, as

    python -m tests.distributed.workers --out DIR SCENARIO [SCENARIO ...]

with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment. Each scenario trains a
tiny Llama (vocab 128, hidden 32, 2 layers, fp32) for a few SGD steps, wrapped the way the
scenario says, once unpatched and once patched, and rank 0 also trains it in one process on the
union of all ranks' batches. Rank 0 writes ``DIR/<scenario>.pt`` with the global losses and the
full (gathered) parameters of every run; the pytest side compares them.

The loss follows the HF Trainer with ``average_tokens_across_devices``: ``num_items_in_batch`` is
the number of target tokens on *all* ranks (an all-reduce), and the rank's loss is multiplied by
the world size before backward, because DDP and FSDP2 average gradients over ranks. Then the
distributed step equals the single-process step on the union of the batches.

GPUs: with one CUDA device per rank the backend is nccl, otherwise gloo on CPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import types
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

STEPS = 3
LR = 0.5
IGNORE = -100


def rank_device(world_size: int) -> tuple[torch.device, str]:
    """cuda:<local rank> with nccl when every rank has a GPU, else cpu with gloo."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        torch.cuda.set_device(local)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")  # fp32 parity at 1e-5 needs IEEE GEMMs
        return torch.device("cuda", local), "nccl"
    return torch.device("cpu"), "gloo"


def init_rank() -> torch.device:
    """Join the process group of this torchrun-style launch (``rank_device``'s backend) and
    return the rank's device."""
    device, backend = rank_device(int(os.environ["WORLD_SIZE"]))
    options = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120), **options)
    return device


def leave_rank() -> None:
    """End this rank once every rank is done and the results are written, skipping the
    interpreter's teardown.

    A rank sometimes aborts in teardown ("terminate called without an active exception", exit
    -6) after all its work succeeded, with or without ``destroy_process_group``: seen in CI
    with DeepSpeed's shm comm op loaded and after the HF Trainer's DDP run. ``os._exit`` after
    the final barrier keeps that race out of the test's verdict.
    """
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def build_model(device: torch.device, tied: bool) -> nn.Module:
    """The same randomly initialised tiny Llama on every rank, fp32."""
    from tests.patching_helpers import tiny_model

    model = tiny_model("llama", seed=0, dtype=torch.float32, tie_word_embeddings=tied)
    return model.to(device)


def rank_batch(step: int, rank: int, device: torch.device, all_ignored: bool = False) -> dict:
    """Rank ``rank``'s batch for ``step`` (every rank can rebuild every other rank's batch)."""
    from tests.patching_helpers import make_batch

    batch = make_batch(seed=100 * step + rank, device=device)
    if all_ignored:
        batch["labels"] = torch.full_like(batch["labels"], IGNORE)
    return batch


def target_count(batch: dict) -> torch.Tensor:
    """Tokens that count after the causal shift (what the Trainer's num_items_in_batch counts)."""
    return (batch["labels"][:, 1:] != IGNORE).sum()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter in full on CPU; DTensor shards are all-gathered (a collective)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():
        tensor = param.full_tensor() if isinstance(param, DTensor) else param
        out[name] = tensor.detach().float().cpu().clone()
    return out


# --------------------------------------------------------------------------------------------
# Wrappings
# --------------------------------------------------------------------------------------------


def wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def wrap_fsdp2_head_unit(model: nn.Module, device: torch.device) -> nn.Module:
    """Each decoder layer, lm_head on its own, then the root: the head weight is a DTensor shard."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model.lm_head)
    fully_shard(model)
    return model


def wrap_fsdp2_root_head(model: nn.Module, device: torch.device) -> nn.Module:
    """Decoder layers, then the root, which holds embeddings and head (the tied-weights layout)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def wrap_accelerate_fsdp2(model: nn.Module, device: torch.device) -> nn.Module:
    """accelerate's own FSDP2 wrapping (``fsdp_version: 2``, transformer-based auto wrap).

    accelerate refuses FSDP on CPU (it keeps MULTI_CPU), so its ``fsdp2_prepare_model`` gets the
    few accelerator attributes it reads from a stand-in. The layout is accelerate's: layers,
    then a tail unit (final norm + lm_head, + embeddings when tied), then the root.
    """
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        reshard_after_forward=True,
    )
    accelerator = types.SimpleNamespace(
        state=types.SimpleNamespace(fsdp_plugin=plugin),
        torch_device_mesh=None,
        parallelism_config=None,
        mixed_precision="no",
        is_main_process=dist.get_rank() == 0,
        device=device,
    )
    return fsdp2_prepare_model(accelerator, model)


# --------------------------------------------------------------------------------------------
# Training runs
# --------------------------------------------------------------------------------------------


def autocast(device: torch.device, amp: bool):
    """The forward's context: ``torch.autocast`` to bf16 for ``amp`` (fp32 parameters, the HF
    Trainer's ``bf16=True``), else nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp)


def train_distributed(
    wrap: Callable[[nn.Module, torch.device], nn.Module],
    device: torch.device,
    tied: bool,
    patched: bool,
    all_ignored_rank: int | None,
    amp: bool = False,
) -> dict:
    """STEPS of SGD under ``wrap`` (forwards under bf16 autocast with ``amp``); global losses,
    what the head looked like, final full parameters."""
    import liger_patch as lp

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(device, tied)
    if patched:
        lp.apply_liger_to(model)
    wrapped = wrap(model, device)
    head_kind = type(model.lm_head.weight).__name__  # DTensor when FSDP2 shards it outside forward
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
    losses, rank_losses, logits_none = [], [], []
    for step in range(STEPS):
        batch = rank_batch(step, rank, device, all_ignored=rank == all_ignored_rank)
        count = target_count(batch)
        dist.all_reduce(count)  # the Trainer's average_tokens_across_devices
        with autocast(device, amp):
            out = wrapped(**batch, num_items_in_batch=count)
        (out.loss * world).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        local = out.loss.detach().float().reshape(1)
        per_rank = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(per_rank, local)
        rank_losses.append(torch.cat(per_rank).cpu())
        losses.append(torch.cat(per_rank).sum().reshape(1).cpu())
        logits_none.append(out.logits is None)
    params = full_params(model)
    return {
        "losses": torch.cat(losses),
        "rank_losses": torch.stack(rank_losses),  # (steps, world)
        "logits_none": logits_none,
        "head_weight_type": head_kind,
        "params": params,
        "finite": all(torch.isfinite(p).all().item() for p in params.values()),
    }


def train_single_process(
    device: torch.device, tied: bool, all_ignored_rank: int | None, world: int, amp: bool = False
) -> dict:
    """The reference: unpatched, one process, every rank's batch concatenated, plain mean."""
    model = build_model(device, tied)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        parts = [rank_batch(step, r, device, all_ignored=r == all_ignored_rank) for r in range(world)]
        batch = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        with autocast(device, amp):
            out = model(**batch)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.detach().float().cpu().reshape(1))
    return {"losses": torch.cat(losses), "params": full_params(model)}


SCENARIOS: dict[str, dict] = {
    "ddp": dict(wrap=wrap_ddp, tied=False, all_ignored_rank=None),
    "ddp_tied": dict(wrap=wrap_ddp, tied=True, all_ignored_rank=None),
    "ddp_all_ignored_rank": dict(wrap=wrap_ddp, tied=False, all_ignored_rank=1),
    "fsdp2_head_unit": dict(wrap=wrap_fsdp2_head_unit, tied=False, all_ignored_rank=None),
    "fsdp2_tied": dict(wrap=wrap_fsdp2_root_head, tied=True, all_ignored_rank=None),
    "fsdp2_all_ignored_rank": dict(wrap=wrap_fsdp2_head_unit, tied=False, all_ignored_rank=1),
    "accelerate_fsdp2": dict(wrap=wrap_accelerate_fsdp2, tied=False, all_ignored_rank=None),
    "accelerate_fsdp2_tied": dict(wrap=wrap_accelerate_fsdp2, tied=True, all_ignored_rank=None),
    # fp32 parameters, forwards under bf16 autocast: the fp32 head weight reaches the op uncast
    "ddp_amp": dict(wrap=wrap_ddp, tied=False, all_ignored_rank=None, amp=True),
    "fsdp2_amp": dict(wrap=wrap_fsdp2_head_unit, tied=False, all_ignored_rank=None, amp=True),
    "fsdp2_tied_amp": dict(wrap=wrap_fsdp2_root_head, tied=True, all_ignored_rank=None, amp=True),
}


class RankDataset(torch.utils.data.Dataset):
    """Eight fixed examples, the same on every rank (the Trainer's sampler splits them)."""

    def __init__(self) -> None:
        batches = [rank_batch(step, 0, torch.device("cpu")) for step in range(4)]
        self.rows = [{k: b[k][i] for k in b} for b in batches for i in range(b["labels"].shape[0])]
        for row in self.rows[1::4]:  # some examples with every label ignored
            row["labels"] = torch.full_like(row["labels"], IGNORE)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def train_with_trainer(device: torch.device, fsdp: bool, patched: bool, out_dir: Path) -> dict:
    """Two optimizer steps of the HF Trainer (DDP, or FSDP2 via ``fsdp_config``), per-rank batch 2."""
    from transformers import Trainer, TrainingArguments

    import liger_patch as lp

    fsdp_args = {}
    if fsdp:
        os.environ["FSDP_VERSION"] = "2"  # transformers 4.57 leaves the version to accelerate's env
        fsdp_args = dict(
            fsdp="full_shard",
            fsdp_config={
                "version": 2,  # transformers 5.x
                "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                "reshard_after_forward": True,
            },
        )
    args = TrainingArguments(
        output_dir=str(out_dir / f"trainer_{'fsdp2' if fsdp else 'ddp'}_{patched}"),
        per_device_train_batch_size=2,
        max_steps=2,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=device.type == "cpu",
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        average_tokens_across_devices=True,
        **fsdp_args,
    )
    model = build_model(device, tied=False)
    callbacks = [lp.LigerPatchCallback()] if patched else []
    trainer = Trainer(model=model, args=args, train_dataset=RankDataset(), callbacks=callbacks)
    trainer.train()
    losses = torch.tensor([e["loss"] for e in trainer.state.log_history if "loss" in e])
    return {
        "losses": losses,
        "params": full_params(trainer.model),
        "sharded": type(model.model.layers[0]).__name__.startswith("FSDP"),
    }


TRAINER_SCENARIOS: dict[str, dict] = {
    "trainer_ddp": dict(fsdp=False),
    "trainer_fsdp2": dict(fsdp=True),  # accelerate refuses FSDP on CPU: GPU only
}


ALL_SCENARIOS = sorted([*SCENARIOS, *TRAINER_SCENARIOS])


def run_scenario(name: str, device: torch.device, out_dir: Path) -> None:
    if name in TRAINER_SCENARIOS:
        fsdp = TRAINER_SCENARIOS[name]["fsdp"]
        result = {
            "unpatched": train_with_trainer(device, fsdp, False, out_dir),
            "patched": train_with_trainer(device, fsdp, True, out_dir),
        }
        if dist.get_rank() == 0:
            torch.save(result, out_dir / f"{name}.pt")
        dist.barrier()
        return
    spec = SCENARIOS[name]
    wrap, tied, ignored, amp = spec["wrap"], spec["tied"], spec["all_ignored_rank"], spec.get("amp", False)
    result = {
        "unpatched": train_distributed(wrap, device, tied, False, ignored, amp),
        "patched": train_distributed(wrap, device, tied, True, ignored, amp),
    }
    if dist.get_rank() == 0:
        result["single"] = train_single_process(device, tied, ignored, dist.get_world_size(), amp)
        torch.save(result, out_dir / f"{name}.pt")
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("scenarios", nargs="+", choices=ALL_SCENARIOS)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    device = init_rank()
    for name in args.scenarios:  # a failure's traceback goes to the rank's log, which launch.py shows
        run_scenario(name, device, args.out)
    leave_rank()
    return 0


if __name__ == "__main__":
    sys.exit(main())
