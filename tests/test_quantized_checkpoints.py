"""Quantised target checkpoints (``checkpoints/quantized``): block-scaled FP8 and compressed-tensors INT4,
dequantised at load for every family.

References, all independent of the loader's code:

- FP8 (``quant_method: "fp8"`` and compressed-tensors ``float-quantized``): weights quantised by tests/quant_tiny.py
  (per-block amax / 448, e4m3 rounding by ml_dtypes) and decoded there by an index formula (``w8[i, j] * s[i // bn, j // bk]`` through explicit index arrays, codes cast by ml_dtypes, not the
  loader's table and pad/reshape), and by transformers' own ``Fp8Dequantize`` where the shapes are multiples
  of the block (it refuses others). Blocks of 16 x 16 on hidden-64 models, shapes that are not multiples.
- INT4: values packed by tests/quant_tiny.py in compressed-tensors' ``pack_to_int32`` layout (value + 8,
  element 8g + k in bits 4k..4k+3 of word g; its words checked against hand-computed ones), decoded there by
  ``q * scale[r, c // group]``, and one word decoded by hand.
- End to end: tiny transformers models (qwen3 dense, qwen3_moe and minimax_m2 with per-expert tensors) saved by
  ``save_pretrained`` and quantised here; ``load_target`` of the quantised directory equals, bit for bit, the
  params ``load_target`` reads from a float checkpoint holding this file's own decoding of the same weights,
  and the FP8 qwen3's logits and every layer's features are within 1e-4 (scaled by magnitude) of
  transformers' model loaded from that float checkpoint (measured: about 1e-6, float32 on CPU).
- Bad checkpoints and configs: each one ``CheckpointError`` naming the file and the key or field.
"""

import json
import re

import ml_dtypes
import numpy as np
import pytest

from dflash_jax.checkpoints.hf_target import load_target
from dflash_jax.models.config import TargetConfig
from dflash_jax.checkpoints.safetensors_io import CheckpointError, SafetensorsDir

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file  # noqa: E402

from hf_tiny import make_hf_target, prompts, randomise, worst_errors  # noqa: E402
from quant_tiny import (  # noqa: E402
    fp8_decode, fp8_quantise, int4_decode, int4_pack, to_torch, write_checkpoint,
)

BLOCK = (16, 16)
# Linear weights of the decoder layers (not the router ``mlp.gate``, norms, embeddings or lm_head).
LINEAR = re.compile(r"layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj|"
                    r"block_sparse_moe\.experts\.\d+\.w[123])\.weight$")


# --- independent references ------------------------------------------------------------------------------




def quantise_int4(w: np.ndarray, group: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Random INT4 codes (the full range, -8 included) and positive scales of ``w``'s shape."""
    out, inn = w.shape
    q = rng.integers(-8, 8, size=(out, inn)).astype(np.int8)
    scale = (0.01 + 0.05 * rng.random((out, -(-inn // group)))).astype(np.float32)
    return q, scale





def stored(path) -> dict:
    src = SafetensorsDir(path, dequantize=False)
    return {k: src.get_stored(k) for k in src.keys()}


def config_of(path) -> dict:
    return json.loads((path / "config.json").read_text())


def fp8_config(block=BLOCK, **extra) -> dict:
    return {"quant_method": "fp8", "activation_scheme": "dynamic",
            "weight_block_size": list(block) if block else None, **extra}


INT4_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": 32, "actorder": None, "dynamic": False}}},
    "ignore": ["lm_head", "re:.*self_attn.*", r"re:.*mlp\.(gate|up|down)_proj.*", r"re:.*mlp\.gate$"],
}


def ct_fp8_config(strategy, **weights) -> dict:
    """compressed-tensors ``float-quantized`` FP8 (llm-compressor's FP8_DYNAMIC: channel; FP8_BLOCK: block)."""
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": {
                "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True},
                "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
                            "dynamic": False, **weights}}},
            "ignore": ["lm_head"]}


