"""Gated DeltaNet: the linear-attention layer of the hybrid Qwen3.5 / Qwen3.6 / Qwen3-Next targets.

Three of every four decoder layers of these targets replace softmax attention with a fixed-size recurrent
state per value head, ``S [head_k_dim, head_v_dim]`` (float32), updated by the gated delta rule. Per token,
with ``q`` and ``k`` L2-normalised and ``q`` scaled by ``head_k_dim ** -0.5``::

    S = S * exp(g)                 # g <= 0: the decay, in log space
    delta = (v - S^T k) * beta     # what the state does not yet predict, times the "learning rate" beta
    S = S + k delta^T
    o = S^T q

This file holds that math as pure JAX functions and one Flax module, exact against transformers' torch
reference (``modeling_qwen3_5.py`` / ``modeling_qwen3_next.py``: ``torch_recurrent_gated_delta_rule``,
``torch_chunk_gated_delta_rule``, ``causal_conv1d_fn`` / ``causal_conv1d_update``, ``*RMSNormGated``,
``*GatedDeltaNet``):

- ``gated_delta_recurrent``: the step-by-step recurrence (one ``lax.scan`` step per token). Cheap for a few
  tokens (decoding, speculative verification) and the only form that can return the state after EVERY
  position, which verification needs to roll back to the accepted prefix.
- ``gated_delta_chunked``: the same function computed per chunk of ``chunk`` tokens with the WY / UT
  transform (a triangular solve per chunk turns the chunk's delta updates into a few matmuls), with one scan
  step per chunk: prefill. It follows ``torch_chunk_gated_delta_rule`` line by line.
- ``causal_conv1d``: the depthwise causal convolution (kernel 4) over the q, k, v channels that precedes the
  recurrence, with the carried conv state (the last ``K - 1`` pre-conv inputs of each row).
- ``GatedDeltaNet``: the whole layer with Qwen3.5's split projections; ``split_qwen3_next_projections``
  rewrites Qwen3-Next's grouped ``in_proj_qkvz`` / ``in_proj_ba`` into that layout, so one module serves both.

Padding (``valid``, True = a real token; padding on the right of each row): a padding token gets
``k = v = 0``, ``beta = 0`` and ``g = 0``, so its step is ``S * exp(0) + k (..)^T = S`` exactly, and its output
is 0 (``q = 0`` too). The conv state of each row ends at that row's last valid token. transformers only zeroes
the padded hidden states (``apply_mask_to_padding_states``), which still lets pads decay the state
(``g = -exp(A_log) * softplus(dt_bias) != 0``) and lets post-conv k, v of a pad be nonzero; its outputs at
valid positions are the same as ours (causality), its final states of a padded row are not.

The delta-rule contractions run at ``Precision.HIGHEST``: the state is float32 and accumulates over the whole
context, and TPUs (and GPUs with TF32) would otherwise round the float32 operands to bfloat16 passes.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models.cache import LinearState
from dflash_jax.models.config import GatedDeltaNetConfig
from dflash_jax.platform import current_platform

Dtype = Any
HIGHEST = jax.lax.Precision.HIGHEST
L2NORM_EPS = 1e-6  # transformers' l2norm (aligned with the FLA kernels): x * rsqrt(sum(x^2) + 1e-6)
RECURRENT_MAX_T = 16  # up to this many tokens per call the module uses the recurrence (decode, verify blocks)


# ----------------------------------------------------------------------------------------------- the delta rule


def l2norm(x: jax.Array, eps: float = L2NORM_EPS) -> jax.Array:
    """transformers' ``l2norm`` over the last axis (a zero vector stays zero)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q, k, v, g, beta, valid, normalize_qk):
    """float32 inputs, key heads repeated to the value heads (value head j reads key head ``j // ratio``,
    transformers' ``repeat_interleave``), optional L2 norm, ``q * head_k_dim ** -0.5``, padding masked."""
    hv = v.shape[2]
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    if q.shape[2] != hv:
        q, k = (jnp.repeat(x, hv // x.shape[2], axis=2) for x in (q, k))
    if normalize_qk:
        q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5)
    if valid is not None:
        m = valid.astype(bool)
        q, k, v = (jnp.where(m[:, :, None, None], x, 0.0) for x in (q, k, v))
        g, beta = (jnp.where(m[:, :, None], x, 0.0) for x in (g, beta))
    return q, k, v, g, beta


def _initial_state(state, q, v):
    b, _, h, dv = v.shape
    if state is None:
        return jnp.zeros((b, h, q.shape[-1], dv), jnp.float32)
    return state.astype(jnp.float32)


def gated_delta_recurrent(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                          state: jax.Array | None = None, *, valid: jax.Array | None = None,
                          normalize_qk: bool = True, all_states: bool = False) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule one token at a time (``torch_recurrent_gated_delta_rule``).

    q, k ``[B, T, Hk, dk]`` (Hk divides Hv; repeated here), v ``[B, T, Hv, dv]``, g and beta ``[B, T, Hv]``,
    state ``[B, Hv, dk, dv]`` (None: zeros), valid ``[B, T]`` (None: all valid). ``normalize_qk`` is
    transformers' ``use_qk_l2norm_in_kernel`` (the layer passes True); q is always scaled by ``dk ** -0.5``.
    Returns ``(o [B, T, Hv, dv]`` in q's dtype, the final float32 state ``[B, Hv, dk, dv])``, or with
    ``all_states`` the state after each position, ``[B, T, Hv, dk, dv]`` (index j: after token j; index
    T - 1 is the final state).
    """
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, valid, normalize_qk)
    s0 = _initial_state(state, q, v)

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B, H, d*], [B, H]
        s = s * jnp.exp(g_t)[..., None, None]
        kv = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=HIGHEST)
        delta = (v_t - kv) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        o = jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=HIGHEST)
        return s, (o, s) if all_states else o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    s_final, ys = jax.lax.scan(step, s0, xs)
    if all_states:
        o, states = ys
        return jnp.moveaxis(o, 0, 1).astype(out_dtype), jnp.moveaxis(states, 0, 1)
    return jnp.moveaxis(ys, 0, 1).astype(out_dtype), s_final


def gated_delta_chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                        state: jax.Array | None = None, chunk: int = 64, *, valid: jax.Array | None = None,
                        normalize_qk: bool = True) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule per chunk (``torch_chunk_gated_delta_rule``): same arguments and results as
    ``gated_delta_recurrent`` (without per-position states). T is padded up to a multiple of ``chunk`` with
    tokens that leave the state unchanged (k = v = beta = g = 0).

    Within a chunk, with ``G_t`` the cumulative log decay from the chunk start and ``D_ij = exp(G_i - G_j)``
    (i >= j), the chunk's sequential delta updates are ``(I + L) U = beta V`` and ``(I + L) W = beta K e^G``
    with ``L`` the strictly lower part of ``(beta K K^T) * D`` (the UT transform, one unit-triangular solve);
    then per chunk, from the state ``S`` at its start: ``v_new = U - W S``,
    ``o = (Q e^G) S + ((Q K^T) * D) v_new`` (causal within the chunk, diagonal included) and
    ``S' = S e^{G_last} + (K e^{G_last - G})^T v_new``.
    """
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, valid, normalize_qk)
    s0 = _initial_state(state, q, v)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (g, beta))
    n = (t + pad) // chunk
    # [B, T, H, d] -> [B, H, N, C, d]
    q, k, v = (x.reshape(b, n, chunk, h, x.shape[-1]).transpose(0, 3, 1, 2, 4) for x in (q, k, v))
    g, beta = (x.reshape(b, n, chunk, h).transpose(0, 3, 1, 2) for x in (g, beta))

    new_values, k_cumdecay, q_dec, k_dec, intra, cum = _chunk_terms(q, k, v, g, beta)
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]  # [B, H, N, 1, 1]

    def step(s, xs):
        nv, kc, qd, kd, it, cd = xs
        v_new = nv - jnp.einsum("bhck,bhkv->bhcv", kc, s, precision=HIGHEST)
        o = (jnp.einsum("bhck,bhkv->bhcv", qd, s, precision=HIGHEST)
             + jnp.einsum("bhij,bhjv->bhiv", it, v_new, precision=HIGHEST))
        s = s * cd + jnp.einsum("bhck,bhcv->bhkv", kd, v_new, precision=HIGHEST)
        return s, o

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (new_values, k_cumdecay, q_dec, k_dec, intra, chunk_decay))
    s_final, o = jax.lax.scan(step, s0, xs)  # o [N, B, H, C, dv]
    o = o.transpose(1, 0, 3, 2, 4).reshape(b, n * chunk, h, dv)[:, :t]
    return o.astype(out_dtype), s_final


