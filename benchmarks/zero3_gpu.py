"""DeepSpeed through HF's Trainer or TRL's SFTTrainer on 2 GPUs: patched against unpatched step time, peak.

Each row is a Llama with a 128256 vocabulary trained with real DeepSpeed (ZeRO-3 without offload
by default; ``--stages`` adds ZeRO-2 and ZeRO-3 with the optimizer offloaded to the CPU) through
``transformers.Trainer`` (or TRL's ``SFTTrainer``, below), bf16, AdamW, 25 % of the labels
ignored, on rank 1 one micro-batch in each segment all-ignored (issue 28's set-up).

**One process pair, variants alternating.** The step of a ZeRO-3 model this size is bound by the
CPU (DeepSpeed's Python hooks), and separate launches of the same run differ by up to 20 % (CPU
placement, clocks): more than the effect measured. So each row is one ``torchrun`` launch whose
training alternates segments of ``--segment-steps`` steps: a warm-up segment, then
unpatched, patched, unpatched, patched, ... (``apply_liger_to`` / ``revert_liger`` between
segments, on the model the DeepSpeed engine holds). The first step of each segment is left out.

**Parity in the same run.** The learning rate is 0 (AdamW still runs every step, so the time
is the same) and every segment walks the same batches in the same order, so the j-th step of
every segment computes the loss and gradient norm of the same batch with the same weights:
each variant's are compared with the unpatched ones there. The run also checks what makes that
comparison sound: each rank's collator saw exactly the micro-batches planned for it (their ids
and trained-label counts, segment after segment), the fused op (``operator.FLCE``,
its calls counted) ran once per micro-batch on both ranks in every patched segment, with the
patch's ``fused_ran`` set, and never outside them.

**``--trainer sft``: TRL's ``SFTTrainer``** (default ``trainer``: the HF ``Trainer``). The same
rows, stages, variants and segments; SFTTrainer computes the loss through TRL's own fused LM head,
which liger_patch answers with the fused op when the model is patched (``liger_patch.integrations.trl``;
under ZeRO-3 its backward gathers the head again, ``gathered_backward``). The rows go in
pre-tokenized (``input_ids`` and a ``completion_mask``, 0 on the ignored labels, with
``completion_only_loss=True``): TRL builds the same labels and tokenizes nothing. ``max_length=None``
is needed, not only because the 2048-token rows would be truncated: with any ``max_length`` TRL
drops every row whose labels are all ignored, which shifts the batches of each segment against the
last and loses rank 1's all-ignored micro-batch (parity then fails). No packing, no padding-free
batches, no shuffling; gradient checkpointing off as in the Trainer rows (``zero3_trainers.py``).
TRL's per-step metrics (entropy, token accuracy, tokens) are kept in each step's record.

Per row (``"trainer"`` says which, so both can share a results file): the median step time of
each variant (wall clock from one step's start to the next; the Trainer waits for the GPU once a
step, in DeepSpeed's gradient-norm check), the peak allocated memory of each rank over the
variant's segments, and the parity figures.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python benchmarks/zero3_gpu.py --out docs/results/zero3.json
    PYTHONPATH=. python benchmarks/zero3_gpu.py --trainer sft --out docs/results/zero3_sft.json
    python benchmarks/zero3_gpu.py --rows h1024_l4 --trace DIR   # + chrome traces of one step
    PYTHONPATH=.:benchmarks python benchmarks/zero3_gpu.py --rows h1024_l4 \
        --variants unpatched,patched,patched@experiments.zero3_variants:no_label_sync  # a probe

``--smoke`` runs the same code on CPU (gloo, DeepSpeed's CPU accelerator, a tiny Llama): a
check of the script, no figures (``PYTHONPATH=$PWD python benchmarks/zero3_gpu.py --smoke
--trainer sft``). Exit status 1 when a parity check fails (after the JSON is written).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zero3_trainers import TRAINERS, OpCalls, build_trainer, planned_batches, training_arguments

_UNTIED, _TIED = dict(tie_word_embeddings=False), dict(tie_word_embeddings=True)
ROWS = {  # name: Llama config keywords, micro-batch, sequence length (Llama-3.2-1B: tied, 8 x 2048)
    "h1024_l4": (dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, **_UNTIED), 4, 1024),
    "h2048_l16": (dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, **_UNTIED), 4, 2048),
    "llama_3_2_1b": (dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, **_TIED), 8, 2048),
}
SMOKE_ROW = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, **_UNTIED), 2, 32)
_ZERO = {"overlap_comm": True, "contiguous_gradients": True}
STAGES = {
    "zero3": {"stage": 3, **_ZERO, "log_trace_cache_warnings": True},
    "zero2": {"stage": 2, **_ZERO},
    "zero3_offload": {"stage": 3, **_ZERO, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
}
LOSS_TOL, GRAD_NORM_RTOL = 2e-3, 1e-2  # same batch, same weights; bf16 logits rounded differently
TRL_METRICS = ("entropy", "mean_token_accuracy", "num_tokens")  # SFTTrainer's, kept per step


def llama(row: dict, vocab: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    heads = max(1, row["hidden_size"] // 64)
    config = LlamaConfig(
        vocab_size=vocab,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=64,
        attn_implementation="sdpa",
        **row,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def rows_for(world: int, vocab: int, batch: int, seq: int, steps: int, repeats: int) -> list[dict]:
    """The training rows in the order the ranks take them (accelerate deals micro-batch ``i`` of
    the list to rank ``i % world``): ``steps`` steps of random ids, the first quarter of each row
    ignored, rank 1's micro-batch of each segment's second step all ignored (the first step of a
    segment is not timed or compared); the same on every rank, ``repeats`` times."""
    import torch

    gen = torch.Generator().manual_seed(1)
    once = []
    for i in range(batch * steps * world):
        ids = torch.randint(0, vocab, (seq,), generator=gen)
        labels = ids.clone()
        labels[: seq // 4] = -100
        if i // batch == world + 1:
            labels[:] = -100
        once.append({"input_ids": ids, "labels": labels})
    return once * repeats


def _variant_switch(variant: str, model) -> contextlib.AbstractContextManager:
    """The variant on ``model`` for one segment: patched (``patched@MODULE:FUNCTION``: with a
    probe's change, undone by what the function returns) or not."""
    import liger_patch as lp

    stack = contextlib.ExitStack()
    name, _, setup = variant.partition("@")
    if setup:
        module, function = setup.split(":")
        stack.callback(getattr(importlib.import_module(module), function)())
    if name == "patched":
        lp.apply_liger_to(model)
        stack.callback(lp.revert_liger, model)
    return stack


class Segments:
    """What the Trainer's callback records: per step, its variant and start time; per segment,
    the peak memory, whether the fused path ran (the patch's flag) and how often the fused op
    was called (``ops``: an ``OpCalls``)."""

    def __init__(self, variants: list[str], steps: int, cuda: bool, ops) -> None:
        self.order = ["warm-up"] + variants * 1000
        self.steps, self.cuda, self.ops = steps, cuda, ops
        self.starts: list[tuple[str, float]] = []
        self.segments: list[dict] = []
        self._switch: contextlib.AbstractContextManager | None = None

    def variant_at(self, step: int) -> str:
        return self.order[step // self.steps]

    def begin(self, step: int, model) -> None:
        import torch

        variant = self.variant_at(step)
        if step % self.steps == 0:
            self.end_segment(model)
            self._switch = (
                _variant_switch(variant, model) if variant != "warm-up" else contextlib.nullcontext()
            )
            self._switch.__enter__()
            self.segments.append({"variant": variant, "op_calls": -self.ops.count})
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
        self.starts.append((variant, time.perf_counter()))

    def end_segment(self, model) -> None:
        import torch

        from liger_patch.patching.state import patch_state

        if self._switch is None:
            return
        segment = self.segments[-1]
        state = patch_state(model) if segment["variant"].startswith("patched") else None
        segment["fused_ran"] = None if state is None else bool(state.fused_ran)
        segment["op_calls"] += self.ops.count
        segment["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None
        self._switch.__exit__(None, None, None)
        self._switch = None


def clock(args, record: Segments, rank: int, cuda: bool, last_segments: int):
    """The callback that drives :class:`Segments` and takes the chrome traces (``--trace``: one
    step in the middle of each variant's last segment)."""
    import torch
    from transformers import TrainerCallback

    traced: dict = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, model=None, **kw):
            record.begin(state.global_step, model)
            step = state.global_step
            if args.trace and step >= last_segments and step % args.segment_steps == args.segment_steps // 2:
                traced["prof"] = torch.profiler.profile(with_stack=args.trace_stacks)
                traced["prof"].__enter__()

        def on_step_end(self, a, state, control, **kw):
            if "prof" in traced:
                if cuda:
                    torch.cuda.synchronize()
                prof = traced.pop("prof")
                prof.__exit__(None, None, None)
                variant = record.variant_at(state.global_step - 1).split(":")[-1]
                path = Path(args.trace) / f"trace_{args.stage}_{args.row}_{variant}_rank{rank}.json"
                prof.export_chrome_trace(str(path))
                subprocess.run(["gzip", "-f", str(path)], check=True)

        def on_train_end(self, a, state, control, model=None, **kw):
            if cuda:
                torch.cuda.synchronize()
            record.starts.append(("end", time.perf_counter()))
            record.end_segment(model)

    return Clock()


def deepspeed_config(stage: str, cuda: bool) -> dict:
    return {
        "zero_optimization": STAGES[stage],
        "bf16": {"enabled": cuda},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_force_ds_cpu_optimizer": False,  # torch's AdamW on the offloaded states: no JIT build
    }


def worker(args) -> None:
    """One row on this rank (started by torchrun); rank 0 writes its JSON."""
    import deepspeed
    import torch
    import torch.distributed as dist

    rank, world, cuda = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), not args.smoke
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")  # zero.Init needs it first
    row, batch, seq = SMOKE_ROW if args.smoke else ROWS[args.row]
    vocab = 1000 if args.smoke else 128256
    variants = args.variants.split(",")
    n_segments = 1 + args.rounds * len(variants)
    total_steps = n_segments * args.segment_steps
    arguments = training_arguments(args.trainer, cuda, batch, total_steps, deepspeed_config(args.stage, cuda))
    model = llama(row, vocab)  # after the arguments: ZeRO-3 builds it partitioned (zero.Init)
    record = Segments(variants, args.segment_steps, cuda, OpCalls())
    last_segments = total_steps - len(variants) * args.segment_steps  # where traced steps are
    data = rows_for(world, vocab, batch, seq, args.segment_steps, n_segments)
    callbacks = [clock(args, record, rank, cuda, last_segments)]
    trainer = build_trainer(args.trainer, model, arguments, data, callbacks)
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
    trainer.train()
    seen = trainer.data_collator.seen[:total_steps]
    mine = {
        "segments": record.segments,
        "batches_as_planned": seen == planned_batches(data, world, rank, batch),
        "trained_labels": [labels for _, labels in seen[: args.segment_steps]],
    }
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        result = {"steps": logged_steps(trainer.state.log_history, record.starts), "ranks": every}
        Path(args.result).write_text(json.dumps(result))
    leave_rank()


def leave_rank() -> None:
    """End this rank once every rank is done, skipping the interpreter's teardown: a rank
    sometimes aborts there ("terminate called without an active exception", exit -6) after all
    its work succeeded, DeepSpeed's shm comm op loaded (seen in the smoke, ZeRO-3 with offload)."""
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def logged_steps(log_history: list[dict], starts: list[tuple[str, float]]) -> list[dict]:
    """Per step: its variant, wall time, loss and gradient norm (and TRL's metrics, where it logs
    them), from the step's own log entry, found by its step number (TRL adds its metrics to that
    entry; the run's summary at the end has no ``loss``)."""
    logged = {e["step"]: e for e in log_history if "loss" in e and "grad_norm" in e}
    if sorted(logged) != list(range(1, len(starts))):
        raise RuntimeError(f"log entries for steps {sorted(logged)}, {len(starts) - 1} steps timed")
    steps = []
    for step, ((variant, t0), (_, t1)) in enumerate(zip(starts[:-1], starts[1:], strict=True), start=1):
        entry = logged[step]
        extra = {key: entry[key] for key in TRL_METRICS if key in entry}
        steps.append(
            {"variant": variant, "ms": 1e3 * (t1 - t0), "loss": entry["loss"],
             "grad_norm": float(entry["grad_norm"]), **extra}
        )  # fmt: skip
    return steps


def launch(args, row: str, stage: str) -> dict:
    """One row: ``torchrun`` on 2 processes; returns its JSON."""
    result = Path(tempfile.mkdtemp()) / "run.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__, "--worker",
               "--row", row, "--stage", stage, "--variants", args.variants, "--rounds", str(args.rounds),
               "--segment-steps", str(args.segment_steps), "--trainer", args.trainer,
               "--result", str(result)]  # fmt: skip
    command += ["--smoke"] if args.smoke else []
    command += ["--trace", args.trace] if args.trace else []
    command += ["--trace-stacks"] if args.trace_stacks else []
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    if args.smoke:
        env["DS_ACCELERATOR"] = "cpu"
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not result.exists():
        print(done.stdout[-3000:], done.stderr[-6000:], sep="\n", file=sys.stderr)
        return {"error": f"exit {done.returncode}", "stderr_tail": done.stderr[-2000:]}
    out = json.loads(result.read_text())
    out["wall_s"] = round(time.perf_counter() - started, 1)
    # DeepSpeed drops its prefetch plan when the modules run in another order than it recorded
    out["deepspeed_invalidated_trace"] = sum(
        "nvalidate trace cache" in line for line in done.stdout.splitlines()
    )
    return out


