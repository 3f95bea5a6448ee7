"""The target decoder: LLaMA-2/3.x, Qwen2/2.5, Qwen3, Qwen3-MoE, gpt-oss, the hybrid Qwen3-Next / Qwen3.5 /
Qwen3.6, MiniMax-M2, Gemma 4, Muse Glimmer, DeepSeek-V3, Kimi K2 and GLM-5 as one pure Flax module.

A family is a set of differences read from its config (``models/config.py``): attention flags (biases, q/k
norms, sinks, an output gate, partial RoPE, zero-centred norms; Gemma 4's V norm, keys as values, softmax
scale and full layers of their own shape; Muse Glimmer's weightless q/k norms, scaled queries, gate
projection and layers without RoPE), each layer's token mixer (softmax attention, with an optional
window, a Gated DeltaNet: ``models/gated_deltanet.py``, or DeepSeek-V3's multi-head latent attention with its
latent cache: ``models/mla.py``, GLM-5's with DeepSeek's sparse-attention indexer on top:
``models/dsa_indexer.py``), each layer's FFN (a dense SwiGLU or GeGLU,
``models/experts.Experts``, or both side by side) and where the norms sit (before each sublayer, or around
it as Gemma's and Muse Glimmer's sandwich, with Gemma's stored ``layer_scalar``).

``TargetModel.apply({'params': p}, tokens, positions, cache=..., feature_layers=(...))`` runs prefill or a
multi-token extension in one call and returns the logits, the requested layers' hidden features and the new
cache. The feature of layer ``i`` is exactly Hugging Face's ``hidden_states[i + 1]``: the output of decoder
block ``i``, except for the LAST layer, whose entry transformers takes after the final norm (SPEC section 3;
the official DFlash code feeds that normed output to drafts that read the last layer).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models.attention_kernels import Segment
from dflash_jax.models.cache import KVCache, LinearState, lengths_after_write, ring_slots, write_slots
from dflash_jax.models.config import TargetConfig
from dflash_jax.models.experts import Experts
from dflash_jax.models.gated_deltanet import GatedDeltaNet
from dflash_jax.models.mla import MLAttention
from dflash_jax.models.layers import (
    float32_dot_general,
    MLP, RMSNorm, apply_rope, attention, cache_attention, rope_inv_freq, rope_scale, to_cache_layout,
    ring_attention, write_rows,
)


class TargetOutput(NamedTuple):
    logits: jax.Array | None  # [B, T, V] or [B, K, V] with ``logits_at``; None when ``skip_logits``
    features: jax.Array | None  # [B, T, len(feature_layers) * H], layers concatenated in the order asked
    cache: KVCache | None


class TargetAttention(nn.Module):
    config: TargetConfig
    dtype: Any = jnp.float32
    window: int | None = None  # keys visible iff 0 <= q_pos - k_pos < window
    rope: bool = True  # False: a NoPE layer (Muse Glimmer's full layers), positions only mask

    @nn.compact
    def __call__(self, x, positions, mask, cache_kv=None, slots=None, live=None, spans=None, lengths=None,
                 valid=None, block_mask=None):
        """``mask``: ``[B, T, T]`` without a cache; with one, ``visible(key_slots) -> [B, T, C]`` and the
        ``live`` slot count that bounds the attention loop (``layers.cache_attention``), ``spans``: the same
        visibility as per-row counts ``(cache slots before the block, valid block tokens)`` for fused kernels,
        ``lengths [B]``: the rows' lengths after the block, and ``valid [B, T]`` the real tokens (a windowed
        layer's ring reads them). ``block_mask [B, T, T]``: a tree block's visibility among its own tokens
        (``TargetModel``'s ``tree``) instead of causal order."""
        cfg = self.config
        b, t, _ = x.shape
        dense = lambda n, bias, name: nn.Dense(  # noqa: E731
            n, use_bias=bias, dtype=self.dtype, param_dtype=self.dtype, name=name
        )
        head_dim, kv_heads, rope_config = cfg.attention_dims(self.window)
        gated = cfg.attention_output_gate  # q_proj yields [query | gate] per head
        q = dense(cfg.num_attention_heads * head_dim * (2 if gated else 1), cfg.qkv_bias, "q_proj")(x)
        k = dense(kv_heads * head_dim, cfg.qkv_bias, "k_proj")(x)
        # Gemma 4's full layers with attention_k_eq_v: no v_proj, V is k_proj's output before k_norm and RoPE
        v = k if cfg.attention_k_eq_v and self.window is None else dense(kv_heads * head_dim, cfg.qkv_bias,
                                                                          "v_proj")(x)
        gate = None
        if cfg.attention_gate_proj:  # Muse Glimmer: its own projection of the normed layer input, no bias
            gate = dense(cfg.num_attention_heads * head_dim, False, "gate_proj")(x)
        if gated:
            q, gate = jnp.split(q.reshape(b, t, cfg.num_attention_heads, 2 * head_dim), 2, axis=-1)
            gate = gate.reshape(b, t, -1)
        q = q.reshape(b, t, cfg.num_attention_heads, head_dim)
        k = k.reshape(b, t, kv_heads, head_dim)
        v = v.reshape(b, t, kv_heads, head_dim)
        if cfg.v_norm:  # Gemma 4: V RMS-normalised per head, no weight
            v = RMSNorm(cfg.rms_norm_eps, self.dtype, self.dtype, use_weight=False)(v)
        if cfg.qk_norm:
            norm = lambda name: RMSNorm(cfg.rms_norm_eps, self.dtype, self.dtype,  # noqa: E731
                                        cfg.norm_weight_in_float32, cfg.zero_centered_norms,
                                        use_weight=cfg.qk_norm_weight, name=name)
            if cfg.qk_norm_scope == "projection":  # one RMS over all heads (MiniMax-M2), written on the whole
                # projection: with heads split over the tensor axis, XLA reduces the mean across it
                q = norm("q_norm")(q.reshape(b, t, -1)).reshape(q.shape)
                k = norm("k_norm")(k.reshape(b, t, -1)).reshape(k.shape)
            else:
                q, k = norm("q_norm")(q), norm("k_norm")(k)
        if cfg.query_scale != 1.0:  # Muse Glimmer's qk_scale_factor: q only, after its norm, in the compute dtype
            q = q * cfg.query_scale
        rot = cfg.rotary_dim or head_dim  # partial RoPE: the first ``rot`` dims of each head rotate, the rest pass
        inv_freq, scale = rope_inv_freq(rope_config, rot), rope_scale(rope_config)
        rope = lambda a: jnp.concatenate(  # noqa: E731
            [apply_rope(a[..., :rot], positions, inv_freq, scale), a[..., rot:]], axis=-1)
        if self.rope:
            q, k = rope(q), rope(k)
        if cfg.attention_scale is not None:  # every attention path scales by 1/sqrt(head_dim): fold the rest in q
            q = (q.astype(jnp.float32) * (cfg.attention_scale * head_dim ** 0.5)).astype(q.dtype)
        copies = cfg.kv_copies(kv_heads)
        if copies > 1:  # head h's copies side by side: query head j still reads its own KV head
            k, v = (jnp.repeat(a, copies, axis=2) for a in (k, v))
        sinks = self.param("sinks", nn.initializers.zeros, (cfg.num_attention_heads,), self.dtype) \
            if cfg.attention_sinks else None
        window = self.window
        if cache_kv is not None:
            if window is not None:  # a ring; only the positions the window reaches, whatever the context
                out, new_kv = ring_attention(q, k, v, cache_kv, positions, valid, lengths, window, sinks,
                                             block_mask=block_mask)
            else:
                k_all = write_rows(cache_kv[0], k, slots)
                v_all = write_rows(cache_kv[1], v, slots)
                new_kv = (k_all, v_all)
                segments = [Segment(k_all, v_all, spans[0]),
                            Segment(to_cache_layout(k), to_cache_layout(v), spans[1], causal=block_mask is None,
                                    mask=block_mask)]
                out = cache_attention(q, k_all, v_all, mask, live, segments=segments, sinks=sinks)
        else:
            new_kv = None
            if window is not None:
                mask = mask & (positions[:, :, None] - positions[:, None, :] < window)
            out = attention(q, [(to_cache_layout(k), to_cache_layout(v), mask)], sinks=sinks)
        out = out.reshape(b, t, -1)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate)
        out = dense(cfg.hidden_size, cfg.o_bias, "o_proj")(out)
        return out, new_kv


