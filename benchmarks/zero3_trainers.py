"""The two trainers ``zero3_gpu.py`` drives (``--trainer``): transformers' ``Trainer`` on the rows
as they are, or TRL's ``SFTTrainer`` on the same rows pre-tokenized, both dealing the batches in
order; and the records that check a run walked the batches it planned and ran the fused op.

Under ``SFTTrainer`` the loss never goes through the model's patched forward: TRL's fused LM head
calls its log-prob kernel, which liger_patch's TRL integration answers with the fused op. So the
op's calls are counted at ``operator.FLCE`` (the registered operator or its eager twin), where
both paths meet.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # tiny_trl: a tokenizer

IGNORE = -100
TRAINERS = ("trainer", "sft")
# Whatever SFTTrainer would change in the rows or their order, off: no truncation (and so no
# dropping of all-ignored rows: TRL drops them whenever max_length is set), no packing, no
# padding-free batches, no shuffling; the labels come from the completion mask. Gradient
# checkpointing (on by SFTConfig's default) off, as the Trainer rows run.
SFT_SETTINGS = dict(
    max_length=None,
    completion_only_loss=True,
    packing=False,
    padding_free=False,
    shuffle_dataset=False,
    gradient_checkpointing=False,
)


def training_arguments(trainer: str, cuda: bool, batch: int, steps: int, ds_config: dict):
    """The same arguments for either trainer: learning rate 0, a log entry every step, bf16 on GPU."""
    common = dict(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch, max_steps=steps,
        bf16=cuda, use_cpu=not cuda, deepspeed=ds_config, logging_steps=1, save_strategy="no", report_to=[],
        dataloader_num_workers=0, learning_rate=0.0, lr_scheduler_type="constant", seed=0, disable_tqdm=True,
    )  # fmt: skip
    if trainer == "trainer":
        from transformers import TrainingArguments

        return TrainingArguments(**common)
    from trl import SFTConfig

    return SFTConfig(**common, **SFT_SETTINGS)


def build_trainer(trainer: str, model, arguments, rows: list[dict], callbacks: list):
    """The trainer on ``rows`` (``rows_for``'s dicts of ``input_ids`` and ``labels``) in order, its
    collator recording every micro-batch it builds (:class:`RecordingCollator`)."""
    if trainer == "trainer":
        from transformers import Trainer

        built = in_order(Trainer)(model=model, args=arguments, train_dataset=rows, callbacks=callbacks)
    else:
        from tiny_trl import tiny_tokenizer
        from trl import SFTTrainer

        built = in_order(SFTTrainer)(
            model=model, args=arguments, train_dataset=sft_dataset(rows),
            processing_class=tiny_tokenizer(), callbacks=callbacks,
        )  # fmt: skip
    built.data_collator = RecordingCollator(built.data_collator)
    return built


def in_order(base: type) -> type:
    """``base`` dealing the dataset in order (micro-batch ``i`` to rank ``i % world``), so every
    segment of the run walks the same batches."""
    import torch

    class InOrder(base):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(
                self.train_dataset if train_dataset is None else train_dataset
            )

    return InOrder


def sft_dataset(rows: list[dict]):
    """The rows as TRL takes pre-tokenized data: ``input_ids`` and a ``completion_mask`` that is 0
    where the row's label is ignored. ``SFTTrainer`` (``completion_only_loss=True``) builds the
    labels from it, the same as the rows', and tokenizes nothing (the ids are there)."""
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "input_ids": [row["input_ids"].tolist() for row in rows],
            "completion_mask": [(row["labels"] != IGNORE).int().tolist() for row in rows],
        }
    )


def fingerprint(ids, labels) -> list[int]:
    """A micro-batch as the run compares it: the sum of its ids and how many labels it trains
    (after the shift to next-token labels)."""
    return [int(ids.sum()), int((labels[:, 1:] != IGNORE).sum())]


def planned_batches(rows: list[dict], world: int, rank: int, batch: int) -> list[list[int]]:
    """The fingerprints of the micro-batches ``rank`` is dealt from ``rows``, in order."""
    import torch

    planned = []
    for start in range(rank * batch, len(rows), world * batch):
        micro = rows[start : start + batch]
        ids, labels = (torch.stack([row[key] for row in micro]) for key in ("input_ids", "labels"))
        planned.append(fingerprint(ids, labels))
    return planned


class RecordingCollator:
    """A trainer's collator that records the fingerprint of every micro-batch it builds (on the
    CPU, in the data loader: nothing is added to the step)."""

    def __init__(self, collate) -> None:
        self.collate, self.seen = collate, []

    def __call__(self, examples: list[dict]) -> dict:
        batch = self.collate(examples)
        self.seen.append(fingerprint(batch["input_ids"], batch["labels"]))
        return batch


class OpCalls:
    """Counts the calls of the fused op, ``liger_patch.ops.cross_entropy.operator.FLCE`` (the
    registered ``torch.ops.liger_patch.flce`` or, in a plain eager call, its eager twin): the
    patched forward's under ``Trainer``, TRL's fused head's (through
    ``liger_patch.integrations.trl``) under ``SFTTrainer``. The functional looks it up there at
    every call, so a counting stand-in put there sees each one."""

    def __init__(self) -> None:
        from liger_patch.ops.cross_entropy import operator

        self.count, op = 0, operator.FLCE

        def counted(*args):
            self.count += 1
            return op(*args)

        operator.FLCE = counted
