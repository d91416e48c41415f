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
    from liger_patch.ops import validation

    original = validation.check_values
    validation.check_values = lambda labels, vocab, ignore_index, divisor=None: labels.numel()

    def undo() -> None:
        validation.check_values = original

    return undo
