"""``python -m liger_patch doctor``: reports the environment, the memory budget and a self-check
against fp64; a bad ``LIGER_MEMORY_BUDGET`` fails it with the reason instead of a traceback."""

import sys

import pytest

from liger_patch.doctor import run_doctor


def test_doctor_passes_and_reports_the_budget(capsys, monkeypatch):
    monkeypatch.setenv("LIGER_MEMORY_BUDGET", "lean")
    assert run_doctor() == 0
    out = capsys.readouterr().out
    assert "memory budget 32 MiB (LIGER_MEMORY_BUDGET=lean)" in out
    assert "self-check    PASS" in out


@pytest.mark.parametrize(
    ("value", "line"),
    [
        (
            None,
            "memory budget 512 MiB for the op, batch (6 x the hidden states' bytes, 256-1024 MiB) "
            "for a patched model (LIGER_MEMORY_BUDGET unset)",
        ),
        (
            "batch",
            "memory budget batch (6 x the hidden states' bytes, 256-1024 MiB) (LIGER_MEMORY_BUDGET=batch)",
        ),
        ("96MiB", "memory budget 96 MiB (LIGER_MEMORY_BUDGET=96MiB)"),
    ],
)
def test_doctor_names_the_budget_a_call_gets(capsys, monkeypatch, value, line):
    """ "batch" is sized per call, so doctor names it with its range (it once printed 1024 MiB)."""
    if value is None:
        monkeypatch.delenv("LIGER_MEMORY_BUDGET", raising=False)
    else:
        monkeypatch.setenv("LIGER_MEMORY_BUDGET", value)
    assert run_doctor() == 0
    assert line in capsys.readouterr().out


def test_doctor_fails_on_a_bad_budget(capsys, monkeypatch):
    monkeypatch.setenv("LIGER_MEMORY_BUDGET", "plenty")
    assert run_doctor() == 1
    assert "LIGER_MEMORY_BUDGET='plenty'" in capsys.readouterr().out


def test_doctor_lists_every_relevant_version_and_where_to_report(capsys):
    """What a bug report needs: liger_patch's own version, every package that changes what it
    does (installed or not), and the issue tracker pyproject.toml names."""
    from liger_patch.doctor import ISSUES_URL, PACKAGES

    assert run_doctor() == 0
    lines = capsys.readouterr().out.splitlines()
    assert ISSUES_URL in lines[0]
    named = {line.split()[0] for line in lines[1:] if line.strip()}
    assert {"python", "liger_patch", *(shown for shown, _ in PACKAGES)} <= named
    assert {"trl", "deepspeed", "peft", "accelerate", "transformers"} <= {shown for shown, _ in PACKAGES}


def test_the_issue_tracker_is_the_one_pyproject_names():
    import pathlib

    from liger_patch.doctor import ISSUES_URL

    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    pyproject = pathlib.Path(__file__).parents[2] / "pyproject.toml"
    urls = tomllib.loads(pyproject.read_text())["project"]["urls"]
    assert urls["Issues"] == ISSUES_URL and {"Homepage", "Documentation"} <= set(urls)
