"""DeepSeek sparse attention (DSA): the lightning indexer of GLM-5 / GLM-5.1 (``glm_moe_dsa``, SPEC 11.5).

Each query of a DSA layer attends only to the ``index_topk`` keys its indexer scores highest among the keys it
may see. The indexer (transformers' ``GlmMoeDsaIndexer``), per token ``x`` with MLA's query residual ``q_resid =
q_a_layernorm(q_a_proj(x))``:

- queries ``qi = wq_b(q_resid)``, ``H_I`` heads of ``D_I``; ONE key per token ``ki = LayerNorm(wk(x))`` (a
  LayerNorm WITH a bias, eps 1e-6, not an RMSNorm);
- interleaved RoPE (MLA's frequencies and positions) on the FIRST ``qk_rope_head_dim`` dims of ``qi`` and
  ``ki``, the rest passed through: ``[rope | pass]``, the opposite order of MLA's ``[nope | rope]``;
- ``score[s, t] = sum_h w[s, h] * relu(qi[s, h] . ki[t] * D_I^-0.5)`` with ``w = weights_proj(x) * H_I^-0.5``,
  all in float32 (transformers keeps ``weights_proj`` in float32). The ReLU comes BEFORE the head-weighted sum;
  ``w`` may be negative, so a score may be too;
- the query keeps the top ``index_topk`` of its visible keys (cached and new alike); the others are masked out
  of its attention, on top of the causal (or tree) mask.

Keys a query cannot see never compete: the top-k is taken over each query's OWN visible set, so a query whose
visible keys number at most ``index_topk`` keeps them all and its attention is exactly dense (transformers takes
``topk(min(index_topk, T))`` over scores with the invisible keys at the mask's minimum: the same set). In a tree
block each node's visible set is the committed context plus its ancestors, and the selection follows it.

"Shared" layers have no indexer: they reuse the selection of the previous full layer (``DSAConfig.layer_types``).

The indexer-key cache: each full layer keeps its post-LayerNorm, roped keys, ``[B, 1, slots, D_I]`` in the
latent cache's layout (one "head"), so it is written by ``layers.write_rows`` at the same slots as the latent,
and a chain rollback (lowering lengths) and a tree commit (``KVCache.commit_path``'s slot moves) treat it
exactly as they treat the latent: slot ``s`` holds the key of the token written there, nothing else.

The selection is a boolean mask over the keys, ``[B, T, S]``: the indexer scores every slot anyway (the lightning
indexer is dense by design), so the mask costs what its scores cost, and it composes with every attention path
here as one more visibility (``select_mask``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.models.config_fields import ConfigError
from dflash_jax.models.layers import apply_rope_interleaved, write_rows

FULL, SHARED = "full", "shared"


@dataclasses.dataclass(frozen=True)
class DSAConfig:
    """The indexer's sizes and the layer schedule (SPEC 11.5). ``layer_types[i]``: ``"full"`` (layer ``i`` runs
    its own indexer and keeps indexer keys) or ``"shared"`` (it reuses the previous full layer's selection)."""

    index_topk: int
    index_n_heads: int
    index_head_dim: int
    rope_dim: int  # MLA's qk_rope_head_dim: the first rope_dim dims of the indexer's q and k rotate
    layer_types: tuple[str, ...]
    norm_eps: float = 1e-6  # k_norm: transformers builds the LayerNorm with eps 1e-6 whatever the config says

    def is_full(self, layer: int) -> bool:
        return self.layer_types[layer] == FULL

    @property
    def full_layers(self) -> tuple[int, ...]:
        """The layers with an indexer, in order: the ones with an indexer-key cache."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == FULL)


def indexer_layer_types(cfg: Mapping[str, Any], num_layers: int, source: str = "config") -> tuple[str, ...]:
    """Each layer's indexer mode as transformers' ``GlmMoeDsaConfig`` derives it: ``indexer_types`` as given;
    else ``index_topk_pattern`` (a string of ``F``/``S``, or a list); else layer ``i`` is full iff
    ``max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0`` (defaults 2 and 1: every layer full). A
    shared layer before any full one has no selection to reuse (transformers fails there): refused."""
    types = cfg.get("indexer_types")
    where = "indexer_types"
    if types is None and cfg.get("index_topk_pattern") is not None:
        pattern, where = cfg["index_topk_pattern"], "index_topk_pattern"
        if isinstance(pattern, str):
            letters = {"F": FULL, "S": SHARED}
            if set(pattern) - set(letters):
                raise ConfigError(f"{source}: field 'index_topk_pattern' {pattern!r} may hold only 'F' (full) and "
                                  "'S' (shared)")
            types = [letters[c] for c in pattern]
        else:
            types = list(pattern)
    if types is None:
        freq = cfg.get("index_topk_freq", 1)
        offset = cfg.get("index_skip_topk_offset", 2)
        for key, value in (("index_topk_freq", freq), ("index_skip_topk_offset", offset)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{source}: field {key!r} must be an integer, got {value!r}")
        freq = max(freq, 1)  # as transformers clamps it
        types = [FULL if max(i - offset + 1, 0) % freq == 0 else SHARED for i in range(num_layers)]
        where = "index_topk_freq' and 'index_skip_topk_offset"
    types = tuple(types)
    if len(types) != num_layers or set(types) - {FULL, SHARED}:
        raise ConfigError(f"{source}: field '{where}' must give 'full' or 'shared' for each of the "
                          f"{num_layers} layers, got {list(types)!r}")
    if types[0] != FULL:
        raise ConfigError(f"{source}: field(s) '{where}' make layer 0 shared, which has no earlier full "
                          "layer's selection to reuse (layer 0 must be full)")
    return types


class IndexerLayerNorm(nn.Module):
    """``torch.nn.LayerNorm`` with its weight and bias (params ``weight``, ``bias`` as stored), in float32 and
    cast back to the compute dtype."""

    eps: float = 1e-6
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        bias = self.param("bias", nn.initializers.zeros, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)


class Indexer(nn.Module):
    """One full layer's indexer projections: ``(x [B, T, H], q_resid [B, T, q_lora_rank], positions [B, T],
    inv_freq, scale) -> (qi [B, T, H_I, D_I], ki [B, T, D_I], w [B, T, H_I] float32)``. ``inv_freq`` and
    ``scale`` are MLA's RoPE (the indexer rotates with the same cos and sin). Params ``wq_b``, ``wk``,
    ``k_norm`` and ``weights_proj`` (transformers' ``self_attn.indexer.*``)."""

    config: DSAConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, q_resid, positions, inv_freq, scale=1.0):
        c = self.config
        b, t, _ = x.shape
        dense = lambda n, name, dtype: nn.Dense(  # noqa: E731
            n, use_bias=False, dtype=dtype, param_dtype=dtype, name=name)
        q = dense(c.index_n_heads * c.index_head_dim, "wq_b", self.dtype)(q_resid)
        q = q.reshape(b, t, c.index_n_heads, c.index_head_dim)
        k = IndexerLayerNorm(c.norm_eps, self.dtype, name="k_norm")(
            dense(c.index_head_dim, "wk", self.dtype)(x))[:, :, None, :]  # [B, T, 1, D_I]
        r = c.rope_dim
        rope = lambda a: jnp.concatenate(  # noqa: E731  [rope | pass]
            [apply_rope_interleaved(a[..., :r], positions, inv_freq, scale), a[..., r:]], axis=-1)
        q, k = rope(q), rope(k)
        # weights_proj reads the hidden states in float32 (transformers keeps that module in float32)
        w = dense(c.index_n_heads, "weights_proj", jnp.float32)(x.astype(jnp.float32))
        return q, k[:, :, 0], w * (c.index_n_heads ** -0.5)


