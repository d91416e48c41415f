"""The distillation op's whole eager forward captured as a CUDA graph and replayed
(``Tuning(call_graphs=True)``, ``distillation/graphed_forward.py``). Replays must give the bits of
calls without graphs for new values of both sides, new labels and ignored positions, over the
options, dtypes and gradients wanted, for forwards of one chunk and of several; must never
rewrite a gradient still being accumulated; must hand out a student grad_W of its own; must
never read a teacher weight from where it no
longer is; must leave a forward that waits for its label check to it; and a bad label or
``num_items_in_batch`` must still raise. ``GraphCache``'s bookkeeping:
tests/ops/core/test_call_graph.py. (tests/conftest.py starts every test with no graph.)"""

import gc
import weakref

import pytest
import torch
from op_helpers import (
    assert_same_bits,
    count_replays,
    embedded_head_sums,
    needs_gpu_for_graphs,
    raises_by_step,
    warm_capture_stream,
)

import liger_patch as lp
from liger_patch.ops.core import call_graph
from liger_patch.ops.core.tuning import Tuning

N, HS, HT, V = 45, 64, 48, 320  # N odd; rows of 128 and 96 bytes in bf16
GRAPHS, NO_GRAPHS = Tuning(call_graphs=True), Tuning(call_graphs=False)
STUDENT = ("student_hidden", "student_weight")


def _case(gen, device, dtype=torch.bfloat16, requires_grad=STUDENT) -> dict:
    """Both sides' tensors (the student's leaves in ``requires_grad``) and labels, a third ignored."""
    case = {
        "student_hidden": torch.empty(N, HS, dtype=dtype, device=device),
        "student_weight": torch.empty(V, HS, dtype=dtype, device=device),
        "teacher_hidden": torch.empty(N, HT, dtype=dtype, device=device),
        "teacher_weight": torch.empty(V, HT, dtype=dtype, device=device),
        "labels": torch.empty(N, dtype=torch.long, device=device),
    }
    _fresh(case, gen)
    for name in requires_grad:
        case[name].requires_grad_()
    return case


def _fresh(case: dict, gen) -> None:
    """New values in place, and new ignored positions (at least one label kept)."""
    with torch.no_grad():
        for name, t in case.items():
            if name == "labels":
                labels = torch.randint(0, V, (N,), generator=gen)
                labels[torch.rand(N, generator=gen) < 0.33] = -100
                labels[int(torch.randint(0, N, (), generator=gen))] = 7
                t.copy_(labels)
            else:
                t.copy_(torch.randn(t.shape, generator=gen) * t.shape[1] ** -0.5 * 4)


def _loss(case: dict, tuning: Tuning, **opts):
    return lp.fused_linear_distillation(
        case["student_hidden"], case["student_weight"], case["teacher_hidden"], case["teacher_weight"],
        case["labels"], tuning=tuning, **{"beta": 0.5, "ce_weight": 0.2, **opts},
    )  # fmt: skip


def _call(case: dict, tuning: Tuning, clear: bool = True, **opts) -> tuple:
    """One forward + backward: copies of the loss and of the student's gradients."""
    leaves = [t for t in case.values() if t.requires_grad]
    if clear:
        for t in leaves:
            t.grad = None
    loss = _loss(case, tuning, **opts)
    if loss.requires_grad:
        (loss.sum() * 1.7).backward()
    return (loss.detach().clone(), *(t.grad.clone() for t in leaves))


OPTIONS = {
    "jsd": {},
    "forward_kl_sum": {"beta": 0.0, "reduction": "sum"},
    "reverse_kl_none": {"beta": 1.0, "ce_weight": 0.0, "reduction": "none"},
    "temperature_softcap": {"temperature": 2.0, "student_softcap": 3.0, "teacher_logit_scale": 0.7},
}
CHUNKED = {on: Tuning(call_graphs=on, chunk_rows=16, min_token_chunk_rows=1) for on in (True, False)}


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("needs", [STUDENT, ("student_hidden",), ("student_weight",), ()], ids=str)
def test_replays_give_the_ungraphed_bits(monkeypatch, gen, device, option, needs):
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
    for dtype in (torch.bfloat16, torch.float16):  # fp16: the backward recomputes the logits
        replays.clear()
        case = _case(gen, device, dtype, needs)
        for _ in range(6):
            _fresh(case, gen)
            graphed = _call(case, GRAPHS, **OPTIONS[option])
            assert_same_bits(graphed, _call(case, NO_GRAPHS, **OPTIONS[option]))
        assert len(replays) == 5, dtype  # calls 2-6


