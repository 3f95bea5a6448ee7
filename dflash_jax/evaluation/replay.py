"""Replaying width policies offline: what adaptive block size gains, and what any policy could gain.

Greedy decoding commits the same text whichever widths the rounds verify, and a round anchored at a given
position proposes the same drafts whatever came before (the draft sees the verified text's target features
and the anchor token). So one teacher-forced pass gives, for EVERY position of an answer, how many drafts a
round anchored there would accept (``teacher_forced_acceptance``: the training forward, no caches). Any
schedule of widths can then be replayed exactly in tokens, with time from per-round costs:

- ``replay_fixed``: every round verifies the whole block (DFlash as in the paper);
- ``replay_adaptive``: the engine's own policy functions (``engine/adaptive.py``) driven round by round as the
  decode loop drives them, so the widths equal the engine's (batch 1; tested);
- ``replay_oracle``: the cheapest schedule knowing every round's acceptance in advance (dynamic programming),
  an upper bound for any policy over these widths.

Costs are per round, relative to an autoregressive round; phase bookkeeping and the gap between an
autoregressive round and a baseline step are left out, so the replay isolates the choice itself. Used by
``python -m infer bench --replay`` (docs/architecture.md, "Adaptive block size").
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.engine import adaptive
from dflash_jax.engine.generate import bucket, to_host
from dflash_jax.models.config import TargetConfig
from dflash_jax.models.draft import DraftModel, shared_head
from dflash_jax.models.draft_config import DraftConfig
from dflash_jax.models.target import TargetModel
from dflash_jax.errors import UserError
from dflash_jax.training.forward import draft_training_proposals
from dflash_jax.training.step import target_features


# Anchors per draft forward: the logits of a chunk ([chunk, block, vocab], float32) stay ~0.3 GB for a
# 152k vocabulary and a block of 16, whatever the answer's length.
ANCHOR_CHUNK = 32


@functools.lru_cache(maxsize=8)
def _teacher_forced_fns(target_config: TargetConfig, draft_config: DraftConfig, block: int, dtype):
    target, draft = TargetModel(target_config, dtype), DraftModel(draft_config, dtype)

    @jax.jit
    def features(target_params, tokens, length):
        return target_features(target, target_params, {"tokens": tokens, "lengths": length},
                               draft_config.target_layer_ids)

    @jax.jit
    def proposals(target_params, draft_params, features, tokens, anchors, valid):
        block_tokens = jnp.full(anchors.shape + (block,), draft_config.mask_token_id, jnp.int32)
        block_tokens = block_tokens.at[..., 0].set(jnp.take_along_axis(tokens, anchors, axis=1))
        return draft_training_proposals(draft, draft_params, features, block_tokens,
                                        anchors[..., None] + jnp.arange(block), valid,
                                        shared_head(target_params, target_config.tie_word_embeddings))[0]

    return features, proposals


def teacher_forced_acceptance(target_config: TargetConfig, target_params: dict, draft_config: DraftConfig,
                              draft_params: dict, prompt: Sequence[int], answer: Sequence[int],
                              block: int, dtype=jnp.float32) -> np.ndarray:
    """``[len(answer)]``: drafts a greedy round anchored at ``answer[i]`` would accept (0 .. block - 1),
    compared with the answer itself (positions past its end count as rejections). The target runs once over
    the whole text; the draft over chunks of ANCHOR_CHUNK anchors; the text is padded to a power of two so
    that a set of answers compiles a few programs, not one each."""
    if draft_config.dspark:
        raise UserError("teacher-forced replay is not implemented for DSpark drafts (their Markov head walks the "
                        "drafted tokens); run bench without --replay")
    sequence = list(prompt) + list(answer)
    tokens = np.zeros((1, bucket(len(sequence) + block)), np.int32)
    tokens[0, : len(sequence)] = sequence
    features_fn, proposals_fn = _teacher_forced_fns(target_config, draft_config, block, dtype)
    tokens = jnp.asarray(tokens)
    features = features_fn(target_params, tokens, jnp.asarray([len(sequence)]))
    chunks = []
    for first in range(0, len(answer), ANCHOR_CHUNK):
        index = first + np.arange(ANCHOR_CHUNK)
        anchors = len(prompt) + np.minimum(index, len(answer) - 1)
        chunks.append(to_host(proposals_fn(target_params, draft_params, features, tokens,
                                           jnp.asarray(anchors[None], jnp.int32),
                                           jnp.asarray(index < len(answer))[None])))
    proposals = np.concatenate(chunks)[: len(answer)]
    # What each proposal must equal: the answer from the anchor's next position on (-1 past its end).
    padded = np.concatenate([np.asarray(answer), np.full(block, -1)])
    targets = padded[np.arange(len(answer))[:, None] + 1 + np.arange(block - 1)[None]]
    matches = proposals == targets
    return np.where(matches.all(axis=1), block - 1, np.argmin(matches, axis=1)).astype(np.int64)


def replay_fixed(acceptance: np.ndarray, block_cost: float) -> tuple[float, list[int]]:
    """(time, acceptance length of each round) of full-block rounds over one answer."""
    i, time, lengths = 0, 0.0, []
    while i < len(acceptance) - 1:  # token 0 came from the prefill; round anchors at answer[i]
        lengths.append(int(acceptance[i]) + 1)
        i += lengths[-1]
        time += block_cost
    return time, lengths


@functools.lru_cache(maxsize=None)
def _policy_functions(widths: tuple[int, ...], block: int):
    next_phase = jax.jit(lambda policy: adaptive.next_phase(policy, widths, block))
    observe = {w: jax.jit(lambda policy, a, w=w: adaptive.observe(policy, a[None], w, jnp.asarray([True])))
               for w in widths if w > 1}
    return next_phase, observe


def replay_adaptive(acceptance: np.ndarray, widths: tuple[int, ...], costs: Sequence[float], block: int
                    ) -> tuple[float, list[int]]:
    """(time, verify width of each round) of the engine's adaptive policy over one answer; ``costs`` per
    width of ``widths`` (= ``adaptive.verify_widths``), in any unit."""
    next_phase, observe = _policy_functions(tuple(widths), block)
    relative = np.asarray(costs, np.float32) / np.float32(costs[-1])
    policy = adaptive.initial_policy(block, len(widths))._replace(costs=jnp.asarray(relative))
    i, time, log = 0, 0.0, []
    while i < len(acceptance) - 1:
        choice, rounds, policy = next_phase(policy)
        width = widths[int(choice)]
        for _ in range(int(rounds)):
            if i >= len(acceptance) - 1:
                break
            accepted = min(int(acceptance[i]), width - 1)  # none for width 1: nothing is verified
            if width > 1:
                policy = observe[width](policy, jnp.int32(accepted))
            i += accepted + 1
            time += costs[int(choice)]
            log.append(width)
        policy = policy._replace(last_width=jnp.int32(width))
    return time, log


def replay_oracle(acceptance: np.ndarray, widths: Sequence[int], costs: Sequence[float]) -> float:
    """The least time over every schedule of ``widths`` for one answer, each round's acceptance known."""
    n = len(acceptance)
    best = np.zeros(n)  # best[i]: least time to finish from anchor i
    for i in range(n - 2, -1, -1):
        best[i] = min(c + best[min(i + min(int(acceptance[i]), w - 1) + 1, n - 1)]
                      for w, c in zip(widths, costs))
    return float(best[0])