def same_params(a, b):
    import jax

    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def fp8_pair(src, root, name, block=BLOCK, quantise=LINEAR.search, **qc):
    """``src``'s Linear weights quantised to FP8 (``root/name``) and the same weights decoded here, in float32
    (``root/name_float``)."""
    t = stored(src)
    quant, floats = {}, {}
    for key, w in t.items():
        if quantise(key):
            codes, scale = fp8_quantise(w, block)
            quant[key], quant[key[: -len(".weight")] + ".weight_scale_inv"] = codes, scale
            floats[key] = fp8_decode(codes, scale, block)
        else:
            quant[key] = floats[key] = w
    cfg = config_of(src)
    return (write_checkpoint(root / name, {**cfg, "quantization_config": fp8_config(block, **qc)}, quant),
            write_checkpoint(root / f"{name}_float", cfg, floats))


# --- FP8 ---------------------------------------------------------------------------------------------------

def test_fp8_tensors_decode_like_the_index_formula_and_transformers(tmp_path):
    """Divisible, partial-block and stacked (3-D, ``<key>_scale_inv``) tensors; transformers' Fp8Dequantize on
    the divisible ones; a bfloat16 dequantise equals the float32 one rounded."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    rng = np.random.default_rng(0)
    shapes = {"a.weight": (64, 48), "b.weight": (40, 70), "c.weight": (5, 3), "d.weight": (128, 128)}
    tensors, want = {}, {}
    for key, shape in shapes.items():
        codes, scale = fp8_quantise(rng.standard_normal(shape).astype(np.float32) * 3, BLOCK)
        tensors[key], tensors[key.replace(".weight", ".weight_scale_inv")] = codes, scale
        want[key] = fp8_decode(codes, scale, BLOCK)
    stack = [fp8_quantise(rng.standard_normal((48, 32)).astype(np.float32), BLOCK) for _ in range(3)]
    tensors["e.gate_up_proj"] = np.stack([c for c, _ in stack])
    tensors["e.gate_up_proj_scale_inv"] = np.stack([s for _, s in stack])
    want["e.gate_up_proj"] = np.stack([fp8_decode(c, s, BLOCK) for c, s in stack])
    tensors["norm.weight"] = want["norm.weight"] = rng.standard_normal(64).astype(np.float32)
    src = SafetensorsDir(write_checkpoint(tmp_path / "t", {"quantization_config": fp8_config()}, tensors))
    for key, ref in want.items():
        got = src.get(key)
        assert got.dtype == np.float32 and src.dtype_name(key) == "F32" and src.shape(key) == ref.shape
        np.testing.assert_array_equal(got, ref, err_msg=key)
    assert src.stored_dtype_name("a.weight") == "F8_E4M3" and src.get_stored("a.weight").dtype == \
        ml_dtypes.float8_e4m3fn
    hf = Fp8Dequantize(None)
    for key in ("a.weight", "d.weight", "e.gate_up_proj"):
        scale_key = key + "_scale_inv" if not key.endswith(".weight") else key[:-7] + ".weight_scale_inv"
        ref = hf._dequantize_one(to_torch(tensors[key]), to_torch(tensors[scale_key]), torch.float32).numpy()
        np.testing.assert_array_equal(src.get(key), ref, err_msg=key)
    src.dequantize_dtype = ml_dtypes.bfloat16
    assert src.dtype_name("b.weight") == "BF16"
    np.testing.assert_array_equal(src.get("b.weight"), want["b.weight"].astype(ml_dtypes.bfloat16))
    # per-tensor scales (weight_block_size null)
    codes, _ = fp8_quantise(rng.standard_normal((8, 8)).astype(np.float32), (8, 8))
    one = SafetensorsDir(write_checkpoint(tmp_path / "one", {"quantization_config": fp8_config(None)},
                               {"x.weight": codes, "x.weight_scale_inv": np.array(0.5, np.float32)}))
    np.testing.assert_array_equal(one.get("x.weight"), codes.astype(np.float32) * 0.5)


@pytest.mark.parametrize("strategy, weights, block", [
    ("channel", {}, lambda n, k: (1, k)),
    ("block", {"block_structure": [16, 16]}, lambda n, k: (16, 16)),
    ("group", {"group_size": 32}, lambda n, k: (1, 32)),
    ("tensor", {}, lambda n, k: (n, k)),
])
def test_compressed_tensors_fp8_decodes_like_the_index_formula(tmp_path, strategy, weights, block):
    """compressed-tensors ``float-quantized``: ``<m>.weight`` e4m3 times ``<m>.weight_scale`` on each strategy's
    grid (shapes not multiples of the block or group), through load-time names as for the fp8 method."""
    rng = np.random.default_rng(5)
    tensors, want = {}, {}
    for key, (n, k) in {"a.weight": (48, 64), "b.weight": (40, 70)}.items():
        codes, scale = fp8_quantise(rng.standard_normal((n, k)).astype(np.float32), block(n, k))
        if strategy == "tensor":
            scale = scale.reshape(1)
        tensors[key], tensors[key + "_scale"] = codes, scale.astype(ml_dtypes.bfloat16)
        want[key] = fp8_decode(codes, scale.astype(ml_dtypes.bfloat16).astype(np.float32).reshape(
            (1, 1) if strategy == "tensor" else scale.shape), block(n, k))
    src = SafetensorsDir(write_checkpoint(tmp_path / "t", {"quantization_config": ct_fp8_config(strategy, **weights)}, tensors))
    for key, ref in want.items():
        np.testing.assert_array_equal(src.get(key), ref, err_msg=key)
    if strategy == "channel":  # a scale grid of another strategy is refused, naming the tensor
        bad = write_checkpoint(tmp_path / "bad", {"quantization_config": ct_fp8_config(strategy, **weights)},
                    {**tensors, "a.weight_scale": np.ones((48, 2), np.float32)})
        with pytest.raises(CheckpointError, match=r"bad/model\.safetensors: tensor 'a\.weight_scale' has shape "
                                                  r"\[48, 2\], expected \[48, 1\]: the scale grid of 'a\.weight'"):
            SafetensorsDir(bad).get("a.weight")


def test_ue8m0_scales_in_every_container(tmp_path):
    """Power-of-two scales stored as float32 (the value), as F8_E8M0 and as uint8 (exponent bytes, 2 ** (b - 127))
    decode alike; uint8 scales without scale_fmt ue8m0 and the E8M0 NaN byte are refused, naming the tensor."""
    rng = np.random.default_rng(1)
    codes = rng.standard_normal((20, 36)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    exps = rng.integers(120, 135, size=(2, 3)).astype(np.uint8)  # ceil(20/16) x ceil(36/16)
    powers = np.ldexp(1.0, exps.astype(np.int32) - 127).astype(np.float32)
    want = fp8_decode(codes, powers, BLOCK)
    ue8m0 = {"quantization_config": fp8_config(scale_fmt="ue8m0")}
    for name, scale in [("f32", to_torch(powers)), ("e8m0", torch.from_numpy(exps.copy()).view(torch.float8_e8m0fnu)),
                        ("u8", torch.from_numpy(exps.copy()))]:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(ue8m0))
        save_file({"m.weight": to_torch(codes), "m.weight_scale_inv": scale}, str(d / "model.safetensors"))
        np.testing.assert_array_equal(SafetensorsDir(d).get("m.weight"), want, err_msg=name)
    (tmp_path / "u8" / "config.json").write_text(json.dumps({"quantization_config": fp8_config()}))
    with pytest.raises(CheckpointError, match=r"u8/model\.safetensors: tensor 'm\.weight_scale_inv' is stored as "
                                              r"U8; FP8 scales must be floating point"):
        SafetensorsDir(tmp_path / "u8").get("m.weight")
    bad = exps.copy()
    bad[1, 2] = 0xFF
    d = write_checkpoint(tmp_path / "nan", ue8m0, {"m.weight": codes})
    save_file({"m.weight": to_torch(codes), "m.weight_scale_inv": torch.from_numpy(bad)}, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor 'm\.weight_scale_inv' holds the E8M0 NaN code"):
        SafetensorsDir(d).get("m.weight")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    # head_dim 24: q_proj [96, 64]; intermediate 72: gate/up [72, 64], down [64, 72], not multiples of 16.
    make_hf_target("qwen3_untied", root / "qwen3", intermediate_size=72)
    make_hf_target("qwen3_moe", root / "qwen3_moe")
    cfg = transformers.MiniMaxM2Config(
        hidden_size=64, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, vocab_size=97, max_position_embeddings=256,
        rms_norm_eps=1e-6, partial_rotary_factor=0.5, bos_token_id=0, eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    torch.manual_seed(0)
    randomise(transformers.MiniMaxM2ForCausalLM(cfg).eval()).save_pretrained(root / "minimax_m2")
    return root


@pytest.fixture(scope="module")
def qwen3_fp8(tiny):
    root = tiny
    return fp8_pair(root / "qwen3", root, "qwen3_fp8", modules_to_not_convert=["lm_head"])


def test_fp8_qwen3_loads_as_its_decoding_and_runs_like_transformers(qwen3_fp8):
    """Every Linear of a dense qwen3 in FP8 (16 x 16 blocks, partial blocks on the MLP), lm_head kept float
    (modules_to_not_convert): the params equal those of the float checkpoint of this file's decoding, and
    the model's logits and features match transformers' run of that float checkpoint."""
    quant, floats = qwen3_fp8
    assert SafetensorsDir(quant).stored_dtype_name("model.layers.0.mlp.gate_proj.weight") == "F8_E4M3"
    config, params = load_target(quant)
    _, want = load_target(floats)
    same_params(params, want)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(floats, dtype=torch.float32).eval()
    worst_logit, worst_feat = worst_errors(config, params, hf_model, prompts(config.vocab_size))
    print(f"fp8 qwen3 vs transformers on the decoded weights: logits {worst_logit:.1e}, features {worst_feat:.1e}")
    assert worst_logit <= 1e-4 and worst_feat <= 1e-4
    # bfloat16: each weight is the float32 decoding rounded once
    _, bf16 = load_target(quant, dtype="bfloat16")
    _, bf16_want = load_target(floats, dtype="bfloat16")
    same_params(bf16, bf16_want)


@pytest.mark.parametrize("family", ["qwen3_moe", "minimax_m2"])
def test_fp8_per_expert_tensors_stack_like_float_ones(tiny, family):
    """Per-expert FP8 tensors (``mlp.experts.{j}.gate_proj`` / MiniMax's ``block_sparse_moe.experts.{j}.w1``)
    with their own scales, routers float (``ignored_layers``, MiniMax's spelling)."""
    root = tiny
    quant, floats = fp8_pair(root / family, root, f"{family}_fp8", ignored_layers=["gate", "lm_head"])
    _, params = load_target(quant)
    _, want = load_target(floats)
    same_params(params, want)
    experts = params["layers_0"]["mlp"]["experts"]
    assert experts["gate_proj"].shape[0] == 4 and np.abs(np.asarray(experts["down_proj"])).max() > 0


# --- INT4 --------------------------------------------------------------------------------------------------

def test_the_int4_packer_writes_compressed_tensors_words():
    """-8..7 in one row: word 0 = 0x76543210 (q -8..-1, lowest nibble first), word 1 = 0xFEDCBA98 (0..7); a
    row of 11 values pads its second word with zero nibbles."""
    words = int4_pack(np.arange(-8, 8)[None]).view(np.uint32)
    assert words.tolist() == [[0x76543210, 0xFEDCBA98]]
    assert int4_pack(np.full((1, 11), 7)).view(np.uint32).tolist() == [[0xFFFFFFFF, 0x00000FFF]]


def test_int4_word_layout_by_hand(tmp_path):
    """One row of 16 values: word 0 = 0x76543210 holds q = -8..-1 (lowest nibble first), word 1 = 0xFEDCBA98
    (negative as int32) holds 0..7; scale 0.5 for the first group of 8 (group_size 8), 2.0 for the second."""
    words = np.array([[0x76543210, 0xFEDCBA98]], np.uint32).view(np.int32)
    assert words[0, 1] < 0
    cfg = json.loads(json.dumps(INT4_CONFIG))
    cfg["config_groups"]["group_0"]["weights"]["group_size"] = 8
    d = write_checkpoint(tmp_path / "w", {"quantization_config": cfg}, {
        "m.weight_packed": words, "m.weight_scale": np.array([[0.5, 2.0]], np.float32),
        "m.weight_shape": np.array([1, 16], np.int64)})
    src = SafetensorsDir(d)
    assert "m.weight" in src.keys() and src.shape("m.weight") == (1, 16) and src.dtype_name("m.weight") == "F32"
    np.testing.assert_array_equal(src.get("m.weight")[0], [0.5 * v for v in range(-8, 0)] + [2.0 * v for v in range(8)])
    np.testing.assert_array_equal(int4_pack(np.arange(-8, 8)[None]), words)  # the test's packer agrees


def test_int4_tensors_decode_like_the_reference(tmp_path):
    """Shapes with a partial word and a partial group (in = 70: 9 words, 3 groups of 32), bf16 scales as Kimi
    ships them: float32 decoding exact; a bfloat16 load equals compressed-tensors' product in bf16."""
    rng = np.random.default_rng(2)
    tensors, want, ref_bf16 = {}, {}, {}
    for key, shape in {"a.weight": (48, 64), "b.weight": (5, 70)}.items():
        q, scale = quantise_int4(np.zeros(shape), 32, rng)
        scale = scale.astype(ml_dtypes.bfloat16)
        tensors.update({key + "_packed": int4_pack(q), key + "_scale": scale, key + "_shape": np.array(shape)})
        want[key] = int4_decode(q, scale.astype(np.float32), 32)
        s = torch.from_numpy(scale.view(np.uint16).copy()).view(torch.bfloat16)
        ref_bf16[key] = (torch.from_numpy(q).to(torch.bfloat16) * s.repeat_interleave(32, dim=1)[:, : shape[1]])
    src = SafetensorsDir(write_checkpoint(tmp_path / "t", {"quantization_config": INT4_CONFIG}, tensors))
    assert src.stored_shape("b.weight_packed") == (5, 9)
    for key in want:
        np.testing.assert_array_equal(src.get(key), want[key], err_msg=key)
    src.dequantize_dtype = ml_dtypes.bfloat16
    for key in want:
        np.testing.assert_array_equal(src.get(key).view(np.uint16), ref_bf16[key].view(torch.uint16).numpy())


def test_int4_experts_with_float_attention_load_as_their_decoding(tiny):
    """Kimi's layout on a qwen3_moe: routed experts packed INT4 (group 32), attention, dense MLP and routers
    float (its ``ignore`` list): params equal the float checkpoint of this file's decoding."""
    root = tiny
    t = stored(root / "qwen3_moe")
    rng = np.random.default_rng(3)
    quant, floats = {}, {}
    for key, w in t.items():
        if ".mlp.experts." in key:
            q, scale = quantise_int4(w, 32, rng)
            base = key  # "<m>.weight"
            quant.update({base + "_packed": int4_pack(q), base + "_scale": scale,
                          base + "_shape": np.array(w.shape, np.int64)})
            floats[key] = int4_decode(q, scale, 32)
        else:
            quant[key] = floats[key] = w
    cfg = config_of(root / "qwen3_moe")
    q_dir = write_checkpoint(root / "moe_int4", {**cfg, "quantization_config": INT4_CONFIG}, quant)
    f_dir = write_checkpoint(root / "moe_int4_float", cfg, floats)
    _, params = load_target(q_dir)
    _, want = load_target(f_dir)
    same_params(params, want)


# --- refusals ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "gptq", "bits": 4}, r"quant_method 'gptq' is not supported"),
    ({"quant_method": "awq"}, r"quant_method 'awq' is not supported"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "mxfp4"}, r"quant_method 'mxfp4' is not supported"),  # outside gpt-oss
    (fp8_config(block=[128]), r"weight_block_size must be two positive integers"),
    (fp8_config(scale_fmt="e5m2"), r"scale_fmt 'e5m2' is not one of"),
    (fp8_config(fmt="e5m2"), r"fmt 'e5m2' is not supported"),
    ({**INT4_CONFIG, "format": "int-quantized"}, r"compressed-tensors format 'int-quantized' is not supported"),
    ({**INT4_CONFIG, "format": "nvfp4-pack-quantized"}, r"format 'nvfp4-pack-quantized' is not supported"),
    ({**INT4_CONFIG, "format": "float-quantized"}, r"weights: type 'int' is not supported with format "
                                                   r"'float-quantized' \(only 'float'\)"),
    ({**INT4_CONFIG, "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                           "strategy": "group", "group_size": 32}}}},
     r"config_groups\.g\.weights: num_bits 8 is not supported"),
    ({**INT4_CONFIG, "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "symmetric": False,
                                                           "strategy": "group", "group_size": 32}}}},
     r"config_groups\.g\.weights: symmetric False: asymmetric"),
    ({**INT4_CONFIG, "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "symmetric": True,
                                                           "strategy": "group", "group_size": 32}}}},
     r"type 'float' is not supported"),
    (ct_fp8_config("block", block_structure=[128]), r"block_structure must be two positive integers"),
    (ct_fp8_config("token"), r"strategy 'token' is not supported"),
])
def test_unsupported_quantization_configs_name_config_json(tiny, tmp_path, qc, message):
    root = tiny
    src = root / "qwen3"
    dst = write_checkpoint(tmp_path / "q", {**config_of(src), "quantization_config": qc}, stored(src))
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(dst))}/config\.json: quantization_config.*{message}"):
        load_target(dst)
    # the config alone still describes the model (plans and layouts read no weights); the error waits in it
    config = TargetConfig.from_json(dst / "config.json")
    assert re.search(message, config.quantization.error) and config == TargetConfig.from_json(src / "config.json")


