"""Fine-tune a causal LM with a plain PyTorch loop and the fused loss.

    python examples/plain_pytorch_loop.py                            # tiny Llama, CPU or GPU, offline
    python examples/plain_pytorch_loop.py --model Qwen/Qwen2.5-0.5B  # a hub checkpoint or a local path

The only liger_patch line is ``apply_liger_to(model)``: in training with labels the model's
loss comes from the fused kernel and ``outputs.logits`` is None; ``model.eval()`` and
``generate`` behave exactly as before. The default model is built from a config (2 layers,
hidden 64, vocabulary 1000): nothing is downloaded, and a few steps take seconds on a CPU.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import liger_patch as lp


def load_model(name: str | None, device: str):
    """A hub/local checkpoint (bf16 on a GPU), or, without ``name``, a tiny random Llama."""
    if name:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        return AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return AutoModelForCausalLM.from_config(config)


def micro_batches(count: int, vocab: int, seq: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random token batches (4 sequences each) whose first quarter is an ignored prompt."""
    batches = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (4, seq), device=device)
        labels = ids.clone()
        labels[:, : seq // 4] = -100  # ignore the prompt
        batches.append((ids, labels))
    return batches


def train_step(model, optimizer, batches, device: str) -> tuple[float, float]:
    """One optimizer step over gradient-accumulated micro-batches: (loss, z_loss) of the step."""
    # Normalise by the tokens of the whole accumulated batch (what HF's Trainer does): each
    # micro-batch's loss is its token sum / this count, so their sum is the batch mean.
    num_items = sum(int((labels[:, 1:] != -100).sum()) for _, labels in batches)
    loss = z_loss = 0.0
    for ids, labels in batches:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            out = model(input_ids=ids, labels=labels, num_items_in_batch=num_items)
        assert out.logits is None  # never materialised
        out.loss.backward()
        loss += out.loss.item()
        z_loss += out.z_loss.item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, z_loss


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="hub name or local path (default: tiny random Llama)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step (default 2)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(args.model, device).to(device)
    lp.apply_liger_to(model, z_loss_scale=1e-4)  # the one line; z-loss is optional
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    for step in range(args.steps):
        batches = micro_batches(args.grad_accum, model.config.vocab_size, args.seq, device)
        loss, z_loss = train_step(model, optimizer, batches, device)
        print(f"step {step}: loss {loss:.4f}  z_loss {z_loss:.2e}", flush=True)

    model.eval()  # evaluation and generation: the original forward, real logits
    with torch.no_grad():
        print(model.generate(torch.tensor([[1, 2, 3]], device=device), max_new_tokens=8, do_sample=False))


if __name__ == "__main__":
    main()
