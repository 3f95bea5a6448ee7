"""The input-injection draft (the paper's ablation of DFlash's per-layer KV injection).

DFlash projects the fused target features into extra keys/values in EVERY draft layer. The ablation feeds
them only at the input: the context positions are ordinary causal tokens of the draft, and a layer's block
attends to the context's keys/values at that layer. The oracle below is a brute-force construction of that
definition, written here in float64 NumPy: ONE sequence ``[context; block]`` through a plain transformer with
one explicit visibility matrix (context causal, block sees all context plus its whole block). The library
computes it differently (a cache written round by round at inference, a packed causal pass plus packed blocks
in training); both must equal the oracle at ``1e-5 * max(1, max |logit|)`` in float32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.checkpoints.official_draft import init_draft_params, load_draft
from dflash_jax.engine.generate import DecodeSettings, generate
from dflash_jax.engine.proposers import DFlashProposer, NoProposer
from dflash_jax.models.config import ConfigError
from dflash_jax.models.draft import DraftModel, SharedHead, init_draft_cache, shared_head
from dflash_jax.models.draft_config import DraftConfig
from dflash_jax.training.anchors import block_labels
from dflash_jax.training.forward import draft_training_logits
from draft_tiny import HIDDEN, VOCAB, official_config, write_official_draft
from engine_tiny import tiny_target
from reference_draft_numpy import _apply_rope, _linear, _rms_norm, _rope_inv_freq, _silu

B, L = 8, 24


def input_injection_reference(weights, config, embed, head, context_features, block_tokens, window=None,
                              sliding_layers=()):
    """Float64 logits ``[B, V]``: the draft as one plain transformer over ``[context (t) ; block (B)]``."""
    eps = config["rms_norm_eps"]
    heads, kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    t = context_features.shape[0]
    n = t + len(block_tokens)
    pos = np.arange(n)
    is_ctx = pos < t
    # visible[i, j]: context queries see context keys j <= i; block queries see every context key and the block.
    visible = np.where(is_ctx[:, None], is_ctx[None, :] & (pos[None, :] <= pos[:, None]), True)
    ctx = _rms_norm(_linear(np.asarray(context_features, np.float64), weights, "fc"), weights["hidden_norm.weight"], eps)
    x = np.concatenate([ctx, np.asarray(embed, np.float64)[block_tokens]])
    inv_freq = _rope_inv_freq(config)
    for li in range(config["num_hidden_layers"]):
        p = f"layers.{li}."
        vis = visible.copy()
        if li in sliding_layers:  # sliding layers are causal (no is_causal in the config): the block too
            diff = pos[:, None] - pos[None, :]
            vis &= (diff >= 0) & (diff < window)
        h = _rms_norm(x, weights[p + "input_layernorm.weight"], eps)
        q = _rms_norm(_linear(h, weights, p + "self_attn.q_proj").reshape(n, heads, d), weights[p + "self_attn.q_norm.weight"], eps)
        k = _rms_norm(_linear(h, weights, p + "self_attn.k_proj").reshape(n, kv, d), weights[p + "self_attn.k_norm.weight"], eps)
        v = _linear(h, weights, p + "self_attn.v_proj").reshape(n, kv, d)
        q, k = _apply_rope(q, pos, inv_freq), _apply_rope(k, pos, inv_freq)
        out = np.zeros((n, heads, d))
        for hq in range(heads):
            s = q[:, hq] @ k[:, hq // (heads // kv)].T * d**-0.5
            s = np.where(vis, s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            out[:, hq] = (w / w.sum(-1, keepdims=True)) @ v[:, hq // (heads // kv)]
        x = x + _linear(out.reshape(n, -1), weights, p + "self_attn.o_proj")
        h2 = _rms_norm(x, weights[p + "post_attention_layernorm.weight"], eps)
        x = x + _linear(_silu(_linear(h2, weights, p + "mlp.gate_proj")) * _linear(h2, weights, p + "mlp.up_proj"),
                        weights, p + "mlp.down_proj")
    x = _rms_norm(x[t:], weights["norm.weight"], eps)
    return x @ np.asarray(head, np.float64).T


@pytest.fixture(scope="module", params=["full", "sliding"])
def bundle(request, tmp_path_factory):
    extra = {}
    if request.param == "sliding":  # window 5 < B: limits the context pass and the block alike
        extra = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    cfg = official_config(**extra)
    cfg["dflash_config"] = {**cfg["dflash_config"], "context_injection": "input"}
    path = tmp_path_factory.mktemp("input") / request.param
    weights = write_official_draft(path, cfg, seed=3)
    config, params = load_draft(path)
    assert config.context_injection == "input"
    rng = np.random.default_rng(7)
    embed = (rng.standard_normal((VOCAB, HIDDEN)) * 0.5).astype(np.float32)
    head = (rng.standard_normal((VOCAB, HIDDEN)) * 0.5).astype(np.float32)
    shared = SharedHead(jnp.asarray(embed), jnp.asarray(head.T))
    sliding = (0,) if request.param == "sliding" else ()
    ref = lambda ctx, blk: input_injection_reference(weights, cfg, embed, head, ctx, blk, 5, sliding)  # noqa: E731
    return config, params, DraftModel(config), shared, ref


def features(seed=0):
    return np.random.default_rng(seed).standard_normal((L, 2 * HIDDEN)).astype(np.float32)


def assert_close(got, want):
    tol = 1e-5 * max(1.0, np.abs(want).max())
    err = np.abs(got - want).max()
    assert err <= tol, (err, tol)


def test_inference_forward_written_round_by_round_equals_reference(bundle):
    config, params, model, shared, ref = bundle
    feats = features()
    blk = np.array([5] + [config.mask_token_id] * (B - 1), np.int32)
    apply = jax.jit(model.apply)
    cache = init_draft_cache(config, 1, L + B)
    # Context arrives in uneven pieces, as accepted tokens do across rounds; padding slots are invalid.
    start = 0
    for piece in (7, 1, 4, 3):
        ctx = np.zeros((1, 6, 2 * HIDDEN), np.float32)
        n = min(piece, 6)
        ctx[0, :n] = feats[start:start + n]
        ctx_pos = (start + np.arange(6, dtype=np.int32))[None]
        out = apply({"params": params}, blk[None], start + n + np.arange(B, dtype=np.int32)[None], ctx, ctx_pos,
                    np.arange(6)[None] < n, cache, shared)
        cache = out.cache
        start += n
        assert_close(np.asarray(out.logits[0]), ref(feats[:start], blk))
    assert int(cache.lengths[0]) == start


def test_training_forward_equals_reference(bundle):
    config, params, model, shared, ref = bundle
    feats = features(1)[None]
    tokens = np.random.default_rng(2).integers(0, VOCAB - 1, size=(1, L)).astype(np.int32)
    anchors = np.array([[0, 3, 11, 20]], np.int32)
    valid = np.ones((1, 4), bool)
    blk, pos, _, _ = block_labels(tokens, np.ones((1, L), np.int32), np.array([L]), anchors, valid, B,
                                  mask_token_id=config.mask_token_id)
    logits = np.asarray(jax.jit(lambda p: draft_training_logits(model, p, feats, blk, pos, valid, shared))(params))
    for i, a in enumerate(anchors[0]):
        assert_close(logits[0, i], ref(feats[0, :a], np.asarray(blk[0, i])))


def test_engine_with_input_injection_draft_is_lossless():
    tc, tp = tiny_target()
    cfg = official_config()
    cfg["dflash_config"] = {**cfg["dflash_config"], "context_injection": "input"}
    config = DraftConfig.from_dict(cfg)
    params = init_draft_params(config, seed=1)
    prompts = [[3, 9, 4, 1, 7], [2, 8, 8, 6, 5, 4, 3, 2, 1]]
    settings = DecodeSettings(max_new_tokens=24)
    ar = generate(tc, tp, prompts, NoProposer(), NoProposer().init(), settings)
    prop = DFlashProposer(config, B)
    out = generate(tc, tp, prompts, prop, prop.init(params, shared_head(tp, False), 2, 16 + 24 + B), settings)
    assert out.tokens == ar.tokens


def test_config_round_trip_and_bad_value():
    cfg = official_config()
    assert DraftConfig.from_dict(cfg).context_injection == "every_layer"
    assert "context_injection" not in DraftConfig.from_dict(cfg).to_official_dict()["dflash_config"]
    cfg["dflash_config"] = {**cfg["dflash_config"], "context_injection": "input"}
    again = DraftConfig.from_dict(DraftConfig.from_dict(cfg).to_official_dict())
    assert again.context_injection == "input"
    cfg["dflash_config"]["context_injection"] = "sometimes"
    with pytest.raises(ConfigError, match="context_injection must be one of every_layer, input, got 'sometimes'"):
        DraftConfig.from_dict(cfg, source="x/config.json")
