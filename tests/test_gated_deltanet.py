"""Gated DeltaNet (models/gated_deltanet.py) against transformers' torch reference, fp32 on CPU.

The recurrence and the chunked (UT transform) form against each other and against
``torch_recurrent_gated_delta_rule`` / ``torch_chunk_gated_delta_rule``; the whole layer against
``Qwen3_5GatedDeltaNet`` (and ``Qwen3NextGatedDeltaNet`` through ``split_qwen3_next_projections``) with the
torch weights copied in, including its cache (conv and recurrent states after a prefill, then one decode
step); and the properties the engine relies on: a prefill split in two with carried states equals one pass,
the state after each position equals a fresh run over that prefix, and right padding leaves a row's states
as if it ran alone. Tiny sizes: hidden 64, 2 key heads and 4 value heads of 16, kernel 4, T <= 40.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.models import gated_deltanet as gdn
from dflash_jax.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig, split_qwen3_next_projections

torch = pytest.importorskip("torch")
qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

B, T, NK, NV, DK, DV, HID, KC = 3, 37, 2, 4, 16, 16, 64, 4
LENGTHS = [40, 29, 17]  # the module tests: three rows, right padded to 40
CFG = GatedDeltaNetConfig(hidden_size=HID, num_k_heads=NK, num_v_heads=NV, head_k_dim=DK, head_v_dim=DV,
                          conv_kernel=KC, eps=1e-6)
ATOL = 1e-5

# Jitted: one compile per shape is much cheaper on CPU than dispatching the scans' ops one by one.
gated_delta_recurrent = jax.jit(gdn.gated_delta_recurrent, static_argnames=("normalize_qk", "all_states"))
gated_delta_chunked = jax.jit(gdn.gated_delta_chunked, static_argnames=("chunk", "normalize_qk"))
causal_conv1d = jax.jit(gdn.causal_conv1d, static_argnames=("activation", "all_states"))


def kernel_inputs(seed=0, t=T):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, t, NK, DK)).astype(np.float32)
    k = rng.standard_normal((B, t, NK, DK)).astype(np.float32)
    v = rng.standard_normal((B, t, NV, DV)).astype(np.float32)
    g = (-np.log1p(np.exp(rng.standard_normal((B, t, NV)))) * 0.3).astype(np.float32)  # <= 0
    beta = (1 / (1 + np.exp(-rng.standard_normal((B, t, NV))))).astype(np.float32)
    s0 = (0.5 * rng.standard_normal((B, NV, DK, DV))).astype(np.float32)
    return q, k, v, g, beta, s0


def close(got, want, atol=ATOL):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=atol, rtol=0)


def test_recurrent_equals_chunked():
    q, k, v, g, beta, s0 = kernel_inputs()
    o_r, s_r = gated_delta_recurrent(q, k, v, g, beta, s0)
    o_c, s_c = gated_delta_chunked(q, k, v, g, beta, s0, chunk=16)  # 37 tokens: 3 chunks, the last padded
    close(o_c, o_r)
    close(s_c, s_r)
    assert o_r.shape == (B, T, NV, DV) and s_r.shape == (B, NV, DK, DV) and s_r.dtype == jnp.float32


def test_unit_lower_solve_methods_agree():
    # The UT transform's systems as the chunked form builds them (unit diagonal, strictly lower part
    # beta k_i.k_j times a decay), batched [2, 3, 64, 64]; both methods against float64 NumPy.
    rng = np.random.default_rng(3)
    k = rng.standard_normal((2, 3, 64, DK))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = 1 / (1 + np.exp(-rng.standard_normal((2, 3, 64))))
    cum = np.cumsum(-0.1 * np.abs(rng.standard_normal((2, 3, 64))), axis=-1)
    lower = np.tril((k * beta[..., None]) @ np.swapaxes(k, -1, -2) * np.exp(cum[..., :, None] - cum[..., None, :]), -1)
    lower += np.eye(64)
    rhs = rng.standard_normal((2, 3, 64, 2 * DV))
    want = np.linalg.solve(lower, rhs)
    got = {m: gdn.unit_lower_solve(jnp.asarray(lower, jnp.float32), jnp.asarray(rhs, jnp.float32), m)
           for m in ("rows", "native")}
    for m, x in got.items():
        np.testing.assert_allclose(np.asarray(x), want, atol=1e-5, rtol=0, err_msg=m)
    with pytest.raises(ValueError, match="'rows' or 'native'"):
        gdn.unit_lower_solve(jnp.asarray(lower), jnp.asarray(rhs), "qr")


def test_kernels_equal_transformers():
    q, k, v, g, beta, s0 = kernel_inputs(1)
    rep = lambda x: torch.from_numpy(x).repeat_interleave(NV // NK, dim=2)  # what the torch layer does
    args = (rep(q), rep(k), torch.from_numpy(v), torch.from_numpy(g), torch.from_numpy(beta))
    kw = dict(initial_state=torch.from_numpy(s0), output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_o, want_s = qwen3_5.torch_recurrent_gated_delta_rule(*args, **kw)
    want_oc, want_sc = qwen3_5.torch_chunk_gated_delta_rule(*args, chunk_size=16, **kw)
    o_r, s_r = gated_delta_recurrent(q, k, v, g, beta, s0)
    o_c, s_c = gated_delta_chunked(q, k, v, g, beta, s0, chunk=16)
    for got_o, got_s in ((o_r, s_r), (o_c, s_c)):
        for wo, ws in ((want_o, want_s), (want_oc, want_sc)):
            close(got_o, wo.numpy())
            close(got_s, ws.numpy())


def test_kernel_padding_and_per_position_states():
    q, k, v, g, beta, s0 = kernel_inputs(2)
    lengths = np.array([T, 23, 5])
    valid = np.arange(T)[None] < lengths[:, None]
    o_all, states = gated_delta_recurrent(q, k, v, g, beta, s0, valid=valid, all_states=True)
    _, s_c = gated_delta_chunked(q, k, v, g, beta, s0, chunk=16, valid=valid)
    close(s_c, states[:, -1])
    # Each prefix runs once alone (one compile per length): a padded row's run alone must equal its padded
    # run (outputs, and the state after its last token and after the padding); the full row's run over its
    # first n tokens must equal the state after its position n - 1.
    for n in lengths[1:]:
        for row in (0, list(lengths).index(n)):
            sl = lambda x: x[row:row + 1, :n]
            o_alone, s_alone = gated_delta_recurrent(sl(q), sl(k), sl(v), sl(g), sl(beta), s0[row:row + 1])
            close(o_all[row:row + 1, :n], o_alone)
            close(states[row, n - 1], s_alone[0])
            if row:
                np.testing.assert_array_equal(np.asarray(o_all[row, n:]), 0.0)
                close(states[row, -1], s_alone[0])
                # bit for bit: a pad step is S * exp(0) + 0 * (..) = S
                np.testing.assert_array_equal(np.asarray(states[row, n:]),
                                              np.broadcast_to(states[row, n - 1], states[row, n:].shape))


def test_conv_prefill_then_extension():
    rng = np.random.default_rng(3)
    c = 5
    x = rng.standard_normal((B, 11, c)).astype(np.float32)
    w = rng.standard_normal((c, 1, KC)).astype(np.float32)
    want = torch.nn.functional.silu(torch.nn.functional.conv1d(
        torch.from_numpy(x).transpose(1, 2), torch.from_numpy(w), padding=KC - 1, groups=c)[..., :11])
    y, _ = causal_conv1d(x, w)
    close(y, want.transpose(1, 2).numpy())
    lengths = np.array([6, 2, 0])
    y1, st = causal_conv1d(x[:, :6], w, valid=np.arange(6)[None] < lengths[:, None])
    for row, n in enumerate(lengths):
        y2, _ = causal_conv1d(x[row:row + 1, n:], w, st[row:row + 1])
        y_full, _ = causal_conv1d(x[row:row + 1], w)
        close(y2, y_full[:, n:])
        close(y1[row, :n], y_full[0, :n])


# ----------------------------------------------------------------------------------------------- the layer


def torch_layer(seed=0):
    from transformers import Qwen3_5TextConfig

    hf = Qwen3_5TextConfig(hidden_size=HID, num_hidden_layers=1, linear_num_key_heads=NK,
                           linear_num_value_heads=NV, linear_key_head_dim=DK, linear_value_head_dim=DV,
                           linear_conv_kernel_dim=KC, rms_norm_eps=1e-6, layer_types=["linear_attention"])
    torch.manual_seed(seed)
    layer = qwen3_5.Qwen3_5GatedDeltaNet(hf, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.05, 1.0)))
            elif name == "norm.weight":
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name == "out_proj.weight":  # outputs of order 1, so that 1e-5 absolute means something
                p.copy_(0.05 * torch.randn_like(p))
            else:
                p.copy_(0.25 * torch.randn_like(p))
    return hf, layer


def params_from(sd):
    sd = {k: v.detach().numpy() for k, v in sd.items()}
    lin = lambda name: {"kernel": sd[f"{name}.weight"].T}
    return {**{n: lin(n) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")},
            "conv1d": {"weight": sd["conv1d.weight"]}, "A_log": sd["A_log"], "dt_bias": sd["dt_bias"],
            "norm": {"weight": sd["norm.weight"]}}


@pytest.fixture(scope="module")
def layer_setup():
    hf, layer = torch_layer()
    x = np.random.default_rng(4).standard_normal((B, max(LENGTHS), HID)).astype(np.float32)
    valid = np.arange(max(LENGTHS))[None] < np.array(LENGTHS)[:, None]
    return hf, layer, params_from(layer.state_dict()), x, valid


@functools.partial(jax.jit, static_argnames=("all_states", "path"))
def run(params, x, valid=None, state=None, all_states=False, path=None):
    return GatedDeltaNet(CFG, chunk_size=16).apply({"params": params}, x, valid, state, all_states=all_states,
                                                   path=path)


@pytest.mark.parametrize("path", ["chunked", "recurrent"])
def test_layer_equals_transformers(layer_setup, path):
    _, layer, params, x, valid = layer_setup
    with torch.no_grad():
        want = layer(torch.from_numpy(x), attention_mask=torch.from_numpy(valid)).numpy()
    got, _ = run(params, x, valid, path=path)
    close(np.where(valid[..., None], got, 0), np.where(valid[..., None], want, 0))
    np.testing.assert_array_equal(np.asarray(got)[~valid], 0.0)  # pads: o = 0, so out_proj(0) = 0


def test_layer_states_equal_transformers_cache(layer_setup):
    """Prefill a row with transformers' cache, then decode one token: our carried (conv, recurrent) states
    give the same decode output, and equal transformers' cached states (its conv state keeps K columns)."""
    from transformers import DynamicCache

    hf, layer, params, x, _ = layer_setup
    n = 17
    row = x[1:2]
    cache = DynamicCache(config=hf)
    with torch.no_grad():
        layer(torch.from_numpy(row[:, :n]), cache_params=cache)
        hf_conv = cache.layers[0].conv_states[0].numpy().copy()  # [1, C, K]
        hf_rec = cache.layers[0].recurrent_states[0].numpy().copy()
        want_next = layer(torch.from_numpy(row[:, n:n + 1]), cache_params=cache).numpy()
    _, (conv_state, rec_state) = run(params, row[:, :n])
    close(conv_state, hf_conv[..., 1:].transpose(0, 2, 1))
    close(rec_state, hf_rec)
    got_next, _ = run(params, row[:, n:n + 1], state=(conv_state, rec_state))
    close(got_next, want_next)


