"""One ``LossOptions`` from every entry point: validated once, unknown names refused, and every
field reachable by keyword from the functional and the Module (their signatures list them)."""

import dataclasses
import inspect

import pytest
import torch

import liger_patch as lp
from liger_patch.ops.options import OPTION_DOCS, OPTION_NAMES, LossOptions, build_options, constant_changes
from liger_patch.ops.tuning import Tuning


def test_numbers_are_normalised_and_the_object_is_frozen_and_hashable():
    opts = LossOptions(label_smoothing=1, z_loss_scale=torch.tensor(0.5), softcap=30)
    assert (opts.label_smoothing, opts.z_loss_scale, opts.softcap) == (1.0, 0.5, 30.0)
    assert all(type(v) is float for v in (opts.label_smoothing, opts.z_loss_scale, opts.softcap))
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.softcap = 1.0
    assert hash(opts) == hash(LossOptions(label_smoothing=1.0, z_loss_scale=0.5, softcap=30.0))


@pytest.mark.parametrize(
    "entry",
    [
        lambda **kw: LossOptions.from_kwargs(**kw),
        lambda **kw: lp.FusedLinearCrossEntropyLoss(**kw),
        lambda **kw: lp.fused_linear_cross_entropy(
            torch.randn(2, 3), torch.randn(4, 3), torch.zeros(2).long(), **kw
        ),
    ],
    ids=["LossOptions", "Module", "functional"],
)
def test_unknown_option_is_refused_naming_it(entry):
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['z_los_scale'\].*z_loss_scale"):
        entry(z_los_scale=1e-4)


def test_replace_checks_the_new_values():
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        LossOptions().replace(label_smoothing=1.5)
    with pytest.raises(TypeError, match="unknown option"):
        LossOptions().replace(smoothing=0.1)


@pytest.mark.parametrize("value", ["fast", 3])
def test_tuning_must_be_a_tuning(value):
    with pytest.raises(TypeError, match="tuning must be"):
        LossOptions(tuning=value)


def test_a_str_tuning_is_refused_at_the_public_call_too():
    h, w, y = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
    with pytest.raises(TypeError, match="tuning must be"):
        lp.fused_linear_cross_entropy(h, w, y, tuning="fast")


def test_options_and_tuning_survive_their_keys():
    tuning = Tuning(chunk_rows=7, row_warps=((4096, 8), (0, 4)), two_pass=True)
    assert Tuning.from_key(tuning.key) == tuning
    opts = LossOptions(tuning=tuning, label_smoothing=0.25, logits_dtype=torch.float32, reduction="sum")
    assert LossOptions.from_key(opts.key) == opts
    assert build_options(opts.key, **constant_changes({"tuning": Tuning()})).tuning == Tuning()


@pytest.mark.parametrize("bad", [dict(chunk_rows=0), dict(min_token_chunk_rows=-1), dict(row_warps=())])
def test_bad_tuning_values(bad):
    with pytest.raises(ValueError, match="Tuning"):
        Tuning(**bad)


@pytest.mark.parametrize(
    "entry", [lp.fused_linear_cross_entropy, lp.FusedLinearCrossEntropyLoss], ids=["functional", "Module"]
)
def test_signatures_list_every_option_with_its_default(entry):
    params = inspect.signature(entry).parameters
    for field in dataclasses.fields(LossOptions):
        assert params[field.name].default == field.default, field.name
        assert params[field.name].kind is inspect.Parameter.KEYWORD_ONLY


def test_every_option_is_documented_in_the_functional_docstring():
    assert set(OPTION_DOCS) == set(OPTION_NAMES)
    for name in OPTION_NAMES:
        assert f"{name}: {OPTION_DOCS[name]}" in lp.fused_linear_cross_entropy.__doc__


def test_module_carries_one_options_object():
    loss_fn = lp.FusedLinearCrossEntropyLoss(z_loss_scale=1e-4, tuning=Tuning(chunk_rows=3))
    assert loss_fn.options == LossOptions(z_loss_scale=1e-4, tuning=Tuning(chunk_rows=3))
    assert repr(loss_fn) == "FusedLinearCrossEntropyLoss(z_loss_scale=0.0001, tuning=Tuning(chunk_rows=3))"
