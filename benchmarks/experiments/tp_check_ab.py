"""Probe: what the vocabulary-parallel check's host read costs a tensor-parallel step (issue 43).

``tp_gpu.py``'s memory part without activation checkpointing (the Llama-3.2-1B shape, bf16,
``tp_plan="auto"`` over 2 GPUs, AdamW, 8 x 2048 tokens per rank) in three variants: unpatched,
patched, and patched with ``vocab_shard.check_ranks_agree`` replaced by its device work alone (the
flags and their all-reduce queued, never read back: no host wait, and no check, so an upper bound
of what beginning the check earlier could save). ``--rounds`` rounds, the variants' order rotating
from round to round; per round each variant's median step (the first left out). Reported: each
variant's median over rounds and the per-round ratios to unpatched, and of unread to patched. JSON
to ``--out``, rewritten after every round.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. torchrun --nproc-per-node 2 \\
        benchmarks/experiments/tp_check_ab.py --out /tmp/tp_check_ab.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from common import log, write_json  # noqa: E402
from tp_gpu import init, llama_1b_checkpoint, memory_run  # noqa: E402

from liger_patch.ops.core import vocab_shard  # noqa: E402
from liger_patch.ops.cross_entropy import vocab_parallel  # noqa: E402

VARIANTS = ("unpatched", "patched", "unread")


def _unread_check(labels, shard, ignore_index, user_divisor, needs, maxima=()):
    """``check_ranks_agree``'s device work (flags, all-reduce) without its read: returns this
    rank's maxima unchecked."""
    flags = vocab_shard._flags(labels, shard.vocab, ignore_index, user_divisor, needs, maxima)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=shard.group)
    return list(maxima)


def run(variant: str, path: Path, device: torch.device, args) -> dict:
    swap = mock.patch.object(vocab_parallel, "check_ranks_agree", _unread_check)
    with swap if variant == "unread" else contextlib.nullcontext():
        return memory_run(path, variant != "unpatched", False, device, args)


def summary(rounds: list[dict[str, float]]) -> dict:
    def ratios(num: str, den: str) -> list[float]:
        return [r[num] / r[den] for r in rounds]

    out = {"rounds": rounds}
    out["median_step_s"] = {v: statistics.median(r[v] for r in rounds) for v in VARIANTS}
    for num, den in (("patched", "unpatched"), ("unread", "unpatched"), ("unread", "patched")):
        rs = ratios(num, den)
        out[f"{num}_over_{den}"] = {"paired": statistics.median(rs), "rounds": rs}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/liger_patch_tp_gpu"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mem-steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--smoke", action="store_true", help="CPU + gloo + tiny shapes")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.seq, args.rounds, args.mem_steps = 2, 64, min(args.rounds, 2), 3
    args.fsdp, args.tp = 1, int(os.environ["WORLD_SIZE"])
    device = init(args)
    path = llama_1b_checkpoint(args.workdir, args.smoke)
    rounds = []
    for r in range(args.rounds):
        order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
        rounds.append({v: run(v, path, device, args)["median_step_s"] for v in order})
        log(f"round {r}: " + ", ".join(f"{v} {1e3 * rounds[-1][v]:.1f} ms" for v in VARIANTS))
        if dist.get_rank() == 0:
            name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
            result = {"device": name, "tokens_per_rank": args.batch * args.seq, **summary(rounds)}
            write_json(args.out, result, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
