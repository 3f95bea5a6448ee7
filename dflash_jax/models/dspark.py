"""The two heads a DSpark draft puts on the DFlash backbone (DeepSeek's DeepSpec, SPEC section 13).

* ``MarkovHead``: a low-rank bigram correction of each block position's logits by the token drafted just
  before it, ``logits_k = base_k + w2(w1[x_{k-1}])`` (``x_{-1}`` = the anchor). The backbone drafts the whole
  block in one pass; this head adds the dependency between neighbouring drafts at the cost of ``B`` tiny
  sequential steps (``markov_chain``: a ``lax.scan`` inside the jitted round). The "gated" kind scales the
  previous token's code by ``sigmoid(gate_proj([h_k ; w1[x_{k-1}]]))`` first.
* ``ConfidenceHead``: ``Linear(H (+ r) -> 1)`` on ``[h_k ; w1[x_{k-1}]]``; its sigmoid predicts whether block
  position ``k`` will be accepted, and a threshold on it cuts a row's verify (``markov_chain``'s
  ``confident_prefix``).

``h_k`` is the backbone's final-normed hidden state of block position ``k`` (what the head's logits come from).
Both heads are written for any leading axes, so the inference round and the packed training forward share them.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp


class MarkovWeights(NamedTuple):
    """A Markov head's params as plain arrays (what the chain's ``lax.scan`` reads; Flax modules cannot be
    called inside it)."""

    w1: jax.Array  # [V, r]
    w2: jax.Array  # [r, V]
    gate_kernel: jax.Array | None = None  # [H + r, r] (gated kind)
    gate_bias: jax.Array | None = None  # [r]


def markov_bias(weights: MarkovWeights, previous: jax.Array, hidden: jax.Array) -> jax.Array:
    """The correction ``[..., V]`` (float32) added to the logits of positions whose previous token is
    ``previous [...]``; ``hidden [..., H]`` is read by the gated kind only."""
    code = jnp.take(weights.w1, previous, axis=0, mode="clip")
    if weights.gate_kernel is not None:
        gate_in = jnp.concatenate([hidden.astype(code.dtype), code], axis=-1)
        code = jax.nn.sigmoid(gate_in @ weights.gate_kernel.astype(code.dtype) + weights.gate_bias) * code
    return jnp.matmul(code, weights.w2.astype(code.dtype), preferred_element_type=jnp.float32)


class MarkovHead(nn.Module):
    """Params (DeepSpec keys under ``markov_head.``): ``markov_w1`` (Embedding ``[V, r]``), ``markov_w2`` (``[r, V]``,
    stored ``[V, r]``, no bias) and, for the gated kind, ``gate_proj`` (``[H + r, r]`` with bias)."""

    vocab_size: int
    rank: int
    kind: str = "vanilla"
    dtype: Any = jnp.float32

    def setup(self):
        self.markov_w1 = nn.Embed(self.vocab_size, self.rank, dtype=self.dtype, param_dtype=self.dtype,
                                  embedding_init=nn.initializers.normal(1.0))
        self.markov_w2 = nn.Dense(self.vocab_size, use_bias=False, dtype=self.dtype, param_dtype=self.dtype)
        self.gate_proj = (nn.Dense(self.rank, dtype=self.dtype, param_dtype=self.dtype) if self.kind == "gated"
                          else None)

    def codes(self, previous: jax.Array) -> jax.Array:
        """``w1[x_{k-1}]`` ``[..., r]`` (what the confidence head also reads)."""
        return self.markov_w1(previous)

    def __call__(self, previous: jax.Array, hidden: jax.Array) -> jax.Array:
        """``markov_bias`` through the modules (training, and creating the params at init)."""
        code = self.codes(previous)
        if self.gate_proj is not None:
            code = jax.nn.sigmoid(self.gate_proj(jnp.concatenate([hidden.astype(code.dtype), code], axis=-1))) * code
        return self.markov_w2(code).astype(jnp.float32)

    def weights(self) -> MarkovWeights:
        params = self.variables["params"]
        gate = params.get("gate_proj")
        return MarkovWeights(params["markov_w1"]["embedding"], params["markov_w2"]["kernel"],
                             None if gate is None else gate["kernel"], None if gate is None else gate["bias"])


class ConfidenceHead(nn.Module):
    """Params (DeepSpec keys ``confidence_head.proj.{weight,bias}``): ``proj`` ``[in, 1]`` with bias."""

    dtype: Any = jnp.float32

    def setup(self):
        self.proj = nn.Dense(1, dtype=self.dtype, param_dtype=self.dtype)

    def __call__(self, features: jax.Array) -> jax.Array:
        """Confidence logits ``[...]`` (float32) of features ``[..., in]``."""
        return self.proj(features)[..., 0].astype(jnp.float32)


class Chain(NamedTuple):
    tokens: jax.Array  # [B, K] drafted tokens
    probs: jax.Array | None  # [B, K, V] the distributions they were drawn from (sampling), else None
    confidence: jax.Array | None  # [B, K] confidence logits (None without a confidence head)


# ``choose(logits [B, V], key) -> (tokens [B], probs [B, V] | None)``: how one position's token is picked from its
# corrected logits (the engine's greedy argmax, or a sample at the decode's temperature / top-k / top-p).
Choose = Callable[[jax.Array, jax.Array], tuple[jax.Array, Any]]


def markov_chain(markov: MarkovWeights | None, confidence: Callable[[jax.Array], jax.Array] | None,
                 with_markov: bool, logits: jax.Array, hidden: jax.Array, anchor: jax.Array, choose: Choose,
                 key: jax.Array | None) -> Chain:
    """Inside ``apply``: draft the block left to right. ``logits [B, K, V]`` are the backbone's (base) logits of
    the ``K`` block positions and ``hidden [B, K, H]`` their final-normed states; position ``k``'s token is
    ``choose``n from ``logits_k + markov(x_{k-1})`` with ``x_{-1} = anchor [B]``. Without a Markov head every
    position is chosen from its base logits (one step, no scan). Then the confidence logits of every position
    from ``[h_k ; w1[x_{k-1}]]`` (or ``h_k`` alone)."""
    k = logits.shape[1]
    keys = jax.random.split(key, k) if key is not None else jnp.zeros((k, 2), jnp.uint32)
    if markov is None:
        flat = logits.reshape(-1, logits.shape[-1])
        tokens, probs = choose(flat, None if key is None else keys[0])
        tokens = tokens.reshape(logits.shape[:2])
        probs = None if probs is None else probs.reshape(logits.shape)
    else:
        steps = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731 ([B, K, ...] -> [K, B, ...])

        def step(previous, xs):
            base, h, step_key = xs
            token, probs = choose(base.astype(jnp.float32) + markov_bias(markov, previous, h),
                                  None if key is None else step_key)
            token = token.astype(jnp.int32)
            return token, (token, probs)

        _, (tokens, probs) = jax.lax.scan(step, anchor.astype(jnp.int32), (steps(logits), steps(hidden), keys))
        tokens = jnp.moveaxis(tokens, 0, 1)
        probs = None if probs is None else jnp.moveaxis(probs, 0, 1)
    conf = None
    if confidence is not None:
        conf = confidence(confidence_features(markov if with_markov else None, hidden,
                                              previous_tokens(anchor, tokens)))
    return Chain(tokens.astype(jnp.int32), probs, conf)


def confidence_features(markov: MarkovWeights | None, hidden: jax.Array, previous: jax.Array) -> jax.Array:
    """``[h_k ; w1[x_{k-1}]]`` (or ``h_k`` when the confidence head reads no Markov code)."""
    if markov is None:
        return hidden
    code = jnp.take(markov.w1, previous, axis=0, mode="clip")
    return jnp.concatenate([hidden, code.astype(hidden.dtype)], axis=-1)


def previous_tokens(anchor: jax.Array, tokens: jax.Array) -> jax.Array:
    """``[anchor, x_0 .. x_{K-2}]``: the token before each block position."""
    return jnp.concatenate([anchor[..., None].astype(tokens.dtype), tokens[..., :-1]], axis=-1)


def confident_prefix(confidence: jax.Array, threshold: float) -> jax.Array:
    """How many drafts a row verifies: the index of the first position whose sigmoid is below ``threshold``
    (all ``K`` when none is; threshold 0 verifies the whole block), as DeepSpec's evaluator cuts. ``[B]`` int32."""
    k = confidence.shape[-1]
    if threshold <= 0:
        return jnp.full(confidence.shape[:-1], k, jnp.int32)
    below = jax.nn.sigmoid(confidence) < threshold
    return jnp.where(jnp.any(below, axis=-1), jnp.argmax(below, axis=-1), k).astype(jnp.int32)
