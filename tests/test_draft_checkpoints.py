"""Official draft checkpoints (SPEC sections 2 and 7): bit-exact round trips, config parsing and every error."""

import json
import re
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from dflash_jax.checkpoints import orbax_io
from dflash_jax.checkpoints.official_draft import load_draft, save_draft
from dflash_jax.checkpoints.safetensors_io import CheckpointError
from dflash_jax.models.config import ConfigError, TargetConfig
from dflash_jax.models.draft_config import DraftConfig, default_target_layer_ids
from draft_tiny import HIDDEN, TARGET_LAYERS, VOCAB, official_config, write_official_draft

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    with safe_open(str(path), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def assert_tensors_bit_exact(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), k


def tiny_target(**overrides) -> TargetConfig:
    cfg = dict(model_type="qwen3", hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=TARGET_LAYERS,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB)
    cfg.update(overrides)
    return TargetConfig.from_dict(cfg, source="target.json")


# ------------------------------------------------------------------------------------------ round trips


@pytest.fixture(scope="module", params=sorted(DTYPES))
def stored(request, tmp_path_factory):
    """An official draft stored in fp32 or bf16 (with attention biases, so biases round-trip too)."""
    root = tmp_path_factory.mktemp(f"draft_{request.param}")
    cfg = official_config(attention_bias=True)
    write_official_draft(root / "official", cfg, seed=3, dtype=DTYPES[request.param])
    return request.param, root, cfg


def test_official_to_params_to_official_is_bit_exact(stored):
    name, root, _ = stored
    config, params = load_draft(root / "official")  # dtype=None keeps the stored dtype
    assert {str(leaf.dtype) for leaf in jax.tree.leaves(params)} == {name}
    out = save_draft(config, params, root / "exported")
    assert_tensors_bit_exact(read_tensors(root / "official" / "model.safetensors"),
                             read_tensors(out / "model.safetensors"))
    exported_cfg = json.loads((out / "config.json").read_text())
    assert exported_cfg["architectures"] == ["DFlashDraftModel"]
    assert exported_cfg["torch_dtype"] == name
    assert DraftConfig.from_json(out) == config


def test_exported_keys_follow_spec_section_7(stored):
    _, root, cfg = stored
    config, params = load_draft(root / "official")
    keys = set(read_tensors(save_draft(config, params, root / "keys") / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= keys
    assert not any(k.startswith("model.") or "embed" in k or "lm_head" in k for k in keys)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        for proj in ("q", "k", "v", "o"):
            assert p + f"self_attn.{proj}_proj.weight" in keys
            assert p + f"self_attn.{proj}_proj.bias" in keys
        assert {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight", p + "mlp.gate_proj.weight",
                p + "mlp.up_proj.weight", p + "mlp.down_proj.weight", p + "input_layernorm.weight",
                p + "post_attention_layernorm.weight"} <= keys


def test_orbax_round_trip_of_draft_params_is_bit_exact(stored):
    name, root, _ = stored
    config, params = load_draft(root / "official")
    orbax_io.save_params(root / "orbax", params, "draft", config.to_official_dict())
    assert orbax_io.is_orbax_dir(root / "orbax")
    restored, meta = orbax_io.restore_params(root / "orbax")
    assert orbax_io.trees_equal(params, restored)
    assert meta["kind"] == "draft"
    assert DraftConfig.from_dict(meta["config"]) == config
    # and back out to the official layout, still bit exact
    out = save_draft(DraftConfig.from_dict(meta["config"]), restored, root / "from_orbax")
    assert_tensors_bit_exact(read_tensors(root / "official" / "model.safetensors"),
                             read_tensors(out / "model.safetensors"))


def test_load_with_dtype_casts(stored):
    _, root, _ = stored
    _, params = load_draft(root / "official", dtype="float32")
    assert {str(leaf.dtype) for leaf in jax.tree.leaves(params)} == {"float32"}
    _, params = load_draft(root / "official", dtype="bfloat16")
    assert {str(leaf.dtype) for leaf in jax.tree.leaves(params)} == {"bfloat16"}


def test_trees_equal_detects_a_one_bit_change(stored):
    _, root, _ = stored
    _, params = load_draft(root / "official")
    changed = jax.tree.map(lambda a: a, params)
    w = np.array(changed["norm"]["weight"])
    w.view(np.uint16 if w.dtype.itemsize == 2 else np.uint32)[0] ^= 1
    changed["norm"]["weight"] = jax.numpy.asarray(w)
    assert not orbax_io.trees_equal(params, changed)


# ---------------------------------------------------------------------------------------- config parsing


def test_nested_and_top_level_dflash_fields_parse_the_same():
    nested = official_config()
    top = official_config()
    top.pop("dflash_config")
    top["target_layer_ids"] = [0, 2]
    top["mask_token_id"] = VOCAB - 1
    a, b = DraftConfig.from_dict(nested), DraftConfig.from_dict(top)
    assert a == b
    assert a.target_layer_ids == (0, 2) and a.mask_token_id == VOCAB - 1


def test_nested_dflash_fields_take_precedence_over_top_level():
    cfg = official_config(target_layer_ids=[1, 3], mask_token_id=5)
    parsed = DraftConfig.from_dict(cfg)
    assert parsed.target_layer_ids == (0, 2) and parsed.mask_token_id == VOCAB - 1


def test_block_size_and_num_target_layers_may_sit_in_dflash_config():
    cfg = official_config()
    cfg["dflash_config"].update(block_size=cfg.pop("block_size"), num_target_layers=cfg.pop("num_target_layers"))
    parsed = DraftConfig.from_dict(cfg)
    assert parsed.block_size == 8 and parsed.num_target_layers == TARGET_LAYERS


@pytest.mark.parametrize("num_target, num_draft, expected", [
    (36, 5, (1, 9, 17, 25, 33)),
    (24, 5, (1, 6, 11, 16, 21)),
    (32, 5, (1, 8, 15, 22, 29)),
    (36, 1, (18,)),
    (24, 1, (12,)),
    (7, 1, (3,)),
])
def test_default_target_layer_ids(num_target, num_draft, expected):
    assert default_target_layer_ids(num_target, num_draft) == expected


def test_default_target_layer_ids_used_when_absent():
    cfg = official_config(num_hidden_layers=5, num_target_layers=36, layer_types=None,
                          dflash_config={"mask_token_id": VOCAB - 1})
    assert DraftConfig.from_dict(cfg).target_layer_ids == (1, 9, 17, 25, 33)
    cfg = official_config(num_hidden_layers=1, num_target_layers=36, layer_types=None,
                          dflash_config={"mask_token_id": VOCAB - 1})
    assert DraftConfig.from_dict(cfg).target_layer_ids == (18,)


def test_optional_dflash_fields_default():
    parsed = DraftConfig.from_dict(official_config())
    assert parsed.input_embedding_scale == 1.0
    assert parsed.output_multiplier == 1.0
    assert parsed.final_logit_softcapping is None
    exported = parsed.to_official_dict()["dflash_config"]
    assert set(exported) == {"target_layer_ids", "mask_token_id"}


@pytest.mark.parametrize("where", ["nested", "top"])
def test_optional_dflash_fields_parse_and_export(where):
    extra = {"input_embedding_scale": 2.0, "output_multiplier": 0.5, "final_logit_softcapping": 30.0}
    cfg = official_config()
    if where == "nested":
        cfg["dflash_config"].update(extra)
    else:
        cfg.update(extra)
    parsed = DraftConfig.from_dict(cfg)
    assert (parsed.input_embedding_scale, parsed.output_multiplier, parsed.final_logit_softcapping) == (2.0, 0.5, 30.0)
    assert DraftConfig.from_dict(parsed.to_official_dict()) == parsed


def test_sliding_layers_and_rope_scaling_round_trip_through_export():
    cfg = official_config(layer_types=["sliding_attention", "full_attention"], sliding_window=16,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    parsed = DraftConfig.from_dict(cfg)
    assert parsed.sliding_window == 16 and parsed.rope.rope_type == "llama3"
    assert DraftConfig.from_dict(parsed.to_official_dict()) == parsed


def test_validate_against_accepts_a_matching_target():
    DraftConfig.from_dict(official_config()).validate_against(tiny_target())


@pytest.mark.parametrize("draft_overrides, target_overrides, pattern", [
    ({}, {"hidden_size": 32, "head_dim": 8}, r"hidden_size 64 != target hidden_size 32"),
    ({"dflash_config": {"target_layer_ids": [0, 7], "mask_token_id": 5}}, {},
     r"target_layer_ids contains 7, outside the target's 4 layers"),
    ({"dflash_config": {"target_layer_ids": [0, -1], "mask_token_id": 5}}, {},
     r"target_layer_ids contains -1, outside the target's 4 layers"),
    ({"dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 200}}, {},
     r"mask_token_id 200 is outside the target's embedding table \(vocab_size 97\)"),
    ({"dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 97}}, {},
     r"mask_token_id 97 is outside the target's embedding table \(vocab_size 97\)"),
    ({}, {"num_hidden_layers": 6}, r"num_target_layers 4 != target num_hidden_layers 6"),
])
def test_validate_against_errors_name_field_and_both_values(draft_overrides, target_overrides, pattern):
    draft = DraftConfig.from_dict(official_config(**draft_overrides))
    with pytest.raises(ConfigError, match=r"^draft\.json: .*" + pattern):
        draft.validate_against(tiny_target(**target_overrides), source="draft.json")


@pytest.mark.parametrize("overrides, pattern", [
    ({"dflash_config": {"target_layer_ids": [0, 2]}}, r"missing required field 'mask_token_id'"),
    ({"layer_types": ["full_attention", "local_attention"]},
     r"layer type 'local_attention' is not one of full_attention, sliding_attention"),
    ({"layer_types": ["full_attention"]}, r"layer_types has 1 entries but num_hidden_layers is 2"),
    ({"block_size": 1}, r"field 'block_size' must be between 2 and 1024, got 1"),
    ({"hidden_size": None}, r"missing required field 'hidden_size'"),
    ({"num_target_layers": None}, r"missing required field 'num_target_layers'"),
    ({"dflash_config": {"target_layer_ids": [], "mask_token_id": 5}}, r"target_layer_ids must be a non-empty list"),
    ({"dflash_config": "oops"}, r"'dflash_config' must be an object"),
    ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, r"rope type 'dynamic' is not supported"),
])
def test_from_dict_errors_name_field_and_value(overrides, pattern):
    with pytest.raises(ConfigError, match=r"^draft\.json: .*" + pattern):
        DraftConfig.from_dict(official_config(**overrides), source="draft.json")


def test_from_json_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"config\.json: draft config file not found"):
        DraftConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path}/config.json: not valid JSON")):
        DraftConfig.from_json(tmp_path)


# ------------------------------------------------------------------------------------------ load errors


def test_missing_tensor_names_key_and_checkpoint(tmp_path):
    weights = write_official_draft(tmp_path / "d", official_config())
    weights.pop("layers.1.mlp.up_proj.weight")
    save_file(weights, str(tmp_path / "d" / "model.safetensors"))
    pattern = re.escape(str(tmp_path / "d")) + r": missing 1 tensor.*'layers\.1\.mlp\.up_proj\.weight'"
    with pytest.raises(CheckpointError, match=pattern):
        load_draft(tmp_path / "d")


def test_wrong_shape_names_key_file_and_both_shapes(tmp_path):
    weights = write_official_draft(tmp_path / "d", official_config())
    weights["fc.weight"] = weights["fc.weight"][:, :-1].copy()
    save_file(weights, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'fc\.weight' has shape \[64, 127\], "
                                              r"expected \[64, 128\]"):
        load_draft(tmp_path / "d")


def test_pickle_only_directory_is_refused(tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(official_config()))
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*refused"):
        load_draft(d)


def test_target_style_prefixed_keys_are_refused(tmp_path):
    weights = write_official_draft(tmp_path / "d", official_config())
    save_file({"model." + k: v for k, v in weights.items()}, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model\.[a-z_.0-9]+' has a 'model\.' prefix"):
        load_draft(tmp_path / "d")


def test_missing_directory_and_corrupt_file(tmp_path):
    with pytest.raises(CheckpointError, match=r"nowhere: draft checkpoint directory not found"):
        load_draft(tmp_path / "nowhere")
    d = tmp_path / "corrupt"
    write_official_draft(d, official_config())
    (d / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        load_draft(d)


def test_sliding_window_settings_as_the_official_code_reads_them():
    """As transformers' Qwen3Config (the official code's config class) reads them, checked against it:
    use_sliding_window false (also its default, when absent) drops every window but keeps the layer types (a
    sliding layer stays causal inside the block); sliding_window null or 0 is no window; an absent one is 4096;
    without layer_types a layer is sliding iff a window is set and its index is >= max_window_layers (default
    28)."""
    from transformers import Qwen3Config

    for extra in ({"use_sliding_window": False}, {"use_sliding_window": None}, {"sliding_window": None},
                  {"sliding_window": 0}, {"drop": "sliding_window"}, {"drop": "use_sliding_window"}):
        raw = official_config(layer_types=["sliding_attention", "full_attention"], sliding_window=16)
        raw.pop(extra.pop("drop", None), None)
        raw.update(extra)
        if raw.get("use_sliding_window") is None:
            raw.pop("use_sliding_window", None)
        cfg = DraftConfig.from_dict(raw)
        hf = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("dflash_config", "architectures")})
        assert cfg.layer_types == tuple(hf.layer_types), extra
        assert cfg.sliding_window == (hf.sliding_window or None), (extra, hf.sliding_window)
        assert cfg.layer_causal == (True, False)
    off = DraftConfig.from_dict(official_config(layer_types=["sliding_attention", "full_attention"],
                                                sliding_window=16, use_sliding_window=False))
    assert off.sliding_window is None and off.layer_window(0) is None
    assert off.to_official_dict()["use_sliding_window"] is False
    by_index = DraftConfig.from_dict(official_config(layer_types=None, sliding_window=16, max_window_layers=1))
    assert by_index.layer_types == ("full_attention", "sliding_attention") and by_index.sliding_window == 16
    default = DraftConfig.from_dict(official_config(layer_types=None, sliding_window=16))
    assert default.layer_types == ("full_attention",) * 2  # 2 layers < the default max_window_layers 28
    assert DraftConfig.from_dict(official_config(layer_types=None)).layer_types == ("full_attention",) * 2
    with pytest.raises(ConfigError, match="field 'max_window_layers' must be an integer, got 'x'"):
        DraftConfig.from_dict(official_config(layer_types=None, sliding_window=16, max_window_layers="x"))
