"""On-device generation: prefill, then every round inside one ``lax.while_loop`` (SPEC section 5).

The same program runs DFlash (a draft proposer, block B) and the autoregressive baseline (``NoProposer``,
block 1): a round verifies ``[anchor, d_1 .. d_K]`` with the target, accepts a prefix, commits it plus the
target's own next token, and rolls the cache back by lowering lengths. Rows are independent: each has its
own anchor, position, acceptance and done flag; finished rows keep computing but stop advancing. With a tree
budget (``tree_round``) a round verifies a tree of the draft's most probable prefixes instead of its chain,
and the rollback moves the accepted path's keys and values into place (``KVCache.commit_path``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.engine import adaptive
from dflash_jax.engine import tree as tree_lib
from dflash_jax.engine.sampling import SamplingConfig, accept_block, accept_greedy, accept_sampling, select
from dflash_jax.errors import UserError
from dflash_jax.models.config import TargetConfig
from dflash_jax.models.cache import KVCache, LinearState
from dflash_jax.models.attention_kernels import check_attention_kernel
from dflash_jax.models.target import TargetModel, TargetOutput, init_cache
from dflash_jax.precision import with_precision_policy


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    max_new_tokens: int
    sampling: SamplingConfig = SamplingConfig()
    stop_tokens: tuple[int, ...] = ()
    record_drafts: bool = False  # keep every round's proposals (tests recompute acceptance from them)
    mesh: Any = None  # a jax Mesh: KV caches sharded over batch (data, fsdp) and KV heads (tensor)
    prefill_chunk: int = 4096  # prompts wider than this prefill chunk by chunk (bounded activation memory)
    # Adaptive block size (beyond the paper; off when empty, engine/adaptive.py): the tokens verified per
    # round, chosen every few rounds among these widths and the full block from the batch's recent acceptance
    # and the measured cost of each width. The draft still proposes a whole block; only the verified prefix
    # shrinks, so the output stays lossless. Width 1 is a plain autoregressive round (no draft forward).
    adaptive_widths: tuple[int, ...] = ()
    # Relative time of a round of each verify width (the adaptive widths below the block, then the block);
    # empty: measured on the device when the program is compiled.
    width_costs: tuple[float, ...] = ()
    # Attention kernel (models/attention_kernels.py): "auto" is cuDNN's fused flash attention on a CUDA GPU
    # with 16-bit activations, the chunked online-softmax loop elsewhere.
    attention: str = "auto"
    # Tree verification (engine/tree.py, SPEC section 12; 0: the chain): each round verifies the
    # ``tree_budget`` most probable draft prefixes under the draft's per-position distributions, built from
    # each position's ``tree_candidates`` most probable tokens (0: ``tree_budget``, which makes the tree the
    # exact top-``tree_budget`` set; 1 gives the chain of the argmaxes).
    tree_budget: int = 0
    tree_candidates: int = 0
    # ``--tree auto`` (engine/adaptive.py, "Tree budget"): each phase of rounds verifies the chain or a tree of
    # one of these budgets, whichever promises the most tokens per unit of time (the rounds' costs measured on
    # the device when the program is compiled, or ``width_costs``: the chain's, then each budget's).
    tree_auto: tuple[int, ...] = ()
    # Sampled chains: judge the block as a whole (``sampling.accept_block``, Sun et al.'s block verification)
    # instead of token by token; lossless either way, never fewer tokens in expectation. No effect when greedy
    # or on trees (their walk samples the target at every node).
    block_verify: bool = False

    def __post_init__(self):
        check_attention_kernel(self.attention)
        if self.tree_budget < 0 or self.tree_candidates < 0:
            raise UserError(f"tree budget and candidates must be >= 0, got {self.tree_budget} and "
                            f"{self.tree_candidates}")
        if self.tree_candidates and not (self.tree_budget or self.tree_auto):
            raise UserError("tree_candidates needs a tree_budget")
        if (self.tree_budget or self.tree_auto) and self.adaptive_widths:
            raise UserError("a tree budget and adaptive widths cannot be combined (choose one)")
        if self.tree_budget and self.tree_auto:
            raise UserError("a fixed tree budget and tree_auto budgets cannot be combined (choose one)")
        if any(b < 1 for b in self.tree_auto) or list(self.tree_auto) != sorted(set(self.tree_auto)):
            raise UserError(f"tree_auto must be increasing positive budgets, got {self.tree_auto}")
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.prefill_chunk < 1:
            raise UserError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if any(w < 1 for w in self.adaptive_widths) or list(self.adaptive_widths) != sorted(set(self.adaptive_widths)):
            raise UserError(f"adaptive_widths must be increasing positive widths, got {self.adaptive_widths}")
        if self.width_costs and not (self.adaptive_widths or self.tree_auto):
            raise UserError("width_costs needs adaptive_widths or tree_auto")
        if any(not (np.isfinite(c) and c > 0) for c in self.width_costs):
            raise UserError(f"width_costs must be positive, got {self.width_costs}")


def verify_span(settings: DecodeSettings, block: int) -> int:
    """The widest block a round writes past a row's length: the draft block, or a tree's root plus nodes.
    Caches hold this many slots of speculation, rings this many past their window."""
    return max(block, settings.tree_budget + 1, max(settings.tree_auto, default=0) + 1)


def check_tree(settings: DecodeSettings, target_config: TargetConfig, proposer) -> None:
    if not (settings.tree_budget or settings.tree_auto):
        return
    if not hasattr(proposer, "candidates") or proposer.block_size < 2:
        raise UserError("tree verification needs a draft (a proposer with per-position candidates)")


class LoopState(NamedTuple):
    key: jax.Array
    cache: Any  # target KVCache
    proposer: Any  # proposer state pytree
    ctx: tuple  # (features [B, Bk, F], positions [B, Bk], valid [B, Bk]) verified last round
    anchor: jax.Array  # [B] the last committed token, not yet in the target cache
    start: jax.Array  # [B] its position
    out: jax.Array  # [B, max_new + Bk] committed tokens
    num_out: jax.Array  # [B]
    done: jax.Array  # [B]
    rounds: jax.Array  # [B] rounds taken while active
    accept: jax.Array  # [B, max_new] acceptance length of each round: tokens committed (accepted drafts + 1, cut)
    drafts: jax.Array  # [B, max_new, K] proposals per round (or [B, 1, K] when not recorded)
    step: jax.Array  # scalar round counter
    prefill_finite: jax.Array  # [B] the prefill's logits were all finite (checked once, on the host)
    # Adaptive widths and tree budgets (engine/adaptive.py); unused by fixed-block decoding.
    widths: jax.Array  # [B, max_new] per round: verify width (adaptive widths) or tree budget (0: chain; tree
    #                    auto); else [B, 1]
    policy: Any  # adaptive.Policy, or adaptive.TreePolicy (tree auto): carried from phase to phase


def _is_stop(tokens: jax.Array, stop_tokens: tuple[int, ...]) -> jax.Array:
    if not stop_tokens:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(stop_tokens, jnp.int32))


def _sharded_caches(tree: Any, mesh: Any) -> Any:
    """Every ``KVCache`` in ``tree`` laid out by the sharding rules (``[batch, kv_heads, slots, head_dim]``:
    batch over data x fsdp, KV heads over tensor; a linear layer's state by ``LinearState.AXES``, its value
    heads over tensor; dimensions a mesh axis does not divide replicate)."""
    if mesh is None:
        return tree
    from dflash_jax import sharding

    def put(a, axes):
        return jax.lax.with_sharding_constraint(a, sharding.NamedSharding(mesh, sharding.spec_for(a.shape, axes, mesh)))

    def constrain(x):
        if not isinstance(x, KVCache):
            return x
        kv = ("batch", "kv_heads", None, None)
        linear = tuple(state.replace(**{name: put(getattr(state, name), axes)
                                        for name, axes in LinearState.AXES.items()}) for state in x.linear)
        return x.replace(keys=tuple(put(k, kv) for k in x.keys), values=tuple(put(v, kv) for v in x.values),
                         linear=linear, indexer=tuple(put(k, kv) for k in x.indexer))

    return jax.tree.map(constrain, tree, is_leaf=lambda x: isinstance(x, KVCache))


def prefill(
    target_config: TargetConfig, proposer, settings: DecodeSettings, slots: int,
    target_params: dict, proposer_consts: Any, proposer_state: Any, prompts: jax.Array, lengths: jax.Array,
    key: jax.Array, dtype: Any = jnp.float32,
) -> LoopState:
    """Run the target over right-padded ``prompts [B, P]`` (``lengths [B]``), produce the first token and
    hand the prompt's features to the proposer."""
    b, p = prompts.shape
    block = proposer.block_size
    target = TargetModel(target_config, dtype)
    check_tree(settings, target_config, proposer)
    cache = _sharded_caches(init_cache(target_config, b, slots, dtype, extension=verify_span(settings, block)),
                            settings.mesh)
    proposer_state = _sharded_caches(proposer_state, settings.mesh)
    # Prompts wider than prefill_chunk go through in chunks (a lax.scan over equal slices: the prompt width
    # is a power of two): each chunk writes its keys/values and hands its features to the proposer, so
    # activations are bounded by the chunk while attention sees everything before it.
    q = min(p, settings.prefill_chunk)
    if p % q:  # a width shrunk to fit max_positions: pad to whole chunks (padding is never written)
        prompts = jnp.pad(prompts, ((0, 0), (0, q - p % q)))
        p = prompts.shape[1]
    last = (lengths - 1)[:, None]

    def chunk(carry, start):
        cache, proposer_state, logits = carry
        positions = start + jnp.broadcast_to(jnp.arange(q, dtype=jnp.int32)[None], (b, q))
        valid = positions < lengths[:, None]
        tokens = jax.lax.dynamic_slice_in_dim(prompts, start, q, axis=1)
        out = target.apply({"params": target_params}, tokens, positions, cache, valid,
                           feature_layers=proposer.feature_layers, logits_at=jnp.clip(last - start, 0, q - 1))
        if proposer.feature_layers:
            proposer_state = proposer.ingest(proposer_consts, proposer_state, out.features, positions, valid)
        here = (last >= start) & (last < start + q)  # the chunk holding a row's last prompt token
        logits = jnp.where(here[:, :, None], out.logits.astype(jnp.float32), logits)
        return (out.cache, proposer_state, logits), None

    logits0 = jnp.zeros((b, 1, target_config.vocab_size), jnp.float32)
    (cache, proposer_state, logits), _ = jax.lax.scan(chunk, (cache, proposer_state, logits0),
                                                       jnp.arange(0, p, q, dtype=jnp.int32))
    feat_dim = (len(proposer.feature_layers) * target_config.hidden_size) if proposer.feature_layers else 0
    out = TargetOutput(logits, None, cache)
    key, k_first = jax.random.split(key)
    first = select(k_first, out.logits[:, 0], settings.sampling)
    ctx = (jnp.zeros((b, block, feat_dim), dtype), jnp.zeros((b, block), jnp.int32), jnp.zeros((b, block), bool))
    buf = jnp.zeros((b, settings.max_new_tokens + block), jnp.int32).at[:, 0].set(first)
    done = _is_stop(first, settings.stop_tokens) | (settings.max_new_tokens <= 1)
    rec = settings.max_new_tokens if settings.record_drafts else 1
    return LoopState(
        key=key, cache=out.cache, proposer=proposer_state, ctx=ctx, anchor=first, start=lengths.astype(jnp.int32),
        out=buf, num_out=jnp.ones((b,), jnp.int32), done=done, rounds=jnp.zeros((b,), jnp.int32),
        accept=jnp.zeros((b, settings.max_new_tokens), jnp.int32),
        drafts=jnp.zeros((b, rec, block - 1), jnp.int32), step=jnp.zeros((), jnp.int32),
        prefill_finite=jnp.all(jnp.isfinite(out.logits[:, 0]), axis=-1),
        widths=jnp.zeros((b, settings.max_new_tokens if settings.adaptive_widths or settings.tree_auto else 1),
                         jnp.int32),
        policy=(adaptive.initial_tree_policy(len(adaptive.tree_options(settings.tree_auto))) if settings.tree_auto
                else adaptive.initial_policy(block, len(adaptive.verify_widths(settings.adaptive_widths, block)))),
    )


