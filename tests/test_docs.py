"""The docs stay honest where a test can tell: every figure the README quotes is read from a
committed results file (``docs/gen_readme.py`` writes them), each **Source** line of
``docs/benchmarks.md`` names the card and torch its results file records, every results file
the docs name exists, and the docs speak of the software and its commits, not of how it was made
(no "session"; perf-notes' numbered entries are cited only inside perf-notes)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _gen_readme():
    """docs/gen_readme.py, imported from its path (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gen_readme", ROOT / "docs" / "gen_readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_figures_are_the_committed_results():
    """The generated blocks are what docs/gen_readme.py makes of docs/results/ now."""
    text = README.read_text()
    assert _gen_readme().render(text) == text, "stale: run python docs/gen_readme.py"


def test_headline_figures_come_from_the_results_files():
    """Spot-check the generator itself: the Llama row's figures and the card, from e2e.json."""
    gen = _gen_readme()
    results = json.loads((ROOT / "docs" / "results" / "e2e.json").read_text())
    runs = [r for r in results["results"] if r["row"] == "llama1b_8x2048" and r["variant"] == "liger_patch"]
    ms, gib = gen.step_figures(results, "llama1b_8x2048", "liger_patch")
    assert len(runs) == 2 and ms == (runs[0]["ms"] + runs[1]["ms"]) / 2  # e2e.py runs each patch twice
    assert gib == max(r["peak_gib"] for r in runs)
    block = "\n".join(gen.headline())
    assert f"{ms:.0f} ms, {gib:.1f} GiB" in block and results["device"] in block


_MEASURED = re.compile(r"\d[\d.,]*\s*(?:ms|s|min|GiB|MiB|GB|%|×)(?![\w])")


def _outside_generated_blocks(text: str) -> str:
    return re.sub(r"<!-- begin generated:.*?<!-- end generated: [\w-]+ -->", "", text, flags=re.DOTALL)


def test_the_readme_quotes_no_figure_outside_its_generated_blocks():
    """A measured figure typed by hand would go stale: the only sizes allowed elsewhere are the
    memory budget's settings, in the environment flags table."""
    text = _outside_generated_blocks(README.read_text())
    text = text.split("## Environment flags")[0]
    assert not _MEASURED.findall(text), _MEASURED.findall(text)


def test_the_quick_subset_exists_and_collects_tests():
    times = json.loads((ROOT / "docs" / "results" / "test_times.json").read_text())
    paths = times["quick"]["command"].split()[1:]
    assert paths and all((ROOT / path.split("::")[0]).exists() for path in paths), paths
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", *paths],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    count = re.search(r"(\d+) tests? collected", collected.stdout)
    assert collected.returncode == 0 and count and int(count.group(1)) > 0, collected.stdout[-2000:]


_SOURCE = re.compile(
    r"Source: ((?:`docs/results/[^`]+`(?:, | and )?)+) "
    r"\(([^;()]+), torch ([^;()]+); committed in ([0-9a-f]{7,40})"
)


def source_lines(text: str) -> list[tuple[list[str], str, str]]:
    """``(results files, card, torch)`` of each **Source** line (wrapped lines joined)."""
    flat = " ".join(text.split())
    return [
        (re.findall(r"`(docs/results/[^`]+)`", files), card, torch_version)
        for files, card, torch_version, _ in _SOURCE.findall(flat)
    ]


def test_each_benchmarks_source_names_the_card_its_file_records():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    sources = source_lines(text)
    assert len(sources) == " ".join(text.split()).count("Source: ") >= 10
    wrong = []
    for files, card, torch_version in sources:
        for name in files:
            recorded = json.loads((ROOT / name).read_text())
            if (recorded["device"], recorded["torch"]) != (card, torch_version):
                wrong.append((name, card, torch_version, recorded["device"], recorded["torch"]))
    assert not wrong, wrong


def _named_results(path: Path) -> set[str]:
    return set(re.findall(r"docs/results/[\w.+-]+\.(?:json|md|log|png)", path.read_text()))


@pytest.mark.parametrize("doc", [d for d in DOCS if d.name != "perf-notes.md"], ids=lambda d: d.name)
def test_every_results_file_a_doc_names_exists(doc: Path):
    """(perf-notes' "Removed result files" names files that were removed on purpose.)"""
    missing = sorted(name for name in _named_results(doc) if not (ROOT / name).exists())
    assert not missing, missing


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_the_docs_speak_of_the_software_not_of_how_it_was_made(doc: Path):
    text = doc.read_text()
    assert not re.findall(r".{0,40}\bsession.{0,40}", text, re.IGNORECASE)
    if doc.name != "perf-notes.md":
        assert not re.findall(r".{0,40}\bitems? \d+.{0,40}", text)


def test_the_readme_sends_problems_to_the_tracker_doctor_names():
    from liger_patch.doctor import ISSUES_URL

    report = README.read_text().split("## Report a problem")[1].split("\n## ")[0]
    assert ISSUES_URL in report and "python -m liger_patch doctor" in report
