"""``--tree auto`` (engine/adaptive.py, "Tree budget"): the chain or a tree budget per phase of rounds.

References: brute-force enumeration of every draft prefix (NumPy) for the surrogate the choice reads
(``tree.prefix_mass``: the draft probability of the budget-``n`` tree's prefixes; ``tree.spine_mass``: of the
chain's); the policy's decisions on hand-made observations, checked against what its documented rule implies
(a tree that cannot pay is never probed; probes back off; a tree that pays is kept); and in the engine, the
target's own autoregressive output (every phase, chain or tree, is lossless) and today's chain run (an auto
run whose trees cannot pay IS the chain: same tokens, same acceptance lengths round by round; one whose
calibration shows no tree can pay runs the chain's own program).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.engine import adaptive
from dflash_jax.engine import tree as T
from dflash_jax.engine.generate import DecodeSettings, generate
from dflash_jax.engine.proposers import DFlashProposer, NoProposer, OracleProposer
from dflash_jax.errors import UserError
from dflash_jax.models.draft import shared_head
from engine_tiny import planted_schedule, tiny_draft, tiny_target

BLOCK = 8
MAX_NEW = 48


# ----------------------------------------------------------------------------------------------------------
# The surrogate, against a full enumeration


def _all_prefixes(step_lp):
    """{rank tuple: probability} of every prefix; ``step_lp(depth, parent_rank, rank)`` is a log-prob."""
    d, k = step_lp.shape_dk
    out = {}
    for depth in range(1, d + 1):
        for ranks in itertools.product(range(k), repeat=depth):
            lp, prev = 0.0, 0
            for j, r in enumerate(ranks):
                lp += step_lp(j, prev, r)
                prev = r
            out[ranks] = np.exp(lp)
    return out


class Independent:
    def __init__(self, lp):
        self.lp, self.shape_dk = lp, lp.shape

    def __call__(self, j, prev, r):
        return float(self.lp[j, r])


class Markov:
    def __init__(self, trans):
        self.t, self.shape_dk = trans, trans.shape[:2]

    def __call__(self, j, prev, r):
        return float(self.t[j, prev if j else 0, r])


def _normalised(x, axis=-1):
    return (x - np.log(np.exp(x).sum(axis, keepdims=True))).astype(np.float32)


def test_prefix_and_spine_mass_equal_brute_force():
    """Phi(n) of a tree of budget B, for every n <= B, is the summed probability of the n most probable
    prefixes of a full enumeration; the spine's is the summed probability of the greedy chain's prefixes (rank 0
    of independent marginals; for Markov transitions, each step's most probable successor). Random float
    scores (no ties), float32 against float64: 1e-5 relative."""
    d, k, budget = 4, 3, 20
    rng = np.random.default_rng(0)
    lp = np.sort(_normalised(rng.normal(size=(d, 6)) * 1.5)[:, :k], axis=-1)[:, ::-1].copy()  # top 3 of 6
    trans = _normalised(rng.normal(size=(d, k, k)) * 1.5)
    tok = rng.permutation(40)[: d * k].reshape(d, k).astype(np.int32)
    cases = {"independent": (Independent(lp), dict(log_probs=lp[None])),
             "markov": (Markov(trans), dict(transitions=trans[None]))}
    for name, (step, offer) in cases.items():
        every = _all_prefixes(step)
        best = sorted(every.values(), reverse=True)
        if name == "independent":
            tree = jax.jit(T.build_tree_rows, static_argnames="budget")(lp[None], tok[None], budget, np.zeros(1, np.int32))
        else:
            tree = jax.jit(T.build_tree_rows, static_argnames="budget")(None, tok[None], budget, np.zeros(1, np.int32),
                                                                      trans[None])
        mass = np.asarray(jax.jit(T.prefix_mass)(tree))[0]
        np.testing.assert_allclose(mass, np.cumsum(best[:budget]), rtol=1e-5, err_msg=name)
        # The greedy chain's prefixes.
        prev, lp_sum, spine = 0, 0.0, 0.0
        for j in range(d):
            r = int(np.argmax([step(j, prev, c) for c in range(k)]))
            lp_sum += step(j, prev, r)
            spine += np.exp(lp_sum)
            prev = r
        got = np.asarray(jax.jit(T.spine_mass)(T.Candidates(tok[None], **offer)))[0]
        np.testing.assert_allclose(got, spine, rtol=1e-5, err_msg=name)
        assert got <= mass[d - 1] + 1e-6  # no d nodes hold more than the best d prefixes


# ----------------------------------------------------------------------------------------------------------
# The policy, on hand-made observations

OPTIONS = adaptive.tree_options((8, 16))  # (0, 8, 16)
next_phase = jax.jit(adaptive.next_tree_phase, static_argnums=(1, 2))
observe_chain = jax.jit(adaptive.observe_chain)
observe_tree = jax.jit(adaptive.observe_tree, static_argnums=(3,))


def _phase(policy, accepted_chain=None, tree=None):
    """One decision, then one observation of the phase it chose: ``accepted_chain`` drafts per chain round,
    ``tree = (accepted, 1 + Phi per option)`` per tree round. Returns (choice, rounds, policy)."""
    choice, rounds, policy = next_phase(policy, OPTIONS, BLOCK)
    active = np.ones((2,), bool)
    for _ in range(int(rounds)):
        if int(choice) == 0:
            policy = observe_chain(policy, np.full((2,), accepted_chain, np.int32), active)
        else:
            accepted, expected = tree
            expected = np.where(np.asarray(OPTIONS) <= OPTIONS[int(choice)], expected, np.nan)
            policy = observe_tree(policy, np.full((2,), accepted, np.int32),
                                  np.broadcast_to(np.asarray(expected, np.float32), (2, 3)), int(choice), active)
    return int(choice), int(rounds), policy._replace(last=choice)


def test_a_tree_that_cannot_pay_is_never_probed():
    """Chain rounds commit 5 tokens at cost 1; a tree round costs 3 chain rounds, so even a whole block (8)
    per tree round (8 / 3 < 5) loses: only chain phases, whatever the draft's probabilities would say."""
    policy = adaptive.initial_tree_policy(3)._replace(costs=jnp.asarray([1.0, 3.0, 3.0], np.float32))
    choices = []
    for _ in range(12):
        choice, rounds, policy = _phase(policy, accepted_chain=4, tree=(7, [8.0, 8.0, 8.0]))
        choices.append((choice, rounds))
    # the opening phase, then phases of TREE_MAX_GAP phases' rounds (no probe is ever due)
    assert choices == [(0, adaptive.DRAFT_PHASE)] + [(0, adaptive.TREE_MAX_GAP * adaptive.DRAFT_PHASE)] * 11


def test_probes_back_off_and_a_paying_tree_is_kept():
    """Equal costs. While the trees commit less than the chain (2 tokens a round against 3), probes (one round at the largest budget)
    come after 1, 2, 4, 8, 16, 16 chain phases; once the trees commit more (the chain 2 tokens, a 16-node tree
    6, its surrogate saying so), the next probe moves to budget 16 and stays there."""
    policy = adaptive.initial_tree_policy(3)
    choices = []
    for _ in range(14):
        choice, rounds, policy = _phase(policy, accepted_chain=2, tree=(1, [3.0, 3.0, 3.0]))
        choices.append((choice, rounds))
    probes = [i for i, (c, _) in enumerate(choices) if c]
    assert all(choices[i] == (2, adaptive.PROBE_PHASE) for i in probes)  # the largest budget, one round
    # chain rounds before each probe, in phases; those between two probes run as one phase
    gaps = [sum(r for c, r in choices[a + 1:b]) / adaptive.DRAFT_PHASE for a, b in zip([-1] + probes, probes)]
    assert choices[0] == (0, adaptive.DRAFT_PHASE) and gaps[:6] == [1, 2, 4, 8, 16, 16]
    assert all(b - a == 2 for a, b in zip(probes, probes[1:]))  # one chain phase between probes
    later = []
    for _ in range(40):
        choice, rounds, policy = _phase(policy, accepted_chain=1, tree=(5, [2.0, 4.0, 6.0]))
        later.append(choice)
    first = later.index(2)
    assert set(later[:first]) == {0} and set(later[first:]) == {2}, later


def test_the_cheaper_budget_wins_when_it_commits_nearly_as_much():
    """After a probe, CaDDTree's rule: budget 8 (cost 1.1, surrogate 5) beats budget 16 (cost 2, surrogate 6)
    and the chain (cost 1, 3 tokens observed): 5 / 1.1 > 6 / 2 > 3 / 1 (the observed tokens match the
    surrogate: no correction)."""
    policy = adaptive.initial_tree_policy(3)._replace(costs=jnp.asarray([1.0, 1.1, 2.0], jnp.float32))
    seen = []
    for _ in range(4):
        choice, _, policy = _phase(policy, accepted_chain=2, tree=(5, [3.0, 5.0, 6.0]))
        seen.append(choice)
    assert seen[:3] == [0, 2, 1] and seen[3] == 1, seen


# ----------------------------------------------------------------------------------------------------------
# The engine


@pytest.fixture(scope="module")
def pair():
    tc, tp = tiny_target()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, tc.vocab_size - 1, n).tolist() for n in (5, 13, 9)]
    ar = generate(tc, tp, prompts, NoProposer(), NoProposer().init(), DecodeSettings(max_new_tokens=MAX_NEW))
    return tc, tp, prompts, ar