def unit_lower_solve(lower: jax.Array, rhs: jax.Array, method: str | None = None) -> jax.Array:
    """``X`` with ``lower @ X = rhs`` for unit lower-triangular ``lower [..., C, C]`` and ``rhs [..., C, R]``.

    ``method`` (default: by the platform traced for, ``current_platform``): ``"native"`` is ``lax.linalg.triangular_solve`` (cuBLAS on GPUs, the
    TPU compiler's own); ``"rows"`` is forward substitution, one row of ``X`` per ``fori_loop`` step
    (``x_i = b_i - L_i X``, the rows past ``i`` still zero), batched over everything in front. On XLA:CPU the
    native solve costs ~10 ms per 64x64 system (64 of them: 650 ms on a 2-core VM), the row loop ~1 ms for
    all 64 together, so it is CPU's default. Both are exact algorithms (``test_gated_deltanet`` compares them).
    """
    method = method or ("rows" if current_platform() == "cpu" else "native")
    if method == "native":
        return jax.lax.linalg.triangular_solve(lower, rhs, left_side=True, lower=True, unit_diagonal=True)
    if method != "rows":
        raise ValueError(f"unit_lower_solve: method must be 'rows' or 'native', got {method!r}")
    n = lower.shape[-1]
    columns = jnp.arange(n)

    def row(i, x):
        before = jnp.where(columns < i, lower[..., i, :], 0.0)  # L_ij for j < i (the unit diagonal is implied)
        xi = rhs[..., i, :] - jnp.einsum("...j,...jr->...r", before, x, precision=HIGHEST)
        return jax.lax.dynamic_update_index_in_dim(x, xi.astype(x.dtype), i, axis=-2)

    return jax.lax.fori_loop(0, n, row, jnp.zeros_like(rhs))


