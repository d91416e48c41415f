"""`python -m liger_patch demo` runs and its two loss columns agree."""

from liger_patch.demo import main


def test_demo_runs_and_losses_agree(capsys):
    assert main(["--steps", "3", "--vocab", "512", "--seq", "32", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "liger_patch loss" in out and "time/step" in out and "OK" in out