# Above this many per-head scores (``B * T * H_I * S``) the heads are summed one at a time: a prefill chunk of 512
# tokens against 128k slots with GLM-5's 32 indexer heads would otherwise hold 8.6 GB of float32 per row.
PER_HEAD_SCORES = 1 << 26


def index_scores(q: jax.Array, w: jax.Array, keys: jax.Array, per_head_above: int = PER_HEAD_SCORES) -> jax.Array:
    """``score [B, T, S]`` of queries ``q [B, T, H_I, D_I]`` (head weights ``w [B, T, H_I]``) against ``keys [B, S,
    D_I]`` (or the cache's ``[B, 1, S, D_I]``): ``sum_h w[h] * relu(q[h] . k * D_I^-0.5)`` in float32. The ReLU
    sits between the dot and the head sum, so the heads cannot be folded into one product: past
    ``per_head_above`` per-head scores they are accumulated head by head (``[B, T, S]`` live, not ``H_I`` of it)."""
    if keys.ndim == 4:
        keys = keys[:, 0]
    b, t, h, d = q.shape
    q, w, keys = q.astype(jnp.float32), w.astype(jnp.float32), keys.astype(jnp.float32)
    if b * t * h * keys.shape[1] <= per_head_above:
        dots = jnp.einsum("bthd,bsd->bths", q, keys, preferred_element_type=jnp.float32)
        return jnp.einsum("bth,bths->bts", w, jax.nn.relu(dots * (d ** -0.5)))

    def one_head(total, head):
        qh, wh = head  # [B, T, D_I], [B, T]
        dots = jnp.einsum("btd,bsd->bts", qh, keys, preferred_element_type=jnp.float32)
        return total + wh[..., None] * jax.nn.relu(dots * (d ** -0.5)), None

    total, _ = jax.lax.scan(one_head, jnp.zeros((b, t, keys.shape[1]), jnp.float32),
                            (q.transpose(2, 0, 1, 3), w.transpose(2, 0, 1)))
    return total