def decode_round(target_config: TargetConfig, proposer, settings: DecodeSettings, target_params: dict,
                 proposer_consts: Any, s: LoopState, dtype: Any = jnp.float32, width: int | None = None,
                 ar_slot: jax.Array | None = None) -> LoopState:
    """One round: draft, verify the anchor and the first ``width - 1`` proposals (the whole block by default),
    accept, commit. Width 1 (adaptive phases only) is an autoregressive round: no draft forward; the anchor's
    features go to slot ``ar_slot`` of the round context, filed into the draft's cache when drafting resumes."""
    block = proposer.block_size
    width = block if width is None else width
    b = s.anchor.shape[0]
    active = ~s.done
    if settings.sampling.greedy:
        # Greedy rounds draw nothing: skip the split (a static choice; measured ~3% of a round and of an AR
        # step on CPU). Sampled rounds split exactly as before, so their key sequence is unchanged.
        key = k_draft = k_accept = s.key
    else:
        key, k_draft, k_accept = jax.random.split(s.key, 3)
    positions = s.start[:, None] + jnp.arange(block, dtype=jnp.int32)[None]

    if width == 1:
        drafts, draft_probs, pstate = jnp.zeros((b, block - 1), jnp.int32), None, s.proposer
    else:
        # Where fewer than a block of tokens remain, the draft sees a block of only the anchor plus the
        # remaining positions, as in the official code (a bidirectional draft's earlier positions depend on
        # how many mask tokens follow them); what it proposes past them is never committed.
        block_len = jnp.minimum(block, settings.max_new_tokens - s.num_out + 1)
        drafts, draft_probs, pstate = proposer.propose(proposer_consts, s.proposer, s.ctx, s.anchor, s.start,
                                                       k_draft, settings.sampling, block_len)
    tokens = jnp.concatenate([s.anchor[:, None], drafts], axis=1)[:, :width]
    verify = TargetModel(target_config, dtype).apply(
        {"params": target_params}, tokens, positions[:, :width], s.cache,
        jnp.broadcast_to(active[:, None], (b, width)), feature_layers=proposer.feature_layers,
    )
    d = drafts[:, : width - 1]
    # A proposer's own cut of each row's verify (DSpark's confidence head; proposers.py's docstring).
    limit = pstate.get("verify_limit") if isinstance(pstate, dict) and width > 1 else None
    if settings.sampling.greedy:
        acc = accept_greedy(d, verify.logits, limit)
    else:
        probs = draft_probs[:, : width - 1] if draft_probs is not None else None
        if probs is None:  # a deterministic proposal: q is a point mass
            probs = jax.nn.one_hot(d, verify.logits.shape[-1], dtype=jnp.float32)
        if settings.block_verify:
            if limit is not None:
                raise UserError("block verification does not take a proposer's verify cut (a confidence "
                                "threshold): use token-wise verification")
            acc = accept_block(k_accept, d, probs, verify.logits, settings.sampling)
        else:
            acc = accept_sampling(k_accept, d, probs, verify.logits, settings.sampling, limit)
    a, nxt = acc.num_accepted, acc.next_token

    # At most ``width`` new tokens: the accepted drafts, then the target's own next token.
    idx = jnp.arange(width, dtype=jnp.int32)[None]
    padded = jnp.concatenate([d, jnp.zeros((b, 1), jnp.int32)], axis=1)
    new_tokens = jnp.where(idx < a[:, None], padded, nxt[:, None])

    # Rollback: keep the anchor and the accepted drafts; the next token is the next anchor, not yet cached.
    cache = verify.cache.with_lengths(jnp.where(active, s.start + a + 1, s.cache.lengths))
    features = verify.features
    if features is None:
        ctx = s.ctx
    elif width == 1:
        ctx = tuple(jax.lax.dynamic_update_slice_in_dim(old, new, ar_slot, axis=1)
                    for old, new in zip(s.ctx, (features, s.start[:, None], active[:, None])))
    else:
        ctx = (jnp.pad(features, ((0, 0), (0, block - width), (0, 0))), positions,
               (jnp.arange(block)[None] <= a[:, None]) & active[:, None])

    policy, widths = s.policy, s.widths
    if settings.adaptive_widths:
        policy = adaptive.observe(policy, a, width, active)
        widths = s.widths.at[jnp.arange(b), s.rounds].set(jnp.where(active, width, 0), mode="drop")
    if settings.tree_auto:  # a chain round of --tree auto (its budget logged as 0)
        policy = adaptive.observe_chain(policy, a, active)
    s = s._replace(key=key, cache=cache, proposer=pstate, ctx=ctx, widths=widths, policy=policy)
    return _emit(s, settings, new_tokens, a, nxt, drafts)


