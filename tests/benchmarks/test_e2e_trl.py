"""``benchmarks/e2e_trl.py``'s step table, which ``e2e_distill.py`` shares: a row per run, the
ratio to the base variant's first timed run, "n/a" where a CPU run timed nothing, a failed run's
error across the row."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def e2e_trl(import_script):
    return import_script("e2e_trl")


def test_step_table(e2e_trl):
    results = [
        {"variant": "base", "error": ["RuntimeError: boom"]},  # a failed run: not the base
        {"variant": "other", "ms": 12.0, "peak_gib": 3.0, "x": 0},  # before the base: ratio to it
        {"variant": "base", "ms": 10.0, "peak_gib": 1.0, "x": 1},
        {"variant": "base", "ms": 15.0, "peak_gib": 2.5, "x": 2},
        {"variant": "cpu", "ms": None, "peak_gib": None, "x": 3},
    ]
    lines = e2e_trl.step_table(results, "base", "Base", {"x": lambda r: f"<{r['x']}>"})
    assert lines == [
        "| variant | step ms (median) | vs Base | peak GiB | x |",
        "|---|---|---|---|---|",
        "| base | error: ['RuntimeError: boom'] | | | |",
        "| other | 12.0 | 1.200x | 3.00 | <0> |",
        "| base | 10.0 | 1.000x | 1.00 | <1> |",
        "| base | 15.0 | 1.500x | 2.50 | <2> |",
        "| cpu | n/a |  | n/a | <3> |",
    ]
    assert (
        e2e_trl.step_table(results[:1], "base", "Base", {})[-1]
        == "| base | error: ['RuntimeError: boom'] | | |"
    )
