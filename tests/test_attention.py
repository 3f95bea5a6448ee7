"""``layers.cache_attention`` (the live-length attention loop) against a dense NumPy softmax.

Shapes cover several chunks, a last chunk that runs past the cache (so its slice is moved back and overlaps
the previous chunk), rows of different lengths, grouped-query heads, an extra segment joining the softmax
and a fully masked query row. Tolerance 1e-5 (float32 against float64).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.models.layers import cache_attention

B, T, HQ, HKV, D, S = 2, 3, 4, 2, 8, 600


def reference(q, k, v, mask, extra=None):
    """Dense softmax over all visible keys (and the extra segment), float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    out = np.zeros(q.shape)
    for b in range(B):
        for h in range(HQ):
            kh = h // (HQ // HKV)
            keys, vals, vis = k[b, kh], v[b, kh], mask[b]
            if extra is not None:
                ek, ev, em = np.asarray(extra[0], np.float64), np.asarray(extra[1], np.float64), extra[2]
                keys = np.concatenate([keys, ek[b, kh]])
                vals = np.concatenate([vals, ev[b, kh]])
                vis = np.concatenate([vis, em[b]], axis=1)
            for t in range(T):
                if not vis[t].any():
                    continue
                s = keys[vis[t]] @ q[b, t, h] * D**-0.5
                w = np.exp(s - s.max())
                out[b, t, h] = (w / w.sum()) @ vals[vis[t]]
    return out


@pytest.mark.parametrize("chunk", [256, 100, 1024])
def test_cache_attention_equals_dense_softmax(chunk):
    rng = np.random.default_rng(chunk)
    q = rng.standard_normal((B, T, HQ, D)).astype(np.float32)
    k = rng.standard_normal((B, HKV, S, D)).astype(np.float32)
    v = rng.standard_normal((B, HKV, S, D)).astype(np.float32)
    lengths = np.array([590, 137], np.int32)
    q_pos = np.array([[585, 588, 589], [130, 20, 0]], np.int32)
    extra = (rng.standard_normal((B, HKV, 5, D)).astype(np.float32),
             rng.standard_normal((B, HKV, 5, D)).astype(np.float32), rng.random((B, T, 5)) < 0.7)
    extra[2][1, 2] = False  # row 1, query 2 (position 0) with a key at slot 0 only

    def visible(pos):
        return (pos[None, None, :] <= jnp.asarray(q_pos)[:, :, None]) & (pos < jnp.asarray(lengths)[:, None, None])

    slot = np.arange(S)
    dense_mask = (slot[None, None, :] <= q_pos[:, :, None]) & (slot < lengths[:, None, None])
    fn = jax.jit(lambda *a: cache_attention(*a[:3], visible, a[3], extra=[a[4:]], chunk=chunk))
    got = np.asarray(fn(q, k, v, jnp.int32(lengths.max()), *extra))
    want = reference(q, k, v, dense_mask, extra)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # Without the extra segment a query that sees nothing gets zeros, not NaN.
    none_visible = lambda pos: jnp.zeros((B, T, pos.shape[0]), bool)  # noqa: E731
    assert not np.asarray(cache_attention(q, k, v, none_visible, jnp.int32(S), chunk=chunk)).any()


def test_slots_past_the_live_length_are_never_read():
    """NaN in every slot at or past the live length must not reach the output (those chunks are skipped)."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, T, HQ, D)).astype(np.float32)
    k = rng.standard_normal((B, HKV, S, D)).astype(np.float32)
    v = rng.standard_normal((B, HKV, S, D)).astype(np.float32)
    k[:, :, 300:] = np.nan
    v[:, :, 300:] = np.nan
    visible = lambda pos: jnp.broadcast_to(pos < 300, (B, T, pos.shape[0]))  # noqa: E731
    out = np.asarray(jax.jit(lambda *a: cache_attention(*a, visible, jnp.int32(256), chunk=128))(q, k, v))
    assert np.isfinite(out).all()


def test_sliding_window_with_sinks_skips_chunks_and_equals_dense_softmax():
    """gpt-oss's attention: a window (keys with 0 <= q_pos - k_pos < W) and one sink logit per query head
    joining the softmax denominator. ``first_slot`` lets the loop start at the window's first chunk; the
    result equals a dense float64 softmax over the visible keys plus the sink (chunk 64, so most chunks of
    the 600-slot cache are skipped), with and without the skip."""
    rng = np.random.default_rng(7)
    window, chunk = 50, 64
    q = rng.standard_normal((B, T, HQ, D)).astype(np.float32)
    k = rng.standard_normal((B, HKV, S, D)).astype(np.float32)
    v = rng.standard_normal((B, HKV, S, D)).astype(np.float32)
    sinks = (1.0 + rng.standard_normal(HQ)).astype(np.float32)
    lengths = np.array([590, 420], np.int32)
    q_pos = np.array([[585, 588, 589], [400, 410, 419]], np.int32)

    def visible(pos):
        p = jnp.asarray(q_pos)[:, :, None]
        return (pos[None, None, :] <= p) & (p - pos[None, None, :] < window) & (pos < jnp.asarray(lengths)[:, None, None])

    slot = np.arange(S)
    mask = (slot <= q_pos[:, :, None]) & (q_pos[:, :, None] - slot < window) & (slot < lengths[:, None, None])
    want = np.zeros(q.shape)
    for b in range(B):
        for h in range(HQ):
            kh = h // (HQ // HKV)
            for t in range(T):
                s = k[b, kh][mask[b, t]].astype(np.float64) @ q[b, t, h] * D**-0.5
                top = max(s.max(), sinks[h])
                w = np.exp(s - top)
                want[b, t, h] = w @ v[b, kh][mask[b, t]] / (w.sum() + np.exp(sinks[h] - top))
    for first in (None, int(q_pos.min()) - window + 1):
        fn = jax.jit(lambda q, k, v, live, s, f: cache_attention(q, k, v, visible, live, chunk=chunk, sinks=s,
                                                                   first_slot=f))
        got = np.asarray(fn(q, k, v, jnp.int32(lengths.max()), sinks, None if first is None else jnp.int32(first)))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
