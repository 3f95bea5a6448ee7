"""Ring caches of sliding-window target layers (``models/cache.ring_slots``): a tiny gpt-oss target (window 6,
sinks, 4 layers of which 2 slide) decoded through prefill chunks and verify blocks with per-row rollback gives,
at every forward, the same logits with rings as with full-length caches (tolerance 1e-5, float32), and the
next token's logits equal a plain full forward of the committed tokens without any cache (1e-4 of the largest
logit); the engine's greedy DFlash output
equals the autoregressive one with rings (tests/test_family_engine.py decodes every family end to end)."""

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models.target import TargetModel, init_cache
from engine_tiny import tiny_moe_target

BLOCK, SLOTS = 4, 64


def test_rings_equal_full_caches_through_chunks_rounds_and_rollback():
    tc, tp = tiny_moe_target("gpt_oss")
    window = tc.window(0)
    assert window == 6 and tc.window(1) is None
    model = TargetModel(tc)
    forward = jax.jit(lambda cache, toks, pos, valid: model.apply({"params": tp}, toks, pos, cache, valid))
    rings, full = init_cache(tc, 2, SLOTS, extension=BLOCK), init_cache(tc, 2, SLOTS, extension=BLOCK, rings=False)
    assert rings.keys[0].shape[2] == window - 1 + BLOCK and full.keys[0].shape[2] == SLOTS
    assert rings.keys[1].shape[2] == SLOTS and rings.num_slots == SLOTS
    rng = np.random.default_rng(0)
    lengths = np.array([13, 9])
    history = [list(rng.integers(0, tc.vocab_size, n)) for n in lengths]  # committed tokens per row
    # Prefill in chunks of 8 positions (the second chunk wraps the 9-slot ring), then rounds of BLOCK tokens
    # whose acceptance differs per row.
    chunks = [(0, 8), (8, 16)]
    for start, end in chunks:
        pos = np.broadcast_to(np.arange(start, end), (2, end - start))
        valid = pos < lengths[:, None]
        toks = np.array([[h[p] if p < len(h) else 0 for p in range(start, end)] for h in history])
        out_r, out_f = forward(rings, toks, pos, valid), forward(full, toks, pos, valid)
        np.testing.assert_allclose(out_r.logits, out_f.logits, atol=1e-5, rtol=1e-5)
        rings, full = out_r.cache, out_f.cache
    for _ in range(6):
        starts = np.asarray(rings.lengths)
        toks = rng.integers(0, tc.vocab_size, (2, BLOCK))
        pos = starts[:, None] + np.arange(BLOCK)[None]
        valid = np.ones((2, BLOCK), bool)
        out_r, out_f = forward(rings, toks, pos, valid), forward(full, toks, pos, valid)
        np.testing.assert_allclose(out_r.logits, out_f.logits, atol=1e-5, rtol=1e-5)
        keep = rng.integers(1, BLOCK + 1, 2)  # the anchor plus 0..BLOCK-1 accepted tokens
        for row in range(2):
            history[row] += toks[row, : keep[row]].tolist()
        new = jnp.asarray(starts + keep, jnp.int32)
        rings, full = out_r.cache.with_lengths(new), out_f.cache.with_lengths(new)
    # What the rounds stood on: the next token's logits through the ring cache equal a plain full forward of
    # each row's committed tokens without any cache (tolerance 1e-4 of the largest logit, as the parity tests
    # scale theirs: another order of the float32 sums, and the plain forward's many tokens take another expert
    # path than the cached single token; 2.2e-4 absolute at logits up to 6 on this Xeon, 2026-12-03).
    starts = np.asarray(rings.lengths)
    assert list(starts) == [len(h) for h in history]
    nxt = rng.integers(0, tc.vocab_size, (2, 1))
    out = forward(rings, nxt, starts[:, None], np.ones((2, 1), bool))
    for row in range(2):
        seq = np.concatenate([history[row], nxt[row]])[None]
        plain = model.apply({"params": tp}, seq, np.arange(seq.shape[1])[None])
        want = np.asarray(plain.logits[0, -1])
        err = np.abs(np.asarray(out.logits[row, 0]) - want).max()
        assert err <= 1e-4 * max(1.0, np.abs(want).max()), (row, err)
