"""``plan_graph``: a call plan's launches captured as a CUDA graph and replayed. Replays must give
the plan's bits (``Tuning(call_graphs=False)``) for new values and labels of the signature; must
never rewrite an output that something still holds (a kept gradient, a gradient being
accumulated); must not run while the weight is elsewhere; and a bad label must still raise.

A signature's calls: the first is seen, the second makes the plan, the third runs it (noting
where the weight is), the fourth runs it and captures the graph, the fifth on replays it.
(tests/conftest.py starts every test with no plan and no graph.) Graphs need a GPU; on the CPU
the plan runs and nothing is captured."""

import pytest
import torch
from op_helpers import call_op, make_case, raises_by_step, record_calls

from liger_patch.ops.core.tuning import Tuning
from liger_patch.ops.cross_entropy import one_chunk, plan_graph

H, V, N = 64, 320, 45  # 16-byte aligned rows; N odd, not a multiple of any tile
GRAPHS, NO_GRAPHS = Tuning(call_graphs=True), Tuning(call_graphs=False)


def _replays(monkeypatch) -> list:
    """One entry per replay (nothing of its results kept: a kept output would stop the next replay)."""
    return record_calls(monkeypatch, plan_graph.PlanGraph, "replay", lambda args, kwargs, result: None)


def _needs_gpu(device) -> None:
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU: this runs in tests/gpu_suite.sh")


def _case(gen, device, dtype=torch.bfloat16, requires_grad=("hidden", "weight"), ignore="mixed"):
    return make_case(gen, (N,), H, V, dtype=dtype, device=device, ignore=ignore, requires_grad=requires_grad)


def _fresh(case, gen) -> None:
    """New values in the case's own tensors (the same signature) and new kept labels."""
    with torch.no_grad():
        for t in case.tensors().values():
            t.copy_((torch.randn(t.shape, generator=gen) * t.float().std().cpu()).to(t.device, t.dtype))
    kept = case.labels != case.ignore_index
    fresh = torch.randint(0, V, case.labels.shape, generator=gen).to(case.labels.device)
    case.labels.copy_(torch.where(kept, fresh, case.labels))


def _call(case, tuning: Tuning, clear: bool = True, **opts):
    """One forward + backward: the outputs and the gradients as the call left them (not copies)."""
    if clear:
        for t in case.grad_leaves().values():
            t.grad = None
    out = call_op(case, tuning=tuning, **opts)
    outs = out if isinstance(out, tuple) else (out,)
    if outs[0].requires_grad:
        (outs[0].sum() * 1.7).backward()
    return outs, tuple(t.grad for t in case.grad_leaves().values())


def _copies(result) -> tuple:
    outs, grads = result
    return tuple(t.detach().clone() for t in (*outs, *grads))


def _assert_same_bits(a: tuple, b: tuple) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y), (x, y)


OPTIONS = {
    "plain": {},
    "sum": {"reduction": "sum"},
    "none": {"reduction": "none"},
    "z_loss": {"z_loss_scale": 2e-2, "return_z_loss": True},
    "smoothing_softcap": {"label_smoothing": 0.1, "softcap": 3.0},
}


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("needs", [("hidden", "weight"), ("hidden",), ("weight",), ()], ids=str)
def test_replays_give_the_plans_bits(monkeypatch, gen, device, option, needs):
    _needs_gpu(device)
    replays = _replays(monkeypatch)
    for dtype in (torch.bfloat16, torch.float16):
        replays.clear()
        case = _case(gen, device, dtype, needs)
        for _ in range(7):
            _fresh(case, gen)
            graphed = _copies(_call(case, GRAPHS, **OPTIONS[option]))
            _assert_same_bits(graphed, _copies(_call(case, NO_GRAPHS, **OPTIONS[option])))
        assert len(replays) == 3, dtype