def _emit(s: LoopState, settings: DecodeSettings, new_tokens: jax.Array, a: jax.Array, nxt: jax.Array,
          drafts: jax.Array) -> LoopState:
    """The end of every round: ``new_tokens [B, W]`` holds a row's ``a`` accepted drafts then the target's own
    next token ``nxt`` (the next anchor); keep them up to ``max_new_tokens`` and through the first stop token,
    log the round, advance the rows still active."""
    b, width = new_tokens.shape
    active = ~s.done
    idx = jnp.arange(width, dtype=jnp.int32)[None]
    # How many of the a+1 new tokens this row keeps: cut at max_new_tokens and right after a stop token.
    count = jnp.minimum(a + 1, settings.max_new_tokens - s.num_out)
    stops = _is_stop(new_tokens, settings.stop_tokens) & (idx < count[:, None])
    hit_stop = stops.any(axis=1)
    count = jnp.where(hit_stop, jnp.argmax(stops, axis=1) + 1, count)
    count = jnp.where(active, count, 0)
    slots = jnp.where(idx < count[:, None], s.num_out[:, None] + idx, s.out.shape[1])
    out = s.out.at[jnp.arange(b)[:, None], slots].set(new_tokens, mode="drop")
    num_out = s.num_out + count
    # A round's acceptance length is the tokens it committed (the official statistic: cut at max_new_tokens
    # and after a stop token), so every row's lengths add up to its output.
    accept = s.accept.at[jnp.arange(b), s.rounds].set(count, mode="drop")
    drafts_log = s.drafts
    if settings.record_drafts:
        drafts_log = s.drafts.at[jnp.arange(b), s.rounds].set(drafts, mode="drop")
    return s._replace(
        anchor=jnp.where(active, nxt, s.anchor), start=jnp.where(active, s.start + a + 1, s.start),
        out=out, num_out=num_out, done=s.done | hit_stop | (num_out >= settings.max_new_tokens),
        rounds=s.rounds + active.astype(jnp.int32), accept=accept, drafts=drafts_log, step=s.step + 1,
    )


