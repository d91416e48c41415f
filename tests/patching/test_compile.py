"""The whole patched model under torch.compile equals eager (loss and gradients).

The fused loss is a registered operator (liger_patch/ops/cross_entropy/operator.py), so a patched model
compiles with ``fullgraph=True`` in one graph, with dynamic shapes, and (on CUDA) under
``mode="reduce-overhead"`` (CUDA graphs).
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch._dynamo.utils import counters

import liger_patch as lp
from tests.patching_helpers import device_and_dtype, make_batch, tiny_model, tolerances

# CPU: aot_eager traces the patched forward and the op's autograd.Function through dynamo and
# AOTAutograd in a few seconds; on CUDA the real inductor backend runs.
BACKEND = "inductor" if torch.cuda.is_available() else "aot_eager"


def _fresh() -> None:
    """A fresh dynamo and no dead patched models waiting for the garbage collector: the traced
    forward reads head._HEAD_PATHS (weak keys: every live patched model), and dynamo guards on its
    keys by position, so a model of an earlier test collected while a graph's guards are built
    fails the compile with "IndexError: list index out of range" (see
    test_another_patched_model_does_not_recompile)."""
    gc.collect()
    torch._dynamo.reset()
    counters.clear()


def test_compiled_patched_model_equals_eager():
    _fresh()
    eager = tiny_model("llama")
    lp.apply_liger_to(eager)
    compiled_model = copy.deepcopy(eager)
    lp.apply_liger_to(compiled_model)  # deepcopy keeps the patch; re-applying is a no-op
    compiled = torch.compile(compiled_model, backend=BACKEND)
    tol = 1e-5 if device_and_dtype()[1] == torch.float32 else 2e-2
    for seed in range(2):
        batch = make_batch(seed)
        out_eager, out_compiled = eager(**batch), compiled(**batch)
        assert out_compiled.logits is None
        torch.testing.assert_close(out_compiled.loss, out_eager.loss, rtol=tol, atol=tol)
        out_eager.loss.backward()
        out_compiled.loss.backward()
        for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=tol * 10, atol=tol * 10, msg=name)
            p.grad = q.grad = None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_patched_moe_model_equals_eager_bf16():
    _fresh()
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    lp.apply_liger_to(model)
    compiled = torch.compile(copy.deepcopy(model))
    batch = make_batch()
    torch.testing.assert_close(compiled(**batch).loss, model(**batch).loss, rtol=2e-2, atol=2e-2)


def _flce_nodes(graph_module: torch.fx.GraphModule) -> int:
    ops = torch.ops.liger_patch.flce
    return sum(node.target in (ops, ops.default) for node in graph_module.graph.nodes)


class _Graphs:
    """A backend that keeps the graphs dynamo hands it and compiles them with ``BACKEND``."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs.append(gm)
        return lookup_backend(BACKEND)(gm, example_inputs)

    def assert_one_graph_with_the_op(self) -> None:
        assert counters["stats"]["unique_graphs"] == 1, "more than one graph (a recompile or a graph break)"
        assert sum(_flce_nodes(g) for g in self.graphs) == 1, "the fused op is not one node of the graph"


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {
        n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters() if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    return grads


def _assert_grads_close(actual: dict, expected: dict, tol: float, what: str) -> None:
    assert actual.keys() == expected.keys(), f"{what}: different parameters got gradients"
    for name, e in expected.items():
        err = ((actual[name] - e).norm() / e.norm().clamp_min(1e-6)).item()
        assert err <= tol, f"{what}: grad {name} relative error {err:.2e}"


def test_fullgraph_dynamic_patched_model_equals_eager():
    """``torch.compile(patched, fullgraph=True, dynamic=True)``: training steps at three sequence
    lengths give eager's loss, every parameter's gradient and the per-call outputs
    (``outputs.token_accuracy``, ``outputs.entropy``), from one graph."""
    _fresh()
    model = tiny_model("llama", seed=3)
    lp.apply_liger_to(model)
    backend = _Graphs()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=backend)
    tol = tolerances(device_and_dtype()[1])
    for step, seq in enumerate((12, 9, 17)):
        batch = make_batch(seed=step, seq=seq)
        results = []
        for fn in (model, compiled):  # the same parameters: eager, then compiled
            out = fn(**batch, return_token_accuracy=True, return_entropy=True)
            assert out.logits is None, "the fused path did not run"
            out.loss.backward()
            results.append((out, _grads(model)))
        (eager, eager_grads), (comp, comp_grads) = results
        for name in ("loss", "token_accuracy", "entropy"):
            a, e = getattr(comp, name), getattr(eager, name)
            assert a is not None and a.shape == e.shape == (), f"seq {seq}: outputs.{name}"
            torch.testing.assert_close(
                a.float(), e.float(), rtol=tol.loss, atol=tol.loss, msg=f"seq {seq}: {name}"
            )
        assert comp.z_loss is None and comp.predicted_tokens is None  # not asked for
        _assert_grads_close(comp_grads, eager_grads, tol.grad, f"seq {seq}")
    backend.assert_one_graph_with_the_op()


