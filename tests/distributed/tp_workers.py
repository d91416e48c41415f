"""Worker processes for tests/distributed/test_tensor_parallel.py: a vocabulary-sharded lm_head,
patched against unpatched.

Run by :func:`tests.distributed.launch.run_workers` as

    python -m tests.distributed.tp_workers --out DIR SCENARIO [SCENARIO ...]

* ``tp_plan`` / ``tp_plan_tied``: a tiny Llama (V = 1001, split 501/500) loaded by transformers with
  ``tp_plan="auto"`` on every rank (transformers >= 5: ``DistributedConfig``), trained for 3 SGD
  steps on the same batches on every rank (tensor parallelism), once unpatched and once patched.
* ``colwise_head`` / ``colwise_head_bias``: only ``lm_head`` parallelized with torch's own
  ``ColwiseParallel`` (hooks, not transformers' forward), without and with a bias.
* ``rowwise_head``: ``lm_head`` sharded over the hidden dimension (``Shard(1)``), which the fused
  loss cannot take: the patched model warns once and runs the original head; the fused loss
  forced onto that head raises ``ShardedHeadError``.
* ``tp_fsdp2`` (4 ranks): transformers' 2-D mesh, ``DistributedConfig(tp_size=2, fsdp_size=2)``:
  FSDP2 owns ``lm_head`` (with the final norm) and the weight it gathers is still a tensor-parallel
  shard; each data-parallel replica trains on its own batches.

Rank 0 writes ``DIR/<scenario>.pt`` with the losses, what the head looked like, and the full
(gathered) parameters of both runs; the pytest side compares them. fp32 throughout.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.distributed.workers import LR, STEPS, full_params, init_rank, leave_rank, rank_batch

TP_VOCAB = 1001  # odd: the shards differ in size (501 and 500 rows)


def transformers_has_distributed_config() -> bool:
    """Whether this transformers loads tensor-parallel models through ``DistributedConfig(tp_plan=...)``
    (5.x; 4.57 has a ``DistributedConfig`` without ``tp_plan``)."""
    import dataclasses

    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return False
    return dataclasses.is_dataclass(DistributedConfig) and any(
        field.name == "tp_plan" for field in dataclasses.fields(DistributedConfig)
    )


def save_checkpoint(out_dir: Path, device: torch.device, tied: bool) -> Path:
    """Rank 0 saves the tiny Llama (V = TP_VOCAB) every rank then loads, sharded."""
    from tests.patching_helpers import tiny_model

    path = out_dir / f"tiny_llama_v{TP_VOCAB}_tied{int(tied)}"
    if dist.get_rank() == 0 and not path.exists():
        model = tiny_model(
            "llama", seed=0, dtype=torch.float32, tie_word_embeddings=tied, vocab_size=TP_VOCAB
        )
        model.save_pretrained(path)
    dist.barrier()
    return path


def load_tensor_parallel(path: Path, **sizes: int) -> nn.Module:
    """The checkpoint loaded with transformers' own tensor-parallel plan (``tp_plan="auto"``)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(tp_plan="auto", **sizes)
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=config, dtype=torch.float32)
    return model.train()


def head_info(model: nn.Module) -> dict:
    """What the head's weight is inside the patched forward's reach: type, placements, local rows."""
    weight = model.lm_head.weight
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    return {
        "type": type(weight).__name__,
        "placements": [repr(p) for p in getattr(weight, "placements", ())],
        "local_rows": local.shape[0],
        "head_class": type(model.lm_head).__name__,
    }


def record_vocab_parallel_calls() -> list[dict]:
    """Record each call of the vocabulary-parallel op the patched forward makes: this rank's rows,
    their offset and the group size (the op still runs)."""
    from liger_patch.patching import sharded_head

    calls, real = [], sharded_head.vocab_parallel_loss

    def spy(hidden, weight, *args, shard, **kwargs):
        group = dist.get_world_size(shard.group)
        calls.append({"rows": weight.shape[0], "offset": shard.offset, "vocab": shard.vocab, "group": group})
        return real(hidden, weight, *args, shard=shard, **kwargs)

    sharded_head.vocab_parallel_loss = spy
    return calls