def test_layer_prefill_in_two_pieces(layer_setup):
    _, _, params, x, valid = layer_setup
    out, (conv, rec) = run(params, x, valid)
    cut = 20  # row 2 (17 tokens) has nothing valid in the second piece: its states must pass through
    zeros = (jnp.zeros((B, KC - 1, CFG.conv_dim)), jnp.zeros((B, NV, DK, DV)))  # == None; one compile for both
    out1, st1 = run(params, x[:, :cut], valid[:, :cut], state=zeros)
    out2, (conv2, rec2) = run(params, x[:, cut:], valid[:, cut:], state=st1)
    close(np.concatenate([out1, out2], axis=1)[valid], np.asarray(out)[valid])
    close(conv2, conv)
    close(rec2, rec)


def test_layer_per_position_states(layer_setup):
    _, _, params, x, valid = layer_setup
    _, (conv_all, rec_all) = run(params, x, valid, all_states=True)
    _, (conv, rec) = run(params, x, valid)
    close(conv_all[:, -1], conv)
    close(rec_all[:, -1], rec)
    for row, n in ((0, 17), (0, 29), (1, 17)):  # the state after position n - 1 == a fresh run over n tokens
        _, (conv_n, rec_n) = run(params, x[row:row + 1, :n])
        close(conv_all[row, n - 1], conv_n[0])
        close(rec_all[row, n - 1], rec_n[0])


