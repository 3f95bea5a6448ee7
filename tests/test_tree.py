"""Tree verification building blocks (dflash_jax/engine/tree.py, SPEC section 12) against plain references:
brute-force prefix enumeration, a Python walk over children dicts, exact target probabilities (chi-square),
and slot bookkeeping. fp32, tiny shapes, each jitted function compiled once per shape."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from dflash_jax.engine import tree as T
from dflash_jax.engine.sampling import SamplingConfig, accept_greedy, probabilities, sample

_build = jax.jit(T.build_tree, static_argnames=("budget",))
top = jax.jit(T.top_candidates, static_argnames=("k", "temperature"))
chain = jax.jit(T.chain_tree)
engine_accept_greedy = jax.jit(accept_greedy)
greedy = jax.jit(T.accept_greedy_tree)
mask_of = jax.jit(T.tree_attention_mask, static_argnames=("num_slots", "window"))
commit_slots = jax.jit(T.commit_cache_slots, static_argnames=("axis",))
permutation = jax.jit(T.commit_permutation, static_argnames=("budget",))
build_rows = jax.jit(T.build_tree_rows, static_argnames=("budget",))
greedy_rows = jax.jit(T.accept_greedy_rows)
sampling_rows = jax.jit(T.accept_sampling_rows, static_argnames=("cfg",))


def build(lp, tok, budget, root=0):
    """build_tree with the root always an int32 scalar (a Python int would be weakly typed: a second compile)."""
    return _build(lp, tok, budget=budget, root_token=np.int32(root))


def normal(seed, shape, scale=1.0):
    """Test inputs from NumPy (eager JAX ops would each compile a small program)."""
    return (np.random.default_rng(seed).normal(size=shape) * scale).astype(np.float32)


# The losslessness tests reject at p < 1e-3: a correct sampler fails one of them once in a thousand runs (the
# keys are fixed, so the outcome is deterministic; the threshold guards against an unlucky choice of seeds).
P_THRESHOLD = 1e-3


# ----------------------------------------------------------------------------------------------------------
# Construction


def reference_prefixes(lp: np.ndarray, budget: int) -> list[tuple[tuple[int, ...], np.float32]]:
    """All prefixes over the K candidates of each of the D positions, best ``budget`` first, finite scores
    only. Scores are float32 running sums in depth order (bit-equal to the beam's). Order: score desc, depth
    asc, then within a depth by (parent's place in that depth's full order, rank): tree.py's documented rule,
    applied here to the full enumeration rather than a beam."""
    lp = np.asarray(lp, np.float32)
    d_all, k = lp.shape
    previous = [((), np.float32(0.0))]
    levels = []
    for d in range(d_all):
        cand = []
        for parent_place, (ranks, score) in enumerate(previous):
            for r in range(k):
                s = lp[0, r] if d == 0 else np.float32(score + lp[d, r])
                cand.append((ranks + (r,), s, parent_place, r))
        cand.sort(key=lambda c: (-c[1], c[2], c[3]))
        previous = [(c[0], c[1]) for c in cand]
        levels.append(previous)
    everything = [(ranks, s, d, place) for d, lev in enumerate(levels) for place, (ranks, s) in enumerate(lev)]
    everything.sort(key=lambda c: (-c[1], c[2], c[3]))
    return [(ranks, s) for ranks, s, _, _ in everything[:budget] if np.isfinite(s)]


def rank_paths(tree) -> list[tuple[int, ...]]:
    """Each valid non-root node's rank tuple, read through ``parents`` and ``ranks``."""
    parents, ranks, valid = (np.asarray(x) for x in (tree.parents, tree.ranks, tree.valid))
    out = []
    for i in range(1, len(parents)):
        if not valid[i]:
            continue
        path, node = [], i
        while node != 0:
            path.append(int(ranks[node]))
            node = int(parents[node])
        out.append(tuple(reversed(path)))
    return out


def check_against_reference(lp, tok, budget, root=7):
    lp, tok = np.asarray(lp, np.float32), np.asarray(tok, np.int32)
    tree = build(lp, tok, budget, root)
    expect = reference_prefixes(lp, budget)
    n_valid = len(expect)
    tokens, parents, depths, valid, scores, anc = (np.asarray(x) for x in (
        tree.tokens, tree.parents, tree.depths, tree.valid, tree.scores, tree.ancestors))
    assert tokens.shape == (budget + 1,) and anc.shape == (budget + 1, budget + 1)
    assert tree.max_depth == lp.shape[0]
    # Root.
    assert tokens[0] == root and parents[0] == 0 and depths[0] == 0 and valid[0] and scores[0] == 0
    # Valid nodes first, in the reference's exact order; padding after.
    assert valid[1:].tolist() == [True] * n_valid + [False] * (budget - n_valid)
    paths = rank_paths(tree)
    assert paths == [ranks for ranks, _ in expect]
    place = {ranks: i + 1 for i, ranks in enumerate(paths)}
    for i, (ranks, s) in enumerate(expect, start=1):
        assert scores[i] == s
        assert depths[i] == len(ranks)
        assert tokens[i] == tok[len(ranks) - 1, ranks[-1]]
        assert parents[i] == place.get(ranks[:-1], 0) and parents[i] < i  # parents precede children
        want = {0, i} | {place[ranks[:j]] for j in range(1, len(ranks))}
        assert set(np.flatnonzero(anc[i])) == want
    # Padding: unmatchable, hangs off the root, sees only the root and itself.
    for i in range(n_valid + 1, budget + 1):
        assert tokens[i] == -1 and parents[i] == 0 and depths[i] == 0 and scores[i] == -np.inf
        assert set(np.flatnonzero(anc[i])) == {0, i}
    assert set(np.flatnonzero(anc[0])) == {0}
    assert np.all(np.diff(scores[1:n_valid + 1]) <= 0)
    return tree


@pytest.mark.parametrize("d,v,k,budget", [(4, 12, 4, 10), (4, 12, 6, 4), (5, 8, 2, 12)])
def test_build_tree_matches_brute_force(d, v, k, budget):
    """Random marginals, several seeds each: K < B (the beam keeps more than K entries per depth), K > B
    (depth 1 truncated), and a narrow deep case (K = 2, D = 5: 62 prefixes for 12 nodes)."""
    for seed in range(4):
        lp, tok = top(normal(seed, (d, v), 2.0), k=k)
        check_against_reference(lp, tok, budget)


@pytest.mark.parametrize("budget", [5, 13])
def test_markov_tree_matches_brute_force(budget):
    """DFlash2 transitions (a candidate's log-prob depends on its parent's rank): the tree holds exactly the
    ``budget`` best prefixes of a full enumeration under the Markov scores (random float scores: no ties),
    each with its exact score, parents before children."""
    d, k = 4, 3
    for seed in range(3):
        rng = np.random.default_rng(seed)
        trans = rng.normal(size=(d, k, k)).astype(np.float32) * 2
        trans = trans - np.log(np.exp(trans).sum(-1, keepdims=True))  # rows normalised
        tok = rng.permutation(50)[: d * k].reshape(d, k).astype(np.int32)
        tree = jax.jit(T.build_tree, static_argnames=("budget",))(None, tok, budget=budget, root_token=np.int32(3),
                                                                   transitions=trans)
        every = {}
        for depth in range(1, d + 1):
            for ranks in itertools.product(range(k), repeat=depth):
                score, prev = np.float32(0), 0
                for j, r in enumerate(ranks):
                    score = np.float32(score + trans[j, prev if j else 0, r])
                    prev = r
                every[ranks] = score
        best = sorted(every, key=lambda r: -every[r])[:budget]
        paths = rank_paths(tree)
        assert sorted(paths) == sorted(best)
        scores, parents = np.asarray(tree.scores), np.asarray(tree.parents)
        for i, ranks in enumerate(paths, start=1):
            np.testing.assert_allclose(scores[i], every[ranks], rtol=1e-6)
            assert np.asarray(tree.tokens)[i] == tok[len(ranks) - 1, ranks[-1]] and parents[i] < i


def test_build_tree_budget_exceeds_prefixes_and_impossible_candidates():
    # D=2, K=3: 3 + 9 = 12 prefixes; vocabulary entries at -inf (a masked vocabulary) leave 2 finite
    # candidates per position, so 2 + 4 = 6 finite prefixes for a budget of 9: 3 padding nodes.
    logits = np.full((2, 12), -np.inf, np.float32)
    logits[:, 3], logits[:, 8] = 1.0, 0.5
    lp, tok = top(logits, k=3)
    assert np.isneginf(np.asarray(lp[:, 2])).all()
    tree = check_against_reference(lp, tok, 9)
    assert int(tree.valid.sum()) == 7 and set(np.asarray(tree.tokens[1:7])) == {3, 8}
    # D=1, K=3: 3 prefixes in all for a budget of 9 (and no deeper level for the beam to scan).
    lp, tok = top(normal(6, (1, 12)), k=3)
    tree = check_against_reference(lp, tok, 9)
    assert int(tree.valid.sum()) == 4 and tree.max_depth == 1


def test_build_tree_ties():
    """Exactly representable log-probs with many equal sums, including a 0 (a child equal to its parent)."""
    lp = np.array([[-1.0, -1.0, -2.0], [0.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], np.float32)
    tok = np.array([[4, 2, 9], [1, 5, 3], [0, 6, 8]], np.int32)
    for budget in (7, 12):
        check_against_reference(lp, tok, budget)
    # Equal logits: top_candidates keeps the lower token id first, so the tree is reproducible.
    lp_eq, tok_eq = top(np.zeros((3, 12), np.float32), k=3)
    assert np.asarray(tok_eq).tolist() == [[0, 1, 2]] * 3
    np.testing.assert_allclose(np.asarray(lp_eq), np.log(1 / 12), rtol=1e-6)
    check_against_reference(lp_eq, tok_eq, 12)


def test_top_candidates_normalises_over_the_vocabulary():
    logits = normal(3, (4, 12))
    lp, tok = top(logits, k=4)
    full = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(lp), np.take_along_axis(full, np.asarray(tok), 1), atol=1e-6)
    assert np.all(np.diff(np.asarray(lp), axis=1) <= 0)
    assert np.asarray(tok).tolist() == np.argsort(-logits, axis=1, kind="stable")[:, :4].tolist()


def dominant_logits(seed, d, v):
    """Draft logits whose top-1 at every position has probability ~1 (margin 40)."""
    favourite = np.random.default_rng(seed).integers(0, v, size=d).astype(np.int32)
    logits = normal(seed, (d, v))
    logits[np.arange(d), favourite] += 40.0
    return logits, favourite


def test_chain_tree_is_build_tree_with_a_dominant_top1():
    d, v = 5, 12
    for seed in range(3):
        logits, favourite = dominant_logits(seed, d, v)
        lp, tok = top(logits, k=4)
        built = build(lp, tok, d, 3)
        chained = chain(favourite, np.int32(3), lp[:, 0])
        for field in ("tokens", "parents", "depths", "valid", "ancestors", "ranks"):
            np.testing.assert_array_equal(np.asarray(getattr(built, field)), np.asarray(getattr(chained, field)), field)
        np.testing.assert_allclose(np.asarray(built.scores), np.asarray(chained.scores), atol=1e-5)
        assert built.max_depth == chained.max_depth == d


def test_chain_tree_is_the_engine_chain():
    """The chain tree's verify layout is the engine's chain block (slot = position, causal visibility), and
    its greedy acceptance is ``sampling.accept_greedy``."""
    d, v, length = 5, 12, 4
    drafts = np.random.default_rng(0).integers(0, v, size=d).astype(np.int32)
    tree = chain(drafts, np.int32(2), None)
    np.testing.assert_array_equal(np.asarray(T.node_positions(tree, length)), length + np.arange(d + 1))
    np.testing.assert_array_equal(np.asarray(T.node_slots(tree, length)), length + np.arange(d + 1))
    causal = np.arange(16)[None, :] <= length + np.arange(d + 1)[:, None]
    np.testing.assert_array_equal(np.asarray(mask_of(tree, length, num_slots=16)), causal)
    for accepted in range(d + 1):
        # Target argmax agrees with the first `accepted` drafts, then disagrees.
        logits = normal(10 + accepted, (d + 1, v))
        padded = np.append(drafts, 0)
        wanted = np.where(np.arange(d + 1) < accepted, padded, (padded + 1) % v)
        logits[np.arange(d + 1), wanted] += 20.0
        got = greedy(tree, logits)
        ref = engine_accept_greedy(drafts[None], logits[None])
        assert int(got.num_accepted) == int(ref.num_accepted[0]) == accepted
        assert int(got.next_token) == int(ref.next_token[0])
        np.testing.assert_array_equal(np.asarray(got.path[: accepted + 1]), np.arange(accepted + 1))
        new_tokens = np.where(np.arange(d + 1) < accepted, padded, int(ref.next_token[0]))
        np.testing.assert_array_equal(np.asarray(got.tokens), new_tokens)


# ----------------------------------------------------------------------------------------------------------
# Verify mask


def test_tree_attention_mask_matches_positions_and_ancestors():
    lp, tok = top(normal(7, (4, 12), 2.0), k=4)
    tree = build(lp, tok, 10, 1)
    length, slots = 6, 24
    anc, depths = np.asarray(tree.ancestors), np.asarray(tree.depths)
    position = length + depths
    for window in (None, 3, 5):
        got = np.asarray(mask_of(tree, length, num_slots=slots, window=window))
        want = np.zeros_like(got)
        for i in range(11):
            for s in range(slots):
                if s < length:
                    key_position, visible = s, True
                elif s <= length + 10:
                    key_position, visible = length + depths[s - length], anc[i, s - length]
                else:
                    key_position, visible = s, False
                if window is not None:
                    visible = visible and position[i] - window < key_position <= position[i]
                want[i, s] = visible
        np.testing.assert_array_equal(got, want, f"window={window}")


# ----------------------------------------------------------------------------------------------------------
# Greedy acceptance


def follow_verified_tree(tokens, parents, valid, logits, max_depth):
    """Plain Python walk: children dicts, follow the target's argmax while a child carries it."""
    children: dict[int, dict[int, int]] = {}
    for i in range(1, len(tokens)):
        if valid[i]:
            children.setdefault(int(parents[i]), {})[int(tokens[i])] = i
    node, path = 0, [0]
    y = int(np.argmax(logits[0]))
    while y in children.get(node, {}):
        node = children[node][y]
        path.append(node)
        y = int(np.argmax(logits[node]))
    accepted = len(path) - 1
    emitted = [int(tokens[n]) for n in path[1:]] + [y] * (max_depth + 1 - accepted)
    return accepted, path + [0] * (max_depth - accepted), y, emitted


def steered_logits(rng, tree, v, mode):
    """Target logits [N, V] with a unique argmax per node: `agree` steers most nodes' argmax to one of their
    children (so walks go deep), `deepest` accepts a whole path to a deepest node, `none` rejects at the root."""
    tokens, parents, valid, depths = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.valid, tree.depths))
    n = len(tokens)
    kids = {i: [j for j in range(1, n) if valid[j] and parents[j] == i] for i in range(n)}
    logits = rng.normal(size=(n, v)).astype(np.float32)
    target = rng.integers(0, v, size=n)
    if mode == "agree":
        for i in range(n):
            if kids[i] and rng.random() < 0.75:
                target[i] = tokens[rng.choice(kids[i])]
    elif mode == "deepest":
        node = int(np.argmax(np.where(valid, depths, -1)))
        while node != 0:
            target[parents[node]] = tokens[node]
            node = int(parents[node])
    elif mode == "none":
        target[0] = next(t for t in range(v) if t not in {int(tokens[j]) for j in kids[0]})
    logits[np.arange(n), target] += 10.0
    return logits


