"""The DFlash training loss: cross-entropy over block positions with exponentially decaying weights.

Acceptance stops at the first wrong draft token, so early block positions matter most: position ``k``
(1-based among the mask positions) is weighted ``w_k = exp(-(k - 1) / gamma)``; the anchor (``k = 0``) never
has a loss (SPEC section 6). Metrics are cheap by-products of the same logits: per-position accuracy and a
greedy acceptance-length estimate (1 + the leading run of correct predictions, the bonus token included).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_GAMMAS = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """The paper's decay constant for ``block_size`` (7 for 16, 5 for 10, 4 for 8)."""
    if block_size not in DEFAULT_GAMMAS:
        raise ValueError(
            f"no default loss decay gamma for block_size {block_size} (known: "
            f"{', '.join(f'{b}: {g:g}' for b, g in sorted(DEFAULT_GAMMAS.items()))}); pass gamma explicitly"
        )
    return DEFAULT_GAMMAS[block_size]


def decay_weights(block_size: int, gamma: float) -> np.ndarray:
    """``[B]`` float32: 0 for the anchor, ``exp(-(k - 1) / gamma)`` for ``k = 1 .. B-1``."""
    k = np.arange(block_size, dtype=np.float64)
    w = np.where(k >= 1, np.exp(-(k - 1) / gamma), 0.0)
    return w.astype(np.float32)


def dflash_loss(logits: jax.Array, labels: jax.Array, label_mask: jax.Array, gamma: float | None = None):
    """Weighted cross-entropy ``sum(w * ce) / sum(w)`` over valid labels.

    ``logits [..., B, V]`` (any dtype; computed in float32), ``labels, label_mask [..., B]``. ``gamma=None``
    uses ``default_gamma(B)``. Returns ``(loss, metrics)`` with metrics ``accuracy`` (over valid labels),
    ``accuracy_per_position [B]`` (0 where a position has no labels), ``acceptance_length`` (mean over blocks
    with a label at k = 1 of 1 + the leading run of correct k = 1, 2, ... predictions) and ``num_labels``.
    """
    block = logits.shape[-2]
    gamma = default_gamma(block) if gamma is None else gamma
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    ce = -jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    mask = label_mask.astype(bool)
    w = jnp.where(mask, jnp.asarray(decay_weights(block, gamma)), 0.0)
    loss = jnp.sum(w * ce) / jnp.maximum(jnp.sum(w), 1e-12)

    correct = (jnp.argmax(logits, axis=-1) == labels) & mask
    flat_correct = correct.reshape(-1, block).astype(jnp.float32)
    flat_mask = mask.reshape(-1, block).astype(jnp.float32)
    per_pos = flat_correct.sum(0) / jnp.maximum(flat_mask.sum(0), 1.0)
    run = jnp.cumprod(flat_correct[:, 1:], axis=1).sum(1)  # leading correct run from k = 1
    has_block = flat_mask[:, 1]
    acceptance = jnp.sum((1.0 + run) * has_block) / jnp.maximum(has_block.sum(), 1.0)
    metrics = {
        "loss": loss,
        "accuracy": flat_correct.sum() / jnp.maximum(flat_mask.sum(), 1.0),
        "accuracy_per_position": per_pos,
        "acceptance_length": acceptance,
        "num_labels": flat_mask.sum(),
    }
    return loss, metrics