def test_a_forward_of_several_chunks_is_graphed_whole(monkeypatch, gen, device):
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
    case = _case(gen, device)
    for _ in range(4):
        _fresh(case, gen)
        assert_same_bits(_call(case, CHUNKED[True]), _call(case, CHUNKED[False]))
    assert len(replays) == 3


def test_accumulated_gradients_equal_the_ungraphed_ones(monkeypatch, gen, device):
    """Gradients summed over three calls: a replay's gradients become the leaves' ``.grad``
    where none was there (the graph's storage), so the calls after it run plainly rather than
    rewrite them."""
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
    case = _case(gen, device)
    for _ in range(3):
        _fresh(case, gen)
        graphed = [_call(case, GRAPHS, clear=i == 0) for i in range(3)]
        plain = [_call(case, NO_GRAPHS, clear=i == 0) for i in range(3)]
        assert_same_bits(graphed[-1], plain[-1])
    # The first round: a plain call, then a capture and two replays (the first call's .grad is
    # its own). Then one replay a round, the first, while no .grad is held.
    assert len(replays) == 2 + 1 + 1


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_replays_student_weight_gradient_is_its_own(monkeypatch, device, tied):
    """As the cross-entropy op's graphs do (tests/ops/cross_entropy/test_call_graph.py), a graph
    of a forward of one chunk leaves the student's grad_W to a GEMM after each replay: a tensor
    of its own, so the micro-batches accumulated into ``.grad`` after it was cleared replay too,
    the sums (a tied student's with its embedding's) are the ungraphed bits, and the graph keeps
    less memory than one grad_W."""
    needs_gpu_for_graphs(device)
    warm_capture_stream(device)
    replays = count_replays(monkeypatch)
    vocab = 4096  # grad_W (8 MiB) above what a pool of small blocks holds (2 MiB segments)
    teacher = {
        "teacher_hidden": torch.empty(N, HT, dtype=torch.bfloat16, device=device),
        "teacher_weight": torch.empty(vocab, HT, dtype=torch.bfloat16, device=device),
        "labels": torch.empty(N, dtype=torch.long, device=device),  # _fresh: below V, so in vocab
    }

    def step(table, weight, tuning, inputs):
        _fresh(teacher, inputs)
        ids = torch.randint(0, vocab, (N,), generator=inputs).to(device)
        hidden = torch.nn.functional.embedding(ids, table) * 1.5
        case = {**teacher, "student_hidden": hidden, "student_weight": weight}
        (_loss(case, tuning) * 1.7).backward()

    sums, held, pools, grad_bytes = embedded_head_sums(device, tied, vocab, step, (GRAPHS, NO_GRAPHS))
    assert len(replays) == 5  # calls 2-6
    assert_same_bits(sums[GRAPHS], sums[NO_GRAPHS])
    assert 0 < held[GRAPHS] < grad_bytes, held  # the graph's own memory, kept between calls
    assert 0 < pools[GRAPHS] < grad_bytes, pools  # and what its pool reserves, free blocks included


def test_a_teacher_weight_elsewhere_is_never_read_from_the_old_address(monkeypatch, gen, device):
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
    case = _case(gen, device)
    for _ in range(3):
        _call(case, GRAPHS)
    assert len(replays) == 2
    moved = dict(case, teacher_weight=torch.randn_like(case["teacher_weight"]))
    for _ in range(3):
        assert_same_bits(_call(moved, GRAPHS), _call(moved, NO_GRAPHS))
    assert len(replays) == 4  # a signature of its own: its second and third calls replay


def test_an_inference_teacher_replays(monkeypatch, gen, device):
    """A teacher run under ``torch.inference_mode`` (TRL's teachers are): its hidden states are
    copied into the graph's buffer like any other, its weight read where it is."""
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
    case = _case(gen, device)
    with torch.inference_mode():
        weight = case["teacher_weight"].clone()
    for _ in range(4):
        _fresh(case, gen)
        with torch.inference_mode():
            hidden = case["teacher_hidden"].clone()
        inferred = {**case, "teacher_hidden": hidden, "teacher_weight": weight}
        assert_same_bits(_call(inferred, GRAPHS), _call(inferred, NO_GRAPHS))
    assert len(replays) == 3