class DecoderLayer(nn.Module):
    config: TargetConfig
    dtype: Any = jnp.float32
    index: int = 0

    @nn.compact
    def __call__(self, x, positions, mask, cache_kv=None, slots=None, live=None, spans=None, valid=None,
                 lengths=None, new_lengths=None, block_mask=None, selection=None):
        """``cache_kv``: this layer's cache, ``(keys, values)`` for attention (plus the indexer keys on a DSA full
        layer) or a ``LinearState`` for a Gated DeltaNet (which reads ``valid`` and the rows' ``lengths`` instead
        of the attention masks); ``new_lengths``: the rows' lengths after this forward. ``selection``: the DSA
        selection of the last full layer (GLM-5; None otherwise), returned as the third output, updated."""
        cfg = self.config
        norm = lambda name, eps=cfg.rms_norm_eps: RMSNorm(eps, self.dtype, self.dtype,  # noqa: E731
                                                          cfg.norm_weight_in_float32, cfg.zero_centered_norms,
                                                          name=name)
        post_eps = cfg.post_norm_eps or cfg.rms_norm_eps  # Muse Glimmer's sandwich post norms: their own eps
        h = norm("input_layernorm")(x)
        if cfg.is_linear_layer(self.index):
            mixed, new_kv = GatedDeltaNet(cfg.linear_attention, self.dtype, self.dtype, name="linear_attn")(
                h, valid, cache_kv, lengths=lengths, tree=block_mask)
            if cache_kv is None:
                new_kv = None
        else:
            if cfg.mla is not None:
                mixed, new_kv, selection = MLAttention(cfg, self.dtype, self.index, name="self_attn")(
                    h, positions, mask, cache_kv, slots, live, spans, new_lengths, valid, block_mask, selection)
            else:
                mixed, new_kv = TargetAttention(cfg, self.dtype, cfg.window(self.index), cfg.has_rope(self.index),
                                                name="self_attn")(h, positions, mask, cache_kv, slots, live, spans,
                                                                  new_lengths, valid, block_mask)

        def ffn(h, residual):
            if cfg.is_expert_layer(self.index) and not cfg.experts_beside_mlp:
                return Experts(cfg.experts, self.dtype, name="mlp")(h)
            out = MLP(cfg.intermediate_size, cfg.mlp_bias, self.dtype, self.dtype, cfg.hidden_act, name="mlp")(h)
            if cfg.is_expert_layer(self.index):  # Gemma 4: experts beside the MLP, routed on the un-normed residual
                moe = Experts(cfg.experts, self.dtype, name="moe")(norm("pre_feedforward_layernorm_2")(residual),
                                                                   residual)
                out = norm("post_feedforward_layernorm_1")(out) + norm("post_feedforward_layernorm_2")(moe)
            return out

        if cfg.sandwich_norms:  # Gemma: each sublayer's output is normed before its residual add
            x = x + norm("post_attention_layernorm", post_eps)(mixed)
            x = x + norm("post_feedforward_layernorm", post_eps)(ffn(norm("pre_feedforward_layernorm")(x), x))
        else:
            x = x + mixed
            x = x + ffn(norm("post_attention_layernorm")(x), x)
        if cfg.layer_scalar:
            x = x * self.param("layer_scalar", nn.initializers.ones, (1,), self.dtype)
        return x, new_kv, selection


