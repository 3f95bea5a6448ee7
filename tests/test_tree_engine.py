"""Tree verification inside the engine (``generate.tree_round``, SPEC section 12), greedy.

References: the target's own autoregressive output from the same engine (a tree round is lossless, so every
budget must give it token for token), today's chain (a tree of one candidate per position and ``block - 1``
nodes is the chain: same tokens, same acceptance lengths, same proposals), and a brute-force count for the
oracle proposer (a full binary tree of its two candidates holds every path, so every round accepts the whole
block). The commit is exercised where accepted nodes are not at their chain slots (oracle alternatives), with
sliding-window ring caches and sinks (gpt-oss), stop tokens inside an accepted path, rows of different
lengths, the fused-attention layout (``xla``: the tree block as a masked segment), and a mesh (data x tensor).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.engine.generate import DecodeSettings, generate
from dflash_jax.engine.proposers import DFlashProposer, NoProposer, OracleProposer
from dflash_jax.errors import UserError
from dflash_jax.models.attention_kernels import Segment, fused_attention
from dflash_jax.models.draft import shared_head
from dflash_jax.models.layers import attention
from engine_tiny import planted_schedule, tiny_draft, tiny_moe_target, tiny_target

BLOCK = 8
PROMPT_LENGTHS = (5, 13, 9)
MAX_NEW = 24


def prompts_for(vocab):
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab - 1, n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def dense():
    tc, tp = tiny_target()
    dc, dp = tiny_draft(block=BLOCK)
    prompts = prompts_for(tc.vocab_size)
    ar = generate(tc, tp, prompts, NoProposer(), NoProposer().init(), DecodeSettings(max_new_tokens=MAX_NEW))
    return tc, tp, dc, dp, prompts, ar


def draft_run(tc, tp, dc, dp, prompts, **settings):
    prop = DFlashProposer(dc, BLOCK)
    inputs = prop.init(dp, shared_head(tp, tc.tie_word_embeddings), len(prompts), 256)
    return generate(tc, tp, prompts, prop, inputs, DecodeSettings(max_new_tokens=MAX_NEW, **settings))


def test_tree_of_one_candidate_is_the_chain(dense):
    tc, tp, dc, dp, prompts, ar = dense
    chain = draft_run(tc, tp, dc, dp, prompts, record_drafts=True)
    tree = draft_run(tc, tp, dc, dp, prompts, record_drafts=True, tree_budget=BLOCK - 1, tree_candidates=1)
    assert chain.tokens == ar.tokens
    assert tree.tokens == chain.tokens
    assert tree.accept_lengths == chain.accept_lengths
    assert all(np.array_equal(a, b) for a, b in zip(tree.drafts, chain.drafts))


@pytest.mark.parametrize("budget", [3, 20])
def test_tree_greedy_is_lossless(dense, budget):
    tc, tp, dc, dp, prompts, ar = dense
    out = draft_run(tc, tp, dc, dp, prompts, tree_budget=budget)
    assert out.tokens == ar.tokens
    assert [sum(a) + 1 for a in out.accept_lengths] == [len(t) for t in out.tokens]


def oracle_run(tc, tp, prompts, ar, budget, schedule=(2, 3, 1), **settings):
    """The oracle proposes the target's own continuation with an error planted after each round's ``schedule``
    tokens (chain view); its second candidate at each position is the other of (proposal, reference)."""
    reference, errors = planted_schedule(prompts, ar.tokens, [list(schedule) * (MAX_NEW // sum(schedule) + 1)] * len(prompts), BLOCK, 128)
    prop = OracleProposer(BLOCK, tc.vocab_size)
    return generate(tc, tp, prompts, prop, prop.init(reference, errors),
                    DecodeSettings(max_new_tokens=MAX_NEW, tree_budget=budget, **settings))


def test_full_binary_tree_accepts_every_block_through_planted_errors(dense):
    tc, tp, _, _, prompts, ar = dense
    chain = oracle_run(tc, tp, prompts, ar, 0)
    assert chain.tokens == ar.tokens
    assert chain.accept_lengths[0][:3] == [2, 3, 1]
    full = 2 ** BLOCK - 2  # every prefix of 1..7 binary choices
    tree = oracle_run(tc, tp, prompts, ar, full)
    assert tree.tokens == ar.tokens
    for row in tree.accept_lengths:  # whole blocks, the last round cut at max_new_tokens
        assert row[:-1] == [BLOCK] * (len(row) - 1) and 1 <= row[-1] <= BLOCK
    # A smaller tree accepts between the two.
    mid = oracle_run(tc, tp, prompts, ar, 24)
    assert mid.tokens == ar.tokens
    assert chain.tau < mid.tau < tree.tau


def test_stop_token_inside_an_accepted_path(dense):
    tc, tp, _, _, prompts, ar = dense
    row = ar.tokens[1]
    stop = row[6]  # committed in a round that accepts a whole block past it
    cut = [t[: t.index(stop) + 1] if stop in t else t for t in ar.tokens]
    tree = oracle_run(tc, tp, prompts, ar, 2 ** BLOCK - 2, stop_tokens=(stop,))
    assert tree.tokens == cut


def test_fused_attention_layout_gives_the_same_tokens(dense):
    tc, tp, _, _, prompts, ar = dense
    loop = oracle_run(tc, tp, prompts, ar, 24)
    xla = oracle_run(tc, tp, prompts, ar, 24, attention="xla")
    assert xla.tokens == loop.tokens == ar.tokens
    assert xla.accept_lengths == loop.accept_lengths


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_masked_segment_matches_plain_attention(kernel):
    """A tree block as a masked segment beside a length-bounded cache segment, against ``layers.attention``
    with the same visibility (tolerance 1e-5, float32)."""
    rng = np.random.default_rng(3)
    b, t, s, hq, hkv, d = 2, 5, 32, 4, 2, 16
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.float32)
    kc, vc = (jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.float32) for _ in range(2))
    kb, vb = (jnp.asarray(rng.standard_normal((b, hkv, t, d)), jnp.float32) for _ in range(2))
    lengths = jnp.asarray([7, 19], jnp.int32)
    mask = jnp.asarray(rng.random((b, t, t)) < 0.5) | jnp.eye(t, dtype=bool)[None]
    got = fused_attention(q, [Segment(kc, vc, lengths), Segment(kb, vb, jnp.full((b,), t, jnp.int32), mask=mask)],
                          kernel)
    cache_mask = jnp.broadcast_to(jnp.arange(s)[None, None] < lengths[:, None, None], (b, t, s))
    want = attention(q, [(kc, vc, cache_mask), (kb, vb, mask)])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_windowed_rings_and_sinks_commit_a_tree():
    """gpt-oss: sliding window 6 (ring caches of window - 1 + 32 slots), sinks, experts; a tree of 31 nodes
    (wider than the window) through planted errors must still give the target's own tokens."""
    tree_beats_chain_losslessly("gpt_oss", 31)


