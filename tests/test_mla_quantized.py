"""Quantised checkpoints of the multi-head latent attention families, end to end: a DeepSeek-V3 target in block
FP8 and a Kimi K2.5 target with compressed-tensors INT4 experts load exactly as float checkpoints of their decoding.

The references are independent of ``checkpoints/quantized``: this file quantises transformers' own tiny random
models (``DeepseekV3ForCausalLM``, ``Kimi_K25ForConditionalGeneration`` with its vision tower, saved by
``save_pretrained``) with tests/quant_tiny.py's NumPy quantiser and packer (block amax / 448 rounded to e4m3 by
ml_dtypes; INT4 codes shifted by 8 and packed eight to an int32 word as compressed-tensors' ``pack_to_int32``
lays them out), decodes them with its index formulas, and writes a float checkpoint holding that decoding. ``load_target`` of the
quantised directory must equal ``load_target`` of the float one bit for bit, in float32 and in bfloat16 (one
rounding of the float32 decoding).

- DeepSeek-V3 as released (``quant_method: "fp8"``, ``fmt: "e4m3"``, dynamic activations): every projection of
  multi-head latent attention (``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``), the
  dense first layer's MLP, each routed expert (``mlp.experts.{e}.{gate,up,down}_proj``) and the shared expert in
  FP8 with their own ``weight_scale_inv`` grids (16 x 16 blocks here, 128 x 128 in the release; 24-, 40- and
  72-wide dimensions leave partial blocks); the norms (both latent norms included), the router's weight and its
  ``e_score_correction_bias``, the embedding and the head stay float. ``kv_b_proj`` (divisible by the block) is
  also decoded by transformers' own ``Fp8Dequantize``.
- Kimi K2.5 as released: the text layers under ``language_model.model.layers.N``, the vision tower and projector
  present, ``quantization_config`` at the top level and in ``text_config`` (pack-quantized, INT4 symmetric group
  32, ignoring attention, the shared experts and the dense MLP); each routed expert's three projections stored as
  ``weight_packed`` int32 ``[out, ceil(in / 8)]``, ``weight_scale`` bfloat16 ``[out, ceil(in / 32)]`` and
  ``weight_shape``; ``down_proj`` reads 40 inputs: a partial word and a partial group.
- Both again with experts of whole blocks (moe_intermediate_size 32), kept packed on the device
  (``experts="packed"``): the same logits as the dequantised load, and DFlash decoding of the packed Kimi model
  equal to its autoregressive decoding.
"""

import json
import re

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from dflash_jax.checkpoints.hf_target import load_target  # noqa: E402
from dflash_jax.checkpoints.safetensors_io import SafetensorsDir, flatten  # noqa: E402
from hf_tiny import randomise  # noqa: E402
from quant_tiny import fp8_decode, fp8_quantise, int4_decode, int4_pack, to_torch, write_checkpoint  # noqa: E402

BLOCK = (16, 16)
GROUP = 32
TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=72, moe_intermediate_size=40, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=256,
            rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=None)
KIMI_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, pos_emb_height=4,
                   pos_emb_width=4, pos_emb_time=2, patch_size=14)
# DeepSeek-V3's released quantization_config, with this file's block.
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(BLOCK)}
# Kimi K2.5's released quantization_config (moonshotai/Kimi-K2.5, config.json).
INT4_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": GROUP, "actorder": None, "block_structure": None,
                                              "dynamic": False, "observer": "minmax", "observer_kwargs": {}}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
}
FP8_LINEAR = re.compile(r"layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)|"
                        r"mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj)\.weight$")
