"""apply_liger_to / revert_liger / liger_patched / register_model: what gets patched, and undone."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch
import transformers

import liger_patch as lp
from liger_patch.patching.forward import is_liger_forward
from liger_patch.patching.registry import BUILTIN_ROWS
from liger_patch.patching.state import STATE_ATTR
from tests.patching_helpers import class_patch, device_and_dtype, make_batch, tiny_model, tolerances

BUILTIN = {row.model_type: row for row in BUILTIN_ROWS}


def test_instance_patch_touches_only_that_instance():
    model, other = tiny_model("llama"), tiny_model("llama")
    assert lp.apply_liger_to(model) is model
    assert is_liger_forward(model.forward)
    assert not is_liger_forward(other.forward)
    assert not is_liger_forward(transformers.LlamaForCausalLM.forward)


def test_apply_is_idempotent_and_updates_options():
    model = tiny_model("llama")
    lp.apply_liger_to(model)
    first = model.forward.__func__
    lp.apply_liger_to(model, z_loss_scale=1e-3)
    assert model.forward.__func__ is first  # no wrapper stacked on the wrapper
    assert getattr(model, STATE_ATTR).options.z_loss_scale == 1e-3
    assert model(**make_batch()).z_loss is not None


def test_revert_restores_the_exact_original():
    model = tiny_model("llama")
    before = dict(vars(model))
    lp.apply_liger_to(model)
    lp.revert_liger(model)
    assert "forward" not in vars(model) and STATE_ATTR not in vars(model)
    assert vars(model).keys() == before.keys()
    assert model.forward.__func__ is transformers.LlamaForCausalLM.forward
    assert model(**make_batch()).logits is not None
    lp.revert_liger(model)  # reverting twice is harmless


def test_liger_patched_is_scoped():
    model = tiny_model("llama")
    with lp.liger_patched(model, z_loss_scale=1e-3) as patched:
        assert patched is model
        assert model(**make_batch()).logits is None
    assert not is_liger_forward(model.forward)
    lp.apply_liger_to(model)
    with lp.liger_patched(model, z_loss_scale=1e-2):
        assert getattr(model, STATE_ATTR).options.z_loss_scale == 1e-2
    assert is_liger_forward(model.forward)  # patched before the block: still patched, old options back
    assert getattr(model, STATE_ATTR).options.z_loss_scale == 0.0


def test_class_level_patch_covers_later_instances_and_reverts():
    original = transformers.LlamaForCausalLM.forward
    with class_patch(transformers.LlamaForCausalLM):
        model = tiny_model("llama")
        assert "forward" not in vars(model)
        out = model(**make_batch())
        assert out.logits is None
        lp.apply_liger_to(model, z_loss_scale=1e-3)  # instance options on top of a class patch
        assert model(**make_batch()).z_loss is not None
    assert transformers.LlamaForCausalLM.forward is original
    assert tiny_model("llama")(**make_batch()).logits is not None


def test_model_type_string_patches_the_class():
    original = transformers.Qwen2ForCausalLM.forward
    with class_patch("qwen2"):
        assert is_liger_forward(transformers.Qwen2ForCausalLM.forward)
        assert tiny_model("qwen2")(**make_batch()).logits is None
    assert transformers.Qwen2ForCausalLM.forward is original


def test_subclass_of_a_supported_class_uses_its_row():
    class MyLlama(transformers.LlamaForCausalLM):
        pass

    base = tiny_model("llama")
    model = MyLlama(base.config)
    model.load_state_dict(base.state_dict())
    model.to(base.lm_head.weight.device, base.lm_head.weight.dtype).train()
    lp.apply_liger_to(model)
    batch = make_batch()
    out = model(**batch)
    assert out.logits is None
    torch.testing.assert_close(out.loss, base(**batch).loss, rtol=1e-4, atol=1e-4)


@pytest.fixture
def scratch_registry(monkeypatch):
    """Rows registered in the test are dropped after it (other tests see the registry as it was)."""
    from liger_patch.patching import registry

    monkeypatch.setattr(registry, "_ROWS_BY_CLASS", dict(registry._ROWS_BY_CLASS))
    monkeypatch.setattr(registry, "_ROWS_BY_MODEL_TYPE", dict(registry._ROWS_BY_MODEL_TYPE))


class NoProjectionLlama(transformers.LlamaForCausalLM):
    """A model whose get_output_embeddings() names nothing: derivation cannot find its head."""

    def get_output_embeddings(self):
        return None


def test_model_without_an_output_projection_is_refused_naming_the_fix():
    model = NoProjectionLlama(tiny_model("llama").config)
    refusal = r"NoProjectionLlama.*get_output_embeddings.*ModelSpec\(head="
    with pytest.raises(lp.UnsupportedModelError, match=refusal):
        lp.apply_liger_to(model)
    with pytest.warns(UserWarning, match="NoProjectionLlama.*left unpatched"):
        assert lp.apply_liger_to(model, strict=False) is model
    assert not is_liger_forward(model.forward)
    with pytest.raises(lp.UnsupportedModelError, match="no_such_model"):
        lp.apply_liger_to("no_such_model")


def test_model_whose_forward_takes_no_labels_is_refused():
    class NoLabels(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask)

    with pytest.raises(lp.UnsupportedModelError, match="NoLabels.forward takes no labels"):
        lp.apply_liger_to(NoLabels)


def test_register_model_names_the_head_and_wins_over_derivation(scratch_registry):
    row = lp.ModelSpec(model_type="no_projection", class_name="", head="lm_head")
    spec = lp.register_model(NoProjectionLlama, row)
    assert spec.class_name == "NoProjectionLlama" and not spec.derived
    assert lp.supported_models(derived=False) == {**BUILTIN, "no_projection": spec}
    llama = tiny_model("llama")
    reference = NoProjectionLlama(llama.config).train().to(llama.lm_head.weight)
    patched = copy.deepcopy(reference)
    lp.apply_liger_to(patched)
    batch = make_batch()
    out = patched(**batch)
    assert out.logits is None
    tol = tolerances(device_and_dtype()[1]).loss
    torch.testing.assert_close(out.loss, reference(**batch).loss, rtol=tol, atol=tol)


def tiny_gpt2(cls, seed: int = 0):
    """A GPT-2 (decoder body ``transformer``, not ``model``) without dropout, in train mode."""
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    torch.manual_seed(seed)
    return cls(config).train()


def test_users_subclass_of_a_transformers_model_patches_with_no_registration(scratch_registry):
    class MyGPT2(transformers.GPT2LMHeadModel):  # decoder body ``transformer``, head found by derivation
        pass

    assert lp.supported_models(derived=False) == BUILTIN
    model = tiny_gpt2(MyGPT2, seed=1)
    reference = copy.deepcopy(model)
    lp.apply_liger_to(model)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(5))
    out = model(input_ids=ids, labels=ids)
    assert out.logits is None
    torch.testing.assert_close(out.loss, reference(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("role", "path"), [("head", "output"), ("head", "model.decoder")])
def test_registered_row_with_a_wrong_path_is_refused_at_apply(scratch_registry, role, path):
    class MyLlama(transformers.LlamaForCausalLM):
        pass

    lp.register_model(MyLlama, lp.ModelSpec(model_type="my_llama", class_name="", **{role: path}))
    batch = make_batch()
    model = MyLlama(tiny_model("llama").config).train().to(batch["input_ids"].device)
    children = "embed_tokens, layers, norm, rotary_emb" if path.startswith("model.") else "model, lm_head"
    with pytest.raises(lp.UnsupportedModelError, match=rf"{role}='{path}'.*child modules are: {children}"):
        lp.apply_liger_to(model)
    assert not is_liger_forward(model.forward)
    with pytest.warns(UserWarning, match=f"{role}='{path}'"):
        lp.apply_liger_to(model, strict=False)
    assert not is_liger_forward(model.forward)
    assert model(**batch).logits is not None


def test_class_patch_with_a_wrong_path_names_it_at_the_forward(scratch_registry):
    class MyLlama(transformers.LlamaForCausalLM):
        pass

    lp.register_model(MyLlama, lp.ModelSpec(model_type="my_llama", class_name="", head="nonexistent"))
    with class_patch(MyLlama):
        batch = make_batch()
        model = MyLlama(tiny_model("llama").config).train().to(batch["input_ids"].device)
        with pytest.raises(AttributeError, match="MyLlama has no submodule 'nonexistent'.*child modules are"):
            model(**batch)


def test_import_pulls_in_no_transformers():
    """`import liger_patch` must stay cheap: transformers (~1 s), peft and torch.distributed's
    FSDP/DTensor modules are imported when a model is patched, not before."""
    heavy = (
        "transformers",
        "transformers.modeling_utils",
        "peft",
        "torch.distributed.fsdp",
        "torch.distributed.tensor",
    )
    code = f"import sys, liger_patch; print([m for m in {heavy!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_an_instance_level_wrapper_keeps_running_on_the_fused_path():
    """A forward already replaced on the instance (accelerate's autocast wrapper) runs on both
    paths: the fused path runs the model's own forward through it, with the head captured."""
    model = tiny_model("llama")
    original, calls = model.forward, []

    def wrapper(*args, **kwargs):  # like accelerate's autocast wrapper
        calls.append(1)
        return original(*args, **kwargs)

    model.forward = wrapper
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lp.apply_liger_to(model)
        assert model(**make_batch()).logits is None
    assert len(calls) == 1
    lp.revert_liger(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert model(**make_batch()).logits is not None
    assert len(calls) == 2


def _distinct_runs(values: list) -> list:
    """``values`` with repeats in a row collapsed: a forward may resolve its budget more than once
    (every row's before the label check, for ``ops/core/head_start.py``; the kept rows' after)."""
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


def test_memory_budget_reaches_the_op_and_is_scoped(monkeypatch):
    """apply_liger_to(memory_budget=...) is what the fused loss gets; liger_patched restores the
    previous one; None leaves the choice to LIGER_MEMORY_BUDGET, read at call time. (Without call
    plans: a planned call, ``ops/cross_entropy/one_chunk.py``, resolves no budget, its plan's is
    its signature's; tests/ops/cross_entropy/test_one_chunk.py checks that.)"""
    from liger_patch.ops.core import budget
    from liger_patch.ops.core.tuning import Tuning

    seen = []
    real = budget.resolve_budget

    def spy(value, hidden_bytes=None, whole_bytes=None):
        seen.append(value)
        return real(value, hidden_bytes, whole_bytes)

    monkeypatch.setattr(budget, "resolve_budget", spy)
    model = tiny_model("llama")
    batch = make_batch()
    lp.apply_liger_to(model, memory_budget="lean", tuning=Tuning(call_plans=False))
    reference = model(**batch).loss
    with lp.liger_patched(model, memory_budget=4096):
        torch.testing.assert_close(model(**batch).loss, reference, rtol=1e-6, atol=1e-6)
    model(**batch)
    lp.apply_liger_to(model)
    monkeypatch.setenv("LIGER_MEMORY_BUDGET", "not a size")
    with pytest.raises(ValueError, match="LIGER_MEMORY_BUDGET"):
        model(**batch)
    assert _distinct_runs(seen) == ["lean", 4096, "lean", None]


def test_a_patched_forward_sizes_its_budget_by_the_batch_unless_one_is_named(monkeypatch):
    """With no memory_budget and LIGER_MEMORY_BUDGET unset, the fused loss of a patched forward
    gets "batch" (sized by the hidden states and by one chunk of the call's rows,
    ops.core.budget.batch_budget); the environment and an explicit option still win. (Each call
    below has a signature of its own, and tests/conftest.py leaves no call plan from an earlier
    test: a planned call, ``ops/cross_entropy/one_chunk.py``, resolves no budget.)"""
    from liger_patch.ops.core import budget

    seen, wholes = [], []
    real = budget.resolve_budget

    def spy(value, hidden_bytes=None, whole_bytes=None):
        seen.append((value, hidden_bytes))
        wholes.append(whole_bytes)
        return real(value, hidden_bytes, whole_bytes)

    monkeypatch.setattr(budget, "resolve_budget", spy)
    monkeypatch.delenv("LIGER_MEMORY_BUDGET", raising=False)
    model = tiny_model("llama")
    batch = make_batch()
    lp.apply_liger_to(model)
    model(**batch)
    hidden_bytes = batch["input_ids"].numel() * model.config.hidden_size * model.dtype.itemsize
    assert _distinct_runs(seen) == [("batch", hidden_bytes)]
    assert wholes[0] > batch["input_ids"].numel() // 2 * model.config.vocab_size  # one chunk's logits
    monkeypatch.setenv("LIGER_MEMORY_BUDGET", "lean")
    model(**batch)
    assert seen[-1] == (None, hidden_bytes)
    monkeypatch.delenv("LIGER_MEMORY_BUDGET")
    with lp.liger_patched(model, memory_budget="default"):
        model(**batch)
    assert seen[-1] == ("default", hidden_bytes)


def test_bad_memory_budget_is_refused_at_apply():
    with pytest.raises(ValueError, match="memory_budget"):
        lp.apply_liger_to(tiny_model("llama"), memory_budget="huge")
    with pytest.raises(TypeError, match="memory_budget"):
        lp.LigerPatchCallback(memory_budget=1.5).on_init_end(None, None, None, model=tiny_model("llama"))


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("ignore_index", 0),
        ("reduction", "sum"),
        ("softcap", 2.0),
        ("logit_scale", 2.0),
        ("return_z_loss", True),
    ],
)
def test_options_the_forward_sets_are_refused_naming_who_sets_them(option, value):
    from liger_patch.patching.forward import FORWARD_SETS

    assert option in FORWARD_SETS
    model = tiny_model("llama")
    with pytest.raises(TypeError, match=rf"{option}.*the patched forward sets them on every call"):
        lp.apply_liger_to(model, **{option: value})
    assert not is_liger_forward(model.forward)
    with pytest.raises(TypeError, match="the patched forward sets them"):
        lp.LigerPatchCallback(**{option: value})


