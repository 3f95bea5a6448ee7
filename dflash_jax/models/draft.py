"""The DFlash draft: a small non-causal transformer whose every layer also attends to the target's features.

One forward takes the raw target features of the newly verified positions, fuses them
(``hidden_norm(fc(concat))``), turns them into each layer's context keys/values (stored, after RoPE, in a
preallocated per-row cache), and predicts a whole block ``[anchor, mask, ..., mask]`` at once. Block
keys/values are transient. The token embedding and the output head are the target's, passed in as arrays
at call time: the draft's params hold exactly what the official checkpoint holds.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.models.attention_kernels import Segment
from dflash_jax.models.cache import KVCache, lengths_after_write, write_slots
from dflash_jax.models.dflash2 import BlockConv, CandidateSelector, select_chain, select_transitions
from dflash_jax.models.draft_config import DraftConfig
from dflash_jax.models.dspark import Chain, Choose, ConfidenceHead, MarkovHead, markov_chain
from dflash_jax.models.layers import (
    MLP, RMSNorm, apply_rope, cache_attention, rope_inv_freq, to_cache_layout, write_rows,
)
from dflash_jax.sharding import embedding_lookup


class SharedHead(NamedTuple):
    """The target's frozen token embedding ``[V, H]`` and output head kernel ``[H, V]`` (None when tied)."""

    embedding: jax.Array
    head_kernel: jax.Array | None


def head_logits(shared: SharedHead, x: jax.Array) -> jax.Array:
    """The target's output head (tied or not) on final-normed hidden states ``[..., H]`` -> ``[..., V]``, in
    float32 like the target's (``TargetModel.unembed``)."""
    if shared.head_kernel is None:
        return jnp.einsum("...h,vh->...v", x, shared.embedding.astype(x.dtype), preferred_element_type=jnp.float32)
    return jnp.matmul(x, shared.head_kernel.astype(x.dtype), preferred_element_type=jnp.float32)


class DraftOutput(NamedTuple):
    logits: jax.Array  # [B, block, V] (position 0, the anchor, is meaningless) or [B, block-1, V] without it
    cache: KVCache | None
    hidden: jax.Array | None = None  # DFlash2, DSpark: the final-normed hidden states of the same positions


def layer_visibility(query_positions: jax.Array, key_positions: jax.Array, window: int | None,
                     causal: bool) -> jax.Array:
    """The official rule of one draft layer over keys at absolute positions (SPEC section 4): a causal layer
    sees ``k_pos <= q_pos``; a windowed one also needs ``q_pos - k_pos < window`` and, when bidirectional,
    ``k_pos - q_pos < window``. ``[..., T]``, ``[..., S]`` -> ``[..., T, S]``."""
    diff = query_positions[..., :, None] - key_positions[..., None, :]
    mask = diff >= 0 if causal else jnp.ones(diff.shape, bool)
    if window is not None:
        mask &= diff < window
        if not causal:
            mask &= -diff < window
    return mask


def context_mask(block_positions: jax.Array, key_positions: jax.Array, key_valid: jax.Array,
                 window: int | None) -> jax.Array:
    """Which context keys each block query sees: verified positions strictly before the anchor, and within
    the sliding window (``q_pos - k_pos < window``) for sliding layers (context keys precede every query, so
    causality changes nothing here). Shapes ``[B, T]``, ``[B, S]`` -> ``[B, T, S]``."""
    start = block_positions[:, :1, None]
    mask = key_valid[:, None, :] & (key_positions[:, None, :] < start)
    mask = jnp.broadcast_to(mask, block_positions.shape + key_positions.shape[-1:])
    if window is not None:
        mask &= block_positions[:, :, None] - key_positions[:, None, :] < window
    return mask


def causal_context_mask(query_positions: jax.Array, key_positions: jax.Array, window: int | None) -> jax.Array:
    """Context positions seeing each other causally (``k_pos <= q_pos``, within the window on sliding
    layers); used only by the input-injection variant, whose context travels through the layers.
    ``[B, T]``, ``[B, S]`` -> ``[B, T, S]``."""
    return layer_visibility(query_positions, key_positions, window, causal=True)


