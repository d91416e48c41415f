"""A refused forward goes on with the real logits: patched equals unpatched from the first step,
with dropout on, and the model's body runs once (its random draws, memory and time as unpatched).
Causal and encoder-decoder models alike; the reason is said once, and later calls run the
original path."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutput

import liger_patch as lp
from liger_patch.patching.state import patch_state
from tests.patching.custom_model import TinyMlpConfig, TinyMlpForCausalLM

VOCAB, HIDDEN = 64, 16


class CountedDropoutLM(TinyMlpForCausalLM):
    """A causal LM with dropout in its body, which counts how often its body runs; ``use`` is
    what its forward does with the logits before taking its loss from them."""

    def __init__(self, config: TinyMlpConfig, use=None) -> None:
        super().__init__(config)
        self.dropout = nn.Dropout(0.3)
        self.body_calls = 0
        self.use = use or (lambda logits: logits)

    def forward(self, input_ids=None, labels=None, **kwargs):
        self.body_calls += 1
        hidden = self.dropout(self.model(input_ids=input_ids).last_hidden_state)
        logits = self.use(self.lm_head(hidden))
        loss = None
        if labels is not None:
            flat = logits[:, :-1].reshape(-1, logits.shape[-1])
            loss = F.cross_entropy(flat, labels[:, 1:].reshape(-1))
        return CausalLMOutput(loss=loss, logits=logits)


REFUSED_USES = {
    "softmax-temperature": lambda logits: torch.log_softmax(logits, -1) * 0.5,
    "clamp": lambda logits: logits.clamp(-3.0, 3.0),
    "vocab-mask": lambda logits: logits.masked_fill(torch.arange(VOCAB) == 5, -1e4),
    "rsub": lambda logits: 0.0 - logits,
}


def make_pair(use, seed: int = 0) -> tuple[CountedDropoutLM, CountedDropoutLM]:
    torch.manual_seed(seed)
    reference = CountedDropoutLM(
        TinyMlpConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2), use
    )
    reference.train()
    patched = copy.deepcopy(reference)
    lp.apply_liger_to(patched)
    return reference, patched


def step(model: nn.Module, batch: dict, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training step from the RNG state ``seed``: its loss and every gradient."""
    model.zero_grad()
    torch.manual_seed(seed)
    output = model(**batch)
    output.loss.backward()
    return output.loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def batch(seed: int = 1) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("use", REFUSED_USES.values(), ids=REFUSED_USES)
def test_a_refused_model_equals_unpatched_from_its_first_step_and_runs_its_body_once(use):
    reference, patched = make_pair(use)
    for seed in (11, 12, 13):  # the first step too: dropout draws the same masks
        ref_loss, ref_grads = step(reference, batch(seed), seed)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss, grads = step(patched, batch(seed), seed)
        assert torch.equal(loss, ref_loss), (seed, loss, ref_loss)
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            assert torch.equal(grad, ref_grads[name]), name
        said = [w for w in caught if "keeps its original loss path" in str(w.message)]
        assert len(said) == (1 if seed == 11 else 0), [str(w.message) for w in caught]
    assert patched.body_calls == reference.body_calls == 3
    assert patch_state(patched).unfusable_reason


def test_the_refused_step_returns_the_real_logits_as_unpatched():
    reference, patched = make_pair(REFUSED_USES["clamp"])
    torch.manual_seed(3)
    want = reference(**batch())
    torch.manual_seed(3)
    with pytest.warns(UserWarning, match="clamp"):
        got = patched(**batch())
    assert got.logits is not None and torch.equal(got.logits, want.logits)


def test_a_fused_model_with_dropout_equals_unpatched_and_runs_its_body_once():
    reference, patched = make_pair(None)
    for seed in (11, 12):
        ref_loss, ref_grads = step(reference, batch(seed), seed)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loss, grads = step(patched, batch(seed), seed)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6)
    assert patched.body_calls == reference.body_calls == 2
    assert patch_state(patched).unfusable_reason is None


