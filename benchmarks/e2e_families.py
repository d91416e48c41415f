"""End to end beyond the causal LM: masked LM, encoder-decoder and speech models, patched against
unpatched step time and peak memory on one GPU.

Rows (random init, bf16, sdpa where the model takes it, AdamW at learning rate 0):

* ``xlmr_large_mlm``: an XLM-R-large-shaped masked LM (vocabulary 250002), 16 x 512 tokens, 15 %
  of them labelled (their inputs replaced by random ids, as the masked-LM collator does);
* ``modernbert_base_mlm``: a ModernBERT-base-shaped masked LM (vocabulary 50368), 16 x 1024
  tokens, 30 % labelled (ModernBERT's own masking rate);
* ``mt5_base_seq2seq``: an mT5-base-shaped encoder-decoder (vocabulary 250112, untied head),
  16 x 512 source tokens, 16 x 128 target tokens;
* ``nllb_600m_seq2seq``: an NLLB-200-600M-shaped encoder-decoder (M2M-100, vocabulary 256206),
  16 x 256 source and 16 x 256 target tokens;
* ``whisper_small``: a Whisper-small-shaped speech model (vocabulary 51865), 8 clips of 30 s
  (80 mel bins x 3000 frames), 448 target tokens.

Each row runs in its own process, which alternates segments of ``--segment-steps`` steps on one
model: unpatched, patched (``apply_liger_to`` on the instance), ``revert_liger``, ... for
``--rounds`` rounds, with the same batch and the same seed before every step (dropout draws the
same masks), so every step computes the same loss: parity is checked (patched against unpatched
within ``LOSS_TOL``, or ``LOSS_REL_TOL`` of the loss where that is more; the fused path must have
run). Reported per variant: the median step time (each segment's first step left out) and the
peak memory allocated. The table's ratio is patched over unpatched.

    python benchmarks/e2e_families.py --out docs/results/e2e_families.json
    python benchmarks/e2e_families.py --rows whisper_small --rounds 2
    python benchmarks/e2e_families.py --smoke   # every row at tiny shapes on the CPU: a check of the script
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass

import torch
from common import environment, need_cuda, run_in_processes, write_json

LOSS_TOL = 2e-2  # bf16, absolute, per step; fp32 (--smoke) is far inside it
# bf16, relative to the loss, where that is larger: a random-init T5's head is not scaled down
# (logits of std ~28, a loss ~500), and the unpatched bf16 logits round by ~0.1 there
LOSS_REL_TOL = 1e-3


@dataclass(frozen=True)
class Row:
    """One benchmark row: the model's family (``mlm``, ``seq2seq``, ``speech``), its
    ``model_type`` and config keywords, the batch, the source length (tokens, or audio frames),
    the target length (seq2seq and speech) and the share of labelled tokens (masked LM)."""

    family: str
    model_type: str
    config: dict
    batch: int
    source: int
    target: int = 0
    labelled: float = 1.0


XLMR_LARGE = dict(vocab_size=250002, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                  num_attention_heads=16, max_position_embeddings=514, type_vocab_size=1,
                  pad_token_id=1)  # fmt: skip
MODERNBERT_BASE = dict(vocab_size=50368, hidden_size=768, intermediate_size=1152, num_hidden_layers=22,
                       num_attention_heads=12, max_position_embeddings=8192, pad_token_id=50283,
                       bos_token_id=50281, eos_token_id=50282, cls_token_id=50281,
                       sep_token_id=50282)  # fmt: skip
MT5_BASE = dict(vocab_size=250112, d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_decoder_layers=12,
                num_heads=12, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
NLLB_600M = dict(vocab_size=256206, d_model=1024, encoder_layers=12, decoder_layers=12,
                 encoder_attention_heads=16, decoder_attention_heads=16, encoder_ffn_dim=4096,
                 decoder_ffn_dim=4096, max_position_embeddings=1024, scale_embedding=True,
                 pad_token_id=1, decoder_start_token_id=2)  # fmt: skip
WHISPER_SMALL = dict(vocab_size=51865, d_model=768, encoder_layers=12, decoder_layers=12,
                     encoder_attention_heads=12, decoder_attention_heads=12, encoder_ffn_dim=3072,
                     decoder_ffn_dim=3072, num_mel_bins=80, max_source_positions=1500,
                     max_target_positions=448, pad_token_id=50257, bos_token_id=50257,
                     eos_token_id=50257, decoder_start_token_id=50258)  # fmt: skip

ROWS = {
    "xlmr_large_mlm": Row("mlm", "xlm-roberta", XLMR_LARGE, batch=16, source=512, labelled=0.15),
    "modernbert_base_mlm": Row("mlm", "modernbert", MODERNBERT_BASE, batch=16, source=1024, labelled=0.30),
    "mt5_base_seq2seq": Row("seq2seq", "mt5", MT5_BASE, batch=16, source=512, target=128),
    "nllb_600m_seq2seq": Row("seq2seq", "m2m_100", NLLB_600M, batch=16, source=256, target=256),
    "whisper_small": Row("speech", "whisper", WHISPER_SMALL, batch=8, source=3000, target=448),
}

# --smoke: every row at tiny shapes (the same keys, smaller values) on the CPU in fp32
SMOKE_SIZES = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                   num_heads=4, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                   decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                   max_source_positions=16, max_target_positions=64, pad_token_id=1,
                   decoder_start_token_id=2, bos_token_id=2, eos_token_id=3, cls_token_id=2,
                   sep_token_id=3)  # fmt: skip


def smoke_row(row: Row) -> Row:
    """``row`` at tiny shapes: its config's sizes shrunk, a batch of 2 x 32 (audio: 32 frames), 8 targets."""
    config = {key: SMOKE_SIZES.get(key, value) for key, value in row.config.items()}
    return Row(row.family, row.model_type, config, batch=2, source=32, target=8 if row.target else 0,
               labelled=row.labelled)  # fmt: skip