def _chunk_terms(q, k, v, g, beta, ancestors=None):
    """The per-chunk terms of the chunked form (inputs ``[B, H, N, C, d]`` / ``[B, H, N, C]``): the UT
    solve's pseudo-values ``U`` and ``W``, the decayed queries and keys, the causal intra-chunk scores and the
    cumulative log decay ``G``. ``v_new = U - W S`` from a chunk's start state ``S`` is then every position's
    delta-rule update ``beta (v - S_prev^T k)``. ``ancestors`` (broadcastable to ``[B, H, N, C, C]``): a tree
    chunk (``gated_delta_block``), whose mask replaces ``i >= j``."""
    chunk, dv = q.shape[-2], v.shape[-1]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    if ancestors is None:
        cum = jnp.cumsum(g, axis=-1)  # [B, H, N, C]
        lower = jnp.tril(jnp.ones((chunk, chunk), bool))  # i >= j
    else:  # the decay summed along each token's root path
        lower = ancestors
        cum = jnp.einsum("...ij,...j->...i", lower.astype(jnp.float32), g, precision=HIGHEST)
    decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    ut = jnp.einsum("bhnik,bhnjk->bhnij", k_beta, k, precision=HIGHEST) * decay
    strict = lower & ~jnp.eye(chunk, dtype=bool)
    ut = jnp.where(strict, ut, 0.0) + jnp.eye(chunk, dtype=jnp.float32)
    intra = jnp.einsum("bhnik,bhnjk->bhnij", q, k, precision=HIGHEST) * decay
    rhs = jnp.concatenate([v_beta, k_beta * jnp.exp(cum)[..., None]], axis=-1)
    sol = unit_lower_solve(ut, rhs)
    q_dec = q * jnp.exp(cum)[..., None]
    k_dec = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    return sol[..., :dv], sol[..., dv:], q_dec, k_dec, intra, cum