def summarise(row: str, stage: str, trainer: str, variants: list[str], run: dict, segment_steps: int) -> dict:
    """The row's figures: per variant, the median over its steps (each segment's first left out),
    the peak of each rank over its segments, and parity with the unpatched steps of the same batch;
    and whether every rank walked the batches planned and the op ran in patched segments only."""
    out: dict = {"row": row, "stage": stage, "trainer": trainer}
    if "error" in run:
        return {**out, **run}
    steps, ranks = run["steps"], run["ranks"]
    steady = [(i % segment_steps, s) for i, s in enumerate(steps) if i % segment_steps]
    base = {j: s for j, s in steady if s["variant"] == "unpatched"}
    ok = True
    for variant in variants:
        mine = [(j, s) for j, s in steady if s["variant"] == variant]
        segments = [[g for g in rank["segments"] if g["variant"] == variant] for rank in ranks]
        out[f"{variant}_step_ms"] = statistics.median(s["ms"] for _, s in mine)
        out[f"{variant}_peak_gib_per_rank"] = [max(g["peak_gib"] or 0.0 for g in rank) for rank in segments]
        if variant != "unpatched":
            out[f"{variant}_parity"] = parity(mine, base, segments, segment_steps)
            ok &= out[f"{variant}_parity"]["ok"]
            out[f"{variant}_over_unpatched"] = out[f"{variant}_step_ms"] / out["unpatched_step_ms"]
            out[f"{variant}_over_unpatched_paired"] = paired_ratios(steps, variant, segment_steps)
    out["op_calls_unpatched"] = sum(
        g["op_calls"] for rank in ranks for g in rank["segments"] if not g["variant"].startswith("patched")
    )
    out["batches_as_planned"] = all(rank["batches_as_planned"] for rank in ranks)
    out["trained_labels_per_rank"] = [rank["trained_labels"] for rank in ranks]  # first segment's steps
    out["parity_ok"] = ok and out["op_calls_unpatched"] == 0 and out["batches_as_planned"]
    for key in ("deepspeed_invalidated_trace", "wall_s", "steps"):
        out[key] = run[key]
    return out


