"""Preallocated key/value caches with per-row lengths.

A cache is a pytree passed into and returned from pure forward functions. Layout ``[batch, kv_heads, slots,
head_dim]`` per layer: attention is a batched dot over (batch, kv head), and with those axes leading XLA
reads the cache in place (``[batch, slots, ...]`` made it transpose a full copy every step on CPU). Slot ``s`` of a row holds the key
and value of the token at absolute position ``s``; ``lengths[b]`` counts the committed slots of row ``b``.
Rejecting speculated tokens is just lowering ``lengths``: the stale slots are never visible (the attention
mask hides slots at or past the length) and are overwritten by the next write.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
    keys: tuple[jax.Array, ...]  # per layer [batch, kv_heads, slots, head_dim]
    values: tuple[jax.Array, ...]
    lengths: jax.Array  # [batch] int32

    @classmethod
    def create(cls, num_layers: int, batch: int, slots: int, kv_heads: int, head_dim: int, dtype=jnp.float32):
        shape = (batch, kv_heads, slots, head_dim)
        return cls(
            keys=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            values=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def num_slots(self) -> int:
        return self.keys[0].shape[2]

    def with_lengths(self, lengths: jax.Array) -> "KVCache":
        return self.replace(lengths=lengths.astype(jnp.int32))


def lengths_after_write(lengths: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
    """Writing at ``positions`` makes a row's length one past its last written position (so a write also
    discards anything speculative beyond it); rows with nothing valid keep their length."""
    last = jnp.max(jnp.where(valid, positions, -1), axis=1)
    return jnp.where(last >= 0, last + 1, lengths).astype(jnp.int32)


def write_slots(positions: jax.Array, valid: jax.Array, num_slots: int) -> jax.Array:
    """Cache slots for each token; invalid tokens get an out-of-range slot so the scatter drops them."""
    return jnp.where(valid, positions, num_slots)