def test_unknown_options_are_refused_listing_the_options():
    with pytest.raises(TypeError, match=r"apply_liger_to got unknown option\(s\) \['z_loss'\]"):
        lp.apply_liger_to(tiny_model("llama"), z_loss=1e-3)
    with pytest.raises(TypeError, match=r"LigerPatchCallback got unknown option"):
        lp.LigerPatchCallback(smoothing=0.1)


def test_signatures_and_docs_list_the_options():
    import inspect

    from liger_patch.ops.cross_entropy.options import OPTION_NAMES
    from liger_patch.patching.forward import FORWARD_SETS

    taken = [name for name in OPTION_NAMES if name not in FORWARD_SETS]
    for entry, first in (
        (lp.apply_liger_to, ["target"]),
        (lp.liger_patched, ["target"]),
        (lp.LigerPatchCallback, []),
    ):
        parameters = inspect.signature(entry).parameters
        assert list(parameters) == [*first, "strict", *taken], entry
        assert all(parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in ["strict", *taken])
        assert all(f"{name}: " in entry.__doc__ for name in taken), entry


def test_every_option_the_forward_sets_is_set_per_call(monkeypatch):
    """FORWARD_SETS (refused at apply) is exactly what the forward passes the op per call, with
    memory_budget only while the patch and the environment name none (the "batch" default)."""
    from liger_patch.patching import forward

    seen = []
    real = forward.fused_head_loss

    def spy(*args, **kwargs):
        seen.append(set(kwargs) - {"options", "num_items_in_batch", "extra_bias"})
        return real(*args, **kwargs)

    monkeypatch.setattr(forward, "fused_head_loss", spy)
    model = tiny_model("llama")
    monkeypatch.delenv("LIGER_MEMORY_BUDGET", raising=False)
    lp.apply_liger_to(model)
    model(**make_batch())
    lp.apply_liger_to(model, memory_budget="lean")
    model(**make_batch())
    assert seen == [set(forward.FORWARD_SETS) | {"memory_budget"}, set(forward.FORWARD_SETS)]


def test_patch_state_reads_through_wrappers():
    from liger_patch.patching.state import patch_state

    model = tiny_model("llama")
    assert patch_state(model) is None and patch_state(None) is None
    lp.apply_liger_to(model, z_loss_scale=1e-3)
    assert patch_state(model).options.z_loss_scale == 1e-3
    assert patch_state(torch.compile(model)) is patch_state(model)
