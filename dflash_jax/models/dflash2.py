"""The two pieces a DFlash2 draft adds to a DFlash draft (SPEC section 10): block convolutions and a selector.

* ``BlockConv``: a grouped dynamic causal convolution along the BLOCK's token axis (never the context; zero
  padding before block position 0, nothing carried between blocks). Each layer has two, one around the
  attention and one around the MLP. Both halves of one take their dynamic kernels from the same normed input:
  ``prepare`` convolves that input with the first half (what attention / the MLP then reads), ``finish``
  convolves the sublayer's output with the second half.
* ``CandidateSelector``: the block is one chain of the draft's top-k candidates per position, chosen left to
  right with a low-rank pairwise score between the chosen predecessor and each candidate. Greedy decoding
  takes the best score, sampling draws from ``softmax(score / T)`` over the k candidates.

Both are written for any leading axes, so the inference forward (``[B, T]``) and the packed training
forward (``[N, A*B]``, cut into blocks of ``block``) share them.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


def grouped_dynamic_conv(x: jax.Array, dynamic: jax.Array, base: jax.Array, group_size: int, block: int) -> jax.Array:
    """``y_t[g, c] = sum_{o < K} (base[o, g*gs + c] + dynamic_t[o, g]) * x_{t-o}[g, c]`` inside each block.

    ``x [..., T, H]`` with ``T`` a multiple of ``block`` (consecutive blocks of ``block`` tokens), ``dynamic
    [..., T, K, G]`` (the kernel at the OUTPUT position t), ``base [K, H]``; ``x_{t-o}`` is zero before a
    block's first token. Computed in ``x``'s dtype, as the official code does.
    """
    *lead, t, h = x.shape
    k, groups = dynamic.shape[-2:]
    xb = x.reshape(*lead, t // block, block, groups, group_size)
    db = dynamic.reshape(*lead, t // block, block, k, groups)
    out = jnp.zeros_like(xb)
    for o in range(k):  # K is tiny (2 in the released drafts)
        shifted = xb if o == 0 else jnp.pad(xb[..., :-o, :, :], [(0, 0)] * (xb.ndim - 3) + [(o, 0), (0, 0), (0, 0)])
        kernel = base[o].reshape(groups, group_size).astype(x.dtype) + db[..., o, :, None].astype(x.dtype)
        out = out + kernel * shifted
    return out.reshape(x.shape)


class BlockConv(nn.Module):
    """Params (official keys): ``base_kernel [2, K, H]``, ``kernel_projection`` (``[H, 2*K*G]``, no bias)."""

    hidden_size: int
    kernel_size: int
    group_size: int
    dtype: Any = jnp.float32

    def setup(self):
        groups = self.hidden_size // self.group_size
        self.base_kernel = self.param("base_kernel", identity_conv_init, (2, self.kernel_size, self.hidden_size),
                                      self.dtype)
        self.kernel_projection = nn.Dense(2 * self.kernel_size * groups, use_bias=False, dtype=self.dtype,
                                          param_dtype=self.dtype)

    def prepare(self, h: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
        """``h [..., T, H]`` -> (its convolution by the first half, the second half's dynamic kernels)."""
        groups = self.hidden_size // self.group_size
        dynamic = self.kernel_projection(h).reshape(*h.shape[:-1], 2, self.kernel_size, groups)
        first = grouped_dynamic_conv(h, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size, block)
        return first, dynamic[..., 1, :, :]

    def finish(self, y: jax.Array, dynamic: jax.Array, block: int) -> jax.Array:
        return grouped_dynamic_conv(y, dynamic, self.base_kernel[1], self.group_size, block)


def identity_conv_init(key, shape, dtype):
    """A new draft's convolutions start as the identity (1 at offset 0, 0 before): a new DFlash2 draft starts
    as a DFlash draft, and its dynamic kernels (from a small random projection) grow from there."""
    del key
    return jnp.zeros(shape, dtype).at[:, 0, :].set(1.0)


class CandidateSelector(nn.Module):
    """Params (official keys): ``predecessor_codebook [V, r]``, ``successor_codebook [V, r]`` (stored without
    ``.weight``), ``hidden_projection`` (``[H, r]``, no bias)."""

    vocab_size: int
    rank: int
    top_k: int
    dtype: Any = jnp.float32

    def setup(self):
        init = nn.initializers.normal(0.02)
        self.predecessor_codebook = self.param("predecessor_codebook", init, (self.vocab_size, self.rank), self.dtype)
        self.successor_codebook = self.param("successor_codebook", init, (self.vocab_size, self.rank), self.dtype)
        self.hidden_projection = nn.Dense(self.rank, use_bias=False, dtype=self.dtype, param_dtype=self.dtype)

    def project(self, hidden: jax.Array) -> jax.Array:
        """The final-normed draft hidden states ``[..., H]`` -> ``[..., r]``."""
        return self.hidden_projection(hidden)

    def scores(self, unary: jax.Array, candidates: jax.Array, projected: jax.Array,
               predecessor: jax.Array) -> jax.Array:
        return pair_scores(self.predecessor_codebook, successor_codes(self.successor_codebook, candidates), unary,
                           projected, predecessor)

    def teacher_forced(self, logits: jax.Array, hidden: jax.Array, predecessors: jax.Array,
                       labels: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Training (no published recipe; docs/training.md says why this one): at every mask position, the
        selector's cross-entropy over its candidates given the TRUE predecessor (the anchor, then the previous
        label), the true token added as one more candidate when the draft's top-k misses it (else the label
        could never be learnt and the selector would learn nothing at the positions that matter most).
        ``logits [..., V]``, ``hidden [..., H]`` (final-normed), ``predecessors, labels [...]``. Returns the
        cross-entropy and whether inference, given that predecessor, would pick the label (both ``[...]``).
        The candidates are chosen without gradient; their logits keep it, as the unary scores at inference."""
        _, candidates = top_candidates(jax.lax.stop_gradient(logits), self.top_k)
        labels = labels.astype(candidates.dtype)
        hit = candidates == labels[..., None]
        missing = ~jnp.any(hit, axis=-1)
        extended = jnp.concatenate([candidates, labels[..., None]], axis=-1)
        unary = jnp.take_along_axis(logits, extended, axis=-1)
        scores = self.scores(unary, extended, self.project(hidden), predecessors)
        label_score = scores[..., -1]  # the label's score, whether or not it is among the candidates
        pool = jnp.where(jnp.concatenate([jnp.ones_like(hit), missing[..., None]], axis=-1), scores, -jnp.inf)
        ce = jax.nn.logsumexp(pool, axis=-1) - label_score
        picked = jnp.take_along_axis(candidates, jnp.argmax(scores[..., :-1], axis=-1)[..., None], axis=-1)[..., 0]
        return ce, picked == labels


def successor_codes(successor_codebook: jax.Array, candidates: jax.Array) -> jax.Array:
    """The candidates' successor codes ``[..., C, r]`` in float32 (token ids are in range by construction:
    ``mode="clip"`` spares the out-of-range fill that ``take`` would otherwise compute and select)."""
    return jnp.take(successor_codebook, candidates, axis=0, mode="clip").astype(jnp.float32)


def pair_scores(predecessor_codebook: jax.Array, successors: jax.Array, unary: jax.Array, projected: jax.Array,
                predecessor: jax.Array) -> jax.Array:
    """``unary + sum_r pred_code[predecessor]_r * projected_r * succ_code[candidate]_r`` in float32.
    ``unary [..., C]``; ``successors [..., C, r]`` (``successor_codes``); ``projected [..., r]``;
    ``predecessor [...]``."""
    pred = jnp.take(predecessor_codebook, predecessor, axis=0, mode="clip").astype(jnp.float32)
    pair = jnp.einsum("...r,...cr->...c", pred * projected.astype(jnp.float32), successors)
    return unary.astype(jnp.float32) + pair


def top_candidates(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The draft's ``k`` best tokens per position and their logits (the selector's unary scores)."""
    return jax.lax.top_k(logits.astype(jnp.float32), k)


