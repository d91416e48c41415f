"""Every registry row: patched training equals unpatched training, step for step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import liger_patch as lp
from liger_patch.patching.registry import BUILTIN_ROWS
from tests.patching_helpers import (
    assert_records_match,
    available_model_types,
    device_and_dtype,
    make_batch,
    tiny_model,
    tolerances,
    train_steps,
)

MODEL_TYPES = available_model_types()
BUILTIN = {row.model_type: row for row in BUILTIN_ROWS}
MOE_TYPES = {"qwen2_moe", "qwen3_moe", "mixtral", "granitemoe"}


def test_every_tested_family_derives_a_spec():
    specs = lp.supported_models()
    assert set(MODEL_TYPES) <= set(specs)
    assert all(specs[mt].derived for mt in MODEL_TYPES)
    assert lp.supported_models(derived=False) == BUILTIN


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_patched_training_matches_unpatched(model_type):
    reference_model = tiny_model(model_type)
    patched_model = copy.deepcopy(reference_model)
    lp.apply_liger_to(patched_model)

    try:
        reference = train_steps(reference_model)
    except AttributeError as error:  # e.g. transformers 5.17 granitemoe: router logits not recorded
        pytest.xfail(f"the unpatched {model_type} forward itself fails here: {error}")
    patched = train_steps(patched_model)

    assert_records_match(patched, reference, tolerances(device_and_dtype()[1]))
    for out, ref_out in zip(patched.outputs, reference.outputs, strict=True):
        assert out.logits is None, "logits must be None in training with labels"
        assert ref_out.logits is not None
        if model_type in MOE_TYPES:
            assert out.aux_loss is not None
            tol = tolerances(device_and_dtype()[1]).loss
            torch.testing.assert_close(out.aux_loss.float(), ref_out.aux_loss.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("model_type", ["llama", "phi", "gemma2", "granite", "cohere"])
def test_z_loss_and_label_smoothing_match_reference_math(model_type):
    """z-loss and label smoothing are options of the fused path: check them against logits."""
    model = tiny_model(model_type)
    batch = make_batch()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    model.train()
    targets = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:].reshape(-1)
    keep = targets != -100
    flat = logits.reshape(-1, logits.shape[-1])[keep]
    lse = torch.logsumexp(flat, dim=-1)
    z_scale, smoothing = 1e-2, 0.1
    expected_z = z_scale * (lse**2).mean()
    expected = F.cross_entropy(flat, targets[keep], label_smoothing=smoothing) + expected_z

    lp.apply_liger_to(model, z_loss_scale=z_scale, label_smoothing=smoothing)
    out = model(**batch)
    tol = 1e-5 if device_and_dtype()[1] == torch.float32 else 3e-2
    torch.testing.assert_close(out.loss.double().cpu(), expected.cpu(), rtol=tol, atol=tol)
    torch.testing.assert_close(out.z_loss.double().cpu(), expected_z.cpu(), rtol=tol, atol=tol)
    out.loss.backward()
