"""Tree verification of DFlash drafts (the DDTree family, SPEC section 12): device-side building blocks.

One DFlash forward gives ``D`` independent per-position marginals. Instead of verifying only their argmax
chain, a round verifies a tree of the ``B`` most probable prefixes under the product of those marginals, in
one target forward of ``B + 1`` query tokens (the root plus ``B`` nodes), and keeps the longest root path the
target agrees with. Everything here is pure JAX with static shapes, written per row (vmap it, or use the
``*_rows`` wrappers), so it runs under ``jax.jit`` inside the engine's ``lax.while_loop`` without a host sync:

1. ``top_candidates`` and ``build_tree``: SPEC 12.1.2's beam (``D`` top-k's over ``B * K`` candidates, one
   sort of ``D * B`` entries), exact for the global top-``B`` prefixes; ``chain_tree``: today's chain as a tree.
2. ``node_positions``, ``node_slots``, ``tree_attention_mask``: what the verify forward needs (SPEC 12.2).
3. ``accept_greedy_tree`` and ``accept_sampling_tree``: the walk of SPEC 12.2 with ``y = argmax`` or with one
   target sample per node (SPEC 12.4 Algorithm S, lossless for temperature / top-k / top-p).
4. ``commit_permutation``, ``apply_commit``, ``commit_cache_slots``: moving the accepted nodes' KV slots to the
   linear prefix (SPEC 12.3.1).

Layout conventions, shared by every function:
- ``N = B + 1`` nodes per tree; node 0 is the root (the last committed token, i.e. the previous round's bonus,
  not yet in the cache), nodes ``1..B`` are draft prefixes in non-increasing score order, so a parent always
  has a smaller index than its children.
- The root's ``parents`` entry is 0 (itself), so every gather through ``parents`` stays in bounds; the root
  is recognised by index 0 / depth 0, never by its parent.
- Padding nodes (budget larger than the number of finite prefixes) have ``valid = False``, token -1 (never
  equal to a target token, so they never match and never add a duplicate sibling), parent 0 and depth 0.
- Node ``i`` is written to KV slot ``committed_len + i`` and rotated for position ``committed_len + depth[i]``:
  two different numbers (SPEC 12.6.1), never derive one from the other.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from dflash_jax.engine.sampling import SamplingConfig, argmax, probabilities, sample


@flax.struct.dataclass
class Tree:
    """A static-shape draft tree of ``N = budget + 1`` nodes (leading batch axes allowed after vmap)."""

    tokens: jax.Array  # [N] int32: node tokens; [0] = the root (last committed token), padding -1
    parents: jax.Array  # [N] int32: parent node index; the root and padding point at 0
    depths: jax.Array  # [N] int32: 0 for the root (and padding), d for a prefix of d draft tokens
    valid: jax.Array  # [N] bool: root and real prefixes True, padding False
    ancestors: jax.Array  # [N, N] bool: ancestors[i, j] = node j is node i or one of its ancestors
    scores: jax.Array  # [N] float32: sum of the path's draft log-probs (root 0, padding -inf)
    ranks: jax.Array  # [N] int32: column of build_tree's candidates at the node's depth; root 0, padding -1
    max_depth: int = flax.struct.field(pytree_node=False)  # D: the draft positions (accept outputs have D + 1)

    @property
    def budget(self) -> int:
        return self.tokens.shape[-1] - 1


class Candidates(NamedTuple):
    """What a proposer offers a tree (``candidates`` of ``engine/proposers.py``), per row: each block position's
    ``tokens [R, D, K]`` with either independent ``log_probs [R, D, K]`` (DFlash: the draft's marginals) or
    ``transitions [R, D, K, K]`` (DFlash2: its selector's, given the parent's rank; ``build_tree``)."""

    tokens: jax.Array
    log_probs: jax.Array | None = None
    transitions: jax.Array | None = None


def top_candidates(logits: jax.Array, k: int, temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """``logits [D, V]`` -> ``(log_probs [D, K], tokens [D, K])`` with ``K = min(k, V)``: each position's
    ``K`` most probable tokens, log-probs normalised over the FULL vocabulary (``logits - logsumexp``, so a
    prefix's score is its true log-probability under the marginals, not a renormalised top-K one), sorted
    descending; equal logits keep the lower token id first (``lax.top_k``). ``temperature`` divides the
    logits first (1 as in DDTree; LUCE uses a separate tree temperature)."""
    x = logits.astype(jnp.float32) / temperature
    top, ids = jax.lax.top_k(x, min(k, x.shape[-1]))
    return top - jax.nn.logsumexp(x, axis=-1, keepdims=True), ids.astype(jnp.int32)


def build_tree(log_probs: jax.Array, tokens: jax.Array, budget: int, root_token: jax.Array | int = 0,
               transitions: jax.Array | None = None) -> Tree:
    """The ``budget`` most probable draft prefixes as a tree (SPEC 12.1.2), for one row.

    ``log_probs [D, K]`` (float, -inf for impossible candidates) and ``tokens [D, K]`` are each position's
    candidates, normally ``top_candidates``' output (sorted descending; the algorithm does not rely on it, but
    ``ranks`` are columns of these arrays). A prefix of depth ``d`` picks one column per position ``0..d-1``;
    its score is the sum of their log-probs. ``budget`` (static) is ``B``, the nodes besides the root;
    ``root_token`` is the last committed token (the engine's anchor).

    Exactness: the global top-``B`` set is ancestor-closed (a parent scores at least as much as its child), so
    each depth's members are children of the previous depth's top ``B``: a beam of width ``B`` per depth
    (top_k over ``B * K`` candidates) never loses one, and one sort of all ``D * B`` beam entries by (score
    desc, depth asc) picks the ``B`` best with every parent before its children.

    Ties (deterministic, and the same order the beam produces, which keeps the beam exact): prefixes are
    ordered by score descending, then depth ascending (a child equal to its parent, possible when a
    log-prob is 0, comes after it), then, within a depth, by the parent's place in that order, then by rank.
    This differs from DDTree's heap (lexicographic rank tuples) only among equal scores at one depth whose
    parents have different scores. Prefixes with score -inf are padding; when fewer than ``B`` prefixes are
    finite, the tail of the tree is padding.

    ``transitions [D, K, K]`` (a DFlash2 draft's selector, SPEC 12.1.3): Markov scores instead of independent
    ones: a depth-``d + 1`` candidate's log-prob depends on its parent's rank, ``transitions[d][parent_rank]``
    (depth 1 reads row 0 of ``transitions[0]``, conditioned on the root); ``log_probs`` is then unused. Still
    log-probs <= 0, so the top-``B`` set stays ancestor-closed and the beam exact.
    """
    d_all, k = tokens.shape
    lp = (transitions[:, 0] if transitions is not None else log_probs).astype(jnp.float32)
    # Depth can never exceed the budget: beams deeper than B would only produce entries the sort drops.
    levels = min(d_all, budget)
    # Depth 1: the B best single candidates (padded with -inf when K < B; top_k keeps ties in rank order).
    first = jnp.full((max(budget, k),), -jnp.inf, jnp.float32).at[:k].set(lp[0])
    score1, rank1 = jax.lax.top_k(first, budget)

    def extend(beam, lp_d):
        # Children of every beam entry, flattened (beam, rank): top_k's lower-index-first tie rule orders equal
        # scores by parent beam position, then rank, which is the documented within-depth order.
        beam_scores, beam_ranks = beam
        rows = lp_d[None, :] if transitions is None else lp_d[jnp.minimum(beam_ranks, k - 1)]
        cand = (beam_scores[:, None] + rows).reshape(-1)
        s, flat = jax.lax.top_k(cand, budget)
        rank = (flat % k).astype(jnp.int32)
        return (s, rank), (s, (flat // k).astype(jnp.int32), rank)

    steps = lp[1:levels] if transitions is None else transitions[1:levels].astype(jnp.float32)
    _, (deeper_scores, deeper_parent, deeper_rank) = jax.lax.scan(extend, (score1, rank1.astype(jnp.int32)), steps)
    level_scores = jnp.concatenate([score1[None], deeper_scores], axis=0)  # [levels, B]
    beam_parent = jnp.concatenate([jnp.zeros((1, budget), jnp.int32), deeper_parent], axis=0)  # beam index at d-1
    beam_rank = jnp.concatenate([rank1[None].astype(jnp.int32), deeper_rank], axis=0)

    flat_scores = level_scores.reshape(-1)  # level-major: entry = level * B + beam
    entry = jnp.arange(levels * budget, dtype=jnp.int32)
    level_of_entry = entry // budget
    # Keys (-score, depth, entry): entry order inside a depth is the beam order, so the sort is total and
    # deterministic; -inf scores (+inf keys) sort last and become padding.
    _, _, order = jax.lax.sort((-flat_scores, level_of_entry, entry), num_keys=3)
    chosen = order[:budget]  # entries of nodes 1..B

    level = chosen // budget
    beam = chosen % budget
    score = flat_scores[chosen]
    valid = jnp.isfinite(score)
    node_of_entry = jnp.zeros((levels * budget,), jnp.int32).at[chosen].set(jnp.arange(1, budget + 1, dtype=jnp.int32))
    parent_entry = jnp.maximum(level - 1, 0) * budget + beam_parent[level, beam]
    # A valid node's parent entry is itself chosen (closure), so node_of_entry finds it; depth-1 nodes hang
    # off the root.
    parent = jnp.where((level > 0) & valid, node_of_entry[parent_entry], 0)
    rank = beam_rank[level, beam]
    token = tokens[level, jnp.minimum(rank, k - 1)].astype(jnp.int32)  # padded depth-1 ranks may exceed K - 1

    return _assemble(
        tokens=jnp.concatenate([jnp.asarray(root_token, jnp.int32)[None], jnp.where(valid, token, -1)]),
        parents=jnp.concatenate([jnp.zeros((1,), jnp.int32), parent]),
        depths=jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.where(valid, level + 1, 0)]),
        valid=jnp.concatenate([jnp.ones((1,), bool), valid]),
        scores=jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.where(valid, score, -jnp.inf)]),
        ranks=jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.where(valid, rank, -1)]),
        max_depth=d_all,
    )


def chain_tree(tokens: jax.Array, root_token: jax.Array | int = 0, log_probs: jax.Array | None = None) -> Tree:
    """The chain ``root -> tokens[0] -> .. -> tokens[D-1]`` as a tree of budget ``D``: node ``i`` is the
    prefix of ``i`` draft tokens, parent ``i - 1``, depth ``i``, so slot = position offset and the in-block
    visibility is causal: exactly the engine's chain verify block ``[anchor, d_1 .. d_D]``. ``tokens [D]``;
    ``log_probs [D]`` (the chosen tokens' draft log-probs) only fills ``scores`` (their prefix sums; zeros
    without it). Equals ``build_tree`` (``budget = D``) whenever each position's top-1 dominates."""
    d = tokens.shape[0]
    node = jnp.arange(d + 1, dtype=jnp.int32)
    scores = jnp.zeros((d + 1,), jnp.float32)
    if log_probs is not None:
        scores = scores.at[1:].set(jnp.cumsum(log_probs.astype(jnp.float32)))
    return _assemble(
        tokens=jnp.concatenate([jnp.asarray(root_token, jnp.int32)[None], tokens.astype(jnp.int32)]),
        parents=jnp.maximum(node - 1, 0), depths=node, valid=jnp.ones((d + 1,), bool), scores=scores,
        ranks=jnp.zeros((d + 1,), jnp.int32), max_depth=d,
    )


def _assemble(*, parents: jax.Array, max_depth: int, **fields) -> Tree:
    """Adds the ancestor matrix by squaring the reachability matrix ``I | P`` (``P[i, parent(i)]``; the root
    is its own parent): after ``m`` squarings it holds every ancestor up to ``2**m`` steps up, so
    ``ceil(log2(D))`` squarings (``depth <= min(D, B)``) reach the root from any node. A handful of tiny
    matmuls: following the parent chain ``D`` times instead (a chain of gathers, each result read twice) made
    XLA:GPU's fusion duplicate the chain into every consumer: a 16-node tree's decode loop took over 11 GB to
    compile for an H200."""
    n = parents.shape[-1]
    column = jnp.arange(n, dtype=jnp.int32)
    reach = (parents[:, None] == column[None, :]) | (column[:, None] == column[None, :])
    longest = max(1, min(max_depth, n - 1))
    for _ in range((longest - 1).bit_length()):
        r = reach.astype(jnp.float32)
        reach = jnp.matmul(r, r, precision=jax.lax.Precision.HIGHEST) > 0  # counts of paths: any is one
    return Tree(parents=parents, ancestors=reach, max_depth=max_depth, **fields)


# ----------------------------------------------------------------------------------------------------------
# Verify forward


def node_positions(tree: Tree, committed_len: jax.Array) -> jax.Array:
    """``[N]`` RoPE positions: ``committed_len + depth`` (siblings share a position)."""
    return committed_len + tree.depths


def node_slots(tree: Tree, committed_len: jax.Array) -> jax.Array:
    """``[N]`` KV slots written by the verify forward: ``committed_len + node index`` (scratch until the
    commit; needs ``committed_len + B + 1 <= capacity``)."""
    return committed_len + jnp.arange(tree.tokens.shape[-1], dtype=jnp.int32)


def tree_attention_mask(tree: Tree, committed_len: jax.Array, num_slots: int, window: int | None = None) -> jax.Array:
    """``[N, num_slots]`` bool: what node ``i`` may attend to in a linear cache whose slots ``< committed_len``
    hold positions ``0..committed_len-1`` and whose slots ``committed_len + j`` hold node ``j`` (SPEC 12.2):
    the committed context, plus its own ancestors and itself inside the block (never a sibling or a node that
    merely has a smaller index: a slot-causal mask is wrong). ``window`` (a sliding-window layer: a query at
    ``p`` sees keys at ``p - window < q <= p``) is measured on POSITIONS, also for block keys (``len +
    depth``). For a forward that keeps the cache and the block as separate attention segments, the block part
    is just ``tree.ancestors`` and the cache part is this mask's first ``committed_len`` columns."""
    n = tree.tokens.shape[-1]
    slot = jnp.arange(num_slots, dtype=jnp.int32)
    rel = slot - committed_len
    in_block = (rel >= 0) & (rel < n)
    rel = jnp.clip(rel, 0, n - 1)
    visible = (slot < committed_len)[None, :] | (in_block[None, :] & tree.ancestors[:, rel])
    if window is not None:
        key_position = jnp.where(in_block, committed_len + tree.depths[rel], slot)
        visible = visible & (key_position[None, :] > node_positions(tree, committed_len)[:, None] - window)
    return visible


# ----------------------------------------------------------------------------------------------------------
# Acceptance


class TreeAcceptance(NamedTuple):
    num_accepted: jax.Array  # [] L: draft tokens kept (the accepted node's depth), 0..D
    path: jax.Array  # [D + 1] node indices root -> accepted node; path[0] = 0, entries past L are 0
    next_token: jax.Array  # [] the target's own token after the path (bonus; the next round's root)
    tokens: jax.Array  # [D + 1] the emitted tokens: path tokens 1..L, then the bonus from index L on
    last: jax.Array  # [] the deepest accepted node (= path[L]; its state is the one a recurrent layer keeps)


def accept_greedy_tree(tree: Tree, target_logits: jax.Array) -> TreeAcceptance:
    """Greedy verification of one row (SPEC 12.2): ``target_logits [N, V]``, row ``i`` the target's logits
    after node ``i``'s path. A node matches when it is valid and its token is its parent's argmax; the
    accepted node is the deepest node whose whole root path matches. For the chain tree this is
    ``sampling.accept_greedy``."""
    return _walk(tree, argmax(target_logits).astype(jnp.int32))


def accept_sampling_tree(tree: Tree, target_logits: jax.Array, key: jax.Array, cfg: SamplingConfig) -> TreeAcceptance:
    """Lossless sampled verification of one row (SPEC 12.4 Algorithm S): every node draws one token from the
    target's processed distribution (``cfg``'s temperature / top-k / top-p, as the chain's ``accept_sampling``)
    with its own key ``fold_in(key, node)``, then the greedy walk runs with those samples in place of the
    argmaxes and the bonus is the accepted node's sample. The emitted tokens follow the target exactly: node
    ``v``'s sample is read only once the walk reaches ``v``, and which node is reached depends only on its
    ancestors' samples. The draft distribution is not needed (the tree is deterministic given the prefix).

    ``key`` must be fresh per round and per row (``accept_sampling_rows`` splits one key over rows): reusing it
    would correlate rounds. ``cfg.greedy`` gives ``accept_greedy_tree`` (the key is unused)."""
    if cfg.greedy:
        return accept_greedy_tree(tree, target_logits)
    n = tree.tokens.shape[-1]
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(n, dtype=jnp.uint32))
    probs = probabilities(target_logits, cfg)
    samples = jax.vmap(sample)(keys, probs).astype(jnp.int32)
    return _walk(tree, samples)


def _walk(tree: Tree, target_tokens: jax.Array) -> TreeAcceptance:
    """The device form of following the verified tree: ``target_tokens [N]`` is the target's token after each
    node (argmax or sample)."""
    depth = tree.depths
    match = tree.valid & (tree.tokens == target_tokens[tree.parents])
    match = match.at[0].set(True)
    # ok[i]: node i and all its ancestors match. With distinct sibling tokens the ok nodes form one root path.
    ok = ~jnp.any(tree.ancestors & ~match[None, :], axis=-1)
    # Deepest ok node; should siblings share a token (not from top_candidates), the earliest of the deepest.
    last = jnp.argmax(jnp.where(ok, depth, -1)).astype(jnp.int32)
    num = depth[last]
    # The path is read off the ancestors of `last` (one per depth 0..L), so it is a root path even with
    # duplicate siblings; depths past L have no entry and give 0.
    level = jnp.arange(tree.max_depth + 1, dtype=jnp.int32)
    on_path = tree.ancestors[last][None, :] & (depth[None, :] == level[:, None])
    path = jnp.argmax(on_path, axis=-1).astype(jnp.int32)
    bonus = target_tokens[last]
    path_tokens = jnp.concatenate([tree.tokens[path[1:]], jnp.zeros((1,), jnp.int32)])
    emitted = jnp.where(level < num, path_tokens, bonus)  # the chain engine's new_tokens layout
    return TreeAcceptance(num, path, bonus, emitted, last)


# ----------------------------------------------------------------------------------------------------------
# Commit (attention KV)


def commit_permutation(path: jax.Array, num_accepted: jax.Array, budget: int) -> jax.Array:
    """``[B + 1]`` gather indices over a row's verify block (slots ``len .. len + B``) that put accepted node
    ``path[j]`` at block slot ``j`` for ``j <= L`` (node ``path[j]`` has depth ``j``, so its keys are already
    rotated for position ``len + j``: no re-RoPE) and leave slots past ``L`` as they were (stale after the
    commit: the length becomes ``len + L + 1``). ``path [D + 1]`` from an acceptance; ``L <= min(D, B)``.
    Not a bijection (a moved node's old slot may keep its copy); a gather of a read block is order-safe."""
    n = budget + 1
    size = path.shape[-1]
    path = jnp.pad(path, (0, n - size)) if size < n else path[:n]
    slot = jnp.arange(n, dtype=jnp.int32)
    return jnp.where(slot <= num_accepted, path, slot)


def apply_commit(cache_block: jax.Array, perm: jax.Array, axis: int) -> jax.Array:
    """``cache_block`` with ``B + 1`` entries along ``axis`` (a verify block's keys or values) reordered by
    ``perm``: entry ``j`` becomes entry ``perm[j]``."""
    return jnp.take(cache_block, perm, axis=axis)


def commit_cache_slots(cache: jax.Array, committed_len: jax.Array, perm: jax.Array, axis: int) -> jax.Array:
    """One row's cache layer (slots along ``axis``, e.g. 1 for ``[kv_heads, slots, head_dim]``) with its verify
    block (slots ``committed_len .. committed_len + B``) permuted by ``perm``: read the block, write it back
    reordered. Needs ``committed_len + B + 1 <= slots``: ``dynamic_slice`` would otherwise clamp the start and
    move the wrong slots silently. vmap over rows (per-row ``committed_len``); skipping rows whose path is
    ``0..L`` saves nothing on device, the gather is the identity there."""
    n = perm.shape[-1]
    block = jax.lax.dynamic_slice_in_dim(cache, committed_len, n, axis)
    return jax.lax.dynamic_update_slice_in_dim(cache, apply_commit(block, perm, axis), committed_len, axis)


# ----------------------------------------------------------------------------------------------------------
# Rows (leading batch axis), the shapes the engine's round uses


def build_tree_rows(log_probs: jax.Array, tokens: jax.Array, budget: int, root_tokens: jax.Array,
                    transitions: jax.Array | None = None) -> Tree:
    """``log_probs, tokens [R, D, K]``, ``root_tokens [R]`` (``transitions [R, D, K, K]``) -> a Tree with a
    leading ``[R]`` axis."""
    if transitions is None:
        return jax.vmap(lambda lp, tok, root: build_tree(lp, tok, budget, root))(log_probs, tokens, root_tokens)
    return jax.vmap(lambda tok, root, tr: build_tree(None, tok, budget, root, tr))(tokens, root_tokens, transitions)


def accept_greedy_rows(trees: Tree, target_logits: jax.Array) -> TreeAcceptance:
    """``target_logits [R, N, V]``; every output gains a leading ``[R]`` axis."""
    return jax.vmap(accept_greedy_tree)(trees, target_logits)


def accept_sampling_rows(trees: Tree, target_logits: jax.Array, key: jax.Array, cfg: SamplingConfig) -> TreeAcceptance:
    """As ``accept_sampling_tree`` per row, one key split over the rows (rows must not share samples)."""
    if cfg.greedy:
        return accept_greedy_rows(trees, target_logits)
    keys = jax.random.split(key, target_logits.shape[0])
    return jax.vmap(lambda t, lg, k: accept_sampling_tree(t, lg, k, cfg))(trees, target_logits, keys)


# ----------------------------------------------------------------------------------------------------------
# Expected acceptance under the draft's own distributions (the budget choice of ``--tree auto``)


def prefix_mass(trees: Tree) -> jax.Array:
    """``[..., B]``: entry ``n - 1`` is ``Phi(n)``, the draft's probability of the first ``n`` nodes' prefixes
    summed. A node is accepted exactly when its whole prefix is the target's, so if the draft's distributions
    were the target's, ``Phi(n)`` would be the expected accepted drafts of the budget-``n`` tree (CaDDTree's
    surrogate, SPEC 12.5); the first ``n`` nodes of ``build_tree``'s order ARE the budget-``n`` tree (the
    top-``n`` set, every parent first)."""
    mass = jnp.where(trees.valid, jnp.exp(trees.scores), 0.0)[..., 1:]
    return jnp.cumsum(mass, axis=-1)


def spine_mass(candidates: Candidates) -> jax.Array:
    """``[R]``: the same surrogate for the chain (one candidate per position, each the most probable given the
    one before: rank 0 of independent marginals, or a DFlash2 selector's greedy walk over its transitions):
    the sum over depths of the chain prefix's draft probability."""
    if candidates.transitions is None:
        steps = candidates.log_probs[..., 0].astype(jnp.float32)  # [R, D]
    else:
        t = candidates.transitions.astype(jnp.float32)  # [R, D, K, K]; depth 1 reads row 0 (the root)

        def walk(rank, t_d):
            row = jnp.take_along_axis(t_d, rank[:, None, None], axis=1)[:, 0]  # [R, K]
            nxt = jnp.argmax(row, axis=-1)
            return nxt, jnp.take_along_axis(row, nxt[:, None], axis=1)[:, 0]

        _, steps = jax.lax.scan(walk, jnp.zeros(t.shape[0], jnp.int32), jnp.moveaxis(t, 1, 0))
        steps = steps.T
    return jnp.sum(jnp.exp(jnp.cumsum(steps, axis=-1)), axis=-1)
