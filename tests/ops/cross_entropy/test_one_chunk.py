"""``one_chunk``: a forward that runs as one token chunk of every row on the fused logits GEMM takes
its chunk loop's decisions once per signature, and its later calls issue only the launches. Their
results must be ``run_chunks``' bits (``Tuning(call_plans=False)``), and a call that differs from
its signature in anything a plan reads (alignment, strides, the budget's environment variable,
the options) must be planned again or take ``run_chunks``.

On the CPU the fused GEMM runs under the interpreter with fp32 inputs (half inputs run fp32 GEMMs
there: no plan); on CUDA with half inputs. The CPU reads its label check first, so there a call
that skips its ignored rows takes ``run_chunks``."""

import pytest
import torch
from op_helpers import call_op, make_case, materialize_options, record_calls

from liger_patch.ops.core.tuning import Tuning
from liger_patch.ops.cross_entropy import one_chunk
from liger_patch.ops.cross_entropy import operator as flce_operator
from liger_patch.ops.cross_entropy.backends import row_backend
from liger_patch.ops.cross_entropy.forward_io import ForwardInputs
from liger_patch.ops.cross_entropy.options import LossOptions

H, V = 24, 160  # 16-byte aligned rows in every dtype: the fused GEMM takes them
N = 37  # odd: not a multiple of any tile
OPTIONS = {
    "plain": {},
    "sum": {"reduction": "sum"},
    "none": {"reduction": "none"},
    "num_items_tensor": {"num_items_in_batch": ("tensor", 23, torch.int64)},
    "num_items_float": {"num_items_in_batch": 41.5},
    "smoothing_softcap_scale": {"label_smoothing": 0.1, "softcap": 3.0, "logit_scale": 0.7},
    "z_loss": {"z_loss_scale": 2e-2, "return_z_loss": True},
    "ignore_index_in_vocab": {"ignore_index": 7},
}
NEEDS = {"both": ("hidden", "weight"), "hidden": ("hidden",), "weight": ("weight",), "none": ()}


def _dtypes(device) -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16, torch.float32] if device.type == "cuda" else [torch.float32]


def _planned_here(device, dtype, case) -> bool:
    """Whether this case's calls take a plan: half inputs on CUDA (fp32 ones run as TF32 in the fused
    GEMM, so it refuses them), fp32 ones on the CPU, where the forward reads its check first and
    skips its ignored rows from 5 % of them."""
    if device.type == "cuda":
        return dtype != torch.float32
    return case.n_kept > 0.95 * case.labels.numel()


def _run(case, ignore_index, plans: bool, **opts):
    """Loss (and any other output) and gradients of one forward + backward."""
    for t in case.grad_leaves().values():
        t.grad = None
    out = call_op(case, ignore_index=ignore_index, tuning=Tuning(call_plans=plans), **opts)
    outs = out if isinstance(out, tuple) else (out,)
    loss = outs[0]
    if loss.requires_grad:
        (loss.sum() * 1.3).backward()
    grads = tuple(t.grad.clone() for t in case.grad_leaves().values())
    return tuple(o.detach().clone() for o in outs), grads


def _assert_same_bits(a, b) -> None:
    for x, y in zip((*a[0], *a[1]), (*b[0], *b[1]), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y), (x, y)


# Every option with both gradients and a few ignored labels; the plain loss with every subset of
# gradients and every share of ignored labels.
CASES = [(option, "both", "last") for option in OPTIONS]
CASES += [("plain", needs, ignore) for needs in NEEDS for ignore in ("none", "mixed")]


@pytest.mark.parametrize("option, needs, ignore", CASES)
def test_planned_calls_give_the_chunk_loops_bits(monkeypatch, gen, device, option, needs, ignore):
    runs = record_calls(monkeypatch, one_chunk.OneChunk, "run")
    for dtype in _dtypes(device):
        ignore_index = OPTIONS[option].get("ignore_index", -100)
        case = make_case(
            gen, (N,), H, V, dtype=dtype, device=device, ignore=ignore, ignore_index=ignore_index,
            requires_grad=NEEDS[needs],
        )  # fmt: skip
        opts = materialize_options({k: v for k, v in OPTIONS[option].items() if k != "ignore_index"}, device)
        unplanned = _run(case, ignore_index, False, **opts)
        runs.clear()
        first, second = (_run(case, ignore_index, True, **opts) for _ in range(2))
        _assert_same_bits(first, unplanned)
        _assert_same_bits(second, unplanned)
        # The first call of a signature may have been planned by an earlier test: at least the second.
        planned = _planned_here(device, dtype, case)
        assert (len(runs) >= 1) == planned, (dtype, len(runs))