class TargetModel(nn.Module):
    """Parameters: ``embed_tokens/embedding``, ``layers_{i}/...``, ``norm/weight``, ``lm_head/kernel``
    (absent when the head is tied to the embedding)."""

    config: TargetConfig
    dtype: Any = jnp.float32

    def setup(self):
        cfg = self.config
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, param_dtype=self.dtype)
        self.layers = [DecoderLayer(cfg, self.dtype, i) for i in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(cfg.rms_norm_eps, self.dtype, self.dtype, cfg.norm_weight_in_float32,
                            cfg.zero_centered_norms and not cfg.final_norm_plain)
        if cfg.embed_norm:
            self.embed_norm = RMSNorm(cfg.rms_norm_eps, self.dtype, self.dtype, use_weight=False)
        if not cfg.tie_word_embeddings:  # float32 logits (``unembed``)
            self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=self.dtype, param_dtype=self.dtype,
                                    dot_general=float32_dot_general)

    def embed(self, tokens: jax.Array) -> jax.Array:
        x = self.embed_tokens(tokens)
        if self.config.scale_embeddings:  # sqrt(H) as transformers has it: a float32 scalar cast to the dtype
            x = x * jnp.asarray(np.float32(self.config.hidden_size ** 0.5), x.dtype)
        if self.config.embed_norm:  # Muse Glimmer: a weightless RMSNorm on the rows (drafts read the raw rows)
            x = self.embed_norm(x)
        return x

    def head(self, hidden: jax.Array) -> jax.Array:
        """Final norm then the output head (tied or not): logits from pre-norm hidden states."""
        return self.unembed(self.norm(hidden))

    def unembed(self, x: jax.Array) -> jax.Array:
        """The output head alone (tied or not), on final-normed hidden states. The logits come out in float32
        whatever the compute dtype (the products accumulate in float32 and are not rounded back): acceptance
        and sampling decide on them, and a bfloat16 argmax flips near-ties that float32 keeps. With
        ``final_logit_softcapping`` (Gemma 4) they are soft-capped: ``cap * tanh(logits / cap)``, after Muse
        Glimmer's ``output_multiplier``."""
        if self.config.tie_word_embeddings:
            table = self.embed_tokens.embedding
            logits = jnp.einsum("...h,vh->...v", x, table.astype(x.dtype), preferred_element_type=jnp.float32)
        else:
            logits = self.lm_head(x)
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache | None = None,
        valid: jax.Array | None = None,
        feature_layers: Sequence[int] = (),
        logits_at: jax.Array | None = None,
        skip_logits: bool = False,
        tree: jax.Array | None = None,
    ) -> TargetOutput:
        """Run ``tokens [B, T]`` at absolute ``positions [B, T]``.

        With a ``cache``, each valid token's key/value is written at slot = its position, and queries see
        every slot at or before their position and below the row's new length. Without a cache the tokens
        see each other causally by position (a plain full forward). ``valid [B, T]`` marks real tokens
        (padding is neither written nor attended to). ``logits_at [B, K]`` selects token indices for the
        head, which saves the ``[B, T, V]`` logits of a long prefill. Hybrid targets: with a cache, a row's
        valid tokens must continue it from its length, as the engine's prefill chunks and rounds do (a linear
        layer's state has no slots to write at other positions); lowering lengths afterwards rolls the linear
        states back too (``models/cache.py``).

        ``tree [B, T, T]`` (with a cache; tree verification, ``engine/tree.py``): the block is a draft tree whose
        token ``i`` sees the committed context and the tokens ``j`` with ``tree[b, i, j]`` (its ancestors and
        itself). Token ``i`` is written at slot ``length + i`` whatever its position (``length + depth``), so
        the row's length grows by ``T`` and the engine's commit then moves the accepted path into place
        (``KVCache.commit_path``). A Gated DeltaNet layer runs each token from the state after its ancestors
        (``gated_deltanet.gated_delta_block``) and keeps every token's terms until that commit.
        """
        if valid is None:
            valid = jnp.ones(tokens.shape, bool)
        x = self.embed(tokens)
        live = spans = new_lengths = None
        if cache is not None and tree is not None:
            t = tokens.shape[1]
            tree = tree & valid[:, None, :]  # invalid tokens are neither written nor seen
            base = cache.lengths
            slots = jnp.where(valid, base[:, None] + jnp.arange(t, dtype=jnp.int32)[None], cache.num_slots)
            new_lengths = jnp.where(valid.any(axis=1), base + t, base)
            live = jnp.max(new_lengths)

            def mask(key_slot):
                rel = key_slot[None, None, :] - base[:, None, None]
                index = jnp.broadcast_to(jnp.clip(rel, 0, t - 1), (tree.shape[0], t, key_slot.shape[0]))
                return (rel < 0) | ((rel < t) & jnp.take_along_axis(tree, index, axis=2))

            spans = (base, jnp.sum(valid, axis=1, dtype=jnp.int32))
        elif cache is not None:
            slots = write_slots(positions, valid, cache.num_slots)
            new_lengths = lengths_after_write(cache.lengths, positions, valid)
            live = jnp.max(new_lengths)  # the attention loop stops at the longest row

            def mask(key_slot):
                return (key_slot[None, None, :] <= positions[:, :, None]) & (key_slot < new_lengths[:, None, None])

            # The same visibility for fused kernels: a row's valid tokens are the first of its block and sit at
            # consecutive positions from its first one, so a query sees every cache slot before the block, then
            # the block causally.
            first = jnp.min(jnp.where(valid, positions, cache.num_slots), axis=1)
            spans = (jnp.minimum(cache.lengths, first), jnp.sum(valid, axis=1, dtype=jnp.int32))
        else:
            slots = None
            mask = (positions[:, None, :] <= positions[:, :, None]) & valid[:, None, :]
        features, new_keys, new_values, new_linear, new_indexer = {}, [], [], [], []
        if -1 in feature_layers:  # DeepSpec's id -1: the embedding output (transformers' hidden_states[0])
            features[-1] = x
        last = len(self.layers) - 1
        attention_index = {layer: n for n, layer in enumerate(self.config.attention_layers)}
        linear_index = {layer: n for n, layer in enumerate(self.config.linear_layers)}
        dsa = self.config.dsa
        indexer_index = {layer: n for n, layer in enumerate(dsa.full_layers)} if dsa is not None else {}
        lengths = cache.lengths if cache is not None else None
        selection = None  # GLM-5's DSA: the last full layer's selection, which shared layers reuse
        for i, layer in enumerate(self.layers):
            layer_cache = None
            if cache is not None:
                layer_cache = cache.linear[linear_index[i]] if i in linear_index else (
                    cache.keys[attention_index[i]], cache.values[attention_index[i]])
                if i in indexer_index:
                    layer_cache = layer_cache + (cache.indexer[indexer_index[i]],)
            x, new_kv, selection = layer(x, positions, mask, layer_cache, slots, live, spans, valid, lengths,
                                         new_lengths if cache is not None else None, tree, selection)
            if isinstance(new_kv, LinearState):
                new_linear.append(new_kv)
            elif new_kv is not None:
                new_keys.append(new_kv[0])
                new_values.append(new_kv[1])
                new_indexer.extend(new_kv[2:])
            if i in feature_layers and i < last:
                features[i] = x
        normed = None
        if last in feature_layers:  # transformers' hidden_states[-1] is taken after the final norm
            normed = features[last] = self.norm(x)
        feats = jnp.concatenate([features[i] for i in feature_layers], axis=-1) if feature_layers else None
        logits = None
        if not skip_logits:
            if logits_at is not None:
                x = jnp.take_along_axis(x, logits_at[:, :, None], axis=1)
                logits = self.head(x)
            else:  # the last layer's feature already holds the normed states
                logits = self.unembed(normed) if normed is not None else self.head(x)
        new_cache = None
        if cache is not None:
            new_cache = KVCache(tuple(new_keys), tuple(new_values), new_lengths, tuple(new_linear), tuple(new_indexer))
        return TargetOutput(logits, feats, new_cache)


