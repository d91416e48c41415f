"""A speech encoder-decoder (Whisper, Speech2Text, Moonshine, ...) in a plain PyTorch loop.

    python examples/speech_seq2seq.py                               # tiny Whisper, offline
    python examples/speech_seq2seq.py --model openai/whisper-small  # a hub checkpoint or a local path

``apply_liger_to`` patches the instance; the decoder's loss over its vocabulary is the fused op.
The default model is built from a config and trained on random log-mel features (80 bins, as
many frames as its encoder takes) with random transcripts: nothing is downloaded.
"""

from __future__ import annotations

import argparse

import torch
from tiny_families import tiny_whisper

import liger_patch as lp


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="hub name or local path (default: tiny random Whisper)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--target-tokens", type=int, default=24, help="transcript length")
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_whisper(args.model).to(device).train()
    lp.apply_liger_to(model)
    config = model.config
    frames = 2 * config.max_source_positions  # Whisper's encoder takes exactly this many
    g = torch.Generator().manual_seed(0)
    features = torch.randn(args.batch, config.num_mel_bins, frames, generator=g).to(device)
    labels = torch.randint(3, config.vocab_size, (args.batch, args.target_tokens), generator=g).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        output = model(input_features=features, labels=labels)
        output.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: loss {output.loss.item():.4f}  (logits built: {output.logits is not None})")


if __name__ == "__main__":
    main()