@pytest.mark.parametrize("mode", ["agree", "deepest", "none"])
def test_accept_greedy_tree_matches_python_walk(mode):
    d, v, budget = 4, 12, 10
    rng = np.random.default_rng({"agree": 0, "deepest": 1, "none": 2}[mode])
    seen_depths = set()
    for seed in range(6):
        draft = normal(seed, (d, v), 2.0)
        if seed % 3 == 2:  # masked vocabulary: 1 finite candidate per position -> a chain + 6 padding nodes
            draft[:, 1:] = -np.inf
        lp, tok = top(draft, k=4)
        tree = build(lp, tok, budget, int(rng.integers(v)))
        if seed % 3 == 2:
            assert not np.asarray(tree.valid).all()
        logits = steered_logits(rng, tree, v, mode)
        got = greedy(tree, logits)
        accepted, path, bonus, emitted = follow_verified_tree(
            *(np.asarray(x) for x in (tree.tokens, tree.parents, tree.valid)), logits, d)
        assert int(got.num_accepted) == accepted
        assert np.asarray(got.path).tolist() == path
        assert int(got.next_token) == bonus and int(got.last) == path[accepted]
        assert np.asarray(got.tokens).tolist() == emitted
        seen_depths.add(accepted)
        if mode == "deepest":
            assert accepted == int(np.asarray(tree.depths).max())
        if mode == "none":
            assert accepted == 0
    if mode == "agree":
        assert len(seen_depths) > 1


