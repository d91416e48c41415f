"""TRL's trainers through the fused op: SFT, DPO, KTO, GRPO and RLOO, unmodified, with
``LigerPatchCallback``; and ORPO and CPO, which take the logits, unfused and warned.

Each test trains the same tiny model from the same seed twice, once as TRL runs it and once
with the callback, and checks that the op computed the log-probs (its calls counted), that
losses, metrics and the trained weights agree, and that nothing was warned. TRL's fused head
(1.15 onwards) calls one kernel that ``liger_patch.integrations.trl`` takes over.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")

from liger_patch import LigerPatchCallback  # noqa: E402
from liger_patch.integrations import trl as trl_head  # noqa: E402
from liger_patch.patching.state import LigerBypassWarning  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from tiny_trl import (  # noqa: E402
    arithmetic_chats,
    arithmetic_labelled,
    arithmetic_preferences,
    arithmetic_prompts,
    digit_reward,
    tiny_model,
    tiny_tokenizer,
)

if not hasattr(trl.trainer.utils, "add_fused_lm_head"):
    pytest.skip("this TRL has no fused LM head (before 1.15)", allow_module_level=True)

# grad_norm too: TRL clips at norm 1 by default, which would hide a gradient wrong by a factor
METRICS = ("loss", "mean_token_accuracy", "entropy", "grad_norm")
# fp32 (``bf16=False``; TRL's configs default to bf16, which on the CPU is bf16 autocast): the two
# runs differ only by fp32 rounding, so logged values and weights agree to ~1e-6 after 3 steps.
FP32 = dict(rtol=5e-5, atol=5e-6)
# TRL's default bf16 autocast: both heads multiply in bf16, but not in the same order, and DPO's
# chosen-minus-rejected gradients cancel, so the runs part by ~1e-3 relative (grad_norm 0.15 %).
BF16 = dict(rtol=1e-2, atol=1e-3)
# Plain SGD: Adam would turn a rounding-level difference in a near-zero gradient into a whole
# step of the learning rate, and hide the gradients' agreement. A wrong gradient moves weights by
# ~1e-2 at this rate, far above either tolerance.
OPTIMIZER = dict(optim="sgd", learning_rate=0.05)
# The op's PyTorch backend (auto would pick the Triton kernels, interpreted on CPU in the tests:
# tests/ops covers those).
CALLBACK = dict(backend="torch")


def _common(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=3,
        logging_steps=1,
        **OPTIMIZER,
        save_strategy="no",
        report_to=[],
        seed=0,
        data_seed=0,
        use_cpu=True,
        bf16=False,
    )
    base.update(overrides)
    return base


def _train(make_trainer, patched: bool, bypassed: bool = False):
    """Log history and trained parameters of one run. Warnings of ours are errors; with
    ``bypassed`` (a trainer that takes its loss from the logits) exactly one is expected."""
    callbacks = [LigerPatchCallback(**CALLBACK)] if patched else []
    with warnings.catch_warnings(record=bypassed) as caught:
        warnings.simplefilter("always" if bypassed else "error", LigerBypassWarning)
        trainer = make_trainer(callbacks)
        trainer.train()
    if bypassed:
        said = [w.message for w in caught if issubclass(w.category, LigerBypassWarning)]
        assert len(said) == 1, said
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return trainer.state.log_history, params


def _assert_same_run(reference, ours, keys, tol=FP32):
    (ref_log, ref_params), (log, params) = reference, ours
    ref_steps = [e for e in ref_log if "loss" in e]
    steps = [e for e in log if "loss" in e]
    assert len(steps) == len(ref_steps) > 0
    for ref_entry, entry in zip(ref_steps, steps, strict=True):
        for key in keys:
            assert key in entry, f"{key} not logged: {sorted(entry)}"
            torch.testing.assert_close(
                torch.tensor(entry[key]),
                torch.tensor(ref_entry[key]),
                **tol,
                msg=lambda m, k=key: f"{k}: {m}",
            )
    assert ref_params.keys() == params.keys()
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], **tol, msg=lambda m, n=name: f"param {n}: {m}")


# ---------------------------------------------------------------- SFT


def _sft(tmp_path, *, peft=False, **config):
    def make(callbacks):
        peft_config = None
        if peft:
            from peft import LoraConfig

            peft_config = LoraConfig(
                r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
            )
        return trl.SFTTrainer(
            model=tiny_model(seed=1),
            args=trl.SFTConfig(**_common(tmp_path, **config)),
            train_dataset=arithmetic_chats(48),
            processing_class=tiny_tokenizer(),
            peft_config=peft_config,
            callbacks=callbacks,
        )

    return make


@pytest.mark.parametrize(
    "config",
    [
        dict(gradient_accumulation_steps=2),
        dict(gradient_accumulation_steps=2, packing=True, max_length=64),
        dict(gradient_accumulation_steps=1, loss_type="dft"),
        dict(
            gradient_accumulation_steps=2, assistant_only_loss=False, completion_only_loss=None, packing=False
        ),
    ],
    ids=["accumulation", "packing", "dft", "all-tokens"],
)
def test_sft_trains_through_the_op_with_trl_metrics(tmp_path, op_calls, config):
    reference = _train(_sft(tmp_path / "trl", **config), patched=False)
    assert not op_calls, "the op ran without the callback"
    ours = _train(_sft(tmp_path / "ours", **config), patched=True)
    accumulation = config.get("gradient_accumulation_steps", 1)
    assert len(op_calls) == 3 * accumulation, op_calls  # one per micro-batch
    _assert_same_run(reference, ours, METRICS)


def test_sft_with_lora(tmp_path, op_calls):
    reference = _train(_sft(tmp_path / "trl", peft=True, gradient_accumulation_steps=2), patched=False)
    ours = _train(_sft(tmp_path / "ours", peft=True, gradient_accumulation_steps=2), patched=True)
    assert len(op_calls) == 6
    _assert_same_run(reference, ours, METRICS)


# ---------------------------------------------------------------- DPO and KTO


def _trl_classes(trainer: str, module=trl):
    """The trainer and config classes of ``trainer`` in ``module`` (TRL's top level unless
    given): "dpo" -> DPOTrainer, DPOConfig."""
    return getattr(module, f"{trainer.upper()}Trainer"), getattr(module, f"{trainer.upper()}Config")


def _dpo(tmp_path, trainer="dpo", **config):
    """A preference trainer with a reference model: DPO on preference pairs, KTO on the same
    completions unpaired and labelled."""
    trainer_class, config_class = _trl_classes(trainer)

    def make(callbacks):
        return trainer_class(
            model=tiny_model(seed=2),
            ref_model=tiny_model(seed=2),
            args=config_class(**_common(tmp_path, **config)),
            train_dataset=arithmetic_preferences(24) if trainer == "dpo" else arithmetic_labelled(24),
            processing_class=tiny_tokenizer(),
            callbacks=callbacks,
        )

    return make


DPO_KEYS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "logits/chosen")
DPO_KEYS += ("logits/rejected", "mean_token_accuracy", "entropy", "loss")


def test_dpo_log_probs_come_from_the_op(tmp_path, op_calls):
    config = dict(gradient_accumulation_steps=2, beta=0.5)
    reference = _train(_dpo(tmp_path / "trl", **config), patched=False)
    ours = _train(_dpo(tmp_path / "ours", **config), patched=True)
    # the policy's chosen + rejected batch, once per micro-batch; the unpatched reference model
    # stays on TRL's kernel
    assert len(op_calls) == 6, op_calls
    _assert_same_run(reference, ours, (*DPO_KEYS, "grad_norm"))


KTO_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
KTO_KEYS += ("logits/chosen", "logits/rejected", "kl", "entropy", "loss", "grad_norm")


def test_kto_log_probs_and_kl_come_from_the_op(tmp_path, op_calls):
    config = dict(gradient_accumulation_steps=2, beta=0.5)
    reference = _train(_dpo(tmp_path / "trl", trainer="kto", **config), patched=False)
    ours = _train(_dpo(tmp_path / "ours", trainer="kto", **config), patched=True)
    # per micro-batch the policy's completions and its mismatched (KL) pairs; the unpatched
    # reference model stays on TRL's kernel
    assert len(op_calls) == 12, op_calls
    _assert_same_run(reference, ours, KTO_KEYS)


@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_trls_default_bf16_autocast(tmp_path, op_calls, trainer):
    """As users run it: TRL's configs default to ``bf16=True`` (autocast; on the CPU too). Both
    heads multiply in bf16; the runs agree to bf16 rounding."""
    make = _sft if trainer == "sft" else _dpo
    config = dict(gradient_accumulation_steps=2, bf16=True)
    reference = _train(make(tmp_path / "trl", **config), patched=False)
    ours = _train(make(tmp_path / "ours", **config), patched=True)
    assert len(op_calls) == 6, op_calls
    _assert_same_run(reference, ours, METRICS if trainer == "sft" else (*DPO_KEYS, "grad_norm"), tol=BF16)


# ---------------------------------------------------------------- GRPO and RLOO


def _grpo(tmp_path, trainer="grpo", **config):
    # by path, as users pass it: GRPO loads its reference model (beta > 0) from the same name
    checkpoint = tmp_path / "checkpoint"
    tiny_model(seed=3).save_pretrained(checkpoint)
    tiny_tokenizer().save_pretrained(checkpoint)

    def make(callbacks):
        torch.manual_seed(0)
        trainer_class, config_class = _trl_classes(trainer)
        return trainer_class(
            model=str(checkpoint),
            reward_funcs=digit_reward,
            args=config_class(
                **_common(
                    tmp_path,
                    per_device_train_batch_size=4,
                    num_generations=4,
                    max_completion_length=8,
                    max_steps=2,
                    temperature=0.7,
                    beta=0.1,
                    **config,
                )
            ),
            train_dataset=arithmetic_prompts(16),
            processing_class=tiny_tokenizer(),
            callbacks=callbacks,
        )

    return make


@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_grpo_log_probs_and_entropy_come_from_the_op(tmp_path, op_calls, trainer):
    reference = _train(_grpo(tmp_path / "trl", trainer), patched=False)
    ours = _train(_grpo(tmp_path / "ours", trainer), patched=True)
    assert len(op_calls) >= 2, op_calls  # the policy's log-probs and entropy in each step
    _assert_same_run(reference, ours, ("loss", "entropy", "kl", "reward", "grad_norm"))


# ---------------------------------------------------------------- trainers that take the logits


def _logits_trainer(tmp_path, trainer, **config):
    """One of TRL's experimental preference trainers that compute their loss from the model's
    logits (no fused head, no reference model)."""
    trainer_class, config_class = _trl_classes(
        trainer, importlib.import_module(f"trl.experimental.{trainer}")
    )

    def make(callbacks):
        return trainer_class(
            model=tiny_model(seed=6),
            args=config_class(**_common(tmp_path, **config)),
            train_dataset=arithmetic_preferences(24),
            processing_class=tiny_tokenizer(),
            callbacks=callbacks,
        )

    return make


LOGITS_KEYS = ("loss", "nll_loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")
LOGITS_KEYS += ("logits/chosen", "logits/rejected", "grad_norm")


@pytest.mark.parametrize("trainer", ["orpo", "cpo"])
def test_trainers_taking_the_logits_train_as_without_the_patch_and_say_so(tmp_path, op_calls, trainer):
    """ORPO and CPO call the model without labels and take their losses from its logits: the
    patched model hands them the full logits, so they train exactly as without the patch
    (unfused), and one ``LigerBypassWarning`` says so."""
    config = dict(gradient_accumulation_steps=2)
    reference = _train(_logits_trainer(tmp_path / "trl", trainer, **config), patched=False)
    ours = _train(_logits_trainer(tmp_path / "ours", trainer, **config), patched=True, bypassed=True)
    assert not op_calls
    _assert_same_run(reference, ours, LOGITS_KEYS)


# ---------------------------------------------------------------- the hook itself


def test_unpatched_models_keep_trls_kernel(tmp_path, op_calls):
    """With the hook installed (an earlier patch did it) an unpatched model runs TRL's own kernel."""
    from liger_patch import apply_liger_to

    apply_liger_to(tiny_model(seed=4))
    assert trl_head.installed()
    model = tiny_model(seed=5)
    trl.trainer.utils.add_fused_lm_head(model, outputs=("entropy", "is_top1"))
    ids = torch.randint(3, 200, (2, 9))
    out = model(input_ids=ids, labels=ids, fused_lm_head=True)
    assert not op_calls and torch.isfinite(out.loss)


