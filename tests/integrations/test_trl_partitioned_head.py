"""TRL's fused LM head on a ZeRO-3-partitioned head (a one-process stand-in,
tests/integrations/fake_zero3.py, put in place of TRL's ``maybe_gather_lm_head_ctx``): a patched
model's log-probs come from the fused op, not TRL's kernel, with no bypass warning, and equal
TRL's kernel's, gradients included. Real DeepSpeed: tests/distributed/test_trl_zero3.py."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")

from liger_patch import apply_liger_to  # noqa: E402
from liger_patch.patching.state import LigerBypassWarning  # noqa: E402
from tests.integrations.fake_zero3 import FakeZero3  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from tiny_trl import tiny_model  # noqa: E402

if not hasattr(trl.trainer.utils, "add_fused_lm_head"):
    pytest.skip("this TRL has no fused LM head (before 1.15)", allow_module_level=True)

OUTPUTS = ("entropy", "is_top1")


@pytest.fixture
def partitioned(monkeypatch):
    """Two copies of one tiny model with TRL's fused head, the second patched, both heads
    partitioned by one ``FakeZero3`` that stands in for TRL's gathering helper."""
    models = [tiny_model(seed=11) for _ in range(2)]
    for model in models:
        trl.trainer.utils.add_fused_lm_head(model, outputs=OUTPUTS)
    apply_liger_to(models[1], backend="torch")
    fake = FakeZero3(*(m.lm_head.weight for m in models))
    monkeypatch.setattr(trl.trainer.utils, "maybe_gather_lm_head_ctx", fake.gather)
    return (*models, fake)


def _ids():
    ids = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :4] = -100
    return ids, labels


def test_a_patched_model_runs_the_op_on_the_partitioned_head(partitioned, op_calls):
    """The fields equal TRL's kernel's on the same partitioned head; so do the gradients of the
    loss for the head and the embeddings (taken with ``autograd.grad``: accumulating a whole
    gradient into the empty partition is DeepSpeed's part). Each backward gathered the head."""
    reference, model, fake = partitioned
    ids, labels = _ids()
    expected = reference(input_ids=ids, labels=labels, fused_lm_head=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LigerBypassWarning)
        got = model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert len(op_calls) == 1
    for field in ("log_probs", "entropy"):
        torch.testing.assert_close(getattr(got, field), getattr(expected, field), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.is_top1, expected.is_top1)
    wanted = [(m.lm_head.weight, m.model.embed_tokens.weight) for m in (reference, model)]
    want = torch.autograd.grad(expected.loss, wanted[0])
    grads = torch.autograd.grad(got.loss, wanted[1])
    for name, g, w in zip(("lm_head", "embed_tokens"), grads, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert fake.entries == [(True, 1)] * 2 + [(False, 1)] * 2  # the forwards (TRL, ours), the backwards
    assert model.lm_head.weight.numel() == 0


def test_without_grad_the_op_runs_directly(partitioned, op_calls):
    """Scoring (a reference model's pass, generation): no backward follows, so the op runs inside
    TRL's forward gathering alone."""
    _, model, fake = partitioned
    ids, labels = _ids()
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert len(op_calls) == 1 and out.log_probs.grad_fn is None
    assert fake.entries == [(False, 1)]
