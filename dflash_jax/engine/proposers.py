"""Proposers: what fills the block after the anchor in each round.

A proposer is a small hashable object with static settings (it is a static argument of the compiled
programs) and two pytrees of arrays, returned together by its ``init(...)``:

- ``consts``: read-only inputs (draft params, the target's embedding and head, oracle references); never
  donated, so the caller's arrays survive the call;
- ``state``: what the rounds update (the draft's context KV cache), carried and donated through the loop.

Methods:

- ``ingest(consts, state, features, positions, valid)`` -> state: the target features of verified positions
  (the prompt after prefill)
- ``propose(consts, state, ctx, anchor, start, key, sampling, block_len)`` -> ``(tokens [B, K], probs [B, K, V]
  | None, state)``: the K = block-1 proposed tokens for positions ``start+1 .. start+K`` (of which only the
  first ``block_len [B] - 1`` can still be committed) and, for sampling, the
  distribution each came from (None means a deterministic proposal). ``sampling`` is the decode's own
  ``SamplingConfig`` (``DecodeSettings.sampling``, the one place it is set). ``ctx = (features, positions, valid)`` holds the target
  features of the positions verified in the previous round, which the DFlash draft writes into its context
  cache within the same forward.

``feature_layers`` tells the engine which target features to compute (none for the baseline and oracles).

A proposer whose state holds ``verify_limit [B]`` (DSpark's confidence cut) caps how many of its proposals
each row may accept this round: the target still checks the whole block (static shapes), but acceptance
stops at the cap and the next token is the target's own there, exactly as verifying only the first
``verify_limit`` drafts would give (the target is causal).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax.engine.sampling import SamplingConfig, argmax, probabilities, sample
from dflash_jax.engine.tree import Candidates, top_candidates
from dflash_jax.errors import UserError
from dflash_jax.models.draft import DraftModel, SharedHead, init_draft_cache, split_head_copies
from dflash_jax.models.draft_config import DraftConfig
from dflash_jax.models.dspark import confident_prefix


class DraftProposer:
    """What the two draft proposers share: a ``DraftModel`` of ``config`` whose context cache lives in the state
    (``state["cache"]``) and takes the verified positions' features in ``ingest``."""

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    @property
    def model(self) -> DraftModel:
        return DraftModel(self.config, self.dtype, self.draft_window)

    def on_mesh(self, mesh) -> "DraftProposer":
        """This proposer for ``mesh`` (None: itself): where the tensor axis outnumbers the draft's KV heads, its
        context cache keeps each head ``sharding.kv_replicas`` times, so that it splits over that axis as the
        target's does (``generate.jitted_functions``) instead of sitting whole on every device."""
        if mesh is None:
            return self
        from dflash_jax import sharding

        replicas = sharding.kv_replicas(self.config.num_key_value_heads, self.config.num_attention_heads, mesh)
        return dataclasses.replace(self, config=dataclasses.replace(self.config, kv_replicas=replicas))

    def ingest(self, consts: dict, state: dict, features, positions, valid) -> dict:
        cache = self.model.apply({"params": consts["params"]}, features, positions, valid, state["cache"],
                                 method=DraftModel.write_context)
        return {**state, "cache": cache}


