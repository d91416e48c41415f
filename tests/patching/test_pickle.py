"""A patched model survives torch.save / torch.load, pickle and deepcopy: still patched, same options.

A bound method pickles as ``getattr(model, "forward")``, which on the half-restored model is the
class's unpatched forward; before the fix a reloaded model ran the original forward while its
leftover PatchState made ``apply_liger_to`` a no-op.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import transformers

import liger_patch as lp
from liger_patch.patching.forward import is_liger_forward
from liger_patch.patching.state import STATE_ATTR
from tests.patching_helpers import class_patch, make_batch, tiny_model


def torch_round_trip(model):
    """``torch.save`` then ``torch.load(weights_only=False)``: the whole model object."""
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


ROUND_TRIPS = {
    "torch.save": torch_round_trip,
    "pickle": lambda model: pickle.loads(pickle.dumps(model)),
    "pickle-protocol-2": lambda model: pickle.loads(pickle.dumps(model, protocol=2)),
    "deepcopy": copy.deepcopy,
}


def assert_fused(model, batch, expected_loss):
    """The fused path runs (logits None), with the expected loss, and trains."""
    out = model(**batch)
    assert out.logits is None, "the reloaded model lost the fused path"
    torch.testing.assert_close(out.loss, expected_loss, rtol=1e-6, atol=1e-6)
    out.loss.backward()
    assert model.lm_head.weight.grad is not None
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("round_trip", ROUND_TRIPS.values(), ids=ROUND_TRIPS.keys())
def test_instance_patch_survives_the_round_trip(round_trip):
    reference = tiny_model("llama", seed=3)
    model = copy.deepcopy(reference)
    lp.apply_liger_to(model, z_loss_scale=1e-3, label_smoothing=0.1, memory_budget="lean")
    batch = make_batch(seed=11)
    before = model(**batch)
    assert before.logits is None

    loaded = round_trip(model)
    assert is_liger_forward(loaded.forward) and loaded.forward.__self__ is loaded
    state = getattr(loaded, STATE_ATTR)
    options = state.options
    assert (options.z_loss_scale, options.label_smoothing, options.memory_budget) == (1e-3, 0.1, "lean")
    out = assert_fused(loaded, batch, before.loss)
    torch.testing.assert_close(out.z_loss, before.z_loss, rtol=1e-6, atol=1e-6)

    lp.apply_liger_to(loaded)  # applying again updates the options of the live patch
    assert loaded(**batch).z_loss is None
    lp.revert_liger(loaded)
    assert not is_liger_forward(loaded.forward)
    assert vars(loaded).keys() == vars(reference).keys()
    ref_out, out = reference(**batch), loaded(**batch)
    assert out.logits is not None
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-6, atol=1e-6)
    assert torch.equal(out.logits, ref_out.logits)


def test_reloaded_model_pickles_again_and_keeps_the_original_untouched():
    model = tiny_model("llama", seed=5)
    lp.apply_liger_to(model)
    batch = make_batch(seed=7)
    expected = model(**batch).loss
    twice = torch_round_trip(torch_round_trip(model))
    assert_fused(twice, batch, expected)
    assert model.forward.__self__ is model  # pickling did not touch the original
    assert_fused(model, batch, expected)


def test_class_patch_then_pickled_instance():
    batch = make_batch(seed=2)
    with class_patch(transformers.LlamaForCausalLM):
        model = tiny_model("llama", seed=1)
        expected = model(**batch).loss
        plain = torch_round_trip(model)  # no instance options: the class patch serves it
        assert "forward" not in vars(plain)
        assert_fused(plain, batch, expected)

        lp.apply_liger_to(model, z_loss_scale=1e-3)  # instance options on top of the class patch
        with_options = torch_round_trip(model)
        assert with_options(**batch).z_loss is not None
    # The class patch is gone: the instance's options outlived it. Applying patches it again
    # (before the fix the leftover state made this a no-op), and revert undoes it.
    assert with_options(**batch).logits is not None
    assert plain(**batch).logits is not None
    lp.apply_liger_to(with_options)
    assert_fused(with_options, batch, expected)
    lp.revert_liger(with_options)
    assert with_options(**batch).logits is not None


def test_model_pickled_without_the_reducer_is_patchable_again():
    """A model pickled before the fix (no reducer) comes back unpatched with a stale state:
    applying patches it again, and revert cleans it up."""
    model = tiny_model("llama", seed=4)
    lp.apply_liger_to(model)
    for name in ("__reduce_ex__", "_replicate_for_data_parallel"):  # as older versions pickled it
        vars(model).pop(name, None)
    batch = make_batch(seed=9)
    expected = model(**batch).loss
    stale = pickle.loads(pickle.dumps(model))
    assert not is_liger_forward(stale.forward) and STATE_ATTR in vars(stale)
    lp.apply_liger_to(stale)
    assert_fused(stale, batch, expected)
    lp.revert_liger(stale)
    assert not is_liger_forward(stale.forward) and STATE_ATTR not in vars(stale)
    assert "forward" not in vars(stale)


def test_data_parallel_replica_runs_its_own_forward():
    """``nn.DataParallel`` (which the HF Trainer uses on several GPUs under plain ``python``)
    replicates a module by copying its ``__dict__``: the patched forward must be bound to each
    replica, not to the original module on the first GPU."""
    model = tiny_model("llama", seed=3)
    lp.apply_liger_to(model)
    batch = make_batch(seed=11)
    expected = model(**batch).loss.detach()
    replica = model._replicate_for_data_parallel()
    assert replica.forward.__self__ is replica
    assert replica._replicate_for_data_parallel.__self__ is replica
    replica.lm_head = copy.deepcopy(model.lm_head)  # a replica's own parameters, as on another GPU
    out = replica(**batch)
    assert out.logits is None
    out.loss.backward()
    assert replica.lm_head.weight.grad is not None and model.lm_head.weight.grad is None
    torch.testing.assert_close(out.loss.detach(), expected, rtol=1e-6, atol=1e-6)
    lp.revert_liger(model)
    assert "_replicate_for_data_parallel" not in vars(model)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nn.DataParallel needs two CUDA devices")
def test_data_parallel_on_two_gpus():
    model = tiny_model("llama", seed=3).cuda()
    lp.apply_liger_to(model)
    batch = {k: v.cuda() for k, v in make_batch(seed=11).items()}
    expected = model(**batch).loss.detach()
    out = torch.nn.DataParallel(model)(**batch)
    torch.testing.assert_close(out.loss.mean().detach(), expected, rtol=1e-3, atol=1e-3)