def test_fullgraph_patched_softcap_model_equals_eager():
    """A head with a softcap (gemma2's final_logit_softcapping, read from the config per call)
    compiles in one graph too (default dynamic: the second length recompiles with dynamic sizes)."""
    _fresh()
    model = tiny_model("gemma2", seed=4)
    lp.apply_liger_to(model)
    compiled = torch.compile(model, fullgraph=True, backend=BACKEND)
    tol = tolerances(device_and_dtype()[1])
    for step, seq in enumerate((12, 9)):
        batch = make_batch(seed=step, seq=seq)
        eager = model(**batch)
        eager.loss.backward()
        eager_grads = _grads(model)
        comp = compiled(**batch)
        assert comp.logits is None
        comp.loss.backward()
        torch.testing.assert_close(comp.loss, eager.loss, rtol=tol.loss, atol=tol.loss)
        _assert_grads_close(_grads(model), eager_grads, tol.grad, f"seq {seq}")


def test_fullgraph_dynamic_patched_softcap_model():
    _fresh()
    tol = tolerances(device_and_dtype()[1])
    model = tiny_model("gemma2", seed=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # logits large enough for the softcap to matter
    lp.apply_liger_to(model)
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=BACKEND)
    for seq in (12, 9):
        before = compiled(**make_batch(0, seq=seq)).loss
        torch.testing.assert_close(before, model(**make_batch(0, seq=seq)).loss, rtol=tol.loss, atol=tol.loss)
    # the softcap was specialized with a guard, not baked in: a changed config value is used
    model.config.final_logit_softcapping = 0.5  # caps the logits hard: a loss far from before
    after = compiled(**make_batch(0, seq=9)).loss
    assert abs(float(after) - float(before)) > 0.1
    torch.testing.assert_close(after, model(**make_batch(0, seq=9)).loss, rtol=tol.loss, atol=tol.loss)


def test_another_patched_model_does_not_recompile():
    _fresh()
    model = tiny_model("llama", seed=5)
    lp.apply_liger_to(model)
    # backend="eager": dynamo's guards are the subject, AOTAutograd would only add time
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="eager")
    compiled(**make_batch(0)).loss.backward()
    other = tiny_model("llama", seed=6)  # e.g. the reference model of an RL trainer
    lp.apply_liger_to(other)
    compiled(**make_batch(1, seq=9)).loss.backward()
    assert counters["stats"]["unique_graphs"] == 1


def test_z_loss_patched_model_does_not_recompile():
    _fresh()
    model = tiny_model("llama", seed=7)
    lp.apply_liger_to(model, z_loss_scale=1e-3)
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="eager")  # guards only
    for step, seq in enumerate((12, 9, 12, 10, 12, 11, 12, 9, 12, 10)):
        out = compiled(**make_batch(step, seq=seq))
        assert out.z_loss is not None
        out.loss.backward()
    # the tracker's per-device sum exists from the second call on: one recompile, then none
    assert counters["stats"]["unique_graphs"] <= 2
    assert lp.patching.state.patch_state(model).z_loss_tracker.pop_mean() > 0


