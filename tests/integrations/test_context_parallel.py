"""Context parallelism (accelerate's ``ParallelismConfig(cp_size=2)`` in the HF Trainer): the calls
one sequence shard makes, on CPU.

What a rank does under CP (transformers 5.24, accelerate 1.15, torch 2.13). Every rank of a CP
group gets the same batch. ``Trainer._get_num_items_in_batch`` counts the kept targets of the
whole batch (``labels[..., 1:]``) before anything is sharded, sums the count over all ranks
and divides it by cp: ``num_items_in_batch`` is the batch's count, as a float tensor.
``Trainer._prepare_context_parallel_inputs`` adds ``shift_labels`` (the labels shifted left over
the whole sequence) and ``position_ids``, and hands ``input_ids``, ``labels``, ``shift_labels``,
a 2-D ``attention_mask`` and ``position_ids`` to torch's ``context_parallel`` (through
``Accelerator.maybe_context_parallel``), which cuts each along the sequence: into 2 x cp chunks
when the length is a multiple of 2 x cp (rank r keeps chunks r and 2cp-1-r, load balancing),
else into cp contiguous pieces. The model gets every buffer's shard (``labels`` too: the loss
must read ``shift_labels``, since a shard's last target lives on another shard) and
``num_items_in_batch``; accelerate's hooks drop the attention mask for ``is_causal``.
``compute_loss`` multiplies the loss by the number of processes and the gradient all-reduce
(DDP or FSDP2, over the CP ranks) averages, so the step's gradient is the sum over ranks of
each shard's gradient of (its token sum / ``num_items_in_batch``).

Here the shards are made by those same functions: the Trainer's and accelerate's own methods,
called on stand-ins for the Trainer and the Accelerator, and torch's ``context_parallel`` on a
fake 2-rank process group in this one process. Torch's ring attention needs CUDA kernels, so the
models are called after the context: attention sees only the shard. That call is the same for
the patched and the unpatched model, which must agree on each shard; the sum over ranks equals
the full sequence's loss only where no position sees another, checked on a Llama with no
decoder layer.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

accelerate = pytest.importorskip("accelerate")
if not hasattr(accelerate, "ParallelismConfig"):
    pytest.skip("this accelerate has no ParallelismConfig", allow_module_level=True)
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    # The stand-ins below call the 5.x Trainer's own methods; 4.57's prepare the shards with other
    # helpers (and count num_items_in_batch as an int tensor).
    pytest.skip("the stand-ins model transformers 5's Trainer", allow_module_level=True)

from accelerate import Accelerator, ParallelismConfig  # noqa: E402
from accelerate.big_modeling import _attach_context_parallel_hooks  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.experimental import context_parallel  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer  # noqa: E402

import liger_patch as lp  # noqa: E402
from liger_patch.patching.state import patch_state  # noqa: E402

CP = 2
IGNORE = -100
VOCAB = 131
# odd sizes; 5 query heads on 1 key-value head
CONFIG = dict(vocab_size=VOCAB, hidden_size=40, intermediate_size=72, num_attention_heads=5,
              num_key_value_heads=1, head_dim=8, max_position_embeddings=64)  # fmt: skip
TOL_LOSS, TOL_GRAD = 2e-5, 2e-4  # fp32: loss absolute, gradient relative (norm of the difference)


def batch_for(case: str) -> dict[str, torch.Tensor]:
    """A collator's batch (ids, all-ones mask, labels with ignored positions) of 3 rows.

    ``scattered``: length 20 (load-balanced chunks of 5); a prompt of 4, every odd and every
    even position ignored in one row each, so each position is ignored somewhere and kept
    somewhere. ``shard_all_ignored``: labels 6..15 ignored in every row, so the targets of rank
    1's positions 5..14 are all ignored and that shard's loss is exactly 0. ``unbalanced``:
    length 18 (not a multiple of 2 x cp: two contiguous halves), a prompt of 5.
    """
    seq = 18 if case == "unbalanced" else 20
    g = torch.Generator().manual_seed(len(case))
    input_ids = torch.randint(0, VOCAB, (3, seq), generator=g)
    labels = input_ids.clone()
    if case == "scattered":
        labels[0, :4] = IGNORE
        labels[1, 1::2] = IGNORE
        labels[2, 0::2] = IGNORE
    elif case == "shard_all_ignored":
        labels[:, 6:16] = IGNORE
    else:
        labels[:, :5] = IGNORE
    return dict(input_ids=input_ids, labels=labels, attention_mask=torch.ones_like(input_ids))


def _torch_cuts_unbalanced_lengths() -> bool:
    """Whether torch's ``context_parallel`` takes a length that is not a multiple of 2 x cp (torch
    2.13 cuts it into cp contiguous pieces; torch 2.11 load-balances every length and asserts
    ``seq_length % (world_size * 2) == 0``, for the Trainer's own call as much as for these)."""
    from torch.distributed.tensor.experimental._context_parallel import _load_balancer

    make_default = getattr(_load_balancer, "_create_default_load_balancer", None)
    return make_default is not None and make_default(18, CP, "cpu") is None


