"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2 / K2.5-K2.7) with a latent cache.

The computation (transformers' ``DeepseekV3Attention``, SPEC 11.4), per token ``x``:

- queries: ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` (or ``q_proj(x)`` when ``q_lora_rank`` is null), per head
  ``[q_nope (dn) | q_pe (dr)]``;
- one latent per token: ``kv_a_proj_with_mqa(x) = [c (r) | k_pe (dr)]``, ``c`` normed by ``kv_a_layernorm``,
  ``k_pe`` a single RoPE key shared by every head;
- RoPE on ``q_pe`` and ``k_pe`` only (interleaved pairs when ``rope_interleave``, else split halves);
- ``kv_b_proj(c)`` per head ``[k_nope (dn) | v (dv)]``; keys ``[k_nope | k_pe]``, softmax scale
  ``MLAConfig.softmax_scale``; ``o_proj`` of the heads' outputs.

Two exact forms of the same attention:

- **expanded** (no cache: plain forwards, training): per-head keys and values from ``kv_b_proj(c)``, ordinary
  multi-head attention;
- **absorbed** (with a cache: prefill, decode, verify): ``kv_b_proj``'s key half is folded into each query,
  ``q_lat_h = W_UK[h]^T q_nope_h`` (``[r]``), so a score is ``[q_lat_h | q_pe_h] . [c_t | k_pe_t]`` against the
  cached latent, and the context ``sum_t p_ht c_t`` goes through the value half ``W_UV[h]`` afterwards. The
  cache then holds ``r + dr`` values per token for all heads (576 for DeepSeek-V3 and Kimi K2, against 2 x 128
  x 192 expanded).

The latent cache is the layer's ``keys`` entry of the ordinary ``KVCache``, ``[B, 1, slots, r + dr]`` (one "KV
head" holding ``[c | roped k_pe]``), with a zero-width ``values`` entry ``[B, 1, slots, 0]``: the values are
the first ``r`` dims of the keys (``layers.cache_attention``'s ``values_in_keys``). So the absorbed form is
multi-query attention with one KV head through the same cache machinery as every other layer, and the
engine's rollbacks need nothing new: a chain lowers the lengths (``KVCache.with_lengths``), a tree moves the
accepted slots (``KVCache.commit_path``), slot by slot, whatever a slot holds. Under a mesh the single head
cannot split over ``tensor`` and is replicated there (``sharding.spec_for``), rows over the data axes.

GLM-5 / GLM-5.1 (``config.dsa``): DeepSeek's sparse attention on top. Each query attends only to the keys its
layer's indexer selects (``models/dsa_indexer``; a "shared" layer reuses the previous full layer's selection, which
this layer takes as ``selection`` and returns), in both forms: the selection replaces the mask. A full layer's
cache entry is then ``(keys, values, indexer_keys [B, 1, S, D_I])``, written at the latent's slots.

Fused attention kernels (cuDNN, the Pallas ones) take neither a 576-wide head nor values narrower than keys:
this layer gives ``cache_attention`` no fused segments, so under ``--attention auto`` (or any fused kernel) it
takes the portable XLA walk over the cache, under ``loop`` the live-length loop; never a kernel that refuses.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.models.config import TargetConfig
from dflash_jax.models.dsa_indexer import Indexer, dsa_selection, select_mask
from dflash_jax.models.layers import (
    RMSNorm, apply_rope, apply_rope_interleaved, attention, cache_attention, rope_inv_freq, rope_scale,
    to_cache_layout, write_rows,
)


class Kernel(nn.Module):
    """A bias-free linear layer's kernel ``[in, out]`` (the param ``kernel``, initialised as ``nn.Dense``'s), for a
    projection that is used through its weight: ``kv_b_proj``, whose halves the absorbed form multiplies apart."""

    shape: tuple[int, int]
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("kernel", nn.initializers.lecun_normal(), self.shape, self.dtype)


class MLAttention(nn.Module):
    """One MLA layer: ``(x [B, T, H], positions, mask, cache_kv, ...) -> (out [B, T, H], (keys, values),
    selection)``, the same call as ``TargetAttention`` without windows (see that class for the arguments).
    ``cache_kv``: the layer's latent cache ``(keys [B, 1, S, r + dr], values [B, 1, S, 0])``, plus its indexer
    keys on a DSA full layer, or None (the expanded form). ``selection``: with DSA, the keys each query keeps
    (``[B, T, S]``, from the previous full layer; returned updated), else None throughout."""

    config: TargetConfig
    dtype: Any = jnp.float32
    index: int = 0  # the layer's index: a DSA layer's full/shared mode

    @nn.compact
    def __call__(self, x, positions, mask, cache_kv=None, slots=None, live=None, spans=None, lengths=None,
                 valid=None, block_mask=None, selection=None):
        cfg, m = self.config, self.config.mla
        b, t, _ = x.shape
        heads, dn, dr, dv, r = (cfg.num_attention_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim,
                                m.kv_lora_rank)
        dense = lambda n, bias, name: nn.Dense(  # noqa: E731
            n, use_bias=bias, dtype=self.dtype, param_dtype=self.dtype, name=name)
        norm = lambda name: RMSNorm(m.latent_norm_eps, self.dtype, self.dtype, name=name)  # noqa: E731
        if m.q_lora_rank:
            q_resid = norm("q_a_layernorm")(dense(m.q_lora_rank, m.attention_bias, "q_a_proj")(x))
            q = dense(heads * (dn + dr), False, "q_b_proj")(q_resid)
        else:
            q = dense(heads * (dn + dr), False, "q_proj")(x)
        q = q.reshape(b, t, heads, dn + dr)
        q_nope, q_pe = q[..., :dn], q[..., dn:]
        latent = dense(r + dr, m.attention_bias, "kv_a_proj_with_mqa")(x)
        c = norm("kv_a_layernorm")(latent[..., :r])  # [B, T, r]
        k_pe = latent[..., None, r:]  # [B, T, 1, dr]: one RoPE key for every head
        inv_freq, scale = rope_inv_freq(cfg.rope, dr), rope_scale(cfg.rope)
        rotate = apply_rope_interleaved if m.rope_interleave else apply_rope
        q_pe, k_pe = rotate(q_pe, positions, inv_freq, scale), rotate(k_pe, positions, inv_freq, scale)
        indexer_keys = None
        if cfg.dsa is not None:  # the selection stands in for the mask: a query sees its selected keys only
            indexer = Indexer(cfg.dsa, self.dtype, name="indexer") if cfg.dsa.is_full(self.index) else None
            own = cache_kv[2] if cache_kv is not None and indexer is not None else None
            selection, indexer_keys = dsa_selection(cfg.dsa, self.index, indexer, x, q_resid, positions, inv_freq,
                                                    scale, mask, own, slots, previous=selection)
            mask = select_mask(mask, selection)
        w = Kernel((r, heads * (dn + dv)), self.dtype, name="kv_b_proj")().astype(self.dtype)
        o_proj = dense(cfg.hidden_size, m.attention_bias, "o_proj")

        def scaled(query):  # every attention path scales by 1/sqrt(its head size): fold MLA's own scale in q
            return (query.astype(jnp.float32) * (m.softmax_scale * query.shape[-1] ** 0.5)).astype(query.dtype)

        if cache_kv is None:  # expanded: per-head keys [k_nope | k_pe] and values from kv_b_proj(c)
            kv = (c @ w).reshape(b, t, heads, dn + dv)
            k = jnp.concatenate([kv[..., :dn], jnp.broadcast_to(k_pe, (b, t, heads, dr))], axis=-1)
            query = scaled(jnp.concatenate([q_nope, q_pe], axis=-1))
            out = attention(query, [(to_cache_layout(k), to_cache_layout(kv[..., dn:]), mask)])
            return o_proj(out.reshape(b, t, heads * dv)), None, selection

        # absorbed: kv_b_proj's kernel [r, heads * (dn + dv)] holds W_UK (keys) and W_UV (values) per head
        w = w.reshape(r, heads, dn + dv)
        q_latent = jnp.einsum("bthn,rhn->bthr", q_nope, w[..., :dn])
        query = scaled(jnp.concatenate([q_latent, q_pe.astype(q_latent.dtype)], axis=-1))  # [B, T, heads, r + dr]
        keys, values = cache_kv[:2]
        entry = jnp.concatenate([c[:, :, None, :], k_pe.astype(c.dtype)], axis=-1)  # [B, T, 1, r + dr]
        keys = write_rows(keys, entry, slots)
        context = cache_attention(query, keys, values, mask, live, values_in_keys=r)  # [B, T, heads, r]
        out = jnp.einsum("bthr,rhv->bthv", context, w[..., dn:])
        new_kv = (keys, values) if indexer_keys is None else (keys, values, indexer_keys)
        return o_proj(out.reshape(b, t, heads * dv)), new_kv, selection