@dataclasses.dataclass(frozen=True)
class DFlashProposer(DraftProposer):
    """The DFlash draft: one forward per round over ``[anchor, mask x K]``. A DFlash2 draft then walks its
    candidate selector over the block: its tokens, and when sampling the selector's distributions (the
    probabilities lossless verification needs; no top-k/top-p on them, as the official code)."""

    config: DraftConfig
    block_size: int
    dtype: Any = jnp.float32
    draft_window: int | None = None  # DraftModel.draft_window: every layer sees at most this much context

    def __post_init__(self):
        if not 2 <= self.block_size <= self.config.block_size:
            raise UserError(
                f"block size {self.block_size} must be between 2 and the draft's block_size {self.config.block_size}"
            )
        if self.draft_window is not None and self.draft_window < 1:
            raise UserError(f"draft window must be a positive number of positions, got {self.draft_window}")

    def init(self, params: dict, shared: SharedHead, batch: int, slots: int) -> tuple[dict, dict]:
        consts = {"params": params, "shared": shared}
        return consts, {"cache": init_draft_cache(self.config, batch, slots, self.dtype, self.draft_window)}

    def _forward(self, consts: dict, state: dict, ctx, anchor, start, block_len):
        b = anchor.shape[0]
        k = self.block_size - 1
        tokens = jnp.concatenate([anchor[:, None], jnp.full((b, k), self.config.mask_token_id, jnp.int32)], axis=1)
        positions = start[:, None] + jnp.arange(self.block_size)[None]
        features, ctx_positions, ctx_valid = ctx
        out = self.model.apply(
            {"params": consts["params"]}, tokens, positions, features, ctx_positions, ctx_valid,
            state["cache"], consts["shared"], skip_anchor_logits=True, block_len=block_len,
        )
        return out, {"cache": out.cache}

    def candidates(self, consts: dict, state: dict, ctx, anchor, start, block_len, k: int):
        """The same forward as ``propose``, for a tree (``engine/tree.py``): ``(Candidates, state)``. DFlash:
        each block position's ``k`` most probable tokens and their log-probabilities over the full vocabulary,
        sorted descending. DFlash2: the selector's first ``k`` candidates (at most its top-k) and its
        transition log-probs between consecutive positions' candidates."""
        out, state = self._forward(consts, state, ctx, anchor, start, block_len)
        if self.config.dflash2:
            k = min(k, self.config.selector_top_k)
            tokens, transitions = self.model.apply({"params": consts["params"]}, out.logits, out.hidden, anchor, k,
                                                   method=DraftModel.transitions)
            return Candidates(tokens, transitions=transitions), state
        log_probs, tokens = top_candidates(out.logits, k)
        return Candidates(tokens, log_probs), state

    def propose(self, consts: dict, state: dict, ctx, anchor, start, key, sampling: SamplingConfig, block_len=None):
        out, state = self._forward(consts, state, ctx, anchor, start, block_len)
        logits = out.logits
        if self.config.dflash2:  # the selector's chain over the draft's top-k (SPEC section 10)
            temperature = 0.0 if sampling.greedy else sampling.temperature
            tokens, probs = self.model.apply({"params": consts["params"]}, logits, out.hidden, anchor, temperature,
                                             None if sampling.greedy else key, method=DraftModel.select)
            return tokens, probs, state
        if sampling.greedy:
            return argmax(logits), None, state
        probs = probabilities(logits, sampling)
        return sample(key, probs).astype(jnp.int32), probs, state