ROUTED = re.compile(r"language_model\.model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


# --- this file's quantisers and decoders (vectorised; not the loader's code) ----------------------------------



def int4_quantise(w: np.ndarray, group=GROUP) -> tuple[np.ndarray, np.ndarray]:
    """float [out, in] -> (codes in [-8, 7], bfloat16 scales [out, ceil(in / group)]). The scale is amax / 8, so
    the largest magnitudes clip to 7 or reach -8: the whole code range occurs."""
    out, inn = w.shape
    groups = -(-inn // group)
    padded = np.zeros((out, groups * group), np.float32)
    padded[:, :inn] = w
    amax = np.abs(padded.reshape(out, groups, group)).max(axis=2)
    scale = (np.maximum(amax, 1e-6) / 8).astype(ml_dtypes.bfloat16)
    full = np.repeat(scale.astype(np.float32), group, axis=1)[:, :inn]
    q = np.clip(np.rint(w / full), -8, 7).astype(np.int8)
    return q, scale




# --- checkpoints -----------------------------------------------------------------------------------------------


def read(path) -> dict:
    with safe_open(str(path / "model.safetensors"), "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}



def same_params(a, b):
    fa, fb = flatten(a), flatten(b)
    assert fa.keys() == fb.keys()
    for path, x in fa.items():
        assert x.dtype == fb[path].dtype, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(fb[path]), err_msg=str(path))


def assert_loads_as_float(quant, floats, stored_key, stored_dtype):
    """``load_target`` of ``quant`` (which stores ``stored_key`` as ``stored_dtype``) equals that of ``floats``
    bit for bit, float32 and bfloat16."""
    assert SafetensorsDir(quant, dequantize=False).stored_dtype_name(stored_key) == stored_dtype
    config, params = load_target(quant)
    want_config, want = load_target(floats)
    assert config == want_config
    same_params(params, want)
    _, bf16 = load_target(quant, dtype="bfloat16")
    _, bf16_want = load_target(floats, dtype="bfloat16")
    same_params(bf16, bf16_want)
    return config, params



def test_deepseek_v3_fp8_loads_as_its_decoding(tmp_path):
    q_dir, f_dir, quant, floats = deepseek_v3_fp8(tmp_path)
    config, params = assert_loads_as_float(q_dir, f_dir, "model.layers.1.mlp.experts.3.down_proj.weight", "F8_E4M3")
    assert config.mla.q_lora_rank == 24 and config.experts.num_experts == 8
    assert np.abs(np.asarray(params["layers_2"]["mlp"]["experts"]["gate_proj"])).max() > 0
    # transformers' own dequantiser on a tensor that divides into blocks: kv_b_proj [128, 32]
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    key = "model.layers.0.self_attn.kv_b_proj.weight"
    ref = Fp8Dequantize(None)._dequantize_one(to_torch(quant[key]), to_torch(quant[key[:-6] + "weight_scale_inv"]),
                                               torch.float32).numpy()
    np.testing.assert_array_equal(SafetensorsDir(q_dir).get(key), ref)
    np.testing.assert_array_equal(ref, floats[key])


def deepseek_v3_fp8(tmp_path, **text):
    """transformers' tiny DeepSeek-V3 (``TEXT`` with ``text``) in the release's FP8 layout, and a float checkpoint
    of its decoding: ``(fp8 dir, float dir, fp8 tensors, float tensors)``."""
    torch.manual_seed(0)
    model = randomise(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**TEXT, **text})).eval())
    model.save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    quant, floats, names = {}, {}, set()
    for key, w in read(tmp_path / "hf").items():
        if FP8_LINEAR.search(key):
            codes, scale = fp8_quantise(w, BLOCK)
            quant[key], quant[key[: -len("weight")] + "weight_scale_inv"] = codes, scale
            floats[key] = fp8_decode(codes, scale, BLOCK)
            names.add(re.sub(r"experts\.\d+\.", "experts.", re.sub(r"model\.layers\.\d+\.", "", key)))
        else:
            quant[key] = floats[key] = w
    # every kind of projection is quantised; what the release keeps float stays float
    assert names == {f"self_attn.{p}.weight" for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                                         "o_proj")} | {
        f"mlp.{m}{p}_proj.weight" for m in ("", "experts.", "shared_experts.") for p in ("gate", "up", "down")}
    kept = [k for k in quant if "norm" in k or ".mlp.gate." in k or "embed" in k or "lm_head" in k]
    assert all(quant[k].dtype == np.float32 for k in kept) and any("e_score_correction_bias" in k for k in kept)
    assert any("kv_a_layernorm" in k for k in kept) and any("q_a_layernorm" in k for k in kept)
    return (write_checkpoint(tmp_path / "fp8", {**cfg, "quantization_config": FP8_CONFIG}, quant),
            write_checkpoint(tmp_path / "float", cfg, floats), quant, floats)


