"""``call_graph`` and ``graphed_forward``: the whole eager forward captured as a CUDA graph and
replayed. Replays must give the bits of calls without graphs (``Tuning(call_graphs=False)``) for
new values, labels and ignored positions of the signature; must never rewrite an output that
something still holds (a kept gradient, a gradient being accumulated); must not run while the
weight is elsewhere or on another stream; must stay out of a caller's own capture; must leave a
forward that waits for its label check to it; and a bad label or ``num_items_in_batch`` must
still raise, with its message. ``GraphCache``'s bookkeeping (when to capture, refuse, drop and
evict; one caller at a time) is tested with stand-in graphs on any device.

A signature's calls: the first runs plainly, noting where the weight is; the second captures the
graph and replays it for itself, as do the later ones. (tests/conftest.py starts every test with
no plan and no graph.) Graphs need a GPU; on the CPU nothing is captured."""

import threading
import time

import pytest
import torch
from op_helpers import (
    assert_same_bits,
    call_op,
    call_raw,
    capture_step,
    checks_taken_ahead,
    fresh_values,
    make_case,
    raises_by_step,
    record_calls,
)

from liger_patch.ops.core import early_checks
from liger_patch.ops.core.tuning import Tuning
from liger_patch.ops.cross_entropy import call_graph, one_chunk
from liger_patch.ops.cross_entropy.call_graph import GraphCache
from liger_patch.ops.cross_entropy.functional import check_labels_ahead

H, V, N = 64, 320, 45  # 16-byte aligned rows; N odd, not a multiple of any tile
GRAPHS, NO_GRAPHS = Tuning(call_graphs=True), Tuning(call_graphs=False)


def _replays(monkeypatch) -> list:
    """One entry per replay begun (counted before it runs: a replay may raise a label check's
    error; nothing of its results kept: a kept output would stop the next replay)."""
    replays, real = [], call_graph.CallGraph.replay

    def spy(self, inputs):
        replays.append(None)
        return real(self, inputs)

    monkeypatch.setattr(call_graph.CallGraph, "replay", spy)
    return replays


def _needs_gpu(device) -> None:
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU: this runs in tests/gpu_suite.sh")


def _case(gen, device, dtype=torch.bfloat16, requires_grad=("hidden", "weight"), ignore="mixed"):
    return make_case(gen, (N,), H, V, dtype=dtype, device=device, ignore=ignore, requires_grad=requires_grad)


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


def _graphs() -> list:
    return call_graph._GRAPHS.graphs()


def _graphed_case(monkeypatch, gen, device):
    """A case whose signature has its graph, replayed once (by its second call, which captured
    it), and the replays' record (``_replays``) from then on."""
    _needs_gpu(device)
    replays = _replays(monkeypatch)
    case = _case(gen, device)
    for _ in range(2):
        _call(case, GRAPHS)
    assert len(replays) == 1 and len(_graphs()) == 1
    return case, replays


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
            fresh_values(case, gen, reignore=True)
            graphed = _copies(_call(case, GRAPHS, **OPTIONS[option]))
            assert_same_bits(graphed, _copies(_call(case, NO_GRAPHS, **OPTIONS[option])))
        assert len(replays) == 6, dtype  # calls 2-7


def test_a_held_output_is_never_rewritten(monkeypatch, gen, device):
    """The results of some calls are kept through the next call (as a caller keeps what it
    logs): that call runs plainly, the one after replays again, and every kept tensor keeps
    its values."""
    _needs_gpu(device)
    replays = _replays(monkeypatch)
    case = _case(gen, device)
    kept, replayed = None, []
    for i in range(8):
        fresh_values(case, gen, reignore=True)
        before = len(replays)
        result = _call(case, GRAPHS)
        replayed.append(len(replays) > before)
        reference = _copies(_call(case, NO_GRAPHS))
        assert_same_bits(_copies(result), reference)
        if kept is not None:
            assert_same_bits(_copies(kept[0]), kept[1])
            kept = None
        if i % 3 == 1:
            kept = (result, reference)
        del result
    # 0 runs plainly; 1 captures and replays (kept); 2 runs plainly; 4 (kept) and 7 replay.
    assert replayed == [False, True, False, True, True, False, True, True]