_HOOK_PROBE = """
import sys
import liger_patch as lp
from liger_patch.integrations import trl as head
{before}
lp.apply_liger_to("llama")
{after}
print(head.installed())
"""


@pytest.mark.parametrize("trl_first", [True, False], ids=["trl-imported-first", "trl-imported-later"])
def test_the_hook_is_installed_whichever_is_imported_first(trl_first):
    """In a fresh interpreter: with TRL imported before ``apply_liger_to`` the patch installs the
    hook at once; imported after, the import hook installs it when ``trl.trainer.utils`` loads.
    Before any patch, importing liger_patch installs nothing."""
    import subprocess

    before = "import trl.trainer.utils\nassert not head.installed()" if trl_first else ""
    after = "" if trl_first else "import trl.trainer.utils"
    probe = _HOOK_PROBE.format(before=before, after=after)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "True"


def test_fields_equal_trls_kernel_for_every_output_and_head_math():
    """The five fields at a temperature, with a scale, softcap and bias, against TRL's kernel:
    values and the gradients of log-probs and entropy."""
    from liger_patch import apply_liger_to

    model = tiny_model(seed=6)
    apply_liger_to(model)
    state = model._liger_patch_state
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(37, 64, generator=gen, dtype=torch.float64).float().requires_grad_()
    w = (torch.randn(301, 64, generator=gen) * 0.2).requires_grad_()
    b = torch.randn(301, generator=gen).requires_grad_()
    y = torch.randint(0, 301, (37,), generator=gen)
    original = trl_head.FusedLogProbHead(trl.kernels.ChunkedLogProbFunction).original
    args = (0.7, 64, 5.0, 1.3, trl_head.FIELDS[1:])
    expected = original.apply(h, w, b, y, *args)
    math_options = trl_head.temperature_options(0.7, 1.3, 5.0)
    got = trl_head.fused_log_prob_fields(h, w, b, y, state, math_options, trl_head.FIELDS[1:])
    for name, e, g in zip(trl_head.FIELDS, expected, got, strict=True):
        if e.dtype == torch.bool:
            assert torch.equal(g, e), name
        else:
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    up = torch.randn(2, 37, generator=gen)
    grads = torch.autograd.grad((expected[0] * up[0] + expected[1] * up[1]).sum(), (h, w, b))
    ours = torch.autograd.grad((got[0] * up[0] + got[1] * up[1]).sum(), (h, w, b))
    for name, e, g in zip("hwb", grads, ours, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"grad {n}: {m}")


