"""Deferred logits: every op a forward applies to its logits is either reproduced exactly by the
fused loss (checked against an fp64 dense reference, gradients included) or refused by name."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.loss.loss_utils import ForCausalLMLoss

from liger_patch.ops.cross_entropy.options import LossOptions
from liger_patch.patching.capture import HeadCapture
from liger_patch.patching.causal_loss import causal_lm_loss
from liger_patch.patching.deferred import DeferredLogits, replace_deferred
from liger_patch.patching.forward import PatchLoss
from liger_patch.patching.registry import ModelSpec
from liger_patch.patching.seam import CapturedCall, UnfusableLogitsUse
from liger_patch.patching.state import PatchState
from tests.op_helpers import TWO_GPUS

H, V = 24, 37  # sizes that divide no block size


def make_head(bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    head = nn.Linear(H, V, bias=bias)
    with torch.no_grad():
        head.weight.mul_(3.0)
    return head


def make_capture(head: nn.Module, **options) -> tuple[HeadCapture, CapturedCall]:
    state = PatchState(ModelSpec("test", "Test"), LossOptions(**options))
    call = CapturedCall(compute_loss=PatchLoss(state, {}))
    return HeadCapture(head, call), call


def hidden_states(shape=(3, 7), seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, H, generator=g, dtype=torch.float32).requires_grad_()


def labels_for(shape=(3, 7), seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, shape, generator=g)
    labels[0, 0] = labels[1, -1] = labels[-1, shape[1] // 2] = -100  # first, last, middle
    return labels


def dense_reference(head, hidden, ops, loss) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The same ops on real fp64 logits, loss and gradients w.r.t. hidden, weight, bias."""
    h = hidden.detach().double().requires_grad_()
    w = head.weight.detach().double().requires_grad_()
    b = head.bias.detach().double().requires_grad_() if head.bias is not None else None
    value = loss(ops(F.linear(h, w, b)))
    value.backward()
    return value.detach(), [t.grad for t in (h, w, b) if t is not None]


