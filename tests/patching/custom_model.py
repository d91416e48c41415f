"""A user's own causal LM, written the standard way (not in transformers, no registry row):
a body returning hidden states, a linear ``lm_head``, ``self.loss_function`` for the loss and a
logit scale read from the config. ``apply_liger_to`` must patch it with no registration, and
``python -m liger_patch verify --model tests.patching.custom_model:TinyMlpForCausalLM`` must
verify it."""

from __future__ import annotations

import torch
import torch.nn as nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput


class TinyMlpConfig(PretrainedConfig):
    model_type = "tiny_mlp_lm"

    def __init__(self, vocab_size=512, hidden_size=256, num_hidden_layers=3, logit_scale=0.5, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.logit_scale = logit_scale
        kwargs.setdefault("tie_word_embeddings", False)  # 4.57 would tie by default
        super().__init__(**kwargs)


class TinyMlpModel(PreTrainedModel):
    config_class = TinyMlpConfig

    def __init__(self, config: TinyMlpConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(config.hidden_size), nn.Linear(config.hidden_size, config.hidden_size))
            for _ in range(config.num_hidden_layers)
        )
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, **kwargs) -> BaseModelOutput:
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = hidden + torch.tanh(layer(hidden))
        return BaseModelOutput(last_hidden_state=hidden)


class TinyMlpForCausalLM(PreTrainedModel):
    config_class = TinyMlpConfig

    def __init__(self, config: TinyMlpConfig) -> None:
        super().__init__(config)
        self.model = TinyMlpModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs) -> CausalLMOutput:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.lm_head(hidden) * self.config.logit_scale
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
        return CausalLMOutput(loss=loss, logits=logits)
