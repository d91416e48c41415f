"""Context parallelism on 2 GPUs: the HF Trainer with accelerate's ``ParallelismConfig(cp_size=2)``
(FSDP2 over the two ranks, SDPA ring attention), patched against unpatched.

Launch (one node, 2 GPUs, nccl):

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/cp_gpu.py --out DIR

Both ranks get the same batches; each runs the model on its shard of every sequence
(``input_ids``, ``labels``, ``shift_labels``, ``position_ids``, cut by torch's load-balanced
``context_parallel``) with ``num_items_in_batch`` counted on the whole batch
(tests/integrations/test_context_parallel.py checks those calls on CPU). A Llama of hidden 1024,
4 layers, 16 heads (as many key-value heads: grouped-query SDPA under CP is left out), vocab
128256, untied head, random init with a fixed seed, fp32 parameters trained with ``bf16=True``
(FSDP2 mixed precision), AdamW, sequences of 4096 tokens (2 per step, 2048 tokens of each per
rank), ``--steps`` steps, unpatched and patched (``LigerPatchCallback``) on the same data, in
``--rounds`` rounds of one run each, the order alternating from round to round.

Written to DIR/cp_gpu.json (rank 0): the versions; the keyword arguments the model received on
each rank (first call); per variant the per-step losses (the Trainer's per-rank losses averaged
over the ranks, as it logs them), grad norms (before clipping), every rank's step times, peak
memory (allocated and reserved, the whole run, AdamW states included) and whether the fused
path ran in every step, all of the first round; then ``parity_ok`` (every step's loss within
``LOSS_TOL`` and grad norm within ``GRAD_NORM_TOL`` relative, the fused path on both ranks in
every step, never in the unpatched run, every rank's first call a shard with ``shift_labels``),
``patched_step_ms`` /
``unpatched_step_ms`` (the median over rounds of the slower rank's median after ``--warmup``
steps; each round's in ``round_step_ms``), ``patched_over_unpatched_paired`` (the median over
rounds of patched / unpatched in the same round), and
``full_sequence_check``: step 0's loss of both runs against the unpatched model's loss on the
whole first batch on one GPU without CP (reported, not part of ``parity_ok``). Exit 1 when
parity fails, 2 when this environment cannot run CP (versions printed first, the reason in the
JSON); a crash leaves DIR/error_rank<r>.txt.

``--smoke`` runs the same code on CPU (gloo, tiny shapes, no bf16). accelerate keeps FSDP off on
CPU, so the ranks are DDP; torch's ring attention needs CUDA's SDPA kernels, so there the
buffers are sharded by ``context_parallel`` as on GPU but attention stays local to the shard.
It checks the script, not CP:

    PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/cp_gpu.py --smoke --out /tmp/cp_smoke
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LOSS_TOL, GiB, alternating_rounds, log, write_json  # noqa: E402

CP_SIZE = 2
GRAD_NORM_TOL = 5e-2  # relative, per step (bf16 patched vs unpatched)
MIN_ACCELERATE = (1, 12)  # transformers' Trainer refuses parallelism_config below it

SHAPE = dict(
    vocab_size=128256,
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
SMOKE_SHAPE = dict(SHAPE, vocab_size=1031, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                   max_position_embeddings=256)  # fmt: skip


# --------------------------------------------------------------------------------------------
# environment
# --------------------------------------------------------------------------------------------


def versions() -> dict:
    """Versions of what the run depends on (``None`` for a package that is not there)."""
    found = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "accelerate", "liger_patch", "triton"):
        try:
            found[name] = __import__(name).__version__
        except Exception:  # a missing or broken package: reported, judged by cp_support
            found[name] = None
    return found


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in text.split(".")[:2])


def cp_support(found: dict, smoke: bool) -> str | None:
    """Why this environment cannot run the Trainer with CP, or ``None`` when it can."""
    if found["accelerate"] is None or found["transformers"] is None:
        return "transformers and accelerate must be installed"
    if _version_tuple(found["accelerate"]) < MIN_ACCELERATE:
        need = ".".join(map(str, MIN_ACCELERATE))
        return f"accelerate {found['accelerate']} is too old: the Trainer needs accelerate>={need} for CP"
    try:
        from accelerate import ParallelismConfig  # noqa: F401
    except ImportError:
        return f"accelerate {found['accelerate']} has no ParallelismConfig"
    from transformers import Trainer, TrainingArguments

    if "parallelism_config" not in getattr(TrainingArguments, "__dataclass_fields__", {}):
        return f"transformers {found['transformers']}: TrainingArguments takes no parallelism_config"
    if not hasattr(Trainer, "_prepare_context_parallel_inputs"):
        return f"transformers {found['transformers']}: the Trainer does not shard inputs for CP"
    try:
        from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no context_parallel"
    if int(os.environ.get("WORLD_SIZE", 1)) != CP_SIZE:
        return f"WORLD_SIZE is not {CP_SIZE}: launch with torchrun --nproc-per-node {CP_SIZE}"
    if not smoke and torch.cuda.device_count() < CP_SIZE:
        return f"{CP_SIZE} CUDA GPUs needed, found {torch.cuda.device_count()} (use --smoke on CPU)"
    return None


def init(smoke: bool) -> torch.device:
    """The process group (accelerate adopts it) and this rank's device."""
    if smoke:
        device, backend, options = torch.device("cpu"), "gloo", {}
    else:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
        options = {"device_id": device}
    # first steps compile Triton kernels on one rank while the other waits: 10 minutes
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10), **options)
    warnings.filterwarnings("ignore", message=".*liger_patch.*")
    return device