def test_layer_padding_leaves_states_exact(layer_setup):
    _, _, params, x, valid = layer_setup
    _, (conv, rec) = run(params, x, valid)
    for row, n in list(enumerate(LENGTHS))[1:]:  # the padded rows
        _, (conv_r, rec_r) = run(params, x[row:row + 1, :n])
        close(conv[row:row + 1], conv_r, atol=1e-6)
        close(rec[row:row + 1], rec_r, atol=1e-6)


def test_qwen3_next_projections():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    hf = Qwen3NextConfig(hidden_size=HID, num_hidden_layers=1, linear_num_key_heads=NK,
                         linear_num_value_heads=NV, linear_key_head_dim=DK, linear_value_head_dim=DV,
                         linear_conv_kernel_dim=KC, rms_norm_eps=1e-6, layer_types=["linear_attention"])
    torch.manual_seed(5)
    layer = Qwen3NextGatedDeltaNet(hf, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.log(torch.empty_like(p).uniform_(0.05, 1.0)) if name == "A_log"
                    else 0.25 * torch.randn_like(p) + (name == "norm.weight"))
    sd = dict(layer.state_dict())
    split = split_qwen3_next_projections(sd.pop("in_proj_qkvz.weight").numpy(),
                                         sd.pop("in_proj_ba.weight").numpy(), CFG)
    sd.update({f"{k}.weight": torch.from_numpy(v) for k, v in split.items()})
    x = np.random.default_rng(6).standard_normal((1, 29, HID)).astype(np.float32)
    with torch.no_grad():
        want = layer(torch.from_numpy(x)).numpy()
    got, _ = run(params_from(sd), x)
    close(got, want)


