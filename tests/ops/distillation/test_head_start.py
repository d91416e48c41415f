"""The teacher's first logits chunk begun before the distillation op waits for its label check
(``distillation_triton.start_head``, ``distillation_operator._start_head``, on
``ops/core/head_start.py``): launched before the wait, finished from the same buffers by the first
chunk, and the op's results bit for bit those without it, whether the call walks every row or
the kept ones (begun over the kept rows where the last read check of the shape saw enough
ignored, a shape not seen before counting as all; dropped when the call walks every row).
On ``device``, in what the fused logits GEMM takes there: on CPU tensors under the Triton
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 only without CUDA) in fp32 with 16-row GEMM
tiles, on a GPU natively in bf16 with 128-row tiles: row counts are given in tiles (``TILE``)."""

import dataclasses

import pytest
import torch

import liger_patch as lp
from liger_patch.ops.core import gemm, head_start, validation
from liger_patch.ops.core.tuning import Tuning
from liger_patch.ops.distillation import triton_chunk as distillation_triton
from tests.ops.distillation.cases import loss_and_grads, make_case

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

HS, HT, V = 24, 40, 136  # 136 fp32 or bf16 logits make 16-byte aligned rows: the fused GEMM takes them
TILE = 128 if torch.cuda.is_available() else 16  # the fused GEMM's row tile (the head's alignment)
DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float32  # what the fused GEMM takes
CHUNK = 3 * TILE
TEACHER_ROW_FLOP = 2 * HT * V


def _tuning(head_tiles: int | None) -> Tuning:
    """Chunks of three row tiles; a head start of ``head_tiles`` tiles of the teacher's GEMM; the
    label check always read (on CUDA waited for, whatever the size), as the head start's timing
    asks."""
    gflop = 0.0 if head_tiles is None else head_tiles * TILE * TEACHER_ROW_FLOP / 1e9
    return Tuning(chunk_rows=CHUNK, head_start_gflop=gflop, wait_to_skip_gflop=0.0)


def _run(case, tuning: Tuning, **opts):
    labels = case["labels"]
    none = opts.get("reduction") == "none"
    upstream = torch.linspace(0.5, 1.5, labels.numel(), device=labels.device) if none else 1.0
    loss, grads = loss_and_grads(
        lp.fused_linear_distillation, case, upstream, backend="triton", tuning=tuning, **opts
    )
    return [loss.detach(), *grads.values()]


@pytest.fixture
def launches(monkeypatch):
    """The fused logits GEMM's launches as ("teacher" or "student", rows) and the label check's
    wait as ("wait",), in order."""
    events = []
    real_result = validation.ValueCheck.result

    def result(self, *args, **kwargs):
        events.append(("wait",))
        return real_result(self, *args, **kwargs)

    monkeypatch.setattr(validation.ValueCheck, "result", result)
    for module in (distillation_triton, gemm):  # the head start's GEMMs: gemm.chunk_logits
        real = module.chunk_logits

        def spy(h, w, *args, real=real, **kwargs):
            logits, partials = real(h, w, *args, **kwargs)
            if partials is not None:
                events.append(("teacher" if w.shape[1] == HT else "student", h.shape[0]))
            return logits, partials

        monkeypatch.setattr(module, "chunk_logits", spy)
    return events


def _case(gen, device, n: int, ignore: str = "none", bias: bool = True):
    return make_case(gen, (n,), HS, HT, V, dtype=DTYPE, ignore=ignore, bias=bias, device=device)


OPTION_SETS = [
    {"beta": 0.5},
    {"beta": 0.0, "temperature": 2.0, "ce_weight": 0.3},
    {"beta": 0.37, "student_softcap": 3.0, "teacher_logit_scale": -0.7},
]
BIT_CASES = [
    (ignore, reduction, OPTION_SETS[(i + j) % 3])
    for i, ignore in enumerate(["none", "first", "half"])
    for j, reduction in enumerate(["mean", "sum", "none"])
]
"""Each ignore pattern with each reduction, the option sets cycling over them."""


@pytest.mark.parametrize(("ignore", "reduction", "opts"), BIT_CASES, ids=str)
def test_bit_equal_to_the_op_without_it(gen, device, ignore, reduction, opts):
    """A head of one row tile of three-tile chunks (the chunk finished by a second launch) and
    of a whole chunk, two calls each (the second begun where the first skipped rows), against no
    head start: the same bits."""
    case = _case(gen, device, 2 * CHUNK + 7, ignore)
    want = _run(case, _tuning(None), reduction=reduction, **opts)
    for tiles in (1, 3):
        for _ in range(2):
            got = _run(case, _tuning(tiles), reduction=reduction, **opts)
            for a, b in zip(want, got, strict=True):
                assert torch.equal(a, b), (tiles, a, b)


