"""The draft forward vs the plain NumPy reference of SPEC section 4 (tests/reference_draft_numpy.py).

Tolerance: max |ours - reference| <= 1e-5 * max(1, max |reference|) in fp32 (the reference runs in float64).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.checkpoints.official_draft import load_draft
from dflash_jax.models.draft import DraftModel, SharedHead, init_draft_cache
from draft_tiny import HIDDEN, VOCAB, official_config, write_official_draft
from reference_draft_numpy import draft_forward_reference

SLOTS = 64


def build(tmp_path, name, tied=False, **overrides):
    cfg = official_config(**overrides)
    weights = write_official_draft(tmp_path / name, cfg, seed=len(name))
    config, params = load_draft(tmp_path / name)
    rng = np.random.default_rng(7)
    embed = (rng.standard_normal((VOCAB, HIDDEN)) * 0.5).astype(np.float32)
    head = embed if tied else (rng.standard_normal((VOCAB, HIDDEN)) * 0.5).astype(np.float32)
    shared = SharedHead(jnp.asarray(embed), None if tied else jnp.asarray(head.T))
    model = DraftModel(config)
    return cfg, weights, config, params, model, shared, embed, head


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build(tmp_path_factory.mktemp("draft"), "full")


def rand_features(rng, rows, t, n=2):
    return rng.standard_normal((rows, t, n * HIDDEN)).astype(np.float32)


def block_tokens(rng, rows, block, mask_id):
    toks = np.full((rows, block), mask_id, np.int32)
    toks[:, 0] = rng.integers(0, VOCAB - 1, size=rows)
    return toks


def check(ours, cfg, weights, embed, head, feats, ctx_len, toks, start):
    ref = draft_forward_reference(weights, cfg, embed, head, feats[:ctx_len], toks, start)
    err = np.abs(np.asarray(ours, np.float64) - ref).max()
    assert err <= 1e-5 * max(1.0, np.abs(ref).max()), err
    return err


def run_rounds(bundle, lengths, rounds, seed=0):
    """Feed each row's context in the chunks ``rounds`` (list of per-row chunk sizes), drafting after each
    chunk, and compare every draft with the reference over the whole context so far."""
    cfg, weights, config, params, model, shared, embed, head = bundle
    rng = np.random.default_rng(seed)
    rows, block = len(lengths), config.block_size
    feats = rand_features(rng, rows, max(lengths))
    cache = init_draft_cache(config, rows, SLOTS)
    apply = jax.jit(model.apply)
    done = np.zeros(rows, int)
    worst = 0.0
    for chunk in rounds:
        tc = max(chunk)
        ctx_pos = done[:, None] + np.arange(tc)[None]
        ctx_valid = np.arange(tc)[None] < np.asarray(chunk)[:, None]
        ctx_feat = np.stack([np.pad(feats[b, done[b]: done[b] + chunk[b]], ((0, tc - chunk[b]), (0, 0)))
                             for b in range(rows)])
        done = done + np.asarray(chunk)
        toks = block_tokens(rng, rows, block, config.mask_token_id)
        pos = done[:, None] + np.arange(block)[None]
        out = apply({"params": params}, toks, pos, ctx_feat, ctx_pos, ctx_valid, cache, shared)
        cache = out.cache
        for b in range(rows):
            worst = max(worst, check(out.logits[b], cfg, weights, embed, head, feats[b], done[b], toks[b], done[b]))
    return worst, out, cache


def test_first_round_long_context_batch_of_different_lengths(tiny):
    worst, _, cache = run_rounds(tiny, [37, 21], [[37, 21]])
    np.testing.assert_array_equal(cache.lengths, [37, 21])
    print(f"first round: max err {worst:.2e}")


def test_later_round_with_partly_filled_cache(tiny):
    worst, _, _ = run_rounds(tiny, [30, 26], [[20, 9], [4, 8], [6, 9]])
    print(f"later rounds: max err {worst:.2e}")


def test_sliding_window_layer(tmp_path):
    bundle = build(tmp_path, "sliding", layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    run_rounds(bundle, [25, 14], [[18, 7], [7, 7]])


def test_tied_embedding_target(tmp_path):
    bundle = build(tmp_path, "tied", tied=True)
    run_rounds(bundle, [12, 19], [[12, 19]])


def test_llama3_rope_bias_and_scalars(tmp_path):
    bundle = build(
        tmp_path, "extras", attention_bias=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16},
        dflash_config={"target_layer_ids": [0, 2], "mask_token_id": VOCAB - 1, "input_embedding_scale": 1.5,
                       "output_multiplier": 0.7, "final_logit_softcapping": 4.0},
    )
    run_rounds(bundle, [15, 22], [[15, 22]])


def test_context_in_three_chunks_equals_context_at_once(tiny):
    cfg, weights, config, params, model, shared, embed, head = tiny
    rng = np.random.default_rng(3)
    feats = rand_features(rng, 1, 27)
    toks = block_tokens(rng, 1, config.block_size, config.mask_token_id)
    pos = 27 + np.arange(config.block_size)[None]
    apply = jax.jit(model.apply)

    def draft_after(chunks):
        cache, start = init_draft_cache(config, 1, SLOTS), 0
        for n in chunks:
            p = start + np.arange(n)[None]
            # Drafting with a throwaway block after each chunk must not disturb the cache.
            out = apply({"params": params}, toks, start + n + np.arange(config.block_size)[None],
                        feats[:, start:start + n], p, np.ones((1, n), bool), cache, shared)
            cache, start = out.cache, start + n
        empty = np.zeros((1, 1, feats.shape[-1]), np.float32)
        return apply({"params": params}, toks, pos, empty, np.zeros((1, 1), np.int32), np.zeros((1, 1), bool),
                     cache, shared)

    once, chunked = draft_after([27]), draft_after([10, 9, 8])
    np.testing.assert_allclose(chunked.logits, once.logits, atol=1e-5, rtol=0)
    for a, b in zip(once.cache.keys, chunked.cache.keys):
        np.testing.assert_allclose(a[:, :, :27], b[:, :, :27], atol=1e-6, rtol=0)


def test_public_one_round_draft_logits(tiny):
    """``engine.proposers.draft_logits`` (the debugging/parity entry point) against the NumPy reference."""
    from dflash_jax.engine.proposers import draft_logits

    cfg, weights, config, params, model, shared, embed, head = tiny
    rng = np.random.default_rng(3)
    feats = rand_features(rng, 2, 11)
    anchors = np.array([5, 17], np.int32)
    logits = np.asarray(draft_logits(config, params, shared, feats, anchors, block_size=6))
    assert logits.shape == (2, 5, VOCAB)
    for row in range(2):
        toks = np.array([anchors[row]] + [config.mask_token_id] * 5, np.int32)
        ref = draft_forward_reference(weights, cfg, embed, head, feats[row], toks, 11)[1:]
        assert np.abs(logits[row] - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())
    with pytest.raises(ValueError, match="block size 99"):
        draft_logits(config, params, shared, feats, anchors, block_size=99)


def test_kv_head_copies_are_exact(tiny):
    """``kv_replicas`` (a tensor axis wider than the KV heads, ``DFlashProposer.on_mesh``) keeps each KV head
    twice in the context cache: the drafts equal the NumPy reference, and each cached head equals its copy."""
    import dataclasses

    cfg, weights, config, params, model, shared, embed, head = tiny
    doubled = dataclasses.replace(config, kv_replicas=2)
    assert doubled.kv_copies == 2 and dataclasses.replace(config, kv_replicas=4).kv_copies == 1  # 2 q per kv
    worst, _, cache = run_rounds((cfg, weights, doubled, params, DraftModel(doubled), shared, embed, head),
                                 [11, 6], [[7, 2], [4, 4]])
    keys = np.asarray(cache.keys[0])
    assert keys.shape[1] == 2 * config.num_key_value_heads
    np.testing.assert_array_equal(keys[:, 0::2], keys[:, 1::2])
