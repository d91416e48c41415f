"""The chunk planner (``budget.plan_chunks``): a pure function from a call's sizes and memory
budget to the plan ``chunked.run_chunks`` executes, checked here without any tensor."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from liger_patch.ops.budget import (
    PER_TOKEN_BYTES,
    SLACK_BYTES,
    ChunkShape,
    chunk_rows,
    plan_chunks,
    vocab_blocks,
    working_bytes,
)
from liger_patch.ops.tuning import Tuning

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


def test_fp32_accumulator_when_it_fits_next_to_large_chunks():
    shape = cuda_shape(4096, 512, 32000)
    plan = plan_chunks(shape, 256 * MiB, DEFAULT)
    assert plan.grad_weight_fp32 and not plan.overwrite_first and not plan.two_pass
    chunk = plan.rows * (32000 * 2 + shape.partial_bytes_per_row)
    assert chunk + 4 * shape.weight_numel <= 256 * MiB


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
