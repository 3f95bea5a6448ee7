"""The packed-block training forward: every anchor's block of a sequence in one draft pass.

It is the inference ``DraftModel`` with a different attention pattern (DESIGN: "Training reuses the model
code"): the same submodules (``fc``/``hidden_norm`` fusion, each layer's ``context_kv``, projections, norms,
MLP, final norm, shared head) are called through ``model.apply(..., method=...)``, so parameters and math are
exactly the inference module's. What changes is the attention:

* context keys/values are computed ONCE for all ``L`` positions of a sequence (RoPE at their positions);
* the ``A * B`` block queries see context positions strictly before their block's anchor (``<= a`` would
  leak: at inference the target has no feature for the anchor yet), limited by the window on sliding
  layers, plus their own block's ``B`` keys (bidirectionally, or causally on causal layers: the official
  per-layer rule), and never another block.

Rather than a dense ``[A*B, L + A*B]`` mask per head, the scores come in two parts: the context part
``[A*B, L]`` (mask = key position < anchor position) and the block-diagonal in-block part ``[A, B, B]``,
merged with one shared maximum (a log-sum-exp merge) into a single softmax. The frozen target embedding
and head are wrapped in ``stop_gradient``: only draft params train.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.models.draft import DraftModel, SharedHead, layer_visibility
from dflash_jax.models.layers import to_cache_layout


def packed_context_mask(block_positions: jax.Array, num_context: int, window: int | None,
                        anchor_valid: jax.Array | None = None) -> jax.Array:
    """``[N, A, B, L]``: block query at ``block_positions[n, a, i]`` sees context position ``s`` iff
    ``s < anchor position`` (and ``q_pos - s < window`` on sliding layers). Invalid anchors see no context."""
    key_pos = jnp.arange(num_context)
    mask = key_pos < block_positions[..., :1, None]  # [N, A, 1, L]
    if anchor_valid is not None:
        mask &= anchor_valid[..., None, None]
    mask = jnp.broadcast_to(mask, block_positions.shape + (num_context,))
    if window is not None:
        mask &= block_positions[..., None] - key_pos < window
    return mask


def packed_block_mask(block_positions: jax.Array, window: int | None, causal: bool) -> jax.Array:
    """``[N, A, B, B]``: block-diagonal in-block visibility, by the layer's rule as at inference."""
    return layer_visibility(block_positions, block_positions, window, causal)


def packed_block_attention(q, ctx_k, ctx_v, blk_k, blk_v, ctx_mask, blk_mask):
    """Grouped-query attention of packed blocks over [context | own block] with one joint softmax.

    ``q [N, A, B, Hq, D]``; ``ctx_k/ctx_v [N, KV, L, D]`` (cache layout, already roped); ``blk_k/blk_v
    [N, A, B, KV, D]`` (roped); ``ctx_mask [N, A, B, L]``; ``blk_mask [N, A, B, B]`` (must keep the diagonal,
    so no row is empty). Scores, softmax and accumulation in float32; returns ``[N, A, B, Hq, D]`` in q's dtype.
    """
    n, a, b, hq, d = q.shape
    kv = ctx_k.shape[1]
    qg = q.reshape(n, a, b, kv, hq // kv, d)
    scale = d**-0.5
    neg = jnp.finfo(jnp.float32).min
    f32 = jnp.float32
    cm = ctx_mask[:, :, :, None, None, :]
    bm = blk_mask[:, :, :, None, None, :]
    s_ctx = jnp.einsum("nabkgd,nksd->nabkgs", qg, ctx_k, preferred_element_type=f32) * scale
    s_blk = jnp.einsum("nabkgd,nackd->nabkgc", qg, blk_k, preferred_element_type=f32) * scale
    s_ctx = jnp.where(cm, s_ctx, neg)
    s_blk = jnp.where(bm, s_blk, neg)
    m = jax.lax.stop_gradient(jnp.maximum(s_ctx.max(-1, keepdims=True), s_blk.max(-1, keepdims=True)))
    p_ctx = jnp.where(cm, jnp.exp(s_ctx - m), 0.0)
    p_blk = jnp.where(bm, jnp.exp(s_blk - m), 0.0)
    denom = p_ctx.sum(-1) + p_blk.sum(-1)  # >= 1: the maximum's own term
    out = jnp.einsum("nabkgs,nksd->nabkgd", p_ctx.astype(ctx_v.dtype), ctx_v, preferred_element_type=f32)
    out = out + jnp.einsum("nabkgc,nackd->nabkgd", p_blk.astype(blk_v.dtype), blk_v, preferred_element_type=f32)
    out = out / denom[..., None]
    return out.reshape(n, a, b, hq, d).astype(q.dtype)


def _context_kv(module: DraftModel, target_features):
    """Every layer's context keys/values ``[N, KV, L, D]`` (roped at their positions), computed ONCE per
    sequence and shared by all of its blocks. With input injection the context first travels causally
    through the layers (position ``s`` sees ``<= s``, all before any anchor that sees ``s``: no leak)."""
    n, length = target_features.shape[:2]
    ctx = module.fuse(target_features)  # [N, L, H], shared by every layer
    ctx_pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None], (n, length))
    out = []
    for i, layer in enumerate(module.layers):
        k_ctx, v_ctx = layer.context_kv(ctx, ctx_pos)
        out.append((to_cache_layout(k_ctx), to_cache_layout(v_ctx)))
        if module.config.context_injection == "input" and i + 1 < len(module.layers):
            ctx = layer.advance_context(ctx, ctx_pos, *out[-1], length)
    return tuple(out)


