"""Building blocks shared by the target decoder and the DFlash draft.

Parameter names mirror Hugging Face keys (``q_proj``, ``input_layernorm``, ``weight``) so that checkpoint
conversion is a path map plus a transpose of linear weights (Flax ``kernel`` is ``[in, out]``).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models.config import RopeConfig

Dtype = Any


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, exactly as HF LLaMA/Qwen do."""

    eps: float = 1e-6
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
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
    return inv


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate ``x [B, T, heads, head_dim]`` at integer ``positions [B, T]`` (split-halves convention).

    Angles are computed in float32 like HF (``inv_freq`` is float32 there), then cos/sin cast to x's dtype.
    """
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query softmax attention.

    q ``[B, T, Hq, D]``, k/v ``[B, S, Hkv, D]``, mask ``[B, T, S]`` (True = visible). Scores and softmax in
    float32; a fully masked row yields zeros rather than NaN.
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (d**-0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask[:, None, None, :, :], probs, 0.0).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, d).astype(q.dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    intermediate_size: int
    use_bias: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = lambda n, name: nn.Dense(  # noqa: E731
            n, use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype, name=name
        )
        h = nn.silu(dense(self.intermediate_size, "gate_proj")(x)) * dense(self.intermediate_size, "up_proj")(x)
        return dense(x.shape[-1], "down_proj")(h)


def write_rows(cache: jax.Array, update: jax.Array, slots: jax.Array) -> jax.Array:
    """Scatter ``update [B, T, ...]`` into ``cache [B, S, ...]`` at per-row ``slots [B, T]``.

    Slots outside ``[0, S)`` are dropped (JAX would otherwise clamp them onto a real slot), which is how
    callers skip padding tokens.
    """
    rows = jnp.arange(cache.shape[0])[:, None]
    return cache.at[rows, slots].set(update.astype(cache.dtype), mode="drop")