def test_rows_match_single_rows():
    d, v, budget, rows = 4, 12, 10, 3
    roots = np.array([1, 5, 9], np.int32)
    candidates = [top(normal(40 + r, (d, v), 2.0), k=4) for r in range(rows)]
    singles = [build(lp, tok, budget, root) for (lp, tok), root in zip(candidates, roots)]
    rng = np.random.default_rng(3)
    logits = np.stack([steered_logits(rng, one, v, "agree") for one in singles])
    lp, tok = (np.stack([np.asarray(c[i]) for c in candidates]) for i in (0, 1))
    trees = build_rows(lp, tok, budget=budget, root_tokens=roots)
    got = greedy_rows(trees, logits)
    for r, one in enumerate(singles):
        for field in ("tokens", "parents", "depths", "valid", "ancestors", "scores", "ranks"):
            np.testing.assert_array_equal(np.asarray(getattr(trees, field)[r]), np.asarray(getattr(one, field)))
        for a, b in zip(got, greedy(one, logits[r])):
            np.testing.assert_array_equal(np.asarray(a[r]), np.asarray(b))


# ----------------------------------------------------------------------------------------------------------
# Lossless sampling (SPEC 12.4 Algorithm S)

V_TOY, D_TOY, B_TOY, ROOT, ROUNDS = 6, 3, 6, 2, 20000


