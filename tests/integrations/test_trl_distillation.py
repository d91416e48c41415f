"""TRL's distillation trainers through ``fused_linear_distillation``: ``DistillationTrainer`` and
``GKDTrainer``, unmodified, with ``LigerPatchCallback``.

Each trainer test trains the same tiny student towards the same tiny teacher (another hidden
size) from the same seed twice, as TRL runs it and with the callback, and checks that the op ran
once per micro-batch (its registered operator's calls counted), that TRL's own divergence did not
(GKD: neither model's ``lm_head`` was ever called, so no ``tokens x V`` logits were built;
``DistillationTrainer``: TRL's chunked kernel never ran), that the logged losses, gradient norms
and metrics and the trained weights agree, and that nothing was warned. The heads are scaled so
that the logits spread as a trained model's do: with a random init's near-uniform softmaxes every
divergence and its gradient would be close to 0 whatever was computed.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")
distillation_trainer = pytest.importorskip("trl.trainer.distillation_trainer")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # trl.experimental announces itself
    gkd = pytest.importorskip("trl.experimental.gkd")

from transformers import AutoModelForCausalLM, Gemma2Config, GraniteConfig  # noqa: E402

from liger_patch import LigerPatchCallback, apply_liger_to  # noqa: E402
from liger_patch.integrations import trl_distillation, trl_gkd  # noqa: E402
from liger_patch.ops.core.tuning import Tuning  # noqa: E402
from liger_patch.ops.distillation import operator as distill_operator  # noqa: E402
from liger_patch.ops.distillation.options import DistillOptions  # noqa: E402
from liger_patch.patching.state import LigerBypassWarning  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from tiny_trl import arithmetic_chats, arithmetic_prompts, tiny_model, tiny_tokenizer  # noqa: E402

# fp32 runs differ by rounding only: ~1e-7 after 2 steps. grad_norm is compared too, since TRL
# clips at norm 1 and would hide a gradient wrong by a factor; plain SGD, as Adam would turn a
# rounding-level difference in a near-zero gradient into a whole step.
FP32 = dict(rtol=5e-5, atol=5e-6)
# TRL's default bf16 autocast: TRL's GKD takes the softmax of bf16 logits, the op works in fp32
# after its GEMMs; the runs part by ~1e-3 relative (grad_norm 0.14 % after 3 steps).
BF16 = dict(rtol=1e-2, atol=1e-3)
CALLBACK = dict(backend="torch")  # (auto: Triton, interpreted on the CPU in the tests)
BETAS = pytest.mark.parametrize("beta", [0.0, 0.5, 1.0], ids=["forward-kl", "jsd", "reverse-kl"])


@pytest.fixture(autouse=True)
def hooks_installed():
    """Both hooks in place before any run, so the unpatched runs show they leave TRL alone."""
    assert trl_distillation.install() and trl_gkd.install()


@pytest.fixture
def op_calls(monkeypatch):
    """Calls of the distillation operator (``operator.FUSED_DISTILL``: the registered operator or
    its eager twin, where every call meets)."""
    calls = []
    operator = distill_operator.FUSED_DISTILL

    def counted(*args):
        calls.append(args[0].shape[0])
        return operator(*args)

    monkeypatch.setattr(distill_operator, "FUSED_DISTILL", counted)
    return calls


def _record_op_option(monkeypatch, name: str) -> list:
    """The option ``name`` of each call of the distillation operator (its options
    travel as one key, the only string argument)."""
    seen = []
    operator = distill_operator.FUSED_DISTILL

    def recorded(*args):
        options = DistillOptions.from_key(next(a for a in args if isinstance(a, str)))
        seen.append(getattr(options, name))
        return operator(*args)

    monkeypatch.setattr(distill_operator, "FUSED_DISTILL", recorded)
    return seen


@pytest.fixture
def op_logits_dtypes(monkeypatch):
    """The ``logits_dtype`` of each call of the distillation operator."""
    return _record_op_option(monkeypatch, "logits_dtype")


@pytest.fixture
def trl_kernel_calls(monkeypatch):
    """Calls of TRL's own chunked divergence kernel (``DistillationTrainer``'s path)."""
    calls = []
    # TRL 1.16 imports it into the trainer's module; 1.15 imports it from its kernels module at
    # each call: count it where this version looks it up.
    home = distillation_trainer
    if not hasattr(home, "ChunkedDivergenceFunction"):
        home = importlib.import_module("trl.kernels.chunked_divergence")
    kernel = home.ChunkedDivergenceFunction

    class Counted:
        @staticmethod
        def apply(*args):
            calls.append(args[0].shape[0])
            return kernel.apply(*args)

    monkeypatch.setattr(home, "ChunkedDivergenceFunction", Counted)
    return calls


def sharpened(model, factor=10.0):
    """``model`` with its head scaled so that its logits spread (std ~2 instead of ~0.2)."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(factor)
    return model


