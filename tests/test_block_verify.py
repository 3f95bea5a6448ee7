"""Block verification (``sampling.accept_block``; Sun et al., arXiv 2403.10444) against exact distributions.

A toy target and a mismatched draft over a 5-token vocabulary whose conditionals depend on the whole prefix
(fixed random tables, NumPy). Drafts ``X_1..X_3`` are drawn from the draft's conditionals in NumPy; one call
verifies them all (200,000 rows). The first two emitted tokens (a round that keeps no draft is continued with
an exact target sample, as the next round would) must follow the target's chain rule: Pearson's chi-square
over the 25 pairs, p > 1e-3, with a negative control (the same samples against another target fail, and
so does token-wise rejection's output against the wrong residual). Block verification must keep more drafts
on average than token-wise rejection (``accept_sampling``) on the same drafts: the paper's guarantee, here
by many standard errors.
"""

import jax
import numpy as np
import pytest

from dflash_jax.engine.sampling import SamplingConfig, accept_block, accept_sampling

stats = pytest.importorskip("scipy.stats")

V, K, N = 5, 3, 100_000
CFG = SamplingConfig(1.0)


def table(seed, sharp):
    """``[t_0, .., t_{K+1}]``: ``t_n`` has shape ``[V] * n + [V]``, the distribution after each prefix of n tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for n in range(K + 2):
        x = rng.normal(size=(V,) * n + (V,)) * sharp
        out.append(np.exp(x) / np.exp(x).sum(-1, keepdims=True))
    return out


P, Q = table(0, 1.5), table(1, 1.5)


def at(t, prefixes):
    """Rows' distributions after their prefixes (``prefixes [N, n]``)."""
    return t[prefixes.shape[1]][tuple(prefixes.T)]


def draw(rng, probs):
    """One sample per row of ``probs [N, V]`` (inverse CDF)."""
    return np.minimum((np.cumsum(probs, axis=1) < rng.random((len(probs), 1))).sum(1), V - 1).astype(np.int32)


@pytest.fixture(scope="module")
def verified():
    rng = np.random.default_rng(7)
    drafts = np.zeros((N, K), np.int32)
    q = np.zeros((N, K, V), np.float32)
    logits = np.zeros((N, K + 1, V), np.float32)
    for j in range(K):
        q[:, j] = at(Q, drafts[:, :j])
        logits[:, j] = np.log(at(P, drafts[:, :j]))
        drafts[:, j] = draw(rng, q[:, j])
    logits[:, K] = np.log(at(P, drafts))
    block = jax.jit(accept_block, static_argnames="cfg")(jax.random.PRNGKey(1), drafts, q, logits, cfg=CFG)
    token = jax.jit(accept_sampling, static_argnames="cfg")(jax.random.PRNGKey(2), drafts, q, logits, cfg=CFG)
    return drafts, block, token


def first_two(drafts, acceptance, seed):
    """``[N, 2]``: the first two emitted tokens of every row: drafts kept, then the next token; a row that kept
    no draft continues with an exact target sample after its next token."""
    num, nxt = np.asarray(acceptance.num_accepted), np.asarray(acceptance.next_token)
    first = np.where(num >= 1, drafts[:, 0], nxt)
    second = np.where(num >= 2, drafts[:, 1], np.where(num == 1, nxt, 0))
    fresh = draw(np.random.default_rng(seed), at(P, first[:, None]))
    return np.stack([first, np.where(num == 0, fresh, second)], axis=1)


def chi_square_p(pairs, target):
    counts = np.zeros((V, V))
    np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
    expected = target[0][:, None] * target[1] * len(pairs)
    return float(stats.chisquare(counts.ravel(), expected.ravel()).pvalue)


def test_block_verification_is_lossless(verified):
    drafts, block, _ = verified
    pairs = first_two(drafts, block, seed=3)
    assert chi_square_p(pairs, P) > 1e-3
    assert chi_square_p(pairs, table(5, 1.5)) < 1e-3  # negative control: another target


def test_token_wise_rejection_is_lossless_and_the_control_fails(verified):
    drafts, _, token = verified
    pairs = first_two(drafts, token, seed=4)
    assert chi_square_p(pairs, P) > 1e-3
    # A wrong verifier fails: the target's own sample in place of the residual at the first rejection.
    num = np.asarray(token.num_accepted)
    wrong = token._replace(next_token=np.where(num < K, drafts[np.arange(N), np.minimum(num, K - 1)],
                                                np.asarray(token.next_token)))
    assert chi_square_p(first_two(drafts, wrong, seed=4), P) < 1e-3


def test_block_verification_keeps_more_drafts(verified):
    _, block, token = verified
    b, t = (np.asarray(x.num_accepted, np.float64) for x in (block, token))
    se = np.sqrt(b.var() / N + t.var() / N)
    print(f"mean drafts kept: block {b.mean():.4f}, token-wise {t.mean():.4f} (se of the difference {se:.4f})")
    assert b.mean() - t.mean() > 4 * se