def cp_on_cpu() -> None:
    """``--smoke`` only, two stand-ins that let the GPU code path run on CPU: accelerate's
    ``ParallelismConfig`` check lets a multi-process CPU run (DDP over gloo) through, which it
    refuses as not "multi-device"; and torch's ``context_parallel`` shards the buffers but leaves
    SDPA alone (its ring attention runs only CUDA's flash / efficient / cuDNN kernels)."""
    from accelerate import ParallelismConfig
    from torch.distributed.tensor.experimental._context_parallel import _attention

    validate = ParallelismConfig._validate_accelerator

    def validate_but_cpu(self, accelerator):
        try:
            validate(self, accelerator)
        except ValueError as error:
            if "MULTI_CPU" not in str(error):
                raise

    ParallelismConfig._validate_accelerator = validate_but_cpu
    _attention._enable_context_parallel_dispatcher_impl = lambda seq_dim, mesh: None
    _attention._disable_context_parallel_dispatcher_impl = lambda: None


# --------------------------------------------------------------------------------------------
# one training run
# --------------------------------------------------------------------------------------------


class TokenRows(torch.utils.data.Dataset):
    """Random token rows, the same on every rank; the first eighth of each an ignored prompt."""

    def __init__(self, rows: int, seq: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (rows, seq), generator=g)
        self.labels = self.ids.clone()
        self.labels[:, : seq // 8] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def describe(value) -> dict | str:
    """A keyword argument as JSON: a tensor's shape and dtype (and a few positions), else its repr."""
    if not torch.is_tensor(value):
        return repr(value)
    out = {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
    if value.dim() == 0:
        out["value"] = value.item()
    elif value.dim() == 2 and not value.is_floating_point():
        row = value[0].tolist()
        out["row0_head_tail"] = row[:3] + ["..."] + row[-3:] if len(row) > 6 else row
    return out


def make_callback(device: torch.device):
    """Per-step wall time (synchronised) and whether the fused op ran in the step."""
    from transformers import TrainerCallback

    from liger_patch.patching.state import patch_state

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    class StepRecorder(TrainerCallback):
        def __init__(self) -> None:
            self.ms: list[float] = []
            self.fused: list[bool] = []

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            sync()
            self.ms.append((time.perf_counter() - self.start) * 1e3)
            patch = patch_state(model)
            self.fused.append(bool(patch is not None and patch.fused_ran))

    return StepRecorder()


def build_model(shape: dict, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**shape, attn_implementation="sdpa", use_cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LlamaForCausalLM(config)  # fp32, on the CPU: the same weights on every rank
    return model.train()


def training_args(variant: str, args, smoke: bool):
    from accelerate import ParallelismConfig
    from transformers import TrainingArguments

    sharding = {}
    if not smoke:  # accelerate runs CP with FSDP2 only (on CPU it keeps DDP)
        os.environ["FSDP_VERSION"] = "2"  # transformers versions that read the version from the env
        sharding = dict(
            fsdp="full_shard",
            fsdp_config={
                "version": 2,
                "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                "reshard_after_forward": True,
            },
        )
    return TrainingArguments(
        output_dir=str(args.workdir / variant),
        parallelism_config=ParallelismConfig(cp_size=CP_SIZE),
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        data_seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
        average_tokens_across_devices=True,
        remove_unused_columns=False,
        bf16=not smoke,
        use_cpu=smoke,
        **sharding,
    )


def gather(value) -> list:
    """``value`` from every rank, in rank order."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def make_trainer(variant: str, model, callbacks: list, args):
    """The HF Trainer on ``TokenRows`` in their order (step k trains on rows k*batch...),
    keeping each training step's loss (this rank's, as the Trainer returns it)."""
    from transformers import Trainer

    class RecordingTrainer(Trainer):
        def _get_train_sampler(self, *a, **kw):
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def training_step(self, *a, **kw):
            loss = super().training_step(*a, **kw)
            self.step_losses.append(loss.detach().float().reshape(()))
            return loss

    trainer = RecordingTrainer(
        model=model,
        args=training_args(variant, args, args.smoke),
        train_dataset=TokenRows(args.steps * args.batch, args.seq, model.config.vocab_size, args.seed),
        callbacks=callbacks,
    )
    trainer.step_losses = []
    return trainer


def train(variant: str, device: torch.device, args) -> dict:
    """One Trainer run (``variant`` "unpatched" or "patched"); what every rank saw, gathered."""
    import liger_patch as lp

    log(f"training {variant}")
    model = build_model(SMOKE_SHAPE if args.smoke else SHAPE, args.seed)
    first_call: dict = {}

    def record_call(module, call_args, call_kwargs):
        if not first_call:
            first_call.update({name: describe(value) for name, value in call_kwargs.items()})

    model.register_forward_pre_hook(record_call, with_kwargs=True)
    recorder = make_callback(device)
    callbacks = [lp.LigerPatchCallback(), recorder] if variant == "patched" else [recorder]
    trainer = make_trainer(variant, model, callbacks, args)
    if device.type == "cuda":
        allocated_before = torch.cuda.memory_allocated(device) / GiB  # what an earlier run left behind
        torch.cuda.reset_peak_memory_stats(device)
    trainer.train()
    losses = torch.stack(trainer.step_losses).to(device)
    dist.all_reduce(losses)  # each rank's loss is scaled by the process count: the mean is the step's loss
    history = trainer.state.log_history
    run = {
        "losses": (losses / dist.get_world_size()).tolist(),
        "trainer_logged_losses": [e["loss"] for e in history if "loss" in e],
        "grad_norms": [e["grad_norm"] for e in history if "grad_norm" in e],
        "step_ms_per_rank": gather(recorder.ms),
        "fused_path_ran_per_rank": gather(recorder.fused),
        "first_call_kwargs_per_rank": gather(first_call),
    }
    run["median_step_ms_per_rank"] = [
        statistics.median(ms[args.warmup :] or ms) for ms in run["step_ms_per_rank"]
    ]
    run["median_step_s"] = max(run["median_step_ms_per_rank"]) / 1e3  # the slower rank sets the step
    if device.type == "cuda":
        run["allocated_before_gib_per_rank"] = gather(allocated_before)
        run["peak_allocated_gib_per_rank"] = gather(torch.cuda.max_memory_allocated(device) / GiB)
        run["peak_reserved_gib_per_rank"] = gather(torch.cuda.max_memory_reserved(device) / GiB)
    del trainer, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dist.barrier()
    return run


VARIANTS = ("unpatched", "patched")


def step_times(unpatched: dict, patched: dict) -> dict:
    """Each variant's step time (the median over rounds of the slower rank's median step), each
    round's, and the paired ratio: the median over rounds of patched / unpatched in that round,
    from ``alternating_rounds``' records."""
    ratios = patched["round_ratios"]
    records = {"unpatched": unpatched, "patched": patched}
    return {
        "round_step_ms": {v: [s * 1e3 for s in r["round_step_s"]] for v, r in records.items()},
        **{f"{v}_step_ms": r["median_step_s"] * 1e3 for v, r in records.items()},
        "patched_over_unpatched_paired": {
            "median": patched["paired_ratio"],
            "min": min(ratios),
            "max": max(ratios),
            "rounds": len(ratios),
        },
    }


def full_sequence_loss(device: torch.device, args) -> float:
    """Step 0's loss without CP: the unpatched model on the whole first batch on this one device
    (bf16 autocast on GPU, as the Trainer's forward), to set against the CP runs' step 0."""
    model = build_model(SMOKE_SHAPE if args.smoke else SHAPE, args.seed).to(device)
    rows = TokenRows(args.steps * args.batch, args.seq, model.config.vocab_size, args.seed)
    batch = {"input_ids": rows.ids[: args.batch].to(device), "labels": rows.labels[: args.batch].to(device)}
    with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        loss = model(**batch).loss.float().item()
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return loss


# --------------------------------------------------------------------------------------------
# the comparison
# --------------------------------------------------------------------------------------------


def got_shards(run: dict, seq: int) -> bool:
    """Every rank's first call had ``shift_labels`` and a ``seq / cp`` shard of the sequence."""
    return all(
        "shift_labels" in call and call.get("input_ids", {}).get("shape", [0, 0])[1] == seq // CP_SIZE
        for call in run["first_call_kwargs_per_rank"]
    )


def compare(unpatched: dict, patched: dict, steps: int, seq: int) -> dict:
    """Per-step differences and the verdict."""
    loss_diffs = [abs(p - u) for p, u in zip(patched["losses"], unpatched["losses"], strict=True)]
    norm_diffs = [
        abs(p - u) / max(abs(u), 1e-12)
        for p, u in zip(patched["grad_norms"], unpatched["grad_norms"], strict=True)
    ]
    fused_everywhere = all(all(ranks) and len(ranks) == steps for ranks in patched["fused_path_ran_per_rank"])
    never_fused_unpatched = not any(any(ranks) for ranks in unpatched["fused_path_ran_per_rank"])
    checks = {
        "all_steps_ran": len(loss_diffs) == steps and len(norm_diffs) == steps,
        "every_rank_got_a_shard": got_shards(unpatched, seq) and got_shards(patched, seq),
        "losses_finite": all(map(_finite, patched["losses"] + unpatched["losses"])),
        "losses_within_tol": all(d <= LOSS_TOL for d in loss_diffs),
        "grad_norms_within_tol": all(d <= GRAD_NORM_TOL for d in norm_diffs),
        "fused_path_ran_on_every_rank_and_step": fused_everywhere,
        "unpatched_never_fused": never_fused_unpatched,
    }
    return {
        "loss_abs_diff_per_step": loss_diffs,
        "grad_norm_rel_diff_per_step": norm_diffs,
        "max_loss_abs_diff": max(loss_diffs, default=float("nan")),
        "max_grad_norm_rel_diff": max(norm_diffs, default=float("nan")),
        "checks": checks,
        "parity_ok": all(checks.values()),
    }


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def print_summary(result: dict) -> None:
    u, p, c = result["unpatched"], result["patched"], result["comparison"]
    log(f"\n{'step':>4} {'loss unpatched':>15} {'loss patched':>13} {'grad norm u':>12} {'grad norm p':>12}")
    # strict=False: a run that stopped short still prints its steps
    rows = zip(u["losses"], p["losses"], u["grad_norms"], p["grad_norms"], strict=False)
    for i, (loss_u, loss_p, norm_u, norm_p) in enumerate(rows):
        log(f"{i:>4} {loss_u:>15.5f} {loss_p:>13.5f} {norm_u:>12.4f} {norm_p:>12.4f}")
    log(f"max |dloss| {c['max_loss_abs_diff']:.2e} (tol {LOSS_TOL}), max grad-norm rel diff "
        f"{c['max_grad_norm_rel_diff']:.2e} (tol {GRAD_NORM_TOL}); checks {c['checks']}")  # fmt: skip
    times = (result["unpatched_step_ms"], result["patched_step_ms"])
    paired = result["patched_over_unpatched_paired"]
    log("median step: unpatched {:.1f} ms, patched {:.1f} ms".format(*times)
        + f"; patched / unpatched paired {paired['median']:.3f} over {paired['rounds']} rounds")  # fmt: skip
    for name, run in (("unpatched", u), ("patched", p)):
        if "peak_allocated_gib_per_rank" in run:
            peaks = ", ".join(f"{x:.2f}" for x in run["peak_allocated_gib_per_rank"])
            log(f"peak allocated GiB per rank, {name}: {peaks}")
    log(f"step 0 against the whole sequence without CP: {result['full_sequence_check']}")
    log(f"rank 0's first call (patched): {p['first_call_kwargs_per_rank'][0]}")
    log(f"parity {'passed' if result['parity_ok'] else 'FAILED'}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for cp_gpu.json")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/liger_patch_cp_gpu"), help="Trainer runs")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the median step time")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step (the same on both ranks)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=4, help="runs of each variant, alternating (>= 1)")
    parser.add_argument("--smoke", action="store_true", help="CPU + gloo + tiny shapes: check the script")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.seq = min(args.steps, 5), min(args.warmup, 2), min(args.seq, 64)
        args.rounds = min(args.rounds, 2)
    return args


