"""FP8 and INT4 expert weights kept quantised on the device (``load_target(..., experts="packed")``,
``models/quantized_experts``).

References, independent of the code under test:

- the decoders: tests/quant_tiny.py's index formulas (``codes[i, j] * scale[i // bn, j // bk]`` with codes cast by
  ml_dtypes; ``q[r, c] * scale[r, c // group]`` with the values before this file packed them), bit for bit in
  float32, for all experts and for a gathered subset with repeats;
- end to end: transformers' tiny random Qwen3-MoE and MiniMax-M2 models, their routed experts quantised here
  (FP8 in 16 x 16 blocks; INT4 in groups of 32 with bfloat16 scales, Kimi's layout) and everything else
  float. The packed load's logits equal the dequantised load's (which tests/test_quantized_checkpoints.py ties
  to the index formulas and transformers) to 1e-5 on all three expert paths, and transformers' own model run
  on the float checkpoint of this file's decoding to 1e-4 (scaled by magnitude); its greedy tokens equal
  transformers' ``generate`` on that checkpoint.
- the packed params are the stored codes, at 8 (FP8) and 4 (INT4) bits per expert weight plus the scales;
- refusals name the file, tensor or field.
"""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dflash_jax import sharding  # noqa: E402
from dflash_jax.checkpoints.expert_layouts import with_packed_experts  # noqa: E402
from dflash_jax.checkpoints.hf_target import abstract_target_params, load_target  # noqa: E402
from dflash_jax.checkpoints.safetensors_io import CheckpointError, SafetensorsDir, flatten  # noqa: E402
from dflash_jax.configs import load_pairing  # noqa: E402
from dflash_jax.engine.decoder import Decoder  # noqa: E402
from dflash_jax.models import quantized_experts as Q  # noqa: E402
from dflash_jax.models.experts import force_expert_path  # noqa: E402
from hf_tiny import hf_greedy, make_hf_target, prompts, randomise, worst_errors  # noqa: E402
from quant_tiny import fp8_decode, fp8_quantise, int4_decode, int4_pack, write_checkpoint  # noqa: E402

FP8_BLOCK = (16, 16)
GROUP = 32
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK),
              "modules_to_not_convert": ["gate", "lm_head"]}
INT4_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
        "actorder": None, "dynamic": False}}},
    "ignore": ["lm_head", "re:.*self_attn.*", r"re:.*mlp\.(gate|up|down)_proj.*", r"re:.*\.gate$"],
}
EXPERT = (".mlp.experts.", ".block_sparse_moe.experts.")


# --- the decoders ------------------------------------------------------------------------------------------