def unbalanced_case(case: str):
    """``case`` as a parameter, skipped with the reason where torch cannot shard its length."""
    refused = case == "unbalanced" and not _torch_cuts_unbalanced_lengths()
    reason = f"torch {torch.__version__}'s context_parallel refuses a length not a multiple of 2 x cp"
    return pytest.param(case, marks=pytest.mark.skipif(refused, reason=reason))


CASES = [unbalanced_case(case) for case in ("scattered", "shard_all_ignored", "unbalanced")]


def trainer_standin(mesh=None, average_tokens: bool = True) -> SimpleNamespace:
    """What the Trainer's methods called here read of ``self``: one rank of a 2-rank CP group
    (DDP or FSDP2 over the two), ``average_tokens_across_devices`` as given."""
    accelerator = SimpleNamespace(
        parallelism_config=ParallelismConfig(cp_size=CP),
        num_processes=CP,
        gather=lambda count: torch.stack([count] * CP),  # each rank of the group counted the same batch
    )
    if mesh is not None:  # what Accelerator._prepare_cp sets
        accelerator._cp_context = functools.partial(context_parallel, mesh=mesh)
        accelerator.maybe_context_parallel = functools.partial(
            Accelerator.maybe_context_parallel, accelerator
        )
    return SimpleNamespace(
        accelerator=accelerator,
        args=SimpleNamespace(average_tokens_across_devices=average_tokens, world_size=CP, n_gpu=1),
        model_accepts_loss_kwargs=True,
        compute_loss_func=None,
        label_smoother=None,
        _loss_shifts_labels=True,
        get_tp_size=lambda: 1,
        get_cp_size=lambda: CP,
        get_sp_size=lambda: 1,
    )


@contextlib.contextmanager
def cp_rank(rank: int):
    """A fake process group of ``CP`` ranks in which this process is ``rank``; its CP mesh."""
    dist.init_process_group("fake", rank=rank, world_size=CP, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (CP,), mesh_dim_names=("cp",))
    finally:
        dist.destroy_process_group()