@dataclasses.dataclass(frozen=True)
class DSparkProposer(DraftProposer):
    """A DSpark draft (SPEC 13): one backbone forward over ``[anchor, mask x (B-1)]`` whose position ``k``
    predicts the token at ``start + k + 1`` (``B`` proposals, verify width ``B + 1``), then the Markov head's
    left-to-right walk (``DraftModel.dspark_chain``) inside the round. With ``confidence_threshold`` > 0 a row
    verifies only the drafts before its first position whose predicted acceptance is below it (DeepSpec's
    evaluator's rule; 0 verifies the whole block, as DeepSpec's offline evaluation and sglang-jax do).
    Sampling draws each token from the Markov-corrected logits at the decode's temperature / top-k / top-p,
    and rejection uses those distributions."""

    config: DraftConfig
    draft_block: int  # the draft's block (tokens in its forward); the engine's block is one more
    dtype: Any = jnp.float32
    draft_window: int | None = None
    confidence_threshold: float = 0.0

    def __post_init__(self):
        if not self.config.dspark:
            raise UserError("DSparkProposer needs a DSpark draft config (architectures Qwen3DSparkModel)")
        if not 1 <= self.draft_block <= self.config.block_size:
            raise UserError(f"block size {self.draft_block} must be between 1 and the DSpark draft's block_size "
                            f"{self.config.block_size}")
        if not 0.0 <= self.confidence_threshold <= 1.0:
            raise UserError(f"confidence threshold must lie in [0, 1], got {self.confidence_threshold}")
        if self.confidence_threshold > 0 and not self.config.confidence_head:
            raise UserError("a confidence threshold needs a draft with a confidence head "
                            "(enable_confidence_head is false in its config)")
        if self.draft_window is not None and self.draft_window < 1:
            raise UserError(f"draft window must be a positive number of positions, got {self.draft_window}")

    @property
    def block_size(self) -> int:
        """The engine's block: the anchor and the ``draft_block`` proposals."""
        return self.draft_block + 1

    def init(self, params: dict, shared: SharedHead, batch: int, slots: int) -> tuple[dict, dict]:
        """``shared``: the target's embedding and head; a draft that holds its own (``split_head_copies``) uses
        those instead (``Decoder`` drops them where they equal the target's)."""
        backbone, own = split_head_copies(params)
        consts = {"params": backbone, "shared": own if own is not None else shared}
        state = {"cache": init_draft_cache(self.config, batch, slots, self.dtype, self.draft_window)}
        if self.confidence_threshold > 0:  # the round's verify cut rides in the state (module docstring)
            state["verify_limit"] = jnp.full((batch,), self.draft_block, jnp.int32)
        return consts, state

    def propose(self, consts: dict, state: dict, ctx, anchor, start, key, sampling: SamplingConfig, block_len=None):
        # DeepSpec drafts the whole block every round, also where fewer tokens remain (block_len unused):
        # what lies past max_new_tokens is never committed.
        b = anchor.shape[0]
        tokens = jnp.concatenate([anchor[:, None], jnp.full((b, self.draft_block - 1), self.config.mask_token_id,
                                                            jnp.int32)], axis=1)
        positions = start[:, None] + jnp.arange(self.draft_block)[None]
        features, ctx_positions, ctx_valid = ctx
        out = self.model.apply({"params": consts["params"]}, tokens, positions, features, ctx_positions, ctx_valid,
                               state["cache"], consts["shared"])

        def choose(logits, step_key):
            if sampling.greedy:
                return argmax(logits), None
            probs = probabilities(logits, sampling)
            return sample(step_key, probs).astype(jnp.int32), probs

        chain = self.model.apply({"params": consts["params"]}, out.logits, out.hidden, anchor, choose,
                                 None if sampling.greedy else key, self.confidence_threshold > 0,
                                 method=DraftModel.dspark_chain)
        state = {"cache": out.cache}
        if self.confidence_threshold > 0:
            state["verify_limit"] = confident_prefix(chain.confidence, self.confidence_threshold)
        return chain.tokens, chain.probs, state

    def candidates(self, consts, state, ctx, anchor, start, block_len, k: int):
        raise UserError("tree verification of DSpark drafts is not supported yet (use the chain)")


def make_proposer(config: DraftConfig, block_size: int | None = None, dtype: Any = jnp.float32,
                  draft_window: int | None = None, confidence_threshold: float = 0.0):
    """The proposer a draft config calls for: ``DSparkProposer`` for DeepSpec's drafts (``block_size`` counts
    the draft's own block), else ``DFlashProposer``. ``block_size`` None: the draft's."""
    block = config.block_size if block_size is None else block_size
    if config.dspark:
        return DSparkProposer(config, block, dtype, draft_window, confidence_threshold)
    if confidence_threshold:
        raise UserError("a confidence threshold needs a DSpark draft with a confidence head")
    return DFlashProposer(config, block, dtype, draft_window)


