"""The chunk planner (``budget.plan_chunks``): a pure function from a call's sizes and memory
budget to the plan ``chunked.run_chunks`` executes, checked here without any tensor."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from liger_patch.ops.core.budget import (
    PER_TOKEN_BYTES,
    SLACK_BYTES,
    ChunkShape,
    balanced_rows,
    chunk_rows,
    plan_chunks,
    vocab_blocks,
    working_bytes,
)
from liger_patch.ops.core.tuning import Tuning

MiB = 1 << 20
DEFAULT = Tuning()


def cuda_shape(n, h, v, grad_weight=True, partials=True):
    """A bf16 call on a GPU: half GEMMs, and the fused GEMM's partials (BN=256, two fp32 per tile)."""
    part = -(-v // 256) * 8 if partials else 0
    return ChunkShape(
        n_rows=n,
        vocab=v,
        weight_numel=v * h,
        weight_bytes=2,
        logit_bytes=2,
        gemm_fp32=False,
        partial_bytes_per_row=part,
        grad_weight=grad_weight,
    )


@pytest.mark.parametrize(
    "rows, expected", [(1, 1), (255, 255), (300, 256), (511, 384), (512, 512), (1664, 1536), (2051, 2048)]
)
def test_rows_are_rounded_to_cublas_tiles(rows, expected):
    assert chunk_rows(1000, rows * 4000, 4, DEFAULT) == expected


@pytest.mark.parametrize("n_rows, expected", [(1216, 1300), (1300, 1300), (1301, 1280), (5000, 1280)])
def test_rows_that_hold_every_row_are_not_rounded(n_rows, expected):
    """Rounding a budget that holds all the rows would only add a remainder chunk."""
    assert chunk_rows(1000, 1300 * 4000, 4, DEFAULT, n_rows) == expected


@given(n=st.integers(1, 1 << 17), max_rows=st.integers(1, 1 << 14))
def test_balanced_chunks_are_as_few_and_as_even_as_the_cap_allows(n, max_rows):
    rows = balanced_rows(n, max_rows)
    assert 1 <= rows <= max_rows
    if n <= max_rows:
        return
    chunks = -(-n // rows)
    assert rows < 256 or rows % 128 == 0
    # as few chunks as the largest allowed chunk (under the cap, aligned from 256 rows) gives
    largest = max_rows if max_rows < 256 else max(255, max_rows - max_rows % 128)
    assert chunks == -(-n // largest)
    # the smallest allowed size for that many chunks
    smaller = rows - 128 if rows >= 384 else rows - 1
    assert smaller < 1 or -(-n // smaller) > chunks
    # every chunk but the last is full, and the last is not empty
    assert 0 < n - (chunks - 1) * rows <= rows


@pytest.mark.parametrize(
    "n, max_rows, rows", [(8192, 1765, 1664), (32768, 1765, 1664), (4096, 1765, 1408), (2048, 1765, 1024)]
)
def test_balanced_chunks_at_the_default_budget(n, max_rows, rows):
    """V=152064 in bf16 fits 1765 rows in 512 MiB: 5 chunks of 1664 rather than 5 of 1536 + 512."""
    assert balanced_rows(n, max_rows) == rows
    assert chunk_rows(152064, max_rows * 2 * 152064, 2, Tuning(balanced_chunks=True), n) == rows


def test_tuning_forces_the_chunk_size():
    assert chunk_rows(1000, 10**12, 4, Tuning(chunk_rows=7)) == 7


@pytest.mark.parametrize(
    "n, h, v, rows", [(8192, 4096, 128256, 2048), (32768, 4096, 151936, 1536), (8192, 2304, 256000, 1024)]
)
def test_headline_shapes_at_the_default_budget(n, h, v, rows):
    """The plans behind docs/benchmarks.md's figures: token chunks, grad_W summed in bf16 (an fp32
    copy of it would not fit in 512 MiB), each chunk's first GEMM overwriting it."""
    plan = plan_chunks(cuda_shape(n, h, v), working_bytes("default", n), DEFAULT)
    assert (plan.rows, plan.two_pass, plan.grad_weight_fp32, plan.overwrite_first) == (
        rows,
        False,
        False,
        True,
    )


def test_working_bytes_leave_room_for_per_token_vectors_and_slack():
    assert working_bytes(64 * MiB, 1000) == 64 * MiB - PER_TOKEN_BYTES * 1000 - SLACK_BYTES
    assert working_bytes(1, 1000) == 1  # at least one byte: one row at a time


def test_gpu_sums_in_the_weight_dtype_with_the_largest_chunks():
    """Even where an fp32 copy of grad_W would fit beside large chunks (H=2048, V=49152: 384 MiB
    of 512), the chunks get the whole budget: 4096 tokens are one chunk, one rounding."""
    shape = cuda_shape(4096, 2048, 49152)
    plan = plan_chunks(shape, working_bytes("default", 4096), DEFAULT)
    assert (plan.rows >= 4096, plan.grad_weight_fp32, plan.overwrite_first) == (True, False, True)
    assert not plan.two_pass


def test_forced_fp32_accumulator_shares_the_budget_with_the_chunks():
    shape = cuda_shape(4096, 512, 32000)
    plan = plan_chunks(shape, 256 * MiB, Tuning(fp32_grad_weight=True))
    assert plan.grad_weight_fp32 and not plan.overwrite_first and not plan.two_pass
    chunk = plan.rows * (32000 * 2 + shape.partial_bytes_per_row)
    assert chunk + 4 * shape.weight_numel <= 256 * MiB
    assert plan.rows < plan_chunks(shape, 256 * MiB, DEFAULT).rows


def test_cpu_always_sums_in_fp32():
    shape = ChunkShape(
        n_rows=100,
        vocab=50,
        weight_numel=50 * 8,
        weight_bytes=2,
        logit_bytes=2,
        gemm_fp32=True,
        grad_weight=True,
    )
    assert plan_chunks(shape, 1, DEFAULT).grad_weight_fp32


def test_small_budget_takes_two_passes_only_for_grad_weight():
    shape = cuda_shape(4096, 512, 32000)
    plan = plan_chunks(shape, 4 * MiB, DEFAULT)
    assert plan.two_pass and plan.vocab_blocks
    no_grad_weight = plan_chunks(cuda_shape(4096, 512, 32000, grad_weight=False), 4 * MiB, DEFAULT)
    assert not no_grad_weight.two_pass and not no_grad_weight.vocab_blocks


def test_tuning_forces_the_path():
    shape = cuda_shape(4096, 512, 32000)
    assert not plan_chunks(shape, 4 * MiB, Tuning(two_pass=False)).two_pass
    assert plan_chunks(shape, 512 * MiB, Tuning(two_pass=True)).two_pass
    assert plan_chunks(shape, 512 * MiB, Tuning(fp32_grad_weight=False)).overwrite_first


@given(
    n=st.integers(1, 5000),
    h=st.integers(1, 4096),
    v=st.integers(1, 70000),
    logit_bytes=st.sampled_from([2, 4]),
    budget=st.integers(1, 64 * MiB),
)
def test_vocab_blocks_cover_the_vocabulary_within_their_memory(n, h, v, logit_bytes, budget):
    """Pass B's blocks tile [0, V) in order; a block kept in grad_W fits in its rows after the
    block (16-byte aligned); the others fit the budget (or are one column)."""
    shape = ChunkShape(
        n_rows=n,
        vocab=v,
        weight_numel=v * h,
        weight_bytes=2,
        logit_bytes=logit_bytes,
        gemm_fp32=False,
        grad_weight=True,
    )
    blocks = vocab_blocks(shape, budget, DEFAULT)
    assert blocks[0][0] == 0 and blocks[-1][1] == v
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:], strict=False))
    for v0, v1, in_grad_weight in blocks:
        assert v1 > v0
        if in_grad_weight:
            assert (v1 - v0) * n * logit_bytes + 16 <= (v - v1) * h * 2
        else:
            assert (v1 - v0) == 1 or (v1 - v0) * n * logit_bytes <= budget


@given(
    n=st.integers(1, 40000),
    h=st.integers(64, 8192),
    v=st.integers(1000, 262144),
    budget_mib=st.integers(1, 2048),
)
def test_token_chunks_stay_within_the_budget(n, h, v, budget_mib):
    """One-pass plans: the chunk, its partials and an fp32 accumulator fit the working budget
    whenever one row of them does."""
    shape = cuda_shape(n, h, v)
    budget = working_bytes(budget_mib * MiB, n)
    plan = plan_chunks(shape, budget, DEFAULT)
    row = v * 2 + shape.partial_bytes_per_row
    if plan.two_pass or row > budget:
        return
    used = plan.rows * row + (4 * shape.weight_numel if plan.grad_weight_fp32 else 0)
    assert used <= budget
    assert plan.rows >= 1


def amp_shape(n, h, v, **changes):
    """An fp32 weight under bf16 autocast on a GPU: bf16 hidden states and GEMMs, fp32 grad_W."""
    return ChunkShape(**{**cuda_shape(n, h, v).__dict__, "weight_bytes": 4, "operand_bytes": 2, **changes})


def test_autocast_weight_copy_lives_in_grad_weight():
    """The bf16 copy of an fp32 weight takes grad_W's second half and the bf16 sum its first: the
    chunks are those of a bf16 weight (nothing comes out of the budget for the copy)."""
    bf16 = plan_chunks(cuda_shape(8192, 3584, 152064), 512 * MiB, DEFAULT)
    amp = plan_chunks(amp_shape(8192, 3584, 152064), 512 * MiB, DEFAULT)
    assert amp.weight_in_grad_weight and amp.overwrite_first and not amp.grad_weight_fp32
    assert amp.rows == bf16.rows and not bf16.weight_in_grad_weight


def test_autocast_fp32_sum_is_grad_weight_itself():
    """A forced fp32 sum fills all of an fp32 grad_W: the copy goes elsewhere, and no fp32
    accumulator beside grad_W is taken from the budget."""
    tuning = Tuning(fp32_grad_weight=True)
    amp = plan_chunks(amp_shape(8192, 3584, 152064), 512 * MiB, tuning)
    half = plan_chunks(cuda_shape(8192, 3584, 152064), 512 * MiB + 4 * 3584 * 152064, tuning)
    assert not amp.weight_in_grad_weight and amp.grad_weight_fp32
    assert amp.rows == half.rows


def test_autocast_two_pass_keeps_the_copy_clear():
    """Two passes: pass A's chunks get grad_W's first half only, and pass B's blocks all use the
    budget's buffer (the unwritten rows of grad_W hold the copy)."""
    shape = amp_shape(8192, 2048, 128256)
    plan = plan_chunks(shape, 32 * MiB, DEFAULT)
    assert plan.two_pass and plan.weight_in_grad_weight and plan.logits_in_grad_weight
    assert plan.rows * 128256 * 2 <= 128256 * 2048 * 2
    assert not any(in_grad_weight for _, _, in_grad_weight in plan.vocab_blocks)
    assert plan.vocab_blocks[-1][1] == 128256
    assert all(b[0] == a[1] for a, b in zip(plan.vocab_blocks[:-1], plan.vocab_blocks[1:], strict=True))


def test_autocast_copy_needs_an_aligned_start():
    """V*H*2 bytes not a multiple of 16: the copy would not start on an aligned boundary."""
    assert not plan_chunks(amp_shape(4096, 9, 1001), 512 * MiB, DEFAULT).weight_in_grad_weight
    assert plan_chunks(amp_shape(4096, 8, 1001), 512 * MiB, DEFAULT).weight_in_grad_weight