def test_a_refused_encoder_decoder_with_dropout_equals_unpatched_from_its_first_step():
    """BART with dropout 0.3 and a logits bias with no fused counterpart: the first step equals
    unpatched (before, the body ran twice and the dropout draws moved on)."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
        dropout=0.3, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = BartForConditionalGeneration(config).train()
    # a bias per batch row: not one constant per vocabulary entry, so no fused counterpart
    reference.register_buffer("final_logits_bias", torch.randn(2, 1, VOCAB))
    patched = copy.deepcopy(reference)
    calls = {"n": 0}
    for model in (reference, patched):
        model.model.forward = _counting(model.model, calls)
    lp.apply_liger_to(patched)
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    for seed in (5, 6):
        calls["n"] = 0
        ref_loss, _ = step(reference, {"input_ids": ids, "labels": ids}, seed)
        ref_calls, calls["n"] = calls["n"], 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss, _ = step(patched, {"input_ids": ids, "labels": ids}, seed)
        assert torch.equal(loss, ref_loss) and calls["n"] == ref_calls == 1
    assert "not one constant per vocabulary entry" in patch_state(patched).unfusable_reason


def _counting(module: nn.Module, calls: dict) -> object:
    body = type(module).forward

    def counted(*args, **kwargs):
        calls["n"] += 1
        return body(module, *args, **kwargs)

    return counted


def _masked_lm_pair(model_class, config) -> tuple[nn.Module, nn.Module, dict[str, torch.Tensor]]:
    """A masked LM of ``config`` (vocabulary 300) in train mode, a patched copy, and a batch with
    about 30 % of its tokens labelled."""
    torch.manual_seed(0)
    reference = model_class(config).train()
    patched = copy.deepcopy(reference)
    lp.apply_liger_to(patched)
    ids = torch.randint(5, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.masked_fill(torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) > 0.3, -100)
    return reference, patched, {"input_ids": ids, "labels": labels}


def test_a_head_that_is_not_the_projection_is_refused_saying_so():
    """DeBERTa-v2's non-legacy masked-LM head: ``get_output_embeddings()`` names its transform's
    dense layer, and the logits are a matmul with the input embedding's weight: refused, equal to
    unpatched, and the reason says the named layer is not vocabulary-sized."""
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM

    config = DebertaV2Config(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=64, legacy=False)  # fmt: skip
    reference, patched, masked = _masked_lm_pair(DebertaV2ForMaskedLM, config)
    try:
        want, _ = step(reference, masked, 4)
    except RuntimeError as why:  # transformers 4.57: its legacy=False head fails on its own
        pytest.skip(f"this transformers' DeBERTa-v2 legacy=False head fails unpatched: {why}")
    with pytest.warns(UserWarning, match="gives 32 outputs, not the vocabulary's 300"):
        got, _ = step(patched, masked, 4)
    assert torch.equal(got, want)


def test_a_head_whose_weight_is_used_but_never_called_is_refused_naming_who_uses_it():
    """MobileBERT's prediction head multiplies by its decoder's weight concatenated with another
    layer's and never calls the decoder: refused, equal to unpatched with dropout on, and the
    reason names the module that makes the logits from the weight. A forward that neither calls
    nor reads its head says the loss is its own."""
    from transformers import MobileBertConfig, MobileBertForMaskedLM

    config = MobileBertConfig(vocab_size=300, hidden_size=64, embedding_size=32, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=64, intra_bottleneck_size=32,
                              true_hidden_size=32, hidden_dropout_prob=0.3)  # fmt: skip
    reference, patched, masked = _masked_lm_pair(MobileBertForMaskedLM, config)
    want, want_grads = step(reference, masked, 4)
    made_by = "MobileBertLMPredictionHead.forward makes the logits from decoder.weight"
    with pytest.warns(UserWarning, match=made_by):
        got, grads = step(patched, masked, 4)
    assert torch.equal(got, want)
    assert all(torch.equal(grad, want_grads[name]) for name, grad in grads.items())
    assert "cls.predictions.decoder" in patch_state(patched).unfusable_reason

    class OwnLossLM(TinyMlpForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            hidden = self.model(input_ids=input_ids).last_hidden_state
            return CausalLMOutput(loss=hidden.pow(2).mean(), logits=hidden)

    own = OwnLossLM(TinyMlpConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1)).train()
    lp.apply_liger_to(own)
    own_loss = r"never called its output projection \(lm_head; the loss is its own\)"
    with pytest.warns(UserWarning, match=own_loss):
        own(**batch())