def paired_ratios(steps: list[dict], variant: str, segment_steps: int) -> dict:
    """Each segment of ``variant`` against its unpatched neighbours: its median step over the mean
    of the medians of the nearest unpatched segments before and after it. The step time drifts
    during a launch (segments of one variant differed by 10 %), which the medians over the whole
    run mix into the ratio; neighbours share the drift. The median, least and largest ratio."""
    medians = [
        (steps[i]["variant"], statistics.median(s["ms"] for s in steps[i + 1 : i + segment_steps]))
        for i in range(0, len(steps) - segment_steps + 1, segment_steps)
    ]
    base = [k for k, (name, _) in enumerate(medians) if name == "unpatched"]
    ratios = []
    for k, (name, ms) in enumerate(medians):
        if name != variant:
            continue
        near = [max((b for b in base if b < k), default=None), min((b for b in base if b > k), default=None)]
        ref = [medians[b][1] for b in near if b is not None]
        ratios.append(ms / statistics.mean(ref))
    return {
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "segments": len(ratios),
    }


def parity(mine: list, base: dict, segments: list[list[dict]], segment_steps: int) -> dict:
    """A variant's steps against the unpatched steps of the same batch (``mine`` and ``base`` keyed
    by the step's place in its segment), and whether the fused path ran in each of its segments
    on every rank: the patch's flag set (``fused_ran``), and the op called once per micro-batch
    (``op_calls``: the counts its segments had, ``[segment_steps]`` when so)."""
    loss = max(abs(s["loss"] - base[j]["loss"]) for j, s in mine)
    norm = max(abs(s["grad_norm"] - base[j]["grad_norm"]) / base[j]["grad_norm"] for j, s in mine)
    ran = all(g["fused_ran"] for rank in segments for g in rank)
    calls = sorted({g["op_calls"] for rank in segments for g in rank})
    ok = loss <= LOSS_TOL and norm <= GRAD_NORM_RTOL and ran and calls == [segment_steps]
    figures = {"max_loss_diff": loss, "max_grad_norm_rel_diff": norm, "fused_ran": ran, "op_calls": calls}
    return {**figures, "ok": ok}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--stages", default="zero3")
    parser.add_argument("--variants", default="unpatched,patched",
                        help="unpatched, patched, or patched@MODULE:FUNCTION (a probe's set-up)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=4, help="segments of each variant")
    parser.add_argument("--segment-steps", type=int, default=6)
    parser.add_argument("--trace", help="folder for chrome traces of one step per variant")
    parser.add_argument("--trace-stacks", action="store_true", help="with Python stacks (slows the step)")
    parser.add_argument("--trainer", choices=TRAINERS, default="trainer",
                        help="trainer: transformers' Trainer; sft: TRL's SFTTrainer")  # fmt: skip
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    import torch

    variants = args.variants.split(",")
    if variants[0] != "unpatched":
        parser.error("--variants must start with unpatched (the parity reference)")
    table = []
    for stage in args.stages.split(","):
        for row in args.rows.split(","):
            run = launch(args, row, stage)
            summary = summarise(row, stage, args.trainer, variants, run, args.segment_steps)
            table.append(summary)
            print(
                json.dumps({k: v for k, v in summary.items() if k not in ("steps", "stderr_tail")}),
                flush=True,
            )
    result = {
        "script": "benchmarks/zero3_gpu.py",
        "command": " ".join(sys.argv),
        "device": "cpu (smoke)" if args.smoke else f"2x {torch.cuda.get_device_name(0)}",
        "torch": torch.__version__,
        "versions": _versions(),
        "trainer": args.trainer,
        "segment_steps": args.segment_steps,
        "rounds": args.rounds,
        "rows": table,
        "parity_ok": all(r.get("parity_ok") for r in table),
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0 if result["parity_ok"] else 1


def _versions() -> dict:
    from importlib.metadata import version

    names = ("transformers", "deepspeed", "accelerate", "triton", "trl")
    return {name: version(name) for name in names}


if __name__ == "__main__":
    sys.exit(main())
