"""Tiny random models and training loops for the patching tests.

Every model is built from a config (no downloads): vocab 128, hidden 32, 2 layers, so a
forward + backward is milliseconds even with the Triton kernel under the interpreter. On CUDA
the same tests run in bf16 with looser tolerances (``tolerances()``).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch
from transformers import AutoConfig

import liger_patch as lp

VOCAB = 128
SEQ = 12
BATCH = 2

# One set of small sizes for every family; keys a family does not know are ignored by it.
TINY_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    # MoE families: small expert counts, router logits on so the aux loss is exercised
    num_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    output_router_logits=True,
    router_aux_loss_coef=0.1,
    # head math that the kernel must reproduce: non-trivial values so a mistake shows
    final_logit_softcapping=2.0,  # gemma2 / gemma3_text
    logits_scaling=4.0,  # granite / granitemoe (logits are divided by it)
    logit_scale=0.5,  # cohere / cohere2 (logits are multiplied by it)
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# The families the patching tests train in depth (the sweep in tests/verify/test_sweep.py
# covers every type once).
# fmt: off
ALL_BUILTIN_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "mixtral", "gemma", "gemma2",
    "gemma3_text", "phi3", "phi", "olmo2", "olmo3", "glm", "glm4", "granite", "granitemoe", "cohere",
    "cohere2", "smollm3",
)
# fmt: on


def available_model_types() -> list[str]:
    """The families above that the installed transformers has (4.57 lacks some)."""
    from liger_patch.patching.derive import classes_for_model_type

    return [mt for mt in ALL_BUILTIN_MODEL_TYPES if classes_for_model_type(mt)]


def device_and_dtype() -> tuple[torch.device, torch.dtype]:
    """fp32 on CPU (tight checks in CI); bf16 on CUDA (the dtype people train in)."""
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


@dataclass(frozen=True)
class Tolerances:
    loss: float
    grad: float  # relative error of each gradient tensor (norm of difference / norm)
    param: float  # absolute error of parameters after the steps


def tolerances(dtype: torch.dtype) -> Tolerances:
    if dtype == torch.float32:
        return Tolerances(loss=2e-5, grad=2e-4, param=1e-4)
    return Tolerances(loss=2e-2, grad=8e-2, param=2e-2)


def tiny_model(model_type: str = "llama", seed: int = 0, dtype: torch.dtype | None = None, **overrides):
    """A randomly initialised causal LM of ``model_type``, in train mode."""
    from liger_patch.patching.derive import classes_for_model_type

    config = AutoConfig.for_model(model_type, **{**TINY_CONFIG, **overrides})
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = classes_for_model_type(model_type)[0](config)
    device, default_dtype = device_and_dtype()
    model.to(device=device, dtype=dtype or default_dtype)
    return model.train()


def make_batch(seed: int = 0, batch: int = BATCH, seq: int = SEQ, device=None) -> dict[str, torch.Tensor]:
    """Token ids, a right-padded attention mask and labels with ignored prompt and padding."""
    device = device or device_and_dtype()[0]
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[-1, seq - 3 :] = 0  # last row is padded
    input_ids[attention_mask == 0] = 0
    labels = input_ids.clone()
    labels[:, :3] = -100  # the "prompt"
    labels[attention_mask == 0] = -100
    return {
        k: v.to(device)
        for k, v in dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels).items()
    }


@dataclass
class TrainRecord:
    losses: list[torch.Tensor]
    grads: list[dict[str, torch.Tensor]]
    params: dict[str, torch.Tensor]
    outputs: list


def train_steps(
    model, steps: int = 3, lr: float | None = None, seed: int = 0, **forward_kwargs
) -> TrainRecord:
    """``steps`` SGD steps on fresh batches; records losses, gradients and final parameters.

    The default step size is large in fp32 (differences would show) and small in bf16, where
    rounding differences between the two runs would otherwise grow step by step.
    """
    if lr is None:
        lr = 0.5 if next(model.parameters()).dtype == torch.float32 else 0.05
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    record = TrainRecord([], [], {}, [])
    for step in range(steps):
        out = model(**make_batch(seed + step), **forward_kwargs)
        out.loss.backward()
        record.losses.append(out.loss.detach().float().cpu())
        record.grads.append(
            {
                n: p.grad.detach().float().cpu().clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
        )
        record.outputs.append(out)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    record.params = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    return record


def assert_records_match(patched: TrainRecord, reference: TrainRecord, tol: Tolerances) -> None:
    """Losses, every gradient and every final parameter agree within ``tol``."""
    for step, (a, b) in enumerate(zip(patched.losses, reference.losses, strict=True)):
        assert torch.allclose(a, b, rtol=tol.loss, atol=tol.loss), f"step {step}: loss {a} vs {b}"
    for step, (ga, gb) in enumerate(zip(patched.grads, reference.grads, strict=True)):
        assert ga.keys() == gb.keys(), f"step {step}: different parameters got gradients"
        for name in gb:
            scale = gb[name].norm().clamp_min(1e-6)
            err = ((ga[name] - gb[name]).norm() / scale).item()
            assert err <= tol.grad, f"step {step}: grad {name} relative error {err:.2e}"
    for name in reference.params:
        err = (patched.params[name] - reference.params[name]).abs().max().item()
        assert err <= tol.param, f"param {name} differs by {err:.2e} after training"


@contextlib.contextmanager
def class_patch(target):
    """Class-level patch that is always reverted, even when the test fails."""
    lp.apply_liger_to(target)
    try:
        yield target
    finally:
        lp.revert_liger(target)
