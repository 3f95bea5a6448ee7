"""Expert checkpoints (Qwen3-MoE, gpt-oss): every stored layout loads to the same params, MXFP4 experts decode
as transformers decodes them, and every kind of broken expert tensor or config is one clear error naming the
file and the tensor or field.

The references are tiny random models written by transformers' ``save_pretrained`` (per-expert tensors for
Qwen3-MoE, fused interleaved ones for gpt-oss) and transformers' own MXFP4 decoder.
"""

import json
import re

import numpy as np
import pytest
from safetensors.numpy import save_file

from dflash_jax.checkpoints.hf_target import load_target
from dflash_jax.checkpoints.safetensors_io import CheckpointError, SafetensorsDir
from dflash_jax.models import mxfp4
from dflash_jax.models.config import ConfigError

torch = pytest.importorskip("torch")

from hf_tiny import make_hf_target  # noqa: E402

E, H = 4, 64  # the tiny variants' experts and width (tests/hf_tiny.py)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    for name in ("qwen3_moe", "gpt_oss"):
        make_hf_target(name, root / name)
    return root


def tensors_of(path) -> dict:
    src = SafetensorsDir(path)
    return {k: src.get(k) for k in src.keys()}


def write(dst, config: dict, tensors: dict):
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def config_of(path) -> dict:
    return json.loads((path / "config.json").read_text())


def same_params(a, b):
    import jax

    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def test_fused_qwen_experts_load_like_per_expert_ones(dirs, tmp_path):
    """transformers' in-memory layout (gate_up_proj [E, 2I, H], gate rows first; down_proj [E, H, I])."""
    src = dirs / "qwen3_moe"
    t = tensors_of(src)
    fused = {k: v for k, v in t.items() if ".mlp.experts." not in k}
    for layer in (0, 2):  # layer 1 is dense (mlp_only_layers)
        base = f"model.layers.{layer}.mlp.experts"
        gate = np.stack([t[f"{base}.{j}.gate_proj.weight"] for j in range(E)])
        up = np.stack([t[f"{base}.{j}.up_proj.weight"] for j in range(E)])
        fused[f"{base}.gate_up_proj"] = np.concatenate([gate, up], axis=1)
        fused[f"{base}.down_proj"] = np.stack([t[f"{base}.{j}.down_proj.weight"] for j in range(E)])
    _, want = load_target(src)
    _, got = load_target(write(tmp_path / "fused", config_of(src), fused))
    same_params(got, want)
    assert "experts" not in got["layers_1"]["mlp"] and "gate_proj" in got["layers_1"]["mlp"]