def oracle_run(tc, tp, prompts, ar, **settings):
    """The oracle proposes the target's continuation with an error after every 2 tokens; its second candidate
    (log-prob log 0.4 against log 0.6) is the right token, so a tree of 8 nodes passes most planted errors."""
    reference, errors = planted_schedule(prompts, ar.tokens, [[2] * MAX_NEW] * len(prompts), BLOCK, 128)
    prop = OracleProposer(BLOCK, tc.vocab_size)
    return generate(tc, tp, prompts, prop, prop.init(reference, errors),
                    DecodeSettings(max_new_tokens=MAX_NEW, **settings))


def test_auto_is_lossless_and_takes_the_tree_when_it_pays(pair):
    """Equal round costs (given): the trees commit more than the chain, so after the opening chain phase and
    a probe the decode runs tree phases; the output is the target's own, and tau beats the chain's."""
    tc, tp, prompts, ar = pair
    chain = oracle_run(tc, tp, prompts, ar)
    auto = oracle_run(tc, tp, prompts, ar, tree_auto=(8,), width_costs=(1.0, 1.0))
    assert chain.tokens == ar.tokens and auto.tokens == ar.tokens
    budgets = [b for row in auto.widths for b in row]
    assert budgets[: adaptive.DRAFT_PHASE] == [0] * adaptive.DRAFT_PHASE  # the opening chain phase
    assert budgets.count(8) > len(budgets) // 2, auto.widths
    assert auto.tau > chain.tau
    assert [sum(a) + 1 for a in auto.accept_lengths] == [len(t) for t in auto.tokens]


