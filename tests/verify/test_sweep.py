"""The verification sweep: every model type of the installed transformers, patched against
unpatched, with no failure; a wrong fused loss or gradient is caught; a type that gives nothing
to compare is not called refused; users' own models pass."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import liger_patch as lp
from liger_patch.patching import derive, forward
from liger_patch.patching.derive import CAUSAL_LM, IMAGE_TEXT_TO_TEXT, MASKED_LM, SEQ2SEQ_LM, SPEECH_SEQ2SEQ
from liger_patch.patching.registry import BUILTIN_ROWS
from liger_patch.verify import models
from liger_patch.verify.compare import verify_model
from liger_patch.verify.sweep import sweep, verify_type
from liger_patch.verify.verdicts import (
    BUILDER_ERROR,
    FAILED,
    REFUSED,
    STATUSES,
    UNBUILDABLE,
    UNPATCHED_FAILS,
    VERIFIED,
    Verdict,
)
from tests.patching.custom_model import TinyMlpConfig, TinyMlpForCausalLM

ROOT = pathlib.Path(__file__).parents[2]

BUILTIN = {row.model_type: row for row in BUILTIN_ROWS}


def committed_results() -> dict | None:
    """The committed CPU sweep for the installed transformers, if there is one."""
    import transformers

    path = ROOT / "docs" / "results" / f"models-transformers-{transformers.__version__}-cpu-float32.json"
    return json.loads(path.read_text()) if path.exists() else None


# Its module-scoped fixture (processes launched, or a sweep) runs once per pytest-xdist worker
# that gets one of its tests: under `-n N --dist loadgroup` they all go to one worker.
pytestmark = pytest.mark.xdist_group(__name__)


@pytest.fixture(scope="module")
def sweep_verdicts() -> list[Verdict]:
    """The whole sweep, on the torch backend: it checks the patching of ~280 types; the Triton
    kernels (interpreted on CPU, seconds per call) are checked in depth by tests/ops and by
    test_models.py's families."""
    return sweep(options={"backend": "torch"})


def test_sweep_fails_no_type(sweep_verdicts):
    failed = [f"{v.task}/{v.model_type}: {v.reason}" for v in sweep_verdicts if v.status == FAILED]
    assert not failed, "\n".join(failed)
    assert all(v.status in STATUSES for v in sweep_verdicts)
    unexplained = [v.model_type for v in sweep_verdicts if v.status != VERIFIED and not v.reason]
    assert not unexplained, f"not verified, without a reason: {unexplained}"


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
    # Committed unbuildable for want of a package this environment has (the GPU image has timm
    # and scipy, CI does not): such a type builds here, and test_sweep_fails_no_type holds it.
    builds_here = {(v["task"], v["model_type"]) for v in committed["verdicts"] if _needs_installed(v)}
    changed = {
        key: (want.get(key), got.get(key))
        for key in (got.keys() | want.keys()) - builds_here
        if got.get(key) != want.get(key)
    }
    assert not changed, f"(task, model_type): (committed, now) = {changed}"


def _needs_installed(verdict: dict) -> bool:
    """Whether a committed verdict is unbuildable for want of packages that are all installed here
    (its reason: "<type>: needs PIL and timm, not installed")."""
    found = re.search(r"needs (.+), not installed", verdict.get("reason") or "")
    if verdict["status"] != UNBUILDABLE or found is None:
        return False
    return all(importlib.util.find_spec(name) is not None for name in found.group(1).split(" and "))