def test_mxfp4_experts_decode_like_transformers(dirs, tmp_path):
    """Random MXFP4 blocks and scales in place of gpt-oss's float experts: the loaded (dequantised, gate and
    up de-interleaved) params equal transformers' own decoding of the same bytes."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src = dirs / "gpt_oss"
    t = tensors_of(src)
    rng = np.random.default_rng(0)
    packed = {k: v for k, v in t.items() if not re.search(r"experts\.(gate_up|down)_proj$", k)}
    reference = {}
    for key in [k for k in t if re.search(r"experts\.(gate_up|down)_proj$", k)]:
        _, in_f, out_f = t[key].shape  # [E, in, out]
        b_shape, s_shape = mxfp4.packed_shapes(in_f, out_f, E)
        blocks = rng.integers(0, 256, b_shape, dtype=np.uint8)
        scales = rng.integers(120, 131, s_shape, dtype=np.uint8)
        packed[key + "_blocks"], packed[key + "_scales"] = blocks, scales
        reference[key] = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                    dtype=torch.float32).numpy()
        assert reference[key].shape == t[key].shape
    _, params = load_target(write(tmp_path / "mxfp4", config_of(src), packed))
    for layer in range(3):
        ex = params[f"layers_{layer}"]["mlp"]["experts"]
        gate_up = reference[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        np.testing.assert_array_equal(np.asarray(ex["gate_proj"]), gate_up[..., 0::2])
        np.testing.assert_array_equal(np.asarray(ex["up_proj"]), gate_up[..., 1::2])
        np.testing.assert_array_equal(np.asarray(ex["down_proj"]), reference[f"model.layers.{layer}.mlp.experts.down_proj"])


def broken(src, dst, drop=(), replace=None, config=None):
    t = {k: v for k, v in tensors_of(src).items() if k not in drop}
    t.update(replace or {})
    return write(dst, config or config_of(src), t)


def test_broken_expert_tensors_are_clear_errors(dirs, tmp_path):
    q, g = dirs / "qwen3_moe", dirs / "gpt_oss"
    qt, gt = tensors_of(q), tensors_of(g)
    key = "model.layers.2.mlp.experts.3.up_proj.weight"
    dst = broken(q, tmp_path / "missing", drop=[key])
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(dst))}: missing 1 tensor\(s\): '{re.escape(key)}'"):
        load_target(dst)
    dst = broken(q, tmp_path / "shape", replace={key: qt[key][:, :-1]})
    with pytest.raises(CheckpointError, match=rf"tensor '{re.escape(key)}' has shape \[32, 63\], expected \[32, 64\]"):
        load_target(dst)
    dst = broken(q, tmp_path / "dtype", replace={key: qt[key].astype(np.int32)})
    with pytest.raises(CheckpointError, match=rf"tensor '{re.escape(key)}' is stored as I32"):
        load_target(dst)
    router = "model.layers.0.mlp.gate.weight"
    dst = broken(q, tmp_path / "router", replace={router: np.zeros((E + 1, H), np.float32)})
    with pytest.raises(CheckpointError, match=rf"tensor '{re.escape(router)}' has shape \[5, 64\], expected \[4, 64\]"):
        load_target(dst)
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    dst = broken(g, tmp_path / "fused", replace={fused: gt[fused][:, :, :-2]})
    with pytest.raises(CheckpointError, match=rf"tensor '{re.escape(fused)}' has shape \[4, 64, 62\], expected "
                                              r"\[4, 64, 64\]"):
        load_target(dst)
    b_shape, s_shape = mxfp4.packed_shapes(H, 64, E)
    dst = broken(g, tmp_path / "blocks", drop=[fused], replace={
        fused + "_blocks": np.zeros(b_shape, np.float32), fused + "_scales": np.zeros(s_shape, np.uint8)})
    with pytest.raises(CheckpointError, match=rf"tensor '{re.escape(fused)}_blocks' is stored as F32; MXFP4"):
        load_target(dst)
    dst = broken(g, tmp_path / "scales", drop=[fused], replace={fused + "_blocks": np.zeros(b_shape, np.uint8)})
    with pytest.raises(CheckpointError, match=rf"missing 1 tensor\(s\): '{re.escape(fused)}_scales'"):
        load_target(dst)


@pytest.mark.parametrize("family, change, message", [
    ("qwen3_moe", {"num_experts_per_tok": 5}, r"field 'num_experts_per_tok' must be between 1 and 4, got 5"),
    ("qwen3_moe", {"mlp_only_layers": [3]}, r"field 'mlp_only_layers' must be a list of layer indices in 0\.\.2"),
    ("qwen3_moe", {"moe_intermediate_size": None}, r"missing required field 'moe_intermediate_size'"),
    ("gpt_oss", {"layer_types": ["full_attention"]}, r"field 'layer_types' must list"),
    ("gpt_oss", {"sliding_window": None}, r"sliding_attention layers need a 'sliding_window'"),
    ("gpt_oss", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.5e5, "factor": 32.0,
                                     "original_max_position_embeddings": 4096}}, r"rope type 'longrope' is not supported"),
])
def test_bad_expert_configs_name_the_field(dirs, tmp_path, family, change, message):
    src = dirs / family
    dst = broken(src, tmp_path / "cfg", config={**config_of(src), **change})
    with pytest.raises(ConfigError, match=rf"{re.escape(str(dst))}/config\.json.*{message}"):
        load_target(dst)
