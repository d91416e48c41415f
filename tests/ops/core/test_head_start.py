"""The first token chunk's logits GEMM begun before the label check's host sync
(``ops/core/head_start.py``), over the kept rows where the forward expects to skip the ignored
ones: it is launched before the check's values are waited for, the chunk it begins is finished
from the same buffers, and the op's results are bit for bit those without it, whether the call
then skips the ignored rows (the head is used) or walks every row (it is dropped).
On CPU the Triton kernels run under the interpreter (``TRITON_INTERPRET=1``), in fp32 with
16-row GEMM tiles; on CUDA in bf16 with 128-row tiles: row counts are given in tiles (``A``)."""

import dataclasses
import math

import pytest
import torch
from op_helpers import call_op, make_case

from liger_patch.ops.core import gemm, head_start, validation
from liger_patch.ops.core.tuning import Tuning

pytest.importorskip("liger_patch.ops.core.triton.logits")

H, V = 16, 64
ROW_FLOP = 2 * H * V  # logits GEMM flops of one row
A = 128 if torch.cuda.is_available() else 16  # the fused GEMM's row tile (head_start's alignment)
DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float32  # what the fused GEMM takes


def _case(gen, device, n: int, **kwargs):
    kwargs.setdefault("dtype", DTYPE)
    return make_case(gen, (n,), H, V, device=device, **kwargs)


def _tuning(chunk: int, head_rows: int | None, skip_share: float = 0.05) -> Tuning:
    """Chunks of ``chunk`` rows; a head start of about ``head_rows`` rows (None: off)."""
    gflop = 0.0 if head_rows is None else head_rows * ROW_FLOP / 1e9
    return Tuning(
        chunk_rows=chunk,
        min_token_chunk_rows=0,
        skip_ignored_share=skip_share,
        wait_to_skip_gflop=0.0,
        head_start_gflop=gflop,
    )


def _run(case, tuning: Tuning, **opts):
    for t in (case.hidden, case.weight, case.bias):
        if t is not None:
            t.grad = None
    out = call_op(case, backend="triton", tuning=tuning, memory_budget=1 << 30, **opts)
    loss = out[0] if isinstance(out, tuple) else out
    (loss * torch.linspace(0.5, 1.5, loss.numel(), device=loss.device).reshape(loss.shape)).sum().backward()
    grads = [t.grad.clone() for t in (case.hidden, case.weight, case.bias) if t is not None]
    return [t.detach().clone() for t in (out if isinstance(out, tuple) else (out,))], grads


@pytest.fixture
def launches(monkeypatch):
    """The order of the fused logits GEMM's launches (their row counts) and the label check's
    wait, as ("gemm", rows) and ("wait",) events."""
    events = []
    real_result = validation.ValueCheck.result

    def result(self, *args, **kwargs):
        events.append(("wait",))
        return real_result(self, *args, **kwargs)

    monkeypatch.setattr(validation.ValueCheck, "result", result)
    real = gemm.chunk_logits  # every fused logits GEMM of the op: token chunks and the head start

    def spy(h, *args, **kwargs):
        logits, partials = real(h, *args, **kwargs)
        if partials is not None:
            events.append(("gemm", h.shape[0]))
        return logits, partials

    monkeypatch.setattr(gemm, "chunk_logits", spy)
    return events


@pytest.mark.parametrize("ignore", ["none", "first", "every_other"])
@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"bias": True},
        {"label_smoothing": 0.1, "softcap": 3.0, "z_loss_scale": 1e-3, "return_z_loss": True},
    ],
    ids=["plain", "bias", "options"],
)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_bit_equal_to_the_op_without_it(gen, device, ignore, opts, reduction):
    """Heads of one and two row tiles of three-tile chunks (the chunk finished by a second launch)
    and of a whole chunk, against no head start: the same bits. 'none' and 'first' (under 5 %
    of the rows ignored) walk every row: a head begun over the kept rows of a shape not seen
    before is dropped; 'every_other' skips half of them: the head is used."""
    opts = dict(opts)
    bias = opts.pop("bias", False)
    case = _case(gen, device, 3 * A + 2, bias=bias, ignore=ignore)
    want = _run(case, _tuning(3 * A, None), reduction=reduction, **opts)
    for head in (A, 2 * A, 3 * A):
        got = _run(case, _tuning(3 * A, head), reduction=reduction, **opts)
        for a, b in zip(want[0] + want[1], got[0] + got[1], strict=True):
            assert torch.equal(a, b), (head, a, b)


def test_launched_before_the_wait_and_finished_after(gen, device, launches):
    case = _case(gen, device, 3 * A + 3, ignore="every_other")  # a shape of its own: no record
    n_kept = int((case.labels != -100).sum())
    _run(case, _tuning(3 * A, A))
    assert launches == [("gemm", A), ("wait",), ("gemm", n_kept - A)], launches