def test_launched_before_the_wait_and_finished_after(gen, device, launches):
    """Two and a half tiles of the rows kept (one chunk of them), a shape not seen before."""
    n, n_kept = 2 * CHUNK + 3, 5 * TILE // 2
    case = _case(gen, device, n)
    case["labels"][torch.randperm(n, generator=gen)[: n - n_kept].to(device)] = -100
    _run(case, _tuning(1))
    want = [("teacher", TILE), ("wait",), ("teacher", n_kept - TILE), ("student", n_kept)]
    assert launches == want, launches


def test_no_launch_before_the_wait_when_off(gen, device, launches):
    _run(_case(gen, device, 2 * CHUNK + 4), _tuning(None))
    assert launches[:3] == [("wait",), ("teacher", CHUNK), ("student", CHUNK)], launches


def test_begun_where_the_last_read_check_of_the_shape_says_skip(gen, device, launches):
    """Every row kept, a shape not seen before: begun over the kept rows (counted as all
    ignored), dropped as the call walks every row; the next call of the shape begins nothing.
    Then two and a half tiles of the rows kept: the first call (none ignored last time) begins
    nothing and walks the kept rows; the next begins over them and uses its head."""
    n, n_kept = 2 * CHUNK + 5, 5 * TILE // 2
    walking = _case(gen, device, n)
    for _ in range(2):
        _run(walking, _tuning(1))
    rest = [("teacher", CHUNK), ("student", CHUNK), ("teacher", 5), ("student", 5)]
    every_row = [("teacher", CHUNK), ("student", CHUNK), *rest]
    assert launches == [("teacher", TILE), ("wait",), *every_row, ("wait",), *every_row], launches
    launches.clear()
    skipping = dict(walking, labels=walking["labels"].clone())
    skipping["labels"][torch.randperm(n, generator=gen)[: n - n_kept].to(device)] = -100
    for _ in range(2):
        _run(skipping, _tuning(1))
    assert launches == [
        ("wait",),
        ("teacher", n_kept),
        ("student", n_kept),
        ("teacher", TILE),
        ("wait",),
        ("teacher", n_kept - TILE),
        ("student", n_kept),
    ], launches


@pytest.mark.parametrize(
    "opts",
    [dict(beta=1.0), dict(beta=0.5, logits_dtype=torch.float32), dict(beta=0.5, backend="torch")],
    ids=["reverse_kl", "fp32_logits", "torch_backend"],
)
def test_not_started_where_the_first_chunk_is_not_the_fused_gemms(gen, device, monkeypatch, opts):
    """Reverse KL and fp32 logits take no partials (no fused GEMM); the torch backend has none."""
    begun = []
    monkeypatch.setattr(head_start, "start", lambda *a, **k: begun.append(a))
    case = _case(gen, device, 2 * CHUNK + 6)
    opts = dict(opts)
    backend = opts.pop("backend", "triton")
    lp.fused_linear_distillation(**case, backend=backend, tuning=_tuning(1), **opts).backward()
    assert begun == []


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="about the CPU's fp32 GEMMs, and Triton runs on CPU tensors only under the interpreter; on a "
    "GPU bf16 inputs are what take the head: the other tests here run them",
)
def test_bf16_on_the_cpu_takes_no_head(gen, monkeypatch):
    """On the CPU the GEMMs run in fp32 (a cast of bf16 hidden states first): nothing is begun."""
    begun = []
    monkeypatch.setattr(head_start, "start", lambda *a, **k: begun.append(a))
    cpu = torch.device("cpu")
    case = {k: v if v is None else v.detach().bfloat16() for k, v in _case(gen, cpu, 2 * CHUNK + 8).items()}
    case["labels"] = torch.randint(0, V, (2 * CHUNK + 8,), generator=gen)
    lp.fused_linear_distillation(**case, backend="triton", beta=0.5, tuning=_tuning(1))
    assert begun == []


def test_tuning_is_an_option_of_the_op(gen):
    """``tuning`` reaches both sides' options and the registered operator's key."""
    from liger_patch.ops.distillation.options import DistillOptions, build_distill_options

    tuning = dataclasses.replace(_tuning(2), fused_logits=False)
    opts = build_distill_options(beta=0.5, tuning=tuning)
    assert opts.student.tuning == opts.teacher.tuning == tuning
    assert DistillOptions.from_key(opts.key) == opts
    with pytest.raises(TypeError, match="tuning must be a liger_patch.ops.core.tuning.Tuning"):
        build_distill_options(tuning="fast")
