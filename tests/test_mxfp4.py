"""MXFP4 (gpt-oss expert weights): host and device decoding against transformers and by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.errors import UserError
from dflash_jax.models import mxfp4


def _packed(rng, experts, out, inn, lo=120, hi=131):
    groups = inn // 32
    blocks = rng.integers(0, 256, size=(experts, out, groups, 16), dtype=np.uint8)
    scales = rng.integers(lo, hi, size=(experts, out, groups), dtype=np.uint8)
    return blocks, scales


def _by_hand(blocks, scales):
    """Scalar-loop reference: W[e, in, out] from the FP4 table, low nibble first, scale 2 ** (s - 127)."""
    experts, out, groups, _ = blocks.shape
    w = np.zeros((experts, groups * 32, out), dtype=np.float64)
    for e in range(experts):
        for o in range(out):
            for g in range(groups):
                scale = 2.0 ** (int(scales[e, o, g]) - 127)
                for j in range(16):
                    byte = int(blocks[e, o, g, j])
                    w[e, g * 32 + 2 * j, o] = mxfp4.FP4_VALUES[byte & 0xF] * scale
                    w[e, g * 32 + 2 * j + 1, o] = mxfp4.FP4_VALUES[byte >> 4] * scale
    return w


def test_fp4_table_and_single_bytes():
    assert mxfp4.FP4_VALUES[:8] == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert mxfp4.FP4_VALUES[8:] == tuple(-v for v in mxfp4.FP4_VALUES[:8])
    blocks = np.zeros((1, 1, 1, 16), dtype=np.uint8)
    blocks[0, 0, 0, :4] = [0x21, 0xF7, 0x9A, 0x08]
    scales = np.full((1, 1, 1), 127, dtype=np.uint8)
    w = mxfp4.dequantize(blocks, scales)
    assert w.shape == (1, 32, 1)
    # 0x21: low nibble 1 -> 0.5, high 2 -> 1.0; 0xF7: 7 -> 6.0, F -> -6.0; 0x9A: A -> -1.0, 9 -> -0.5;
    # 0x08: 8 -> -0.0, 0 -> 0.0
    np.testing.assert_array_equal(w[0, :8, 0], [0.5, 1.0, 6.0, -6.0, -1.0, -0.5, -0.0, 0.0])
    assert np.signbit(w[0, 6, 0]) and not np.signbit(w[0, 7, 0])
    np.testing.assert_array_equal(w[0, 8:, 0], 0.0)
    # scale 129 -> x4, 125 -> x1/4
    scales[...] = 129
    assert mxfp4.dequantize(blocks, scales)[0, 0, 0] == 2.0
    scales[...] = 125
    assert mxfp4.dequantize(blocks, scales)[0, 1, 0] == 0.25


def test_matches_scalar_reference_and_orientation():
    rng = np.random.default_rng(0)
    blocks, scales = _packed(rng, experts=2, out=3, inn=64)
    w = mxfp4.dequantize(blocks, scales)
    assert w.shape == (2, 64, 3) and w.dtype == np.float32
    np.testing.assert_array_equal(w, _by_hand(blocks, scales))


@pytest.mark.parametrize("lo,hi", [(120, 131), (0, 256)])
def test_matches_transformers(lo, hi):
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.integrations.mxfp4")
    rng = np.random.default_rng(1)
    # gate_up_proj-like (out = 2I = 48, in = H = 64) and down_proj-like (out = H = 64, in = I = 96)
    for out, inn in ((48, 64), (64, 96)):
        blocks, scales = _packed(rng, experts=3, out=out, inn=inn, lo=lo, hi=hi)
        ref = hf.convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                            dtype=torch.float32).numpy()
        assert ref.shape == (3, inn, out)
        ours = mxfp4.dequantize(blocks, scales, rows_per_chunk=7)  # odd chunking on purpose
        np.testing.assert_array_equal(ours, ref)
        assert np.array_equal(np.signbit(ours), np.signbit(ref))
        ref_bf16 = hf.convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                 dtype=torch.bfloat16).float().numpy()
        ours_bf16 = mxfp4.dequantize(blocks, scales, dtype=jnp.bfloat16)
        assert ours_bf16.dtype == jnp.bfloat16
        np.testing.assert_array_equal(ours_bf16.astype(np.float32), ref_bf16)


def test_transformers_gpt_oss_layout_uses_xw():
    """The dequantised weight is used as x @ W[e] by transformers' GptOssExperts (gate_up [E, H, 2I])."""
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.integrations.mxfp4")
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    config_mod = pytest.importorskip("transformers.models.gpt_oss.configuration_gpt_oss")
    hidden, inter, experts = 64, 32, 2
    cfg = config_mod.GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                                  num_experts_per_tok=1, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=32, vocab_size=16)
    module = modeling.GptOssExperts(cfg)
    assert tuple(module.gate_up_proj.shape) == (experts, hidden, 2 * inter)
    assert tuple(module.down_proj.shape) == (experts, inter, hidden)
    rng = np.random.default_rng(2)
    gb, gs = _packed(rng, experts, 2 * inter, hidden)
    db, ds = _packed(rng, experts, hidden, inter)
    mxfp4.check_packed_shapes(gb.shape, gs.shape, hidden, 2 * inter, experts, name="gate_up_proj")
    mxfp4.check_packed_shapes(db.shape, ds.shape, inter, hidden, experts, name="down_proj")
    gate_up = hf.convert_moe_packed_tensors(torch.from_numpy(gb), torch.from_numpy(gs), dtype=torch.float32)
    down = hf.convert_moe_packed_tensors(torch.from_numpy(db), torch.from_numpy(ds), dtype=torch.float32)
    assert tuple(gate_up.shape) == tuple(module.gate_up_proj.shape)
    assert tuple(down.shape) == tuple(module.down_proj.shape)
    np.testing.assert_array_equal(mxfp4.dequantize(gb, gs), gate_up.numpy())
    np.testing.assert_array_equal(mxfp4.dequantize(db, ds), down.numpy())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_jax_equals_numpy(dtype):
    rng = np.random.default_rng(3)
    blocks, scales = _packed(rng, experts=3, out=40, inn=96)
    host = mxfp4.dequantize(blocks, scales, dtype=dtype)
    dev = jax.jit(lambda b, s: mxfp4.dequantize_jax(b, s, dtype))(blocks, scales)
    assert dev.shape == host.shape and dev.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(dev).astype(np.float32), host.astype(np.float32))


