"""Train a causal LM with a plain PyTorch loop and the fused loss.

    python examples/plain_pytorch_loop.py                            # tiny Llama, CPU or GPU, offline
    python examples/plain_pytorch_loop.py --model Qwen/Qwen2.5-0.5B  # a hub checkpoint or a local path

The only liger_patch line is ``apply_liger_to(model)``: in training with labels the model's
loss comes from the fused kernel and ``outputs.logits`` is None; ``model.eval()`` and
``generate`` behave exactly as before. The default model is built from a config (2 layers,
hidden 64, vocabulary 1000): nothing is downloaded, and 20 steps take seconds on a CPU.

The data is something a model can learn without a download: a few fixed random "phrases" of
tokens, each training sequence one phrase repeated. The loss falls from about ln(vocabulary)
(6.9 for the tiny model) as the model learns them, and at the end the model, generating from the
start of a phrase, continues it.
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


PHRASES, PHRASE_LEN = 4, 16


def phrases(vocab: int, seed: int = 0) -> torch.Tensor:
    """``PHRASES`` fixed random token sequences of ``PHRASE_LEN``: the corpus to learn."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (PHRASES, PHRASE_LEN), generator=generator)


def micro_batches(
    corpus: torch.Tensor, count: int, seq: int, device: str, generator: torch.Generator
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of 4 sequences, each a random phrase repeated to ``seq`` tokens, whose
    first quarter is an ignored prompt (as in fine-tuning: the loss is on the rest only)."""
    batches = []
    for _ in range(count):
        rows = corpus[torch.randint(0, len(corpus), (4,), generator=generator)]
        ids = rows.repeat(1, -(-seq // PHRASE_LEN))[:, :seq].to(device)
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
    parser.add_argument(
        "--lr", type=float, default=None, help="AdamW's learning rate (default 5e-3; 2e-5 with --model)"
    )
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(args.model, device).to(device)
    lp.apply_liger_to(model, z_loss_scale=1e-4)  # the one line; z-loss is optional
    model.train()
    lr = args.lr if args.lr is not None else (2e-5 if args.model else 5e-3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    corpus = phrases(model.config.vocab_size)
    generator = torch.Generator().manual_seed(1)

    losses = []
    for step in range(args.steps):
        batches = micro_batches(corpus, args.grad_accum, args.seq, device, generator)
        loss, z_loss = train_step(model, optimizer, batches, device)
        losses.append(loss)
        print(f"step {step}: loss {loss:.4f}  z_loss {z_loss:.2e}", flush=True)
    print(f"training loss: {losses[0]:.4f} at the first step, {losses[-1]:.4f} at the last")

    model.eval()  # evaluation and generation: the original forward, real logits
    prompt, expected = corpus[0, :4].tolist(), corpus[0, 4:12].tolist()
    with torch.no_grad():
        generated = model.generate(torch.tensor([prompt], device=device), max_new_tokens=8, do_sample=False)
    continuation = generated[0, len(prompt) :].tolist()
    print(f"generate: phrase 0's first tokens {prompt}")
    print(f"  continued with {continuation}")
    matches = sum(a == b for a, b in zip(continuation, expected, strict=True))
    print(f"  phrase 0 goes on {expected} ({matches} of {len(expected)} match)")


if __name__ == "__main__":
    main()