def test_tree_block_runs_each_token_from_its_root_path(layer_setup):
    """A tree block through the decode cache (``LinearState``, ``tree=ancestors``): every token's output equals a
    plain extension of the committed state by its root path (the recurrence and the causal conv, checked above
    against transformers) at the path's last token; after ``KVCache.commit_path`` of one root-to-leaf path, the
    state the next forward reads (``committed_state``) equals that plain extension's final states (1e-5)."""
    from dflash_jax.engine.tree import commit_permutation
    from dflash_jax.models.cache import KVCache, LinearState

    _, _, params, x, _ = layer_setup
    n = 11  # committed tokens
    parents = [0, 0, 0, 1, 1, 2, 3, 6]  # node 0 the root; depth 4 reaches past the conv window
    t = len(parents)
    anc = np.eye(t, dtype=bool)
    for i in range(1, t):
        anc[i] |= anc[parents[i]]
    path_of = lambda i: [int(j) for j in np.flatnonzero(anc[i])]  # noqa: E731 (ancestors come first)
    tree_x = np.random.default_rng(9).standard_normal((1, t, HID)).astype(np.float32)
    _, (conv0, rec0) = run(params, x[:1, :n])
    state = LinearState.create(1, 16, KC, CFG.conv_dim, NV, DK, DV).replace(
        conv=conv0, recurrent=rec0, start=jnp.asarray([n], jnp.int32))
    lengths = jnp.asarray([n], jnp.int32)
    out, pending = jax.jit(lambda p, xs, st, tr: GatedDeltaNet(CFG).apply(
        {"params": p}, xs, None, st, lengths=lengths, tree=tr))(params, tree_x, state, anc[None])
    for i in range(t):
        want, _ = run(params, tree_x[:, path_of(i)], state=(conv0, rec0))
        close(out[:, i], want[:, -1])
    leaf = t - 1
    path = np.asarray(path_of(leaf), np.int32)
    depth = len(path) - 1
    perm = commit_permutation(jnp.asarray(np.pad(path, (0, t - len(path)))), jnp.int32(depth), t - 1)
    cache = KVCache((), (), lengths, (pending,)).commit_path(lengths, perm[None], lengths + depth + 1)
    conv, rec = gdn.committed_state(cache.linear[0], cache.lengths)
    _, (want_conv, want_rec) = run(params, tree_x[:, path], state=(conv0, rec0))
    close(conv, want_conv)
    close(rec, want_rec)