def _block_hidden(module: DraftModel, context_kv, block_tokens, block_positions, anchor_valid, shared):
    """The draft layers over packed blocks ``[N, A, B]``; returns the last hidden states ``[N, A, B, H]``
    (before the final norm)."""
    cfg = module.config
    n, a, b = block_tokens.shape
    length = context_kv[0][0].shape[2]
    flat_pos = block_positions.reshape(n, a * b)
    x = module.embed_block(block_tokens.reshape(n, a * b), shared)  # [N, A*B, H]
    for layer, (k_ctx, v_ctx) in zip(module.layers, context_kv):
        def attend(attn, h, layer=layer, k_ctx=k_ctx, v_ctx=v_ctx):
            # DraftAttention's own projections, with the packed attention in place of `attention`.
            q = attn.queries(h, flat_pos)
            k_blk, v_blk = attn.keys_values(h, flat_pos)
            shape5 = (n, a, b, cfg.num_key_value_heads, cfg.head_dim)
            out = packed_block_attention(
                q.reshape(n, a, b, cfg.num_attention_heads, cfg.head_dim), k_ctx, v_ctx,
                k_blk.reshape(shape5), v_blk.reshape(shape5),
                packed_context_mask(block_positions, length, layer.window, anchor_valid),
                packed_block_mask(block_positions, layer.window, layer.causal),
            )
            return attn.o_proj(out.reshape(n, a * b, -1))

        x = layer.block_step(x, attend, b)  # the layer's own order (and DFlash2's convolutions, block by block)
    return x.reshape(n, a, b, -1)


def _packed_forward(module: DraftModel, target_features, block_tokens, block_positions, anchor_valid, shared):
    """Runs inside ``model.apply``: the module's own submodules with the packed-block attention."""
    context_kv = _context_kv(module, target_features)
    x = _block_hidden(module, context_kv, block_tokens, block_positions, anchor_valid, shared)
    return module.logits(x, shared)


def _packed_proposals(module: DraftModel, target_features, block_tokens, block_positions, anchor_valid, shared):
    """Inside ``apply``: every packed block's greedy proposals ``[N, A, B-1]`` for its mask positions, as an
    inference round makes them: the argmax, or a DFlash2 draft's selector chain from the block's anchor."""
    context_kv = _context_kv(module, target_features)
    x = _block_hidden(module, context_kv, block_tokens, block_positions, anchor_valid, shared)
    normed = module.norm(x[:, :, 1:])
    logits = module.normed_logits(normed, shared)
    if module.candidate_selector is None:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    n, a, k = logits.shape[:3]
    flat = lambda t: t.reshape((n * a, k) + t.shape[3:])  # noqa: E731
    tokens, _ = module.select(flat(logits), flat(normed), block_tokens[..., 0].reshape(n * a))
    return tokens.reshape(n, a, k)


def draft_training_proposals(model: DraftModel, params, target_features: jax.Array, block_tokens: jax.Array,
                             block_positions: jax.Array, anchor_valid: jax.Array, shared: SharedHead) -> jax.Array:
    """Greedy proposals ``[N, A, B-1]`` of every packed block (same inputs as ``draft_training_logits``):
    block ``(n, a)`` proposes what the inference round anchored there proposes."""
    return model.apply({"params": params}, target_features, block_tokens, block_positions, anchor_valid,
                       frozen(shared), method=_packed_proposals)


def frozen(shared: SharedHead) -> SharedHead:
    """The target's embedding/head with gradients stopped (they are never trained)."""
    head = None if shared.head_kernel is None else jax.lax.stop_gradient(shared.head_kernel)
    return SharedHead(jax.lax.stop_gradient(shared.embedding), head)


def draft_training_logits(model: DraftModel, params, target_features: jax.Array, block_tokens: jax.Array,
                          block_positions: jax.Array, anchor_valid: jax.Array, shared: SharedHead) -> jax.Array:
    """Logits ``[N, A, B, V]`` of every packed block.

    ``target_features [N, L, n*H]`` are the raw concatenated target features of the full clean sequences
    (padding past a sequence's length is never seen by a valid anchor, whose context is ``< a < length``);
    ``block_tokens, block_positions [N, A, B]`` and ``anchor_valid [N, A]`` come from
    ``anchors.block_labels`` / ``sample_anchors``. Block ``(n, a)`` equals the inference draft forward with
    context ``features[n, :anchor]`` and the block at ``anchor .. anchor+B-1``. Invalid anchors get finite,
    meaningless logits (they see only their own block) and carry no labels.
    """
    return model.apply({"params": params}, target_features, block_tokens, block_positions, anchor_valid,
                       frozen(shared), method=_packed_forward)