def build_model(row: Row, device: str, dtype: torch.dtype):
    """The row's random-init model in train mode (sdpa attention where the class takes it)."""
    from transformers import (
        AutoConfig,
        AutoModelForMaskedLM,
        AutoModelForSeq2SeqLM,
        AutoModelForSpeechSeq2Seq,
    )

    auto = {
        "mlm": AutoModelForMaskedLM,
        "seq2seq": AutoModelForSeq2SeqLM,
        "speech": AutoModelForSpeechSeq2Seq,
    }
    torch.manual_seed(0)
    config = AutoConfig.for_model(row.model_type, **row.config)
    with torch.device(device):  # initialised where it runs: seconds, not a minute, at 600M parameters
        try:
            model = auto[row.family].from_config(config, dtype=dtype, attn_implementation="sdpa")
        except (ValueError, ImportError):  # a class without sdpa keeps its default attention
            model = auto[row.family].from_config(config, dtype=dtype)
    return model.to(device).train()


def make_batch(row: Row, vocab: int, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The row's batch: masked-LM ids with ``labelled`` of them labelled and replaced by random
    ids; source ids (or log-mel features) and target labels for the encoder-decoders."""
    g = torch.Generator().manual_seed(1)
    shape = (row.batch, row.source)
    if row.family == "speech":
        batch = {
            "input_features": torch.randn(row.batch, row.config["num_mel_bins"], row.source, generator=g)
        }
    else:
        ids = torch.randint(5, vocab, shape, generator=g)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if row.family == "mlm":
        keep = torch.rand(shape, generator=g) < row.labelled
        batch["labels"] = ids.masked_fill(~keep, -100)
        batch["input_ids"] = torch.where(keep, torch.randint(5, vocab, shape, generator=g), ids)
    else:
        batch["labels"] = torch.randint(5, vocab, (row.batch, row.target), generator=g)
    return {k: v.to(device, dtype=dtype if v.is_floating_point() else None) for k, v in batch.items()}


def segment(model, opt, batch: dict, steps: int) -> dict:
    """``steps`` optimizer steps on ``batch``: their times (ms), losses, the peak memory (GiB,
    CUDA only) and whether every step's logits came back ``None`` (the fused path ran)."""
    cuda = batch["labels"].is_cuda
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses, fused = [], [], True
    for _ in range(steps):
        torch.manual_seed(2)  # the same dropout masks in every step of every segment
        start = time.perf_counter()
        output = model(**batch)
        output.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
        losses.append(output.loss.item())
        fused = fused and output.logits is None
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {"ms": times, "losses": losses, "peak_gib": peak, "fused": fused}


def run_row(name: str, rounds: int, segment_steps: int, smoke: bool) -> dict:
    """One row's alternating segments, summarised."""
    import liger_patch as lp

    started = time.perf_counter()
    row = smoke_row(ROWS[name]) if smoke else ROWS[name]
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    model = build_model(row, device, dtype)
    batch = make_batch(row, model.config.vocab_size, device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    segment(model, opt, batch, 2)  # warm-up (and AdamW's states made)
    runs: dict[str, list[dict]] = {"unpatched": [], "patched": []}
    for _ in range(rounds):
        runs["unpatched"].append(segment(model, opt, batch, segment_steps))
        lp.apply_liger_to(model)
        runs["patched"].append(segment(model, opt, batch, segment_steps))
        lp.revert_liger(model)
    return {**summary(name, row, runs), "seconds": round(time.perf_counter() - started, 1)}


def summary(name: str, row: Row, runs: dict[str, list[dict]]) -> dict:
    """Medians (each segment's first step left out), peaks, parity."""
    out: dict = {"row": name, "family": row.family, "batch": row.batch, "source": row.source,
                 "target": row.target, "labelled": row.labelled,
                 "vocab": row.config["vocab_size"]}  # fmt: skip
    for variant, segments in runs.items():
        out[f"{variant}_ms"] = statistics.median(t for s in segments for t in (s["ms"][1:] or s["ms"]))
        peaks = [s["peak_gib"] for s in segments if s["peak_gib"] is not None]
        out[f"{variant}_peak_gib"] = max(peaks) if peaks else None
    pairs = zip(runs["unpatched"], runs["patched"], strict=True)
    out["max_loss_diff"] = max(
        abs(a - b) for u, p in pairs for a, b in zip(u["losses"], p["losses"], strict=True)
    )
    out["fused_ran"] = all(s["fused"] for s in runs["patched"]) and not any(
        s["fused"] for s in runs["unpatched"]
    )
    out["loss"] = statistics.median(runs["unpatched"][0]["losses"])
    tolerance = max(LOSS_TOL, LOSS_REL_TOL * abs(out["loss"]))
    out["parity_ok"] = out["max_loss_diff"] <= tolerance and out["fused_ran"]
    out["step_ratio"] = out["patched_ms"] / out["unpatched_ms"]
    return out


def _cell(result: dict, variant: str) -> str:
    peak = result[f"{variant}_peak_gib"]
    return f"{result[f'{variant}_ms']:.1f} ms" + ("" if peak is None else f", {peak:.2f} GiB")


def table(results: list[dict]) -> str:
    """The markdown table: per row, each variant's step and peak, their ratios, parity."""
    lines = ["| row | tokens | unpatched | patched | step | peak | loss | loss diff |", "|---" * 8 + "|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['row']} | error: {' '.join(r['error'])} | | | | | | |")
            continue
        tokens = f"{r['batch']}x{r['source']}" + (f" -> {r['batch']}x{r['target']}" if r["target"] else "")
        if r["family"] == "mlm":
            tokens += f", {round(100 * r['labelled'])} % labelled"

        peak_ratio = (
            f"{r['patched_peak_gib'] / r['unpatched_peak_gib']:.3f}x"
            if r["unpatched_peak_gib"]
            else "n/a (CPU)"
        )
        parity = f"{r['max_loss_diff']:.1e}" + ("" if r["parity_ok"] else " (PARITY FAILED)")
        lines.append(f"| {r['row']} | {tokens} | {_cell(r, 'unpatched')} | {_cell(r, 'patched')} | "
                     f"{r['step_ratio']:.3f}x | {peak_ratio} | {r['loss']:.4g} | {parity} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--segment-steps", type=int, default=5)
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU, every row in this process"
    )
    parser.add_argument("--one", metavar="ROW", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="JSON results (the markdown table beside it, .md)")
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_row(args.one, args.rounds, args.segment_steps, args.smoke)))
        return 0
    rows = args.rows.split(",")
    started = time.perf_counter()
    if args.smoke:
        results = [run_row(row, args.rounds, args.segment_steps, smoke=True) for row in rows]
    else:
        if not need_cuda(__file__):
            return 2
        shared = ["--rounds", str(args.rounds), "--segment-steps", str(args.segment_steps)]
        results = run_in_processes(__file__, [{"row": row} for row in rows], shared)
    text = table(results)
    print(text)
    if args.out:
        env = environment("transformers")
        seconds = round(time.perf_counter() - started, 1)
        head = {**env, "smoke": args.smoke, "rounds": args.rounds, "segment_steps": args.segment_steps,
                "seconds": seconds}  # fmt: skip
        write_json(args.out, {**head, "results": results, "table": text})
        with open(args.out.rsplit(".", 1)[0] + ".md", "w") as f:
            versions = f"torch {env['torch']}, transformers {env['transformers']}"
            plan = f"{args.rounds} rounds of {args.segment_steps} steps per variant, {seconds} s in all"
            f.write(f"Measured on {env['device']} ({versions}), {plan}; step and peak are patched "
                    f"over unpatched.\n\n{text}\n")  # fmt: skip
    return 0 if all(r.get("parity_ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