def test_a_held_output_is_never_rewritten(monkeypatch, gen, device):
    """Gradients kept from every other call (as a caller keeps what it logs) hold the graph's
    buffers: those calls' successors run the plan instead, and every kept tensor keeps its values."""
    _needs_gpu(device)
    replays = _replays(monkeypatch)
    case = _case(gen, device)
    kept = []
    for i in range(12):
        _fresh(case, gen)
        result = _call(case, GRAPHS)
        reference = _copies(_call(case, NO_GRAPHS))
        _assert_same_bits(_copies(result), reference)
        if i % 2:
            kept.append((result, reference))
        del result
    for result, reference in kept:
        _assert_same_bits(_copies(result), reference)
    assert 0 < len(replays) < 8  # some calls replayed, none while a kept gradient held its buffer


def test_accumulated_gradients_equal_the_plans(gen, device):
    """Gradients accumulated over calls (no clearing between them), graphed or not: the same bits."""
    _needs_gpu(device)
    case = _case(gen, device)
    start = {name: t.detach().clone() for name, t in case.tensors().items()}
    labels = case.labels.clone()
    sums = {}
    for tuning in (GRAPHS, NO_GRAPHS):
        with torch.no_grad():  # each run from the same values: _fresh scales by their spread
            for name, t in case.tensors().items():
                t.copy_(start[name])
        case.labels.copy_(labels)
        for t in case.grad_leaves().values():
            t.grad = None
        for step in range(8):
            _fresh(case, torch.Generator().manual_seed(step))
            _call(case, tuning, clear=False)
        sums[tuning] = tuple(t.grad.clone() for t in case.grad_leaves().values())
    _assert_same_bits(sums[GRAPHS], sums[NO_GRAPHS])


def test_no_replay_while_the_weight_is_elsewhere(monkeypatch, gen, device):
    """A weight of the same signature at another address (as FSDP2 or ZeRO-3 gather it anew) runs
    the plan; the graph's own weight replays again afterwards; too many misses in a row drop it."""
    _needs_gpu(device)
    replays = _replays(monkeypatch)
    case = _case(gen, device)
    for _ in range(5):
        _call(case, GRAPHS)
    assert len(replays) == 1
    original = case.weight
    case.weight = original.detach().clone().requires_grad_()
    _assert_same_bits(_copies(_call(case, GRAPHS)), _copies(_call(case, NO_GRAPHS)))
    assert len(replays) == 1
    case.weight = original
    _call(case, GRAPHS)
    assert len(replays) == 2
    case.weight = original.detach().clone().requires_grad_()
    for _ in range(plan_graph._MAX_MISSES):
        _call(case, GRAPHS)
    assert None in plan_graph._ENTRIES.values()  # dropped, and not captured again
    case.weight = original
    for _ in range(3):
        _call(case, GRAPHS)
    assert len(replays) == 2


def test_a_bad_label_still_raises(gen, device):
    _needs_gpu(device)
    case = _case(gen, device)
    for _ in range(5):
        _call(case, GRAPHS)
    assert any(isinstance(v, plan_graph.PlanGraph) for v in plan_graph._ENTRIES.values())
    case.labels[3] = V
    with raises_by_step(IndexError):
        _call(case, GRAPHS)


def test_graphs_off_by_default_turned_off_or_on_the_cpu_make_none(monkeypatch, gen, device):
    runs = record_calls(monkeypatch, one_chunk.OneChunk, "run")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    case = _case(gen, device, dtype, ignore="none")  # the CPU plans a call that walks every row
    tunings = (NO_GRAPHS, Tuning()) if device.type == "cuda" else (NO_GRAPHS, Tuning(), GRAPHS)
    for tuning in tunings:
        for _ in range(6):
            _call(case, tuning)
    assert len(runs) >= 3 * len(tunings) and not plan_graph._ENTRIES  # planned, never captured


def test_at_most_a_few_graphs_are_kept(gen, device):
    _needs_gpu(device)
    for n in range(N, N + plan_graph._MAX_GRAPHS + 2):
        case = make_case(gen, (n,), H, V, dtype=torch.bfloat16, device=device, ignore="mixed")
        for _ in range(4):
            _call(case, GRAPHS)
    graphs = [v for v in plan_graph._ENTRIES.values() if isinstance(v, plan_graph.PlanGraph)]
    assert len(graphs) == plan_graph._MAX_GRAPHS
    plan_graph.forget()
    assert not plan_graph._ENTRIES