def tree_round(target_config: TargetConfig, proposer, settings: DecodeSettings, target_params: dict,
               proposer_consts: Any, s: LoopState, dtype: Any = jnp.float32, budget: int | None = None) -> LoopState:
    """One round of tree verification (SPEC section 12): the draft's forward gives each block position's
    candidates, ``engine/tree.build_tree`` the ``tree_budget`` most probable prefixes, the target verifies root
    and nodes in one forward (each node at position ``start + depth``, written at slot ``start + index``,
    seeing the context, its ancestors and itself), the walk keeps the deepest node whose whole path the target
    agrees with, and the commit moves that path's keys and values into place (``KVCache.commit_path``). The
    draft reads the accepted path's features next round, as after a chain. ``budget``: ``--tree auto``'s
    option for this phase (else ``settings.tree_budget``)."""
    block = proposer.block_size
    budget = budget or settings.tree_budget
    active = ~s.done
    if settings.sampling.greedy:
        key = k_accept = s.key
    else:
        key, k_accept = jax.random.split(s.key)
    block_len = jnp.minimum(block, settings.max_new_tokens - s.num_out + 1)
    offer, pstate = proposer.candidates(proposer_consts, s.proposer, s.ctx, s.anchor, s.start, block_len,
                                        settings.tree_candidates or budget)
    trees = tree_lib.build_tree_rows(offer.log_probs, offer.tokens, budget, s.anchor, offer.transitions)
    verify = TargetModel(target_config, dtype).apply(
        {"params": target_params}, jnp.maximum(trees.tokens, 0), s.start[:, None] + trees.depths, s.cache,
        active[:, None] & trees.valid, feature_layers=proposer.feature_layers, tree=trees.ancestors,
    )
    acc = tree_lib.accept_sampling_rows(trees, verify.logits, k_accept, settings.sampling)
    a = acc.num_accepted
    perm = jax.vmap(tree_lib.commit_permutation, in_axes=(0, 0, None))(acc.path, a, budget)
    perm = jnp.where(active[:, None], perm, jnp.arange(budget + 1, dtype=jnp.int32)[None])
    cache = verify.cache.commit_path(s.start, perm, jnp.where(active, s.start + a + 1, s.cache.lengths))
    ctx = s.ctx
    if verify.features is not None:  # the accepted path's features, laid out as a chain's
        ctx = (jnp.take_along_axis(verify.features, acc.path[:, :, None], axis=1),
               s.start[:, None] + jnp.arange(block, dtype=jnp.int32)[None],
               (jnp.arange(block)[None] <= a[:, None]) & active[:, None])
    policy, widths = s.policy, s.widths
    if settings.tree_auto:  # what this tree predicted for every option up to its budget, and what it committed
        options = adaptive.tree_options(settings.tree_auto)
        mass = tree_lib.prefix_mass(trees)  # [R, budget]
        expected = jnp.stack([1.0 + tree_lib.spine_mass(offer)] + [
            1.0 + mass[:, n - 1] if n <= budget else jnp.full_like(mass[:, 0], jnp.nan) for n in options[1:]], axis=1)
        policy = adaptive.observe_tree(policy, a, expected, options.index(budget), active)
        widths = s.widths.at[jnp.arange(a.shape[0]), s.rounds].set(jnp.where(active, budget, 0), mode="drop")
    s = s._replace(key=key, cache=cache, proposer=pstate, ctx=ctx, policy=policy, widths=widths)
    return _emit(s, settings, acc.tokens, a, acc.next_token, offer.tokens[:, :, 0])