def gated_delta_block(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                      state: jax.Array | None = None, *, valid: jax.Array | None = None,
                      normalize_qk: bool = True, ancestors: jax.Array | None = None
                      ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    """A short extension (a verify block, a decode step) as ONE chunk of the chunked form, keeping what it
    takes to form the state after any prefix of it later (``advance``). Same arguments as
    ``gated_delta_recurrent``. Returns ``(o [B, T, Hv, dv]``, ``(keys [B, T, Hv, dk], deltas [B, T, Hv, dv],
    decay [B, T, Hv]))``, float32: the normalised keys, the delta-rule updates and the cumulative log decay.

    Why not keep the state after every position (vLLM's approach): that is ``T`` copies of
    ``[Hv, dk, dv]`` per layer and row (Qwen3.5-27B, block 16: ~2.4 GB per row), written every round. These
    terms are ``T (dk + dv + 1)`` floats per head (~0.8 MB per layer and row there), and the state after the
    first ``n`` tokens is one weighted sum over them (``advance``): exact, and cheaper than replaying the
    recurrence over the accepted prefix, which would be ``n`` more sequential steps per layer.

    ``ancestors [B, T, T]`` (tree verification, ``engine/tree.py``; parents before children): token ``i``
    continues the state after its own ancestors (``ancestors[b, i, j]``, itself included) rather than after
    every earlier token. The chunk's algebra only changes its mask: the cumulative log decay runs along each
    token's root path (``G = ancestors @ g``), and the UT solve and the intra-chunk scores keep the pairs
    ``(i, ancestor j)`` instead of ``i >= j``; still unit lower-triangular, since an ancestor comes first. The
    terms of the tokens on one root path, gathered in path order (``KVCache.commit_path``), are exactly the
    terms the chain computes for that path, so ``advance`` forms the state after the accepted path.
    """
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, valid, normalize_qk)
    s0 = _initial_state(state, q, v)
    # [B, T, H, d] -> [B, H, 1, T, d]: the block is one chunk
    to_chunk = lambda x: jnp.moveaxis(x, 1, 2)[:, :, None]  # noqa: E731
    u, w, q_dec, _, intra, cum = _chunk_terms(*(to_chunk(x) for x in (q, k, v, g, beta)),
                                              ancestors=None if ancestors is None else ancestors[:, None, None])
    deltas = u - jnp.einsum("bhnck,bhkv->bhncv", w, s0, precision=HIGHEST)
    o = (jnp.einsum("bhnck,bhkv->bhncv", q_dec, s0, precision=HIGHEST)
         + jnp.einsum("bhnij,bhnjv->bhniv", intra, deltas, precision=HIGHEST))
    back = lambda x: jnp.moveaxis(x[:, :, 0], 1, 2)  # noqa: E731 ([B, H, 1, T, ...] -> [B, T, H, ...])
    return back(o).astype(out_dtype), (k, back(deltas), back(cum))


def advance(state: jax.Array, keys: jax.Array, deltas: jax.Array, decay: jax.Array, keep: jax.Array) -> jax.Array:
    """The state after the first ``keep [B]`` tokens of an extension run from ``state [B, Hv, dk, dv]``, from
    its ``gated_delta_block`` terms: unrolling the recurrence, ``S_n = e^{G_n} S + sum_{j<n} e^{G_n - G_j}
    k_j delta_j^T`` with ``G`` the cumulative log decay (``keep = 0``: ``state`` itself)."""
    t = keys.shape[1]
    last = jnp.clip(keep - 1, 0, t - 1)
    g_last = jnp.take_along_axis(decay, last[:, None, None], axis=1)[:, 0]  # [B, Hv]
    kept = (jnp.arange(t)[None] < keep[:, None])[..., None]  # [B, T, 1]
    weights = jnp.where(kept, jnp.exp(jnp.minimum(g_last[:, None] - decay, 0.0)), 0.0)  # [B, T, Hv]
    update = jnp.einsum("bth,bthk,bthv->bhkv", weights, keys, deltas, precision=HIGHEST)
    scale = jnp.where((keep > 0)[:, None], jnp.exp(g_last), 1.0)
    return state.astype(jnp.float32) * scale[..., None, None] + update


