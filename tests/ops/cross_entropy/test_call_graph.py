"""``call_graph`` and ``graphed_forward``: the whole eager forward captured as a CUDA graph and
replayed. Replays must give the bits of calls without graphs (``Tuning(call_graphs=False)``) for
new values, labels and ignored positions of the signature; must never rewrite an output that
something still holds (a leaf's kept gradient, a gradient being accumulated); must hand out a
weight's gradient of its own (accumulated micro-batches and tied heads replay); must not run while the
weight is elsewhere or on another stream; must stay out of a caller's own capture; must leave a
forward that waits for its label check to it; and a bad label or ``num_items_in_batch`` must
still raise, with its message. ``GraphCache``'s bookkeeping (when to capture, refuse, drop and
evict; one caller at a time) is tested with stand-in graphs in tests/ops/core/test_call_graph.py.

A signature's calls: the first runs plainly, noting where the weight is; the second captures the
graph and replays it for itself, as do the later ones. (tests/conftest.py starts every test with
no plan and no graph.) Graphs need a GPU; on the CPU nothing is captured."""

import pytest
import torch
from op_helpers import (
    assert_same_bits,
    call_op,
    call_raw,
    capture_step,
    checks_taken_ahead,
    count_replays,
    embedded_head_sums,
    fresh_values,
    make_case,
    needs_gpu_for_graphs,
    raises_by_step,
    record_calls,
    warm_capture_stream,
)

from liger_patch.ops.core import call_graph, early_checks
from liger_patch.ops.core.tuning import Tuning
from liger_patch.ops.cross_entropy import one_chunk
from liger_patch.ops.cross_entropy.functional import check_labels_ahead

H, V, N = 64, 320, 45  # 16-byte aligned rows; N odd, not a multiple of any tile
GRAPHS, NO_GRAPHS = Tuning(call_graphs=True), Tuning(call_graphs=False)


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
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
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
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
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
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
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
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
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


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_replays_weight_gradient_is_its_own(monkeypatch, device, tied):
    """A weight's gradient from a replay is a tensor of its own, not the graph's storage (the
    graph leaves it to a GEMM after the replay, its warm-up too), so a replay may run while the last one's is
    kept: the first micro-batch after the gradients were cleared replays and its gradient
    becomes ``.grad``, and the micro-batches accumulated into it replay too (were it the
    graph's storage, they would run plainly). The sums are the bits of calls without graphs,
    and a graph keeps less memory than one grad_W (it would keep one more, also for a head tied
    to its embedding, whose gradients are summed into a new tensor). The hidden states are an
    embedding's rows, not a leaf whose ``.grad`` would hold the graph's grad_h."""
    needs_gpu_for_graphs(device)
    warm_capture_stream(device)
    replays = count_replays(monkeypatch)

    def step(table, weight, tuning, gen):
        ids = torch.randint(0, table.shape[0], (N,), generator=gen).to(device)
        labels = torch.randint(0, weight.shape[0], (N,), generator=gen)
        labels[torch.rand(N, generator=gen) < 0.3] = -100
        hidden = torch.nn.functional.embedding(ids, table) * 1.5
        (call_raw(hidden, weight, labels.to(device), tuning=tuning) * 1.7).backward()

    # grad_W (4096 x 1024 bf16, 8 MiB) above what a pool of small blocks holds (2 MiB segments)
    sums, held, pools, grad_bytes = embedded_head_sums(device, tied, 4096, step, (GRAPHS, NO_GRAPHS))
    assert len(replays) == 5  # calls 2-6
    assert_same_bits(sums[GRAPHS], sums[NO_GRAPHS])
    assert 0 < held[GRAPHS] < grad_bytes, held  # the graph's own memory, kept between calls
    assert 0 < pools[GRAPHS] < grad_bytes, pools  # and what its pool reserves, free blocks included


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
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
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
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
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
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
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
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
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
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
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
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
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
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
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


def test_a_capture_leaves_no_warm_up_memory_cached_for_its_stream(monkeypatch, gen, device):
    """The warm-up before a capture allocates what the forward does (here 60 MiB and more); it
    allocates from the graph's pool, which the capture then reuses: nothing of it stays cached
    for the side stream outside the pool (cuBLAS's workspace, made before, aside)."""
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
    case = make_case(gen, (512,), 1024, 30000, dtype=torch.bfloat16, device=device, ignore="mixed")
    for _ in range(4):  # the first notes, the second captures (94 GFLOP: none waits to skip)
        _call(case, GRAPHS)
    assert len(replays) == 3
    side = next(iter(call_graph._SIDE_STREAMS.values())).cuda_stream
    cached = sum(
        block["size"]
        for segment in torch.cuda.memory_snapshot()
        if segment["stream"] == side and segment["segment_pool_id"] == (0, 0)
        for block in segment["blocks"]
        if block["state"] == "inactive"
    )
    assert cached < 16 * 2**20, cached


def test_at_most_a_few_graphs_are_kept(gen, device):
    needs_gpu_for_graphs(device)
    for n in range(N, N + call_graph._MAX_GRAPHS + 2):
        case = make_case(gen, (n,), H, V, dtype=torch.bfloat16, device=device, ignore="mixed")
        for _ in range(4):
            _call(case, GRAPHS)
    assert len(_graphs()) == call_graph._MAX_GRAPHS
    call_graph.forget()
    assert not call_graph._GRAPHS.entries
