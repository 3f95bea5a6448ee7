"""Hugging Face target checkpoints <-> params <-> Orbax: bit-exact round trips, sharded indexes, errors.

The reference checkpoints are tiny random models written by transformers' ``save_pretrained`` (needs torch).
"""

import json
import re
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from dflash_jax.checkpoints import orbax_io
from dflash_jax.checkpoints.hf_target import load_target, save_target
from dflash_jax.checkpoints.safetensors_io import INDEX_FILE, CheckpointError, SafetensorsDir, save_tensors
from dflash_jax.models.config import ConfigError, TargetConfig

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_tiny import make_hf_target  # noqa: E402

VARIANTS = ["qwen3_untied", "qwen3_tied", "llama3", "qwen2_bias", "qwen3_moe", "gpt_oss", "qwen3_5", "qwen3_5_moe",
            "qwen3_next"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_targets")
    for i, variant in enumerate(VARIANTS):
        make_hf_target(variant, root / variant, seed=i)
    return root


def esc(path) -> str:
    """A filesystem path as a literal regex fragment."""
    return re.escape(str(path))


def stored_tensors(path) -> dict[str, np.ndarray]:
    src = SafetensorsDir(path)
    return {k: src.get(k) for k in src.keys()}


def assert_tensors_bit_exact(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), k


def copy_with(src, dst, tensors: dict, config: dict | None = None):
    """A copy of checkpoint ``src`` holding ``tensors`` (and optionally another config.json)."""
    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text()) if config is None else config
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("variant", VARIANTS)
def test_save_target_writes_the_transformers_tensors_bit_exact(hf_dirs, tmp_path, variant):
    config, params = load_target(hf_dirs / variant)
    out = save_target(config, params, tmp_path / "out")
    assert_tensors_bit_exact(stored_tensors(hf_dirs / variant), stored_tensors(out))
    config2, params2 = load_target(out)
    assert config2 == config
    assert orbax_io.trees_equal(params, params2)
    assert ("lm_head" in params) == (not config.tie_word_embeddings)


@pytest.mark.parametrize("variant", ["qwen3_untied", "llama3"])
def test_orbax_round_trip_of_target_params_is_bit_exact(hf_dirs, tmp_path, variant):
    config, params = load_target(hf_dirs / variant)
    orbax_io.save_params(tmp_path / "orbax", params, "target", config.to_hf_dict())
    restored, meta = orbax_io.restore_params(tmp_path / "orbax")
    assert meta["kind"] == "target"
    assert TargetConfig.from_dict(meta["config"]) == config
    assert orbax_io.trees_equal(params, restored)


def test_config_export_reparses_equal(hf_dirs):
    for variant in VARIANTS:
        config = TargetConfig.from_json(hf_dirs / variant)
        assert TargetConfig.from_dict(config.to_hf_dict()) == config


def test_sharded_index_loads_like_the_single_file(hf_dirs, tmp_path):
    src = hf_dirs / "qwen3_untied"
    tensors = stored_tensors(src)
    sharded = tmp_path / "sharded"
    paths = save_tensors(tensors, sharded, max_shard_bytes=20_000)
    assert len(paths) > 2 and (sharded / INDEX_FILE).is_file() and not (sharded / "model.safetensors").exists()
    weight_map = json.loads((sharded / INDEX_FILE).read_text())["weight_map"]
    assert sorted(weight_map) == sorted(tensors)
    shutil.copy(src / "config.json", sharded / "config.json")
    config, single = load_target(src)
    config2, from_shards = load_target(sharded)
    assert config2 == config
    assert orbax_io.trees_equal(single, from_shards)


def test_sharded_index_with_a_missing_shard_is_refused(hf_dirs, tmp_path):
    sharded = tmp_path / "sharded"
    paths = save_tensors(stored_tensors(hf_dirs / "qwen3_untied"), sharded, max_shard_bytes=20_000)
    shutil.copy(hf_dirs / "qwen3_untied" / "config.json", sharded / "config.json")
    paths[1].unlink()
    with pytest.raises(CheckpointError, match=rf"{INDEX_FILE}: shard {paths[1].name} is listed but missing"):
        load_target(sharded)


def test_keys_without_model_prefix_load_too(hf_dirs, tmp_path):
    src = hf_dirs / "qwen3_untied"
    bare = {k.removeprefix("model."): v for k, v in stored_tensors(src).items()}
    assert "embed_tokens.weight" in bare and "lm_head.weight" in bare
    dst = copy_with(src, tmp_path / "bare", bare)
    _, expected = load_target(src)
    _, got = load_target(dst)
    assert orbax_io.trees_equal(expected, got)


