"""examples/*.py run as a user runs them: a fresh interpreter, their offline defaults (a tiny
Llama built from a config), a couple of steps; each must exit 0, print finite losses and never
warn that a step bypassed the op."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HELPERS = {"tiny_trl.py", "tiny_families.py"}  # imported by the examples, not run on their own
EXAMPLES = sorted(path for path in (ROOT / "examples").glob("*.py") if path.name not in HELPERS)
# Packages an example needs beyond the `test` extra, with how to get them.
TRL = ("trl", 'trl is not installed (pip install -e ".[examples]")')
NEEDS = {"trl_sft.py": TRL, "trl_dpo.py": TRL, "trl_grpo.py": TRL, "trl_distillation.py": TRL}
LOSS = re.compile(r"\bloss:?\s+([-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|nan|inf))", re.IGNORECASE)


def printed_losses(output: str) -> list[float]:
    """Every ``loss X`` / ``loss: X`` value in an example's output."""
    return [float(value) for value in LOSS.findall(output)]


def _reader_env() -> dict[str, str]:
    """The user's environment: no TRITON_INTERPRET (tests/conftest.py sets it), no hub access,
    and the checkout importable even without an install."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_loss_pattern_reads_what_the_examples_print():
    found = printed_losses("step 0: loss 6.9218  z_loss 4.79e-03\neval: loss: nan")
    assert found[0] == 6.9218 and math.isnan(found[1]) and len(found) == 2  # z_loss is not a loss


def test_the_examples_are_found():
    expected = {"plain_pytorch_loop.py", "hf_trainer_callback.py", *NEEDS}
    assert expected <= {path.name for path in EXAMPLES}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_example_runs_offline_and_prints_a_finite_loss(example: Path, tmp_path: Path):
    module, reason = NEEDS.get(example.name, (None, ""))
    if module is not None and importlib.util.find_spec(module) is None:
        pytest.skip(reason)
    done = subprocess.run(
        [sys.executable, str(example), "--steps", "2"],
        cwd=tmp_path,  # the Trainer examples write their output folders here
        env=_reader_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    losses = printed_losses(done.stdout)
    assert losses, f"{example.name} printed no loss:\n{done.stdout[-3000:]}"
    assert all(math.isfinite(loss) for loss in losses), losses
    assert "LigerBypassWarning" not in output, output[-6000:]  # every step went through the op


def test_the_plain_loop_learns_its_data_and_labels_its_output(tmp_path: Path):
    """The plain loop trains on data a model can learn: over its default 20 steps the loss falls
    well below ln(vocabulary), and its generation is labelled against what it should produce."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "plain_pytorch_loop.py")],
        cwd=tmp_path,
        env=_reader_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    steps = [float(value) for value in re.findall(r"^step \d+: loss (\S+)", done.stdout, re.MULTILINE)]
    assert len(steps) == 20 and steps[-1] < steps[0] / 2, steps
    assert "generate: phrase 0's first tokens" in done.stdout and "match)" in done.stdout