def block_mask(block_positions: jax.Array, window: int | None, causal: bool,
               block_len: jax.Array | None = None) -> jax.Array:
    """Block tokens among themselves, by the layer's rule (``layer_visibility``). ``block_len [B]``: only the
    first ``block_len`` block tokens exist as keys, as when the official code drafts a shorter block where
    fewer tokens than a block remain to be generated."""
    mask = layer_visibility(block_positions, block_positions, window, causal)
    if block_len is not None:
        mask &= (jnp.arange(block_positions.shape[1]) < block_len[:, None])[:, None, :]
    return mask


class DraftAttention(nn.Module):
    config: DraftConfig
    dtype: Any = jnp.float32

    def setup(self):
        cfg = self.config
        dense = lambda n: nn.Dense(n, use_bias=cfg.attention_bias, dtype=self.dtype, param_dtype=self.dtype)  # noqa
        self.q_proj = dense(cfg.num_attention_heads * cfg.head_dim)
        self.k_proj = dense(cfg.num_key_value_heads * cfg.head_dim)
        self.v_proj = dense(cfg.num_key_value_heads * cfg.head_dim)
        self.o_proj = dense(cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.rms_norm_eps, self.dtype, self.dtype)
        self.k_norm = RMSNorm(cfg.rms_norm_eps, self.dtype, self.dtype)

    def keys_values(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Roped, normed keys and plain values of ``x [B, T, H]``; used for context and block alike."""
        cfg = self.config
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim))
        v = self.v_proj(x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
        k = apply_rope(k, positions, rope_inv_freq(cfg.rope, cfg.head_dim))
        copies = cfg.kv_copies
        if copies > 1:  # each head's copies side by side: query head j still reads its own KV head
            k, v = jnp.repeat(k, copies, axis=2), jnp.repeat(v, copies, axis=2)
        return k, v

    def queries(self, h: jax.Array, positions: jax.Array) -> jax.Array:
        """Roped, normed queries ``[B, T, heads, head_dim]`` of the block tokens (inference and training)."""
        cfg = self.config
        b, t, _ = h.shape
        q = self.q_norm(self.q_proj(h).reshape(b, t, cfg.num_attention_heads, cfg.head_dim))
        return apply_rope(q, positions, rope_inv_freq(cfg.rope, cfg.head_dim))

    def __call__(self, h, block_positions, ctx_keys, ctx_values, ctx_visible, live, blk_mask, ctx_lengths=None,
                 blk_lengths=None, causal=False):
        """``ctx_keys/values [B, KV, S, D]`` (the context cache, already roped) are read up to ``live`` slots
        (``layers.cache_attention``); ``ctx_visible(key_positions [C]) -> [B, T, C]``; ``blk_mask [B, T, T]``.
        ``ctx_lengths [B]``, where given, is the same context visibility as a per-row slot count, and
        ``blk_lengths [B]`` the block keys that exist (causal or not, no window): the form fused kernels take."""
        b, t, _ = h.shape
        q = self.queries(h, block_positions)
        k_blk, v_blk = self.keys_values(h, block_positions)
        k_blk, v_blk = to_cache_layout(k_blk), to_cache_layout(v_blk)
        segments = None
        if ctx_lengths is not None:
            segments = [Segment(ctx_keys, ctx_values, ctx_lengths), Segment(k_blk, v_blk, blk_lengths, causal)]
        out = cache_attention(q, ctx_keys, ctx_values, ctx_visible, live, extra=[(k_blk, v_blk, blk_mask)],
                              segments=segments)
        return self.o_proj(out.reshape(b, t, -1))


class DraftLayer(nn.Module):
    config: DraftConfig
    window: int | None = None
    causal: bool = False  # inside the block (DraftConfig.layer_causal)
    dtype: Any = jnp.float32

    def setup(self):
        cfg = self.config
        self.input_layernorm = RMSNorm(cfg.rms_norm_eps, self.dtype, self.dtype)
        self.self_attn = DraftAttention(cfg, self.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.rms_norm_eps, self.dtype, self.dtype)
        self.mlp = MLP(cfg.intermediate_size, False, self.dtype, self.dtype)
        if cfg.dflash2:  # SPEC section 10: a block convolution around the attention and one around the MLP
            conv = lambda: BlockConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size, self.dtype)  # noqa
            self.attention_conv, self.mlp_conv = conv(), conv()
        else:
            self.attention_conv = self.mlp_conv = None

    def block_step(self, x: jax.Array, attend: Callable[["DraftAttention", jax.Array], jax.Array],
                   block: int) -> jax.Array:
        """The layer over block tokens ``x [..., T, H]`` (consecutive blocks of ``block`` tokens), with
        ``attend(self_attn, h)`` giving the attention's output (after ``o_proj``): the inference forward and
        the packed training forward differ only there."""
        h = self.input_layernorm(x)
        if self.attention_conv is not None:
            h, second = self.attention_conv.prepare(h, block)
            x = x + self.attention_conv.finish(attend(self.self_attn, h), second, block)
        else:
            x = x + attend(self.self_attn, h)
        h = self.post_attention_layernorm(x)
        if self.mlp_conv is not None:
            h, second = self.mlp_conv.prepare(h, block)
            return x + self.mlp_conv.finish(self.mlp(h), second, block)
        return x + self.mlp(h)

    def context_kv(self, ctx: jax.Array, positions: jax.Array):
        """DFlash: the fused features are memory only (no input norm, no query, no MLP). The input-injection
        variant treats the context as this layer's ordinary input, normed like any token."""
        if self.config.context_injection == "input":
            ctx = self.input_layernorm(ctx)
        return self.self_attn.keys_values(ctx, positions)

    def advance_context(self, ctx: jax.Array, positions: jax.Array, keys: jax.Array, values: jax.Array,
                        live: jax.Array | int) -> jax.Array:
        """Input-injection variant only: the context positions' own pass through this layer (causal attention
        over the context keys/values ``[B, KV, S, D]``, which already hold theirs, up to ``live`` slots),
        giving the next layer's context input."""
        b, t, _ = ctx.shape
        q = self.self_attn.queries(self.input_layernorm(ctx), positions)
        visible = lambda pos: causal_context_mask(positions, jnp.broadcast_to(pos, (b, pos.shape[0])),  # noqa: E731
                                                   self.window)
        out = cache_attention(q, keys, values, visible, live)
        ctx = ctx + self.self_attn.o_proj(out.reshape(b, t, -1))
        return ctx + self.mlp(self.post_attention_layernorm(ctx))

    def __call__(self, x, block_positions, ctx_keys, ctx_values, ctx_visible, live, blk_mask, ctx_lengths=None,
                 blk_lengths=None):
        def attend(attn, h):
            return attn(h, block_positions, ctx_keys, ctx_values, ctx_visible, live, blk_mask, ctx_lengths,
                        blk_lengths, self.causal)

        return self.block_step(x, attend, x.shape[-2])


class DraftModel(nn.Module):
    """Params: ``fc/kernel``, ``hidden_norm/weight``, ``layers_{i}/...``, ``norm/weight`` (official keys).

    ``draft_window`` (inference only, beyond the official code) bounds every layer's context to the last
    ``draft_window`` positions before each query, as a sliding window does: at long context the draft's
    attention and cache stop growing with the prompt. Only the proposals change, never the output."""

    config: DraftConfig
    dtype: Any = jnp.float32
    draft_window: int | None = None

    def setup(self):
        cfg = self.config
        self.fc = nn.Dense(cfg.hidden_size, use_bias=False, dtype=self.dtype, param_dtype=self.dtype)
        self.hidden_norm = RMSNorm(cfg.rms_norm_eps, self.dtype, self.dtype)
        self.layers = [DraftLayer(cfg, cfg.layer_window(i), causal, self.dtype)
                       for i, causal in enumerate(cfg.layer_causal)]
        self.norm = RMSNorm(cfg.rms_norm_eps, self.dtype, self.dtype)
        self.candidate_selector = (CandidateSelector(cfg.vocab_size, cfg.selector_rank, cfg.selector_top_k,
                                                     self.dtype) if cfg.dflash2 else None)
        # DSpark (SPEC 13): the Markov and confidence heads read the same final-normed states as the head.
        self.markov_head = (MarkovHead(cfg.vocab_size, cfg.markov_rank, cfg.markov_head_type, self.dtype)
                            if cfg.dspark and cfg.markov_rank else None)
        self.confidence_head = ConfidenceHead(self.dtype) if cfg.dspark and cfg.confidence_head else None

    def fuse(self, features: jax.Array) -> jax.Array:
        """Raw concatenated target features ``[..., n*H]`` -> the fused context feature ``[..., H]``."""
        return self.hidden_norm(self.fc(features.astype(self.dtype)))

    def embed_block(self, tokens: jax.Array, shared: SharedHead) -> jax.Array:
        x = embedding_lookup(shared.embedding, tokens).astype(self.dtype)
        scale = self.config.input_embedding_scale
        return x * scale if scale != 1.0 else x

    def logits(self, x: jax.Array, shared: SharedHead) -> jax.Array:
        """Final norm, the target's head, the output multiplier and softcap: last hidden -> logits."""
        return self.normed_logits(self.norm(x), shared)

    def normed_logits(self, x: jax.Array, shared: SharedHead) -> jax.Array:
        cfg = self.config
        logits = head_logits(shared, x)
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        if cfg.final_logit_softcapping is not None:
            cap = cfg.final_logit_softcapping
            logits = cap * jnp.tanh(logits / cap)
        return logits

    def __call__(
        self,
        block_tokens: jax.Array,
        block_positions: jax.Array,
        ctx_features: jax.Array,
        ctx_positions: jax.Array,
        ctx_valid: jax.Array,
        cache: KVCache,
        shared: SharedHead,
        skip_anchor_logits: bool = False,
        block_len: jax.Array | None = None,
    ) -> DraftOutput:
        """One inference forward.

        ``ctx_features [B, Tc, n*H]`` are the raw target features of the newly verified positions
        ``ctx_positions [B, Tc]`` (``ctx_valid`` marks real ones); their keys/values are written into
        ``cache`` (``write_context``). The block ``[B, T]`` at ``block_positions`` then attends to every
        cached context slot before its anchor plus the block (each layer's rule: ``block_mask``), of which
        only the first ``block_len [B]`` tokens exist (default: all).
        """
        cache = self.write_context(ctx_features, ctx_positions, ctx_valid, cache)
        b = block_tokens.shape[0]
        live = jnp.max(cache.lengths)  # context attention stops at the longest row
        blk_lengths = jnp.full((b,), block_tokens.shape[1], jnp.int32) if block_len is None else block_len
        x = self.embed_block(block_tokens, shared)
        for i, layer in enumerate(self.layers):
            bound = self.context_bound(i)
            size = cache.keys[i].shape[2]

            def visible(slot, bound=bound, size=size):
                if bound is None:  # slot = position
                    keys = jnp.broadcast_to(slot, (b, slot.shape[0]))
                    return context_mask(block_positions, keys, keys < cache.lengths[:, None], None)
                keys = ring_positions(slot, cache.lengths, size)
                return context_mask(block_positions, keys, keys >= 0, bound)

            # Without a bound a block sees exactly the context slots before its anchor and the first block_len
            # block keys (causally or not): the fused kernels' form.
            ctx_lengths = None if bound is not None else jnp.minimum(cache.lengths, block_positions[:, 0])
            x = layer(x, block_positions, cache.keys[i], cache.values[i], visible,
                      live if bound is None else jnp.minimum(live, size),
                      block_mask(block_positions, layer.window, layer.causal, block_len), ctx_lengths, blk_lengths)
        if skip_anchor_logits:  # the anchor's prediction is never used at inference: save 1/B of the head
            x = x[:, 1:]
        normed = self.norm(x)
        hidden = None
        if self.candidate_selector is not None:  # DFlash2: the selector reads the final-normed states
            hidden = normed
            if self.is_initializing():
                self.candidate_selector.project(normed)
        if self.config.dspark:
            hidden = normed
            if self.is_initializing():
                self.dspark_heads(normed, block_tokens[:, -normed.shape[1]:])
        return DraftOutput(self.normed_logits(normed, shared), cache, hidden)

    def dspark_heads(self, hidden: jax.Array, previous: jax.Array) -> tuple[jax.Array | None, jax.Array | None]:
        """DSpark, teacher-forced (training; and creating the heads' params at init): the Markov correction
        ``[..., V]`` and the confidence logits ``[...]`` of positions with final-normed ``hidden [..., H]`` whose
        previous tokens are ``previous [...]`` (None for a head the draft does not have)."""
        bias = None if self.markov_head is None else self.markov_head(previous, hidden)
        conf = None
        if self.confidence_head is not None:
            features = hidden
            if self.config.confidence_with_markov:
                features = jnp.concatenate([hidden, self.markov_head.codes(previous).astype(hidden.dtype)], axis=-1)
            conf = self.confidence_head(features)
        return bias, conf

    def dspark_chain(self, logits: jax.Array, hidden: jax.Array, anchor: jax.Array, choose: Choose,
                     key: jax.Array | None = None, confidence: bool = True) -> Chain:
        """DSpark: draft the block left to right through the Markov head (``dspark.markov_chain``) from a
        forward's ``logits [B, K, V]`` and ``hidden [B, K, H]``; ``confidence`` False skips the confidence head
        (a round without a threshold never reads it)."""
        weights = None if self.markov_head is None else self.markov_head.weights()
        return markov_chain(weights, self.confidence_head if confidence else None,
                            self.config.confidence_with_markov, logits, hidden, anchor, choose, key)

    def select(self, logits: jax.Array, hidden: jax.Array, anchor: jax.Array, temperature: float = 0.0,
               key: jax.Array | None = None):
        """DFlash2: the block's chain of candidates (``dflash2.select_chain``) from a forward's mask-position
        ``logits`` and ``hidden``."""
        return select_chain(self.candidate_selector, logits, hidden, anchor, temperature, key)

    def transitions(self, logits: jax.Array, hidden: jax.Array, anchor: jax.Array, k: int):
        """DFlash2: the selector's candidates and their transition log-probs, for a tree
        (``dflash2.select_transitions``)."""
        return select_transitions(self.candidate_selector, logits, hidden, anchor, k)

    def context_bound(self, i: int) -> int | None:
        """How far back layer ``i``'s block queries see the context (``q_pos - k_pos < bound``): its sliding
        window and/or the run's ``draft_window``; None: everything."""
        return _bound(self.layers[i].window, self.draft_window)

    def write_context(self, ctx_features: jax.Array, ctx_positions: jax.Array, ctx_valid: jax.Array,
                      cache: KVCache) -> KVCache:
        """Fuse raw target features and store every layer's context keys/values: at slot = position, or at
        slot = position mod size in a bounded layer's ring (``init_draft_cache``)."""
        ctx = self.fuse(ctx_features)
        lengths = lengths_after_write(cache.lengths, ctx_positions, ctx_valid)
        new_keys, new_values = [], []
        for i, layer in enumerate(self.layers):
            size = cache.keys[i].shape[2]
            if self.context_bound(i) is None:
                slots = write_slots(ctx_positions, ctx_valid, size)
            else:
                # Only the last ``size`` positions survive a write (a long prefill chunk wraps around the ring):
                # the older ones are dropped rather than scattered onto the same slots in an undefined order.
                keep = ctx_valid & (ctx_positions >= lengths[:, None] - size)
                slots = jnp.where(keep, ctx_positions % size, size)
            k_ctx, v_ctx = layer.context_kv(ctx, ctx_positions)
            new_keys.append(write_rows(cache.keys[i], k_ctx, slots))
            new_values.append(write_rows(cache.values[i], v_ctx, slots))
            if self.config.context_injection == "input" and i + 1 < len(self.layers):
                # Slots up to a valid position were all committed before or in this write; padding queries
                # may read stale slots, but their outputs are never written.
                ctx = layer.advance_context(ctx, ctx_positions, new_keys[-1], new_values[-1], jnp.max(lengths))
        return KVCache(tuple(new_keys), tuple(new_values), lengths)


def _bound(window: int | None, draft_window: int | None) -> int | None:
    bounds = [w for w in (window, draft_window) if w is not None]
    return min(bounds) if bounds else None


def ring_positions(slots: jax.Array, lengths: jax.Array, size: int) -> jax.Array:
    """The absolute position each ring slot ``[C]`` holds, per row ``[B, C]``: the last position below the row's
    context length that maps onto it (negative: never written). Every position below the length was written
    in order, so slot ``s`` holds the newest ``p < length`` with ``p % size == s``."""
    last = lengths[:, None] - 1
    return last - jnp.mod(last - slots[None, :], size)


def context_cache_sizes(config: DraftConfig, slots: int, draft_window: int | None = None) -> tuple[int, ...]:
    """Slots of each layer's context cache: a layer that sees only the last ``bound`` positions (a sliding
    window, or ``draft_window`` for every layer) keeps them in a ring of ``bound`` slots (a query at ``start+i``
    needs context ``> start + i - bound``, so the ``bound - 1`` positions before the anchor at most);
    the others keep every position. A ring as large as the whole cache is the plain layout (slot = position),
    so a bound longer than the context changes nothing."""
    if config.context_injection == "input":  # its context's own causal pass reads the cache by position
        return (slots,) * config.num_hidden_layers
    return tuple(min(slots, _bound(config.layer_window(i), draft_window) or slots)
                 for i in range(config.num_hidden_layers))


def init_draft_cache(config: DraftConfig, batch: int, slots: int, dtype=jnp.float32,
                     draft_window: int | None = None) -> KVCache:
    shapes = [(batch, config.num_key_value_heads * config.kv_copies, n, config.head_dim)
              for n in context_cache_sizes(config, slots, draft_window)]
    return KVCache(tuple(jnp.zeros(s, dtype) for s in shapes), tuple(jnp.zeros(s, dtype) for s in shapes),
                   jnp.zeros((batch,), jnp.int32))


# DeepSpec's DSpark checkpoints keep their own copies of the target's embedding and head beside the backbone
# (the same arrays in every released draft); they sit in the draft's params under these names.
HEAD_COPIES = ("embed_tokens", "lm_head")


def split_head_copies(params: dict) -> tuple[dict, SharedHead | None]:
    """A DSpark draft's params -> (the backbone's params, its own embedding/head as a ``SharedHead``, or None
    when it holds none)."""
    if params is None or not any(name in params for name in HEAD_COPIES):
        return params, None
    backbone = {k: v for k, v in params.items() if k not in HEAD_COPIES}
    return backbone, SharedHead(params["embed_tokens"]["embedding"], params["lm_head"]["kernel"])


def with_head_copies(params: dict, shared: SharedHead) -> dict:
    """Backbone params plus the embedding/head copies a DeepSpec checkpoint stores (a tied head written out as
    the embedding's transpose: DeepSpec's drafts have ``tie_word_embeddings: false``)."""
    backbone, _ = split_head_copies(params)
    head = shared.head_kernel if shared.head_kernel is not None else jnp.transpose(shared.embedding)
    return {**backbone, "embed_tokens": {"embedding": shared.embedding}, "lm_head": {"kernel": head}}


def shared_head(target_params: dict, tied: bool) -> SharedHead:
    """Borrow (not copy) the target's embedding and head from its params."""
    head = None if tied else target_params["lm_head"]["kernel"]
    return SharedHead(target_params["embed_tokens"]["embedding"], head)