def dense_causal(logits, labels, num_items_in_batch=None, ignore_index=-100, shift_labels=None):
    """transformers' causal-LM loss written out in the logits' own dtype (fp64 here; the
    library's version upcasts to fp32)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    flat, targets = logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1)
    if num_items_in_batch is None:
        return F.cross_entropy(flat, targets, ignore_index=ignore_index)
    return F.cross_entropy(flat, targets, ignore_index=ignore_index, reduction="sum") / num_items_in_batch


def fused_grads(head, hidden) -> list[torch.Tensor]:
    return [t.grad.double() for t in (hidden, head.weight, head.bias) if t is not None]


SOFTCAP_FORMS = {
    "gemma": lambda x: torch.tanh(x / 3.0) * 3.0,
    "recurrent_gemma": lambda x: F.tanh(x / 3.0) * 3.0,
    "method": lambda x: (x / 3.0).tanh() * 3.0,
    "scaled_then_capped": lambda x: torch.tanh((x * 0.5) / 3.0) * 3.0,
    "cohere_scale": lambda x: x * 0.0625,
    "granite_divisor": lambda x: x / 4.0,
    "tensor_scale": lambda x: x * torch.tensor(0.25),
    "left_tensor_scale": lambda x: torch.tensor(0.25) * x,
    "contiguous": lambda x: x.contiguous() / 2.0,
    "none": lambda x: x,
}


@pytest.mark.parametrize("form", SOFTCAP_FORMS, ids=str)
def test_head_math_forms_match_the_dense_fp64_loss(form):
    ops = SOFTCAP_FORMS[form]
    head = make_head()
    capture, call = make_capture(head)
    hidden, labels = hidden_states(), labels_for()
    loss = causal_lm_loss(ops(capture(hidden)), labels, V)
    loss.backward()
    expected, grads = dense_reference(head, hidden, ops, lambda logits: dense_causal(logits, labels))
    assert call.head_calls == 1 and call.losses == 1
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(fused_grads(head, hidden), grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(
    before=st.lists(st.tuples(st.sampled_from(["mul", "div"]), st.floats(0.25, 4.0)), max_size=3),
    cap=st.one_of(st.none(), st.floats(0.5, 30.0)),
    after=st.floats(0.5, 2.0),
)
def test_any_chain_of_scales_and_one_softcap_is_exact(before, cap, after):
    def ops(x):
        for kind, value in before:
            x = x * value if kind == "mul" else x / value
        if cap is not None:
            x = torch.tanh(x / cap) * cap * after
        return x

    head = make_head(bias=False, seed=3)
    capture, _ = make_capture(head)
    hidden, labels = hidden_states(), labels_for()
    loss = causal_lm_loss(ops(capture(hidden)), labels, V)
    expected, _ = dense_reference(head, hidden, ops, lambda logits: dense_causal(logits, labels))
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


def test_cross_entropy_loss_module_on_flattened_logits_is_unshifted_and_exact():
    """bart / whisper / xlnet style: ``CrossEntropyLoss()(logits.view(-1, V), labels.view(-1))``."""
    head = make_head()
    for reduction in ("mean", "sum", "none"):
        capture, _ = make_capture(head)
        hidden, labels = hidden_states(), labels_for()
        loss_fn = nn.CrossEntropyLoss(reduction=reduction)
        loss = loss_fn(capture(hidden).view(-1, V), labels.view(-1))
        dense = F.linear(hidden.double(), head.weight.double(), head.bias.double())
        expected = F.cross_entropy(dense.view(-1, V), labels.view(-1), reduction=reduction)
        torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


def test_causal_loss_arguments_as_transformers_passes_them():
    """num_items_in_batch divides the sum; shift_labels wins over labels; ignore_index is read;
    a batch where every label is ignored gives exactly 0 (not NaN) and zero gradients."""
    head = make_head()
    hidden, labels = hidden_states(), labels_for()
    capture, _ = make_capture(head)
    dense = F.linear(hidden.double(), head.weight.double(), head.bias.double())
    torch.testing.assert_close(
        causal_lm_loss(capture(hidden), labels, V, num_items_in_batch=torch.tensor(5)).double(),
        dense_causal(dense, labels, num_items_in_batch=5),
    )
    shifted = labels.roll(3)
    torch.testing.assert_close(
        causal_lm_loss(capture(hidden), labels, V, shift_labels=shifted).double(),
        dense_causal(dense, labels, shift_labels=shifted),
    )
    sevens = labels.masked_fill(labels == -100, 7)
    torch.testing.assert_close(
        causal_lm_loss(capture(hidden), sevens, V, ignore_index=7).double(),
        dense_causal(dense, sevens, ignore_index=7),
    )
    nothing = torch.full_like(labels, -100)
    loss = causal_lm_loss(capture(hidden), nothing, V, num_items_in_batch=0)
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad is not None and not hidden.grad.any()


def test_token_indexing_and_reshapes_move_to_the_hidden_states():
    """git-style ``logits[:, k:-1, :]`` and ``.contiguous().view(-1, V)`` select tokens only."""
    head = make_head()
    capture, _ = make_capture(head)
    hidden = hidden_states((2, 9))
    deferred = capture(hidden)[:, 2:-1, :].contiguous()
    assert deferred.shape == (2, 6, V) and deferred.size(-1) == V and deferred.dim() == 3
    torch.testing.assert_close(deferred.materialize(), head(hidden)[:, 2:-1, :])
    assert capture(hidden)[1].shape == (9, V)
    torch.testing.assert_close(capture(hidden)[..., :-1, :].materialize(), head(hidden)[..., :-1, :])
    assert capture(hidden).reshape(-1, V).shape == (18, V)
    assert capture(hidden).view(2, -1, V).shape == (2, 9, V) and capture(hidden).view(2, 9, -1).shape == (
        2,
        9,
        V,
    )


REFUSED_USES = [
    (lambda x: x[..., :5], "vocabulary|indexes"),
    (lambda x: x[:, :, :5], "vocabulary"),
    (lambda x: x.transpose(1, 2), "logits.transpose"),
    (lambda x: torch.log_softmax(x, 1), "log_softmax over dimension 1"),
    (lambda x: torch.softmax(x, -1), "softmax"),
    (lambda x: 1.0 - x, "__rsub__"),
    (lambda x: x + torch.ones(3, 1, 1), "not one constant per vocabulary entry"),
    (lambda x: x + torch.ones(1, 3, 7, V), "more dimensions"),
    (lambda x: x.tolist(), "logits.tolist"),
    (lambda x: x * nn.Parameter(torch.tensor(2.0)), "learnable"),
    (lambda x: x / 0.0, "divides the logits by 0.0"),
    (lambda x: x * 0, "finite, non-zero"),
    (lambda x: x * float("nan"), "by nan"),
    (lambda x: x / torch.tensor(float("inf")), "by inf"),
    (lambda x: x * torch.ones(V), "not a scalar"),
    (lambda x: x.view(-1), "last dimension"),
    (lambda x: x.view(3, -1), "last dimension"),
    (lambda x: x.to("meta"), "moves the logits"),
    (lambda x: bool(x[0, 0, 0]), "vocabulary"),
    (lambda x: x.argmax(-1), "logits.argmax"),
    (
        lambda x: F.cross_entropy(x.view(-1, V), torch.zeros(21, dtype=torch.long), weight=torch.ones(V)),
        "weights",
    ),
    (lambda x: F.nll_loss(x.view(-1, V), torch.zeros(21, dtype=torch.long)), "not log-probabilities"),
]
"""Uses of the logits with no fused counterpart, each with what the refusal's reason names."""