def test_kimi_k25_int4_experts_load_as_their_decoding(tmp_path):
    q_dir, f_dir, quant = kimi_k25_int4(tmp_path)
    down = "language_model.model.layers.1.mlp.experts.5.down_proj.weight_packed"
    assert quant[down].shape == (64, 5) and quant[down[: -len("packed")] + "scale"].shape == (64, 2)
    config, params = assert_loads_as_float(
        q_dir, f_dir, "language_model.model.layers.2.mlp.experts.0.up_proj.weight_packed", "I32")
    assert config.model_type == "kimi_k2" and not config.tie_word_embeddings
    assert params["layers_1"]["mlp"]["experts"]["down_proj"].shape == (8, 40, 64)


def kimi_k25_int4(tmp_path, **text):
    """transformers' tiny Kimi K2.5 (vision tower included; ``TEXT`` with ``text``) with its routed experts in
    the release's INT4 layout, and a float checkpoint of their decoding: ``(int4 dir, float dir, int4 tensors)``."""
    torch.manual_seed(1)
    cfg = transformers.Kimi_K25Config(text_config={**TEXT, **text, "model_type": "kimi_k2"}, vision_config=KIMI_VISION,
                                      projection_hidden_size=32, tie_word_embeddings=False)
    randomise(transformers.Kimi_K25ForConditionalGeneration(cfg).eval()).save_pretrained(tmp_path / "hf")
    config_json = json.loads((tmp_path / "hf" / "config.json").read_text())
    config_json["text_config"]["model_type"] = "kimi_k2"  # as released (5.x writes deepseek_v3)
    released = {k.replace("language_model.model.blocks.", "language_model.model.layers."): v
                for k, v in read(tmp_path / "hf").items()}
    assert any(k.startswith("vision_tower.") for k in released) and "language_model.lm_head.weight" in released
    quant, floats, routed = {}, {}, 0
    for key, w in released.items():
        if ROUTED.search(key):
            q, scale = int4_quantise(w)
            assert q.min() == -8 and q.max() == 7
            base = key[: -len("weight")]
            quant.update({base + "weight_packed": int4_pack(q), base + "weight_scale": scale,
                          base + "weight_shape": np.array(w.shape, np.int32)})
            floats[key] = int4_decode(q, scale, GROUP)
            routed += 1
        else:
            quant[key] = floats[key] = w
    assert routed == 2 * 8 * 3  # two expert layers of 8 experts, three projections each
    q_cfg = {**config_json, "quantization_config": INT4_CONFIG,
             "text_config": {**config_json["text_config"], "quantization_config": INT4_CONFIG}}
    return (write_checkpoint(tmp_path / "int4", q_cfg, quant),
            write_checkpoint(tmp_path / "float", config_json, floats), quant)


# --- experts kept packed on the device ------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["deepseek_v3/fp8", "kimi_k25/int4"])
def test_packed_experts_compute_the_dequantised_model(tmp_path, family):
    """Experts of whole blocks (moe_intermediate_size 32: 2 x 4 FP8 blocks of 16 x 16, INT4 groups of 32, as the
    released sizes are) kept as stored (``experts="packed"``): logits equal the dequantised load's on the
    dense, grouped and routed expert paths, 1e-5 absolute (both compute in float32 from the same decoded
    values; tests/test_mla_quantized's other tests tie the dequantised load to the index formulas). For Kimi,
    the engine on the packed model: DFlash with a random draft (chain and a 12-node tree, rollbacks and tree
    commits of the latent cache every round) gives exactly the autoregressive tokens."""
    from hf_tiny import batched_forward, check_lossless, decode_with_random_draft, prompts

    from dflash_jax.models.experts import force_expert_path

    if family == "deepseek_v3/fp8":
        q_dir = deepseek_v3_fp8(tmp_path, moe_intermediate_size=32)[0]
    else:
        q_dir = kimi_k25_int4(tmp_path, moe_intermediate_size=32)[0]
    config_d, params_d = load_target(q_dir)
    config_p, params_p = load_target(q_dir, experts="packed")
    assert config_p.experts.weight_format == family.split("/")[1] and "gate_proj_qweight" in \
        params_p["layers_1"]["mlp"]["experts"]
    rows = prompts(config_d.vocab_size)
    want = batched_forward(config_d, params_d, rows)[0]
    for path in ("dense", "grouped", "routed"):
        with force_expert_path(path):
            got = batched_forward(config_p, params_p, rows)[0]
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=path)
    if family == "kimi_k25/int4":
        check_lossless(decode_with_random_draft(config_p, params_p, config_p.vocab_size, (0, 1)))