def toy_problem():
    """Target: the next token's logits are a fixed random function of the last token (a bigram model).
    Draft: fixed marginals per position, the target's along its argmax chain plus noise (informative but
    mismatched, so rounds accept 0..3 tokens). The tree and every node's target logits follow from the
    committed prefix alone, as in a real round. Seed 12: the root's children are {3}, token 3's are {2, 0, 1},
    and two depth-3 nodes, so first, second and third tokens are all tested."""
    rng = np.random.default_rng(12)
    bigram = rng.normal(size=(V_TOY, V_TOY)).astype(np.float32) * 1.5
    spine = [ROOT]
    for _ in range(D_TOY - 1):
        spine.append(int(np.argmax(bigram[spine[-1]])))
    draft = bigram[spine] + rng.normal(size=(D_TOY, V_TOY)).astype(np.float32)
    lp, tok = top(draft, k=min(B_TOY, V_TOY))
    tree = build(lp, tok, B_TOY, ROOT)
    node_logits = jnp.asarray(bigram[np.maximum(np.asarray(tree.tokens), 0)])  # padding rows are never read
    return bigram, tree, node_logits


def processed(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """NumPy reference of the engine's temperature / top-k / top-p processing, one distribution per row."""
    x = logits.astype(np.float64) / cfg.temperature
    if cfg.top_k:
        kth = np.sort(x, axis=-1)[..., -cfg.top_k][..., None]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if cfg.top_p < 1:
        for row in p.reshape(-1, p.shape[-1]):
            mass = np.array([row[row >= t].sum() for t in row])
            threshold = row[mass >= cfg.top_p - 1e-6].max()
            row[row < threshold] = 0
            row /= row.sum()
    return p


def tree_prefix_probabilities(bigram, tree, cfg, k):
    """Exact probabilities of the first ``k`` emitted tokens, conditioned on the round emitting at least ``k``
    (the path's first ``k - 1`` tokens are a tree path: an event of those tokens only, so the conditional is the
    target's chain rule restricted to them). Returns {token tuple: probability}."""
    p = processed(bigram, cfg)  # p[a] = the target's processed distribution after token a
    tokens, parents, depths, valid = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.depths, tree.valid))
    heads = []  # token tuples of the tree paths of depth k - 1
    for i in range(len(tokens)):
        if valid[i] and depths[i] == k - 1:
            path, node = [], i
            while node != 0:
                path.append(int(tokens[node]))
                node = int(parents[node])
            heads.append(tuple(reversed(path)))
    table = {}
    for head in heads:
        weight, last = 1.0, ROOT
        for t in head:
            weight *= p[last, t]
            last = t
        for y in range(V_TOY):
            table[head + (y,)] = weight * p[last, y]
    total = sum(table.values())
    return {key: value / total for key, value in table.items()}