def committed_state(cache: LinearState, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(conv state, recurrent state)`` of each row at its length: the base advanced by the row's first
    ``lengths - start`` pending tokens (clipped to the pending width)."""
    keep = jnp.clip(lengths - cache.start, 0, cache.width).astype(jnp.int32)
    conv = conv_window(jnp.concatenate([cache.conv, cache.inputs.astype(cache.conv.dtype)], axis=1), keep,
                       cache.conv.shape[1])
    return conv, advance(cache.recurrent, cache.keys, cache.deltas, cache.decay, keep)


# ----------------------------------------------------------------------------------------------- the conv


def last_valid_end(valid: jax.Array | None, b: int, t: int) -> jax.Array:
    """Per row, one past its last valid token (``[B]`` int32; T when ``valid`` is None, 0 for no token)."""
    if valid is None:
        return jnp.full((b,), t, jnp.int32)
    pos = jnp.arange(1, t + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(valid.astype(bool), pos, 0), axis=1)


def causal_conv1d(x: jax.Array, weight: jax.Array, conv_state: jax.Array | None = None,
                  valid: jax.Array | None = None, *, activation: bool = True,
                  all_states: bool = False) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv over time with a carried state (``causal_conv1d_fn`` for a prefill,
    ``causal_conv1d_update`` for an extension: one function, the state is zeros for a fresh prefill).

    x ``[B, T, C]`` (pre-conv q|k|v channels), weight ``[C, 1, K]`` as transformers stores ``conv1d.weight``
    (tap ``K - 1`` multiplies the current token, tap 0 the token ``K - 1`` steps back), conv_state
    ``[B, K - 1, C]``: the previous ``K - 1`` pre-conv inputs, oldest first (None: zeros; transformers keeps
    ``[B, C, K]``, one column more than needed). No bias (these layers have none). SiLU when ``activation``.

    Returns ``(y [B, T, C]`` in x's dtype, the new conv state ``[B, K - 1, C])``: the ``K - 1`` inputs ending
    at each row's last valid token, i.e. ``concat(conv_state, x)[end : end + K - 1]`` with ``end`` from
    ``last_valid_end`` (a row with no valid token keeps its state). With ``all_states`` the state after each
    position, ``[B, T, K - 1, C]`` (a padding position repeats the state of the row's last valid token).
    """
    b, t, c = x.shape
    kk = weight.shape[-1]
    if conv_state is None:
        conv_state = jnp.zeros((b, kk - 1, c), x.dtype)
    buf = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, K - 1 + T, C]
    w = weight.reshape(c, kk).astype(jnp.float32)
    buf32 = buf.astype(jnp.float32)
    y = sum(buf32[:, i:i + t] * w[:, i] for i in range(kk))  # a static loop over the K taps
    if activation:
        y = jax.nn.silu(y)
    end = last_valid_end(valid, b, t)
    if all_states:
        taps = jnp.arange(kk - 1, dtype=jnp.int32)
        ends = jnp.minimum(jnp.arange(1, t + 1, dtype=jnp.int32)[None], end[:, None])  # [B, T]
        idx = ends[..., None] + taps  # [B, T, K - 1]
        new_state = jnp.take_along_axis(buf[:, None], idx[..., None], axis=2)
    else:
        new_state = conv_window(buf, end, kk - 1)
    return y.astype(x.dtype), new_state


def tree_conv1d(x: jax.Array, weight: jax.Array, conv_state: jax.Array, ancestors: jax.Array,
                activation: bool = True) -> jax.Array:
    """``causal_conv1d``'s output for a tree block (``x [B, T, C]``, token 0 the root continuing ``conv_state``;
    ``ancestors [B, T, T]`` with itself included, parents before children): token ``i`` convolves its own
    input with its ``K - 1`` nearest ancestors' (a path's sequence), reaching into ``conv_state`` past the
    root. (No new state: a tree's conv state is formed at the commit from the accepted path's inputs.)"""
    b, t, c = x.shape
    kk = weight.shape[-1]
    w = weight.reshape(c, kk).astype(jnp.float32)
    buf = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1).astype(jnp.float32)  # [B, K - 1 + T, C]
    depth = jnp.sum(ancestors, axis=-1, dtype=jnp.int32) - 1  # [B, T] (the root 0)
    y = x.astype(jnp.float32) * w[:, kk - 1]
    for m in range(1, kk):  # the m-th input before each token along its path
        up = depth - m
        node = jnp.argmax(ancestors & (depth[:, None, :] == up[:, :, None]), axis=-1)  # [B, T]
        index = jnp.clip(jnp.where(up >= 0, kk - 1 + node, kk - 1 + up), 0, kk - 2 + t)
        y = y + jnp.take_along_axis(buf, index[..., None], axis=1) * w[:, kk - 1 - m]
    if activation:
        y = jax.nn.silu(y)
    return y.astype(x.dtype)


