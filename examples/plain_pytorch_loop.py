"""Fine-tune a causal LM with a plain PyTorch loop and the fused loss.

    python examples/plain_pytorch_loop.py                      # tiny random Llama, no download
    python examples/plain_pytorch_loop.py --model Qwen/Qwen2.5-0.5B   # a real checkpoint

The only liger_patch line is ``apply_liger_to(model)``: in training with labels the model's
loss comes from the fused kernel and ``outputs.logits`` is None; ``model.eval()`` and
``generate`` behave exactly as before.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import liger_patch as lp


def load_model(name: str | None):
    if name:
        return AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return AutoModelForCausalLM.from_config(config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a HF checkpoint; default: tiny random Llama")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--grad-accum", type=int, default=2)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(args.model).to(device)
    lp.apply_liger_to(model, z_loss_scale=1e-4)  # the one line; z-loss is optional
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.config.vocab_size

    for step in range(args.steps):
        micro_batches = []
        for _ in range(args.grad_accum):
            ids = torch.randint(0, vocab, (4, 128), device=device)
            labels = ids.clone()
            labels[:, :32] = -100  # ignore the prompt
            micro_batches.append((ids, labels))
        # Normalise by the tokens of the whole accumulated batch (what HF's Trainer does):
        # each micro-batch's loss is its token sum / this count, so the sum is the batch mean.
        num_items = sum(int((labels[:, 1:] != -100).sum()) for _, labels in micro_batches)
        for ids, labels in micro_batches:
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                out = model(input_ids=ids, labels=labels, num_items_in_batch=num_items)
            assert out.logits is None  # never materialised
            out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {out.loss.item() * args.grad_accum:.4f}  z_loss {out.z_loss.item():.2e}")

    model.eval()  # evaluation and generation: the original forward, real logits
    with torch.no_grad():
        print(model.generate(torch.tensor([[1, 2, 3]], device=device), max_new_tokens=8, do_sample=False))


if __name__ == "__main__":
    main()