def test_bad_quantized_tensors_name_file_and_key(tiny, qwen3_fp8, tmp_path):
    root = tiny
    quant = stored(qwen3_fp8[0])
    cfg = config_of(qwen3_fp8[0])
    key = "model.layers.1.mlp.down_proj.weight"  # [64, 72]: grid [4, 5]
    scale = key[:-7] + ".weight_scale_inv"

    def broken(name, drop=(), replace=None, config=None):
        t = {k: v for k, v in quant.items() if k not in drop}
        t.update(replace or {})
        return write_checkpoint(tmp_path / name, config or cfg, t)

    dst = broken("noscale", drop=[scale])
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(dst))}/model\.safetensors: FP8 tensor "
                                              rf"'{re.escape(key)}' has no scale tensor '{re.escape(scale)}'"):
        load_target(dst)
    dst = broken("grid", replace={scale: quant[scale][:, :4]})
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(dst))}/model\.safetensors: tensor '{re.escape(scale)}' "
                                              r"has shape \[4, 4\], expected \[4, 5\]: the scale grid of"):
        load_target(dst)
    nan = quant[key].copy()
    nan.view(np.uint8)[3, 5] = 0xFF
    dst = broken("nan", replace={key: nan})
    with pytest.raises(CheckpointError, match=rf"FP8 tensor '{re.escape(key)}' holds the e4m3 NaN code"):
        load_target(dst)
    dst = broken("noconfig", config=config_of(root / "qwen3"))
    with pytest.raises(CheckpointError, match=r"is stored as F8_E4M3; weights must be floating point .*FP8 weights "
                                              r"are read when config\.json's quantization_config says"):
        load_target(dst)
    # INT4: a missing scale, a wrong grid, a zero point, a packed width that does not fit weight_shape
    rng = np.random.default_rng(4)
    q, s = quantise_int4(np.zeros((64, 72)), 32, rng)
    packed = {key + "_packed": int4_pack(q), key + "_scale": s, key + "_shape": np.array([64, 72])}
    floats = {k: v.astype(np.float32) if v.dtype == ml_dtypes.float8_e4m3fn else v for k, v in quant.items()
              if not k.endswith("_scale_inv")}
    base = {k: v for k, v in floats.items() if k != key}
    icfg = {**cfg, "quantization_config": INT4_CONFIG}
    cases = [
        ("i_noscale", {k: v for k, v in packed.items() if not k.endswith("_scale")},
         rf"packed INT4 tensor '{re.escape(key)}_packed' has no scale tensor '{re.escape(key)}_scale'"),
        ("i_grid", {**packed, key + "_scale": s[:, :2]},
         rf"tensor '{re.escape(key)}_scale' has shape \[64, 2\], expected \[64, 3\]"),
        ("i_zero", {**packed, key + "_zero_point": np.zeros((64, 3), np.int32)},
         rf"tensor '{re.escape(key)}_zero_point': zero points .* not supported"),
        ("i_shape", {**packed, key + "_shape": np.array([64, 80])},
         rf"tensor '{re.escape(key)}' \(stored packed as '{re.escape(key)}_packed', its shape in "
         rf"'{re.escape(key)}_shape'\) has shape \[64, 80\], expected \[64, 72\]"),
        ("i_width", {**packed, key + "_packed": int4_pack(q[:, :64])},
         rf"tensor '{re.escape(key)}_packed' has shape \[64, 8\], expected \[64, 9\]"),
        ("i_noshape", {k: v for k, v in packed.items() if not k.endswith("_shape")},
         rf"packed INT4 tensor '{re.escape(key)}_packed' has no '{re.escape(key)}_shape'"),
    ]
    for name, extra, message in cases:
        dst = write_checkpoint(tmp_path / name, icfg, {**base, **extra})
        with pytest.raises(CheckpointError, match=rf"{re.escape(str(dst))}/model\.safetensors: {message}"):
            load_target(dst)
