"""Where a ZeRO-3 training step waits on the host: every synchronisation in one steady step.

HF Trainer + DeepSpeed ZeRO-3 (no offload), a Llama with a 128256 vocabulary and an untied head,
bf16, rank 1's first micro-batch all-ignored (as issue 28 measured it). One steady-state step is
watched three ways, patched or not (``--patched``):

* explicit synchronisations: ``torch.cuda.synchronize``, ``Stream.synchronize`` and
  ``Event.synchronize`` are wrapped to record the Python stack of each call;
* implicit ones (``.item()``, ``.tolist()``, a copy to the host, ``nonzero``): CUDA's sync debug
  mode warns on each, and the warning hook records the stack;
* ``torch.profiler`` counts the CUDA runtime's synchronising calls and the step's CPU and CUDA time.

Run on 2 GPUs (the DeepSpeed wheel as in the device README):

    torchrun --nproc-per-node 2 benchmarks/experiments/zero3_syncs.py --out DIR [--patched]

Each rank writes ``DIR/{patched,unpatched}_rank{r}.json``: the step times, the profiler's counts
and every synchronisation with the frames of its stack that are not torch's own.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist


def _frames(skip: int = 2) -> list[str]:
    """The caller's stack, innermost last, without torch's and this file's own frames."""
    keep = []
    for frame in traceback.extract_stack()[:-skip]:
        path = frame.filename
        if "/torch/" in path and "/torch/distributed" not in path or path == __file__:
            continue
        short = path.split("site-packages/")[-1].split("/work/main/")[-1]
        keep.append(f"{short}:{frame.lineno} {frame.name}")
    return keep[-8:]


def _own_frames(stack: list[str]) -> list[str]:
    """A profiler event's stack without torch's own frames."""
    return [f.split("site-packages/")[-1] for f in stack if "/torch/" not in f][:6]


class SyncRecorder:
    """Records the stack of every synchronisation while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.events: list[dict] = []
        self._wrap(torch.cuda, "synchronize", "torch.cuda.synchronize")
        self._wrap(torch.cuda.Stream, "synchronize", "Stream.synchronize")
        self._wrap(torch.cuda.Event, "synchronize", "Event.synchronize")
        self._show = warnings.showwarning
        warnings.showwarning = self._warning

    def _wrap(self, owner, name: str, kind: str) -> None:
        original = getattr(owner, name)
        recorder = self

        def wrapped(*args, **kwargs):
            if recorder.on:
                recorder.events.append({"kind": kind, "stack": _frames()})
            return original(*args, **kwargs)

        setattr(owner, name, wrapped)

    def _warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if self.on and "synchronizing CUDA operation" in str(message):
            self.events.append({"kind": "implicit (sync debug mode)", "stack": _frames(3)})
            return
        self._show(message, category, filename, lineno, file, line)


def build_model(args):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def dataset(args, rank: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1 + rank)
    rows = []
    for i in range(args.batch * (args.steps + 1)):
        ids = torch.randint(0, args.vocab, (args.seq,), generator=gen)
        labels = ids.clone()
        labels[: args.seq // 4] = -100
        if rank == 1 and i < args.batch:
            labels[:] = -100  # rank 1's first micro-batch: nothing kept
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--patched", action="store_true")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--watch-step", type=int, default=7)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("zero3_syncs.py needs CUDA GPUs (2, through torchrun)") from None

    from transformers import Trainer, TrainerCallback, TrainingArguments

    import liger_patch as lp
    from liger_patch.patching.state import patch_state

    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    recorder = SyncRecorder()
    ds_config = {
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True},
        "bf16": {"enabled": True},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_force_ds_cpu_optimizer": False,
    }
    training_args = TrainingArguments(
        output_dir="/tmp/zero3_syncs_trainer",
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        bf16=True,
        deepspeed=ds_config,
        logging_steps=10_000,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        learning_rate=1e-5,
    )
    model = build_model(args)
    if args.patched:
        lp.apply_liger_to(model)
    starts: list[float] = []
    profile: dict = {}

    class Watch(TrainerCallback):
        def __init__(self) -> None:
            self.prof = None

        def on_step_begin(self, a, state, control, **kw):
            starts.append(time.perf_counter())
            if state.global_step == args.watch_step:
                torch.cuda.synchronize()
                self.prof = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                    with_stack=True,
                )
                self.prof.__enter__()
                torch.cuda.set_sync_debug_mode("warn")
                warnings.simplefilter("always")  # every sync, not the first per place
                recorder.on = True

        def on_step_end(self, a, state, control, **kw):
            if self.prof is not None:
                recorder.on = False
                torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize()
                self.prof.__exit__(None, None, None)
                events = self.prof.key_averages()
                runtime = {e.key: e.count for e in events if "Synchronize" in e.key}
                profile["runtime_syncs"] = runtime
                profile["cpu_ms"] = sum(e.self_cpu_time_total for e in events) / 1e3
                profile["cuda_ms"] = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3
                profile["top_cpu"] = [
                    (e.key, round(e.self_cpu_time_total / 1e3, 3), e.count)
                    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:30]
                ]
                profile["liger_ops"] = {e.key: e.count for e in events if "liger_patch" in e.key}
                by_stack = self.prof.key_averages(group_by_stack_n=6)
                profile["top_cpu_by_stack"] = [
                    (e.key, round(e.self_cpu_time_total / 1e3, 3), e.count, _own_frames(e.stack))
                    for e in sorted(by_stack, key=lambda e: -e.self_cpu_time_total)[:25]
                ]
                self.prof = None

    trainer = Trainer(model=model, args=training_args, train_dataset=dataset(args, rank), callbacks=[Watch()])
    trainer.train()
    steps_ms = [1e3 * (b - a) for a, b in zip(starts, starts[1:], strict=False)]
    where = [" <- ".join(reversed(e["stack"][-5:])) for e in recorder.events]
    grouped = collections.Counter((e["kind"], w) for e, w in zip(recorder.events, where, strict=True))
    result = {
        "patched": args.patched,
        "rank": rank,
        "step_ms": steps_ms,
        "median_step_ms_after_3": statistics.median(steps_ms[3:]) if len(steps_ms) > 3 else None,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "profile": profile,
        "syncs": [{"kind": k, "where": w, "count": c} for (k, w), c in grouped.most_common()],
        "fused_ran": patch_state(model).fused_ran if args.patched else None,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"{'patched' if args.patched else 'unpatched'}_rank{rank}.json"
    (args.out / name).write_text(json.dumps(result, indent=1))
    dist.barrier()
    if rank == 0:
        print(json.dumps({k: result[k] for k in ("patched", "median_step_ms_after_3", "peak_gib")}))
        print("runtime syncs:", profile.get("runtime_syncs"), "cpu ms", profile.get("cpu_ms"))
        for s in result["syncs"]:
            print(f"  {s['count']:3d}  {s['kind']}: {s['where']}")


if __name__ == "__main__":
    main()