def _pair(student=None, teacher=None):
    return (
        sharpened(student if student is not None else tiny_model(seed=1)),
        sharpened(teacher if teacher is not None else tiny_model(seed=2, hidden_size=96)),
    )


def _common(tmp_path, **overrides):
    return (
        dict(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            max_steps=2,
            logging_steps=1,
            optim="sgd",
            learning_rate=0.05,
            save_strategy="no",
            report_to=[],
            seed=0,
            data_seed=0,
            use_cpu=True,
            bf16=False,
        )
        | overrides
    )


def _gkd(tmp_path, models=_pair, trainer_class=None, compute_metrics=None, **config):
    def make(callbacks):
        student, teacher = models()
        return (trainer_class or gkd.GKDTrainer)(
            model=student,
            teacher_model=teacher,
            args=gkd.GKDConfig(**_common(tmp_path, **({"lmbda": 0.0} | config))),
            train_dataset=arithmetic_chats(32),
            eval_dataset=arithmetic_chats(4),
            processing_class=tiny_tokenizer(),
            compute_metrics=compute_metrics,
            callbacks=callbacks,
        )

    return make


def _distillation(tmp_path, **config):
    def make(callbacks):
        student, teacher = _pair()
        return trl.DistillationTrainer(
            model=student,
            teacher_model=teacher,
            args=trl.DistillationConfig(**_common(tmp_path, max_completion_length=8, **config)),
            train_dataset=arithmetic_prompts(32),
            processing_class=tiny_tokenizer(),
            callbacks=callbacks,
        )

    return make


def _train(make_trainer, patched: bool, action="train"):
    """Log history, trained parameters and the number of ``lm_head`` calls (student, teacher)
    that built logits for more than one position of a sequence (generation asks for the last
    one only) in one run; our bypass warnings are errors."""
    callbacks = [LigerPatchCallback(**CALLBACK)] if patched else []
    with warnings.catch_warnings():
        warnings.simplefilter("error", LigerBypassWarning)
        trainer = make_trainer(callbacks)
        head_calls = [0, 0]

        def count(i, hidden):
            head_calls[i] += hidden.shape[-2] > 1

        for i, model in enumerate((trainer.model, trainer.teacher_model)):
            model.get_output_embeddings().register_forward_hook(lambda m, args, out, i=i: count(i, args[0]))
        getattr(trainer, action)()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return trainer.state.log_history, params, head_calls


def _assert_same_run(reference, ours, keys=("loss", "grad_norm"), tol=FP32):
    (ref_log, ref_params, _), (log, params, _) = reference, ours
    ref_steps, steps = [e for e in ref_log if "loss" in e], [e for e in log if "loss" in e]
    assert len(steps) == len(ref_steps) > 0
    for ref_entry, entry in zip(ref_steps, steps, strict=True):
        for key in keys:
            assert key in entry, f"{key} not logged: {sorted(entry)}"
            got, expected = torch.tensor(entry[key]), torch.tensor(ref_entry[key])
            torch.testing.assert_close(got, expected, **tol, msg=lambda m, k=key: f"{k}: {m}")
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], **tol, msg=lambda m, n=name: f"param {n}: {m}")


# ---------------------------------------------------------------- GKDTrainer