# A value other than the default for every loss-math and output option a patch takes (the forward
# sets the others per call); a new option fails the test below until it has a value here.
PATCH_OPTION_SAMPLES = {
    "label_smoothing": 0.1,
    "z_loss_scale": 1e-2,
    "use_token_scaling": True,
    "return_token_accuracy": True,
    "return_predicted_tokens": True,
    "return_entropy": True,
}


def _fields_with(seed: int, **options):
    from liger_patch import apply_liger_to

    model = tiny_model(seed=seed)
    apply_liger_to(model, backend="torch", **options)
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(23, 64, generator=gen)
    w = torch.randn(301, 64, generator=gen) * 0.2
    y = torch.randint(0, 301, (23,), generator=gen)
    math_options = trl_head.temperature_options(0.7, 1.3, 5.0)
    return trl_head.fused_log_prob_fields(
        h, w, None, y, model._liger_patch_state, math_options, trl_head.FIELDS[1:]
    )


@pytest.mark.parametrize("name", list(PATCH_OPTION_SAMPLES))
def test_loss_and_output_options_leave_trls_fields_alone(name):
    """TRL builds its loss from the log-probs: a patch's loss-math option (token scaling would
    hand TRL p_y * log p_y) or output option changes none of the five fields."""
    from liger_patch.ops.cross_entropy.options import LOSS_OPTIONS, OUTPUT_OPTIONS
    from liger_patch.patching.forward import FORWARD_SETS

    assert set(PATCH_OPTION_SAMPLES) == set(LOSS_OPTIONS + OUTPUT_OPTIONS) - set(FORWARD_SETS)
    expected = _fields_with(8)
    got = _fields_with(8, **{name: PATCH_OPTION_SAMPLES[name]})
    for field, e, g in zip(trl_head.FIELDS, expected, got, strict=True):
        assert torch.equal(g, e), f"{name} changed TRL's {field}"


def test_token_scaling_patch_gives_trl_log_probs_and_says_so(op_calls):
    """``apply_liger_to(model, use_token_scaling=True, z_loss_scale=...)`` under TRL's fused head:
    the log-probs and entropy equal TRL's own kernel's, and one warning names both options."""
    from liger_patch import apply_liger_to

    model, reference = tiny_model(seed=9), tiny_model(seed=9)
    for m in (model, reference):
        trl.trainer.utils.add_fused_lm_head(m, outputs=("entropy", "is_top1"))
    apply_liger_to(model, backend="torch", use_token_scaling=True, z_loss_scale=1e-2)
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(2))
    with pytest.warns(UserWarning, match="do not apply under TRL") as caught:
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
    messages = [str(w.message) for w in caught if "do not apply under TRL" in str(w.message)]
    assert len(messages) == 1 and "z_loss_scale, use_token_scaling" in messages[0], messages
    expected = reference(input_ids=ids, labels=ids, fused_lm_head=True)
    assert len(op_calls) == 1
    for field in ("log_probs", "entropy"):
        got, want = getattr(out, field), getattr(expected, field)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, f=field: f"{f}: {m}")
    assert torch.equal(out.is_top1, expected.is_top1)
