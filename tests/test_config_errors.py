"""Malformed values a user may hand us: each is a ConfigError/CheckpointError naming the file and field."""

import json

import pytest

from dflash_jax.checkpoints import orbax_io
from dflash_jax.checkpoints.loading import load_draft_any, restore_orbax
from dflash_jax.checkpoints.safetensors_io import CheckpointError
from dflash_jax.models.config import ConfigError, TargetConfig
from draft_tiny import official_config
from engine_tiny import tiny_draft

BASE = dict(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, max_position_embeddings=64)


@pytest.mark.parametrize("extra, message", [
    (dict(rope_scaling=[1]), "rope_scaling must be an object"),
    (dict(rope_parameters="x"), "rope_parameters must be an object"),
    (dict(max_position_embeddings=None), "max_position_embeddings"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "'dynamic' is not supported"),
    (dict(model_type="mistral", sliding_window=4096), "sliding_window=4096 is not supported"),
    (dict(model_type="gemma"), "model_type 'gemma' is not supported"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_target_config_errors_name_the_field(extra, message):
    with pytest.raises(ConfigError, match=message) as e:
        TargetConfig.from_dict({**BASE, **extra}, source="some/config.json")
    assert str(e.value).startswith("some/config.json:")


def test_mistral_without_window_is_accepted():
    assert TargetConfig.from_dict({**BASE, "model_type": "mistral", "sliding_window": None}).model_type == "mistral"


def test_orbax_params_that_do_not_fit_their_config(tmp_path):
    config, params = tiny_draft()
    path = orbax_io.save_params(tmp_path / "d", params, "draft", config.to_official_dict())
    assert load_draft_any(path)[0] == config
    meta = json.loads((path / orbax_io.META_FILE).read_text())
    meta["config"]["dflash_config"]["target_layer_ids"] = [0, 1, 2]  # fc would need 3 features, it has 2
    (path / orbax_io.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"param 'fc/kernel' has shape \[128, 64\], expected \[192, 64\]"):
        load_draft_any(path)
    with pytest.raises(CheckpointError, match="holds a draft checkpoint, but a target was expected"):
        restore_orbax(path, "target")


def test_draft_config_max_positions_must_be_an_integer():
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        from dflash_jax.models.draft_config import DraftConfig

        DraftConfig.from_dict(official_config(max_position_embeddings="big"))