def chi_square_p(samples: np.ndarray, expected: dict) -> float:
    """p-value of observed token tuples against exact probabilities; cells expecting < 5 are pooled (and the
    pool joins the smallest remaining cell if it still expects < 5). A sample outside the support gives 0."""
    unique, number = np.unique(samples, axis=0, return_counts=True)
    counts = {tuple(row): int(c) for row, c in zip(unique.tolist(), number)}
    if any(key not in expected or expected[key] == 0 for key in counts):
        return 0.0
    n = len(samples)
    cells = sorted(expected, key=expected.get)
    obs = np.array([counts.get(c, 0) for c in cells], float)
    exp = np.array([expected[c] * n for c in cells])
    small = exp < 5
    obs_big, exp_big = list(obs[~small]), list(exp[~small])
    if small.any():
        if exp[small].sum() >= 5 or not exp_big:
            obs_big, exp_big = [obs[small].sum()] + obs_big, [exp[small].sum()] + exp_big
        else:
            obs_big[0] += obs[small].sum()
            exp_big[0] += exp[small].sum()
    if len(exp_big) < 2:
        return 1.0
    exp_big = np.array(exp_big)
    return float(chisquare(obs_big, exp_big * sum(obs_big) / exp_big.sum()).pvalue)


@functools.partial(jax.jit, static_argnames=("cfg", "control"))
def many_rounds(tree, node_logits, keys, cfg, control=None):
    """One round per key from the same committed prefix. ``control`` picks a LOSSY variant the same test must
    reject: "greedy_walk" (argmax walk, then a sampled bonus) or "shared_key" (Algorithm S with one key for
    every node instead of ``fold_in(key, node)``: correlated draws along a path)."""

    def one(key):
        if control is None:
            return T.accept_sampling_tree(tree, node_logits, key, cfg)
        probs = probabilities(node_logits, cfg)
        if control == "shared_key":
            return T._walk(tree, jax.vmap(sample, in_axes=(None, 0))(key, probs).astype(jnp.int32))
        acc = T.accept_greedy_tree(tree, node_logits)
        bonus = sample(key, probs[acc.last]).astype(jnp.int32)
        emitted = jnp.where(jnp.arange(tree.max_depth + 1) < acc.num_accepted, acc.tokens, bonus)
        return acc._replace(next_token=bonus, tokens=emitted)

    return jax.vmap(one)(keys)


