"""Changes to the patched path that ``benchmarks/zero3_gpu.py`` times against the shipped one.

Each function here is a ``--variants ...,patched@experiments.zero3_variants:NAME`` set-up: every
rank runs it at the start of each of that variant's segments and calls what it returns at the end
(the undo). They answer "what does this part of the patched path cost under ZeRO-3", not what to
ship (a variant may drop a check the op needs):

    PYTHONPATH=.:benchmarks python benchmarks/zero3_gpu.py --rows h1024_l4 \
        --variants unpatched,patched,patched@experiments.zero3_variants:no_label_sync
"""

from __future__ import annotations

from collections.abc import Callable


def no_label_sync() -> Callable[[], None]:
    """The op without its one host sync: the label check reports every row kept, so no sync and
    no skipping of ignored rows (every row goes through the kernels, ignored ones masked there).
    Labels are not range-checked in this variant."""
    from liger_patch.ops.core import validation

    original = validation.check_values
    validation.check_values = lambda labels, vocab, ignore_index, divisor=None: labels.numel()

    def undo() -> None:
        validation.check_values = original

    return undo


def never_wait_to_skip() -> Callable[[], None]:
    """The op that never waits for its label check to skip the ignored rows (issue 43): every
    forward walks every row, ignored ones weighing 0, and its check is read later
    (``kept_rows``), as ``Tuning.wait_to_skip_gflop`` = inf would make it. The shipped op waits
    where that saves at least 400 GFLOP of its GEMMs."""
    from liger_patch.ops.core.tuning import Tuning

    original = Tuning.waits_to_skip
    Tuning.waits_to_skip = lambda self, ignored_share, work_gflop: False

    def undo() -> None:
        Tuning.waits_to_skip = original

    return undo


def memory_at_peak() -> Callable[[], None]:
    """Record the allocator's history over the segment (this rank's GPU); at its end, replay it to
    the moment the bytes allocated during the segment peak and write what is alive then, summed
    by where it was allocated (``experiments.peak_blocks``' replay), to
    ``$ZERO3_PEAK_DIR/peak_rank{RANK}_{n}.json``. Changes nothing the step computes."""
    import json
    import os
    from pathlib import Path

    import torch
    from experiments.peak_blocks import live_at_peak

    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")

    def undo() -> None:
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snapshot["device_traces"][torch.cuda.current_device()]
        peak, at_peak = live_at_peak(trace)
        by_site: dict[str, list[int]] = {}
        for size, where in at_peak:
            entry = by_site.setdefault(where, [0, 0])
            entry[0] += size
            entry[1] += 1
        top = sorted(by_site.items(), key=lambda kv: -kv[1][0])[:40]
        out = Path(os.environ.get("ZERO3_PEAK_DIR", "/tmp"))
        out.mkdir(parents=True, exist_ok=True)
        n = len(list(out.glob(f"peak_rank{os.environ['RANK']}_*.json")))
        summary = {
            "peak_over_segment_start_gib": peak / 2**30,
            "live_blocks": len(at_peak),
            "events": len(trace),
            "top_sites": [{"where": w, "gib": b / 2**30, "blocks": c} for w, (b, c) in top],
        }
        (out / f"peak_rank{os.environ['RANK']}_{n}.json").write_text(json.dumps(summary, indent=1))

    return undo


def budget(value: str) -> Callable[[], Callable[[], None]]:
    """A set-up that runs the patched op at memory budget ``value`` (``LIGER_MEMORY_BUDGET``, which
    the op reads on every call) instead of the patched forward's ``"batch"``."""

    def setup() -> Callable[[], None]:
        import os

        before = os.environ.get("LIGER_MEMORY_BUDGET")
        os.environ["LIGER_MEMORY_BUDGET"] = value

        def undo() -> None:
            if before is None:
                os.environ.pop("LIGER_MEMORY_BUDGET", None)
            else:
                os.environ["LIGER_MEMORY_BUDGET"] = before

        return undo

    return setup


budget_1gib = budget("1GiB")
budget_lean = budget("lean")
budget_512mib = budget("512MiB")


def loss_check() -> Callable[[], None]:
    """The patched forward without its label check begun ahead (``patching/labels_ahead.py``): the
    loss's own call queues it after the model's body, as before a95a68a, so a forward that waits
    for it to skip the ignored rows waits for the body's GPU work too. The results are the same."""
    from liger_patch.patching import forward

    original = forward.begin_labels_ahead
    forward.begin_labels_ahead = lambda head, state, call: None

    def undo() -> None:
        forward.begin_labels_ahead = original

    return undo
