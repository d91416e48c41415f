"""``python -m liger_patch verify`` from the command line: bad arguments are one line and exit
status 2 (an unknown type names the closest known ones; a bad ``--model`` says what was tried),
each line says what its numbers are and their tolerance, the summary is a table, warnings of the
code under test are counted on one line and written to a file, and a sweep has a progress bar."""

from __future__ import annotations

import logging
import pathlib
import re
import subprocess
import sys
import warnings

import pytest

from liger_patch.__main__ import main
from liger_patch.patching.derive import CAUSAL_LM, IMAGE_TEXT_TO_TEXT
from liger_patch.verify import cli
from liger_patch.verify.quiet import collected
from liger_patch.verify.report import line, summary_table
from liger_patch.verify.verdicts import FAILED, REFUSED, STATUSES, VERIFIED, Tolerance, Verdict

ROOT = pathlib.Path(__file__).parents[2]
USER_MODEL = "tests.patching.custom_model:TinyMlpForCausalLM"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """``python -m liger_patch verify ARGV`` in this process: (exit status, stdout, stderr)."""
    status = main(["verify", *argv])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def no_sweep(monkeypatch):
    """Fail the test if anything would be checked (a bad argument must stop before)."""

    def refuse(*args, **kwargs):
        raise AssertionError("nothing should have been checked")

    monkeypatch.setattr(cli, "sweep", refuse)


def test_an_unknown_type_is_an_error_naming_the_closest_types(capsys, no_sweep):
    status, out, err = run(capsys, "lama", "qwen3")
    assert status == 2 and out == ""
    assert err.count("\n") == 1, err
    assert "unknown model type 'lama'" in err and "closest: llama" in err


def test_a_type_with_no_close_match_points_at_the_list(capsys, no_sweep):
    status, _, err = run(capsys, "notatype")
    assert status == 2 and "unknown model type 'notatype'" in err and "--list" in err


def test_a_type_of_the_other_task_says_which_task_it_is(capsys, no_sweep):
    status, _, err = run(capsys, "--task", IMAGE_TEXT_TO_TEXT, "qwen3")
    assert status == 2 and f"it is a {CAUSAL_LM} type" in err


def test_list_prints_every_type_of_each_task(capsys):
    status, out, _ = run(capsys, "--list")
    assert status == 0
    assert out.startswith(f"{CAUSAL_LM} (") and f"\n{IMAGE_TEXT_TO_TEXT} (" in out
    assert {"llama", "qwen3"} <= set(out.split())  # (a name may end a wrapped line)


def test_model_types_and_model_together_are_an_error(capsys, no_sweep):
    status, _, err = run(capsys, "llama", "--model", USER_MODEL)
    assert status == 2 and "not both" in err


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("/no/such/dir", "no such file or directory"),
        ("./relative/missing/dir", "no such file or directory"),
        ("no_such_package.models:Thing", "cannot import module 'no_such_package.models'"),
        ("tests.patching.custom_model:NoSuchClass", "has no attribute 'NoSuchClass'"),
        ("tests.patching.custom_model:torch", "not a transformers model class"),
        (
            "someone/no-such-model-here",
            "no config could be fetched for it from the Hugging Face Hub (offline",
        ),
    ],
)
def test_a_bad_model_is_one_line_saying_what_was_tried(capsys, monkeypatch, model, says):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # the hub id's case must not wait on the network
    status, _, err = run(capsys, "--model", model)
    assert status == 2
    assert err.startswith("verify: error: --model ") and err.count("\n") == 1, err
    assert says in err and "Traceback" not in err


def test_a_directory_without_config_json_is_named(capsys, tmp_path):
    status, _, err = run(capsys, "--model", str(tmp_path))
    assert status == 2 and "the directory has no config.json" in err


def verdict(status: str, loss: float | None = None, grad: float | None = None, reason: str = "") -> Verdict:
    return Verdict("llama", CAUSAL_LM, status, reason=reason, loss_error=loss, grad_error=grad)


def test_a_line_says_what_its_numbers_are_and_their_tolerance():
    tolerance = Tolerance.for_dtype(__import__("torch").float32)
    ok = line(verdict(VERIFIED, 8.6e-08, 3.4e-07), tolerance)
    assert ok.startswith("verified") and "rel. error: loss 8.6e-08 <= 1e-05, grad 3.4e-07 <= 1e-04" in ok
    bad = line(verdict(FAILED, 2e-3, 1e-6, "loss 1.0 vs unpatched 1.002"), tolerance)
    assert "loss 2.0e-03 >  1e-05" in bad and bad.endswith("vs unpatched 1.002")
    refused = line(verdict(REFUSED, reason="it uses logits.transpose"), tolerance)
    assert "rel. error" not in refused and refused.endswith("logits.transpose")