def emitted_prefix_p_values(cfg, control=None):
    bigram, tree, node_logits = toy_problem()
    keys = jax.random.split(jax.random.PRNGKey(123), ROUNDS)
    out = many_rounds(tree, node_logits, keys, cfg, control)
    num, tokens = np.asarray(out.num_accepted), np.asarray(out.tokens)
    # Sanity of the round itself: bonus at index L, path tokens before it.
    np.testing.assert_array_equal(tokens[np.arange(ROUNDS), num], np.asarray(out.next_token))
    p_values, sizes = {}, {}
    for k in (1, 2, 3):
        reach = num >= k - 1
        sizes[k] = int(reach.sum())
        p_values[k] = chi_square_p(tokens[reach, :k], tree_prefix_probabilities(bigram, tree, cfg, k))
    return p_values, sizes, tree


SAMPLING_CONFIGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_k=4, top_p=0.9)]


@pytest.mark.parametrize("cfg", SAMPLING_CONFIGS, ids=["t1", "t0.8-k4-p0.9"])
def test_accept_sampling_tree_is_lossless(cfg):
    """First token always, first two tokens when >= 2 are emitted, first three when >= 3: each against the
    target's exact probabilities, chi-square p > 1e-3."""
    p_values, sizes, tree = emitted_prefix_p_values(cfg)
    assert int(np.asarray(tree.depths).max()) >= 2  # the toy tree branches and goes deep enough for k = 3
    assert sizes[1] == ROUNDS and sizes[2] > 3000 and sizes[3] > 3000, sizes
    assert all(p > P_THRESHOLD for p in p_values.values()), (p_values, sizes)


@pytest.mark.parametrize("control", ["greedy_walk", "shared_key"])
def test_negative_controls_fail_the_same_test(control):
    """The chi-square test has power: a greedy walk with a sampled bonus, and Algorithm S with one key reused
    by every node, both give p < 1e-3 on the first two tokens (the first token alone is right in the second)."""
    p_values, sizes, _ = emitted_prefix_p_values(SAMPLING_CONFIGS[0], control=control)
    assert sizes[2] > 3000, sizes
    assert p_values[2] < P_THRESHOLD, (p_values, sizes)


