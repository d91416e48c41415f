"""What ``verify`` prints: one line per type, saying what its numbers are and the tolerance they
are held to, and a summary table of the statuses."""

from __future__ import annotations

from collections.abc import Sequence

from liger_patch.verify.verdicts import STATUS_SUMMARIES, STATUSES, Tolerance, Verdict

__all__ = ["legend", "line", "summary_table"]


def legend(tolerance: Tolerance) -> str:
    """What a line's numbers are, printed once before the lines."""
    return (
        "Each type: one training step patched against unpatched, from the same weights and batch. "
        "'loss' is the relative error of the patched loss, 'grad' the largest relative error over "
        f"the parameters' gradients; a type is verified when loss <= {tolerance.loss:.0e} and "
        f"grad <= {tolerance.grad:.0e}."
    )


def line(verdict: Verdict, tolerance: Tolerance) -> str:
    """``status task model_type`` then, when compared, both relative errors against their
    tolerances (``rel. error: loss 8.6e-08 <= 1e-05, grad 3.4e-07 <= 1e-04``); then the reason,
    when there is one."""
    errors = ""
    if verdict.loss_error is not None:
        errors = (
            f"  rel. error: loss {_judged(verdict.loss_error, tolerance.loss)},"
            f" grad {_judged(verdict.grad_error, tolerance.grad)}"
        )
    reason = f"  {verdict.reason}" if verdict.reason else ""
    return f"{verdict.status:15s} {verdict.task:18s} {verdict.model_type:28s}{errors}{reason}".rstrip()


def _judged(error: float | None, limit: float) -> str:
    """``8.6e-08 <= 1e-05`` or ``3.1e-02 > 1e-05``: the error and how it stands against its limit."""
    if error is None:
        return "n/a"
    return f"{error:.1e} {'<=' if error <= limit else '> '} {limit:.0e}"


def summary_table(verdicts: Sequence[Verdict]) -> list[str]:
    """Lines of a table: a row per status, a column per task of the verdicts and their total, and
    what the status means."""
    tasks = list(dict.fromkeys(v.task for v in verdicts))
    header = ["status", *tasks, "total", "meaning"]
    rows = [
        [
            status,
            *(str(sum(v.status == status and v.task == task for v in verdicts)) for task in tasks),
            str(sum(v.status == status for v in verdicts)),
            STATUS_SUMMARIES[status],
        ]
        for status in STATUSES
    ]
    totals = [str(sum(v.task == task for v in verdicts)) for task in tasks]
    rows.append(["all", *totals, str(len(verdicts)), ""])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    return [_row(cells, widths) for cells in [header, *rows]]


def _row(cells: list[str], widths: list[int]) -> str:
    """The status left-aligned, the counts right-aligned, the meaning last, unpadded."""
    status, *counts, meaning = cells
    padded = [status.ljust(widths[0]), *(c.rjust(w) for c, w in zip(counts, widths[1:], strict=True))]
    return "  ".join([*padded, meaning]).rstrip()