@BETAS
def test_gkd_trains_through_the_op(tmp_path, op_calls, op_logits_dtypes, beta):
    """Offline GKD (``lmbda=0``), two micro-batches a step (``num_items_in_batch``). The config's
    temperature 2 is GKD's sampling temperature: its loss is at ``generalized_jsd_loss``'s default.
    GKD's own path takes the model's logits in its dtype, so the op keeps the input dtype."""
    make = _gkd(tmp_path, beta=beta, temperature=2.0, gradient_accumulation_steps=2)
    reference = _train(make, patched=False)
    assert not op_calls and min(reference[2]) > 0  # TRL's own path: both heads built logits
    ours = _train(make, patched=True)
    assert len(op_calls) == 4 and ours[2] == [0, 0]  # neither head was called
    assert op_logits_dtypes == [None] * 4
    _assert_same_run(reference, ours)


def _head_math_pair():
    """A Granite student (its logits divided by ``logits_scaling``) and a Gemma 2 teacher (a
    final softcap), both read off their forwards by the capture."""
    sizes = dict(
        vocab_size=1000, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(3)
    student = AutoModelForCausalLM.from_config(GraniteConfig(hidden_size=64, logits_scaling=0.5, **sizes))
    teacher = AutoModelForCausalLM.from_config(
        Gemma2Config(hidden_size=96, head_dim=24, final_logit_softcapping=3.0, **sizes)
    )
    return _pair(student, teacher)


@pytest.mark.parametrize(
    "config",
    [
        dict(lmbda=1.0, max_new_tokens=6),
        dict(seq_kd=True, max_new_tokens=6),
        dict(models=_head_math_pair),
        dict(bf16=True),
    ],
    ids=["on-policy", "sequence-kd", "scale-and-softcap", "bf16-autocast"],
)
def test_gkd_generation_head_math_and_autocast(tmp_path, op_calls, config):
    """The batches the student (``lmbda``) or the teacher (``seq_kd``) generates, heads that
    scale or softcap their logits, and TRL's default bf16 autocast go through the op too."""
    make = _gkd(tmp_path, beta=0.5, temperature=2.0, **config)
    reference = _train(make, patched=False)
    ours = _train(make, patched=True)
    assert len(op_calls) == 2 and ours[2] == [0, 0]
    _assert_same_run(reference, ours, tol=BF16 if config.get("bf16") else FP32)


class _OwnJSD(gkd.GKDTrainer):
    @staticmethod
    def generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5, **kwargs):
        """TRL's, at temperature 3: the fused path cannot know what an override computes."""
        return gkd.GKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, labels, beta, 3.0)


def _custom_teacher_head():
    class Head(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) + 0.0

    student, teacher = _pair()
    old = teacher.lm_head
    teacher.lm_head = Head(old.in_features, old.out_features, bias=False)
    teacher.lm_head.weight = old.weight
    return student, teacher


def _logits_hook_teacher():
    def centre(module, args, out):
        out.logits.sub_(out.logits.mean())

    student, teacher = _pair()
    teacher.register_forward_hook(centre)
    return student, teacher


@pytest.mark.parametrize(
    "setup, reason, tries",
    [
        (dict(trainer_class=_OwnJSD), "_OwnJSD overrides generalized_jsd_loss", 0),
        (dict(models=_custom_teacher_head), "teacher's head cannot be fused: its lm_head is a Head", 0),
        (dict(models=_logits_hook_teacher), "it uses logits.sub_", 1),
    ],
    ids=["own-jsd", "custom-head", "logits-used"],
)
def test_gkd_runs_trls_loss_where_it_cannot_fuse_and_says_why(tmp_path, op_calls, setup, reason, tries):
    """TRL's loss, TRL's numbers, the reason said; a forward that refused is not tried again
    (``tries``: the student's forwards beyond TRL's one a step)."""
    make = _gkd(tmp_path, beta=0.5, **setup)
    reference = _train(make, patched=False)
    with pytest.warns(LigerBypassWarning, match=reason):
        trainer = make([LigerPatchCallback(**CALLBACK)])
        forwards = []
        trainer.model.register_forward_pre_hook(lambda *_: forwards.append(1))
        trainer.train()
    assert not op_calls and len(forwards) == trainer.state.global_step + tries
    _assert_same_run(reference, (trainer.state.log_history, dict(trainer.model.named_parameters()), None))


def test_gkd_evaluation_through_the_op(tmp_path, op_calls):
    """Evaluation asks for the loss alone (SFT's ``prediction_step``): the op computes it."""
    make = _gkd(tmp_path, beta=0.5)
    reference = _train(make, patched=False, action="evaluate")
    ours = _train(make, patched=True, action="evaluate")
    assert len(op_calls) == 1 and ours[2] == [0, 0]
    torch.testing.assert_close(ours[0][-1]["eval_loss"], reference[0][-1]["eval_loss"], **FP32)