def test_accumulated_gradients_equal_the_plans(monkeypatch, gen, device):
    """Gradients accumulated over calls (no clearing between them), graphed or not: the same bits."""
    _needs_gpu(device)
    replays = _replays(monkeypatch)
    case = _case(gen, device)
    start = {name: t.detach().clone() for name, t in case.tensors().items()}
    labels = case.labels.clone()
    sums = {}
    for tuning in (GRAPHS, NO_GRAPHS):
        with torch.no_grad():
            for name, t in case.tensors().items():
                t.copy_(start[name])  # each run from the same values: fresh_values scales by their spread
        case.labels.copy_(labels)
        for t in case.grad_leaves().values():
            t.grad = None
        for step in range(8):
            fresh_values(case, torch.Generator().manual_seed(step), reignore=True)
            _call(case, tuning, clear=False)
        sums[tuning] = tuple(t.grad.clone() for t in case.grad_leaves().values())
    assert_same_bits(sums[GRAPHS], sums[NO_GRAPHS])
    assert len(replays) >= 2  # the graphed run's later calls replayed into the sums


def test_no_replay_while_the_weight_is_elsewhere(monkeypatch, gen, device):
    """A weight of the same signature at another address (as FSDP2 or ZeRO-3 gather it anew, with
    other values) runs the plan; the graph's own weight replays again afterwards; too many misses
    in a row drop the graph for good."""
    case, replays = _graphed_case(monkeypatch, gen, device)
    original = case.weight

    def moved():
        with torch.no_grad():
            return (original + 0.05 * torch.randn_like(original)).requires_grad_()

    case.weight = moved()
    assert_same_bits(_copies(_call(case, GRAPHS)), _copies(_call(case, NO_GRAPHS)))
    assert len(replays) == 1
    case.weight = original
    _call(case, GRAPHS)
    assert len(replays) == 2
    elsewhere = []  # kept alive, so that each call finds the weight somewhere new
    for _ in range(call_graph._MAX_MISSES):
        case.weight = moved()
        elsewhere.append(case.weight)
        _call(case, GRAPHS)
    assert not _graphs()
    case.weight = original
    for _ in range(3):
        _call(case, GRAPHS)
    assert len(replays) == 2 and not _graphs()


def test_no_replay_on_another_stream(monkeypatch, gen, device):
    """A graph replays only on the stream it was captured for: calls of its signature on another
    stream run the plan (and give its bits), and the graph serves its own stream again after."""
    case, replays = _graphed_case(monkeypatch, gen, device)
    other = torch.cuda.Stream(device=device)
    other.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(other):
        for _ in range(3):  # the replay count below is the check; the bits show the call ran right
            fresh_values(case, gen, reignore=True)
            graphed = _copies(_call(case, GRAPHS))
            assert_same_bits(graphed, _copies(_call(case, NO_GRAPHS)))
    torch.cuda.current_stream(device).wait_stream(other)
    assert len(replays) == 1
    _call(case, GRAPHS)
    assert len(replays) == 2