def tree_beats_chain_losslessly(family, budget):
    """The oracle through planted errors on a tiny ``family`` target: chain and tree give the target's own
    tokens, the tree with higher tau. Returns ``(config, params, prompts, autoregressive result)``."""
    tc, tp = tiny_moe_target(family)
    prompts = prompts_for(tc.vocab_size)
    ar = generate(tc, tp, prompts, NoProposer(), NoProposer().init(), DecodeSettings(max_new_tokens=MAX_NEW))
    chain = oracle_run(tc, tp, prompts, ar, 0)
    tree = oracle_run(tc, tp, prompts, ar, budget)
    assert chain.tokens == tree.tokens == ar.tokens
    assert tree.tau > chain.tau
    return tc, tp, prompts, ar


def test_gated_deltanet_layers_commit_a_tree():
    """Qwen3.5 (hybrid: Gated DeltaNet layers beside full attention, experts): each tree token runs from the
    state after its own ancestors (conv window and delta rule along its path) and the commit gathers the
    accepted path's pending terms; through planted errors a tree of 24 nodes must give the target's own
    tokens, pass errors the chain cannot (higher tau), and a random draft's trees (rejected most rounds, the
    commit then keeps a short path off the chain slots) as well."""
    tc, tp, prompts, ar = tree_beats_chain_losslessly("qwen3_5", 24)
    dc, dp = tiny_draft(block=BLOCK)
    assert draft_run(tc, tp, dc, dp, prompts, tree_budget=12).tokens == ar.tokens


def test_refusals(dense):
    tc, tp, dc, dp, prompts, _ = dense
    with pytest.raises(UserError, match="adaptive widths"):
        DecodeSettings(max_new_tokens=4, tree_budget=4, adaptive_widths=(1,))
    with pytest.raises(UserError, match="tree_candidates needs"):
        DecodeSettings(max_new_tokens=4, tree_candidates=2)
    with pytest.raises(UserError, match="needs a draft"):
        generate(tc, tp, prompts, NoProposer(), NoProposer().init(), DecodeSettings(max_new_tokens=4, tree_budget=4))


def test_sharded_tree_equals_one_device():
    """data=2,tensor=2 on 4 fake CPU devices (a subprocess: the device count is fixed when JAX starts)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "sharded_tree_check.py")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4
    one, sharded = out["runs"]["one"], out["runs"]["data2_tensor2"]
    assert one["tokens"] == out["ar"] and sharded == one
    assert max(max(row) for row in one["accept"]) > 3  # the tree went past planted errors
