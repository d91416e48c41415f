"""``benchmarks/common.py``'s result helpers: the process-per-variant runner of the end-to-end
scripts, what they print and write after it, and the JSON plus markdown table that the sweeps
(``flce.py``, ``distill.py``) write after every point."""

from __future__ import annotations

import json

import pytest

CHILD = """\
import json, sys
_, one, row, variant, flag = sys.argv
if variant == "bad":
    sys.exit("RuntimeError: boom")
print("a line before the result")
print(json.dumps({"row": row, "variant": variant, "one": one, "flag": flag}))
"""


@pytest.fixture(scope="module")
def common(import_script):
    return import_script("common")


def test_each_run_is_a_process_whose_last_line_is_its_result(common, tmp_path, capsys):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    runs = [{"row": "r1", "variant": "good"}, {"row": "r2", "variant": "bad"}]
    results = common.run_in_processes(str(script), runs, ["--flag"])
    assert results == [
        {"row": "r1", "variant": "good", "one": "--one", "flag": "--flag"},
        {"row": "r2", "variant": "bad", "error": ["RuntimeError: boom"]},
    ]
    out, err = capsys.readouterr()
    assert out.splitlines() == [json.dumps(r) for r in results]
    assert err.strip() == "RuntimeError: boom"  # a failed run's stderr, echoed
    common.run_in_processes(str(script), runs[1:], ["--flag"], echo_stderr=False)
    assert capsys.readouterr().err == ""


def test_report_runs_prints_the_table_and_writes_the_head_first(common, tmp_path, capsys):
    out = tmp_path / "results" / "e2e.json"
    common.report_runs([{"variant": "a"}], "| table |", str(out), ("pytest",), batch=2, seq=8)
    assert capsys.readouterr().out == "| table |\n"
    data = json.loads(out.read_text())
    assert list(data) == ["device", "torch", "triton", "python", "pytest", "batch", "seq", "results", "table"]
    assert (data["pytest"], data["batch"], data["seq"]) == (pytest.__version__, 2, 8)
    assert (data["results"], data["table"]) == ([{"variant": "a"}], "| table |")
    common.report_runs([], "| table |", None)  # no --out: printed only
    assert capsys.readouterr().out == "| table |\n"


def test_report_row_prints_the_newest_row_and_writes_json_and_markdown(common, tmp_path, capsys):
    result = {"device": "cpu", "torch": "2.x", "triton": "3.x", "rows": [{"n": 1}]}
    out = tmp_path / "results" / "sweep.v2.json"
    table = "| n |\n|---|\n| 1 |"
    common.report_row(result, table, str(out))
    assert capsys.readouterr().out == table + "\n"  # the whole table after the first point
    result["rows"].append({"n": 2})
    common.report_row(result, table + "\n| 2 |", str(out))
    assert capsys.readouterr().out == "| 2 |\n"
    assert json.loads(out.read_text()) == result
    md = tmp_path / "results" / "sweep.v2.md"
    assert md.read_text() == "cpu, torch 2.x, triton 3.x\n\n| n |\n|---|\n| 1 |\n| 2 |\n"


def test_a_peers_triton_kernels_run_on_the_cpu_only_under_the_interpreter(common, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert common.cpu_triton_refusal("liger_kernel") is None
    for value in ("0", ""):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        refusal = common.cpu_triton_refusal("liger_kernel")
        assert refusal.startswith("liger_kernel") and "TRITON_INTERPRET=1" in refusal


def test_the_distill_smoke_reports_a_triton_peer_missing_without_the_interpreter(import_script, monkeypatch):
    distill = import_script("distill")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    setting = distill.Setting(beta=0.3, temperature=2.0, backend="torch")
    rows = distill.smoke_rows(["liger_fused_jsd"], setting, ignore_frac=0.2, corr=0.9)
    assert rows["liger_fused_jsd"]["ok"] and "liger_kernel" in rows["liger_fused_jsd"]["missing"]


def test_alternating_rounds_alternate_the_order_and_pair_each_round(common):
    order = []

    def run(patched: bool) -> dict:  # the k-th run takes k seconds
        order.append(patched)
        return {"median_step_s": float(len(order)), "step_s": [len(order)]}

    unpatched, patched = common.alternating_rounds(run, 3)
    assert order == [False, True, True, False, False, True]
    assert unpatched["round_step_s"] == [1.0, 4.0, 5.0] and unpatched["median_step_s"] == 4.0
    assert patched["round_step_s"] == [2.0, 3.0, 6.0] and patched["median_step_s"] == 3.0
    assert patched["round_ratios"] == [2.0, 0.75, 1.2]
    assert patched["paired_ratio"] == 1.2
    assert patched["round_steps_s"] == [[2], [3], [6]]


@pytest.mark.parametrize("rounds", [0, -1])
def test_alternating_rounds_refuse_fewer_than_one_round(common, rounds):
    with pytest.raises(ValueError, match=f"rounds must be >= 1, got {rounds}"):
        common.alternating_rounds(lambda patched: {"median_step_s": 1.0}, rounds)


def test_write_json_makes_its_folder_and_ends_its_last_line(common, tmp_path):
    path = tmp_path / "a" / "b.json"
    common.write_json(path, {"x": [1, 2]})
    text = path.read_text()
    assert text.endswith("}\n") and json.loads(text) == {"x": [1, 2]}