def test_no_launch_before_the_wait_when_off(gen, device, launches):
    case = _case(gen, device, 3 * A + 4, ignore="none")
    _run(case, _tuning(3 * A, None))
    assert launches == [("wait",), ("gemm", 3 * A), ("gemm", 4)]


def test_begun_where_the_last_read_check_of_the_shape_says_skip(gen, device, launches):
    """A shape not seen before counts as all ignored: begun over the kept rows, dropped when the
    call walks every row after all. The shape's next call (none ignored last time) begins
    nothing; with half the labels ignored it skips them, and the call after that begins its
    head over the kept rows and uses it."""
    n = 3 * A + 5
    walking = _case(gen, device, n, ignore="none")
    for _ in range(2):
        _run(walking, _tuning(3 * A, A))
    assert launches == [
        ("gemm", A),
        ("wait",),
        ("gemm", 3 * A),
        ("gemm", 5),
        ("wait",),
        ("gemm", 3 * A),
        ("gemm", 5),
    ]
    launches.clear()
    labels = torch.randint(0, V, (n,), generator=gen)
    labels[::2] = -100
    skipping = dataclasses.replace(walking, labels=labels.to(device))
    n_kept = int((labels != -100).sum())
    for _ in range(2):
        _run(skipping, _tuning(3 * A, A))
    assert launches == [("wait",), ("gemm", n_kept), ("gemm", A), ("wait",), ("gemm", n_kept - A)]


def test_not_started_where_the_first_chunk_is_not_the_fused_gemms(gen, device, launches):
    """The two-pass path and an autocast cast of the weight (fp32 weights) take no head start."""
    case = _case(gen, device, 3 * A + 2, ignore="none")
    two_pass = dataclasses.replace(_tuning(A, A), two_pass=True)
    _run(case, two_pass)
    assert launches[0] == ("wait",), launches
    launches.clear()
    wide = _case(gen, device, 3 * A + 2, ignore="none", dtype=torch.float32)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        _run(wide, _tuning(3 * A, A))
    assert launches[0] == ("wait",), launches


@pytest.mark.parametrize(
    ("gflop_rows", "first", "want"),
    [(0, 48, 0), (1, 48, 16), (16, 48, 16), (17, 48, 32), (100, 48, 48), (5, 0, 0)],
)
def test_head_rows_in_whole_row_tiles(gflop_rows, first, want):
    """Rows for about the flops, rounded up to whole row tiles, capped (in units of 1/16 tile)."""
    scale = A // 16
    gflop = gflop_rows * scale * ROW_FLOP / 1e9
    assert head_start.head_rows(gflop, H, V, first * scale) == want * scale


@pytest.mark.parametrize("value", [-1.0, math.inf, math.nan, True, "1"])
def test_tuning_refuses_a_bad_head_start(value):
    with pytest.raises(ValueError, match="head_start_gflop"):
        Tuning(head_start_gflop=value)


def test_used_when_the_kept_rows_fit_one_unrounded_chunk(gen, device, monkeypatch):
    """A plan over N rows rounds its chunk down to whole cuBLAS row tiles (512 of 600 here); one
    over the kept rows that all fit does not (budget.chunk_rows), so the first chunk over the kept
    rows can be longer than the rounded one: the head begun over the kept rows must hold it.
    Budgets across the rounding: wherever a head is begun for a call that skips as the last one
    did, it is used."""
    begun, used = [], []
    real_start, real_finish = head_start.start, head_start.finish
    monkeypatch.setattr(head_start, "start", lambda *a, **k: begun.append(real_start(*a, **k)) or begun[-1])
    monkeypatch.setattr(
        head_start,
        "finish",
        lambda head, logits_gemm, h: used.append(h.shape[0]) or real_finish(head, logits_gemm, h),
    )
    labels = torch.randint(0, V, (600,), generator=gen)
    labels[torch.randperm(600, generator=gen)[:70]] = -100  # 530 kept: skipped (over 5 %)
    case = dataclasses.replace(_case(gen, device, 600), labels=labels.to(device))
    tuning = Tuning(head_start_gflop=64 * ROW_FLOP / 1e9, min_token_chunk_rows=0, wait_to_skip_gflop=0.0)
    lengths = set()
    # A chunk row's bytes (logits, partials, gathered rows) are 400 in fp32, 200 in bf16.
    for fp32_extra in range(150_000, 330_000, 12_000):
        extra = fp32_extra * DTYPE.itemsize // 4
        budget = (2 << 20) + 40 * 600 + extra  # the slack and per-token vectors, then the chunk's
        for _ in range(2):  # the second call's head is begun over the kept rows
            begun.clear(), used.clear()
            call_op(case, backend="triton", tuning=tuning, memory_budget=budget)
        assert begun and begun[0] is not None, extra
        assert used, (extra, begun[0].logits.shape)
        lengths.add(used[0])
    assert {530} < lengths | {530} and max(lengths) == 530 and min(lengths) < 512, lengths