def test_jax_extreme_scales():
    """Full 0..255 scale range: jax decode equals the host decode (ldexp semantics, inf at s = 255)."""
    rng = np.random.default_rng(4)
    blocks, scales = _packed(rng, experts=1, out=256, inn=32)
    scales[0, :, 0] = np.arange(256, dtype=np.uint8)
    host = mxfp4.dequantize(blocks, scales)
    dev = np.asarray(jax.jit(lambda b, s: mxfp4.dequantize_jax(b, s, jnp.float32))(blocks, scales))
    normal = scales[0, :, 0] >= 2  # s <= 1 gives subnormals (flushed on some backends)
    np.testing.assert_array_equal(dev[0][:, normal], host[0][:, normal])
    assert np.isinf(host[0][:, 255]).any()


def test_packed_expert_matmul():
    rng = np.random.default_rng(5)
    experts, tokens, inn, out = 3, 5, 64, 48
    blocks, scales = _packed(rng, experts, out, inn)
    x = rng.standard_normal((experts, tokens, inn)).astype(np.float32)
    w = mxfp4.dequantize(blocks, scales)
    ref = np.einsum("eci,eio->eco", x.astype(np.float64), w.astype(np.float64))
    got = jax.jit(lambda x, b, s: mxfp4.packed_expert_matmul(x, b, s))(x, blocks, scales)
    assert got.shape == (experts, tokens, out) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    got_bf16 = mxfp4.packed_expert_matmul(jnp.asarray(x, jnp.bfloat16), blocks, scales,
                                          preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(got_bf16), ref, rtol=3e-2, atol=3e-2 * np.abs(ref).max())