def test_accept_sampling_rows_draw_independently_per_row():
    _, tree, node_logits = toy_problem()
    rows = 64
    trees = jax.tree_util.tree_map(lambda x: np.broadcast_to(np.asarray(x), (rows,) + x.shape), tree)
    logits = np.broadcast_to(np.asarray(node_logits), (rows,) + node_logits.shape)
    out = sampling_rows(trees, logits, jax.random.PRNGKey(0), cfg=SAMPLING_CONFIGS[0])
    assert len({tuple(r) for r in np.asarray(out.tokens).tolist()}) > 10  # rows do not share samples


def test_rounds_trace_inside_a_while_loop():
    """The engine's shape of use: rows of trees built, verified and committed inside ``lax.while_loop`` (the
    bonus becomes the next root, the length grows by L + 1). Traced only (``eval_shape``): no compile."""
    rows, d, k, budget, v, slots = 2, 4, 4, 6, 12, 32
    cfg = SamplingConfig(temperature=1.0, top_p=0.9)

    def decode(draft_logits, target_logits, cache, key):
        def body(carry):
            step, roots, lengths, cache, key = carry
            key, k_accept = jax.random.split(key)
            lp, tok = T.top_candidates(draft_logits, k)  # [rows, D, K]: top_candidates maps leading axes
            trees = T.build_tree_rows(lp, tok, budget, roots)
            acc = T.accept_sampling_rows(trees, target_logits, k_accept, cfg)
            perm = jax.vmap(T.commit_permutation, in_axes=(0, 0, None))(acc.path, acc.num_accepted, budget)
            cache = jax.vmap(T.commit_cache_slots, in_axes=(0, 0, 0, None))(cache, lengths, perm, 1)
            return step + 1, acc.next_token, lengths + acc.num_accepted + 1, cache, key

        init = (0, jnp.zeros((rows,), jnp.int32), jnp.zeros((rows,), jnp.int32), cache, key)
        return jax.lax.while_loop(lambda c: c[0] < 3, body, init)

    out = jax.eval_shape(decode, jax.ShapeDtypeStruct((rows, d, v), jnp.float32),
                         jax.ShapeDtypeStruct((rows, budget + 1, v), jnp.float32),
                         jax.ShapeDtypeStruct((rows, 2, slots, 8), jnp.float32), jax.random.PRNGKey(0))
    assert out[1].shape == (rows,) and out[3].shape == (rows, 2, slots, 8)


# ----------------------------------------------------------------------------------------------------------
# Commit


@pytest.mark.parametrize("d,budget", [(4, 10), (6, 3)])
def test_commit_moves_the_path_to_the_linear_prefix(d, budget):
    """KV slot ``len + path[j]`` lands at ``len + j`` for j <= L; every other slot keeps its value. (6, 3):
    a path [D + 1] longer than the block [B + 1]."""
    v, length, slots, heads, dim = 12, 5, 24, 2, 3
    rng = np.random.default_rng(d)
    lp, tok = top(normal(d, (d, v), 2.0), k=4)
    tree = build(lp, tok, budget, 0)
    acc = greedy(tree, steered_logits(rng, tree, v, "deepest"))
    path, num = np.asarray(acc.path), int(acc.num_accepted)
    assert num >= 1 and (path[: num + 1] != np.arange(num + 1)).any()  # a path that really moves slots
    perm = np.asarray(permutation(acc.path, acc.num_accepted, budget=budget))
    assert perm.shape == (budget + 1,)
    np.testing.assert_array_equal(perm[: num + 1], path[: num + 1])
    np.testing.assert_array_equal(perm[num + 1:], np.arange(num + 1, budget + 1))
    # A cache whose every entry names its (head, slot).
    cache = np.arange(heads)[:, None, None] * 1000 + np.arange(slots)[None, :, None] + np.zeros(dim)
    cache = cache.astype(np.float32)
    got = np.asarray(commit_slots(cache, np.int32(length), perm, axis=1))
    want = cache.copy()
    for j in range(num + 1):
        want[:, length + j] = cache[:, length + path[j]]
    np.testing.assert_array_equal(got, want)
    # The block-level gather is the same move.
    block = cache[:, length: length + budget + 1]
    np.testing.assert_array_equal(np.asarray(T.apply_commit(block, perm, axis=1)), want[:, length: length + budget + 1])
    # The chain's path 0..L is the identity.
    identity = np.asarray(permutation(np.arange(d + 1, dtype=np.int32), np.int32(min(d, budget)), budget=budget))
    np.testing.assert_array_equal(identity, np.arange(budget + 1))