def test_a_callers_own_capture_runs_the_plan_inside_it(monkeypatch, gen, device):
    """With a graph of the signature already kept, a caller capturing the op in a graph of its own
    (torch.cuda.graph, reduce-overhead) records the op's launches, not a replay of ours: its
    replays follow new labels and values as the op called eagerly does."""
    case, replays = _graphed_case(monkeypatch, gen, device)
    static = {"hidden": case.hidden, "weight": case.weight, "labels": case.labels}

    def step():
        loss = call_op(case, tuning=GRAPHS)
        (loss * 1.7).backward()
        return loss.detach()

    replay = capture_step(step, static, ("hidden", "weight"))
    for _ in range(3):
        fresh_values(case, gen, reignore=True)
        values = {name: t.detach().clone() for name, t in static.items()}
        (loss,), grads = replay(values)
        # The eager reference on copies: the captured backward writes the static leaves' .grad.
        hidden, weight = (values[n].clone().requires_grad_() for n in ("hidden", "weight"))
        eager = call_raw(hidden, weight, values["labels"], ignore_index=case.ignore_index, tuning=NO_GRAPHS)
        (eager * 1.7).backward()
        torch.testing.assert_close(loss, eager.detach(), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(grads["hidden"], hidden.grad, rtol=2e-2, atol=1e-4)
        torch.testing.assert_close(grads["weight"], weight.grad, rtol=2e-2, atol=1e-4)
    assert len(replays) == 1  # none inside the capture


def test_a_bad_label_still_raises(monkeypatch, gen, device):
    case, replays = _graphed_case(monkeypatch, gen, device)
    case.labels[3] = V
    with raises_by_step(IndexError):
        _call(case, GRAPHS)
    assert len(replays) == 2


def test_a_changed_gemm_setting_is_a_signature_of_its_own(monkeypatch, gen, device):
    """cuBLAS reads TF32 at every launch and a graph keeps it as captured: calls under each
    setting replay a graph of their own, with the bits of the ungraphed call under it."""
    _needs_gpu(device)
    replays = _replays(monkeypatch)
    case = _case(gen, device, torch.float32)
    prior = torch.backends.cuda.matmul.allow_tf32
    try:
        for tf32 in (False, False, True, True, False):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            fresh_values(case, gen, reignore=True)
            graphed = _copies(_call(case, GRAPHS))
            assert_same_bits(graphed, _copies(_call(case, NO_GRAPHS)))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prior
    assert len(replays) == 3  # calls 2 and 4 capture and replay, call 5 replays the first graph


def test_hidden_states_off_a_new_buffers_alignment_are_never_graphed(monkeypatch, gen, device):
    """cuBLASLt picks kernels by pointer alignment (up to 256 bytes): a view 64 bytes into a
    buffer runs plainly, with the bits of the ungraphed call."""
    _needs_gpu(device)
    replays = _replays(monkeypatch)
    case = _case(gen, device)
    base = torch.empty(N * H + 32, dtype=case.hidden.dtype, device=device)
    for _ in range(3):
        fresh_values(case, gen, reignore=True)
        with torch.no_grad():
            base[32:].copy_(case.hidden.reshape(-1))
        hidden = base[32:].view(N, H).requires_grad_()
        outs = {}
        for tuning in (GRAPHS, NO_GRAPHS):
            hidden.grad = case.weight.grad = None
            loss = call_raw(hidden, case.weight, case.labels, ignore_index=case.ignore_index, tuning=tuning)
            (loss * 1.7).backward()
            outs[tuning] = (loss.detach().clone(), hidden.grad.clone(), case.weight.grad.clone())
        assert_same_bits(outs[GRAPHS], outs[NO_GRAPHS])
    assert not replays and not call_graph._GRAPHS.entries


def test_a_forward_of_several_chunks_is_graphed_whole(monkeypatch, gen, device):
    """A forward that no plan serves (three token chunks here) is captured whole as well."""
    _needs_gpu(device)
    replays = _replays(monkeypatch)
    case = _case(gen, device)
    chunked = {on: Tuning(call_graphs=on, chunk_rows=16, min_token_chunk_rows=1) for on in (True, False)}
    for _ in range(4):
        fresh_values(case, gen, reignore=True)
        graphed = _copies(_call(case, chunked[True]))
        assert_same_bits(graphed, _copies(_call(case, chunked[False])))
    assert len(replays) == 3


def test_num_items_in_batch_tensors_replay_and_a_bad_one_raises(monkeypatch, gen, device):
    """The divisor is an input of the graph: new values replay with the right loss; a negative
    one raises with its value, as without graphs."""
    _needs_gpu(device)
    replays = _replays(monkeypatch)
    case = _case(gen, device)
    for count in (37, 11, 90):
        items = torch.tensor(count, device=device)
        fresh_values(case, gen, reignore=True)
        graphed = _copies(_call(case, GRAPHS, num_items_in_batch=items))
        assert_same_bits(graphed, _copies(_call(case, NO_GRAPHS, num_items_in_batch=items)))
    assert len(replays) == 2
    with raises_by_step(ValueError, match="num_items_in_batch must be finite and >= 0, got -3"):
        _call(case, GRAPHS, num_items_in_batch=torch.tensor(-3, device=device))
    assert len(replays) == 3


def test_a_num_items_tensor_on_the_cpu_is_never_graphed(monkeypatch, gen, device):
    """Its copy to the GPU could not be captured: such calls run plainly, with the same bits."""
    _needs_gpu(device)
    replays = _replays(monkeypatch)
    case = _case(gen, device)
    for count in (29, 31, 33):
        fresh_values(case, gen, reignore=True)
        graphed = _copies(_call(case, GRAPHS, num_items_in_batch=torch.tensor(count)))
        assert_same_bits(graphed, _copies(_call(case, NO_GRAPHS, num_items_in_batch=torch.tensor(count))))
    assert not replays and not call_graph._GRAPHS.entries


def test_a_bad_labels_error_after_a_replay_names_it(monkeypatch, gen, device):
    case, replays = _graphed_case(monkeypatch, gen, device)
    case.labels[3] = V + 2
    with raises_by_step(IndexError, match=f"label {V + 2} at flat position 3 is outside"):
        _call(case, GRAPHS)
    assert len(replays) == 2


def test_kept_losses_keep_their_values_and_hold_back_no_replay(monkeypatch, gen, device):
    """A caller keeps the loss and z-loss it logs: a replay hands out copies of them, so kept
    ones neither stop the next replay nor change."""
    _needs_gpu(device)
    replays = _replays(monkeypatch)
    case = _case(gen, device)
    opts = {"z_loss_scale": 1e-2, "return_z_loss": True}
    kept = []
    for _ in range(5):
        fresh_values(case, gen, reignore=True)
        (loss, z_loss), _ = _call(case, GRAPHS, **opts)
        (ref_loss, ref_z), _ = _call(case, NO_GRAPHS, **opts)
        kept.append(((loss, z_loss), (ref_loss.detach().clone(), ref_z.detach().clone())))
    assert len(replays) == 4
    for graphed, reference in kept:
        assert_same_bits(tuple(t.detach() for t in graphed), reference)


def test_a_check_begun_ahead_is_taken_by_a_replay(monkeypatch, gen, device):
    """A patched model begins its labels' check before its body: a replay takes that check (its
    answer, no copy of the graph's) and leaves none behind; a bad label still raises."""
    case, replays = _graphed_case(monkeypatch, gen, device)
    taken = checks_taken_ahead(monkeypatch)
    for _ in range(2):
        fresh_values(case, gen, reignore=True)
        check_labels_ahead(case.labels, V, ignore_index=case.ignore_index, tuning=GRAPHS)
        _call(case, GRAPHS)
    assert taken == [True, True] and len(replays) == 3 and not early_checks.waiting()
    case.labels[5] = -7
    check_labels_ahead(case.labels, V, ignore_index=case.ignore_index, tuning=GRAPHS)
    with raises_by_step(IndexError, match="label -7 at flat position 5 is outside"):
        _call(case, GRAPHS)
    assert len(replays) == 4


def test_a_forward_that_reads_its_check_first_is_not_graphed(monkeypatch, gen, device):
    """A forward that waits for its label check (to skip the ignored rows) takes decisions from
    the GPU's answer: never graphed."""
    _needs_gpu(device)
    replays = _replays(monkeypatch)
    case = _case(gen, device)
    for _ in range(4):
        fresh_values(case, gen, reignore=True)
        _call(case, Tuning(call_graphs=True, wait_to_skip_gflop=0))
    assert not replays and not call_graph._GRAPHS.entries


def test_graphs_off_by_default_turned_off_or_on_the_cpu_make_none(monkeypatch, gen, device):
    runs = record_calls(monkeypatch, one_chunk.OneChunk, "run")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    case = _case(gen, device, dtype, ignore="none")  # the CPU plans a call that walks every row
    tunings = (NO_GRAPHS, Tuning()) if device.type == "cuda" else (NO_GRAPHS, Tuning(), GRAPHS)
    for tuning in tunings:
        for _ in range(6):
            _call(case, tuning)
    assert len(runs) >= 3 * len(tunings) and not call_graph._GRAPHS.entries  # planned, never captured


def test_at_most_a_few_graphs_are_kept(gen, device):
    _needs_gpu(device)
    for n in range(N, N + call_graph._MAX_GRAPHS + 2):
        case = make_case(gen, (n,), H, V, dtype=torch.bfloat16, device=device, ignore="mixed")
        for _ in range(4):
            _call(case, GRAPHS)
    assert len(_graphs()) == call_graph._MAX_GRAPHS
    call_graph.forget()
    assert not call_graph._GRAPHS.entries


# ``GraphCache``'s bookkeeping with stand-ins: a plan that counts its runs, graphs that count their
# replays, and "streams" that are plain values.


class _Plan:
    def __init__(self) -> None:
        self.runs = 0

    def run(self, *inputs):
        self.runs += 1
        return "run"


class _Graph:
    """A stand-in graph: serves its stream and weight unless ``held``; ``fail`` makes capture raise."""

    made: list = []
    fail: BaseException | None = None

    def __init__(self, plan, weight, stream, inputs) -> None:
        if _Graph.fail is not None:
            raise _Graph.fail
        self.plan, self.weight, self.stream, self.held, self.replays = plan, weight, stream, False, 0
        self.weight_ptr = weight.data_ptr()
        _Graph.made.append(self)

    def serves(self, weight, stream) -> bool:
        return weight.data_ptr() == self.weight.data_ptr() and stream == self.stream and not self.held

    def replay(self, inputs):
        self.replays += 1
        return "replay"


@pytest.fixture
def cache():
    _Graph.made, _Graph.fail = [], None
    return GraphCache(_Graph)


def _weight() -> torch.Tensor:
    """A stand-in weight: only its address is read (the test keeps it alive while it matters)."""
    return torch.empty(8)


def _calls(cache, plan, key, weight, n, stream="s0") -> list:
    return [cache.run(plan, key, weight, stream, (None,)) for _ in range(n)]


def test_the_second_call_at_one_address_captures_and_replays(cache):
    """The capturing call runs nothing of its own before the capture: it replays the new graph."""
    plan, weight = _Plan(), _weight()
    assert _calls(cache, plan, "k", weight, 5) == ["run", "replay", "replay", "replay", "replay"]
    assert plan.runs == 1 and len(_Graph.made) == 1 and _Graph.made[0].stream == "s0"


def test_a_weight_that_moves_at_every_call_is_never_captured(cache):
    plan, weights = _Plan(), [_weight() for _ in range(6)]
    for weight in weights:
        _calls(cache, plan, "k", weight, 1)
    assert plan.runs == 6 and not _Graph.made


def test_a_weight_that_moved_and_stays_is_captured_again_there(cache):
    """A model loaded anew: its weight's new address, found by two calls in a row, gets a graph of
    its own, the old one dropped; a weight moving back and forth between two places keeps one."""
    plan, old, new = _Plan(), _weight(), _weight()
    _calls(cache, plan, "k", old, 2)
    assert _calls(cache, plan, "k", new, 3) == ["run", "replay", "replay"]
    assert len(_Graph.made) == 2 and cache.graphs() == [_Graph.made[1]]
    assert [_calls(cache, plan, "k", w, 1)[0] for w in (old, new, old, new)] == ["run", "replay"] * 2


def test_refusals_in_a_row_drop_the_graph_for_good(cache):
    plan, weight = _Plan(), _weight()
    _calls(cache, plan, "k", weight, 3)
    assert _calls(cache, plan, "k", weight, call_graph._MAX_MISSES - 1, stream="s1") == ["run"] * 7
    assert _calls(cache, plan, "k", weight, 1) == ["replay"]  # a replay ends the run of refusals
    assert _calls(cache, plan, "k", weight, call_graph._MAX_MISSES, stream="s1") == ["run"] * 8
    assert not cache.graphs()
    assert _calls(cache, plan, "k", weight, 4) == ["run"] * 4 and len(_Graph.made) == 1


def test_a_held_output_refuses_the_replay(cache):
    plan, weight = _Plan(), _weight()
    _calls(cache, plan, "k", weight, 2)
    _Graph.made[0].held = True
    assert _calls(cache, plan, "k", weight, 2) == ["run", "run"]
    _Graph.made[0].held = False
    assert _calls(cache, plan, "k", weight, 1) == ["replay"]


def test_the_least_recently_replayed_graph_makes_room_and_may_come_back(cache):
    plans, weight = {k: _Plan() for k in range(call_graph._MAX_GRAPHS + 1)}, _weight()
    for k in range(call_graph._MAX_GRAPHS):
        _calls(cache, plans[k], k, weight, 2)
    for k in (0, 2, 3):  # 1 is the least recently replayed
        _calls(cache, plans[k], k, weight, 1)
    _calls(cache, plans[4], 4, weight, 2)
    assert {g.plan for g in cache.graphs()} == {plans[k] for k in (0, 2, 3, 4)}
    assert _calls(cache, plans[1], 1, weight, 3) == ["run", "replay", "replay"]  # captured again
    assert len(cache.graphs()) == call_graph._MAX_GRAPHS and plans[0] not in {g.plan for g in cache.graphs()}


def test_signatures_taking_turns_stop_capturing(cache):
    """More signatures than graphs, each called in turn: each is captured at most a few times."""
    plans, weight = {k: _Plan() for k in range(call_graph._MAX_GRAPHS + 1)}, _weight()
    for _ in range(4 * call_graph._MAX_CAPTURES):
        for k, plan in plans.items():
            _calls(cache, plan, k, weight, 2)
    assert len(_Graph.made) <= len(plans) * call_graph._MAX_CAPTURES


def test_a_failed_capture_leaves_the_signature_to_its_plan(cache):
    plan, weight = _Plan(), _weight()
    _Graph.fail = RuntimeError("operation not permitted when stream is capturing")
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        assert _calls(cache, plan, "k", weight, 2) == ["run", "run"]  # the call's own result
    _Graph.fail = None
    assert _calls(cache, plan, "k", weight, 4) == ["run"] * 4 and not _Graph.made


def test_running_out_of_memory_in_a_capture_drops_every_graph(cache):
    weight = _weight()
    _calls(cache, _Plan(), "a", weight, 2)
    assert len(cache.graphs()) == 1
    _Graph.fail = torch.cuda.OutOfMemoryError("CUDA out of memory")
    assert _calls(cache, _Plan(), "b", weight, 2) == ["run", "run"]
    assert not cache.graphs()


def test_a_plan_made_anew_is_not_replayed_from_the_old_ones_graph(cache):
    weight, old, new = _weight(), _Plan(), _Plan()
    _calls(cache, old, "k", weight, 2)
    assert _calls(cache, new, "k", weight, 3) == ["run", "replay", "replay"]
    assert cache.graphs()[0].plan is new


def test_the_signatures_noted_are_bounded(cache):
    for k in range(call_graph._MAX_ENTRIES + 5):
        _calls(cache, _Plan(), k, _weight(), 1)
    assert len(cache.entries) == call_graph._MAX_ENTRIES and 0 not in cache.entries


def test_a_signature_in_use_outlives_a_stream_of_new_ones(cache):
    """Dynamic padding brings a new signature at every call: the one called at every step keeps
    its graph, and one whose capture failed is not retried."""
    plan, weight, failing = _Plan(), _weight(), _Plan()
    _calls(cache, plan, "busy", weight, 2)
    _Graph.fail = RuntimeError("not capturable")
    with pytest.warns(RuntimeWarning):
        _calls(cache, failing, "failed", weight, 2)
    _Graph.fail = None
    for k in range(3 * call_graph._MAX_ENTRIES):
        _calls(cache, _Plan(), ("padded", k), _weight(), 1)
        if k % 64 == 0:
            assert _calls(cache, plan, "busy", weight, 1) == ["replay"]
            _calls(cache, failing, "failed", weight, 2)
    assert len(_Graph.made) == 1 and failing.runs == 2 + 2 * 12


def test_a_graph_captured_by_another_thread_meanwhile_is_kept(cache):
    """Call B looks (nothing known of its signature), runs its plan; meanwhile calls A of the same
    signature note the weight and capture; B's bookkeeping after its run must keep A's graph."""
    weight = _weight()

    class Racing(_Plan):
        def run(self, *inputs):
            if self.runs == 0:  # B's run: A's two calls inside it
                self.runs += 1
                assert _calls(cache, self, "k", weight, 2) == ["run", "replay"]
            return super().run(*inputs)

    plan = Racing()
    assert _calls(cache, plan, "k", weight, 1) == ["run"]  # B, with A inside
    assert len(cache.graphs()) == 1 and _calls(cache, plan, "k", weight, 1) == ["replay"]


def test_one_caller_at_a_time_checks_and_replays(cache):
    """Threads calling one signature: no replay starts while another is between its check that
    nothing holds the outputs and its replay (a graph marks itself held for that time)."""
    plan, weight = _Plan(), _weight()
    _calls(cache, plan, "k", weight, 2)
    graph, overlaps = _Graph.made[0], []
    serves = graph.serves

    def slow_serves(weight, stream):  # another thread runs between this check and the replay
        ok = serves(weight, stream)
        time.sleep(1e-4)
        return ok

    def replay(inputs):
        overlaps.append(graph.held)
        graph.held = True
        time.sleep(1e-4)
        graph.held, graph.replays = False, graph.replays + 1
        return "replay"

    graph.serves, graph.replay = slow_serves, replay
    threads = [threading.Thread(target=_calls, args=(cache, plan, "k", weight, 50)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not any(overlaps) and graph.replays == 1 + 200 and plan.runs == 1
