"""Building blocks shared by the target decoder and the DFlash draft.

Parameter names mirror Hugging Face keys (``q_proj``, ``input_layernorm``, ``weight``) so that checkpoint
conversion is a path map plus a transpose of linear weights (Flax ``kernel`` is ``[in, out]``).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.errors import UserError
from dflash_jax.models.attention_kernels import (
    Segment, active_kernel, fallback_kernel, fused_attention, group_queries, group_sinks, ungroup_queries,
)
from dflash_jax.models.config_fields import RopeConfig

Dtype = Any


def float32_dot_general(*args, **kwargs) -> jax.Array:
    """``lax.dot_general`` whose result stays in float32 (the products accumulate in float32 whatever the
    operands' dtype): for layers whose outputs are decisions (output heads, routers)."""
    return jax.lax.dot_general(*args, **kwargs, preferred_element_type=jnp.float32)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, exactly as HF LLaMA/Qwen do
    (``weight_in_float32``: the weight multiplies before the cast, as gpt-oss and Gemma 4 do)."""

    eps: float = 1e-6
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    weight_in_float32: bool = False
    zero_centered: bool = False  # Qwen3-Next / Qwen3.5: scale by (1 + w) in float32, w stored (starts at 0)
    use_weight: bool = True  # False: no weight at all (Gemma 4's V norm and router norm)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if not self.use_weight:
            return x32.astype(self.dtype)
        init = nn.initializers.zeros if self.zero_centered else nn.initializers.ones
        weight = self.param("weight", init, (x.shape[-1],), self.param_dtype)
        if self.zero_centered:
            return (x32 * (1.0 + weight.astype(jnp.float32))).astype(self.dtype)
        if self.weight_in_float32:
            return (weight.astype(jnp.float32) * x32).astype(self.dtype)
        return weight.astype(self.dtype) * x32.astype(self.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies (host side) including the ``linear`` and ``llama3`` scalings.

    Computed in float32 like Hugging Face, so that angles at large positions agree to the last bit or two.
    """
    exponent = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
    inv = np.float32(1.0) / (np.float32(rope.theta) ** exponent)
    if rope.rope_type == "linear":
        inv = inv / rope.factor
    elif rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    elif rope.rope_type == "yarn":
        inv = _yarn_inv_freq(rope, head_dim)
    elif rope.rope_type == "proportional":  # Gemma 4's full layers: the first n frequencies turn, the rest are 0
        turning = int(rope.partial_rotary_factor * head_dim // 2)
        inv = np.where(np.arange(head_dim // 2) < turning, inv, np.float32(0)) / np.float32(rope.factor)
    return inv


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> np.ndarray:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times over the original context are interpolated
    (divided by ``factor``), those turning more than ``beta_fast`` times are kept, with a linear ramp between
    (arXiv 2309.00071; transformers' ``_compute_yarn_parameters``, whose float32 steps this follows).
    ``truncate: false`` (gpt-oss) keeps the ramp's ends unrounded."""
    base, orig = rope.theta, rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:  # the dimension that turns ``rotations`` times
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    extrapolation, interpolation = np.float32(1.0) / pos_freqs, np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (np.float32(1.0) - ramp).astype(np.float32)
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def rope_scale(rope: RopeConfig) -> float:
    """The factor that multiplies cos and sin (YaRN's attention factor; 1 otherwise)."""
    return rope.attention_factor if rope.rope_type == "yarn" else 1.0


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> jax.Array:
    """Rotate ``x [B, T, heads, head_dim]`` at integer ``positions [B, T]`` (split-halves convention).

    Angles are computed in float32 like HF (``inv_freq`` is float32 there), then cos/sin (times ``scale``,
    in float32) cast to x's dtype.
    """
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def apply_rope_interleaved(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> jax.Array:
    """RoPE on adjacent pairs ``(x[2i], x[2i+1])`` rotated by frequency ``i`` (DeepSeek's layout, transformers'
    ``apply_rotary_pos_emb_interleave``), the output PERMUTED to the rotated evens then the rotated odds, as
    transformers returns it: q.k is the same either way as long as queries and cached keys use this one routine.
    ``x [B, T, heads, D]``; angles in float32, cos/sin (times ``scale``) cast to x's dtype."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B, T, D/2]
    cos, sin = jnp.cos(freqs)[:, :, None, :], jnp.sin(freqs)[:, :, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([even * cos - odd * sin, odd * cos + even * sin], axis=-1)


def attention(q: jax.Array, segments: Sequence[tuple[jax.Array, jax.Array, jax.Array]],
              sinks: jax.Array | None = None) -> jax.Array:
    """Grouped-query softmax attention over one or more key/value segments with a joint softmax.

    q ``[B, T, Hq, D]``; each segment is ``(k, v, mask)`` with k/v ``[B, Hkv, S, D]`` (the cache layout, so
    XLA's batched dot reads the cache in place instead of transposing a copy of it) and mask ``[B, T, S]``
    (True = visible). Passing the cached context and the transient block as two segments avoids
    concatenating (copying) the cache. Scores and softmax in float32; fully masked rows yield zeros.
    ``sinks [Hq]`` (gpt-oss): one logit per query head joins every softmax and is dropped after it.
    """
    b, t, hq, d = q.shape
    hkv = segments[0][0].shape[1]
    qg = group_queries(q, hkv)
    scores, masks = [], []
    for k, _, mask in segments:
        s = jnp.einsum("bkqd,bksd->bkqs", qg, k, preferred_element_type=jnp.float32) * (d**-0.5)
        m = jnp.broadcast_to(mask[:, None, None], (b, 1, hq // hkv) + mask.shape[1:]).reshape(b, 1, -1, mask.shape[-1])
        scores.append(jnp.where(m, s, jnp.finfo(jnp.float32).min))
        masks.append(m)
    if sinks is not None:
        scores.append(jnp.broadcast_to(group_sinks(sinks, hkv, t)[None, ..., None], (b, hkv, hq // hkv * t, 1)))
        masks.append(jnp.ones((b, 1, hq // hkv * t, 1), bool))
    all_scores = jnp.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0]
    all_masks = jnp.concatenate(masks, axis=-1) if len(masks) > 1 else masks[0]
    probs = jnp.where(all_masks, jax.nn.softmax(all_scores, axis=-1), 0.0)
    out = jnp.zeros(qg.shape[:-1] + segments[0][1].shape[-1:], jnp.float32)  # values may be narrower (MLA)
    offset = 0
    for k, v, _ in segments:
        n = k.shape[2]
        p = probs[..., offset:offset + n].astype(v.dtype)
        out = out + jnp.einsum("bkqs,bksd->bkqd", p, v, preferred_element_type=jnp.float32)
        offset += n
    out = ungroup_queries(out, t)
    return out.astype(q.dtype)


KV_CHUNK = 256  # cache slots per step of the live-length attention loop


def cache_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    visible: Callable[[jax.Array], jax.Array],
    live_slots: jax.Array,
    extra: Sequence[tuple[jax.Array, jax.Array, jax.Array]] = (),
    chunk: int = KV_CHUNK,
    segments: Sequence[Segment] | None = None,
    sinks: jax.Array | None = None,
    first_slot: jax.Array | None = None,
    values_in_keys: int | None = None,
) -> jax.Array:
    """Attention over a preallocated cache whose cost follows the LIVE length, not the number of slots.

    ``q [B, T, Hq, D]``; ``k_cache, v_cache [B, Hkv, S, D]``; ``visible(key_positions [C]) -> [B, T, C]`` says
    which of a chunk's slots each query sees; slots at or past ``live_slots`` (a traced scalar: the longest
    row's length) are never visible and never read. The cache is walked in chunks of ``chunk`` slots with an
    online softmax (running maximum, denominator and weighted sum, all float32) inside a loop whose trip
    count is ``ceil(live_slots / chunk)``, so a round at 256 live tokens costs the same in a 512-slot and a
    16k-slot cache, and scores never exceed ``[B, H, T, chunk]``. ``extra`` segments ``(k, v, mask)`` (the
    draft's transient block) join the same softmax. Equals ``attention`` up to float rounding; fully masked
    rows yield zeros.

    ``segments`` describe the SAME attention as length-bounded key segments (the cache prefix every query
    sees, then the block's own keys), the form fused kernels take. When the trace runs under a fused kernel
    (``attention_kernels.attention_kernel``) and the caller gives them, the kernel replaces the loop.
    ``sinks [Hq]`` join every softmax's denominator (gpt-oss), in the loop and after a fused kernel alike.
    ``first_slot`` (traced scalar, a bounded layer's lowest visible slot) lets the loop skip the chunks
    before it.

    Only the ``loop`` kernel (the CPU default) bounds the walk by the live length. Under any other kernel,
    where no fused kernel applies (no ``segments``, or ``auto``'s kernel refused the shapes), the walk covers
    every slot in a static number of chunks: more reads than the live length on a long, mostly empty cache,
    but no loop whose trip count depends on data, which on a GPU costs a host sync per trip.

    ``values_in_keys`` (multi-head latent attention's cache, ``models/mla.py``): there is no separate value
    cache (``v_cache`` is ignored); each slot's value is the first ``values_in_keys`` dims of its key, sliced
    chunk by chunk so the cache is read once.
    """
    kernel, fallback = active_kernel(q.dtype)
    if segments is not None and kernel != "loop":
        try:
            return fused_attention(q, segments, kernel, sinks)
        except (NotImplementedError, RuntimeError) as e:  # refused at trace time: shapes, no cuDNN (ROCm)
            if not fallback:
                raise UserError(f"attention kernel {kernel!r} cannot run this attention: {e}") from e
            kernel = fallback_kernel()
            if kernel != "loop":
                return fused_attention(q, segments, kernel, sinks)
    if kernel != "loop" and not isinstance(live_slots, int):
        live_slots, first_slot = k_cache.shape[2], None  # every slot, a static trip count
    b, t, hq, d = q.shape
    hkv, slots = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    size = min(chunk, slots)
    dv = values_in_keys if values_in_keys is not None else v_cache.shape[-1]
    qg = group_queries(q, hkv)
    neg = jnp.finfo(jnp.float32).min

    def update(carry, k, v, mask):
        m, l, acc = carry
        s = jnp.einsum("bkqd,bksd->bkqs", qg, k, preferred_element_type=jnp.float32) * (d**-0.5)
        mask = jnp.broadcast_to(mask[:, None, None], (b, 1, g) + mask.shape[1:]).reshape(b, 1, g * t, -1)
        s = jnp.where(mask, s, neg)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        scale = jnp.exp(m - m_new)
        acc = acc * scale[..., None] + jnp.einsum("bkqs,bksd->bkqd", p.astype(v.dtype), v,
                                                  preferred_element_type=jnp.float32)
        return m_new, l * scale + p.sum(-1), acc

    def chunk_step(c, carry):
        # The last chunk may reach past the cache: its slice is moved back inside and the slots an earlier
        # chunk already covered are masked out, so no slot counts twice.
        start = jnp.minimum(c * size, slots - size)
        k = jax.lax.dynamic_slice_in_dim(k_cache, start, size, axis=2)
        v = k[..., :dv] if values_in_keys is not None else jax.lax.dynamic_slice_in_dim(v_cache, start, size, axis=2)
        pos = start + jnp.arange(size, dtype=jnp.int32)
        fresh = (pos >= c * size) & (pos < live_slots)
        return update(carry, k, v, visible(pos) & fresh[None, None, :])

    carry = (jnp.full((b, hkv, g * t), neg, jnp.float32), jnp.zeros((b, hkv, g * t), jnp.float32),
             jnp.zeros((b, hkv, g * t, dv), jnp.float32))
    if slots <= size:  # one chunk: no loop (its per-layer overhead shows on tiny models)
        carry = chunk_step(0, carry)
    elif isinstance(live_slots, int):  # static (training): a fixed trip count, so the loop is differentiable
        carry = jax.lax.fori_loop(0, -(-min(live_slots, slots) // size), chunk_step, carry)
    else:
        lo = 0 if first_slot is None else jnp.clip(first_slot, 0, slots) // size
        carry = jax.lax.fori_loop(lo, (jnp.minimum(live_slots, slots) + size - 1) // size, chunk_step, carry)
    for k, v, mask in extra:
        carry = update(carry, k, v, mask)
    if sinks is not None:  # a key with this logit and no value: it only adds exp(sink) to the denominator
        m, l, acc = carry
        sink = group_sinks(sinks, hkv, t)[None]
        m_new = jnp.maximum(m, sink)
        scale = jnp.exp(m - m_new)
        carry = (m_new, l * scale + jnp.exp(sink - m_new), acc * scale[..., None])
    _, l, acc = carry
    out = jnp.where(l[..., None] > 0, acc / jnp.maximum(l, 1e-30)[..., None], 0.0)
    out = ungroup_queries(out, t)
    return out.astype(q.dtype)


WINDOW_QUERY_TILE = 256  # queries per step of a windowed layer's attention over a long block (prefill)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache_kv: tuple[jax.Array, jax.Array],
                   positions: jax.Array, valid: jax.Array, lengths: jax.Array, window: int,
                   sinks: jax.Array | None = None, tile: int = WINDOW_QUERY_TILE, block_mask: jax.Array | None = None):
    """A sliding-window layer's forward over its ring cache (``models/cache.ring_slots``): the attention of
    ``q [B, T, Hq, D]`` and the cache with the block's ``k, v [B, T, Hkv, D]`` written. Returns ``(out,
    (keys, values))``.

    ``positions [B, T]`` are consecutive in each row from its first one (prefill chunks and rounds are), and
    position ``p`` sits at slot ``p % R`` (``R`` the ring's slots; a full-length cache is the ring with ``R =
    slots``). A query at ``p`` sees the keys at ``p - window < k <= p`` that exist, so the forward reads the
    ``window - 1`` positions before its first query from the ring (before writing: a long prefill chunk
    overwrites its own early positions) and lays them before the block's own keys: in that sequence, query
    ``i`` sees keys ``i .. i + window - 1``, the same band in every row. Long blocks go by tiles of ``tile``
    queries, each a static slice of ``window - 1 + tile`` keys. Shapes and the number of tiles (one in a
    decode round) are static: no loop whose trip count depends on data, a cost that follows the window and
    not the context. The write keeps a row's last ``R`` valid positions; ``lengths [B]``, the rows' lengths
    after the block, say which those are.

    ``block_mask [B, T, T]`` (a tree block, ``TargetModel``'s ``tree``): token ``i`` is at ``positions[:, i]`` (the
    committed length plus its depth, siblings alike) but is written as if at ``first + i`` (its scratch slot,
    moved into place by the commit), and sees the block tokens ``block_mask`` allows inside its window. The
    ring must hold ``window - 1 + T`` slots (``init_cache``'s ``extension``)."""
    k_cache, v_cache = cache_kv
    b, t = positions.shape
    size = k_cache.shape[2]
    before = window - 1
    first = positions[:, 0]
    held = first[:, None] - before + jnp.arange(before, dtype=first.dtype)[None]  # [B, W - 1] positions
    take = jax.vmap(lambda cache, slots: cache[:, slots])
    keys = jnp.concatenate([take(k_cache, held % size), to_cache_layout(k).astype(k_cache.dtype)], axis=2)
    values = jnp.concatenate([take(v_cache, held % size), to_cache_layout(v).astype(v_cache.dtype)], axis=2)
    exists = jnp.concatenate([held >= 0, valid], axis=1)  # [B, W - 1 + T]

    if block_mask is not None:  # one tile: the window by position, the block by ancestry
        near = lambda key_positions: key_positions[:, None, :] > positions[:, :, None] - window  # noqa: E731
        mask = jnp.concatenate([near(held) & (held >= 0)[:, None, :],
                                near(positions) & block_mask & valid[:, None, :]], axis=2)
        out = attention(q, [(keys, values, mask)], sinks=sinks)
        at = first[:, None] + jnp.arange(t, dtype=first.dtype)[None]
        slots = jnp.where(valid & (at >= lengths[:, None] - size), at % size, size)
        return out, (write_rows(k_cache, k, slots), write_rows(v_cache, v, slots))

    c = min(t, tile)
    tiles = -(-t // c)
    if tiles * c != t:  # whole tiles: padded queries (and keys nothing sees) whose outputs are dropped
        pad = tiles * c - t
        q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
        keys, values = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (keys, values))
        exists = jnp.pad(exists, ((0, 0), (0, pad)))
    span = before + c
    band = jnp.arange(span)[None, :] - jnp.arange(c)[:, None]  # key index - query index within a tile
    band = (band >= 0) & (band < window)  # [c, span]: query i sees keys i .. i + W - 1

    def one_tile(j):
        start = j * c
        sl = lambda x, n, axis: jax.lax.dynamic_slice_in_dim(x, start, n, axis=axis)  # noqa: E731
        mask = band[None] & sl(exists, span, 1)[:, None, :]
        return attention(sl(q, c, 1), [(sl(keys, span, 2), sl(values, span, 2), mask)], sinks=sinks)

    if tiles == 1:
        out = one_tile(0)
    else:
        out = jax.lax.map(one_tile, jnp.arange(tiles))  # [tiles, B, c, Hq, D], a static trip count
        out = out.swapaxes(0, 1).reshape(b, tiles * c, *out.shape[3:])
    keep = valid & (positions >= lengths[:, None] - size)
    slots = jnp.where(keep, positions % size, size)
    return out[:, :t], (write_rows(k_cache, k, slots), write_rows(v_cache, v, slots))


def to_cache_layout(x: jax.Array) -> jax.Array:
    """``[B, T, Hkv, D]`` (projection output) -> ``[B, Hkv, T, D]`` (cache/attention layout)."""
    return x.transpose(0, 2, 1, 3)


# Gate activations of the gated feed-forwards (``MLP`` and the experts): SwiGLU, GeGLU with transformers'
# ``gelu_pytorch_tanh`` (the tanh approximation).
ACTIVATIONS = {"silu": nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class MLP(nn.Module):
    """Gated feed-forward: ``down(act(gate(x)) * up(x))``, SwiGLU by default (``ACTIVATIONS``)."""

    intermediate_size: int
    use_bias: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    activation: str = "silu"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = lambda n, name: nn.Dense(  # noqa: E731
            n, use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype, name=name
        )
        gate = ACTIVATIONS[self.activation](dense(self.intermediate_size, "gate_proj")(x))
        return dense(x.shape[-1], "down_proj")(gate * dense(self.intermediate_size, "up_proj")(x))


def write_rows(cache: jax.Array, update: jax.Array, slots: jax.Array) -> jax.Array:
    """Scatter ``update [B, T, Hkv, D]`` into ``cache [B, Hkv, S, D]`` at per-row ``slots [B, T]``.

    Slots outside ``[0, S)`` are dropped (JAX would otherwise clamp them onto a real slot), which is how
    callers skip padding tokens.
    """
    rows = jnp.arange(cache.shape[0])[:, None]
    return cache.at[rows, :, slots].set(update.astype(cache.dtype), mode="drop")
