"""Preallocated key/value caches with per-row lengths.

A cache is a pytree passed into and returned from pure forward functions. Layout ``[batch, kv_heads, slots,
head_dim]`` per layer: attention is a batched dot over (batch, kv head), and with those axes leading XLA
reads the cache in place (``[batch, slots, ...]`` made it transpose a full copy every step on CPU). Slot ``s`` of a row holds the key
and value of the token at absolute position ``s``; ``lengths[b]`` counts the committed slots of row ``b``.
Rejecting speculated tokens is just lowering ``lengths``: the stale slots are never visible (the attention
mask hides slots at or past the length) and are overwritten by the next write.

A sliding-window layer keeps a ring instead (``ring_slots``): position ``p`` at slot ``p % R`` with ``R =
window - 1 + extension``, the window a query reaches back plus the widest forward that may be rolled back (the
verify block). A write keeps only its last ``R`` positions (a long prefill chunk wraps around), and rollback is
still only lowering ``lengths``: a rejected position overwrote a slot whose position lies before every window
that can still be asked for. gpt-oss-120b at 131,072 positions keeps 256 slots in each of its 18 sliding
layers instead of 131,072.

Multi-head latent attention layers (DeepSeek-V3, Kimi K2: ``models/mla.py``) keep a latent cache in the same
two tuples: ``keys`` ``[batch, 1, slots, kv_lora_rank + qk_rope_head_dim]`` (each token's normed latent and its
roped shared key, one "head" for all query heads) and a zero-width ``values`` ``[batch, 1, slots, 0]`` (the values
are the first ``kv_lora_rank`` dims of the keys). A slot is a slot whatever it holds, so rollback (lengths) and
the tree commit (``commit_path`` moves slots) are the attention layers' own.

Hybrid targets (Qwen3-Next, Qwen3.5) keep, for each Gated DeltaNet layer, a ``LinearState`` instead of
keys and values, with the same contract: the state of a row IS a function of its length. A linear layer
cannot overwrite a slot, so it keeps the state before its last extension (``start``) plus what that
extension computed, and the state after the row's first ``lengths - start`` tokens of it is formed when the
next forward needs it (``models/gated_deltanet.py``). Lowering ``lengths`` after a verified block therefore
rolls the recurrent and conv states back to the accepted prefix, exactly, at no cost in the round.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class LinearState:
    """One Gated DeltaNet layer's decode state: the state before the last extension, and that extension's
    terms (``W`` = the widest extension kept, the verify block; wider ones, prefill chunks, are folded into
    the base at once and leave nothing pending). Only ``lengths`` says how much of the extension a row keeps.
    Pending positions past a row's valid tokens hold zeros (they change nothing)."""

    conv: jax.Array  # [B, K - 1, conv_dim] the last K - 1 pre-conv inputs before ``start`` (compute dtype)
    recurrent: jax.Array  # [B, Hv, dk, dv] float32: the delta-rule state before ``start``
    start: jax.Array  # [B] int32: the position of the extension's first token
    inputs: jax.Array  # [B, W, conv_dim] the extension's pre-conv inputs
    keys: jax.Array  # [B, W, Hv, dk] float32: its normalised keys, repeated to the value heads
    deltas: jax.Array  # [B, W, Hv, dv] float32: its delta-rule updates (``beta (v - S^T k)``)
    decay: jax.Array  # [B, W, Hv] float32: cumulative log decay from ``start`` through each position

    @classmethod
    def create(cls, batch: int, width: int, conv_kernel: int, conv_dim: int, heads: int, head_k_dim: int,
               head_v_dim: int, dtype=jnp.float32) -> "LinearState":
        f32 = jnp.float32
        return cls(conv=jnp.zeros((batch, conv_kernel - 1, conv_dim), dtype),
                   recurrent=jnp.zeros((batch, heads, head_k_dim, head_v_dim), f32),
                   start=jnp.zeros((batch,), jnp.int32), inputs=jnp.zeros((batch, width, conv_dim), dtype),
                   keys=jnp.zeros((batch, width, heads, head_k_dim), f32),
                   deltas=jnp.zeros((batch, width, heads, head_v_dim), f32),
                   decay=jnp.zeros((batch, width, heads), f32))

    @property
    def width(self) -> int:
        return self.inputs.shape[1]

    # Logical axes per leaf for the sharding rules: rows over the data axes, value heads over tensor.
    AXES = dict(conv=("batch", None, None), recurrent=("batch", "kv_heads", None, None), start=("batch",),
                inputs=("batch", None, None), keys=("batch", None, "kv_heads", None),
                deltas=("batch", None, "kv_heads", None), decay=("batch", None, "kv_heads"))