def select_topk(scores: jax.Array, visible: jax.Array, topk: int) -> jax.Array:
    """The keys each query keeps, ``[B, T, S]`` bool: the ``topk`` highest ``scores`` among its ``visible`` keys
    (all of them when it sees at most ``topk``). Exactly ``min(topk, visible)`` per query; among equal scores at
    the boundary the lower slot wins (``lax.top_k``'s order), the same rule in prefill, verify and step.
    Exact ties are common with few indexer heads: a key whose dot product is <= 0 for every head scores exactly
    0 after the ReLU (about 2^-heads of the keys), and with negative head weights 0 is often the top score.
    DeepSeek's reference and transformers (``torch.topk``) leave that order undefined; on CPU torch orders ties
    by the row's length and contents, so transformers' own cached decode and fresh forward disagree there
    (issue 53: parity with it holds up to these ties)."""
    s = scores.shape[-1]
    if topk >= s:  # nothing to drop: every visible key is kept
        return visible
    masked = jnp.where(visible, scores, -jnp.inf)
    _, idx = jax.lax.top_k(masked, topk)  # [B, T, k]; invisible keys only where fewer than k are visible
    b, t = scores.shape[:2]
    chosen = jnp.zeros(scores.shape, bool).at[
        jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], idx].set(True)
    return chosen & visible


def select_mask(mask: jax.Array | Callable[[jax.Array], jax.Array], selected: jax.Array):
    """The attention's visibility with the indexer's ``selected [B, T, S]`` in place of ``mask`` (which it
    implies: ``select_topk`` keeps visible keys only), in the form the caller gave: an array ``[B, T, S]`` (no
    cache), or, for a cache, the callable ``visible(key_slots [C]) -> [B, T, C]`` that ``layers.cache_attention``
    asks chunk by chunk."""
    if callable(mask):
        return lambda key_slots: jnp.take(selected, key_slots, axis=2)
    return selected


def visible_slots(mask: jax.Array | Callable[[jax.Array], jax.Array], num_keys: int) -> jax.Array:
    """``mask`` over all ``num_keys`` keys as one ``[B, T, S]`` array (the callable form evaluated at every slot)."""
    return mask(jnp.arange(num_keys, dtype=jnp.int32)) if callable(mask) else mask


def write_keys(cache: jax.Array, keys: jax.Array, slots: jax.Array) -> jax.Array:
    """Write indexer keys ``[B, T, D_I]`` into their cache ``[B, 1, S, D_I]`` at ``slots [B, T]`` (the latent's
    slots; out-of-range slots, padding, are dropped)."""
    return write_rows(cache, keys[:, :, None, :], slots)


def dsa_selection(config: DSAConfig, layer: int, indexer: Indexer | None, x, q_resid, positions, inv_freq,
                  scale, mask, cache_keys=None, slots=None, previous=None):
    """One DSA layer's selection: ``(selected [B, T, S], new indexer-key cache or None)``.

    A full layer (``indexer`` given) scores the keys it may see: with ``cache_keys [B, 1, S, D_I]`` the block's
    keys are written at ``slots`` first and every slot is scored (``mask`` is then the cache's callable), else
    the block's own keys (``mask [B, T, T]``). A shared layer returns ``previous``, the last full layer's."""
    if not config.is_full(layer):
        if previous is None:
            raise ValueError(f"DSA layer {layer} is shared but no full layer ran before it")
        return previous, None
    q, k, w = indexer(x, q_resid, positions, inv_freq, scale)
    if cache_keys is not None:
        cache_keys = write_keys(cache_keys, k, slots)
        keys = cache_keys
    else:
        keys = k
    visible = visible_slots(mask, keys.shape[-2])
    if config.index_topk >= keys.shape[-2]:  # no query can see more keys than it keeps: nothing to score
        return visible, cache_keys
    return select_topk(index_scores(q, w, keys), visible, config.index_topk), cache_keys


def layer_schedule_from(types: Sequence[str]) -> str:
    """``layer_types`` as transformers' ``index_topk_pattern`` string (``F``/``S``), for logs and exports."""
    return "".join("F" if kind == FULL else "S" for kind in types)


__all__ = ["DSAConfig", "FULL", "SHARED", "Indexer", "IndexerLayerNorm", "dsa_selection", "index_scores",
           "indexer_layer_types", "layer_schedule_from", "select_mask", "select_topk", "visible_slots",
           "write_keys"]