def test_packed_ragged_dot():
    rng = np.random.default_rng(6)
    experts, inn, out = 4, 32, 16
    blocks, scales = _packed(rng, experts, out, inn)
    sizes = np.array([2, 0, 3, 1], dtype=np.int32)
    x = rng.standard_normal((int(sizes.sum()) + 2, inn)).astype(np.float32)  # 2 padding rows at the end
    w = mxfp4.dequantize(blocks, scales).astype(np.float64)
    owner = np.repeat(np.arange(experts), sizes)
    ref = np.zeros((x.shape[0], out))
    ref[: len(owner)] = np.einsum("ti,tio->to", x[: len(owner)], w[owner])
    got = jax.jit(lambda x, b, s, g: mxfp4.packed_ragged_dot(x, b, s, g))(x, blocks, scales, sizes)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_sizes_helpers():
    bshape, sshape = mxfp4.packed_shapes(2880, 5760, 128)
    assert bshape == (128, 5760, 90, 16) and sshape == (128, 5760, 90)
    assert mxfp4.check_packed_shapes(bshape, sshape, 2880, 5760, 128) == (128, 2880, 5760)
    assert mxfp4.packed_nbytes(2880, 5760, 128) * 8 == 128 * 2880 * 5760 * 4.25
    key = "model.layers.0.mlp.experts.gate_up_proj"
    assert mxfp4.packed_key_names(key) == (key + "_blocks", key + "_scales")


def test_errors():
    name = "model-00001.safetensors:model.layers.0.mlp.experts.down_proj"
    blocks = np.zeros((2, 8, 3, 16), dtype=np.uint8)
    scales = np.zeros((2, 8, 3), dtype=np.uint8)
    assert issubclass(mxfp4.Mxfp4Error, UserError)

    with pytest.raises(UserError, match=r"down_proj.*blocks must be uint8.*int8"):
        mxfp4.dequantize(blocks.astype(np.int8), scales, name=name)
    with pytest.raises(UserError, match=r"scales must be uint8.*float32"):
        mxfp4.dequantize_jax(blocks, scales.astype(np.float32), name=name)
    with pytest.raises(UserError, match=r"blocks must have shape .*\[2, 8, 48\]"):
        mxfp4.dequantize(blocks.reshape(2, 8, 48), scales, name=name)
    with pytest.raises(UserError, match=r"blocks must have shape .*\[2, 8, 6, 8\]"):
        mxfp4.dequantize(blocks.reshape(2, 8, 6, 8), scales, name=name)
    with pytest.raises(UserError, match=r"scales must have shape .*\[2, 24\]"):
        mxfp4.dequantize(blocks, scales.reshape(2, 24), name=name)
    with pytest.raises(UserError, match=r"\[2, 8, 3, 16\] and scales \[2, 8, 4\] disagree"):
        mxfp4.dequantize(blocks, np.zeros((2, 8, 4), dtype=np.uint8), name=name)
    with pytest.raises(UserError, match=r"disagree"):
        mxfp4.packed_expert_matmul(np.zeros((3, 1, 96), np.float32), blocks, np.zeros((3, 8, 3), np.uint8))
    with pytest.raises(UserError, match=r"x must have shape \[experts=2, tokens, in=96\], got \[2, 1, 64\]"):
        mxfp4.packed_expert_matmul(np.zeros((2, 1, 64), np.float32), blocks, scales, name=name)
    with pytest.raises(UserError, match=r"group_sizes must have shape \[2\]"):
        mxfp4.packed_ragged_dot(np.zeros((4, 96), np.float32), blocks, scales, np.ones(3, np.int32))

    # loader-side check against the config, before reading any data
    with pytest.raises(UserError, match=r"down_proj.*in_features=64 but the tensor holds 96.*expected blocks "
                                        r"\[2, 8, 2, 16\]"):
        mxfp4.check_packed_shapes(blocks.shape, scales.shape, in_features=64, out_features=8, num_experts=2,
                                  name=name)
    with pytest.raises(UserError, match=r"num_experts=4 but the tensor holds 2"):
        mxfp4.check_packed_shapes(blocks.shape, scales.shape, 96, 8, 4, name=name)
    with pytest.raises(UserError, match=r"out_features=9 but the tensor holds 8"):
        mxfp4.check_packed_shapes(blocks.shape, scales.shape, 96, 9, 2, name=name)
    with pytest.raises(UserError, match=r"in_features=100 is not a multiple of 32"):
        mxfp4.check_packed_shapes(blocks.shape, scales.shape, 100, 8, 2, name=name)