def init_cache(config: TargetConfig, batch: int, slots: int, dtype=jnp.float32, extension: int = 16,
               rings: bool = True) -> KVCache:
    """An empty cache of ``slots`` positions per row. ``extension``: the widest forward that must stay
    rollback-able (the verify block): hybrid targets' linear layers keep that extension's terms, and each
    sliding-window layer keeps a ring of ``window - 1 + extension`` slots (``models/cache.ring_slots``;
    ``rings=False``: every layer keeps all ``slots``, the same results at more memory)."""
    def layer_shape(layer: int) -> tuple[int, int, int, int]:
        window = config.window(layer)
        head_dim, kv_heads, _ = config.attention_dims(window)
        size = ring_slots(window, extension, slots) if rings and window is not None else slots
        return batch, kv_heads * config.kv_copies(kv_heads), size, head_dim

    shapes = [layer_shape(i) for i in config.attention_layers]
    value_shapes = shapes
    if config.mla is not None:  # the latent cache (models/mla.py): one head of [c | k_pe], values inside the keys
        shapes = [(batch, 1, slots, config.mla.cache_width)] * len(shapes)
        value_shapes = [(batch, 1, slots, 0)] * len(shapes)
    cache = KVCache(tuple(jnp.zeros(s, dtype) for s in shapes), tuple(jnp.zeros(s, dtype) for s in value_shapes),
                    jnp.zeros((batch,), jnp.int32))
    if config.dsa is not None:  # GLM-5: each full DSA layer's indexer keys, in the latent's slots (models/dsa_indexer)
        cache = cache.replace(indexer=tuple(jnp.zeros((batch, 1, slots, config.dsa.index_head_dim), dtype)
                                            for _ in config.dsa.full_layers))
    la = config.linear_attention
    linear = tuple(LinearState.create(batch, extension, la.conv_kernel, la.conv_dim, la.num_v_heads, la.head_k_dim,
                                      la.head_v_dim, dtype) for _ in config.linear_layers)
    return cache.replace(linear=linear)

