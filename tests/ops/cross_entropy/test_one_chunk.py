"""``one_chunk``: a forward that runs as one token chunk of every row on the fused logits GEMM takes
its chunk loop's decisions once per signature (the second time the signature is seen), and its
later calls issue only the launches. Their results must be ``run_chunks``' bits
(``Tuning(call_plans=False)``), also with other tensors of the same signature, and a call that
differs from its signature in anything a plan reads (gradients wanted, shapes, strides,
alignment, the budget's environment variable, the options) must be planned again or take
``run_chunks``. (tests/conftest.py starts every test with no plan.)

On the CPU the fused GEMM runs under the interpreter with fp32 inputs (half inputs run fp32 GEMMs
there: no plan); on CUDA with half inputs. The CPU reads its label check first, so there a call
that skips its ignored rows takes ``run_chunks``."""

import dataclasses
import weakref

import pytest
import torch
from op_helpers import assert_same_bits, call_op, fresh_values, make_case, materialize_options, record_calls
from torch import Tensor

from liger_patch.ops.core.eager_call import EmptyOutputs
from liger_patch.ops.core.grad_sums import GradSums
from liger_patch.ops.core.graphed_forward import Later
from liger_patch.ops.core.tuning import Tuning
from liger_patch.ops.cross_entropy import chunks, one_chunk
from liger_patch.ops.cross_entropy import operator as flce_operator
from liger_patch.ops.cross_entropy.backends import row_backend
from liger_patch.ops.cross_entropy.forward_io import ForwardInputs, ForwardOutputs
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
    # No graphs (test_call_graph.py): a capture runs the plan once more, uncounted here.
    tuning = Tuning(call_plans=plans, call_graphs=False)
    out = call_op(case, ignore_index=ignore_index, tuning=tuning, **opts)
    outs = out if isinstance(out, tuple) else (out,)
    loss = outs[0]
    if loss.requires_grad:
        (loss.sum() * 1.3).backward()
    grads = tuple(t.grad.clone() for t in case.grad_leaves().values() if t.grad is not None)
    return tuple(o.detach().clone() for o in outs), grads


def _assert_same_bits(a, b) -> None:
    assert_same_bits((*a[0], *a[1]), (*b[0], *b[1]))


def _planned_thrice(case, ignore_index=-100, **opts):
    """Three calls with plans on (seen, planned, run by the plan) and one without, all the same
    bits; the last planned call's results."""
    unplanned = _run(case, ignore_index, False, **opts)  # also records the shape's ignored share
    results = [_run(case, ignore_index, True, **opts) for _ in range(3)]
    for result in results:
        _assert_same_bits(result, unplanned)
    return results[-1]


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
        runs.clear()
        _planned_thrice(case, ignore_index, **opts)
        planned = _planned_here(device, dtype, case)
        assert len(runs) == (1 if planned else 0), (dtype, len(runs))
        # The plan serves other values and labels of its signature.
        fresh_values(case, gen)
        runs.clear()
        _assert_same_bits(_run(case, ignore_index, True, **opts), _run(case, ignore_index, False, **opts))
        assert len(runs) == (1 if planned else 0)


# A forward that reads its label check first and walks its kept rows without a head start: on
# the CPU every forward reads first; on CUDA ``wait_to_skip_gflop=0`` makes every one wait.
KEPT = {"wait_to_skip_gflop": 0.0, "head_start_gflop": 0.0}


def _run_tuned(case, plans: bool, tuning: dict, **opts):
    """``_run`` with more ``Tuning`` fields (no graphs)."""
    for t in case.grad_leaves().values():
        t.grad = None
    out = call_op(case, tuning=Tuning(call_plans=plans, call_graphs=False, **tuning), **opts)
    outs = out if isinstance(out, tuple) else (out,)
    if outs[0].requires_grad:
        (outs[0].sum() * 1.3).backward()
    grads = tuple(t.grad.clone() for t in case.grad_leaves().values() if t.grad is not None)
    return tuple(o.detach().clone() for o in outs), grads


def _relabel(case, gen, n_kept: int) -> None:
    """New values and labels in ``case``'s own tensors, exactly ``n_kept`` of them kept, at random
    positions."""
    fresh_values(case, gen)
    n = case.labels.numel()
    kept = torch.zeros(n, dtype=torch.bool)
    kept[torch.randperm(n, generator=gen)[:n_kept]] = True
    fresh = torch.randint(0, case.weight.shape[0], (n,), generator=gen)
    case.labels.copy_(
        torch.where(kept, fresh, case.ignore_index).view(case.labels.shape).to(case.labels.device)
    )


KEPT_CASES = [
    ("plain", "both"),
    ("plain", "hidden"),
    ("plain", "weight"),
    ("none", "both"),
    ("z_loss", "both"),
]
KEPT_CASES += [("num_items_tensor", "both")]