# Types every supported transformers has, with what the sweep must find: (status, a fragment of
# the reason). A refusal names the op or layer that does not fit.
NAMED = {
    (CAUSAL_LM, "llama"): (VERIFIED, ""),
    (CAUSAL_LM, "gemma2"): (VERIFIED, ""),
    (CAUSAL_LM, "qwen3_moe"): (VERIFIED, ""),
    (CAUSAL_LM, "bert"): (VERIFIED, ""),
    (CAUSAL_LM, "bart"): (VERIFIED, ""),
    (CAUSAL_LM, "prophetnet"): (VERIFIED, ""),  # log_softmax + nll_loss over transposed streams
    (CAUSAL_LM, "musicgen"): (REFUSED, "ModuleList"),
    (IMAGE_TEXT_TO_TEXT, "llava"): (VERIFIED, ""),
    (IMAGE_TEXT_TO_TEXT, "qwen2_vl"): (VERIFIED, ""),
    (IMAGE_TEXT_TO_TEXT, "paligemma"): (VERIFIED, ""),
    (IMAGE_TEXT_TO_TEXT, "chameleon"): (REFUSED, "__setitem__"),
    (IMAGE_TEXT_TO_TEXT, "idefics"): (REFUSED, "IdeficsDecoupledLinear"),
    (IMAGE_TEXT_TO_TEXT, "gemma3n"): (UNBUILDABLE, "timm"),
    (SEQ2SEQ_LM, "t5"): (VERIFIED, ""),
    (SEQ2SEQ_LM, "bart"): (VERIFIED, ""),  # final_logits_bias: the loss's bias
    (SEQ2SEQ_LM, "prophetnet"): (VERIFIED, ""),
    (SEQ2SEQ_LM, "fsmt"): (VERIFIED, ""),  # a registry row: the head is output_projection
    (SEQ2SEQ_LM, "m2m_100"): (VERIFIED, ""),
    (SPEECH_SEQ2SEQ, "whisper"): (VERIFIED, ""),
    (SPEECH_SEQ2SEQ, "speech_to_text"): (VERIFIED, ""),
    (MASKED_LM, "bert"): (VERIFIED, ""),
    (MASKED_LM, "xlm-roberta"): (VERIFIED, ""),
    (MASKED_LM, "modernbert"): (VERIFIED, ""),
    (MASKED_LM, "mobilebert"): (REFUSED, "MobileBertLMPredictionHead.forward makes the logits from decoder"),
    (MASKED_LM, "perceiver"): (REFUSED, "get_output_embeddings() returns no submodule"),
}
# Types transformers 4.57 does not have: named from the version that added them.
NAMED_SINCE: dict[str, dict[tuple[str, str], tuple[str, str]]] = {
    "5.0": {
        (CAUSAL_LM, "gemma4_assistant"): (REFUSED, "takes no labels, so it computes no loss to fuse"),
    },
    "5.24": {
        (CAUSAL_LM, "dory"): (REFUSED, "DoryLMHead"),
        (IMAGE_TEXT_TO_TEXT, "apertus1p5"): (VERIFIED, ""),
        (IMAGE_TEXT_TO_TEXT, "inkling2_loop"): (VERIFIED, ""),
    },
}


def named_types() -> dict[tuple[str, str], tuple[str, str]]:
    """``NAMED`` and the ``NAMED_SINCE`` entries the installed transformers is new enough for."""
    import transformers
    from packaging.version import Version

    named = dict(NAMED)
    for since, types in NAMED_SINCE.items():
        if Version(transformers.__version__) >= Version(since):
            named.update(types)
    return named


def test_named_types_are_verified_or_refused_specifically(sweep_verdicts):
    """Each named type is in the sweep (a type that disappears fails here) with its status and,
    when not verified, its reason."""
    by_type = {(v.task, v.model_type): v for v in sweep_verdicts}
    named = named_types()
    missing = sorted(key for key in named if key not in by_type)
    assert not missing, f"named types the sweep no longer has: {missing}"
    wrong = {
        key: (by_type[key].status, by_type[key].reason)
        for key, (status, fragment) in named.items()
        if by_type[key].status != status or fragment not in by_type[key].reason
    }
    assert not wrong, f"(task, model_type): (status, reason) = {wrong}"


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


class NoLabelsLM(TinyMlpForCausalLM):
    """A causal LM whose forward takes no labels: derivation refuses its class."""

    def forward(self, input_ids=None, **kwargs):
        return super().forward(input_ids=input_ids)


def refusal_of(cls: type) -> str:
    """What ``apply_liger_to`` says when it refuses the class ``cls``."""
    with pytest.raises(lp.UnsupportedModelError) as refused:
        lp.apply_liger_to(cls)
    return str(refused.value)


@pytest.fixture
def builds(monkeypatch) -> list[tuple]:
    """The arguments of every tiny model the sweep builds from here on (each still built)."""
    built, real = [], models.tiny_model

    def recording(*args, **kwargs):
        built.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(models, "tiny_model", recording)
    return built


def test_a_class_that_takes_no_labels_is_refused_with_derivations_reason_unbuilt(monkeypatch, builds):
    """The sweep's "refused" is apply_liger_to's refusal, asked before building: not unbuildable."""
    real = models.model_class
    monkeypatch.setattr(
        models, "model_class", lambda t, task: NoLabelsLM if t == "no_labels_lm" else real(t, task)
    )
    verdict = verify_type("no_labels_lm")
    assert (verdict.status, verdict.reason) == (REFUSED, refusal_of(NoLabelsLM)), verdict
    assert "NoLabelsLM.forward takes no labels" in verdict.reason and verdict.class_name == "NoLabelsLM"
    assert builds == []


def test_any_refusal_of_derivation_is_reported_before_building(monkeypatch, builds):
    """Not only "no labels": whatever derivation refuses (here a known mismatch) is refused,
    with its reason, and nothing is built."""
    from transformers import LlamaForCausalLM

    monkeypatch.setitem(derive.KNOWN_MISMATCHES, "llama", "its loss is off by one token")
    verdict = verify_type("llama")
    assert (verdict.status, verdict.reason) == (REFUSED, refusal_of(LlamaForCausalLM)), verdict
    assert "off by one token" in verdict.reason
    assert builds == []


def test_a_type_with_no_tiny_model_here_is_unbuildable_not_refused():
    verdict = verify_type("gemma3n", IMAGE_TEXT_TO_TEXT)
    assert verdict.status == UNBUILDABLE and "timm" in verdict.reason, verdict