def shard_inputs(model, batch: dict, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s model inputs, as the Trainer's training step makes them."""
    inputs = {name: tensor.clone() for name, tensor in batch.items()}
    with cp_rank(rank) as mesh, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cp_context, inputs = Trainer._prepare_context_parallel_inputs(trainer_standin(mesh), model, inputs)
        with cp_context():
            pass  # the buffers are sharded on entry and stay so (no_restore_buffers): the model runs here
    return inputs


def num_items(batch: dict, average_tokens: bool = True) -> torch.Tensor:
    """The Trainer's ``num_items_in_batch`` for ``batch``, counted before sharding."""
    return Trainer._get_num_items_in_batch(trainer_standin(average_tokens=average_tokens), [batch], "cpu")


def llama(layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG, num_hidden_layers=layers, attn_implementation="sdpa")
    return LlamaForCausalLM(config).train()


def pair(layers: int) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """(unpatched, patched) copies of one Llama, with the hooks accelerate's ``_prepare_cp`` adds."""
    reference = llama(layers)
    patched = copy.deepcopy(reference)
    lp.apply_liger_to(patched)
    for model in (reference, patched):
        _attach_context_parallel_hooks(model)
    return reference, patched


def training_loss(model, inputs: dict, count, average_tokens: bool = True) -> tuple[torch.Tensor, dict, bool]:
    """One rank's loss as the Trainer's ``compute_loss`` returns it, its gradients, and whether
    the fused path ran (no logits, and the patch says so)."""
    model.zero_grad(set_to_none=True)
    state = patch_state(model)
    if state is not None:
        state.fused_ran = False
    loss, outputs = Trainer.compute_loss(
        trainer_standin(average_tokens=average_tokens), model, inputs, True, num_items_in_batch=count
    )
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    fused = outputs.logits is None and state is not None and state.fused_ran
    return loss.detach(), grads, fused


def assert_same(loss, grads, expected_loss, expected_grads, what: str) -> None:
    assert abs(loss.item() - expected_loss.item()) <= TOL_LOSS, f"{what}: loss {loss} vs {expected_loss}"
    assert grads.keys() == expected_grads.keys()
    for name, expected in expected_grads.items():
        err = (grads[name] - expected).norm().item()
        assert err <= TOL_GRAD * expected.norm().item() + 1e-12, f"{what}: grad {name} off by {err:.2e}"


# the positions each rank keeps: load-balanced chunks of 5 (rank r: chunks r and 3 - r), or halves
POSITIONS = {
    "scattered": [[*range(0, 5), *range(15, 20)], [*range(5, 15)]],
    "unbalanced": [[*range(0, 9)], [*range(9, 18)]],
}


@pytest.mark.parametrize("case", [unbalanced_case(case) for case in POSITIONS])
def test_a_shard_gets_its_chunks_of_every_buffer_and_the_whole_batch_count(case):
    """The investigation above, checked: the keys, the chunks, the targets across shards, the count."""
    batch = batch_for(case)
    count = num_items(batch)
    assert count.dtype == torch.float32 and count.item() == batch["labels"][:, 1:].ne(IGNORE).sum().item()
    full_shift = torch.nn.functional.pad(batch["labels"], (0, 1), value=IGNORE)[:, 1:]
    shards = [shard_inputs(llama(0), batch, rank) for rank in range(CP)]
    for shard, kept in zip(shards, POSITIONS[case], strict=True):
        assert set(shard) == {"input_ids", "labels", "shift_labels", "attention_mask", "position_ids"}
        positions = torch.tensor(kept)
        assert torch.equal(shard["position_ids"], positions.expand(3, -1))
        assert torch.equal(shard["input_ids"], batch["input_ids"][:, positions])
        assert torch.equal(shard["labels"], batch["labels"][:, positions])
        assert torch.equal(shard["shift_labels"], full_shift[:, positions])
    # rank 0's last position before the gap predicts rank 1's first token: the shard's own labels
    # shifted would give it the next position of its own shard (or nothing) instead
    last = POSITIONS[case][0].index(POSITIONS[case][1][0] - 1)
    assert torch.equal(shards[0]["shift_labels"][:, last], shards[1]["labels"][:, 0])


@pytest.mark.parametrize("rank", range(CP))
@pytest.mark.parametrize("case", CASES)
def test_patched_shard_equals_unpatched(case, rank):
    """Each rank's call: the patched model's loss and every gradient equal the unpatched model's."""
    reference, patched = pair(layers=2)
    batch = batch_for(case)
    average_tokens = case != "unbalanced"  # off: the count is still divided by cp, the loss not scaled
    count = num_items(batch, average_tokens)
    inputs = shard_inputs(reference, batch, rank)
    expected_loss, expected_grads, unpatched_fused = training_loss(reference, inputs, count, average_tokens)
    loss, grads, fused = training_loss(patched, inputs, count, average_tokens)
    assert fused and not unpatched_fused
    assert_same(loss, grads, expected_loss, expected_grads, f"{case}, rank {rank}")
    if case == "shard_all_ignored" and rank == 1:
        assert loss.item() == 0.0 and all(g.abs().max() == 0 for g in grads.values())
    else:
        assert loss.item() > 0


@pytest.mark.parametrize("case", CASES)
def test_shards_add_up_to_the_full_sequence(case):
    """With no decoder layer (no position sees another) the mean over ranks of the Trainer's
    scaled losses, and of their gradients (the all-reduce), is the full sequence's mean loss and
    gradient, unpatched and without CP."""
    reference, patched = pair(layers=0)
    batch = batch_for(case)
    average_tokens = case != "unbalanced"
    count = num_items(batch, average_tokens)
    ranks = [
        training_loss(patched, shard_inputs(patched, batch, r), count, average_tokens) for r in range(CP)
    ]
    assert all(fused for _, _, fused in ranks)
    loss = torch.stack([loss for loss, _, _ in ranks]).mean()
    grads = {name: torch.stack([g[name] for _, g, _ in ranks]).mean(0) for name in ranks[0][1]}
    reference.zero_grad(set_to_none=True)
    full = reference(**batch).loss
    full.backward()
    full_grads = {name: p.grad for name, p in reference.named_parameters()}
    assert_same(loss, grads, full.detach(), full_grads, f"{case}: shards vs full sequence")
