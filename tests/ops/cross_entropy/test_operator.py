"""The op as registered PyTorch operators (liger_patch/ops/cross_entropy/operator.py).

* ``torch.library.opcheck`` of ``liger_patch::flce``, ``liger_patch::flce_backward`` and
  ``liger_patch::scale_grads_``: schema (declared mutations), fake implementation against the real
  one, autograd registration, and AOT dispatch with dynamic shapes (which compares the traced
  forward and backward with eager).
* ``torch.compile(fullgraph=True, dynamic=True)`` of training steps through the public entry
  points: one graph holding one ``flce`` node, no recompile as the token count changes, and
  eager's loss, outputs and gradients.
* ``torch._dynamo.explain``: no graph break in the functional, the Module or the log-probs.

CPU runs use aot_eager (the Triton backend runs under the interpreter); on CUDA inductor runs too.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from op_helpers import BACKENDS, TOL, assert_close
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import liger_patch as lp
from liger_patch.ops.core.forward_grads import grads_in_forward
from liger_patch.ops.cross_entropy.options import LossOptions

HAS_CUDA = torch.cuda.is_available()
COMPILERS = ["aot_eager"] + (["inductor"] if HAS_CUDA else [])
OPS = torch.ops.liger_patch
H, V, D = 16, 37, 9  # hidden size, vocabulary, width of the layer before the op
ALL_OUTPUTS = dict(
    return_z_loss=True, return_token_accuracy=True, return_predicted_tokens=True, return_entropy=True
)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _same(compiler: str) -> float:
    """Tolerance of compiled vs eager: aot_eager runs the same kernels; inductor fuses the layer."""
    return 1e-6 if compiler == "aot_eager" else TOL[torch.float32]


# --------------------------------------------------------------------------------------------
# opcheck


def _flce_args(
    gen,
    device,
    *,
    options,
    bias=False,
    class_weight=False,
    num_items=None,
    needs=(True, True, True),
    ignore=0.3,
    dtype=torch.float32,
    n=10,
):
    """The positional arguments of ``liger_patch::flce`` (inputs that need a gradient require one)."""
    hidden = torch.randn(n, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.5
    b = torch.randn(V, generator=gen) * 0.1 if bias else None
    labels = torch.randint(0, V, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < ignore] = -100
    cw = torch.rand(V, generator=gen) + 0.5 if class_weight else None
    tensors = [
        None if t is None else t.to(device=device, dtype=dtype).requires_grad_(need)
        for t, need in zip((hidden, weight, b), needs, strict=True)
    ]
    num_items_tensor = torch.tensor(7, device=device) if num_items == "tensor" else None
    num_items_value = 7.0 if num_items == "value" else None
    return (
        *tensors,
        labels.to(device),
        None if cw is None else cw.to(device),
        num_items_tensor,
        num_items_value,
        LossOptions(**options).key,
        [need and t is not None for t, need in zip(tensors, needs, strict=True)],
    )


OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")

OPCHECK_CASES = {
    "mean": dict(options=dict(), bias=True),
    "sum_zloss_smoothing": dict(
        options=dict(reduction="sum", z_loss_scale=1e-2, return_z_loss=True, label_smoothing=0.1),
        needs=(True, False, False),
    ),
    "none_all_outputs_softcap": dict(options=dict(reduction="none", softcap=5.0, **ALL_OUTPUTS), bias=True),
    "mean_entropy_weight_only": dict(
        options=dict(return_entropy=True, logit_scale=0.5), needs=(False, True, False)
    ),
    "mean_class_weight": dict(options=dict(label_smoothing=0.1), class_weight=True, bias=True),
    "none_class_weight_token_scaling": dict(
        options=dict(reduction="none", use_token_scaling=True, z_loss_scale=1e-2), class_weight=True
    ),
    "mean_token_scaling_accuracy": dict(options=dict(use_token_scaling=True, return_token_accuracy=True)),
    "mean_num_items_tensor": dict(options=dict(z_loss_scale=1e-2), num_items="tensor"),
    "mean_num_items_value": dict(options=dict(), num_items="value", bias=True),
    "mean_all_ignored": dict(options=dict(**ALL_OUTPUTS), ignore=1.0, bias=True),
    "no_grads": dict(options=dict(return_entropy=True), needs=(False, False, False)),
    "fp16_mean": dict(options=dict(z_loss_scale=1e-2), dtype=torch.float16),  # no gradients in the forward
}


@pytest.mark.parametrize("case", OPCHECK_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_flce(gen, device, chunk_rows, backend, case):
    spec = dict(OPCHECK_CASES[case])
    options = {**spec.pop("options"), **chunk_rows(4, V), "backend": backend}  # 3 chunks of 10 rows
    args = _flce_args(gen, device, options=options, **spec)
    hidden, needs = args[0], args[-1]
    utils = OPCHECK_UTILS
    if grads_in_forward(LossOptions.from_key(args[7]).reduction, hidden.dtype, needs):
        # The forward returns the gradients it computed at scale 1 as (non-differentiable) outputs,
        # and the backward scales those same tensors in place (scale_grads_). test_aot_dispatch_dynamic
        # returns *every* output of the op from the traced function, so these internal outputs become
        # user-visible outputs that the backward mutates, which AOTAutograd's partitioner refuses
        # ("Node ... was invalid, but is output"). The entry points never return them: the same AOT
        # check over the outputs they do return runs in test_aot_dispatch_dynamic_public_outputs.
        utils = tuple(u for u in OPCHECK_UTILS if u != "test_aot_dispatch_dynamic")
    torch.library.opcheck(OPS.flce, args, test_utils=utils)


@pytest.mark.parametrize("case", OPCHECK_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_aot_dispatch_dynamic_public_outputs(gen, device, chunk_rows, backend, case):
    """opcheck's AOT test for what the entry points take from the op (loss, z_loss, argmax,
    entropy): traced with dynamic shapes, forward and backward (the precomputed and scaled
    gradients included) equal eager."""
    from functorch.compile import aot_function, nop

    spec = dict(OPCHECK_CASES[case])
    options = {**spec.pop("options"), **chunk_rows(4, V), "backend": backend}
    hidden, weight, bias, labels, class_weight, num_items, num_items_value, key, needs = _flce_args(
        gen, device, options=options, **spec
    )
    leaves = [t for t in (hidden, weight, bias) if t is not None and t.requires_grad]
    tensors = (hidden, weight, bias, labels, class_weight, num_items)

    def public(hidden, weight, bias, labels, class_weight, num_items):
        outs = OPS.flce(hidden, weight, bias, labels, class_weight, num_items, num_items_value, key, needs)
        return outs[:4]

    results = []
    for fn in (public, aot_function(public, nop, dynamic=True)):
        outs = fn(*tensors)
        objective = sum(o.float().sum() * (k + 1) for k, o in enumerate(outs) if o.requires_grad)
        grads = torch.autograd.grad(objective, leaves) if leaves and torch.is_tensor(objective) else ()
        results.append(([o.detach() for o in outs], grads))
    (eager_outs, eager_grads), (aot_outs, aot_grads) = results
    for k, (a, e) in enumerate(zip(aot_outs, eager_outs, strict=True)):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6, msg=lambda m, k=k: f"output {k}: {m}")
    for k, (a, e) in enumerate(zip(aot_grads, eager_grads, strict=True)):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6, msg=lambda m, k=k: f"grad {k}: {m}")


@pytest.mark.parametrize("with_entropy", [False, True], ids=["ce_z", "ce_z_entropy"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_flce_backward(gen, device, backend, with_entropy):
    options = dict(reduction="none", z_loss_scale=1e-2, return_entropy=True, backend=backend)
    hidden, weight, bias, labels, cw, *_, key, needs = _flce_args(
        gen, device, options=options, bias=True, class_weight=with_entropy, needs=(False, False, False)
    )
    outs = OPS.flce(hidden, weight, bias, labels, cw, None, None, key, [True, True, True])
    entropy, lse = outs[3], outs[4]
    n = labels.shape[0]
    coef_ce = torch.randn(n, generator=gen).to(device)
    coef_z = torch.randn(n, generator=gen).to(device)
    entropy_coef = torch.randn(n, generator=gen).to(device) if with_entropy else None
    for needs in ([True, True, True], [True, False, True], [False, True, False]):
        args = (
            hidden,
            weight,
            bias,
            labels,
            cw,
            lse,
            coef_ce,
            coef_z,
            entropy_coef,
            entropy if with_entropy else None,
            key,
            needs,
        )
        torch.library.opcheck(OPS.flce_backward, args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_scale_grads(gen, device, backend):
    grads = [torch.randn(5, H, generator=gen).to(device), torch.randn(V, H, generator=gen).to(device)]
    # All four sub-tests apply to this mutating op too: test_schema checks that only `grads` is
    # written, and the AOT test functionalises the in-place write.
    torch.library.opcheck(OPS.scale_grads_, (grads, torch.tensor(0.37, device=device), backend))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [0.37, 1.0, 0.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_grads_multiplies_in_place(gen, device, backend, scale, dtype):
    grads = [
        torch.randn(5, H, generator=gen).to(device, dtype),
        torch.randn(V, generator=gen).to(device, dtype),
    ]
    expected = [(g.float() * scale).to(dtype) for g in grads]  # the fp32 product, rounded once
    pointers = [g.data_ptr() for g in grads]
    assert OPS.scale_grads_(grads, torch.tensor(scale, device=device), backend) is None
    assert [g.data_ptr() for g in grads] == pointers
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    OPS.scale_grads_([], torch.tensor(scale, device=device), backend)  # nothing to scale


# --------------------------------------------------------------------------------------------
# fullgraph, dynamic compile of training steps


def _flce_node_count(graph_module: torch.fx.GraphModule) -> int:
    return sum(node.target in (OPS.flce, OPS.flce.default) for node in graph_module.graph.nodes)


def _assert_one_graph(counter: CompileCounterWithBackend) -> None:
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times (a recompile or a graph break)"
    assert counters["stats"]["unique_graphs"] == 1
    assert _flce_node_count(counter.graphs[0]) == 1, "the op is not one node of the graph"


class _Params:
    """A layer before the op (so the hidden states have a gradient path) and the head."""

    def __init__(self, gen, device, bias=True):
        self.proj = (torch.randn(D, H, generator=gen) * 0.4).to(device).requires_grad_()
        self.weight = (torch.randn(V, H, generator=gen) * 0.5).to(device).requires_grad_()
        self.bias = (torch.randn(V, generator=gen) * 0.1).to(device).requires_grad_() if bias else None

    def leaves(self) -> dict[str, torch.Tensor]:
        out = {"proj": self.proj, "weight": self.weight}
        if self.bias is not None:
            out["bias"] = self.bias
        return out

    def run(self, fn, *args):
        """``fn(*args) -> (outputs, objective)``, then ``objective.backward()``: (outputs, grads)."""
        for t in self.leaves().values():
            t.grad = None
        out, objective = fn(*args)
        objective.backward()
        return out, {k: t.grad.detach().clone() for k, t in self.leaves().items()}


def _batch(gen, device, tokens: int, ignored: float = 0.4):
    x = torch.randn(2, tokens, D, generator=gen)
    labels = torch.randint(0, V, (2, tokens), generator=gen)
    labels[torch.rand(2, tokens, generator=gen) < ignored] = -100
    labels[0, 0] = -100  # at least one ignored token
    labels[1, -1] = 3  # at least one kept token
    return x.to(device), labels.to(device)


def _assert_outputs_equal(name, actual, expected, tol):
    assert type(actual) is type(expected), f"{name}: {type(actual)} vs {type(expected)}"
    assert actual._fields == expected._fields
    for field, a, e in zip(expected._fields, actual, expected, strict=True):
        if field == "predicted_tokens":
            assert torch.equal(a, e), f"{name}: predicted_tokens differ"
        else:
            assert_close(f"{name} {field}", a, e.double(), tol)


@pytest.mark.parametrize("objective", ["loss", "loss_z_entropy"])
@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fullgraph_dynamic_training_step_equals_eager(gen, device, backend, compiler, objective):
    """One graph for three token counts; loss, z_loss, token accuracy, entropy and every gradient
    equal eager's. "loss": the gradients come from the forward, scaled in the backward
    (scale_grads_); "loss_z_entropy": gradients through z_loss and the entropy recompute them
    (flce_backward)."""
    params = _Params(gen, device)

    def step(x, labels):
        hidden = torch.tanh(x @ params.proj)
        out = lp.fused_linear_cross_entropy(
            hidden,
            params.weight,
            labels,
            params.bias,
            backend=backend,
            z_loss_scale=1e-2,
            label_smoothing=0.1,
            return_z_loss=True,
            return_entropy=True,
            return_token_accuracy=True,
        )  # float options as literals: see test_float_option_from_a_variable_under_dynamic_shapes
        obj = out.loss if objective == "loss" else out.loss + 0.5 * out.z_loss - 0.1 * out.entropy
        return out, obj

    counter = CompileCounterWithBackend(compiler)
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=counter)
    tol = _same(compiler)
    for tokens in (7, 5, 11):
        x, labels = _batch(gen, device, tokens)
        eager_out, eager_grads = params.run(step, x, labels)
        comp_out, comp_grads = params.run(compiled, x, labels)
        assert comp_out._fields == ("loss", "z_loss", "token_accuracy", "entropy")
        _assert_outputs_equal(f"T={tokens}", comp_out, eager_out, tol)
        for name, g in eager_grads.items():
            assert_close(f"T={tokens} grad {name}", comp_grads[name], g.double(), tol)
    _assert_one_graph(counter)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_named_tuple_equals_eager(gen, device, backend, reduction):
    params = _Params(gen, device)

    def step(x, labels):
        hidden = torch.tanh(x @ params.proj)
        out = lp.fused_linear_cross_entropy(
            hidden,
            params.weight,
            labels,
            params.bias,
            backend=backend,
            reduction=reduction,
            z_loss_scale=1e-2,
            **ALL_OUTPUTS,
        )
        return out, (out.loss.sum() + out.entropy.sum()) if reduction == "none" else out.loss + out.entropy

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=counter)
    for tokens in (6, 9):
        x, labels = _batch(gen, device, tokens)
        eager_out, eager_grads = params.run(step, x, labels)
        out, grads = params.run(compiled, x, labels)
        assert type(out).__name__ == "FusedLossOutput"
        assert out._fields == ("loss", "z_loss", "token_accuracy", "predicted_tokens", "entropy")
        loss, z_loss, accuracy, predicted, entropy = out  # unpacks in the documented order
        lead = () if reduction == "mean" else labels.shape
        assert loss.shape == z_loss.shape == accuracy.shape == entropy.shape == lead
        assert predicted.shape == labels.shape and predicted.dtype == torch.int64
        assert (predicted[labels == -100] == -1).all()
        _assert_outputs_equal(f"T={tokens}", out, eager_out, 1e-6)
        for name, g in eager_grads.items():
            assert_close(f"T={tokens} grad {name}", grads[name], g.double(), 1e-6)
    _assert_one_graph(counter)


@pytest.mark.parametrize(
    "how",
    ["mean", "mean_num_items_0", "sum", "none"],
    ids=lambda s: s.replace("_num_items_0", "+num_items=0"),
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_all_ignored_batch(gen, device, backend, how):
    """No kept token: the loss (and every output) is exactly 0, attached to the graph; every
    gradient is a finite zero."""
    params = _Params(gen, device)
    reduction = how.split("_")[0]
    # as a tensor: a Python int is test_compiled_num_items_python_int's bug
    num_items = torch.zeros((), dtype=torch.long, device=device) if how.endswith("num_items_0") else None

    def step(x, labels):
        hidden = torch.tanh(x @ params.proj)
        out = lp.fused_linear_cross_entropy(
            hidden,
            params.weight,
            labels,
            params.bias,
            backend=backend,
            reduction=reduction,
            z_loss_scale=1e-2,
            label_smoothing=0.1,
            num_items_in_batch=num_items,
            **ALL_OUTPUTS,
        )
        return out, out.loss.sum() + out.z_loss.sum() + out.entropy.sum()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=counter)
    for tokens in (4, 7):
        x, labels = _batch(gen, device, tokens)
        labels.fill_(-100)
        out, grads = params.run(compiled, x, labels)
        assert out.loss.requires_grad
        for field in ("loss", "z_loss", "token_accuracy", "entropy"):
            value = getattr(out, field)
            assert (value == 0).all(), f"T={tokens}: {field} = {value}"
        assert (out.predicted_tokens == -1).all()
        for name, g in grads.items():
            assert torch.isfinite(g).all() and (g == 0).all(), f"T={tokens}: grad {name} not a finite zero"
    _assert_one_graph(counter)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_num_items_tensor_varies_without_recompile(gen, device, backend):
    """The HF Trainer's ``num_items_in_batch`` tensor changes every step: no recompile."""
    params = _Params(gen, device, bias=False)

    def step(x, labels, num_items):
        hidden = torch.tanh(x @ params.proj)
        loss = lp.fused_linear_cross_entropy(
            hidden, params.weight, labels, backend=backend, num_items_in_batch=num_items
        )
        return loss, loss

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=counter)
    for tokens, num_items in ((6, 13), (9, 20), (5, 3)):
        x, labels = _batch(gen, device, tokens)
        n = torch.tensor(num_items, device=device)
        eager_loss, eager_grads = params.run(step, x, labels, n)
        loss, grads = params.run(compiled, x, labels, n)
        assert_close(f"T={tokens} loss", loss, eager_loss.double(), 1e-6)
        for name, g in eager_grads.items():
            assert_close(f"T={tokens} grad {name}", grads[name], g.double(), 1e-6)
    _assert_one_graph(counter)


