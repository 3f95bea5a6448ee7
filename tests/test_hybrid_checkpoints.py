"""Hybrid target checkpoints (Qwen3.5, Qwen3-Next), written by transformers itself.

- A multimodal Qwen3.5 directory (``model_type: qwen3_5`` with ``text_config``, weights under
  ``model.language_model.``, a vision tower and an MTP head beside it) loads exactly like the text-only
  checkpoint; the skipped towers are noted in the log.
- transformers reads back what ``save_target`` writes (Qwen3-Next's grouped projections re-fused): the same
  logits as the original model (1e-5, float32).
- Bad input is one clear error naming the file and the key or field: a missing linear-attention tensor, a
  conv kernel of the wrong shape, head counts that do not divide, bad ``layer_types``, a config without its
  ``text_config`` (a vision-only directory).
"""

import json
import logging
import re

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from dflash_jax.checkpoints.hf_target import load_target, save_target
from dflash_jax.checkpoints.safetensors_io import CheckpointError, SafetensorsDir
from dflash_jax.models.config import ConfigError
from dflash_jax.models.target import TargetModel

torch = pytest.importorskip("torch")

from hf_tiny import make_hf_target  # noqa: E402


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    models = {v: make_hf_target(v, root / v, seed=i) for i, v in enumerate(("qwen3_5", "qwen3_next"))}
    return root, models


def tensors_of(path):
    src = SafetensorsDir(path)
    return {k: src.get(k) for k in src.keys()}


def write(dst, tensors, config):
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def config_of(path):
    return json.loads((path / "config.json").read_text())


def test_multimodal_qwen3_5_layout_loads_like_the_text_checkpoint(dirs, tmp_path, caplog):
    root, _ = dirs
    text = root / "qwen3_5"
    tensors = {("lm_head.weight" if k == "lm_head.weight" else "model.language_model." + k[len("model."):]): v
               for k, v in tensors_of(text).items()}
    tensors["model.visual.patch_embed.proj.weight"] = np.zeros((4, 3), np.float32)
    tensors["mtp.fc.weight"] = np.zeros((4, 4), np.float32)
    text_cfg = config_of(text)
    nested = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "tie_word_embeddings": text_cfg.pop("tie_word_embeddings"), "text_config": text_cfg,
              "vision_config": {"model_type": "qwen3_5", "depth": 1}}
    multi = write(tmp_path / "multi", tensors, nested)
    with caplog.at_level(logging.INFO, logger="dflash_jax.checkpoints.hf_target"):
        config_m, params_m = load_target(multi)
    config_t, params_t = load_target(text)
    assert config_m == config_t
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), params_m, params_t))
    notes = " ".join(r.getMessage() for r in caplog.records)
    assert "1 tensor(s) of the vision tower" in notes and "1 tensor(s) of the multi-token prediction head" in notes


@pytest.mark.parametrize("variant", ["qwen3_5", "qwen3_next"])
def test_transformers_reads_what_save_target_writes(dirs, tmp_path, variant):
    import transformers

    root, models = dirs
    config, params = load_target(root / variant)
    out = save_target(config, params, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]])
    with torch.no_grad():
        ref, ours = models[variant](ids).logits.numpy(), reloaded(ids).logits.numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)
    mine = TargetModel(config).apply({"params": params}, ids.numpy().astype(np.int32),
                                     np.arange(ids.shape[1], dtype=np.int32)[None]).logits
    np.testing.assert_allclose(np.asarray(mine), ref, atol=1e-4, rtol=0)


def test_broken_linear_attention_tensors_are_clear_errors(dirs, tmp_path):
    root, _ = dirs
    src = root / "qwen3_next"
    tensors = tensors_of(src)
    missing = {k: v for k, v in tensors.items() if k != "model.layers.2.linear_attn.in_proj_ba.weight"}
    bad = write(tmp_path / "missing", missing, config_of(src))
    with pytest.raises(CheckpointError, match=re.escape("'model.layers.2.linear_attn.in_proj_ba.weight'")):
        load_target(bad)
    conv = dict(tensors, **{"model.layers.0.linear_attn.conv1d.weight": np.zeros((64, 1, 3), np.float32)})
    bad = write(tmp_path / "conv", conv, config_of(src))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.linear_attn\.conv1d\."
                                              r"weight' has shape \[64, 1, 3\], expected \[64, 1, 4\]"):
        load_target(bad)
    ints = dict(tensors, **{"model.layers.0.linear_attn.A_log": np.zeros((4,), np.int32)})
    bad = write(tmp_path / "ints", ints, config_of(src))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.linear_attn\.A_log' is stored as I32"):
        load_target(bad)


@pytest.mark.parametrize("change, message", [
    ({"linear_num_value_heads": 3}, r"linear_num_value_heads \(3\) must be a multiple of linear_num_key_heads \(2\)"),
    ({"layer_types": ["linear_attention"] * 3}, r"'layer_types' must list 'linear_attention' or 'full_attention' "
                                                r"for each of the 4 layers"),
    ({"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]}, r"'layer_types'"),
    ({"partial_rotary_factor": 0.1, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                        "partial_rotary_factor": 0.1}},
     r"partial_rotary_factor 0\.1 gives 1 rotary dims"),
    ({"linear_conv_kernel_dim": 1}, r"'linear_conv_kernel_dim' must be between 2 and 64"),
    ({"linear_key_head_dim": None}, r"missing required field 'linear_key_head_dim'"),
])
def test_bad_hybrid_configs_name_the_field(dirs, tmp_path, change, message):
    root, _ = dirs
    cfg = {**config_of(root / "qwen3_5"), **change}
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=re.escape(str(bad / "config.json")) + ".*" + message):
        load_target(bad)


def test_a_vision_only_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "vision_config": {"depth": 2}}))
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "config.json")) + r": a 'qwen3_5' config needs "
                                          r"a 'text_config' object \(the language model\); got none: a vision-only"):
        load_target(tmp_path)