def _transformers_tester_llama():
    """transformers' tiny Llama of its model tester (fp32), patched, in training mode (the fused
    path runs for training forwards with labels)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=37,
        hidden_act="gelu",
        max_position_embeddings=512,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device="cuda", dtype=torch.float32).train()
    return lp.apply_liger_to(model)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_transformers_torch_compile_for_training_on_patched_llama():
    """The body of transformers' ``test_torch_compile_for_training`` (5.23,
    tests/test_modeling_common.py) on a patched tiny LlamaForCausalLM:
    ``torch.compile(fullgraph=True, mode="reduce-overhead")`` gives eager's gradients."""
    from transformers import set_seed

    _fresh()
    model = _transformers_tester_llama()
    device = "cuda"
    inputs = {
        "input_ids": torch.randint(low=1, high=model.config.vocab_size, size=(2, 10), device=device),
        "attention_mask": torch.tensor(
            [[1, 1, 1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.int64, device=device
        ),
        "position_ids": torch.arange(0, 10, device=device).unsqueeze(0),
        "labels": torch.randint(low=1, high=model.config.vocab_size, size=(2, 10), device=device),
        "use_cache": False,
    }

    set_seed(42)
    outputs = model(**inputs)
    assert outputs.logits is None, "the patched (fused) loss did not run"
    loss = outputs.loss
    loss.backward()
    params = {
        name: param.grad.detach().to(device="cpu", copy=True) for name, param in model.named_parameters()
    }
    model.zero_grad()
    del loss, outputs

    model = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    set_seed(42)
    loss = model(**inputs).loss
    loss.backward()
    for name, param in model._orig_mod.named_parameters():
        torch.testing.assert_close(param.grad.detach().cpu(), params[name], rtol=1e-4, atol=1e-4, msg=name)
    torch._dynamo.reset()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("objective", ["loss", "loss_z"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_reduce_overhead_functional_replays_equal_eager_bf16(backend, objective):
    """``mode="reduce-overhead"`` of a step calling the functional: CUDA graphs are recorded and
    replayed (no skip), and every call equals eager in loss, z_loss and gradients; a bad label in
    a replay gives a NaN loss instead of an exception (nothing synchronises in a replay)."""
    _fresh()
    N, D, H, V = 96, 48, 64, 1000
    gen = torch.Generator().manual_seed(11)

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(D, H, bias=False)
            self.head = torch.nn.Parameter(torch.randn(V, H, generator=gen) * H**-0.5)

        def forward(self, x, labels):
            hidden = self.proj(x)
            out = lp.fused_linear_cross_entropy(
                hidden, self.head, labels, backend=backend, z_loss_scale=1e-3, return_z_loss=True
            )
            return out.loss, out.z_loss

    model = Step().to(device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")

    def run(fn, x, labels):
        model.zero_grad(set_to_none=True)
        loss, z_loss = fn(x, labels)
        (loss if objective == "loss" else loss + 2.0 * z_loss).backward()
        # clone at once: a later replay overwrites the graphs' outputs
        return loss.detach().clone(), z_loss.detach().clone(), _grads(model)

    for call in range(5):  # warm-up, recording, then replays
        x = torch.randn(N, D, generator=gen).to("cuda", torch.bfloat16)
        labels = torch.randint(0, V, (N,), generator=gen)
        labels[torch.rand(N, generator=gen) < 0.3] = -100
        labels = labels.cuda()
        torch.compiler.cudagraph_mark_step_begin()
        loss, z_loss, grads = run(compiled, x, labels)
        eager_loss, eager_z, eager_grads = run(model, x, labels)
        torch.testing.assert_close(loss, eager_loss, rtol=2e-2, atol=2e-2, msg=f"call {call}: loss")
        torch.testing.assert_close(z_loss, eager_z, rtol=2e-2, atol=1e-4, msg=f"call {call}: z_loss")
        _assert_grads_close(grads, eager_grads, 3e-2, f"call {call}")
    assert counters["inductor"]["cudagraph_skips"] == 0, "CUDA graphs were skipped"

    labels[3] = V  # out of range: a replay cannot raise, it poisons the loss
    torch.compiler.cudagraph_mark_step_begin()
    loss, z_loss = compiled(x, labels)
    assert torch.isnan(loss) and torch.isnan(z_loss)
    torch._dynamo.reset()