def conv_window(buf: jax.Array, end: jax.Array, width: int) -> jax.Array:
    """``buf[b, end[b] : end[b] + width]`` per row: the conv state after the first ``end`` tokens of an
    extension, from ``buf = concat(conv state before it, its inputs)`` (``[B, K - 1 + T, C]``)."""
    idx = end[:, None] + jnp.arange(width, dtype=jnp.int32)
    return jnp.take_along_axis(buf, idx[..., None], axis=1)


# ----------------------------------------------------------------------------------------------- the layer


def gated_rms_norm(o: jax.Array, z: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``RMSNormGated``: ``w * rmsnorm(o) * silu(z)`` over the last axis, with transformers' casts (normalise
    in float32, cast to o's dtype, times the plain weight ``w``, times ``silu(z)`` in float32, cast back)."""
    dtype = o.dtype
    o32 = o.astype(jnp.float32)
    h = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)
    h = weight * h.astype(dtype)
    return (h * jax.nn.silu(z.astype(jnp.float32))).astype(dtype)


def _a_log_init(key, shape, dtype):
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer (``Qwen3_5GatedDeltaNet``) on ``x [B, T, H]``.

    Parameters (HF key names; kernels ``[in, out]``): ``in_proj_qkv/kernel [H, 2 key_dim + value_dim]``
    (contiguous ``[q | k | v]``, each head-major), ``in_proj_z/kernel [H, value_dim]``,
    ``in_proj_b/kernel [H, Hv]``, ``in_proj_a/kernel [H, Hv]``, ``conv1d/weight [conv_dim, 1, K]`` (as stored
    by transformers, copied unchanged), ``A_log [Hv]``, ``dt_bias [Hv]``, ``norm/weight [head_v_dim]``,
    ``out_proj/kernel [value_dim, H]``.

    ``state``: ``(conv_state [B, K - 1, conv_dim]`` in the compute dtype, ``recurrent_state
    [B, Hv, dk, dv]`` float32``)``, None for a fresh prefill. Returns ``(out [B, T, H], new state)``; with
    ``all_states`` the new state holds every position's states (``[B, T, K - 1, conv_dim]``,
    ``[B, T, Hv, dk, dv]``; index j = after token j), for rolling a verified block back to its accepted prefix.
    ``path``: ``"recurrent"``, ``"chunked"`` or None (recurrent up to ``RECURRENT_MAX_T`` tokens or with
    ``all_states``, else chunked); both compute the same function.
    """

    cfg: GatedDeltaNetConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    chunk_size: int = 64

    @nn.compact
    def __call__(self, x: jax.Array, valid: jax.Array | None = None,
                 state: tuple[jax.Array, jax.Array] | LinearState | None = None, *, all_states: bool = False,
                 path: str | None = None, lengths: jax.Array | None = None, tree: jax.Array | None = None):
        """With a ``LinearState`` (the decode cache) and the rows' current ``lengths``, ``x`` extends each row
        from its length (its valid tokens first, contiguous): returns ``(out, new LinearState)``, the new state
        pending on the rows' next lengths (``committed_state``). Extensions up to the state's width keep their
        terms (rollback to any prefix); wider ones (prefill chunks) are folded in whole. ``tree [B, T, T]``
        (with a ``LinearState``): a tree block, each token continuing its ancestors (``gated_delta_block``);
        its terms stay in token order until ``KVCache.commit_path`` gathers the accepted path."""
        if isinstance(state, LinearState):
            return self._extend(x, valid, state, lengths, tree)
        if tree is not None:
            raise ValueError("a tree block needs the decode cache (a LinearState)")
        cfg = self.cfg
        b, t, _ = x.shape
        mixed, z, beta, g, conv = self._project(x, valid)
        conv_state, rec_state = state if state is not None else (None, None)
        mixed, new_conv = causal_conv1d(mixed, conv, conv_state, valid, all_states=all_states)
        q, k, v = self._heads(mixed)

        if path is None:
            path = "recurrent" if all_states or t <= RECURRENT_MAX_T else "chunked"
        if path == "recurrent":
            o, new_rec = gated_delta_recurrent(q, k, v, g, beta, rec_state, valid=valid, all_states=all_states)
        elif path == "chunked":
            if all_states:
                raise ValueError("all_states needs path='recurrent'")
            o, new_rec = gated_delta_chunked(q, k, v, g, beta, rec_state, self.chunk_size, valid=valid)
        else:
            raise ValueError(f"path must be 'recurrent', 'chunked' or None, got {path!r}")

        return self._output(o, z), (new_conv, new_rec)

    def _dense(self, n: int, name: str) -> nn.Dense:
        return nn.Dense(n, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, name=name)

    def _project(self, x, valid):
        """The input projections: pre-conv ``q|k|v`` channels, the output gate ``z``, ``beta``, the log decay
        ``g`` (float32) and the conv weight."""
        cfg = self.cfg
        b, t, _ = x.shape
        x = x.astype(self.dtype)
        if valid is not None:  # as transformers' apply_mask_to_padding_states: pads project to zeros
            x = jnp.where(valid.astype(bool)[..., None], x, 0).astype(self.dtype)
        mixed = self._dense(cfg.conv_dim, "in_proj_qkv")(x)
        z = self._dense(cfg.value_dim, "in_proj_z")(x).reshape(b, t, cfg.num_v_heads, cfg.head_v_dim)
        bb = self._dense(cfg.num_v_heads, "in_proj_b")(x)
        a = self._dense(cfg.num_v_heads, "in_proj_a")(x)
        conv = _Conv1dWeight(cfg.conv_dim, cfg.conv_kernel, self.param_dtype, name="conv1d")()
        a_log = self.param("A_log", _a_log_init, (cfg.num_v_heads,), self.param_dtype)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (cfg.num_v_heads,), self.param_dtype)
        beta = jax.nn.sigmoid(bb)
        g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias)
        return mixed, z, beta, g, conv.astype(self.dtype)

    def _heads(self, mixed):
        cfg = self.cfg
        b, t, _ = mixed.shape
        q, k, v = jnp.split(mixed, [cfg.key_dim, 2 * cfg.key_dim], axis=-1)
        return (q.reshape(b, t, cfg.num_k_heads, cfg.head_k_dim), k.reshape(b, t, cfg.num_k_heads, cfg.head_k_dim),
                v.reshape(b, t, cfg.num_v_heads, cfg.head_v_dim))

    def _output(self, o, z):
        cfg = self.cfg
        b, t = o.shape[:2]
        norm_w = _NormWeight(cfg.head_v_dim, self.param_dtype, name="norm")()
        o = gated_rms_norm(o, z, norm_w, cfg.eps).reshape(b, t, cfg.value_dim)
        return self._dense(cfg.hidden_size, "out_proj")(o)

    def _extend(self, x, valid, cache: LinearState, lengths, tree=None):
        b, t, _ = x.shape
        width = cache.width
        if valid is None:
            valid = jnp.ones((b, t), bool)
        conv_state, rec_state = committed_state(cache, lengths)
        pre_conv, z, beta, g, conv = self._project(x, valid)
        if tree is None:
            mixed, new_conv = causal_conv1d(pre_conv, conv, conv_state, valid)
        elif t > width:
            raise ValueError(f"a tree block of {t} tokens exceeds the linear state's width {width}")
        else:
            mixed = tree_conv1d(pre_conv, conv, conv_state, tree)
        q, k, v = self._heads(mixed)
        if t <= width:  # keep the terms: the next lengths pick the prefix
            o, (keys, deltas, decay) = gated_delta_block(q, k, v, g, beta, rec_state, valid=valid, ancestors=tree)
            pad = lambda a: jnp.pad(a, [(0, 0), (0, width - t)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
            new = LinearState(conv=conv_state, recurrent=rec_state, start=lengths.astype(jnp.int32),
                              inputs=pad(pre_conv.astype(cache.inputs.dtype)),  # pads project to zeros
                              keys=pad(keys), deltas=pad(deltas), decay=pad(decay))
        else:  # a prefill chunk: folded in whole (nothing to roll back into)
            o, rec = gated_delta_chunked(q, k, v, g, beta, rec_state, self.chunk_size, valid=valid)
            n = jnp.sum(valid, axis=1, dtype=jnp.int32)
            zero = jax.tree.map(jnp.zeros_like, cache)
            new = zero.replace(conv=new_conv.astype(cache.conv.dtype), recurrent=rec,
                               start=lengths.astype(jnp.int32) + n)
        return self._output(o, z), new


class _Conv1dWeight(nn.Module):
    """Holds ``conv1d/weight [conv_dim, 1, K]`` (transformers' depthwise ``nn.Conv1d`` layout)."""

    channels: int
    kernel: int
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self) -> jax.Array:
        init = nn.initializers.variance_scaling(1.0, "fan_in", "uniform", in_axis=-1, out_axis=0)
        return self.param("weight", init, (self.channels, 1, self.kernel), self.param_dtype)


