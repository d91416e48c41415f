"""TRL's fused LM head on a LoRA-wrapped lm_head (integrations/trl.py with patching/adapters.py).

TRL's head hands ``lm_head.weight`` to its log-prob kernel: for a LoRA layer that is the base
weight alone (TRL's SFT, GRPO, RLOO and KTO trainers refuse such a model; DPO does not). Through
the patch the kernel is ours, and it adds the head's adapters as the op's low-rank term: the
log-probs, the entropy and the gradients of every adapter equal TRL's own kernel's on the
effective weight ``W + s B A`` formed densely. A wrapper with no fused form runs TRL's kernel,
with a warning that names it."""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import liger_patch as lp
from liger_patch.patching.state import LigerBypassWarning
from tests.patching_helpers import make_batch, tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))  # tiny_trl, as test_trl.py
trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
if not hasattr(trl.trainer.utils, "add_fused_lm_head"):
    pytest.skip("this TRL has no fused LM head (before 1.15)", allow_module_level=True)


def _lora_model(tied: bool, **config):
    # No dropout: TRL scores only the kept rows, so a mask would be drawn over other elements than
    # in the reference (tests/patching/test_peft_head.py covers dropout).
    config = {
        "lora_dropout": 0.0,
        "r": 3,
        "lora_alpha": 7,
        "init_lora_weights": False,
        "target_modules": ["q_proj", "lm_head"],
        **config,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(
            tiny_model("llama", dtype=torch.float32, tie_word_embeddings=tied, output_router_logits=False),
            peft.LoraConfig(**config),
        )


class DenseLoraHead(nn.Module):
    """The reference head: its ``weight`` is the LoRA layer's effective weight ``W + s B A``,
    formed densely (autograd reaches lora_A and lora_B), and no bias: TRL's own kernel on it is
    what the adapter means."""

    def __init__(self, lora: nn.Module):
        super().__init__()
        self.inner = lora

    @property
    def weight(self) -> torch.Tensor:
        lora = self.inner
        name = lora.active_adapters[0]
        delta = lora.lora_B[name].weight @ lora.lora_A[name].weight * lora.scaling[name]
        return lora.base_layer.weight + delta

    bias = None


def _fields_and_grads(model, batch):
    trl.trainer.utils.add_fused_lm_head(model.get_base_model(), outputs=("log_probs", "entropy"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", LigerBypassWarning)
        out = model(**batch, fused_lm_head=True)
    (out.log_probs.sum() + 0.1 * out.entropy.sum()).backward()
    grads = {n.replace("inner.", ""): p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.log_probs.detach(), out.entropy.detach(), grads


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_lora_head_log_probs_and_grads_equal_trls_kernel_on_the_dense_weight(op_calls, tied):
    patched = _lora_model(tied)
    reference = copy.deepcopy(patched)
    base = reference.get_base_model()
    base.lm_head = DenseLoraHead(base.lm_head)
    lp.apply_liger_to(patched, backend="torch")
    batch = make_batch()
    logp, entropy, grads = _fields_and_grads(patched, batch)
    assert len(op_calls) == 1
    ref_logp, ref_entropy, ref_grads = _fields_and_grads(reference, batch)
    assert len(op_calls) == 1  # the reference is not patched: TRL's own kernel
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys() and any("lm_head.lora_B" in n for n in grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_unfusable_head_wrapper_runs_trls_kernel_and_names_it(op_calls):
    model = _lora_model(False, use_dora=True)
    trl.trainer.utils.add_fused_lm_head(model.get_base_model())
    with pytest.warns(UserWarning, match="DoRA"):
        lp.apply_liger_to(model, backend="torch")
    with pytest.warns(LigerBypassWarning, match="TRL's own log-prob kernel ran .*DoRA"):
        model(**make_batch(), fused_lm_head=True)
    assert op_calls == []


def test_sft_trainer_with_modules_to_save_head_and_lora_layers(tmp_path, op_calls):
    """TRL's SFTTrainer (which refuses LoRA on lm_head itself) with LoRA on attention and a
    trainable copy of lm_head (modules_to_save): the same run through the op."""
    from peft import LoraConfig
    from tiny_trl import arithmetic_chats, tiny_tokenizer
    from tiny_trl import tiny_model as trl_tiny_model

    from tests.integrations.test_trl import METRICS, _assert_same_run, _common, _train

    def make(path):
        def trainer(callbacks):
            config = LoraConfig(
                r=3,
                lora_alpha=7,
                target_modules=["q_proj"],
                modules_to_save=["lm_head"],
                task_type="CAUSAL_LM",
            )
            return trl.SFTTrainer(
                model=trl_tiny_model(seed=1),
                args=trl.SFTConfig(**_common(path, gradient_accumulation_steps=2)),
                train_dataset=arithmetic_chats(48),
                processing_class=tiny_tokenizer(),
                peft_config=config,
                callbacks=callbacks,
            )

        return trainer

    reference = _train(make(tmp_path / "trl"), patched=False)
    ours = _train(make(tmp_path / "ours"), patched=True)
    assert len(op_calls) == 6
    _assert_same_run(reference, ours, METRICS)
    assert any("modules_to_save" in name and "lm_head" in name for name in ours[1])
