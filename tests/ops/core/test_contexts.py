"""``autocast_off`` and ``without_grad``: the modes of the chunk loops, set only where they change
something, and exactly the modes the context managers they stand for would give."""

from __future__ import annotations

import pytest
import torch

from liger_patch.ops.core.contexts import autocast_off, without_grad


def _mm_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    return (a @ b).dtype


def test_autocast_off_turns_autocast_off_inside_it_and_back_on_after():
    a = torch.randn(3, 5)
    b = torch.randn(5, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _mm_dtype(a, b) == torch.bfloat16
        with autocast_off("cpu"):
            assert not torch.is_autocast_enabled("cpu")
            assert _mm_dtype(a, b) == torch.float32
        assert torch.is_autocast_enabled("cpu")
        assert _mm_dtype(a, b) == torch.bfloat16


def test_autocast_off_outside_autocast_sets_nothing():
    assert not torch.is_autocast_enabled("cpu")
    manager = autocast_off("cpu")
    assert not isinstance(manager, torch.autocast)
    with manager:
        assert not torch.is_autocast_enabled("cpu")
    with manager:  # one instance serves every call
        assert (torch.randn(2, 3) @ torch.randn(3, 2)).dtype == torch.float32


def test_autocast_off_where_another_device_type_has_autocast_on():
    """The cast cache is the thread's, shared by every device type: with autocast switched on by
    hand for CUDA (no region, nesting 0), turning it off for the CPU must still enter and leave
    the manager, whose exit clears that cache, as ``torch.autocast`` did before."""
    torch.set_autocast_enabled("cuda", True)
    try:
        manager = autocast_off("cpu")
        assert isinstance(manager, torch.autocast)
        with manager:
            assert not torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cuda")
    finally:
        torch.set_autocast_enabled("cuda", False)


def test_autocast_off_for_a_device_type_autocast_does_not_know():
    """What ``torch.autocast`` itself does there (it refuses "meta") while autocast is on; with
    autocast off everywhere there is nothing to turn off, and nothing is refused."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError) as theirs:
            torch.autocast("meta", enabled=False)
        with pytest.raises(RuntimeError) as ours:
            autocast_off("meta")
    assert str(ours.value) == str(theirs.value)
    with autocast_off("meta"):
        pass


def test_autocast_off_compiles_without_a_graph_break():
    def scaled(x):
        with autocast_off("cpu"):
            return x @ x.t()

    compiled = torch.compile(scaled, backend="eager", fullgraph=True)
    x = torch.randn(3, 4)
    assert compiled(x).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compiled(x).dtype == torch.float32


def test_without_grad_runs_without_grad_and_restores_the_mode():
    seen = []

    @without_grad
    def body(x, *, scale):
        """Doubles."""
        seen.append(torch.is_grad_enabled())
        return x * scale

    x = torch.randn(4, requires_grad=True)
    out = body(x, scale=2.0)
    assert not out.requires_grad
    assert seen == [False]
    assert torch.is_grad_enabled()
    with torch.no_grad():
        body(x, scale=2.0)
        assert not torch.is_grad_enabled()
    assert seen == [False, False]
    assert body.__name__ == "body" and body.__doc__ == "Doubles."


def test_without_grad_under_inference_mode():
    @without_grad
    def body(x):
        return x * 2

    x = torch.randn(3, requires_grad=True)
    with torch.inference_mode():
        out = body(x)
        assert out.is_inference() and not out.requires_grad
        assert torch.is_inference_mode_enabled()


def test_without_grad_restores_the_mode_when_the_body_raises():
    @without_grad
    def fails():
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        fails()
    assert torch.is_grad_enabled()
