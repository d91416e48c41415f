"""TRL's ``SFTTrainer`` under DeepSpeed ZeRO-3, one rank per process (started by
tests/distributed/test_trl_zero3.py through launch.py; gloo on CPU, DeepSpeed's CPU accelerator).

    python -m tests.distributed.trl_zero3_workers --out DIR

One launch trains every run of :data:`RUNS` in turn: two SGD steps of a tiny fp32 Llama with
every parameter partitioned (the ZeRO-3 config of deepspeed_workers.py), unpatched (TRL's own
log-prob kernel) and patched (``LigerPatchCallback``: the fused op behind TRL's fused head). The
heads (:data:`HEADS`):

* ``untied`` and ``tied`` (to the embeddings): as users train them. DeepSpeed's engine gathers
  a partitioned parameter that the forward reads by attribute (``lm_head.weight``) itself, and
  fetches it again for the model's backward, so TRL's ``maybe_gather_lm_head_ctx`` finds it
  gathered there;
* ``frozen_left_to_trl``: an untied head that does not train, kept from that discovery (see
  :class:`LeaveHeadToTRL`), so it is an empty partition when TRL's kernel is called and again
  in its backward: TRL's helper gathers it both times, around TRL's kernel or around the fused
  op's forward and backward. (A trainable head cannot run so, with TRL's kernel or ours: its
  gradient reaches the parameter after the helper has partitioned it again, and PyTorch
  refuses to accumulate a full gradient into the empty partition.)

Every model is built before the first ``SFTConfig(deepspeed=...)`` exists, so none is built
under ``zero.Init`` and both runs of a head start from the same weights. Batches are dealt in
order, so rank 1's first micro-batch has every label ignored.

Per run and rank it records how often the fused op and TRL's kernel computed the log-probs,
every entry into TRL's gathering helper (forward or backward, and the head's size before and
inside), the labels of each micro-batch and the head's partition after training. Rank 0 saves
``DIR/trl_zero3.pt``: per run the logged values, every parameter (gathered) and the ranks' records.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from tests.distributed.deepspeed_workers import DS_CONFIG, in_order_trainer
from tests.distributed.workers import IGNORE, LR, leave_rank
from tests.patching_helpers import TINY_CONFIG, VOCAB

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

HEADS = ("untied", "tied", "frozen_left_to_trl")
RUNS = [f"{head}_{patch}" for head in HEADS for patch in ("unpatched", "patched")]
METRICS = ("loss", "grad_norm", "mean_token_accuracy", "entropy")


def rows():
    """Eight rows of 16 ids as TRL takes a tokenized dataset; rows 2 and 3 (rank 1's first
    micro-batch) have every label ignored, row 5 one half."""
    from datasets import Dataset

    ids = torch.randint(3, VOCAB, (8, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[2:4] = IGNORE
    labels[5, :8] = IGNORE
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def build_model(head: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    # no router settings: SFTTrainer asks a config that has them for an MoE aux loss
    sizes = {k: v for k, v in TINY_CONFIG.items() if not k.startswith(("output_router", "router_"))}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("llama", **sizes, tie_word_embeddings=head == "tied")
    )
    if head == "frozen_left_to_trl":
        model.lm_head.weight.requires_grad_(False)
    return model


class Records:
    """What one run did on this rank: the fused op's calls, TRL's kernel's calls, and every
    entry into TRL's gathering helper as ``(phase, head numel before, head numel inside)``."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.op_calls, self.trl_calls, self.gathers = 0, 0, []

    def install(self) -> None:
        """Count through TRL's module and our integration: the fused op's entry, TRL's kernel
        behind our hook, and the helper that TRL's call site, TRL's backward and ours look up."""
        import trl.trainer.utils as trl_utils

        from liger_patch.integrations import trl as trl_head

        assert trl_head.install(), "this TRL has no fused LM head kernel"
        fields, kernel, gather = (
            trl_head.fused_log_prob_fields,
            trl_utils._ChunkedLogProbFunction.original,
            trl_utils.maybe_gather_lm_head_ctx,
        )

        def counted_fields(*args, **kwargs):
            self.op_calls += 1
            return fields(*args, **kwargs)

        class CountedKernel:
            @staticmethod
            def apply(*args):
                self.trl_calls += 1
                return kernel.apply(*args)

        @contextlib.contextmanager
        def recorded_gather(weight, bias=None):
            phase, before = "forward" if torch.is_grad_enabled() else "backward", weight.numel()
            with gather(weight, bias):
                self.gathers.append((phase, before, weight.numel()))
                yield

        trl_head.fused_log_prob_fields = counted_fields
        trl_utils._ChunkedLogProbFunction.original = CountedKernel
        trl_utils.maybe_gather_lm_head_ctx = recorded_gather


def callbacks(head: str, patched: bool) -> list:
    from transformers import TrainerCallback

    import liger_patch as lp

    class LeaveHeadToTRL(TrainerCallback):
        """Keeps DeepSpeed from gathering the head by itself. Its engine's forward prologue (a
        forward pre-hook of the model) marks every module as in forward, which makes reading a
        partitioned parameter by attribute gather it and register it with the running module;
        a pre-hook added after the engine's takes the head's mark off again."""

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            head_params = model.get_output_embeddings()._parameters
            model.register_forward_pre_hook(lambda *_: setattr(head_params, "_in_forward", False))

    found = [lp.LigerPatchCallback(backend="torch")] if patched else []
    return found + ([LeaveHeadToTRL()] if head == "frozen_left_to_trl" else [])


def train(model, run: str, out_dir: Path, records: Records) -> dict:
    from tiny_trl import tiny_tokenizer
    from trl import SFTConfig, SFTTrainer

    head, patch = run.rsplit("_", 1)
    args = SFTConfig(
        output_dir=str(out_dir / run),
        per_device_train_batch_size=2,
        max_steps=2,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        average_tokens_across_devices=True,
        dataset_kwargs={"skip_prepare_dataset": True},
        deepspeed=DS_CONFIG,
    )
    trainer = in_order_trainer(SFTTrainer)(
        model=model,
        args=args,
        train_dataset=rows(),
        processing_class=tiny_tokenizer(),
        callbacks=callbacks(head, patch == "patched"),
    )
    trainer.seen_labels = []
    records.reset()
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    return report(trainer.model_wrapped.module, logged, trainer.seen_labels, records)


def report(module, logged: list[dict], seen_labels: list[int], records: Records) -> dict:
    import deepspeed

    weight = module.lm_head.weight
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        params = {n: p.detach().float().clone() for n, p in module.named_parameters()}
    rank_info = {
        "op_calls": records.op_calls,
        "trl_calls": records.trl_calls,
        "gathers": records.gathers,
        "seen_labels": seen_labels,
        "head_numel_after": weight.numel(),
        "tied": weight is module.get_input_embeddings().weight,
    }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rank_info)
    return {
        "logged": {key: torch.tensor([float(e[key]) for e in logged]) for key in METRICS},
        "params": params,
        "ranks": gathered,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    models = {run: build_model(run.rsplit("_", 1)[0]) for run in RUNS}  # before any ZeRO-3 config
    records = Records()
    records.install()
    results = {run: train(models[run], run, args.out, records) for run in RUNS}
    if dist.get_rank() == 0:
        torch.save(results, args.out / "trl_zero3.pt")
    leave_rank()
    return 0


if __name__ == "__main__":
    sys.exit(main())