def train(model: nn.Module, device: torch.device, batch_of_step, patched: bool) -> dict:
    """STEPS of SGD; losses, whether logits came back, head info, the vocabulary-parallel calls
    and the full parameters."""
    import liger_patch as lp
    from liger_patch.patching import sharded_head

    real = sharded_head.vocab_parallel_loss
    calls = record_vocab_parallel_calls()
    if patched:
        lp.apply_liger_to(model)
    info = head_info(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, logits_none = [], []
    for step in range(STEPS):
        batch = batch_of_step(step)
        count = (batch["labels"][:, 1:] != -100).sum()  # step 1 passes num_items_in_batch
        out = model(**batch, num_items_in_batch=count) if step == 1 else model(**batch)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.detach().float().cpu().reshape(1))
        logits_none.append(out.logits is None)
    sharded_head.vocab_parallel_loss = real
    return {
        "losses": torch.cat(losses),
        "logits_none": logits_none,
        "head": info,
        "vocab_parallel_calls": calls,
        "params": full_params(model),
    }


def tp_plan(device: torch.device, out_dir: Path, tied: bool) -> dict:
    """transformers' ``tp_plan="auto"`` over every rank; the same batch on every rank."""
    path = save_checkpoint(out_dir, device, tied)
    world = dist.get_world_size()
    return {
        patched: train(
            load_tensor_parallel(path, tp_size=world), device, lambda s: rank_batch(s, 0, device), patched
        )
        for patched in (False, True)
    }


def tp_fsdp2(device: torch.device, out_dir: Path) -> dict:
    """transformers' 2-D mesh (fsdp=2, tp=2): the batch of each data-parallel replica."""
    path = save_checkpoint(out_dir, device, tied=False)
    replica = dist.get_rank() // 2  # the mesh is (fsdp, tp) with tp innermost: ranks {0,1} and {2,3}
    return {
        patched: train(
            load_tensor_parallel(path, tp_size=2, fsdp_size=2),
            device,
            lambda s: rank_batch(s, replica, device),
            patched,
        )
        for patched in (False, True)
    }


def torch_parallel_head(device: torch.device, style: str, bias: bool) -> dict:
    """Only ``lm_head`` parallelized with torch's own styles; patched against unpatched."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from tests.distributed.workers import build_model

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    plan = (
        ColwiseParallel(output_layouts=Replicate())
        if style == "colwise"
        else RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    )
    result = {}
    for patched in (False, True):
        model = build_model(device, tied=False)
        if bias:
            torch.manual_seed(1)
            model.lm_head.bias = nn.Parameter(0.5 * torch.randn(model.config.vocab_size, device=device))
        parallelize_module(model.lm_head, mesh, plan)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result[patched] = train(model, device, lambda s: rank_batch(s, 0, device), patched)
        result[patched]["warnings"] = [str(w.message) for w in caught if "liger_patch" in str(w.message)]
    result["forced_error"] = _forced_fused_loss_error(model, device)
    result["forced_dtensor_hidden_error"] = _forced_fused_loss_error(model, device, mesh)
    return result


def _forced_fused_loss_error(model: nn.Module, device: torch.device, mesh=None) -> str:
    """What ``fused_head_loss`` says when forced onto the head (``""``: it computed a loss), with
    the hidden states as a replicated DTensor on ``mesh`` when given."""
    from torch.distributed.tensor import DTensor, Replicate

    from liger_patch.patching.sharded_head import ShardedHeadError, fused_head_loss

    gen = torch.Generator().manual_seed(2)  # the same tokens on every rank
    hidden = torch.randn(5, model.config.hidden_size, generator=gen).to(device).requires_grad_()
    labels = torch.randint(0, model.config.vocab_size, (5,), generator=gen).to(device)
    if mesh is not None:
        hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    try:
        fused_head_loss(model.lm_head, hidden, labels)
    except ShardedHeadError as exc:
        return str(exc)
    return ""


SCENARIOS = {
    "tp_plan": lambda device, out: tp_plan(device, out, tied=False),
    "tp_plan_tied": lambda device, out: tp_plan(device, out, tied=True),
    "tp_fsdp2": tp_fsdp2,
    "colwise_head": lambda device, out: torch_parallel_head(device, "colwise", bias=False),
    "colwise_head_bias": lambda device, out: torch_parallel_head(device, "colwise", bias=True),
    "rowwise_head": lambda device, out: torch_parallel_head(device, "rowwise", bias=False),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("scenarios", nargs="+", choices=sorted(SCENARIOS))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    device = init_rank()
    for name in args.scenarios:  # a failure's traceback goes to the rank's log, which launch.py shows
        result = SCENARIOS[name](device, args.out)
        if dist.get_rank() == 0:
            torch.save(result, args.out / f"{name}.pt")
        dist.barrier()
    leave_rank()
    return 0


if __name__ == "__main__":
    sys.exit(main())
