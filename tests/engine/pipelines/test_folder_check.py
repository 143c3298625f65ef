"""A broken model folder is refused in one line naming the file and the problem,
before any worker starts (EngineConfig) and, for what only loading finds, from
the worker as one line too."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from diffrt.engine import EngineConfig, EngineConfigError
from diffrt.engine.models.embedded import embedded_folder
from diffrt.engine.models.folder_check import ModelLoadError, check_model_folder
from diffrt.engine.pipelines.load import load_pipeline


@pytest.fixture(scope="module")
def good_folder():
    return Path(embedded_folder("tiny-flux"))


@pytest.fixture
def folder(good_folder, tmp_path):
    copy = tmp_path / "flux"
    shutil.copytree(good_folder, copy)
    return copy


def weights(folder, component: str = "transformer"):
    [path] = (folder / component).glob("*.safetensors")
    return path


def _truncate(folder):
    path = weights(folder)
    os.truncate(path, path.stat().st_size - 100)
    return path, "truncated"


def _missing_vae(folder):
    shutil.rmtree(folder / "vae")
    return folder / "vae", "missing (model_index.json lists component 'vae')"


def _corrupt_config(folder):
    path = folder / "transformer" / "config.json"
    path.write_text('{"_class_name": "FluxTransformer2DModel",')
    return path, "not valid JSON"


def _index_is_a_list(folder):
    path = folder / "model_index.json"
    path.write_text(json.dumps(["transformer", "vae"]))
    return path, "must hold a JSON object, found a list"


def _header_only(folder):
    path = weights(folder, "vae")
    path.write_bytes(b"\x10\x00")
    return path, "truncated"


def _no_text_encoder(folder):
    path = folder / "model_index.json"
    index = json.loads(path.read_text())
    del index["text_encoder"]
    path.write_text(json.dumps(index))
    return path, "lists no text_encoder"


def _edit(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _no_vae_weights(folder):
    weights(folder, "vae").unlink()
    return folder / "vae", "component 'vae' has a config.json but no weights"


def _more_layers(folder):
    _edit(folder / "transformer" / "config.json", num_layers=3)
    return folder / "transformer", "transformer_blocks: 2 in the weights, 3 by config.json"


def _other_head_count(folder):
    _edit(folder / "transformer" / "config.json", num_attention_heads=4)
    return folder / "transformer", "in the weights, [64"


def _other_vae_channels(folder):
    _edit(folder / "vae" / "config.json", block_out_channels=[32, 32, 64, 128])
    return folder / "vae", "component 'vae' do not match its config.json"


def _unknown_pipeline(folder):
    _edit(folder / "model_index.json", _class_name="NoSuchPipeline")
    return folder / "model_index.json", "pipeline _class_name 'NoSuchPipeline' is not a"


def _unknown_component_class(folder):
    index = json.loads((folder / "model_index.json").read_text())
    _edit(folder / "model_index.json", vae=[index["vae"][0], "NoSuchAutoencoder"])
    return folder / "model_index.json", "component 'vae' class 'NoSuchAutoencoder'"


BREAKAGES = [_truncate, _missing_vae, _corrupt_config, _index_is_a_list, _header_only,
             _no_text_encoder, _no_vae_weights, _more_layers, _other_head_count,
             _other_vae_channels, _unknown_pipeline, _unknown_component_class]


def test_a_good_folder_passes(good_folder):
    assert check_model_folder(str(good_folder))["transformer"][1] == "FluxTransformer2DModel"


@pytest.mark.parametrize("breakage", BREAKAGES, ids=lambda f: f.__name__.strip("_"))
def test_a_broken_folder_is_refused_naming_the_file(folder, breakage):
    path, problem = breakage(folder)
    with pytest.raises(EngineConfigError) as info:
        EngineConfig(model=str(folder)).model_spec()
    message = str(info.value)
    assert info.value.field == "model"
    assert str(path.resolve()) in message and problem in message
    assert "\n" not in message


def test_what_only_loading_finds_is_one_line_too(folder):
    # A config that parses but that diffusers cannot build a model from.
    config = folder / "vae" / "config.json"
    data = json.loads(config.read_text())
    data["block_out_channels"] = "not a list"
    config.write_text(json.dumps(data))
    with pytest.raises(ModelLoadError) as info:
        load_pipeline(str(folder))
    assert str(folder) in str(info.value) and "\n" not in str(info.value)