class _NormWeight(nn.Module):
    """Holds ``norm/weight [head_v_dim]`` (plain, initialised to ones: not zero-centred like the layer norms)."""

    size: int
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("weight", nn.initializers.ones, (self.size,), self.param_dtype)


# ----------------------------------------------------------------------------------------------- Qwen3-Next


def split_qwen3_next_projections(in_proj_qkvz: np.ndarray, in_proj_ba: np.ndarray,
                                 cfg: GatedDeltaNetConfig) -> dict[str, np.ndarray]:
    """Qwen3-Next's fused projections -> Qwen3.5's split ones, both in torch layout ``[out, in]``.

    Qwen3-Next groups the rows per key head (``fix_query_key_value_ordering``): ``in_proj_qkvz`` is
    ``[nk, (dk q | dk k | r*dv v | r*dv z), H]`` and ``in_proj_ba`` is ``[nk, (r b | r a), H]`` with
    ``r = Hv / nk``; value head ``i * r + j`` is the j-th of key head i. Its conv runs over
    ``concat(q, k, v)`` flattened head-major, the same channel order as Qwen3.5's contiguous
    ``in_proj_qkv``, so ``conv1d.weight`` and every other parameter copy unchanged.
    Returns ``{"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"}``.
    """
    nk, dk, dv, r = cfg.num_k_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.num_v_heads // cfg.num_k_heads
    hidden = in_proj_qkvz.shape[-1]
    w = np.asarray(in_proj_qkvz).reshape(nk, 2 * dk + 2 * r * dv, hidden)
    q, k, v, z = np.split(w, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
    ba = np.asarray(in_proj_ba).reshape(nk, 2 * r, hidden)
    flat = lambda x: x.reshape(-1, hidden)
    return {"in_proj_qkv": np.concatenate([flat(q), flat(k), flat(v)], axis=0), "in_proj_z": flat(z),
            "in_proj_b": flat(ba[:, :r]), "in_proj_a": flat(ba[:, r:])}


def join_qwen3_next_projections(split: dict[str, np.ndarray], cfg: GatedDeltaNetConfig) -> dict[str, np.ndarray]:
    """The inverse of ``split_qwen3_next_projections`` (torch layout): ``{"in_proj_qkvz", "in_proj_ba"}``."""
    nk, dk, dv, r = cfg.num_k_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.num_v_heads // cfg.num_k_heads
    hidden = split["in_proj_qkv"].shape[-1]
    q, k, v = np.split(np.asarray(split["in_proj_qkv"]), [nk * dk, 2 * nk * dk], axis=0)
    per_head = lambda x, n: x.reshape(nk, n, hidden)  # noqa: E731
    qkvz = np.concatenate([per_head(q, dk), per_head(k, dk), per_head(v, r * dv),
                           per_head(np.asarray(split["in_proj_z"]), r * dv)], axis=1)
    ba = np.concatenate([per_head(np.asarray(split["in_proj_b"]), r), per_head(np.asarray(split["in_proj_a"]), r)],
                        axis=1)
    return {"in_proj_qkvz": qkvz.reshape(-1, hidden), "in_proj_ba": ba.reshape(-1, hidden)}