def draft_logits(config: DraftConfig, params: dict, shared: SharedHead, context_features: jax.Array,
                 anchor: jax.Array, block_size: int | None = None, dtype: Any = jnp.float32) -> jax.Array:
    """One round of the DFlash draft, for debugging and parity checks: the logits ``[B, block_size-1, V]``
    of the mask positions after ``anchor [B]`` (the last verified token, at position ``T``), given the raw
    target features ``[B, T, n*H]`` of the ``T`` verified positions before it (all valid). The engine's
    rounds compute exactly this, with the context cached across rounds. Jitted (one compile per shape):
    op by op, the attention loops inside the forward take seconds per call."""
    block = config.block_size if block_size is None else block_size
    DFlashProposer(config, block)  # validates the block size
    return _round_logits(config, block, dtype, params, shared, jnp.asarray(context_features),
                         jnp.asarray(anchor, jnp.int32))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _round_logits(config: DraftConfig, block: int, dtype: Any, params: dict, shared: SharedHead,
                  context_features: jax.Array, anchor: jax.Array) -> jax.Array:
    b, t = context_features.shape[:2]
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    tokens = jnp.concatenate([jnp.asarray(anchor, jnp.int32)[:, None],
                              jnp.full((b, block - 1), config.mask_token_id, jnp.int32)], axis=1)
    out = DraftModel(config, dtype).apply(
        {"params": params}, tokens, t + jnp.broadcast_to(jnp.arange(block)[None], (b, block)),
        jnp.asarray(context_features), positions, jnp.ones((b, t), bool), init_draft_cache(config, b, t + block, dtype),
        shared, skip_anchor_logits=True)
    return out.logits


@dataclasses.dataclass(frozen=True)
class OracleProposer:
    """Proposes a known continuation (by absolute position) with errors planted where ``errors`` is True.

    Used by tests to force chosen acceptance lengths: with the target's true greedy output as ``reference``
    every acceptance length can be produced on purpose.
    """

    block_size: int
    vocab_size: int
    feature_layers: tuple[int, ...] = ()

    def init(self, reference: jax.Array, errors: jax.Array) -> tuple[dict, dict]:
        """``reference [B, L]`` tokens by absolute position; ``errors [B, L]`` positions to corrupt."""
        return {"reference": jnp.asarray(reference, jnp.int32), "errors": jnp.asarray(errors, bool)}, {}

    def ingest(self, consts, state, features, positions, valid):
        return state

    def propose(self, consts, state, ctx, anchor, start, key, sampling, block_len=None):
        pos = start[:, None] + 1 + jnp.arange(self.block_size - 1)[None]
        ref = jnp.take_along_axis(consts["reference"], pos, axis=1, mode="clip")
        bad = jnp.take_along_axis(consts["errors"], pos, axis=1, mode="fill", fill_value=False)
        return jnp.where(bad, (ref + 1) % self.vocab_size, ref), None, state

    def candidates(self, consts, state, ctx, anchor, start, block_len, k: int):
        """For trees: at each position the proposal (log-prob log 0.6) and its alternative (log 0.4): the
        reference where the proposal is corrupted, else the corrupted token. A tree of enough nodes reaches
        the reference through every planted error; the chain stops at the first."""
        proposed, _, state = self.propose(consts, state, ctx, anchor, start, None, None)
        pos = start[:, None] + 1 + jnp.arange(self.block_size - 1)[None]
        ref = jnp.take_along_axis(consts["reference"], pos, axis=1, mode="clip")
        other = jnp.where(proposed == ref, (ref + 1) % self.vocab_size, ref)
        tokens = jnp.stack([proposed, other], axis=-1)[..., :k]
        log_probs = jnp.broadcast_to(jnp.log(jnp.asarray([0.6, 0.4], jnp.float32))[:k], tokens.shape)
        return Candidates(tokens, log_probs), state


@dataclasses.dataclass(frozen=True)
class NoProposer:
    """Plain autoregressive decoding: a block of one (just the anchor)."""

    block_size: int = 1
    feature_layers: tuple[int, ...] = ()

    def init(self) -> tuple[dict, dict]:
        return {}, {}

    def ingest(self, consts, state, features, positions, valid):
        return state

    def propose(self, consts, state, ctx, anchor, start, key, sampling, block_len=None):
        return jnp.zeros((anchor.shape[0], 0), jnp.int32), None, state
