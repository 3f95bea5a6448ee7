"""Anchor sampling and packed-block construction for DFlash training (SPEC section 6).

Training a draft block by block would need one draft forward per anchor. Instead every training sequence
carries ``A`` anchors drawn anew at each step; each anchor ``a`` becomes a block ``[token[a], mask x (B-1)]``
at positions ``a .. a+B-1`` whose block position ``k`` is trained to predict ``token[a+k]``. Everything here is
a pure, jittable function of fixed-shape arrays (``num_anchors`` and ``block_size`` are static), so that the
sampling runs inside the jitted train step with no host round trip and no Python loop over anchors.

Conventions: anchors come back sorted ascending with the valid ones first; invalid (padding) anchors sit at
position 0 with ``valid = False`` and carry no labels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.sharding import constrain_batch


def _batched(loss_mask: jax.Array, lengths) -> tuple[jax.Array, jax.Array]:
    loss_mask = jnp.asarray(loss_mask)
    if loss_mask.ndim == 1:
        loss_mask = loss_mask[None]
    lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32).reshape(-1), loss_mask.shape[:1])
    return loss_mask.astype(bool), lengths


def eligible_anchors(loss_mask: jax.Array, lengths) -> jax.Array:
    """``[N, L]`` bool: position ``a`` may be an anchor iff ``a + 1 < length``, ``loss_mask[a + 1]`` (the
    first predicted token is a trained one) and ``loss_mask[a]``: at inference the anchor is always a token
    the target generated, never the last prompt token (the rule of the most used public trainer)."""
    loss_mask, lengths = _batched(loss_mask, lengths)
    n, length = loss_mask.shape
    next_mask = jnp.concatenate([loss_mask[:, 1:], jnp.zeros((n, 1), bool)], axis=1)
    pos = jnp.arange(length)[None]
    return loss_mask & next_mask & (pos + 1 < lengths[:, None])


def sample_anchors(key: jax.Array, loss_mask: jax.Array, lengths, num_anchors: int) -> tuple[jax.Array, jax.Array]:
    """Per sequence, up to ``num_anchors`` DISTINCT uniformly random eligible positions (``eligible_anchors``).

    ``loss_mask`` is ``[L]`` or ``[N, L]``; ``lengths`` a scalar or ``[N]``. Returns ``anchors [N, A]`` int32
    (ascending, valid first) and ``valid [N, A]`` bool. With fewer eligible positions than ``A`` all of them
    are taken and the rest are invalid. Sampling without replacement = the top ``A`` of i.i.d. uniform keys
    over the eligible positions (ineligible ones get key -1 and are never chosen ahead of an eligible one).
    """
    elig = _padded_eligible(loss_mask, lengths, num_anchors)
    return _top_scores(jnp.where(elig, jax.random.uniform(key, elig.shape), -1.0), num_anchors)


def sample_row_anchors(row_keys: jax.Array, loss_mask: jax.Array, lengths, num_anchors: int
                       ) -> tuple[jax.Array, jax.Array]:
    """``sample_anchors`` for ``[N, L]`` rows with row ``i`` drawn from ``row_keys[i]`` alone (the same as
    ``vmap``-ing ``sample_anchors`` over rows), so that a row's anchors do not depend on the rows it shares a
    batch or a device with. Written for the batch rather than per row so that, under a mesh, the draws and
    the selection stay with each device's own rows."""
    elig = _padded_eligible(loss_mask, lengths, num_anchors)
    uniforms = jax.vmap(lambda k: jax.random.uniform(k, elig.shape[1:]))(row_keys)
    return _top_scores(constrain_batch(jnp.where(elig, uniforms, -1.0)), num_anchors)


def _padded_eligible(loss_mask: jax.Array, lengths, num_anchors: int) -> jax.Array:
    elig = eligible_anchors(loss_mask, lengths)
    length = elig.shape[1]
    if num_anchors > length:  # every row must have num_anchors candidates: pad with never-eligible positions
        elig = jnp.pad(elig, ((0, 0), (0, num_anchors - length)))
    return elig


def _top_scores(scores: jax.Array, num_anchors: int) -> tuple[jax.Array, jax.Array]:
    """The positions of the ``num_anchors`` highest scores of each row (score -1: never valid), ascending with
    the valid ones first."""
    # A sort rather than lax.top_k: XLA partitions a sort along its other dimensions, so under a mesh each
    # device keeps to its own rows (top_k was gathered onto every device).
    idx = jnp.argsort(-scores, axis=1, stable=True)[:, :num_anchors]
    valid = jnp.take_along_axis(scores, idx, axis=1) >= 0.0
    # Sort: valid anchors ascending first, then the invalid ones (reset to position 0).
    order = jnp.argsort(jnp.where(valid, idx, scores.shape[1] + idx), axis=1)
    idx = jnp.take_along_axis(idx, order, axis=1)
    valid = jnp.take_along_axis(valid, order, axis=1)
    return jnp.where(valid, idx, 0).astype(jnp.int32), valid