def select_chain(selector: CandidateSelector, logits: jax.Array, hidden: jax.Array, anchor: jax.Array,
                 temperature: float = 0.0, key: jax.Array | None = None):
    """Inside ``apply``: walk the block left to right from ``anchor [B]``.

    ``logits [B, K, V]`` and ``hidden [B, K, H]`` (final-normed) of the mask positions. Returns ``tokens
    [B, K]`` and, when sampling (``temperature > 0``), ``probs [B, K, V]``: the selector's distribution over
    each position's candidates placed at their vocabulary ids (0 elsewhere; the candidates are distinct), so
    lossless verification treats it as any draft distribution: ``q(d)`` is the drafted candidate's
    probability, and the residual ``max(p - q, 0)`` subtracts it at the candidates only.
    """
    unary, candidates = top_candidates(logits, selector.top_k)
    projected = selector.project(hidden)
    # Only the predecessor depends on the chain: the candidates' successor codes are gathered once for the
    # whole block (in the scan's position-major order), so a step of the scan reads one codebook row.
    steps = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731 ([B, K, ...] -> [K, B, ...])
    successors = successor_codes(selector.successor_codebook, steps(candidates))
    predecessor_codebook = selector.predecessor_codebook  # a plain array inside the scan
    sampling = temperature > 0
    keys = jax.random.split(key, logits.shape[1]) if sampling else jnp.zeros((logits.shape[1], 2), jnp.uint32)

    def step(predecessor, xs):
        u, c, succ, p, k = xs
        s = pair_scores(predecessor_codebook, succ, u, p, predecessor)
        if not sampling:  # greedy rounds carry no distributions through the scan
            token = jnp.take_along_axis(c, jnp.argmax(s, axis=-1)[:, None], axis=1)[:, 0]
            return token, (token, None)
        index = jax.random.categorical(k, s / temperature, axis=-1)
        token = jnp.take_along_axis(c, index[:, None], axis=1)[:, 0]
        return token, (token, jax.nn.softmax(s / temperature, axis=-1))

    xs = (steps(unary), steps(candidates), successors, steps(projected), keys)
    _, (tokens, q) = jax.lax.scan(step, anchor.astype(jnp.int32), xs)
    tokens = jnp.moveaxis(tokens, 0, 1)
    if not sampling:
        return tokens, None
    q = jnp.moveaxis(q, 0, 1)  # [B, K, k]
    probs = jnp.put_along_axis(jnp.zeros(logits.shape, jnp.float32), candidates, q, axis=-1, inplace=False)
    return tokens, probs