LOSS_TIME_REFUSALS = [
    (lambda x: torch.tanh(x * 1e300) * 1e300 * 1e300, "finite, non-zero"),
    (lambda x: torch.tanh(torch.tanh(x)) * 2.0, "twice"),
    (lambda x: torch.tanh(x) * -2.0, "softcap must be > 0"),
    (lambda x: torch.tanh(x / 2.0) * 2.0 + 1.0, "after their tanh softcap"),
    (lambda x: torch.log_softmax(x, -1) * 2.0, "log-probabilities"),
]
"""Chains each of whose ops records, but which together have no fused counterpart: refused
when their loss is asked for."""


def same_outcome(got, want) -> None:
    """``got`` is ``want``: equal tensors (same dtype, device, values), or equal values."""
    if torch.is_tensor(want):
        assert torch.is_tensor(got) and (got.dtype, got.device, got.shape) == (
            want.dtype,
            want.device,
            want.shape,
        )
        if want.device.type != "meta":
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    else:
        assert got == want


@pytest.mark.parametrize(("use", "named"), REFUSED_USES, ids=[n for _, n in REFUSED_USES])
def test_every_other_use_gets_the_real_logits_and_is_refused_by_name(use, named):
    """The use is applied to the real logits, made from the captured hidden states (bit for bit
    what the model's own head gives), and the reason, naming it, is recorded on the call."""
    head = make_head()
    capture, call = make_capture(head)
    hidden = hidden_states()
    same_outcome(use(capture(hidden)), use(head(hidden)))
    assert call.refusal is not None and re.search(named, call.refusal), call.refusal


@pytest.mark.parametrize(
    ("use", "named"), REFUSED_USES + LOSS_TIME_REFUSALS, ids=lambda v: v if isinstance(v, str) else ""
)
def test_a_strict_call_raises_the_refusal_by_name(use, named):
    """A caller that runs the model's own path itself (TRL's GKD) asks for a strict call."""
    capture, call = make_capture(make_head())
    call.strict = True
    with pytest.raises(UnfusableLogitsUse, match=named):
        result = use(capture(hidden_states()))
        if isinstance(result, DeferredLogits):
            causal_lm_loss(result, labels_for(), V)


@pytest.mark.parametrize(("use", "named"), LOSS_TIME_REFUSALS, ids=[n for _, n in LOSS_TIME_REFUSALS])
def test_a_chain_with_no_fused_counterpart_takes_its_loss_from_the_real_logits(use, named):
    head = make_head()
    capture, call = make_capture(head)
    hidden, labels = hidden_states(), labels_for()
    loss = causal_lm_loss(use(capture(hidden)), labels, V)
    expected = ForCausalLMLoss(use(head(hidden)), labels, V)
    torch.testing.assert_close(loss, expected, rtol=0, atol=0, equal_nan=True)
    assert call.losses == 0
    assert call.refusal is not None and re.search(named, call.refusal), call.refusal


def test_once_made_every_deferred_logits_of_that_head_call_is_real():
    """After a refused in-place write, a view taken before it and the loss both see the write, as
    on real logits (Chameleon masks image-token logits so)."""
    head = make_head()
    capture, call = make_capture(head)
    hidden, labels = hidden_states(), labels_for()

    def forward(logits):
        shifted = logits[:, :-1, :]
        logits[:, :, 3] = -1e4
        return shifted, F.cross_entropy(shifted.reshape(-1, V), labels[:, 1:].reshape(-1))

    deferred_view, loss = forward(capture(hidden))
    want_view, want = forward(head(hidden))
    assert torch.equal(loss, want) and torch.equal(deferred_view.materialize(), want_view)
    assert call.losses == 0 and "__setitem__" in call.refusal


@pytest.mark.parametrize("operator", DeferredLogits.REFUSED_OPERATORS)
def test_every_refused_operator_is_refused_by_name(operator):
    capture, call = make_capture(make_head())
    call.strict = True
    with pytest.raises(UnfusableLogitsUse, match=f"it applies {operator} to the logits"):
        getattr(capture(hidden_states()), operator)(1.0)