def test_fp8_decode_matches_the_index_formula_for_all_and_gathered_experts():
    rng = np.random.default_rng(0)
    e, out, inn, block = 3, 32, 48, (16, 16)
    ws = [rng.standard_normal((out, inn)).astype(np.float32) * 0.1 for _ in range(e)]
    codes, scales = zip(*(fp8_quantise(w, block) for w in ws))
    codes, scales = np.stack(codes), np.stack(scales)
    want = np.stack([fp8_decode(c, s, block) for c, s in zip(codes, scales)])  # [E, out, in]
    got = Q.decode_rows("fp8", block, jnp.asarray(codes), jnp.asarray(scales), jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(Q.decode_all("fp8", block, codes, scales, jnp.float32)),
                                  want.transpose(0, 2, 1))
    ids = np.array([[2, 0], [2, 2]])
    np.testing.assert_array_equal(np.asarray(Q.decode_rows("fp8", block, codes, scales, jnp.float32, ids=ids)),
                                  want[ids])
    bf16 = Q.decode_rows("fp8", block, codes, scales, jnp.bfloat16)  # the float32 product rounded once
    np.testing.assert_array_equal(np.asarray(bf16).view(np.uint16), want.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_int4_decode_matches_the_values_before_packing():
    rng = np.random.default_rng(1)
    e, out, inn = 3, 8, 64
    q = rng.integers(-8, 8, size=(e, out, inn))
    scale = (0.01 + 0.05 * rng.random((e, out, inn // GROUP))).astype(ml_dtypes.bfloat16)
    words = np.stack([int4_pack(x) for x in q])
    want = np.stack([int4_decode(x, s.astype(np.float32), GROUP) for x, s in zip(q, scale)])
    got = Q.decode_rows("int4", (1, GROUP), jnp.asarray(words), jnp.asarray(scale), jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), want)
    ids = np.array([1, 1, 0])
    np.testing.assert_array_equal(
        np.asarray(Q.decode_rows("int4", (1, GROUP), words, scale, jnp.float32, ids=ids)), want[ids])


def test_blocks_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match=r"layer: a \[40, 64\] weight is not a whole number of 16 x 16 blocks"):
        Q.check_block("fp8", (16, 16), 40, 64, "layer")
    with pytest.raises(ValueError, match="of 8 inputs"):
        Q.check_block("int4", (1, 4), 8, 12, "layer")


# --- checkpoints -------------------------------------------------------------------------------------------

def _stored(path) -> dict:
    src = SafetensorsDir(path, dequantize=False)
    return {k: src.get_stored(k) for k in src.keys()}


def _quantise(src, dst, fmt, rng):
    """``src``'s routed experts quantised (``fmt``) into ``dst``; the same weights decoded here, float32, into
    ``dst_float`` (transformers' reference reads that one)."""
    quant, floats = {}, {}
    for key, w in _stored(src).items():
        if not any(part in key for part in EXPERT) or not key.endswith(".weight"):
            quant[key] = floats[key] = w
        elif fmt == "fp8":
            codes, scale = fp8_quantise(w, FP8_BLOCK)
            quant[key], quant[key + "_scale_inv"] = codes, scale
            floats[key] = fp8_decode(codes, scale, FP8_BLOCK)
        else:
            q = rng.integers(-8, 8, size=w.shape)
            scale = (0.004 + 0.01 * rng.random((w.shape[0], w.shape[1] // GROUP))).astype(ml_dtypes.bfloat16)
            quant.update({key + "_packed": int4_pack(q), key + "_scale": scale,
                          key + "_shape": np.array(w.shape, np.int64)})
            floats[key] = int4_decode(q, scale.astype(np.float32), GROUP)
    cfg = json.loads((src / "config.json").read_text())
    qc = FP8_CONFIG if fmt == "fp8" else INT4_CONFIG
    return (write_checkpoint(dst, {**cfg, "quantization_config": qc}, quant),
            write_checkpoint(dst.parent / f"{dst.name}_float", cfg, floats))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("qexperts")
    make_hf_target("qwen3_moe", root / "qwen3_moe")  # experts 4 x [32, 64]: 16 x 16 blocks, groups of 32
    cfg = transformers.MiniMaxM2Config(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, vocab_size=97, max_position_embeddings=256,
        rms_norm_eps=1e-6, partial_rotary_factor=0.5, bos_token_id=0, eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    torch.manual_seed(0)
    randomise(transformers.MiniMaxM2ForCausalLM(cfg).eval()).save_pretrained(root / "minimax_m2")
    rng = np.random.default_rng(5)
    return {"qwen3_moe/fp8": _quantise(root / "qwen3_moe", root / "qwen3_moe_fp8", "fp8", rng),
            "qwen3_moe/int4": _quantise(root / "qwen3_moe", root / "qwen3_moe_int4", "int4", rng),
            "minimax_m2/fp8": _quantise(root / "minimax_m2", root / "minimax_m2_fp8", "fp8", rng)}


def _logits(config, params, rows):
    from hf_tiny import batched_forward

    return batched_forward(config, params, rows)[0]


@pytest.mark.parametrize("case", ["qwen3_moe/fp8", "qwen3_moe/int4", "minimax_m2/fp8"])
def test_packed_experts_compute_the_dequantised_model(ckpts, case):
    quant, floats = ckpts[case]
    fmt = case.split("/")[1]
    config_d, params_d = load_target(quant)
    config_p, params_p = load_target(quant, experts="packed")
    assert config_d.experts.weight_format == "float" and config_p.experts.weight_format == fmt
    rows = prompts(config_d.vocab_size)
    want = _logits(config_d, params_d, rows)
    for path in ("dense", "grouped", "routed"):  # routed: only the routed pairs' codes decoded
        with force_expert_path(path):
            got = _logits(config_p, params_p, rows)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(floats, dtype=torch.float32).eval()
    worst_logit, worst_feat = worst_errors(config_p, params_p, hf_model, rows)
    print(f"{case} packed vs transformers on the decoded weights: logits {worst_logit:.1e}, "
          f"features {worst_feat:.1e}")
    assert worst_logit <= 1e-4 and worst_feat <= 1e-4
    if case == "qwen3_moe/fp8":  # one decode program per module: greedy tokens as transformers generates them
        batch = [p.tolist() for p in prompts(config_p.vocab_size, seed=2)]
        tokens = Decoder(config_p, params_p).generate(batch, 12, baseline=True).tokens
        for prompt, row in zip(batch, tokens):
            assert row == hf_greedy(hf_model, prompt, 12)


def test_packed_params_are_the_stored_codes(ckpts):
    quant, _ = ckpts["qwen3_moe/fp8"]
    _, params = load_target(quant, experts="packed", dtype="bfloat16")
    stored = _stored(quant)
    experts = params["layers_0"]["mlp"]["experts"]
    assert set(experts) == {f"{p}_{part}" for p in ("gate_proj", "up_proj", "down_proj") for part in ("qweight",
                                                                                                      "qscale")}
    assert experts["gate_proj_qweight"].dtype == jnp.float8_e4m3fn and experts["gate_proj_qscale"].dtype == jnp.float32
    for j in range(4):
        key = f"model.layers.0.mlp.experts.{j}.down_proj.weight"
        np.testing.assert_array_equal(np.asarray(experts["down_proj_qweight"][j]).view(np.uint8),
                                      stored[key].view(np.uint8))
        np.testing.assert_array_equal(np.asarray(experts["down_proj_qscale"][j]), stored[key + "_scale_inv"])
    # the rest is dequantised and cast as usual
    assert params["layers_0"]["self_attn"]["q_proj"]["kernel"].dtype == jnp.bfloat16

    quant, _ = ckpts["qwen3_moe/int4"]
    config, params = load_target(quant, experts="packed")
    e = config.experts
    flat = flatten(params)
    packed = sum(v.nbytes for k, v in flat.items() if k[-1].endswith(("_qweight", "_qscale")))
    weights = 3 * e.num_experts * e.intermediate_size * config.hidden_size * len(config.expert_layers)
    assert packed * 8 / weights == pytest.approx(4 + 16 / GROUP)  # 4-bit codes and a bf16 scale per 32


def test_shardings_keep_whole_blocks_per_device():
    """Kimi-K2.5 (INT4, groups of 32) and GLM-5.1-FP8 (128 x 128) on 8 devices (expert=2, fsdp=2, tensor=2):
    codes and scales of one projection split along the same axes, every device's slice whole blocks."""
    mesh = jax.sharding.AbstractMesh((2, 2, 2), ("expert", "fsdp", "tensor"))
    for name in ("kimi-k2.5-dflash-b8", "glm-5.1-fp8-dflash-b8"):
        config = with_packed_experts(load_pairing(name).target, "packed", name)
        first = min(config.expert_layers)  # after the dense first layers
        config = dataclasses.replace(config, num_hidden_layers=first + 1)
        layer = abstract_target_params(config, jnp.bfloat16)[f"layers_{first}"]["mlp"]["experts"]
        fmt, block = config.experts.weight_format, config.experts.weight_block
        for proj in ("gate_proj", "down_proj"):
            codes, scales = layer[f"{proj}_qweight"], layer[f"{proj}_qscale"]
            axes = sharding.logical_axes(f"layers_{first}/mlp/experts/{proj}_qweight", 3)
            assert axes == sharding.logical_axes(f"layers_{first}/mlp/experts/{proj}_qscale", 3)
            spec_c = sharding.spec_for(codes.shape, axes, mesh)
            spec_s = sharding.spec_for(scales.shape, axes, mesh)
            assert spec_c == spec_s and spec_c[0] == "expert", (name, proj, spec_c)
            per = [int(np.prod([mesh.shape[n] for n in ((a,) if isinstance(a, str) else a)])) if a else 1
                   for a in spec_s]
            assert all(d % n == 0 for d, n in zip(scales.shape, per)), (name, proj, scales.shape, spec_s)
            unit = (1, block[0], block[1] // (8 if fmt == "int4" else 1))
            assert all((d // n) % u == 0 for d, n, u in zip(codes.shape, per, unit)), (name, proj, codes.shape)


def test_codes_split_as_their_scales_where_the_grid_does_not_divide():
    """MiniMax-M2.5's FP8 experts (intermediate 1536: 12 blocks of 128) over tensor=8: 1536 divides by 8 but 12
    does not, so the codes stay whole along it like their scales (a device never holds part of a block whose
    scale it lacks); over tensor=4 both split."""
    base = load_pairing("minimax-m2.5-dflash-b16").target
    config = dataclasses.replace(base, num_hidden_layers=1, experts=dataclasses.replace(
        base.experts, weight_format="fp8", weight_block=(128, 128)))
    params = abstract_target_params(config, jnp.bfloat16)
    for tensor, split in ((8, None), (4, "tensor")):
        mesh = jax.sharding.AbstractMesh((1, 1, tensor, 2), sharding.MESH_AXES)
        experts = sharding.tree_shardings(params, mesh)["layers_0"]["mlp"]["experts"]
        for proj, dim in (("gate_proj", 1), ("down_proj", 2)):  # the intermediate dimension of each
            codes, scales = experts[f"{proj}_qweight"].spec, experts[f"{proj}_qscale"].spec
            assert codes == scales and codes[0] == "expert" and codes[dim] == split, (tensor, proj, codes)


# --- refusals ----------------------------------------------------------------------------------------------

def test_refusals_name_the_file_tensor_or_field(ckpts, tmp_path):
    quant, floats = ckpts["qwen3_moe/fp8"]
    with pytest.raises(CheckpointError, match=r"float weights \(no quantization_config\).*experts='dequantize'"):
        load_target(floats, experts="packed")
    # float experts under a quantization_config that quantises only the attention
    cfg = json.loads((floats / "config.json").read_text())
    mixed = write_checkpoint(tmp_path / "mixed", {**cfg, "quantization_config": FP8_CONFIG}, _stored(floats))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.experts\.0\."
                                              r"(gate|up|down)_proj\.weight' holds float expert weights"):
        load_target(mixed, experts="packed")
    # blocks that do not divide the experts' sizes
    odd = write_checkpoint(tmp_path / "odd", {**cfg, "quantization_config": {**FP8_CONFIG,
                                                                             "weight_block_size": [24, 24]}},
                           _stored(quant))
    with pytest.raises(CheckpointError, match=r"odd: experts' gate/up_proj: a \[32, 64\] weight is not a whole "
                                              r"number of 24 x 24 blocks"):
        load_target(odd, experts="packed")
    # INT4 scales in float32 are not kept (the params declare Kimi's bfloat16)
    quant4, _ = ckpts["qwen3_moe/int4"]
    t = _stored(quant4)
    t = {k: (v.astype(np.float32) if k.endswith("_scale") else v) for k, v in t.items()}
    f32 = write_checkpoint(tmp_path / "f32", json.loads((quant4 / "config.json").read_text()), t)
    with pytest.raises(CheckpointError, match=r"f32/model\.safetensors: tensor 'model\.layers\.0\.mlp\.experts\.0\."
                                              r"down_proj\.weight_scale'"
                                              r" is stored as F32; INT4 scales kept on the device"):
        load_target(f32, experts="packed")
    assert load_target(f32)[0].experts.weight_format == "float"  # dequantised, it loads
    # zero points (asymmetric INT4) change the decoding: refused as the load-time decoder refuses them
    zp_key = "model.layers.0.mlp.experts.1.up_proj.weight_zero_point"
    zp = write_checkpoint(tmp_path / "zp", json.loads((quant4 / "config.json").read_text()),
                          {**_stored(quant4), zp_key: np.zeros((32, 2), np.int32)})
    with pytest.raises(CheckpointError, match=rf"zp/model\.safetensors: tensor '{re.escape(zp_key)}': zero points"):
        load_target(zp, experts="packed")
    # a stored weight_shape that disagrees with config.json
    t = _stored(quant4)
    t["model.layers.2.mlp.experts.2.down_proj.weight_shape"] = np.array([64, 64], np.int64)
    shape = write_checkpoint(tmp_path / "shape", json.loads((quant4 / "config.json").read_text()), t)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.2\.mlp\.experts\.2\.down_proj\.weight_shape' says "
                                              r"\[64, 64\], but config\.json makes .* \[64, 32\]"):
        load_target(shape, experts="packed")
    # all experts fused in one tensor (transformers 5's layout): not kept packed, with the tensor named
    fused = {k: v for k, v in _stored(floats).items() if ".mlp.experts." not in k}
    for layer in (0, 2):  # the expert layers (layer 1's MLP is dense)
        base = f"model.layers.{layer}.mlp.experts"
        per = [[_stored(floats)[f"{base}.{j}.{p}.weight"] for j in range(4)] for p in ("gate_proj", "up_proj",
                                                                                        "down_proj")]
        fused[f"{base}.gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(per[0], per[1])])
        fused[f"{base}.down_proj"] = np.stack(per[2])
    fused_dir = write_checkpoint(tmp_path / "fused", {**cfg, "quantization_config": FP8_CONFIG}, fused)
    with pytest.raises(CheckpointError, match=r"fused/model\.safetensors: tensor 'model\.layers\.0\.mlp\.experts\."
                                              r"gate_up_proj' holds all experts in one tensor"):
        load_target(fused_dir, experts="packed")


def test_config_alone_reads_under_an_unsupported_quantization(ckpts, tmp_path):
    """A config.json whose quantization_config this project cannot read still describes the model (plans and
    layouts need no weights); keeping its experts packed raises the QuantizationError naming the file."""
    from dflash_jax.checkpoints.quantized import UnsupportedScheme
    from dflash_jax.models.config import TargetConfig

    _, floats = ckpts["qwen3_moe/fp8"]
    cfg = json.loads((floats / "config.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "awq", "bits": 4}}))
    config = TargetConfig.from_json(path)
    assert isinstance(config.quantization, UnsupportedScheme)
    assert config == TargetConfig.from_json(floats / "config.json")  # the same model
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))}: quantization_config: quant_method 'awq' "
                                              r"is not supported"):
        with_packed_experts(config, "packed", str(tmp_path))