def test_bf16_load_gives_bf16_params(hf_dirs, tmp_path):
    config, params = load_target(hf_dirs / "qwen3_tied", dtype="bfloat16")
    assert {str(leaf.dtype) for leaf in jax.tree.leaves(params)} == {"bfloat16"}
    _, fp32 = load_target(hf_dirs / "qwen3_tied")
    cast = jax.tree.map(lambda a: a.astype(jax.numpy.bfloat16), fp32)
    assert orbax_io.trees_equal(params, cast)
    # bf16 stored weights, loaded keeping the stored dtype, round-trip bit exact through safetensors and Orbax
    out = save_target(config, params, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, kept = load_target(out, dtype=None)
    assert orbax_io.trees_equal(params, kept)
    orbax_io.save_params(tmp_path / "orbax", kept, "target", config.to_hf_dict())
    assert orbax_io.trees_equal(kept, orbax_io.restore_params(tmp_path / "orbax")[0])


# ---------------------------------------------------------------------------------------------- errors


def test_missing_tensor_names_the_key(hf_dirs, tmp_path):
    src = hf_dirs / "llama3"
    tensors = stored_tensors(src)
    tensors.pop("model.layers.1.self_attn.v_proj.weight")
    dst = copy_with(src, tmp_path / "missing", tensors)
    pattern = re.escape(str(dst)) + r": missing 1 tensor.*'model\.layers\.1\.self_attn\.v_proj\.weight'"
    with pytest.raises(CheckpointError, match=pattern):
        load_target(dst)


def test_wrong_shape_names_key_file_and_shapes(hf_dirs, tmp_path):
    src = hf_dirs / "qwen3_untied"
    tensors = stored_tensors(src)
    tensors["model.layers.0.mlp.down_proj.weight"] = np.zeros((64, 100), np.float32)
    dst = copy_with(src, tmp_path / "shape", tensors)
    pattern = (rf"{esc(dst)}/model\.safetensors: tensor 'model\.layers\.0\.mlp\.down_proj\.weight' "
               r"has shape \[64, 100\], expected \[64, 128\]")
    with pytest.raises(CheckpointError, match=pattern):
        load_target(dst)


def test_bad_config_json_names_file_and_field(hf_dirs, tmp_path):
    src = hf_dirs / "qwen3_untied"
    good = json.loads((src / "config.json").read_text())
    tensors = stored_tensors(src)

    dst = copy_with(src, tmp_path / "gpt2", tensors, {**good, "model_type": "gpt2"})
    with pytest.raises(ConfigError, match=rf"{esc(dst)}/config\.json: model_type 'gpt2' is not supported"):
        load_target(dst)

    cfg = dict(good)
    cfg.pop("hidden_size")
    dst = copy_with(src, tmp_path / "nohidden", tensors, cfg)
    with pytest.raises(ConfigError, match=rf"{esc(dst)}/config\.json: missing required field 'hidden_size'"):
        load_target(dst)

    dst = copy_with(src, tmp_path / "notjson", tensors)
    (dst / "config.json").write_text("{'single quotes': 1}")
    with pytest.raises(ConfigError, match=rf"{esc(dst)}/config\.json: not valid JSON"):
        load_target(dst)

    dst = copy_with(src, tmp_path / "noconfig", tensors)
    (dst / "config.json").unlink()
    with pytest.raises(ConfigError, match=rf"{esc(dst)}/config\.json: config file not found"):
        load_target(dst)

    rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}  # 5.x layout, as save_pretrained writes
    dst = copy_with(src, tmp_path / "yarn", tensors, {**good, "rope_parameters": rope})
    with pytest.raises(ConfigError, match=rf"{esc(dst)}/config\.json \(rope scaling\): missing required field "
                                          "'original_max_position_embeddings'"):
        load_target(dst)
    rope = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    dst = copy_with(src, tmp_path / "rope", tensors, {**good, "rope_parameters": rope})
    with pytest.raises(ConfigError, match=rf"{esc(dst)}/config\.json: rope type 'dynamic' is not supported"):
        load_target(dst)


def test_unusable_weights_are_refused(hf_dirs, tmp_path):
    with pytest.raises(CheckpointError, match=r"nowhere: target checkpoint directory not found"):
        load_target(tmp_path / "nowhere")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(hf_dirs / "llama3" / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*refused"):
        load_target(pickled)
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(hf_dirs / "llama3" / "config.json", empty / "config.json")
    with pytest.raises(CheckpointError, match=rf"{esc(empty)}: no \.safetensors weights found"):
        load_target(empty)
    with pytest.raises(ValueError, match=r"unknown dtype 'float8'"):
        load_target(hf_dirs / "llama3", dtype="float8")