@pytest.mark.parametrize("how", ["varying_int", "constant_int_dynamic"])
def test_compiled_num_items_python_int(gen, device, how):
    """A Python int ``num_items_in_batch``: one that changes between calls (dynamo makes it
    symbolic on its second distinct value), or a constant one under dynamic=True."""
    params = _Params(gen, device, bias=False)
    x, labels = _batch(gen, device, 6)

    def step(x, labels, num_items):
        hidden = torch.tanh(x @ params.proj)
        return lp.fused_linear_cross_entropy(hidden, params.weight, labels, num_items_in_batch=num_items)

    dynamic = True if how == "constant_int_dynamic" else None
    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    for num_items in (5, 9, 13) if how == "varying_int" else (5, 5):
        assert_close(
            f"num_items={num_items}", compiled(x, labels, num_items), step(x, labels, num_items), 1e-6
        )


Z_LOSS_SCALE = 1e-2  # a float option held in a variable (a config value), not written as a literal


def test_float_option_from_a_variable_under_dynamic_shapes(gen, device):
    """Under ``dynamic=True`` a float read from a variable is traced as a symbol; the options
    still reach the op as constants (``constant_changes``), and a new value recompiles."""
    params = _Params(gen, device, bias=False)
    x, labels = _batch(gen, device, 6)
    opts = dict(z_loss_scale=Z_LOSS_SCALE, label_smoothing=0.1)

    def step(x, labels):
        hidden = torch.tanh(x @ params.proj)
        return lp.fused_linear_cross_entropy(hidden, params.weight, labels, **opts)

    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    assert_close("loss", compiled(x, labels), step(x, labels).double(), 1e-6)
    # a changed float is used, not the one the first trace saw (float.hex put a guard on it)
    opts["z_loss_scale"] = 0.5
    assert_close("loss", compiled(x, labels), step(x, labels).double(), 1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_logprobs_equal_eager(gen, device, backend):
    params = _Params(gen, device)

    def step(x, labels):
        hidden = torch.tanh(x @ params.proj)
        out = lp.fused_linear_logprobs(
            hidden, params.weight, labels, params.bias, temperature=0.7, return_entropy=True, backend=backend
        )
        return out, -out.logprobs.sum() - 0.1 * out.entropy.sum()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=counter)
    for tokens in (6, 9):
        x, labels = _batch(gen, device, tokens)
        eager_out, eager_grads = params.run(step, x, labels)
        out, grads = params.run(compiled, x, labels)
        assert type(out) is lp.LogProbs and out.logprobs.shape == labels.shape
        for field, a, e in zip(out._fields, out, eager_out, strict=True):
            assert_close(f"T={tokens} {field}", a, e.double(), 1e-6)
        for name, g in eager_grads.items():
            assert_close(f"T={tokens} grad {name}", grads[name], g.double(), 1e-6)
    _assert_one_graph(counter)