def test_the_summary_is_a_table_of_statuses_by_task():
    verdicts = [verdict(VERIFIED), verdict(REFUSED), Verdict("llava", IMAGE_TEXT_TO_TEXT, VERIFIED)]
    table = summary_table(verdicts)
    assert table[0].split() == ["status", CAUSAL_LM, IMAGE_TEXT_TO_TEXT, "total", "meaning"]
    rows = {row.split()[0]: row.split()[1:4] for row in table[1:]}
    assert list(rows) == [*STATUSES, "all"]
    assert (
        rows[VERIFIED] == ["1", "1", "2"]
        and rows[REFUSED] == ["1", "0", "1"]
        and rows["all"] == ["2", "1", "3"]
    )


@pytest.mark.parametrize("propagate", [False, True], ids=["configured", "propagating"])
def test_collected_hides_warnings_and_log_records_and_writes_them_down(
    capfd, tmp_path, monkeypatch, propagate
):
    """Each message once, whether or not transformers' logger propagates to the root (it does
    until transformers configures it, which depends on what ran before)."""
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", propagate)
    loggers = [logging.getLogger(), logging.getLogger("transformers")]
    handlers = [list(logger.handlers) for logger in loggers]
    with collected() as sink:
        sink.tag = "causal-lm/llama"
        warnings.warn("a config attribute is deprecated", FutureWarning, stacklevel=1)
        logging.getLogger("transformers.configuration_utils").warning("unused kwargs")
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    path = sink.write(str(tmp_path))
    summary = sink.summary(path)
    assert summary.startswith("2 warnings collected instead of printed (")
    assert "transformers 1" in summary and summary.endswith(f"; see {path}")
    written = pathlib.Path(path).read_text()
    assert "[causal-lm/llama] transformers: unused kwargs" in written
    assert "FutureWarning: a config attribute is deprecated" in written
    assert [list(logger.handlers) for logger in loggers] == handlers  # put back as they were


class RecordingBar:
    """Stands in for tqdm: records the total and the updates."""

    made: list[RecordingBar] = []

    def __init__(self, total: int, **kwargs) -> None:
        self.total, self.updates = total, 0
        RecordingBar.made.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def update(self, n: int) -> None:
        self.updates += n

    def set_postfix_str(self, *args, **kwargs) -> None:
        pass

    @staticmethod
    def write(text: str, file=None) -> None:
        print(text, file=file)


def test_a_sweep_counts_its_warnings_on_one_line_and_shows_progress(capsys, monkeypatch):
    """Every line, the table, one line for the warnings (count and file), and a progress bar
    over every (task, type) of the plan."""
    import tqdm.auto

    monkeypatch.setattr(tqdm.auto, "tqdm", RecordingBar)
    RecordingBar.made.clear()

    def fake_sweep(model_types, tasks, *, progress, **kwargs):
        verdicts = []
        for task, model_type in cli.sweep_plan(model_types, tasks):
            logging.getLogger("transformers.modeling_utils").warning(f"{model_type} config noise")
            verdicts.append(Verdict(model_type, task, VERIFIED, loss_error=0.0, grad_error=1e-7))
            progress(verdicts[-1])
        return verdicts

    monkeypatch.setattr(cli, "sweep", fake_sweep)
    # propagating, as before transformers configures its logger: each record reaches two handlers
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)
    status, out, err = run(capsys, "llama", "qwen3", "--task", CAUSAL_LM)
    assert status == 0 and "noise" not in out + err
    assert [bar.total for bar in RecordingBar.made] == [2] and RecordingBar.made[0].updates == 2
    lines = out.splitlines()
    assert sum(text.startswith("verified") and "rel. error" in text for text in lines) == 2
    assert any(text.split()[:2] == ["all", "2"] for text in lines)
    noise = [text for text in lines if "warnings collected instead of printed" in text]
    assert len(noise) == 1 and noise[0].startswith("2 warnings") and "(transformers 2)" in noise[0]
    path = noise[0].rsplit("; see ", 1)[1]
    assert "[causal-lm/qwen3] transformers: qwen3 config noise" in pathlib.Path(path).read_text()
    pathlib.Path(path).unlink()


def test_cli_verifies_a_users_model_and_named_types():
    """The real command, in a fresh interpreter, on a user's class and on a named type."""
    command = [sys.executable, "-m", "liger_patch", "verify"]
    user = subprocess.run(
        [*command, "--model", USER_MODEL], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert user.returncode == 0, user.stdout + user.stderr
    assert any(text.startswith("verified") and "tiny_mlp_lm" in text for text in user.stdout.splitlines())
    named = subprocess.run(
        [*command, "llama", "--task", CAUSAL_LM], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert named.returncode == 0, named.stdout + named.stderr
    rows = {text.split()[0]: text.split()[1:3] for text in named.stdout.splitlines() if text.strip()}
    assert rows[VERIFIED] == ["1", "1"] and rows["all"] == ["1", "1"], named.stdout
    assert "Traceback" not in named.stderr
    for done in (user, named):  # the warnings' files these runs wrote
        for path in re.findall(r"warnings collected instead of printed .*; see (\S+)", done.stdout):
            pathlib.Path(path).unlink()
