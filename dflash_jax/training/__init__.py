"""DFlash draft training (SPEC section 6): anchors and packed blocks, the packed training forward, the loss."""

from dflash_jax.training.anchors import block_labels, eligible_anchors, sample_anchors
from dflash_jax.training.forward import draft_training_logits, packed_block_attention
from dflash_jax.training.loss import decay_weights, default_gamma, dflash_loss

__all__ = [
    "block_labels", "decay_weights", "default_gamma", "dflash_loss", "draft_training_logits", "eligible_anchors",
    "packed_block_attention", "sample_anchors",
]