def select_transitions(selector: CandidateSelector, logits: jax.Array, hidden: jax.Array, anchor: jax.Array,
                       k: int) -> tuple[jax.Array, jax.Array]:
    """For a tree over the selector's choices (SPEC 12.1.3; inside ``apply``): each mask position's first ``k``
    of the selector's candidates ``tokens [B, K, k]`` and ``transitions [B, K, k, k]``, the selector's
    log-softmax over a position's candidates given each candidate of the position before as predecessor
    (position 0: given the anchor, in every row). The selector's greedy chain follows each row's argmax."""
    unary, candidates = top_candidates(logits, selector.top_k)
    unary, candidates = unary[..., :k], candidates[..., :k]
    b = candidates.shape[0]
    successors = successor_codes(selector.successor_codebook, candidates)  # [B, K, k, r]
    predecessors = jnp.concatenate([jnp.broadcast_to(anchor.astype(candidates.dtype)[:, None, None], (b, 1, k)),
                                    candidates[:, :-1]], axis=1)  # [B, K, k]: row j of position d = candidate j of d-1
    # pair_scores for every (predecessor, candidate) pair of a position at once: one [k, r] x [r, k] product
    # per row and position (broadcasting pair_scores' operands instead made XLA:CPU loop over every pair row).
    pred = jnp.take(selector.predecessor_codebook, predecessors, axis=0, mode="clip").astype(jnp.float32)
    pred = pred * selector.project(hidden).astype(jnp.float32)[:, :, None, :]
    scores = unary.astype(jnp.float32)[:, :, None, :] + jnp.einsum("bdpr,bdcr->bdpc", pred, successors)
    return candidates, jax.nn.log_softmax(scores, axis=-1)