@pytest.mark.parametrize("variant", ["mean", "none", "fp16"])
def test_outputs_held_through_the_next_forward_are_never_rewritten(monkeypatch, gen, device, variant):
    """Two forwards before their backwards: the first's gradients (or, for "none" and fp16,
    whose backward recomputes, its saved row weights) are the graph's storage until its backward
    runs, so the second forward runs plainly; both give the ungraphed bits."""
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
    dtype = torch.float16 if variant == "fp16" else torch.bfloat16
    opts = {"reduction": "none"} if variant == "none" else {}
    case = _case(gen, device, dtype)

    def two_forwards(tuning: Tuning) -> tuple:
        for t in (case["student_hidden"], case["student_weight"]):
            t.grad = None
        losses = [_loss(case, tuning, **opts) for _ in range(2)]
        for loss in reversed(losses):
            (loss.sum() * 1.7).backward()
        return (*(loss.detach() for loss in losses), case["student_hidden"].grad, case["student_weight"].grad)

    for _ in range(3):
        _fresh(case, gen)
        assert_same_bits(two_forwards(GRAPHS), two_forwards(NO_GRAPHS))
    # The first round: a plain forward, then the capture (its replay). The second and third: the
    # first forward replays, the second is refused while the first's outputs are held.
    assert len(replays) == 3


def test_a_graph_keeps_no_weight_alive(monkeypatch, gen, device):
    """The graph reads the weights where they were at its capture and holds neither: a weight
    made anew at each call (here dropped by the caller) is freed."""
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
    case = _case(gen, device)
    for _ in range(2):
        _call(case, GRAPHS)
    assert len(replays) == 1
    weights = [weakref.ref(case.pop(name)) for name in ("student_weight", "teacher_weight")]
    gc.collect()
    assert all(w() is None for w in weights)


def test_autocast_copies_of_the_weights_replay(monkeypatch, gen, device):
    """Under autocast the functional casts fp32 weights to new bf16 copies at every call; freed
    after each, the next call's copies come back to their addresses and replay the graph."""
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
    case = _case(gen, device, torch.float32)
    for _ in range(5):
        _fresh(case, gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert_same_bits(_call(case, GRAPHS), _call(case, NO_GRAPHS))
    assert replays


def test_a_graph_captured_under_inference_mode_is_not_replayed_outside_it(monkeypatch, gen, device):
    """Its buffers are inference tensors, which a call outside inference mode could not write:
    inference mode is part of the signature."""
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
    case = _case(gen, device, requires_grad=())
    for _ in range(2):
        with torch.inference_mode():
            _call(case, GRAPHS)
    assert len(replays) == 1
    for _ in range(3):
        _fresh(case, gen)
        with torch.no_grad():
            assert_same_bits(_call(case, GRAPHS), _call(case, NO_GRAPHS))
    assert len(replays) == 3  # a signature of its own: its second and third calls


def test_a_bad_label_still_raises(monkeypatch, gen, device):
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
    case = _case(gen, device)
    for _ in range(2):
        _call(case, GRAPHS)
    case["labels"][3] = V
    with raises_by_step(IndexError, match=f"label {V} at flat position 3 is outside"):
        _call(case, GRAPHS)
    assert len(replays) == 2


def test_num_items_in_batch_tensors_replay_and_a_bad_one_raises(monkeypatch, gen, device):
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
    case = _case(gen, device)
    for items in (30.0, 17.0, 41.0):
        n_items = torch.tensor(items, device=device)
        graphed = _call(case, GRAPHS, num_items_in_batch=n_items)
        assert_same_bits(graphed, _call(case, NO_GRAPHS, num_items_in_batch=n_items))
    assert len(replays) == 2
    with raises_by_step(ValueError, match="num_items_in_batch must be finite and >= 0, got -3"):
        _call(case, GRAPHS, num_items_in_batch=torch.tensor(-3.0, device=device))
    assert len(replays) == 3


def test_a_bias_or_a_forward_that_reads_its_check_first_is_not_graphed(monkeypatch, gen, device):
    needs_gpu_for_graphs(device)
    replays = count_replays(monkeypatch)
    case = _case(gen, device)
    bias = torch.randn(V, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        _call(case, Tuning(call_graphs=True, wait_to_skip_gflop=0))
        lp.fused_linear_distillation(
            case["student_hidden"], case["student_weight"], case["teacher_hidden"], case["teacher_weight"],
            case["labels"], bias, beta=0.5, tuning=GRAPHS,
        ).backward()  # fmt: skip
    assert not replays and not call_graph._GRAPHS.entries


def test_graphs_off_by_default_or_on_the_cpu_make_none(gen, device):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    case = _case(gen, device, dtype)
    tunings = (NO_GRAPHS, Tuning()) if device.type == "cuda" else (NO_GRAPHS, Tuning(), GRAPHS)
    for tuning in tunings:
        for _ in range(3):
            _call(case, tuning)
    assert not call_graph._GRAPHS.entries
