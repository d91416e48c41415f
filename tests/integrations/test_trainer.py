"""HF Trainer + LigerPatchCallback: same training as the plain Trainer, z_loss logged."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from transformers import Trainer, TrainingArguments

import liger_patch as lp
from liger_patch.patching.forward import is_liger_forward
from tests.patching_helpers import device_and_dtype, make_batch, tiny_model


class TinyDataset(torch.utils.data.Dataset):
    """Eight fixed examples with ignored prompts and padding (so num_items_in_batch matters)."""

    def __init__(self):
        batches = [make_batch(seed, device="cpu") for seed in range(4)]
        self.rows = [{k: b[k][i] for k in b} for b in batches for i in range(2)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def run_trainer(model, tmp_path, callbacks=(), **overrides):
    """A Trainer of 3 SGD steps (accumulation 2) on TinyDataset; bf16 autocast on a GPU unless
    ``overrides`` say otherwise (they replace any argument)."""
    defaults = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=3,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        bf16=device_and_dtype()[1] == torch.bfloat16,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    args = TrainingArguments(**{**defaults, **overrides})
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=TinyDataset(),
        eval_dataset=TinyDataset(),
        callbacks=list(callbacks),
    )
    return trainer


def test_callback_training_equals_plain_trainer_with_grad_accumulation(tmp_path):
    reference_model = tiny_model("llama", dtype=torch.float32)
    patched_model = copy.deepcopy(reference_model)

    plain = run_trainer(reference_model, tmp_path / "plain")
    plain.train()
    patched = run_trainer(patched_model, tmp_path / "patched", callbacks=[lp.LigerPatchCallback()])
    assert is_liger_forward(patched_model.forward)  # patched at on_init_end
    patched.train()

    losses = [e["loss"] for e in patched.state.log_history if "loss" in e]
    expected = [e["loss"] for e in plain.state.log_history if "loss" in e]
    assert len(losses) == 3
    tol = 1e-5 if device_and_dtype()[1] == torch.float32 else 2e-2
    assert losses == pytest.approx(expected, rel=tol, abs=tol)
    for (name, p), q in zip(patched_model.named_parameters(), reference_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=tol * 10, atol=tol * 10, msg=name)

    eval_patched, eval_plain = patched.evaluate(), plain.evaluate()
    assert eval_patched["eval_loss"] == pytest.approx(eval_plain["eval_loss"], rel=tol, abs=tol)


def test_callback_logs_z_loss(tmp_path):
    model = tiny_model("llama", dtype=torch.float32)
    trainer = run_trainer(model, tmp_path, callbacks=[lp.LigerPatchCallback(z_loss_scale=1e-2)])
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert logged and all(e.get("z_loss", 0) > 0 for e in logged)
    assert all(e["z_loss"] < e["loss"] for e in logged)


def test_callback_warns_when_use_liger_kernel_is_set_too():
    callback = lp.LigerPatchCallback()
    model = tiny_model("llama")
    with pytest.warns(UserWarning, match="use_liger_kernel"):
        callback.on_init_end(types.SimpleNamespace(use_liger_kernel=True), None, None, model=model)
    assert is_liger_forward(model.forward)
