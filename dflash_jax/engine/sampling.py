"""Token selection and speculative acceptance (SPEC section 5, step 4).

Greedy acceptance keeps the longest prefix of draft tokens equal to the target's argmax. Sampling acceptance
is lossless rejection sampling: with the same temperature/top-k/top-p applied to both the target
distribution ``p`` and the draft distribution ``q``, draft token ``d`` is kept when ``u * q(d) < p(d)``; the
first rejected slot is resampled from ``normalise(max(p - q, 0))``, so committed tokens are distributed
exactly as the target's own samples.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dflash_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """``temperature == 0`` means greedy. ``top_k == 0`` and ``top_p == 1`` disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not math.isfinite(self.temperature) or not math.isfinite(self.top_p):
            raise UserError(f"temperature and top_p must be finite numbers, got {self.temperature}, {self.top_p}")
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """The sampling distribution over the last axis after temperature, top-k and top-p (float32). Neither
    filter sorts the vocabulary (152k entries for Qwen3, at every block position): top-k is ``lax.top_k``'s
    k-th value, top-p a threshold search (``top_p_keep``)."""
    x = logits.astype(jnp.float32) / max(cfg.temperature, 1e-6)
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, cfg.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    probs = jax.nn.softmax(x, axis=-1)
    if cfg.top_p < 1.0:
        probs = jnp.where(top_p_keep(probs, cfg.top_p), probs, 0.0)
        probs = probs / probs.sum(-1, keepdims=True)
    return probs


def top_p_keep(probs: jax.Array, top_p: float) -> jax.Array:
    """Nucleus filter without a sort: keep the most probable tokens until their mass reaches ``top_p`` (the
    token crossing it stays), i.e. every token with ``p >= t*`` where ``t*`` is the LARGEST ``t`` whose mass
    ``sum(p[p >= t])`` still reaches ``top_p``. ``t*`` is one of the probabilities, found exactly by binary
    search over the bit patterns of the non-negative float32 values (ordered like the values): 32 masked
    sums over the vocabulary instead of an O(V log V) sort and a scatter. Tokens tied with ``t*`` are all kept
    (a sort would keep an arbitrary subset of them)."""
    bits = jax.lax.bitcast_convert_type(probs.astype(jnp.float32), jnp.int32)
    lo = jnp.zeros(probs.shape[:-1] + (1,), jnp.int32)  # mass(p >= 0) = 1 >= top_p
    hi = jnp.max(bits, axis=-1, keepdims=True) + 1  # mass(p > max) = 0 < top_p

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        enough = jnp.sum(jnp.where(bits >= mid, probs, 0.0), axis=-1, keepdims=True) >= top_p
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))  # 2**31 patterns: 31 halvings close the gap
    return bits >= lo


def argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` (the first index of the maximum) as two plain reductions, max then min index.
    XLA:CPU runs argmax's paired (value, index) reduction as scalar code: about 2.3 us per 512-wide row on the
    development CPU, 70 us of a 440 us stories260K DFlash round at block 16 (draft and verify argmaxes).
    A row holding NaN gives the last index (it has no maximum)."""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    first = jnp.min(jnp.where(x == top, index, x.shape[-1]), axis=-1)
    return jnp.minimum(first, x.shape[-1] - 1)


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    return jax.random.categorical(key, jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf))


def select(key: jax.Array, logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """One token per row from ``logits [..., V]``: argmax when greedy, else a sample."""
    if cfg.greedy:
        return argmax(logits)
    return sample(key, probabilities(logits, cfg)).astype(jnp.int32)


class Acceptance(NamedTuple):
    num_accepted: jax.Array  # [B] draft tokens kept, 0..K
    next_token: jax.Array  # [B] the target's own token after them (bonus or resampled replacement)


def within(limit: jax.Array | None, k: int) -> jax.Array | bool:
    """``[B, K]``: the draft positions below each row's ``limit [B]`` (True everywhere without one)."""
    return True if limit is None else jnp.arange(k)[None] < limit[:, None]


def accept_greedy(draft_tokens: jax.Array, target_logits: jax.Array, limit: jax.Array | None = None) -> Acceptance:
    """``draft_tokens [B, K]``; ``target_logits [B, K + 1, V]`` where position k predicts draft token k.
    ``limit [B]``: at most this many drafts per row may be accepted (a proposer's verify cut)."""
    target_tokens = argmax(target_logits)
    matches = (draft_tokens == target_tokens[:, :-1]) & within(limit, draft_tokens.shape[1])
    num = jnp.sum(jnp.cumprod(matches.astype(jnp.int32), axis=1), axis=1)
    bonus = jnp.take_along_axis(target_tokens, num[:, None], axis=1)[:, 0]
    return Acceptance(num.astype(jnp.int32), bonus)


def accept_sampling(
    key: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array, target_logits: jax.Array, cfg: SamplingConfig,
    limit: jax.Array | None = None,
) -> Acceptance:
    """Lossless rejection sampling. ``draft_probs [B, K, V]`` is the distribution each draft token was drawn
    from (already processed with ``cfg``); ``target_logits [B, K + 1, V]``. ``limit [B]``: only the first
    ``limit`` drafts of a row are judged; when all of them pass, the next token is drawn from ``p`` at the
    cut (as the bonus of a block that ended there: the draft's q counts as zero past the cut)."""
    p = probabilities(target_logits, cfg)
    b, k = draft_tokens.shape
    if limit is not None:
        draft_probs = jnp.where(within(limit, k)[..., None], draft_probs, 0.0)
    key_u, key_r = jax.random.split(key)
    p_d = jnp.take_along_axis(p[:, :k], draft_tokens[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(key_u, (b, k))
    accepted = (u * q_d < p_d) & within(limit, k)
    num = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1)
    # Residual at the first rejected slot; when every draft is accepted, q is zero there and the residual is
    # just p at the last position (the bonus distribution).
    q_pad = jnp.concatenate([draft_probs, jnp.zeros_like(p[:, :1])], axis=1)
    p_at = jnp.take_along_axis(p, num[:, None, None], axis=1)[:, 0]
    q_at = jnp.take_along_axis(q_pad, num[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_at - q_at, 0.0)
    mass = residual.sum(-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.maximum(mass, 1e-38), p_at)
    return Acceptance(num.astype(jnp.int32), sample(key_r, residual).astype(jnp.int32))


def accept_block(
    key: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array, target_logits: jax.Array, cfg: SamplingConfig
) -> Acceptance:
    """Lossless block verification (Sun et al., arXiv 2403.10444, Algorithm 2; SPEC 12.4): the same arguments
    and result as ``accept_sampling``, but the block is judged as a whole, never accepting fewer tokens in
    expectation than token-wise rejection. With ``p_j, q_j`` the target's and the draft's distributions at
    draft position ``j`` (``X_j ~ q_j`` given the drafts before it)::

        a_0 = 1,  a_j = min(1, a_{j-1} p_j(X_j) / q_j(X_j))
        rho_j = sum_x max(a_j p_{j+1}(x) - q_{j+1}(x), 0),  h_j = rho_j / (rho_j + 1 - a_j)  (j < K),  h_K = a_K
        tau = the largest j with eta_j <= h_j (eta_j iid uniform; h_0 = 1), keep X_1 .. X_tau
        next token ~ normalise(max(a_tau p_{tau+1} - q_{tau+1}, 0))   (q_{K+1} = 0: p's bonus)

    Where ``q`` is a point mass (greedy drafts, the oracle) its acceptance has the same distribution as
    ``accept_sampling``'s; it pays for sampled chains (a DFlash2 selector's T > 0 walk, a DFlash draft sampled
    from its marginals)."""
    p = probabilities(target_logits, cfg)
    b, k = draft_tokens.shape
    key_u, key_r = jax.random.split(key)
    p_d = jnp.take_along_axis(p[:, :k], draft_tokens[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
    ratio = p_d / jnp.maximum(q_d, 1e-38)  # q_d > 0: X_j was drawn from q_j
    weights = [jnp.ones((b,), jnp.float32)]
    for j in range(k):  # a static K (the block): a_j = min(1, a_{j-1} p_j(X_j) / q_j(X_j))
        weights.append(jnp.minimum(1.0, weights[-1] * ratio[:, j]))
    a = jnp.stack(weights, axis=1)  # [B, K + 1]
    rho = jnp.sum(jnp.maximum(a[:, :k, None] * p[:, :k] - draft_probs, 0.0), axis=-1)  # [B, K]
    denominator = rho + 1.0 - a[:, :k]
    # rho = 0 with a = 1 (q equal to p there) cannot stop the block at j: a later position always qualifies
    # then (h = a = 1 at the end), so h = 0 is the right limit and keeps the residual below non-empty.
    h = jnp.concatenate([jnp.where(denominator > 1e-12, rho / jnp.maximum(denominator, 1e-12), 0.0), a[:, k:]], axis=1)
    eta = jax.random.uniform(key_u, (b, k + 1))
    index = jnp.arange(k + 1, dtype=jnp.int32)[None]
    num = jnp.max(jnp.where((eta <= h) | (index == 0), index, 0), axis=1)
    q_pad = jnp.concatenate([draft_probs, jnp.zeros_like(p[:, :1])], axis=1)
    p_at = jnp.take_along_axis(p, num[:, None, None], axis=1)[:, 0]
    q_at = jnp.take_along_axis(q_pad, num[:, None, None], axis=1)[:, 0]
    a_at = jnp.take_along_axis(a, num[:, None], axis=1)
    residual = jnp.maximum(a_at * p_at - q_at, 0.0)
    mass = residual.sum(-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.maximum(mass, 1e-38), p_at)
    return Acceptance(num.astype(jnp.int32), sample(key_r, residual).astype(jnp.int32))
