"""``python -m liger_patch demo``: the command line parses the demo's own options, and the demo
shows what patching gains (loss-step peak memory, speed with its explanation, per-step progress)
while its two loss columns agree."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from liger_patch.__main__ import main as cli_main
from liger_patch.demo import main as demo_main

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--steps", "3", "--vocab", "512", "--seq", "32", "--batch", "2"]


@pytest.fixture
def as_a_user(monkeypatch):
    """The environment a user runs the demo in: without TRITON_INTERPRET (tests/conftest.py sets
    it, which would run the demo's CPU loss through the slow Triton interpreter).

    Triton is imported first, under the interpreter: it fixes its own library's kernels (``tl.zeros``
    ...) to the mode it is imported in, and the demo imports it (transformers -> torch._dynamo)
    without the interpreter, after which every later test's interpreted kernel would fail."""
    with contextlib.suppress(ImportError):
        import triton.language  # noqa: F401
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m liger_patch ARGS`` in a fresh interpreter, as a user types it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-m", "liger_patch", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_demo_runs_and_losses_agree(capsys, as_a_user):
    assert demo_main(SMALL) == 0
    out = capsys.readouterr().out
    assert "liger_patch loss" in out and "time/step" in out and "OK: same loss curve" in out
    assert "unpatched (HF)   step 3/3" in out and "patched (liger)  step 3/3" in out  # progress
    assert "loss-step peak" in out and "Memory:" in out and "Speed:" in out


def test_cli_demo_takes_the_demo_options(capsys, as_a_user):
    assert cli_main(["demo", *SMALL, "--memory-budget", "1MiB"]) == 0
    assert "fused-loss memory budget 1 MiB" in capsys.readouterr().out


def test_cli_demo_rejects_a_bad_budget_with_a_message(capsys, as_a_user):
    assert cli_main(["demo", *SMALL, "--memory-budget", "plenty"]) == 2
    assert "--memory-budget" in capsys.readouterr().err


def test_top_level_help_is_plain_text():
    done = _cli("--help")
    assert done.returncode == 0, done.stderr
    assert "doctor" in done.stdout and "demo" in done.stdout
    assert "``" not in done.stdout  # no raw reStructuredText


def test_demo_help_lists_the_demo_options():
    done = _cli("demo", "--help")
    assert done.returncode == 0, done.stderr
    for option in ("--steps", "--device", "--vocab", "--seq", "--batch", "--memory-budget"):
        assert option in done.stdout


def test_demo_with_three_steps_from_the_command_line():
    done = _cli("demo", "--steps", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step 3/3" in done.stdout and "OK: same loss curve" in done.stdout


def test_unknown_demo_option_is_an_argparse_error():
    done = _cli("demo", "--stepz", "3")
    assert done.returncode == 2 and "--stepz" in done.stderr