def test_a_builder_exception_is_its_own_status(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("shape '[-1, 2]' is invalid")

    monkeypatch.setattr(models, "tiny_model", broken)
    verdict = verify_type("llama")
    assert verdict.status == BUILDER_ERROR, verdict
    assert verdict.reason == "RuntimeError: shape '[-1, 2]' is invalid"


class FailingLM(TinyMlpForCausalLM):
    """A model whose own forward raises on every batch."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        raise AttributeError("'CausalLMOutput' object has no attribute 'image_outputs'")


class NanLM(TinyMlpForCausalLM):
    """A model whose own loss is NaN."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        output = super().forward(input_ids=input_ids, labels=labels, **kwargs)
        output["loss"] = output["loss"] * float("nan")
        return output


@pytest.mark.parametrize(("cls", "named"), [(FailingLM, "image_outputs"), (NanLM, "not finite")])
def test_an_unpatched_model_failing_on_its_batch_is_not_refused(cls, named):
    torch.manual_seed(0)
    model = cls(TinyMlpConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1))
    ids = torch.randint(0, 64, (2, 8))
    verdict = verify_model(model, {"input_ids": ids, "labels": ids})
    assert verdict.status == UNPATCHED_FAILS and named in verdict.reason, verdict


def test_a_users_model_the_patch_refuses_is_refused_not_unpatched_fails():
    """``--model`` asks the patch first, as the sweep does: a class apply_liger_to refuses is
    refused with its reason, whatever the unpatched step would make of the batch."""
    torch.manual_seed(0)
    model = NoLabelsLM(TinyMlpConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1))
    ids = torch.randint(0, 64, (2, 8))
    verdict = verify_model(model, {"input_ids": ids, "labels": ids})
    assert verdict.status == REFUSED and "takes no labels" in verdict.reason, verdict


def test_a_users_own_architecture_patches_with_no_registration():
    torch.manual_seed(0)
    model = TinyMlpForCausalLM(TinyMlpConfig(vocab_size=97, hidden_size=24, num_hidden_layers=2))
    ids = torch.randint(0, 97, (2, 11))
    labels = ids.clone()
    labels[:, 0] = labels[:, -1] = -100
    verdict = verify_model(model, {"input_ids": ids, "labels": labels})
    assert verdict.status == VERIFIED, verdict
    assert lp.supported_models(derived=False) == BUILTIN


def test_docs_models_md_is_generated_from_the_committed_sweeps():
    result = subprocess.run([sys.executable, "docs/gen_models.py", "--check"], cwd=ROOT, timeout=60)
    assert result.returncode == 0, "run: python docs/gen_models.py"


def _gen_models():
    """docs/gen_models.py, imported from its path (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gen_models", ROOT / "docs" / "gen_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sweep_file(version: str, status: str, reason: str) -> dict:
    verdict = {"task": CAUSAL_LM, "model_type": "x", "status": status, "reason": reason, "class_name": "X"}
    return {"versions": {"transformers": version, "device": "cpu", "dtype": "float32"}, "verdicts": [verdict]}


def test_models_md_reason_is_the_newest_sweeps():
    """A type an older sweep could not build and the newest verified shows no reason (an old
    failure would describe it wrongly); a newer refusal replaces an older reason."""
    table = _gen_models()._table
    fixed = table(
        [_sweep_file("5.17.0", BUILDER_ERROR, "AttributeError: old"), _sweep_file("5.24.0", VERIFIED, "")]
    )
    assert fixed[-1].endswith("| builder-error | verified |  |"), fixed[-1]
    changed = table(
        [_sweep_file("5.17.0", REFUSED, "old reason"), _sweep_file("5.24.0", REFUSED, "new reason")]
    )
    assert changed[-1].endswith("| new reason |"), changed[-1]


def test_models_md_rows_verified_in_the_newest_sweep_carry_no_reason():
    tasks = tuple(f"| {task} |" for task in derive.TASKS)
    rows = [row for row in (ROOT / "docs" / "models.md").read_text().splitlines() if row.startswith(tasks)]
    stale = [row for row in rows if row.split("|")[-3].strip() == VERIFIED and row.split("|")[-2].strip()]
    assert not stale, stale


@pytest.mark.parametrize("model_type", ["fast_vlm", "perception_lm"])
def test_timm_vision_towers_are_built_tiny_and_verified(model_type):
    """FastVLM's and PerceptionLM's vision towers are timm models, sized in ``model_args`` where
    the config rules do not reach (overrides.py): with timm installed (as on the GPU image) they
    verify; without it they are unbuildable, which the committed sweep records."""
    pytest.importorskip("timm", reason="FastVLM and PerceptionLM build timm vision towers")
    pytest.importorskip("torchvision", reason="timm's vision towers need torchvision")
    verdict = verify_type(model_type, IMAGE_TEXT_TO_TEXT, options={"backend": "torch"})
    assert verdict.status == VERIFIED, (verdict.status, verdict.reason)
