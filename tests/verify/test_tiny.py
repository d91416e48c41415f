"""Tiny random models and batches of any model type (the factory in liger_patch.verify).

A handful of representative types: a dense and a mixture-of-experts causal LM, and three
vision-language layouts (Gemma 3 pooled patches, LLaVA placeholders, Qwen2-VL patch grids).
Each builds, its batch ignores the first / middle / last position of every row, one training
step gives a finite loss and gradients, and the same seed gives the same loss twice.
"""

from __future__ import annotations

import pytest
import torch

from liger_patch.patching.derive import CAUSAL_LM, IMAGE_TEXT_TO_TEXT
from liger_patch.verify.batches import example_batch
from liger_patch.verify.config_rules import TinyModelError
from liger_patch.verify.configs import place_code_ranges, select_layers, tiny_config
from liger_patch.verify.models import model_class, model_types, tiny_model, tiny_model_from_config
from liger_patch.verify.sizes import VOCAB, VQ_CODES

CASES = [
    ("llama", CAUSAL_LM),
    ("qwen3_moe", CAUSAL_LM),
    ("gemma3", IMAGE_TEXT_TO_TEXT),
    ("llava", IMAGE_TEXT_TO_TEXT),
    ("qwen2_vl", IMAGE_TEXT_TO_TEXT),
]
IDS = [f"{task}:{model_type}" for model_type, task in CASES]


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _model(model_type: str, task: str, seed: int = 0) -> torch.nn.Module:
    """The tiny model, skipping a type the installed transformers does not have."""
    if model_type not in model_types(task):
        pytest.skip(f"transformers has no {task} class for {model_type}")
    return tiny_model(model_type, task, seed=seed)


def _loss(model: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    """The training loss of one forward on the example batch."""
    return model(**example_batch(model, seed=seed)).loss


def test_model_types_are_sorted_and_known():
    for task in (CAUSAL_LM, IMAGE_TEXT_TO_TEXT):
        types = model_types(task)
        assert types == sorted(types)
        assert len(types) > 20
    assert "llama" in model_types(CAUSAL_LM)
    assert model_class("llama", CAUSAL_LM).__name__ == "LlamaForCausalLM"


def test_an_unknown_type_or_task_raises():
    with pytest.raises(TinyModelError, match="no-such-type"):
        model_class("no-such-type", CAUSAL_LM)
    with pytest.raises(ValueError, match="unknown task"):
        model_types("fill-mask")


def test_tiny_config_shrinks_nested_configs():
    from transformers import AutoConfig

    config = tiny_config(AutoConfig.for_model("llava"))
    assert config.text_config.hidden_size <= 64
    assert config.text_config.num_hidden_layers == 2
    assert config.vision_config.hidden_size <= 64
    assert config.vision_config.num_hidden_layers == 2
    assert 0 <= config.image_token_id < config.text_config.vocab_size <= 300


@pytest.mark.parametrize(("model_type", "task"), CASES, ids=IDS)
def test_batch_ignores_first_middle_last(model_type, task):
    model = _model(model_type, task)
    batch = example_batch(model, batch_size=2, seq_len=16)
    labels = batch["labels"]
    length = labels.shape[1]
    assert labels.dtype == torch.int64 and batch["input_ids"].shape == labels.shape
    assert (labels[:, [0, length // 2, length - 1]] == -100).all()
    assert (labels != -100).any(dim=1).all()
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert value.dtype == torch.float32
    if task == IMAGE_TEXT_TO_TEXT:
        assert "pixel_values" in batch
        placeholders = batch["input_ids"] == model.config.image_token_id
        assert placeholders.any(dim=1).all()
        assert (labels[placeholders] == -100).all()


@pytest.mark.parametrize(("model_type", "task"), CASES, ids=IDS)
def test_training_step(model_type, task):
    model = _model(model_type, task)
    assert model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    loss = _loss(model)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize(("model_type", "task"), CASES, ids=IDS)
def test_same_seed_same_loss(model_type, task):
    first = _loss(_model(model_type, task, seed=3), seed=5)
    second = _loss(_model(model_type, task, seed=3), seed=5)
    assert torch.equal(first, second)
    other = _loss(_model(model_type, task, seed=4), seed=5)
    assert not torch.equal(first, other)


def test_tiny_model_from_config_picks_the_class():
    from transformers import AutoConfig

    model = tiny_model_from_config(AutoConfig.for_model("llava"))
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    model = tiny_model_from_config(AutoConfig.for_model("llama"), seed=1)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert torch.isfinite(_loss(model))


def test_an_unbuildable_type_names_itself():
    with pytest.raises(TinyModelError, match="gemma3n"):
        tiny_model("gemma3n", IMAGE_TEXT_TO_TEXT)


def test_layer_sections_keep_adding_up_and_keep_a_layer_each():
    """Counts that split the layers into sections (Dory: input, recurrent, output) are re-split
    over the kept layers; with ``span`` entries per layer, whole layers are kept."""
    kinds = ["sliding", "sliding", "sliding", "full"] * 3
    sections = {"n_in_layers": 3, "n_mid_layers": 6, "n_out_layers": 3}
    d = {"num_hidden_layers": 12, "layer_types": list(kinds), **sections}
    select_layers(d)
    assert d["num_hidden_layers"] == 3 and d["layer_types"] == ["sliding", "sliding", "full"]
    assert (d["n_in_layers"], d["n_mid_layers"], d["n_out_layers"]) == (1, 1, 1)
    paired = [entry for kind in kinds for entry in (kind, "mlp")]
    doubled = {key: 2 * count for key, count in sections.items()}
    d = {"num_hidden_layers": 24, "layer_types": paired, **doubled}
    select_layers(d, span=2)
    assert d["layer_types"] == ["sliding", "mlp", "sliding", "mlp", "full", "mlp"]
    assert d["num_hidden_layers"] == 6
    assert (d["n_in_layers"], d["n_mid_layers"], d["n_out_layers"]) == (2, 2, 2)


def test_a_config_writing_two_entries_per_layer_keeps_whole_layers():
    """Dory's dict form writes each layer as (attention, mlp) and doubles its counts."""
    from transformers import CONFIG_MAPPING

    if "dory" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no Dory")
    config = tiny_config(CONFIG_MAPPING["dory"]())
    sections = (config.n_input_layers, config.n_recurrent_layers, config.n_output_layers)
    assert sections == (1, 1, 1) and config.num_hidden_layers == len(config.layer_types) == 3


def test_counts_that_do_not_split_the_layers_are_left_alone():
    d = {"num_hidden_layers": 12, "layer_types": ["a", "b"] * 6, "num_dense_layers": 1, "n_extra_layers": 3}
    select_layers(d)
    assert d["num_hidden_layers"] == 2 and (d["num_dense_layers"], d["n_extra_layers"]) == (1, 3)


def test_code_ranges_are_laid_end_to_end_inside_the_tiny_vocabulary():
    tree = {"image_token_offset": 131272, "audio_token_offset": 262344, "text_config": {"vocab_size": VOCAB}}
    place_code_ranges(tree)
    image, audio = tree["image_token_offset"], tree["audio_token_offset"]
    assert image + VQ_CODES == audio and audio + VQ_CODES <= VOCAB