def test_gkd_evaluation_for_metrics_runs_trls_loss_and_says_why(tmp_path, op_calls):
    """With ``compute_metrics`` the evaluation asks for the student's logits as well."""
    make = _gkd(tmp_path, beta=0.5, compute_metrics=lambda prediction: {"seen": 1.0})
    reference = _train(make, patched=False, action="evaluate")
    with pytest.warns(LigerBypassWarning, match="asked for the student's outputs"):
        ours = make([LigerPatchCallback(**CALLBACK)])
        ours.evaluate()
    assert not op_calls and ours.state.log_history[-1]["eval_seen"] == 1.0
    torch.testing.assert_close(ours.state.log_history[-1]["eval_loss"], reference[0][-1]["eval_loss"])


# ---------------------------------------------------------------- DistillationTrainer


@BETAS
def test_distillation_trainer_trains_through_the_op(
    tmp_path, op_calls, op_logits_dtypes, trl_kernel_calls, beta
):
    """On-policy distillation at temperature 2 (divergence and sampling), TRL's ``entropy`` metric
    included. The op keeps fp32 logits, as TRL's kernel keeps its tiles (on a GPU, bf16 logits
    would make the gradients ten times less exact than the unpatched trainer's)."""
    make = _distillation(tmp_path, beta=beta, temperature=2.0)
    reference = _train(make, patched=False)
    assert not op_calls and len(trl_kernel_calls) == 2
    ours = _train(make, patched=True)
    assert len(op_calls) == 2 and len(trl_kernel_calls) == 2  # TRL's kernel: the reference's only
    assert op_logits_dtypes == [torch.float32] * 2
    _assert_same_run(reference, ours, keys=("loss", "grad_norm", "entropy"))


class _Caller(distillation_trainer.DistillationTrainer):
    """A ``DistillationTrainer`` only as far as the hook looks: a ``model`` and a method calling
    the module's divergence function, as ``_compute_loss`` does."""

    def __init__(self, model):
        self.model = model

    def divergence(self, *args, **kwargs):
        return distillation_trainer._chunked_divergence_loss(*args, **kwargs)


def _divergence_inputs(bias: bool, scales: tuple, softcaps: tuple):
    g = torch.Generator().manual_seed(0)
    sh, th = torch.randn(3, 9, 16, generator=g), torch.randn(3, 9, 24, generator=g)
    sw, tw = torch.randn(300, 16, generator=g), torch.randn(300, 24, generator=g)
    mask = (torch.rand(3, 9, generator=g) > 0.3).long()
    sb, tb = (torch.randn(300, generator=g), torch.randn(300, generator=g)) if bias else (None, None)
    return dict(
        student_hidden_states=sh.requires_grad_(), teacher_hidden_states=th,
        student_lm_head_weight=sw.requires_grad_(), teacher_lm_head_weight=tw, completion_mask=mask,
        student_lm_head_bias=sb if sb is None else sb.requires_grad_(), teacher_lm_head_bias=tb,
        student_logit_scale=scales[0], teacher_logit_scale=scales[1],
        student_final_logit_softcapping=softcaps[0], teacher_final_logit_softcapping=softcaps[1],
        temperature=1.5,
    )  # fmt: skip


def _divergence_and_grads(fn, inputs, **kwargs):
    loss, entropy_sum, n_valid = fn(**inputs, **kwargs)
    wanted = [t for t in inputs.values() if torch.is_tensor(t) and t.requires_grad]
    return (loss, entropy_sum, n_valid, *torch.autograd.grad(loss, wanted))