# --------------------------------------------------------------------------------------------
# the autograd graph is freed after the backward

FREED_CASES = [
    pytest.param(dict(), lambda out: out, id="mean_loss"),  # gradients from the forward, scaled
    pytest.param(dict(return_entropy=True), lambda out: out.loss + out.entropy, id="mean_loss_entropy"),
    pytest.param(
        dict(z_loss_scale=1e-2, return_z_loss=True),
        lambda out: out.loss + out.z_loss,
        id="mean_loss_z",
    ),
    pytest.param(dict(reduction="none"), lambda out: out.sum(), id="none"),
    pytest.param(
        dict(reduction="none", return_entropy=True),
        lambda out: (out.loss + out.entropy).sum(),
        id="none_entropy",
    ),
    pytest.param(dict(dtype=torch.float16), lambda out: out.float(), id="fp16_mean"),
    pytest.param(dict(logprobs=True), lambda out: -out.sum(), id="logprobs"),
    pytest.param(
        dict(logprobs=True, return_entropy=True),
        lambda out: -out.logprobs.sum() - out.entropy.sum(),
        id="logprobs_entropy",
    ),
]


@pytest.mark.parametrize(("options", "objective"), FREED_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_frees_the_graph(gen, device, backend, options, objective):
    """After ``backward()`` and dropping the outputs, nothing of the step stays alive: 10 steps
    with fresh hidden states leave none of them behind (a leaked graph keeps its saved tensors)."""
    options = dict(options, backend=backend)
    dtype = options.pop("dtype", torch.float32)
    op = lp.fused_linear_logprobs if options.pop("logprobs", False) else lp.fused_linear_cross_entropy
    weight = (torch.randn(V, H, generator=gen) * 0.5).to(device, dtype).requires_grad_()
    alive = []
    for _ in range(10):
        hidden = torch.randn(6, H, generator=gen).to(device, dtype).requires_grad_()
        labels = torch.randint(0, V, (6,), generator=gen).to(device)
        out = op(hidden, weight, labels, **options)
        objective(out).backward()
        alive.append(weakref.ref(hidden))
        del hidden, out
    gc.collect()
    assert sum(ref() is not None for ref in alive) == 0, "the steps' autograd graphs were not freed"


# --------------------------------------------------------------------------------------------
# no graph breaks


def _explain_inputs(gen, device):
    hidden = torch.randn(2, 5, H, generator=gen).to(device).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) * 0.5).to(device).requires_grad_()
    labels = torch.randint(0, V, (2, 5), generator=gen)
    labels[0, :2] = -100
    return hidden, weight, labels.to(device)


EXPLAINED = {
    "functional": lambda h, w, y: lp.fused_linear_cross_entropy(
        h,
        w,
        y,
        z_loss_scale=1e-3,
        class_weight=torch.ones(V, device=h.device),
        use_token_scaling=True,
        **ALL_OUTPUTS,
    ),
    "module": lp.FusedLinearCrossEntropyLoss(label_smoothing=0.1, z_loss_scale=1e-3, return_z_loss=True),
    "module_num_items": lambda h, w, y: lp.FusedLinearCrossEntropyLoss(return_entropy=True)(
        h, w, y, num_items_in_batch=torch.tensor(4, device=h.device)
    ),
    "logprobs": lambda h, w, y: lp.fused_linear_logprobs(h, w, y, temperature=0.7, return_entropy=True),
}


@pytest.mark.parametrize("entry", EXPLAINED)
def test_explain_reports_no_graph_break(gen, device, entry):
    explanation = torch._dynamo.explain(EXPLAINED[entry])(*_explain_inputs(gen, device))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    assert sum(_flce_node_count(g) for g in explanation.graphs) == 1