@flax.struct.dataclass
class KVCache:
    """The target's (and the draft's) decode cache: keys and values of the attention layers, in layer order,
    the linear layers' states (hybrid targets; empty otherwise) and each row's committed length."""

    keys: tuple[jax.Array, ...]  # per attention layer [batch, kv_heads, slots, head_dim]
    values: tuple[jax.Array, ...]
    lengths: jax.Array  # [batch] int32
    linear: tuple[LinearState, ...] = ()  # per Gated DeltaNet layer, in layer order
    # GLM-5's DSA indexer keys, per full DSA layer in layer order, [batch, 1, slots, index_head_dim]: slot by slot
    # like the latent cache, so rollback and commit treat them as they treat keys (``models/dsa_indexer``)
    indexer: tuple[jax.Array, ...] = ()

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
        """The positions a row can hold: the full layers' slots (a windowed layer's ring may be smaller)."""
        return max(k.shape[2] for k in self.keys)

    def with_lengths(self, lengths: jax.Array) -> "KVCache":
        """The rollback of a chain: the rows keep their first ``lengths`` positions (what a forward wrote past
        them is stale and never seen)."""
        return self.replace(lengths=lengths.astype(jnp.int32))

    def commit_path(self, base: jax.Array, perm: jax.Array, lengths: jax.Array) -> "KVCache":
        """The rollback of a tree (``engine/tree.py``): a verify block written at slots ``base + i`` (``base
        [B]``, the rows' lengths before it) is reordered so that slot ``base + j`` takes slot ``base +
        perm[:, j]`` (``perm [B, N]``: the accepted path's nodes first, the identity elsewhere), then the rows
        keep ``lengths``. Node ``perm[j]`` was rotated for position ``base + j``, so nothing is re-rotated;
        ring layers map slots modulo their size (they hold at least ``N`` slots past the window). The chain is
        the identity permutation: ``with_lengths``. A linear layer's pending terms (``LinearState``, token order
        from ``base``) are gathered the same way: the accepted path's terms are the chain's for that path, and
        the new lengths form its state when the next forward needs it."""
        n = perm.shape[1]
        rows = jnp.arange(perm.shape[0])[:, None]

        def gather(pending: jax.Array) -> jax.Array:  # [B, W, ...]: the first n entries permuted
            moved = jnp.take_along_axis(pending, perm.reshape(perm.shape + (1,) * (pending.ndim - 2)), axis=1)
            return jnp.concatenate([moved, pending[:, n:]], axis=1)

        linear = tuple(state.replace(inputs=gather(state.inputs), keys=gather(state.keys),
                                     deltas=gather(state.deltas), decay=gather(state.decay))
                       for state in self.linear)

        def move(layer: jax.Array) -> jax.Array:
            size = layer.shape[2]
            source = (base[:, None] + perm) % size
            dest = (base[:, None] + jnp.arange(n, dtype=perm.dtype)[None]) % size
            return layer.at[rows, :, dest].set(layer[rows, :, source])  # read all, then write: order-safe

        return self.replace(keys=tuple(map(move, self.keys)), values=tuple(map(move, self.values)),
                            lengths=lengths.astype(jnp.int32), linear=linear, indexer=tuple(map(move, self.indexer)))


def lengths_after_write(lengths: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
    """Writing at ``positions`` makes a row's length one past its last written position (so a write also
    discards anything speculative beyond it); rows with nothing valid keep their length."""
    last = jnp.max(jnp.where(valid, positions, -1), axis=1)
    return jnp.where(last >= 0, last + 1, lengths).astype(jnp.int32)


def ring_slots(window: int, extension: int, slots: int) -> int:
    """Slots of a sliding-window layer's ring: the ``window - 1`` positions before a forward's first query, plus
    the ``extension`` a rolled-back forward may write past the committed length (never more than ``slots``)."""
    return min(slots, window - 1 + extension)


def write_slots(positions: jax.Array, valid: jax.Array, num_slots: int) -> jax.Array:
    """Cache slots for each token; invalid tokens get an out-of-range slot so the scatter drops them."""
    return jnp.where(valid, positions, num_slots)
