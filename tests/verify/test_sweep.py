"""The verification sweep: every model type of the installed transformers, patched against
unpatched, with no failure; a wrong fused loss or gradient is caught; users' own models pass."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

import liger_patch as lp
from liger_patch.patching import forward
from liger_patch.patching.derive import CAUSAL_LM, IMAGE_TEXT_TO_TEXT
from liger_patch.patching.registry import BUILTIN_ROWS
from liger_patch.verify.compare import verify_model
from liger_patch.verify.sweep import sweep, verify_type
from liger_patch.verify.verdicts import FAILED, REFUSED, VERIFIED, Verdict
from tests.patching.custom_model import TinyMlpConfig, TinyMlpForCausalLM

ROOT = pathlib.Path(__file__).parents[2]

BUILTIN = {row.model_type: row for row in BUILTIN_ROWS}


def committed_results() -> dict | None:
    """The committed CPU sweep for the installed transformers, if there is one."""
    import transformers

    path = ROOT / "docs" / "results" / f"models-transformers-{transformers.__version__}-cpu-float32.json"
    return json.loads(path.read_text()) if path.exists() else None


@pytest.fixture(scope="module")
def sweep_verdicts() -> list[Verdict]:
    """The whole sweep, on the torch backend: it checks the patching of ~280 types; the Triton
    kernels (interpreted on CPU, seconds per call) are checked in depth by tests/ops and by
    test_models.py's families."""
    return sweep(options={"backend": "torch"})


def test_sweep_fails_no_type(sweep_verdicts):
    failed = [f"{v.task}/{v.model_type}: {v.reason}" for v in sweep_verdicts if v.status == FAILED]
    assert not failed, "\n".join(failed)
    assert all(v.reason for v in sweep_verdicts if v.status == REFUSED), "a refusal without a reason"


def test_sweep_matches_the_committed_results_for_this_transformers(sweep_verdicts):
    """Statuses equal docs/results/models-transformers-<version>-cpu-float32.json where one is
    committed for the installed version (regenerate: python -m liger_patch verify --json <file>,
    then python docs/gen_models.py)."""
    committed = committed_results()
    if committed is None:
        import transformers

        version = transformers.__version__
        pytest.skip(
            f"no committed sweep for transformers {version} (test_sweep_fails_no_type still ran it); "
            f"add one: python -m liger_patch verify --json "
            f"docs/results/models-transformers-{version}-cpu-float32.json, then python docs/gen_models.py"
        )
    got = {(v.task, v.model_type): v.status for v in sweep_verdicts}
    want = {(v["task"], v["model_type"]): v["status"] for v in committed["verdicts"]}
    changed = {
        key: (want.get(key), got.get(key))
        for key in got.keys() | want.keys()
        if got.get(key) != want.get(key)
    }
    assert not changed, f"(task, model_type): (committed, now) = {changed}"


def test_named_types_are_verified_or_refused_specifically(sweep_verdicts):
    by_type = {(v.task, v.model_type): v for v in sweep_verdicts}
    for key in [
        (CAUSAL_LM, "llama"),
        (CAUSAL_LM, "gemma2"),
        (CAUSAL_LM, "qwen3_moe"),
        (CAUSAL_LM, "bert"),
        (CAUSAL_LM, "bart"),
        (IMAGE_TEXT_TO_TEXT, "llava"),
        (IMAGE_TEXT_TO_TEXT, "qwen2_vl"),
        (IMAGE_TEXT_TO_TEXT, "paligemma"),
    ]:
        if key in by_type:
            assert by_type[key].status == VERIFIED, (key, by_type[key].reason)


def scaled_loss(scale_value: float, scale_grad: float):
    """A wrapper of the fused head loss whose value or gradient is off by a factor."""
    real = forward.fused_head_loss

    def wrong(*args, **kwargs):
        result = real(*args, **kwargs)
        loss = result.loss if isinstance(result, tuple) else result
        loss = loss.detach() * scale_value + (loss - loss.detach()) * scale_grad
        return result._replace(loss=loss) if isinstance(result, tuple) else loss

    return wrong


@pytest.mark.parametrize(
    ("value", "grad", "named"), [(1.001, 1.0, "loss"), (1.0, 1.01, "gradient of")], ids=["loss", "grad"]
)
def test_a_wrong_loss_or_gradient_is_reported_as_failed(monkeypatch, value, grad, named):
    monkeypatch.setattr(forward, "fused_head_loss", scaled_loss(value, grad))
    verdict = verify_type("llama")
    assert verdict.status == FAILED and named in verdict.reason, verdict


def test_a_fallback_is_reported_as_refused_with_its_reason():
    class TransposingLM(TinyMlpForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state).transpose(1, 2)
            return {
                "loss": torch.nn.functional.cross_entropy(logits[..., :-1], labels[:, 1:]),
                "logits": logits,
            }

    torch.manual_seed(0)
    model = TransposingLM(TinyMlpConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1))
    ids = torch.randint(0, 64, (2, 8))
    verdict = verify_model(model, {"input_ids": ids, "labels": ids})
    assert verdict.status == REFUSED and "transpose" in verdict.reason


def test_a_users_own_architecture_patches_with_no_registration():
    torch.manual_seed(0)
    model = TinyMlpForCausalLM(TinyMlpConfig(vocab_size=97, hidden_size=24, num_hidden_layers=2))
    ids = torch.randint(0, 97, (2, 11))
    labels = ids.clone()
    labels[:, 0] = labels[:, -1] = -100
    verdict = verify_model(model, {"input_ids": ids, "labels": labels})
    assert verdict.status == VERIFIED, verdict
    assert lp.supported_models(derived=False) == BUILTIN


def test_cli_verifies_a_users_model_and_named_types():
    command = [sys.executable, "-m", "liger_patch", "verify"]
    user = subprocess.run(
        [*command, "--model", "tests.patching.custom_model:TinyMlpForCausalLM"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert user.returncode == 0, user.stdout + user.stderr
    assert user.stdout.startswith("verified") and "tiny_mlp_lm" in user.stdout
    named = subprocess.run(
        [*command, "llama", "--task", CAUSAL_LM], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert named.returncode == 0 and "{'verified': 1, 'refused': 0, 'failed': 0}" in named.stdout, (
        named.stdout
    )


def test_docs_models_md_is_generated_from_the_committed_sweeps():
    result = subprocess.run([sys.executable, "docs/gen_models.py", "--check"], cwd=ROOT, timeout=60)
    assert result.returncode == 0, "run: python docs/gen_models.py"
