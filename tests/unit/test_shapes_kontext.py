"""The shapes-kontext editing demo model: shapes-sd3's encoders reused as FLUX takes them, its pretraining
deterministic, the shipped weights loaded behind the Kontext adapter."""

import json
from dataclasses import asdict

import pytest
import torch
from safetensors.torch import load_file

from components.models import shapes_kontext, shapes_sd3
from components.models.config import ModelConfig
from components.models.flux.kontext import FluxKontextModel
from components.models.loading import load_model
from components.models.shapes_edit_pretrain import EditPretrainConfig, pretrain
from components.shapes.edits import BUILTIN_PATH


@pytest.fixture(scope="module")
def pipes():
    return shapes_kontext.build_architecture(0), shapes_sd3.load_shapes_sd3(48, 0)


def test_the_text_encoders_are_shapes_sd3s_as_flux_takes_them(pipes):
    kontext, sd3 = pipes
    ids = sd3.tokenizer(["make the blue square red", "add a green circle"], padding="max_length",
                        max_length=16, return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = sd3.text_encoder(ids, output_hidden_states=True).last_hidden_state
        pooled = kontext.text_encoder(ids).pooler_output
    eos = (ids == sd3.tokenizer.eos_token_id).int().argmax(-1)  # the first end token: CLIP's pooled position
    assert torch.equal(pooled, hidden[torch.arange(len(ids)), eos]) and pooled.shape[-1] == 32
    assert kontext.text_encoder_2 is not None
    for name, value in sd3.text_encoder_3.state_dict().items():
        assert torch.equal(kontext.text_encoder_2.state_dict()[name], value)
    assert kontext.transformer.config.pooled_projection_dim == 32
    assert kontext.transformer.config.joint_attention_dim == sd3.text_encoder_3.config.d_model


def test_every_built_in_instruction_fits_the_text_length_in_known_tokens(pipes):
    kontext, _ = pipes
    prompts = {json.loads(line)["prompt"] for line in BUILTIN_PATH.read_text().splitlines()}
    for tokenizer, size in ((kontext.tokenizer, kontext.text_encoder.config.vocab_size),
                            (kontext.tokenizer_2, kontext.text_encoder_2.config.vocab_size)):
        for prompt in prompts:
            ids = tokenizer(prompt).input_ids
            assert len(ids) <= shapes_sd3.TEXT_LENGTH and max(ids) < size, prompt
            assert tokenizer.unk_token_id not in ids[:-1], prompt  # CLIP's unknown is its end token


def test_pretraining_is_deterministic_and_does_not_depend_on_the_total_steps(tmp_path):
    tiny = {"triples": 12, "batch": 4, "sigma_groups": 2, "eval_triples": 2, "eval_steps": 1, "warmup": 2}
    three, log = pretrain(EditPretrainConfig(steps=3, **tiny), lambda *a: None, 2, tmp_path)
    again, _ = pretrain(EditPretrainConfig(steps=3, **tiny), lambda *a: None)
    two, _ = pretrain(EditPretrainConfig(steps=2, **tiny), lambda *a: None)
    for name, value in three.transformer.state_dict().items():
        assert torch.equal(again.transformer.state_dict()[name], value)
    snapshot = load_file(str(tmp_path / "step2.safetensors"))
    changed = 0
    for name, value in two.transformer.state_dict().items():
        assert torch.equal(snapshot[name], value)
        changed += not torch.equal(value, three.transformer.state_dict()[name])
    assert changed > 0 and set(log["held_out"]) == {"edit", "keep", "partial", "strict"}


@pytest.mark.skipif(not shapes_kontext.WEIGHTS.is_file(), reason="the shipped weights are built by the script")
def test_the_shipped_model_loads_behind_the_kontext_adapter():
    model = load_model(ModelConfig(kind="shapes-kontext", resolution=48, device="cpu"), seed=0)
    assert isinstance(model, FluxKontextModel) and model.guidance_mode == "none" and model.input_images == 1
    shipped = load_file(str(shapes_kontext.WEIGHTS))
    assert all(torch.equal(value, shipped[name]) for name, value in model.transformer.state_dict().items())
    log = json.loads(shapes_kontext.WEIGHTS.with_suffix(".json").read_text())
    assert log["config"] == asdict(EditPretrainConfig())  # the script's defaults rebuild the committed file
    with pytest.raises(ValueError, match="shapes-kontext demo model was trained at 48 px"):
        ModelConfig(kind="shapes-kontext", resolution=32)
