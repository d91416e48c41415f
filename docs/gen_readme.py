"""Write README.md's generated blocks from committed results, so that every figure the README
quotes comes from a file under docs/results/ (tests/test_docs.py checks them).

python docs/gen_readme.py          # rewrite the blocks in README.md
python docs/gen_readme.py --check  # exit 1 if a block is stale

A block sits between ``<!-- begin generated: NAME ... -->`` and ``<!-- end generated: NAME -->``:

- ``headline``: training-step time and peak memory, unpatched / liger-kernel / liger_patch, at
  three rows of ``benchmarks/e2e.py``'s results (``docs/results/e2e.json``, ``e2e_amp.json``),
  with the card and torch they ran on.
- ``test-times``: how long the whole test suite and the quick subset took, and the quick
  subset's command (``docs/results/test_times.json``).
"""

from __future__ import annotations

import json
import pathlib
import re
import statistics
import sys
import textwrap
from collections.abc import Callable

DOCS = pathlib.Path(__file__).parent
RESULTS = DOCS / "results"
README = DOCS.parent / "README.md"

HEADLINE_ROWS = (
    ("e2e.json", "llama1b_8x2048", "Llama-3.2-1B, 8 × 2048"),
    ("e2e.json", "qwen05b_16x2048", "Qwen2.5-0.5B, 16 × 2048"),
    ("e2e_amp.json", "qwen05b_amp_8x2048", "Qwen2.5-0.5B, 8 × 2048, AMP (fp32 weights)"),
)
"""(results file, ``e2e.py`` row, label) of each row of the README's table."""

VARIANTS = (("unpatched", "unpatched"), ("liger_kernel", "liger-kernel"), ("liger_patch", "liger_patch"))
"""(``e2e.py`` variant, column heading), in the table's order."""


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def step_figures(results: dict, row: str, variant: str) -> tuple[float, float]:
    """(median step ms, peak GiB) of a variant on a row: the median over the variant's runs
    (e2e.py interleaves two runs of each patch), the highest peak of them."""
    runs = [r for r in results["results"] if r["row"] == row and r["variant"] == variant]
    if not runs:
        raise ValueError(f"no {variant} run of {row} in the results")
    return statistics.median(r["ms"] for r in runs), max(r["peak_gib"] for r in runs)


def first_loss_gap(results: dict, row: str) -> float:
    """The largest difference of a liger_patch run's first-step loss from the unpatched one's."""
    runs = [r for r in results["results"] if r["row"] == row]
    (unpatched,) = [r["first_loss"] for r in runs if r["variant"] == "unpatched"]
    return max(abs(r["first_loss"] - unpatched) for r in runs if r["variant"] == "liger_patch")


def _where(files: dict[str, dict]) -> str:
    """The card and torch the results ran on: one phrase when all files agree, else each's."""
    places = {(f["device"], f["torch"]) for f in files.values()}
    if len(places) == 1:
        device, torch_version = places.pop()
        return f"one {device} (torch {torch_version})"
    return "; ".join(f"`{name}`: {f['device']} (torch {f['torch']})" for name, f in files.items())


def headline() -> list[str]:
    """The README's results table and the sentences around it."""
    files = {name: _load(name) for name in dict.fromkeys(name for name, _, _ in HEADLINE_ROWS)}
    header = ["model shape, tokens per step", *(heading for _, heading in VARIANTS)]
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, row, label in HEADLINE_ROWS:
        cells = [label]
        for variant, _ in VARIANTS:
            ms, gib = step_figures(files[name], row, variant)
            cells.append(f"{ms:.0f} ms, {gib:.1f} GiB")
        table.append("| " + " | ".join(cells) + " |")
    gap = max(first_loss_gap(files[name], row) for name, row, _ in HEADLINE_ROWS)
    sources = " and ".join(f"`docs/results/{name}`" for name in files)
    intro = (
        "One AdamW training step of a randomly initialised model of each shape, bf16, only the head "
        f"and loss patched (`benchmarks/e2e.py`): median step time and peak GPU memory, on {_where(files)}."
    )
    after = (
        f"The first step's loss is the unpatched one to within {gap:.1e} (fp32 rounding). From {sources}; "
        "the op against every peer (torch.compile, cut-cross-entropy, PyTorch's own op), the shape grid, "
        "TRL's trainers, distillation and distributed runs: [docs/benchmarks.md](docs/benchmarks.md)."
    )
    return [*_fill(intro), "", *table, "", *_fill(after)]


def _fill(text: str) -> list[str]:
    return textwrap.wrap(text, width=100, break_on_hyphens=False, break_long_words=False)


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def suite_times() -> list[str]:
    """How long the suite and the quick subset took, where and at which commit, and the quick
    subset's command."""
    times = _load("test_times.json")
    full, quick = times["full"], times["quick"]
    text = (
        f"The whole suite took {_duration(full['seconds'])} on {full['machine']} ({full['passed']} passed, "
        f"{full['skipped']} skipped; at {full['commit']}). A quick subset (the op's API and its errors, "
        "patching and five model families' head math, `doctor` and `verify`) took "
        f"{_duration(quick['seconds'])} on {quick['machine']} ({quick['passed']} passed, "
        f"{quick['skipped']} skipped; at {quick['commit']}):"
    )
    command = textwrap.wrap(quick["command"], width=96, break_on_hyphens=False, break_long_words=False)
    return [*_fill(text), "", "```bash", " \\\n    ".join(command), "```"]


BLOCKS: dict[str, Callable[[], list[str]]] = {"headline": headline, "test-times": suite_times}


def render(text: str) -> str:
    """``text`` (the README) with every generated block rewritten."""
    for name, make in BLOCKS.items():
        begin, end = (
            rf"<!-- begin generated: {re.escape(name)}\b[^\n]*-->\n",
            rf"<!-- end generated: {re.escape(name)} -->",
        )
        pattern = re.compile(f"({begin})(.*?)({end})", re.DOTALL)
        if not pattern.search(text):
            raise ValueError(f"README.md has no generated block {name!r}")
        body = "\n".join(make()) + "\n"
        text = pattern.sub(lambda match, body=body: match.group(1) + body + match.group(3), text)
    return text


def main(argv: list[str]) -> int:
    current = README.read_text()
    text = render(current)
    if "--check" in argv:
        return 0 if text == current else 1
    README.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