def uniform_anchors(loss_mask: jax.Array, lengths, num_anchors: int, block_size: int) -> tuple[jax.Array, jax.Array]:
    """The ablation baseline of random anchors: non-overlapping blocks laid end to end from the first
    eligible position (``p0, p0 + B, p0 + 2B, ...``), each kept if eligible, at most ``num_anchors``. Same
    outputs as ``sample_anchors`` (ascending, valid first, invalid at 0)."""
    elig = eligible_anchors(loss_mask, lengths)
    n, length = elig.shape
    first = jnp.argmax(elig, axis=1)  # 0 when nothing is eligible (then nothing below is valid either)
    grid = first[:, None] + block_size * jnp.arange(num_anchors)[None]
    valid = jnp.take_along_axis(jnp.pad(elig, ((0, 0), (0, 1))), jnp.minimum(grid, length), axis=1)
    order = jnp.argsort(~valid, axis=1, stable=True)  # keep ascending order, valid ones first
    grid, valid = jnp.take_along_axis(grid, order, axis=1), jnp.take_along_axis(valid, order, axis=1)
    return jnp.where(valid, grid, 0).astype(jnp.int32), valid


def block_labels(tokens: jax.Array, loss_mask: jax.Array, lengths, anchors: jax.Array, valid: jax.Array,
                 block_size: int, *, mask_token_id: int):
    """The packed blocks and their labels.

    ``tokens, loss_mask [N, L]`` (or ``[L]``), ``anchors, valid [N, A]``. Returns ``block_tokens [N, A, B]``
    (``[token[a], mask_token_id x (B-1)]``), ``block_positions [N, A, B]`` (``a + k``), ``labels [N, A, B]``
    (``token[a+k]``, 0 where out of range) and ``label_mask [N, A, B]``: true only for ``k >= 1``, a valid
    anchor, and ``a + j < length`` with ``loss_mask[a + j]`` for every ``j = 1 .. k``.
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim == 1:
        tokens = tokens[None]
    loss_mask, lengths = _batched(loss_mask, lengths)
    length = tokens.shape[1]
    k = jnp.arange(block_size)
    positions = anchors[..., None].astype(jnp.int32) + k  # [N, A, B]
    gather_at = jnp.minimum(positions, length - 1)
    take = jax.vmap(lambda row, idx: row[idx])
    labels = take(tokens, gather_at)
    in_range = positions < jnp.minimum(lengths, length)[:, None, None]
    # A label counts only while every position from a+1 to a+k is trained: a block never predicts across an
    # untrained gap (the next user turn of a conversation), which the draft never has to do at inference.
    trained_run = jnp.cumprod((take(loss_mask, gather_at) & in_range) | (k == 0), axis=-1).astype(bool)
    label_mask = valid[..., None] & (k >= 1) & trained_run
    labels = jnp.where(label_mask, labels, 0).astype(jnp.int32)
    first = take(tokens, anchors.astype(jnp.int32))  # [N, A]
    block_tokens = jnp.where(k == 0, first[..., None], mask_token_id).astype(jnp.int32)
    return block_tokens, positions, labels, label_mask


def prefix_range(block_size: int, prefix_min: int = 1, prefix_max: int | None = None) -> tuple[int, int]:
    """The visible-prefix lengths ``lo .. hi`` a block of ``block_size`` may draw: at most ``B - 1`` (one
    mask position is left to supervise), at least 1 (the anchor alone: the standard block)."""
    hi = block_size - 1 if prefix_max is None else min(prefix_max, block_size - 1)
    return max(1, min(prefix_min, hi)), hi


def prefix_pmf(lo: int, hi: int, base: float) -> np.ndarray:
    """The truncated geometric prior of D2SD: ``Pr(l) = base**l / sum_{j=lo..hi} base**j`` for ``l = lo ..
    hi`` (float64, for tests and docs)."""
    w = float(base) ** np.arange(lo, hi + 1, dtype=np.float64)
    return w / w.sum()


def sample_prefix_lengths(row_keys: jax.Array, num_anchors: int, lo: int, hi: int, base: float) -> jax.Array:
    """``[N, A]`` int32 visible-prefix lengths, i.i.d. from ``prefix_pmf(lo, hi, base)``, row ``i`` from
    ``row_keys[i]`` alone (a stream apart from the anchors' draw, which uses the same row key). By the inverse
    CDF of one uniform per block (``jax.random.categorical`` compiled five times slower here)."""
    cdf = jnp.asarray(np.cumsum(prefix_pmf(lo, hi, base))[:-1], jnp.float32)
    uniforms = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1), (num_anchors,)))(row_keys)
    return (lo + jnp.searchsorted(cdf, uniforms, side="right")).astype(jnp.int32)


def visible_prefix(block_tokens: jax.Array, labels: jax.Array, label_mask: jax.Array, prefix: jax.Array):
    """The variable-prefix block (D2SD's VP objective): block positions ``1 .. prefix-1`` show their real
    tokens instead of the mask token and carry no label; only the masked suffix ``k >= prefix`` is supervised.

    ``block_tokens, labels, label_mask [N, A, B]`` from ``block_labels``; ``prefix [N, A]`` (1: the standard
    block). A position shows its token only where it has a label (inside the sequence and the trained run):
    past that every later label is off anyway, and the draft never sees a token it could not have been given.
    Returns ``(block_tokens, label_mask)``; ``labels`` are unchanged (a DFlash2 selector still reads the true
    predecessor of the first masked position from them).
    """
    k = jnp.arange(block_tokens.shape[-1])
    prefix = prefix[..., None]
    show = (k >= 1) & (k < prefix) & label_mask
    return jnp.where(show, labels, block_tokens).astype(block_tokens.dtype), label_mask & (k >= prefix)