@BETAS
@pytest.mark.parametrize(
    "bias, scales, softcaps, num_items",
    [(False, (1.0, 1.0), (None, None), None), (True, (0.7, 2.0), (4.0, None), torch.tensor(40.0))],
    ids=["plain", "bias-scale-softcap-num-items"],
)
def test_divergence_equals_trls_function(op_calls, beta, bias, scales, softcaps, num_items):
    """TRL's ``(loss, entropy_sum, n_valid)`` and the student's gradients, for every head math."""
    caller = _Caller(apply_liger_to(tiny_model(seed=4), **CALLBACK))
    inputs = _divergence_inputs(bias, scales, softcaps)
    trls = distillation_trainer._chunked_divergence_loss.original
    expected = _divergence_and_grads(trls, inputs, beta=beta, num_items_in_batch=num_items)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _divergence_and_grads(caller.divergence, inputs, beta=beta, num_items_in_batch=num_items)
    assert len(op_calls) == 1 and len(got) == len(expected) == 5 + bias
    names = ("loss", "entropy", "n_valid", "grad_h", "grad_w", "grad_b")[: len(got)]
    for name, g, e in zip(names, got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=2e-5, atol=2e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(teacher_logit_scale=0.0), "teacher's logit scale is 0"),
        (dict(partitioned="student_lm_head_weight"), "student's lm_head tensors are sharded"),
    ],
    ids=["zero-scale", "zero3-head"],
)
def test_divergence_falls_back_to_trls_with_the_reason(op_calls, monkeypatch, change, reason):
    """What the op cannot take runs TRL's function (here a stand-in: TRL's would gather a real
    ZeRO-3 head), saying why."""
    model = apply_liger_to(tiny_model(seed=4), **CALLBACK)
    inputs = _divergence_inputs(False, (1.0, 1.0), (None, None))
    change = dict(change)
    name = change.pop("partitioned", None)
    if name is not None:
        inputs[name].ds_id, inputs[name].ds_status = 0, "AVAILABLE"
    inputs |= change
    stand_in = lambda *args, **kwargs: "trl"  # noqa: E731
    monkeypatch.setattr(distillation_trainer._chunked_divergence_loss, "original", stand_in)
    with pytest.warns(LigerBypassWarning, match=reason):
        assert _Caller(model).divergence(**inputs, beta=0.5) == "trl"
    assert not op_calls


def test_the_patch_tuning_reaches_the_op(monkeypatch):
    """The patch's ``Tuning`` (how the op runs) is what both hooks pass (``distill_runtime``),
    not the default one."""
    tuning = Tuning(head_start_gflop=0.0, row_block=1024)
    seen = _record_op_option(monkeypatch, "tuning")
    model = apply_liger_to(tiny_model(seed=4), tuning=tuning, **CALLBACK)
    assert trl_distillation.distill_runtime(model._liger_patch_state)["tuning"] == tuning
    _Caller(model).divergence(**_divergence_inputs(False, (1.0, 1.0), (None, None)), beta=0.5)
    assert seen == [tuning]


def test_loss_options_of_the_patch_are_said_not_to_apply(op_calls):
    caller = _Caller(apply_liger_to(tiny_model(seed=4), z_loss_scale=1e-4, **CALLBACK))
    with pytest.warns(UserWarning, match="z_loss_scale do not apply"):
        caller.divergence(**_divergence_inputs(False, (1.0, 1.0), (None, None)), beta=0.5)
    assert len(op_calls) == 1


# ---------------------------------------------------------------- the hooks


def test_a_patch_installs_both_hooks_on_imported_trl(monkeypatch):
    """TRL imported first (as here): ``apply_liger_to`` installs both hooks at once."""
    original = distillation_trainer._chunked_divergence_loss.original
    monkeypatch.setattr(distillation_trainer, "_chunked_divergence_loss", original)
    monkeypatch.setattr(gkd.GKDTrainer, "compute_loss", gkd.GKDTrainer.compute_loss.__liger_original__)
    assert not trl_distillation.installed() and not trl_gkd.installed()
    apply_liger_to(tiny_model(seed=5))
    assert trl_distillation.installed() and trl_gkd.installed()


_LATER_PROBE = """
import liger_patch as lp
from liger_patch.integrations import trl_distillation, trl_gkd
lp.apply_liger_to("llama")
assert not trl_distillation.installed() and not trl_gkd.installed()
from trl import DistillationTrainer
from trl.experimental.gkd import GKDTrainer
print(trl_distillation.installed(), trl_gkd.installed())
"""


def test_trl_imported_after_the_patch_gets_both_hooks():
    """In a fresh interpreter: the import hook installs each when its TRL module loads."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", _LATER_PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "True True"
