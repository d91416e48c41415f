"""One ``LossOptions`` from every entry point: validated once, unknown names refused, every
field reachable by keyword from the functional and the Module (their signatures list them), and
every field tagged with its kind (loss math / output / runtime), the tags checked by behaviour."""

import dataclasses
import inspect

import pytest
import torch

import liger_patch as lp
from liger_patch.ops.core.options import constant_changes
from liger_patch.ops.core.tuning import Tuning
from liger_patch.ops.cross_entropy.options import (
    LOSS_OPTIONS,
    OPTION_DOCS,
    OPTION_KINDS,
    OPTION_NAMES,
    OUTPUT_OPTIONS,
    LossOptions,
    OptionKind,
    _option,
    build_options,
    option_defaults,
    option_kinds,
    options_of_kind,
)
from liger_patch.ops.cross_entropy.outputs import OUTPUT_NAMES


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


# ---------------------------------------------------------------- kinds


def test_every_field_has_a_kind():
    assert tuple(OPTION_KINDS) == OPTION_NAMES
    assert all(isinstance(kind, OptionKind) for kind in OPTION_KINDS.values())
    assert set(options_of_kind(*OptionKind)) == set(OPTION_NAMES)


def test_a_field_without_a_kind_is_refused_naming_it():
    @dataclasses.dataclass(frozen=True)
    class Options:
        tagged: float = _option(0.0, OptionKind.LOSS)
        untagged: float = 0.0

    with pytest.raises(TypeError, match=r"without a kind: \['untagged'\]"):
        option_kinds(Options)


def test_output_names_follow_the_output_options():
    """``outputs.py`` names each output as its option without "return_", in the options' order,
    which is the order a call returns them in (a contract: ``loss, z_loss, accuracy = ...``)."""
    assert OUTPUT_NAMES == ("z_loss", "token_accuracy", "predicted_tokens", "entropy")


def test_option_defaults_by_kind():
    assert option_defaults(OptionKind.OUTPUT) == dict.fromkeys(OUTPUT_OPTIONS, False)
    loss = option_defaults(OptionKind.LOSS)
    assert tuple(loss) == LOSS_OPTIONS and loss["ignore_index"] == -100 and loss["softcap"] is None


# A value other than the default for every option, chosen so that a loss-math option changes this
# case's loss. A new option fails test_kinds_are_what_the_options_do until it has one here.
SAMPLES = {
    "ignore_index": 3,
    "reduction": "sum",
    "label_smoothing": 0.2,
    "z_loss_scale": 0.1,
    "softcap": 2.0,
    "logit_scale": 0.5,
    "return_z_loss": True,
    "return_token_accuracy": True,
    "return_predicted_tokens": True,
    "return_entropy": True,
    "use_token_scaling": True,
    "backend": "triton",
    "memory_budget": "lean",
    "logits_dtype": torch.float32,
    "tuning": Tuning(chunk_rows=3, min_token_chunk_rows=1),
}


def _loss_and_grads(**options):
    """Loss and gradients on the GPU where there is one (the Triton sample needs CUDA tensors
    there; on a CPU machine tests/conftest.py runs Triton's interpreter)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 6, generator=gen).to(device).requires_grad_()
    weight = torch.randn(11, 6, generator=gen).to(device).requires_grad_()
    labels = torch.tensor([3, 1, 3, 4, 5, 6, 7, 8, 3], device=device)
    options.setdefault("backend", "torch")
    out = lp.fused_linear_cross_entropy(hidden, weight, labels, **options)
    loss = out if torch.is_tensor(out) else out.loss
    loss.sum().backward()
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("name", OPTION_NAMES)
def test_kinds_are_what_the_options_do(name):
    """A loss-math option changes the loss (its value here); an output or runtime option leaves
    the loss and its gradients as they are (to fp32 rounding: another backend or chunking sums in
    another order)."""
    assert set(SAMPLES) == set(OPTION_NAMES), "every option needs a sample value here"
    base = _loss_and_grads()
    changed = _loss_and_grads(**{name: SAMPLES[name]})
    if OPTION_KINDS[name] is OptionKind.LOSS:
        assert not torch.allclose(changed[0], base[0], rtol=1e-3), f"{name} (loss math) left the loss as is"
    else:
        for got, expected in zip(changed, base, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
