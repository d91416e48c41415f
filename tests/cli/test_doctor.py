"""``python -m liger_patch doctor``: reports the environment, the memory budget and a self-check
against fp64; a bad ``LIGER_MEMORY_BUDGET`` fails it with the reason instead of a traceback."""

from liger_patch.doctor import run_doctor


def test_doctor_passes_and_reports_the_budget(capsys, monkeypatch):
    monkeypatch.setenv("LIGER_MEMORY_BUDGET", "lean")
    assert run_doctor() == 0
    out = capsys.readouterr().out
    assert "memory budget 32 MiB (LIGER_MEMORY_BUDGET=lean)" in out
    assert "self-check    PASS" in out


def test_doctor_fails_on_a_bad_budget(capsys, monkeypatch):
    monkeypatch.setenv("LIGER_MEMORY_BUDGET", "plenty")
    assert run_doctor() == 1
    assert "LIGER_MEMORY_BUDGET='plenty'" in capsys.readouterr().out