def decode_loop(target_config: TargetConfig, proposer, settings: DecodeSettings, target_params: dict,
                proposer_consts: Any, state: LoopState, step_limit: jax.Array, dtype: Any = jnp.float32
                ) -> LoopState:
    """Rounds until every row is done, or until ``step_limit`` rounds in total (a traced value, so streaming
    can resume the same compiled loop chunk by chunk). With adaptive widths the rounds run in phases of one
    width each (``engine/adaptive.py``)."""

    def cond(s: LoopState):
        return (~jnp.all(s.done)) & (s.step < jnp.minimum(step_limit, settings.max_new_tokens))

    tree_ = functools.partial(tree_round, target_config, proposer, settings, target_params, proposer_consts,
                              dtype=dtype)
    if settings.tree_budget:
        return jax.lax.while_loop(cond, tree_, state)
    round_ = functools.partial(decode_round, target_config, proposer, settings, target_params, proposer_consts,
                               dtype=dtype)
    block = proposer.block_size
    if settings.tree_auto:
        options = adaptive.tree_options(settings.tree_auto)

        def tree_phase(s: LoopState) -> LoopState:
            # As the adaptive widths' phases: one while_loop per option, all but the chosen one for zero rounds.
            choice, rounds, policy = adaptive.next_tree_phase(s.policy, options, block)
            s = s._replace(policy=policy)
            for index, budget in enumerate(options):
                one = round_ if budget == 0 else functools.partial(tree_, budget=budget)
                s, _ = jax.lax.while_loop(
                    lambda c, n=jnp.where(choice == index, rounds, 0): cond(c[0]) & (c[1] < n),
                    lambda c, one=one: (one(c[0]), c[1] + 1), (s, jnp.int32(0)))
            return s._replace(policy=s.policy._replace(last=choice))

        return jax.lax.while_loop(cond, tree_phase, state)
    if not settings.adaptive_widths:
        return jax.lax.while_loop(cond, round_, state)
    widths = adaptive.verify_widths(settings.adaptive_widths, block)

    def file_context(s: LoopState) -> LoopState:
        pstate = proposer.ingest(proposer_consts, s.proposer, *s.ctx)
        return s._replace(proposer=pstate, ctx=(s.ctx[0], s.ctx[1], jnp.zeros_like(s.ctx[2])))

    def ar_block(c):
        # File the pending features (the last drafting round's, or the previous block's), then a block of
        # autoregressive rounds refilling the round context slot by slot.
        s, blocks = c
        if proposer.feature_layers:
            s = file_context(s)
        s, _ = jax.lax.while_loop(lambda c: cond(c[0]) & (c[1] < block),
                                  lambda c: (round_(c[0], width=1, ar_slot=c[1]), c[1] + 1), (s, jnp.int32(0)))
        return s, blocks - 1

    def next_phase(s: LoopState) -> LoopState:
        # One while_loop per width in sequence, all but the chosen one running zero rounds. (A lax.switch
        # between the loops made XLA copy every KV cache on entering a phase and, in the autoregressive
        # branch, in every round.)
        choice, rounds, policy = adaptive.next_phase(s.policy, widths, block)
        s = s._replace(policy=policy)
        for index, width in enumerate(widths):
            chosen = choice == index
            if width == 1:
                s, _ = jax.lax.while_loop(lambda c: cond(c[0]) & (c[1] > 0), ar_block,
                                          (s, jnp.where(chosen, rounds // block, 0)))
                continue
            s, _ = jax.lax.while_loop(
                lambda c, n=jnp.where(chosen, rounds, 0): cond(c[0]) & (c[1] < n),
                lambda c, width=width: (round_(c[0], width=width), c[1] + 1),
                (s, jnp.int32(0)))
        width = jnp.asarray(widths, jnp.int32)[choice]
        return s._replace(policy=s.policy._replace(last_width=width))

    return jax.lax.while_loop(cond, next_phase, state)


def jitted_functions(target_config: TargetConfig, proposer, settings: DecodeSettings, slots: int, dtype,
                     state_shardings: Any = None):
    """Jitted prefill and decode loop for one configuration (not yet compiled: ``generate`` compiles them
    ahead of time into its executable cache). On a mesh whose tensor axis outnumbers the target's KV heads,
    the caches keep each head ``sharding.kv_replicas`` times, so that they split over that axis."""
    if settings.mesh is not None:
        from dflash_jax import sharding

        replicas = sharding.kv_replicas(target_config.num_key_value_heads, target_config.num_attention_heads,
                                        settings.mesh)
        target_config = dataclasses.replace(target_config, kv_replicas=replicas)
    pre = jax.jit(with_precision_policy(
        functools.partial(prefill, target_config, proposer, settings, slots, dtype=dtype), dtype, settings.attention,
        settings.mesh))
    # Only the loop state (caches, buffers) is donated: params and proposer constants belong to the caller.
    # ``state_shardings`` (the prefill's output layout) pins the loop's output to its input layout, so a
    # streamed decode can feed the loop its own output.
    loop = jax.jit(with_precision_policy(
        functools.partial(decode_loop, target_config, proposer, settings, dtype=dtype), dtype, settings.attention,
        settings.mesh),
        donate_argnums=(2,),
        out_shardings=state_shardings)
    return pre, loop


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # per row, committed tokens (cut after a stop token)
    accept_lengths: list[list[int]]  # per row, acceptance length of every round (after prefill)
    rounds: list[int]
    prefill_s: float  # wall time of the prefill program (no compilation)
    decode_s: float  # wall time of the decode loop program (no compilation)
    compile_s: float
    drafts: list[np.ndarray] | None = None  # per row [rounds, K] when recorded
    # per row, every round's verify width (adaptive widths) or tree budget (tree auto; 0: the chain)
    widths: list[list[int]] | None = None
    width_costs: list[float] | None = None  # relative round time of each width or option the choice used
    # ``--tree auto`` whose calibration showed every tree budget hopeless: the decode ran the chain's program
    tree_auto_chain: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tau(self) -> float:
        """Mean acceptance length over all rounds of all rows."""
        flat = [a for row in self.accept_lengths for a in row]
        return float(np.mean(flat)) if flat else float("nan")


def _committed(state: LoopState) -> list[list[int]]:
    out, num = to_host(state.out), to_host(state.num_out)
    return [out[i, : num[i]].tolist() for i in range(out.shape[0])]


SLOT_ALIGN = 16


def prompt_width(longest: int, max_new_tokens: int, max_positions: int) -> int:
    """Padded prompt width for a batch: the power-of-two bucket, shrunk when padding alone would push the cache
    past ``max_positions`` (only the real prompt plus ``max_new_tokens`` must fit)."""
    if longest + max_new_tokens > max_positions:
        raise UserError(
            f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the target's "
            f"{max_positions} positions (max_position_embeddings); shorten the prompt or lower max_new_tokens"
        )
    return max(longest, min(bucket(longest), max_positions - max_new_tokens))


def cache_slots(longest: int, max_new_tokens: int, block_size: int, max_positions: int) -> int:
    """Slots of the target and draft caches: the padded prompt, every new token, and one block of
    speculation past the last committed token, rounded up to a multiple of ``SLOT_ALIGN`` (TPU kernels copy
    cache chunks whose offsets must be whole (16, 128) tiles of bfloat16)."""
    slots = prompt_width(longest, max_new_tokens, max_positions) + max_new_tokens + block_size
    return -(-slots // SLOT_ALIGN) * SLOT_ALIGN


# (smallest width, growth factor) of the prompt-width ladder; ``prompt_buckets`` changes it for a block.
_BUCKETS: contextvars.ContextVar[tuple[int, int]] = contextvars.ContextVar("prompt_buckets", default=(16, 2))


@contextlib.contextmanager
def prompt_buckets(smallest: int = 16, factor: int = 2):
    """Pad prompts inside the block to the ladder ``smallest * factor**i``: a coarser ladder compiles fewer
    programs (``infer bench`` takes 256 x 4: at most 4 widths up to 16k tokens) for more prefill padding."""
    if smallest < 1 or factor < 2:
        raise ValueError(f"prompt_buckets needs smallest >= 1 and factor >= 2, got {smallest}, {factor}")
    token = _BUCKETS.set((int(smallest), int(factor)))
    try:
        yield
    finally:
        _BUCKETS.reset(token)


def bucket(n: int, smallest: int | None = None) -> int:
    """Padded prompt width: the next step of the ladder (powers of two from 16 unless ``prompt_buckets`` says
    otherwise). Every distinct width is a new compilation (seconds on CPU, much more for an 8B model on an
    accelerator), while padding only costs prefill work, so few coarse widths beat tight padding."""
    first, factor = _BUCKETS.get()
    width = first if smallest is None else smallest
    while width < n:
        width *= factor
    return width


@dataclasses.dataclass(frozen=True)
class PaddedBatch:
    tokens: np.ndarray  # [B, width] right-padded prompts
    lengths: np.ndarray  # [B] real prompt lengths
    slots: int  # cache slots the proposer's state must have


def pad_prompts(target_config: TargetConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                block_size: int) -> PaddedBatch:
    """Check the prompts against the target (non-empty, ids inside the vocabulary, room for the answer) and
    right-pad them to a power-of-two width (``prompt_width``) so that nearby lengths share one program."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("every prompt needs at least one token")
    vocab = target_config.vocab_size
    for i, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= int(t) < vocab]
        if bad:  # JAX would not fail: the embedding lookup of an out-of-range id gives NaN
            raise UserError(f"prompt {i} has token id {bad[0]} outside the target's vocabulary (0..{vocab - 1}); "
                            "is the tokenizer the target's own?")
    longest = max(len(p) for p in prompts)
    max_positions = target_config.max_position_embeddings
    width = prompt_width(longest, max_new_tokens, max_positions)
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    return PaddedBatch(tokens, lengths, cache_slots(longest, max_new_tokens, block_size, max_positions))


def _place_batch(batch: PaddedBatch, mesh: Any) -> PaddedBatch:
    """Prompts split over the batch axes when they divide the batch, else replicated."""
    from dflash_jax import sharding

    tokens, lengths = (jax.device_put(x, sharding.NamedSharding(mesh, sharding.spec_for(
        x.shape, ("batch",) + (None,) * (x.ndim - 1), mesh))) for x in (batch.tokens, batch.lengths))
    return dataclasses.replace(batch, tokens=tokens, lengths=lengths)


# The one compile cache of the engine: (prefill, loop) executables by configuration and input shapes.
# Compiling ahead of time keeps compilation out of the measured prefill/decode times, and the cache makes a
# second call with the same shapes (the next benchmark sample) free.
_EXECUTABLES: dict = {}
_MAX_EXECUTABLES = 32
_COMPILED = [0]  # programs this process has compiled (two per new signature: prefill and loop)


def programs_compiled() -> int:
    """How many programs (prefills and decode loops) the engine has compiled in this process."""
    return _COMPILED[0]


def _shapes(tree: Any) -> tuple:
    """Structure, shapes, dtypes, shardings and device layouts (packed experts on TPUs: ``place_packed``): an
    executable compiled for one placement of the inputs must not be reused for another."""
    leaves, treedef = jax.tree.flatten(tree)
    return (treedef, tuple((tuple(np.shape(x)), str(getattr(x, "dtype", type(x))), getattr(x, "sharding", None),
                            _layout_of(x)) for x in leaves))


def _layout_of(x: Any) -> Any:
    """A placed integer array's device layout (None for the default, or anything else). Only packed expert
    codes are ever placed in another layout (``place_packed``), so float leaves are not asked: reading an
    array's format costs a few microseconds, and a large target has hundreds of leaves per call."""
    if not (isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.integer)):
        return None
    layout = x.format.layout
    return None if layout is None or layout.major_to_minor == tuple(range(x.ndim)) else layout.major_to_minor


def to_host(x: Any) -> np.ndarray:
    """A (possibly multi-process) array as one host NumPy array on every process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def executables(target_config: TargetConfig, target_params: dict, proposer, proposer_inputs: tuple[Any, Any],
                settings: DecodeSettings, batch: PaddedBatch, key: jax.Array, dtype: Any
                ) -> tuple[Any, Any, np.ndarray | None, bool]:
    """The compiled ``(prefill, loop, costs, chain_only)`` for this call, from the cache or compiled (and warmed
    up) now. ``costs``: the calibrated (or given) relative round costs of adaptive widths or tree options;
    ``chain_only``: ``--tree auto`` where no tree budget's calibration rounds beat the chain's."""
    consts, pstate = proposer_inputs
    signature = (target_config, proposer, settings, batch.slots, dtype, _shapes(target_params),
                 _shapes(proposer_inputs), batch.tokens.shape)
    if signature not in _EXECUTABLES:
        pre, _ = jitted_functions(target_config, proposer, settings, batch.slots, dtype)
        pre_c = pre.lower(target_params, consts, pstate, batch.tokens, batch.lengths, key).compile()
        _, loop = jitted_functions(target_config, proposer, settings, batch.slots, dtype, pre_c.output_shardings)
        # The loop is compiled for the state exactly as the prefill lays it out (shardings included).
        state_shape = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                   jax.eval_shape(pre, target_params, consts, pstate, batch.tokens, batch.lengths, key),
                                   pre_c.output_shardings)
        loop_c = loop.lower(target_params, consts, state_shape, jnp.int32(0)).compile()
        _COMPILED[0] += 2
        # The first execution of a fresh executable is several times slower on CPU (measured 27 vs 1.4 ms per
        # token); one round of warm-up keeps that out of the timings.
        warm = pre_c(target_params, consts, pstate, batch.tokens, batch.lengths, key)
        jax.block_until_ready(loop_c(target_params, consts, warm, jnp.int32(1)))
        costs, tokens = _width_costs(pre_c, loop_c, target_params, proposer_inputs, settings,
                                     proposer.block_size, batch, key)
        chain_only = tokens is not None and not np.any(adaptive.paying_budgets(
            costs, adaptive.tree_options(settings.tree_auto), tokens))
        _EXECUTABLES[signature] = (pre_c, loop_c, costs, chain_only)
        while len(_EXECUTABLES) > _MAX_EXECUTABLES:
            _EXECUTABLES.pop(next(iter(_EXECUTABLES)))
    return _EXECUTABLES[signature]


def _width_costs(pre_c: Any, loop_c: Any, target_params: dict, proposer_inputs: tuple[Any, Any],
                 settings: DecodeSettings, block: int, batch: PaddedBatch, key: jax.Array
                 ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``(costs, tokens)``: the relative round cost of each adaptive verify width (or ``--tree auto``
    option: the chain, then each budget), given or timed on this batch with the compiled loop itself (each
    forced in turn), so the costs are those of this device and program; and, when timed for tree auto, the
    tokens a row committed per round of each option in those timing runs (else None)."""
    if settings.tree_auto:
        widths, what = adaptive.tree_options(settings.tree_auto), "option (the chain, then each tree budget)"
    elif settings.adaptive_widths:
        widths, what = adaptive.verify_widths(settings.adaptive_widths, block), "verify width"
    else:
        return None, None
    if settings.width_costs:
        if len(settings.width_costs) != len(widths):
            raise UserError(f"width_costs needs one cost per {what} {widths}, got {settings.width_costs}")
        return np.asarray(settings.width_costs, np.float32), None
    consts, pstate = proposer_inputs
    committed = np.zeros((2, len(widths)))  # tokens committed, row rounds: each option's timing runs

    def run_rounds(index: int) -> tuple[float, int]:
        state = pre_c(target_params, consts, pstate, batch.tokens, batch.lengths, key)
        forced = jax.device_put(np.int32(index), state.policy.forced.sharding)
        state = state._replace(policy=state.policy._replace(forced=forced))
        state = jax.block_until_ready(state)
        t0 = time.perf_counter()
        state = jax.block_until_ready(loop_c(target_params, consts, state, jnp.int32(adaptive.CALIBRATION_ROUNDS)))
        seconds = time.perf_counter() - t0
        committed[0, index] += float(np.sum(to_host(state.num_out) - 1))  # the prefill's token is no round's
        committed[1, index] += float(np.sum(to_host(state.rounds)))
        return seconds, int(to_host(state.step))

    costs = adaptive.calibrate(widths, run_rounds)
    tokens = (committed[0] / np.maximum(committed[1], 1.0)).astype(np.float32)
    if jax.process_count() > 1:  # every process must take the same widths: process 0's timings decide
        from jax.experimental import multihost_utils

        both = np.asarray(multihost_utils.broadcast_one_to_all(np.stack([costs, tokens])), np.float32)
        costs, tokens = both[0], both[1]
    return costs, (tokens if settings.tree_auto else None)


def _with_costs(state: LoopState, costs: np.ndarray | None) -> LoopState:
    if costs is None:
        return state
    return state._replace(policy=state.policy._replace(costs=jax.device_put(costs, state.policy.costs.sharding)))


def _check_prefill(state: LoopState) -> None:
    broken = np.flatnonzero(~to_host(state.prefill_finite))
    if broken.size:  # NaN/Inf logits would decode as garbage (or an empty text) with nothing to say why
        raise UserError(f"the target's logits for prompt {int(broken[0])} are not finite (NaN or Inf) after the "
                        "prefill: the target checkpoint is broken (a NaN/Inf weight, or a dtype that overflows)")


def _decode(loop_c: Any, target_params: dict, consts: Any, state: LoopState, max_new_tokens: int,
            on_tokens: Callable[[list[list[int]]], None] | None, chunk_rounds: int) -> LoopState:
    """The whole decode in one device call, or ``chunk_rounds`` rounds at a time with ``on_tokens`` shown
    every row's tokens so far after each chunk (streaming)."""
    if on_tokens is None:
        return jax.block_until_ready(loop_c(target_params, consts, state, jnp.int32(max_new_tokens)))
    on_tokens(_committed(state))
    limit = 0
    while not bool(np.all(to_host(state.done))) and limit < max_new_tokens:
        limit += chunk_rounds
        state = loop_c(target_params, consts, state, jnp.int32(limit))
        on_tokens(_committed(state))
    return state


def _result(state: LoopState, settings: DecodeSettings, prefill_s: float, decode_s: float,
            compile_s: float) -> GenerationResult:
    out, num_out, rounds, accept = (to_host(x) for x in (state.out, state.num_out, state.rounds, state.accept))
    rows = range(out.shape[0])
    drafts = to_host(state.drafts) if settings.record_drafts else None
    widths = to_host(state.widths) if settings.adaptive_widths or settings.tree_auto else None
    return GenerationResult(
        tokens=[out[i, : num_out[i]].tolist() for i in rows],
        accept_lengths=[accept[i, : rounds[i]].tolist() for i in rows],
        rounds=rounds.tolist(),
        prefill_s=prefill_s, decode_s=decode_s, compile_s=compile_s,
        drafts=[drafts[i, : rounds[i]] for i in rows] if drafts is not None else None,
        widths=[widths[i, : rounds[i]].tolist() for i in rows] if widths is not None else None,
    )


def generate(
    target_config: TargetConfig,
    target_params: dict,
    prompts: Sequence[Sequence[int]],
    proposer,
    proposer_inputs: tuple[Any, Any] | Callable[[int], tuple[Any, Any]],
    settings: DecodeSettings,
    seed: int = 0,
    dtype: Any = jnp.float32,
    on_tokens: Callable[[list[list[int]]], None] | None = None,
    chunk_rounds: int = 8,
) -> GenerationResult:
    """Generate for a batch of token-id prompts of any lengths: pad (``pad_prompts``; a proposer's caches must
    have ``batch.slots`` = ``cache_slots`` slots), compile or reuse (``executables``), prefill, decode
    (streamed through ``on_tokens`` in chunks of ``chunk_rounds`` rounds, or in one device call).
    ``proposer_inputs``: the proposer's ``(consts, state)`` for ``batch.slots``, or a function of the slots that
    makes them (then ``--tree auto``'s chain fallback runs with the chain's own, smaller caches: at the
    tree's slots the shipped CPU pair's chain ran 10% slower)."""
    inputs_for = proposer_inputs if callable(proposer_inputs) else None

    def padded(settings: DecodeSettings) -> tuple[PaddedBatch, tuple[Any, Any]]:
        batch = pad_prompts(target_config, prompts, settings.max_new_tokens, verify_span(settings, proposer.block_size))
        if settings.mesh is not None:
            batch = _place_batch(batch, settings.mesh)
        return batch, (inputs_for(batch.slots) if inputs_for is not None else proposer_inputs)

    batch, proposer_inputs = padded(settings)
    key = jax.random.PRNGKey(seed)

    t0 = time.perf_counter()
    pre_c, loop_c, costs, chain_only = executables(target_config, target_params, proposer, proposer_inputs, settings,
                                                   batch, key, dtype)
    run_settings = settings
    if chain_only:  # --tree auto where no tree pays on this device and batch: the chain's own program
        run_settings = dataclasses.replace(settings, tree_auto=(), width_costs=())
        if inputs_for is not None:
            batch, proposer_inputs = padded(run_settings)
        pre_c, loop_c, _, _ = executables(target_config, target_params, proposer, proposer_inputs, run_settings,
                                          batch, key, dtype)
    consts, pstate = proposer_inputs
    compile_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    state = jax.block_until_ready(pre_c(target_params, consts, pstate, batch.tokens, batch.lengths, key))
    prefill_s = time.perf_counter() - t0
    _check_prefill(state)
    state = _with_costs(state, None if chain_only else costs)

    t0 = time.perf_counter()
    state = _decode(loop_c, target_params, consts, state, settings.max_new_tokens, on_tokens, chunk_rounds)
    result = _result(state, run_settings, prefill_s, time.perf_counter() - t0, compile_s)
    result.width_costs = None if costs is None else [float(c) for c in costs]
    if chain_only:  # every round a chain round (budget 0), as the phase rule would have logged them
        result.widths, result.tree_auto_chain = [[0] * r for r in result.rounds], True
    return result
