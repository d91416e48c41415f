"""``benchmarks/experiments/host_calls_cpu.py`` runs on the CPU (in its own process: it stubs the
Triton launches and the label check's event there) and counts the calls of the path it stands in
for: more with more chunks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "experiments" / "host_calls_cpu.py"


def _calls(*args: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--rounds", "1", "--reps", "3", *args],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    match = re.search(r"µs a forward \+ backward on this CPU; (\d+) calls", done.stdout)
    assert match, done.stdout + done.stderr
    return int(match.group(1)), done.stdout


def test_counts_more_calls_for_more_chunks():
    one, _ = _calls()
    four, by = _calls("--chunk-rows", "16", "--by")
    assert 0 < one < four
    assert "ops/cross_entropy/chunks.py:run_chunks" in by