@pytest.mark.parametrize("option, needs", KEPT_CASES)
def test_a_kept_rows_plan_serves_any_kept_count_with_the_chunk_loops_bits(
    monkeypatch, gen, device, option, needs
):
    """A forward walking its kept rows is planned once, and the plan then serves calls of its
    signature whatever their number of kept rows, from one to all but two, and gives
    ``run_chunks``' bits: ce, lse and grad_h scattered into zeros for the ignored rows."""
    runs = record_calls(monkeypatch, one_chunk.OneChunk, "run")
    made = record_calls(monkeypatch, one_chunk.OneChunk, "of", lambda args, kwargs, plan: plan is not None)
    for dtype in _dtypes(device):
        planned = device.type == "cpu" or dtype != torch.float32
        case = make_case(
            gen, (N,), H, V, dtype=dtype, device=device, ignore="half", requires_grad=NEEDS[needs]
        )
        opts = materialize_options(OPTIONS[option], device)
        runs.clear(), made.clear()
        for n_kept in (N // 2, N // 2, 1, N - 2, 5):  # (N - 1 kept: too few ignored to skip)
            _relabel(case, gen, n_kept)
            _assert_same_bits(_run_tuned(case, True, KEPT, **opts), _run_tuned(case, False, KEPT, **opts))
        assert len(runs) == (3 if planned else 0), (dtype, len(runs))  # seen, planned, then run
        assert made.count(True) == (1 if planned else 0)
        assert all(kwargs["kept"] is not None for _, kwargs, _ in runs)


FEW_ROWS = 8 * V * 4 + 40 * N + (2 << 20)  # a budget of a few logits rows: several chunks


@pytest.mark.parametrize("budget", ["batch", "512MiB", "lean", FEW_ROWS, None])
def test_where_every_row_is_one_chunk_so_is_every_kept_count(monkeypatch, gen, device, budget):
    """What a plan for kept rows rests on: where ``run_chunks`` would walk every row as one chunk,
    it walks any smaller number of kept rows as one chunk with the same decisions, under a
    budget in bytes and one sized by the batch (a budget of a few rows fits no walk of every
    row: then no plan is made, ``OneChunk.of``)."""
    calls = record_calls(monkeypatch, one_chunk.OneChunk, "of", lambda args, kwargs, plan: args[0])
    case = make_case(gen, (N,), H, V, dtype=_dtypes(device)[0], device=device, ignore="half")
    opts = {} if budget is None else {"memory_budget": budget}
    for _ in range(2):
        _run_tuned(case, True, KEPT, **opts)
    (call,) = calls
    grad_weight = call.computes_grads and call.wanted.weight
    whole = one_chunk._one_chunk_plan(call, grad_weight, call.labels)
    assert (whole is None) == (budget == FEW_ROWS)
    if whole is not None:
        for n in range(1, N + 1):
            assert one_chunk._one_chunk_plan(call, grad_weight, call.labels[:n]) == whole, n


def test_no_kept_rows_plan_where_some_count_would_take_two_chunks(monkeypatch, gen, device):
    """A plan for kept rows is made only where a walk of every row would be one chunk: chunks of
    ``N - 1`` rows hold any walk but every row's, so no plan, and every call gives
    ``run_chunks``' bits; nor for a call that keeps no row (nothing to walk)."""
    runs = record_calls(monkeypatch, one_chunk.OneChunk, "run")
    case = make_case(gen, (N,), H, V, dtype=_dtypes(device)[0], device=device, ignore="half")
    for tuning in ({**KEPT, "chunk_rows": N - 1}, KEPT):
        for n_kept in (N // 2, N // 2, N - 1) if "chunk_rows" in tuning else (0, 0, 0):
            _relabel(case, gen, n_kept)
            _assert_same_bits(_run_tuned(case, True, tuning), _run_tuned(case, False, tuning))
    assert not runs


def test_a_kept_rows_plan_follows_a_budget_sized_by_the_batch(monkeypatch, gen, device):
    """``memory_budget="batch"`` sizes the budget by the rows walked: the plan made at one count
    serves the others with ``run_chunks``' bits."""
    runs = record_calls(monkeypatch, one_chunk.OneChunk, "run")
    case = make_case(gen, (N,), H, V, dtype=_dtypes(device)[0], device=device, ignore="half")
    for n_kept in (3, 3, N - 2, 1):
        _relabel(case, gen, n_kept)
        planned = _run_tuned(case, True, KEPT, memory_budget="batch")
        _assert_same_bits(planned, _run_tuned(case, False, KEPT, memory_budget="batch"))
    assert len(runs) == 2


def _variant(case, gen, **tensors):
    """A case with ``case``'s labels and the given tensors (the others ``case``'s)."""
    other = make_case(gen, (N,), H, V, dtype=case.hidden.dtype, device=case.hidden.device, ignore="none")
    other.hidden, other.weight, other.labels = case.hidden, case.weight, case.labels
    for name, t in tensors.items():
        setattr(other, name, t)
    return other


def _offset_copy(t: Tensor) -> Tensor:
    """``t``'s values one element off a 16-byte boundary (the fused GEMM refuses such a base)."""
    storage = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    return storage[1:].view(t.shape).copy_(t.detach()).requires_grad_(t.requires_grad)


def test_a_changed_signature_is_planned_again(monkeypatch, gen, device):
    """Gradients wanted, another token count, misaligned or column-major hidden states, a misaligned
    or transposed weight, another budget from the environment, other options: each is a signature
    of its own (planned where the fused GEMM takes it), whose calls give ``run_chunks``' bits."""
    dtype = _dtypes(device)[0]
    runs = record_calls(monkeypatch, one_chunk.OneChunk, "run")
    chunk_runs = record_calls(monkeypatch, flce_operator, "run_chunks")
    case = make_case(gen, (N,), H, V, dtype=dtype, device=device, ignore="last")

    def check(variant, planned_runs: int) -> None:
        """Three planned calls of ``variant``: its plan ran ``planned_runs`` times (1: made by the
        second, run by the third; 3: made before)."""
        runs.clear()
        _planned_thrice(variant)
        assert len(runs) == planned_runs

    check(case, 1)
    with torch.no_grad():  # no gradient wanted: a signature of its own
        check(case, 1)
    check(case, 3)  # the plan with gradients, made above
    check(make_case(gen, (N + 8,), H, V, dtype=dtype, device=device, ignore="last"), 1)
    check(_variant(case, gen, hidden=_offset_copy(case.hidden)), 0)
    column_major = case.hidden.detach().t().contiguous().t().requires_grad_()
    check(_variant(case, gen, hidden=column_major), 0)
    check(_variant(case, gen, weight=_offset_copy(case.weight)), 0)
    check(_variant(case, gen, weight=case.weight.detach().t().contiguous().t().requires_grad_()), 0)

    # A budget of a few logits rows from the environment: several chunks, so no plan.
    monkeypatch.setenv("LIGER_MEMORY_BUDGET", str(FEW_ROWS))
    chunk_runs.clear()
    check(case, 0)
    assert len(chunk_runs) == 4
    monkeypatch.delenv("LIGER_MEMORY_BUDGET")
    runs.clear()
    _run(case, -100, True)
    assert len(runs) == 1  # the first signature's plan again

    # Options of their own: chunks of 8 rows.
    runs.clear()
    for _ in range(3):
        call_op(case, tuning=Tuning(chunk_rows=8)).backward()
    assert not runs


def test_a_signature_seen_once_is_not_planned_and_the_oldest_go_first(gen, device):
    """Token counts that change at every call (dynamic padding) cost no planning, and the plans
    kept are bounded."""
    dtype = _dtypes(device)[0]
    for n in (5, 6, 7):
        case = make_case(gen, (n,), H, V, dtype=dtype, device=device, ignore="none")
        _run(case, -100, False)  # records the shape's ignored share (unknown: the CPU expects to skip)
        _run(case, -100, True)
    assert all(p is one_chunk._SEEN_ONCE for p in one_chunk._PLANS.values())
    first = next(iter(one_chunk._PLANS))
    for i in range(one_chunk._MAX_PLANS):
        one_chunk.learn(("another signature", i), None)  # seen once: the call is not read
    assert len(one_chunk._PLANS) == one_chunk._MAX_PLANS and first not in one_chunk._PLANS
    one_chunk.forget()
    assert not one_chunk._PLANS


def _forward_inputs(opts: LossOptions, **fields) -> ForwardInputs:
    """The operator's arguments of a plain call with ``fields`` (hidden, weight and labels at
    least): by default no bias, class weights or ``num_items_in_batch``, gradients for hidden
    and weight."""
    plain = dict(
        bias=None, class_weight=None, num_items=None, num_items_value=None, options=opts.key,
        needs=[True, True, False],
    )  # fmt: skip
    return ForwardInputs(**{**plain, **fields})


def test_no_plan_for_bias_class_weights_low_rank_or_no_rows(gen, device):
    dtype = _dtypes(device)[0]
    case = make_case(gen, (N,), H, V, dtype=dtype, device=device, bias=True)
    hidden, weight, bias = case.hidden, case.weight, case.bias
    opts = LossOptions()
    backend = row_backend(opts.backend, hidden.device)

    def inputs(**changes):
        return _forward_inputs(opts, **{"hidden": hidden, "weight": weight, "labels": case.labels, **changes})

    assert one_chunk.signature(inputs(), opts, backend) is not None
    assert one_chunk.signature(inputs(bias=bias), opts, backend) is None
    assert one_chunk.signature(inputs(class_weight=torch.ones(V, device=device)), opts, backend) is None
    low_rank = dict(low_rank_u=hidden[:, :2], low_rank_b=weight[:, :2], needs=[True, True, False, True, True])
    assert one_chunk.signature(inputs(**low_rank), opts, backend) is None
    assert one_chunk.signature(inputs(hidden=hidden[:0], labels=case.labels[:0]), opts, backend) is None
    off = LossOptions(tuning=Tuning(call_plans=False))
    assert one_chunk.signature(inputs(options=off.key), off, backend) is None


@pytest.mark.parametrize("name", ["fused_logits", "reverse_pass2", "balanced_chunks", "call_plans"])
def test_switches_must_be_bools(name):
    with pytest.raises(ValueError, match=f"{name} must be True or False"):
        Tuning(**{name: 1})


@pytest.mark.parametrize("name", ["two_pass", "fp32_grad_weight"])
def test_optional_switches_must_be_none_or_bools(name):
    assert getattr(Tuning(**{name: None}), name) is None
    with pytest.raises(ValueError, match=f"{name} must be None, True or False"):
        Tuning(**{name: "yes"})


def test_a_plan_serves_only_the_backend_record_it_was_made_for(gen, device):
    """The signature holds the record's ``id``; a record built and dropped (as tests do) may leave
    its ``id`` to another, which must not get the first one's plan."""
    case = make_case(gen, (N,), H, V, dtype=_dtypes(device)[0], device=device, ignore="none")
    _planned_thrice(case)
    key, plan = next((k, p) for k, p in one_chunk._PLANS.items() if isinstance(p, one_chunk.OneChunk))
    assert one_chunk.planned(key, plan.backend) is plan
    assert one_chunk.planned(key, dataclasses.replace(plan.backend)) is None
    assert one_chunk.planned(None, plan.backend) is None


def test_partials_are_freed_before_the_gradient_gemms(monkeypatch, gen, device):
    """The fused GEMM's log-sum-exp partials serve only the row kernel: nothing holds them where the
    chunk's gradient GEMMs allocate (docs/perf-notes.md item 21), in the chunk loop and in a plan."""
    taken, seen_alive = [], []
    take_partials = chunks.ChunkLogits.take_partials

    def recording_take(self):
        partials = take_partials(self)
        taken.extend(weakref.ref(p) for p in partials if p is not None)
        return partials

    add = GradSums.add

    def checking_add(self, *args, **kwargs):
        seen_alive.append(sum(ref() is not None for ref in taken))
        return add(self, *args, **kwargs)

    monkeypatch.setattr(chunks.ChunkLogits, "take_partials", recording_take)
    monkeypatch.setattr(GradSums, "add", checking_add)
    runs = record_calls(monkeypatch, one_chunk.OneChunk, "run")
    case = make_case(gen, (N,), H, V, dtype=_dtypes(device)[0], device=device, ignore="none")
    _planned_thrice(case)
    assert taken and len(runs) == 1  # partials were made, by the loop and by a plan
    assert len(seen_alive) == 4 and not any(seen_alive)


def test_a_capture_plans_at_once_and_leaves_grad_w_to_later(gen, device):
    """A forward run for a CUDA graph's capture (given a ``Later``: ``core/graphed_forward``) makes
    its plan at once, even at its signature's first sighting, and leaves grad_W to the
    ``Later``: a graph's warm-up is that sighting, and were it run by ``run_chunks`` its grad_W
    would stay reserved in the graph's pool, which the capture's plan never uses. The grad_W made
    later is the plain call's bits. (On the CPU no graph is captured; the forward's body runs.)"""
    case = make_case(gen, (N,), H, V, dtype=_dtypes(device)[0], device=device, ignore="none")
    _run(case, -100, plans=False)  # the shape's ignored share, 0: no head start (a capture has none)
    opts = LossOptions()
    backend = row_backend(opts.backend, case.hidden.device)
    args = _forward_inputs(opts, hidden=case.hidden.detach(), weight=case.weight.detach(), labels=case.labels)
    shape_key = (case.hidden.device, N, V)
    gflop = flce_operator._gemm_gflop(args.hidden, args.weight, opts.reduction, args.needs)
    pending = flce_operator._begin(args, opts, backend, shape_key, gflop)
    later, empties = Later(), EmptyOutputs(device, shared=True)
    left = flce_operator._checked_forward(args, opts, backend, pending, empties, later)
    index = ForwardOutputs._fields.index("grad_weight")
    assert list(later.outputs) == [index] and left[index].numel() == 0
    plain = flce_operator._GRAPHED.run(args, opts, backend, shape_key, gflop)  # the plan made above
    assert_same_bits(later.outputs[index](), plain[index])
