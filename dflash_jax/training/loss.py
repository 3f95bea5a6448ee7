"""The DFlash training loss: cross-entropy over block positions with exponentially decaying weights.

Acceptance stops at the first wrong draft token, so early block positions matter most: position ``k``
(1-based among the mask positions) is weighted ``w_k = exp(-(k - 1) / gamma)``; the anchor (``k = 0``) never
has a loss (SPEC section 6). Metrics are cheap by-products of the same logits: per-position accuracy and a
greedy acceptance-length estimate (1 + the leading run of correct predictions, the bonus token included).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.errors import UserError

DEFAULT_GAMMAS = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """The paper's decay constant for ``block_size`` (7 for 16, 5 for 10, 4 for 8)."""
    if block_size not in DEFAULT_GAMMAS:
        raise UserError(
            f"no default loss decay gamma for block_size {block_size} (known: "
            f"{', '.join(f'{b}: {g:g}' for b, g in sorted(DEFAULT_GAMMAS.items()))}); pass gamma explicitly"
        )
    return DEFAULT_GAMMAS[block_size]


def decay_weights(block_size: int, gamma: float) -> np.ndarray:
    """``[B]`` float32: 0 for the anchor, ``exp(-(k - 1) / gamma)`` for ``k = 1 .. B-1``."""
    k = np.arange(block_size, dtype=np.float64)
    w = np.where(k >= 1, np.exp(-(k - 1) / gamma), 0.0)
    return w.astype(np.float32)


class LossSums(NamedTuple):
    """Additive pieces of the loss and its metrics. Sums, not means, so that they can be added over chunks
    of anchors, accumulation micro-steps, devices and processes before the ONE division (SPEC section 6:
    per-device normalisation made the loss depend on how the batch was split)."""

    weighted_ce: jax.Array  # sum of w_k * ce over valid labels
    weight: jax.Array  # sum of w_k over valid labels
    correct: jax.Array  # [B] correct greedy predictions per block position (0 at the anchor)
    count: jax.Array  # [B] valid labels per block position
    accepted: jax.Array  # sum over blocks with a label at k = 1 of (1 + leading run of correct predictions)
    blocks: jax.Array  # number of such blocks

    @classmethod
    def zeros(cls, block_size: int) -> "LossSums":
        z = jnp.zeros((), jnp.float32)
        return cls(z, z, jnp.zeros((block_size,), jnp.float32), jnp.zeros((block_size,), jnp.float32), z, z)

    def __add__(self, other: "LossSums") -> "LossSums":  # type: ignore[override]
        return LossSums(*(a + b for a, b in zip(self, other)))


def block_loss_sums(draft_logits: jax.Array, labels: jax.Array, label_mask: jax.Array, gamma: float) -> LossSums:
    """``LossSums`` of blocks from the logits of their MASK positions only.

    ``draft_logits [..., B-1, V]`` are block positions 1..B-1 (the anchor predicts nothing, so its logits are
    never computed); ``labels, label_mask [..., B]`` cover the whole block. Cross-entropy in float32.
    """
    block = labels.shape[-1]
    labels_k, mask_k = labels[..., 1:], label_mask[..., 1:].astype(bool)
    logits = draft_logits.astype(jnp.float32)
    label_logit = jnp.take_along_axis(logits, labels_k[..., None].astype(jnp.int32), axis=-1)[..., 0]
    ce = jax.nn.logsumexp(logits, axis=-1) - label_logit
    w = jnp.where(mask_k, jnp.asarray(decay_weights(block, gamma)[1:]), 0.0)
    correct = ((jnp.argmax(logits, axis=-1) == labels_k) & mask_k).reshape(-1, block - 1).astype(jnp.float32)
    mask_f = mask_k.reshape(-1, block - 1).astype(jnp.float32)
    run = jnp.cumprod(correct, axis=1).sum(1)  # leading run of correct predictions from k = 1
    has_block = mask_f[:, 0]
    pad = jnp.zeros((1,), jnp.float32)
    return LossSums(
        weighted_ce=jnp.sum(w * ce), weight=jnp.sum(w),
        correct=jnp.concatenate([pad, correct.sum(0)]), count=jnp.concatenate([pad, mask_f.sum(0)]),
        accepted=jnp.sum((1.0 + run) * has_block), blocks=has_block.sum(),
    )


def implied_acceptance(accuracy_per_position: jax.Array) -> jax.Array:
    """``1 + sum_k prod_{j<=k} acc_j`` over the mask positions: the acceptance length the per-position
    accuracies imply if errors were independent (a cheap training metric that tracks tau, SPEC section 6)."""
    return 1.0 + jnp.sum(jnp.cumprod(accuracy_per_position[1:]))


def loss_and_metrics(sums: LossSums) -> tuple[jax.Array, dict]:
    """The one division: loss ``sum(w * ce) / sum(w)`` and the metrics, from (globally reduced) sums."""
    per_pos = sums.correct / jnp.maximum(sums.count, 1.0)
    loss = sums.weighted_ce / jnp.maximum(sums.weight, 1e-12)
    metrics = {
        "loss": loss,
        "accuracy": sums.correct.sum() / jnp.maximum(sums.count.sum(), 1.0),
        "accuracy_per_position": per_pos,
        "acceptance_length": sums.accepted / jnp.maximum(sums.blocks, 1.0),
        "implied_acceptance_length": implied_acceptance(per_pos),
        "num_labels": sums.count.sum(),
    }
    return loss, metrics


def dflash_loss(logits: jax.Array, labels: jax.Array, label_mask: jax.Array, gamma: float | None = None):
    """Weighted cross-entropy ``sum(w * ce) / sum(w)`` over valid labels, from full block logits.

    ``logits [..., B, V]`` (any dtype; computed in float32; position 0 is ignored), ``labels, label_mask
    [..., B]``. ``gamma=None`` uses ``default_gamma(B)``. Returns ``(loss, metrics)`` with metrics
    ``accuracy`` (over valid labels), ``accuracy_per_position [B]`` (0 where a position has no labels),
    ``acceptance_length`` (mean over blocks with a label at k = 1 of 1 + the leading run of correct k = 1,
    2, ... predictions), ``implied_acceptance_length`` and ``num_labels``.
    """
    block = logits.shape[-2]
    gamma = default_gamma(block) if gamma is None else gamma
    return loss_and_metrics(block_loss_sums(logits[..., 1:, :], labels, label_mask, gamma))