def test_vocab_size_other_than_the_head_is_refused():
    head = make_head()
    capture, call = make_capture(head)
    hidden, labels = hidden_states(), labels_for()
    with pytest.raises(RuntimeError, match=r"shape '\[-1, 40\]' is invalid"):
        causal_lm_loss(capture(hidden), labels, 40)
    assert "vocab_size=40" in call.refusal
    with pytest.raises(RuntimeError, match=r"shape '\[-1, 40\]' is invalid"):
        ForCausalLMLoss(head(hidden), labels, 40)  # the same error as unpatched


CONSTANT_BIAS_FORMS = {
    "bart": lambda x, b: x + b.view(1, V),
    "left": lambda x, b: b + x,
    "torch_add": lambda x, b: torch.add(x, b),
    "sub": lambda x, b: x - b,
    "number": lambda x, b: x + 0.5,
    "one_value": lambda x, b: x - b[:1],
    "scaled_before": lambda x, b: (x * 0.5 + b) / 0.25,
    "then_softcap": lambda x, b: torch.tanh((x + b) / 3.0) * 3.0,
    "twice": lambda x, b: x + b + b.flip(0),
}


@pytest.mark.parametrize("form", CONSTANT_BIAS_FORMS, ids=str)
@pytest.mark.parametrize("head_bias", [True, False], ids=["head-bias", "no-head-bias"])
def test_a_constant_added_to_the_logits_is_the_losss_bias(form, head_bias):
    """BART's ``lm_logits + final_logits_bias``: the loss's bias, exact against fp64 (the head's
    own bias too, and a learnable constant's gradient)."""
    ops = CONSTANT_BIAS_FORMS[form]
    head = make_head(bias=head_bias)
    constant = torch.randn(V, generator=torch.Generator().manual_seed(4)).requires_grad_()
    capture, call = make_capture(head)
    hidden, labels = hidden_states(), labels_for()
    loss = causal_lm_loss(ops(capture(hidden), constant), labels, V)
    loss.backward()
    assert call.losses == 1 and call.refusal is None
    c64 = constant.detach().double().requires_grad_()
    expected, grads = dense_reference(head, hidden, lambda x: ops(x, c64), lambda x: dense_causal(x, labels))
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(fused_grads(head, hidden), grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    if form != "number":
        torch.testing.assert_close(constant.grad.double(), c64.grad, rtol=1e-4, atol=1e-6)


def test_a_wrong_bias_is_caught():
    """The planted bug: the constant dropped from the loss makes the fp64 comparison fail."""
    head = make_head()
    constant = torch.randn(V, generator=torch.Generator().manual_seed(4))
    capture, _ = make_capture(head)
    hidden, labels = hidden_states(), labels_for()
    deferred = capture(hidden) + constant
    deferred.ops = deferred.ops[:-1]  # the add forgotten
    expected, _ = dense_reference(
        head, hidden, lambda x: x + constant.double(), lambda x: dense_causal(x, labels)
    )
    with pytest.raises(AssertionError):
        torch.testing.assert_close(
            causal_lm_loss(deferred, labels, V).double(), expected, rtol=1e-5, atol=1e-6
        )


def test_log_softmax_then_nll_loss_is_the_cross_entropy():
    """ProphetNet: ``nll_loss(log_softmax(logits.transpose(0, 1).contiguous().view(-1, V)), t)``."""
    head = make_head()
    capture, call = make_capture(head)
    hidden = hidden_states((2, 3, 7))
    targets = torch.randint(0, V, (3, 2, 7), generator=torch.Generator().manual_seed(5))
    targets[0, 0, :2] = -100

    def loss_of(logits):
        assert logits.is_contiguous()
        flat = logits.transpose(0, 1).contiguous()
        lprobs = F.log_softmax(flat.view(-1, flat.size(-1)), dim=-1, dtype=torch.float32)
        return F.nll_loss(lprobs, targets.view(-1), reduction="mean")

    loss = loss_of(capture(hidden))
    loss.backward()
    expected, grads = dense_reference(head, hidden, lambda x: x, loss_of)
    assert call.losses == 1 and call.refusal is None
    torch.testing.assert_close(loss.double(), expected.double(), rtol=1e-5, atol=1e-6)
    for got, want in zip(fused_grads(head, hidden), grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_casts_are_recorded_and_replayed():
    head = make_head()
    capture, _ = make_capture(head)
    hidden = hidden_states().bfloat16()
    deferred = capture(hidden)
    assert deferred.dtype == torch.bfloat16 and deferred.float().dtype == torch.float32
    assert deferred.to(torch.float32).dtype == torch.float32
    assert deferred.to(hidden).dtype == torch.bfloat16 and deferred.to("cpu").dtype == torch.bfloat16
    head16 = make_head().bfloat16()
    capture16, _ = make_capture(head16)
    assert torch.equal(capture16(hidden).float().materialize(), head16(hidden).float())


@TWO_GPUS
def test_a_move_to_cuda_without_an_index_goes_to_the_current_device():
    """``.to("cuda")`` is the current device, as for a tensor: logits on cuda:1 with cuda:0 current
    are moved (made real, then moved), not kept where they are; ``.to("cuda")`` with cuda:1
    current keeps them deferred."""
    head = make_head().to("cuda:1")
    capture, _ = make_capture(head)
    hidden = hidden_states().to("cuda:1")
    with torch.cuda.device(1):
        assert isinstance(capture(hidden).to("cuda"), DeferredLogits)
    with torch.cuda.device(0):
        moved = capture(hidden).to("cuda")
        assert moved.device == torch.device("cuda", 0) and not isinstance(moved, DeferredLogits)
        torch.testing.assert_close(moved, head(hidden).to("cuda:0"))


def test_replay_matches_the_original_op_order_bit_for_bit():
    head = make_head()
    capture, _ = make_capture(head)
    hidden = hidden_states()
    ops = SOFTCAP_FORMS["gemma"]
    assert torch.equal(ops(capture(hidden)).materialize(), ops(head(hidden)))
    output = (torch.tensor(1.0), ops(capture(hidden)), None)
    assert replace_deferred(output, materialize=False)[1] is None
    assert torch.equal(replace_deferred(output, materialize=True)[1], ops(head(hidden)))


def test_z_loss_is_returned_to_the_call_record():
    head = make_head()
    capture, call = make_capture(head, z_loss_scale=1e-2)
    hidden, labels = hidden_states(), labels_for()
    loss = causal_lm_loss(capture(hidden), labels, V)
    dense = F.linear(hidden.double(), head.weight.double(), head.bias.double())
    targets = F.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1)
    kept = dense.reshape(-1, V)[targets != -100]
    z = 1e-2 * (torch.logsumexp(kept, -1) ** 2).mean()
    torch.testing.assert_close(call.z_losses[0].double(), z, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(loss.double(), F.cross_entropy(kept, targets[targets != -100]) + z)


class NamedHead(nn.Linear):
    """A head subclass with a field and a property of its own (remote code's heads)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tag = "vocab-head"

    @property
    def vocab(self) -> int:
        return self.out_features


def test_the_capture_answers_every_attribute_as_the_head_does():
    head = NamedHead(H, V)
    capture, _ = make_capture(head)
    assert (capture.in_features, capture.out_features) == (H, V)
    assert (capture.tag, capture.vocab) == ("vocab-head", V)
    assert capture.weight is head.weight and capture.bias is head.bias
    assert isinstance(capture, nn.Linear) and isinstance(capture, NamedHead)
    assert [(n, p) for n, p in capture.named_parameters()] == list(head.named_parameters())
    assert next(capture.parameters()).dtype == head.weight.dtype
    assert capture.training == head.training
    assert capture.extra_repr().startswith("capturing NamedHead")
    assert not hasattr(capture, "no_such_field")
    with pytest.raises(AttributeError, match="'NamedHead' object has no attribute 'no_such_field'"):
        capture.no_such_field  # noqa: B018 (the same error as the head's)
    assert isinstance(capture(hidden_states()), DeferredLogits)


def test_the_capture_wears_the_registered_modules_face():
    """Where the fused head is another module than the registered one (PEFT's modules_to_save
    copy), the capture reads the fused head's weight but answers as the registered module."""
    registered = nn.Sequential(make_head())
    active = make_head(seed=3)
    call = CapturedCall(compute_loss=None)
    capture = HeadCapture(active, call, registered)
    assert isinstance(capture, nn.Sequential) and capture.weight is active.weight
    assert [n for n, _ in capture.named_parameters()] == ["0.weight", "0.bias"]
    assert capture.get_submodule("0") is registered[0]
    assert capture(hidden_states()).head is active


def test_iterating_the_logits_yields_deferred_rows():
    """``iter`` and ``len`` are over the first token dimension, as on a tensor; nothing is made
    (transformers' ModelOutput tries ``iter`` on a first field that is not a tensor)."""
    head = make_head()
    capture, call = make_capture(head)
    hidden = hidden_states()
    rows = list(capture(hidden))
    assert len(capture(hidden)) == 3 and len(rows) == 3 and all(isinstance(r, DeferredLogits) for r in rows)
    assert torch.equal(rows[1].materialize(), head(hidden)[1]) and call.refusal is None