def test_a_changed_signature_is_planned_again(monkeypatch, gen, device):
    """Misaligned hidden states, strides of a transposed weight, another budget from the environment,
    other options: each is a signature of its own, whose calls give ``run_chunks``' bits."""
    dtype = _dtypes(device)[0]
    runs = record_calls(monkeypatch, one_chunk.OneChunk, "run")
    chunk_runs = record_calls(monkeypatch, flce_operator, "run_chunks")
    case = make_case(gen, (N,), H, V, dtype=dtype, device=device, ignore="last")
    planned = _run(case, -100, True), _run(case, -100, True)
    assert len(runs) >= 1
    _assert_same_bits(planned[1], _run(case, -100, False))

    # Hidden states one element off a 16-byte boundary: the fused GEMM refuses them.
    storage = torch.empty(N * H + 1, dtype=dtype, device=device)
    shifted = storage[1:].view(N, H).copy_(case.hidden.detach()).requires_grad_()
    moved = make_case(gen, (N,), H, V, dtype=dtype, device=device, ignore="last")
    moved.hidden, moved.weight, moved.labels = shifted, case.weight, case.labels
    runs.clear()
    chunk_runs.clear()
    first, again = _run(moved, -100, True), _run(moved, -100, True)
    assert not runs and len(chunk_runs) == 2
    _assert_same_bits(first, again)
    _assert_same_bits(again, _run(moved, -100, False))

    # A weight that is a transposed view: its strides are part of the signature.
    w_t = case.weight.detach().t().contiguous().t().requires_grad_()
    strided = make_case(gen, (N,), H, V, dtype=dtype, device=device, ignore="last")
    strided.hidden, strided.weight, strided.labels = case.hidden, w_t, case.labels
    runs.clear()
    _assert_same_bits(_run(strided, -100, True), _run(strided, -100, False))
    _assert_same_bits(_run(strided, -100, True), _run(strided, -100, False))
    assert not runs  # its rows are not unit-strided: the fused GEMM refuses it

    # A budget of a few logits rows from the environment: several chunks, so no plan.
    monkeypatch.setenv("LIGER_MEMORY_BUDGET", str(8 * V * 4 + 40 * N + (2 << 20)))
    runs.clear()
    chunk_runs.clear()
    budgeted = _run(case, -100, True), _run(case, -100, True)
    assert not runs and len(chunk_runs) == 2
    _assert_same_bits(budgeted[1], _run(case, -100, False))
    monkeypatch.delenv("LIGER_MEMORY_BUDGET")
    runs.clear()
    _run(case, -100, True)
    assert len(runs) == 1  # the first signature's plan again

    # Options of their own: chunks of 8 rows.
    runs.clear()
    chunk_runs.clear()
    tuned = call_op(case, tuning=Tuning(chunk_rows=8))
    tuned.backward()
    assert not runs and len(chunk_runs) == 1


def test_no_plan_for_bias_class_weights_low_rank_or_no_rows(gen, device):
    dtype = _dtypes(device)[0]
    case = make_case(gen, (N,), H, V, dtype=dtype, device=device, bias=True)
    hidden, weight, bias = case.hidden, case.weight, case.bias
    opts = LossOptions()
    backend = row_backend(opts.backend, hidden.device)

    def inputs(**changes):
        args = dict(
            hidden=hidden, weight=weight, bias=None, labels=case.labels, class_weight=None, num_items=None,
            num_items_value=None, options=opts.key, needs=[True, True, False],
        )  # fmt: skip
        return ForwardInputs(**{**args, **changes})

    assert one_chunk.signature(inputs(), opts, backend) is not None
    assert one_chunk.signature(inputs(bias=bias), opts, backend) is None
    assert one_chunk.signature(inputs(class_weight=torch.ones(V, device=device)), opts, backend) is None
    low_rank = dict(low_rank_u=hidden[:, :2], low_rank_b=weight[:, :2], needs=[True, True, False, True, True])
    assert one_chunk.signature(inputs(**low_rank), opts, backend) is None
    assert one_chunk.signature(inputs(hidden=hidden[:0], labels=case.labels[:0]), opts, backend) is None
    off = LossOptions(tuning=Tuning(call_plans=False))
    assert one_chunk.signature(inputs(options=off.key), off, backend) is None


def test_call_plans_must_be_a_bool():
    with pytest.raises(ValueError, match="call_plans must be True or False"):
        Tuning(call_plans=1)