def run(args, found: dict) -> int:
    device = init(args.smoke)
    if args.smoke:
        cp_on_cpu()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"device {name} x {dist.get_world_size()}, cp {CP_SIZE}, {args.batch} x {args.seq} tokens per step")
    result = {"versions": found, "device": name, "world_size": dist.get_world_size(), "cp_size": CP_SIZE}
    result.update(
        mode="smoke (CPU, DDP, local attention)" if args.smoke else "gpu (FSDP2, ring attention)",
        model=SMOKE_SHAPE if args.smoke else SHAPE,
        parameters="fp32, bf16 mixed precision" if not args.smoke else "fp32",
        sequences_per_step=args.batch,
        seq_len=args.seq,
        tokens_per_rank_per_step=args.batch * args.seq // CP_SIZE,
        steps=args.steps,
        warmup_steps=args.warmup,
        tolerances={"loss_abs": LOSS_TOL, "grad_norm_rel": GRAD_NORM_TOL},
    )
    log("step 0 without CP")
    reference = full_sequence_loss(device, args)
    # unpatched and patched in --rounds rounds, the order alternating: a drift of the machine
    # over the launch falls on both alike (separate launches differed by up to 40 %)
    unpatched, patched = alternating_rounds(lambda p: train(VARIANTS[p], device, args), args.rounds)
    result.update(unpatched=unpatched, patched=patched)  # the first round's runs, for the parity
    result["full_sequence_check"] = {
        "step0_loss_without_cp": reference,
        **{f"{v}_step0_minus_it": result[v]["losses"][0] - reference for v in ("unpatched", "patched")},
        "meaningful": not args.smoke,  # the smoke's attention sees only the shard
    }
    result["comparison"] = compare(result["unpatched"], result["patched"], args.steps, args.seq)
    result["parity_ok"] = result["comparison"]["parity_ok"]
    result.update(step_times(unpatched, patched))
    if dist.get_rank() == 0:
        write_json(args.out / "cp_gpu.json", result, indent=2)
    print_summary(result)
    log(f"wrote {args.out / 'cp_gpu.json'}")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if result["parity_ok"] else 1


def main() -> int:
    args = parse_args()
    rank = int(os.environ.get("RANK", 0))
    found = versions()
    if rank == 0:
        print(f"versions: {found}", flush=True)
    problem = cp_support(found, args.smoke)
    if problem is not None:
        if rank == 0:
            print(f"cp_gpu.py cannot run here: {problem}", file=sys.stderr, flush=True)
            write_json(args.out / "cp_gpu.json", {"error": problem, "versions": found}, indent=2)
        return 2
    try:
        return run(args, found)
    except BaseException:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    sys.exit(main())
