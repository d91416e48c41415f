"""The logits ops table: for every op kind, what it does to real logits (replay) and what it means
for the fused loss (fold) agree, both checked against the same ops on fp64 logits; and the table
is the one place that deferred logits' replay and loss math read."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from liger_patch.patching import logits_ops
from liger_patch.patching.causal_loss import causal_lm_loss
from liger_patch.patching.logits_ops import OPS, OpKind
from tests.patching.test_deferred import V, dense_causal, hidden_states, labels_for, make_capture, make_head

# One forward's head math per op kind of the table (a test fails until a new kind gets its chain).
CHAINS = {
    "mul": lambda x: x * 0.37,
    "div": lambda x: x / 2.9,
    "tanh": lambda x: torch.tanh(x / 5.0) * 5.0,
    "cast": lambda x: (x * 0.5).to(torch.float64),
    "add": lambda x: x + torch.linspace(-2.0, 2.0, V),
    "sub": lambda x: (x * 2.0 - torch.linspace(-2.0, 2.0, V)) / 3.0,
    "log_softmax": lambda x: torch.log_softmax(x / 2.0, -1),
    "index": lambda x: x[:, 0:7],
    "view": lambda x: x.view(7, 3, V).view(3, 7, V),
    "reshape": lambda x: x.reshape(21, V).reshape(3, 7, V),
    "transpose": lambda x: x.transpose(0, 1).contiguous().transpose(1, 0),
}


def test_every_op_kind_has_a_chain():
    assert set(CHAINS) == set(OPS)


@pytest.mark.parametrize("kind", CHAINS)
def test_replay_and_loss_math_of_each_op_kind_agree_with_fp64(kind):
    chain = CHAINS[kind]
    head = make_head()
    capture, _ = make_capture(head)
    hidden, labels = hidden_states(), labels_for()
    deferred = chain(capture(hidden))
    assert kind in [op.kind for op in deferred.ops]
    dense = chain(F.linear(hidden.double(), head.weight.double(), head.bias.double()))
    expected = dense_causal(dense, labels)

    replayed = deferred.materialize()
    own = chain(head(hidden))  # the model's own expression: replay must give it bit for bit
    assert replayed.dtype == own.dtype and torch.equal(replayed, own)
    torch.testing.assert_close(dense_causal(replayed.double(), labels), expected, rtol=1e-5, atol=1e-6)

    fused = causal_lm_loss(deferred, labels, V)
    torch.testing.assert_close(fused.double(), expected, rtol=1e-5, atol=1e-6)


def test_replay_and_loss_math_read_the_table(monkeypatch):
    """An entry swapped in the table changes both what ``materialize`` computes and what the
    fused loss computes, the same way: neither interprets an op anywhere else."""
    doubled = OpKind(replay=lambda logits, x: logits * (2 * x), fold=lambda math, x: math.scaled(2 * x))
    monkeypatch.setitem(logits_ops.OPS, "mul", doubled)
    head = make_head()
    capture, _ = make_capture(head)
    hidden, labels = hidden_states(), labels_for()
    deferred = capture(hidden) * 0.37
    assert deferred.loss_math() == (0.74, None)
    assert torch.equal(deferred.materialize(), head(hidden) * 0.74)
    dense = F.linear(hidden.double(), head.weight.double(), head.bias.double()) * 0.74
    torch.testing.assert_close(
        causal_lm_loss(deferred, labels, V).double(), dense_causal(dense, labels), rtol=1e-5, atol=1e-6
    )