def test_auto_whose_trees_cannot_pay_is_the_chain(pair):
    """Trees at 20x a chain round: no tree round ever runs, and the decode is the chain's round for round
    (a random DFlash draft, so rounds are rejected at every position)."""
    tc, tp, prompts, ar = pair
    dc, dp = tiny_draft(block=BLOCK)
    prop = DFlashProposer(dc, BLOCK)
    runs = {}
    for name, extra in (("chain", {}), ("auto", dict(tree_auto=(8,), width_costs=(1.0, 20.0)))):
        inputs = prop.init(dp, shared_head(tp, tc.tie_word_embeddings), len(prompts), 256)
        runs[name] = generate(tc, tp, prompts, prop, inputs, DecodeSettings(max_new_tokens=MAX_NEW, **extra))
    assert runs["auto"].tokens == runs["chain"].tokens == ar.tokens
    assert runs["auto"].accept_lengths == runs["chain"].accept_lengths
    assert {b for row in runs["auto"].widths for b in row} == {0}


def test_auto_runs_the_chain_program_when_calibration_finds_no_tree_pays(pair, monkeypatch):
    """Calibration's runs are real, the costs it returns given. ``generate`` decodes with the chain's own
    program (the chain's tokens and acceptance lengths, every round logged as budget 0) when no tree's
    calibration rounds committed more per unit of time than the chain's: a random draft at equal costs (its
    trees commit about what the chain does, ~1 token a round), and the oracle draft whose trees do pay, at a
    tree round of 10 chain rounds. The oracle draft at equal costs keeps the trees in play (the phase rule
    runs and takes tree rounds)."""
    import dflash_jax.engine.generate as g

    tc, tp, prompts, ar = pair
    dc, dp = tiny_draft(block=BLOCK)
    prop = DFlashProposer(dc, BLOCK)

    def random_draft(**extra):
        inputs = prop.init(dp, shared_head(tp, tc.tie_word_embeddings), len(prompts), 256)
        return generate(tc, tp, prompts, prop, inputs, DecodeSettings(max_new_tokens=MAX_NEW, **extra))

    def oracle(**extra):
        return oracle_run(tc, tp, prompts, ar, **extra)

    measured = adaptive.calibrate
    for run, costs, chain_only in ((random_draft, (1.0, 1.0), True), (oracle, (0.1, 1.0), True),
                                   (oracle, (1.0, 1.0), False)):
        monkeypatch.setattr(g, "_EXECUTABLES", {})  # calibrate afresh
        monkeypatch.setattr(adaptive, "calibrate", lambda widths, runs, c=costs: (
            measured(widths, runs), np.asarray(c, np.float32))[1])
        auto = run(tree_auto=(8,))
        assert auto.tree_auto_chain is chain_only and auto.width_costs == pytest.approx(costs), run.__name__
        assert auto.tokens == ar.tokens
        if chain_only:
            assert auto.accept_lengths == run().accept_lengths
            assert auto.widths == [[0] * n for n in auto.rounds]
        else:
            assert 8 in {b for row in auto.widths for b in row}, auto.widths


def test_refusals():
    for bad, match in [(dict(tree_auto=(8, 4)), "increasing"), (dict(tree_auto=(0, 4)), "increasing"),
                       (dict(tree_auto=(4,), tree_budget=4), "cannot be combined"),
                       (dict(tree_auto=(4,), adaptive_widths=(2,)), "cannot be combined")]:
        with pytest.raises(UserError, match=match):
            DecodeSettings(max_new_tokens=8, **bad)


def test_cli_tree_auto_flags():
    from infer.cli import UsageError, tree_arg, tree_settings
    import argparse

    assert tree_arg("auto") == "auto" and tree_arg("12") == 12
    with pytest.raises(argparse.ArgumentTypeError, match="'auto'"):
        tree_arg("many")
    args = argparse.Namespace(tree="auto", tree_budgets=(16, 32))
    assert tree_settings(args, True) == {"tree_budget": 0, "tree_auto": (16, 32)}
    with pytest.raises(UsageError, match="--tree-budgets needs --tree auto"):
        tree_settings(argparse.Namespace(tree=8, tree_budgets=(16,)), True)
    with pytest.raises(UsageError, match="needs a draft"):
        tree_settings(args, False)
