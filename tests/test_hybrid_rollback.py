"""Rollback of the hybrid targets' linear-attention state, round by round.

After every round of the engine's own ``decode_round`` (forced acceptance: an oracle proposes the target's
own continuation with errors planted at chosen positions, so rows accept 0, part of, or the whole block, each
row its own schedule), each row's conv state and recurrent state of every Gated DeltaNet layer, as the next
forward will see them (``committed_state`` at the row's length), equal the states of a FRESH prefill over
exactly that row's committed tokens (prompt + accepted tokens, the pending anchor excluded). Tolerances
(float32): layer 0, whose inputs are the same embeddings on both sides, 1e-5 absolute; deeper linear layers
1e-4 of the state's largest magnitude where that exceeds 1, because their inputs carry the rounding of the
layers below, computed by different forms (the fresh prefill folds its tokens in one 64-token chunk, the
rounds one block at a time; measured ~1.5e-5 relative). A wrong prefix or window shows as O(1) differences. Greedy and
sampled rounds (temperature 0.1, near the greedy path the oracle proposes, so that its point-mass proposals are
accepted at random but often in part: sampled rows leave the greedy reference, after which nothing is accepted).

The property behind it, per cache kind (DESIGN: ``commit(keep)`` after a block equals running only the first
``keep`` tokens) is tested directly too: a block extension, then lengths lowered to each keep.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.engine.generate import DecodeSettings, decode_round, generate, prefill
from dflash_jax.engine.proposers import NoProposer, OracleProposer
from dflash_jax.engine.sampling import SamplingConfig
from dflash_jax.models.gated_deltanet import committed_state
from dflash_jax.models.target import TargetModel, init_cache
from engine_tiny import planted_schedule, tiny_moe_target

BLOCK = 6
PROMPT_LENGTHS = (5, 9, 3)
MAX_NEW = 30
SLOTS = 64
TOL = 1e-5
TOL_DEEP = 1e-4


FRESH_WIDTH = 48
FRESH_ROWS = 4  # every fresh prefill takes this many rows (fewer are padded with copies): one compile


@functools.lru_cache(maxsize=None)
def _fresh_prefill(tc):
    def run(tp, tokens, lengths):
        positions = jnp.broadcast_to(jnp.arange(FRESH_WIDTH, dtype=jnp.int32), tokens.shape)
        cache = init_cache(tc, tokens.shape[0], SLOTS, extension=BLOCK)
        cache = TargetModel(tc).apply({"params": tp}, tokens, positions, cache, positions < lengths[:, None],
                                      skip_logits=True).cache
        return [committed_state(s, cache.lengths) for s in cache.linear]

    return jax.jit(run)


def fresh_states(tc, tp, rows):
    """Per linear layer: (conv, recurrent) of each row after a fresh prefill over ``rows[b]`` (one batched
    prefill, rows right-padded: padding leaves a row's states exactly as its last real token left them)."""
    padded = list(rows) + [rows[0]] * (FRESH_ROWS - len(rows))
    tokens = np.zeros((len(padded), FRESH_WIDTH), np.int32)
    for b, row in enumerate(padded):
        tokens[b, : len(row)] = row
    states = _fresh_prefill(tc)(tp, jnp.asarray(tokens), jnp.asarray([len(r) for r in padded], jnp.int32))
    return [(conv[: len(rows)], rec[: len(rows)]) for conv, rec in states]


def assert_states_match(tc, tp, cache, committed):
    """The first linear layer (layer 0: identical inputs on both sides) within ``TOL`` absolute; deeper ones
    within ``TOL_DEEP`` of the state's magnitude where that exceeds 1."""
    for n, (state, (conv_ref, rec_ref)) in enumerate(zip(cache.linear, fresh_states(tc, tp, committed))):
        conv, rec = committed_state(state, cache.lengths)
        for ours, ref in ((conv, conv_ref), (rec, rec_ref)):
            ours, ref = np.asarray(ours), np.asarray(ref)
            tol = TOL if tc.linear_layers[n] == 0 else TOL_DEEP * max(1.0, np.abs(ref).max())
            np.testing.assert_allclose(ours, ref, atol=tol, rtol=0)


@pytest.fixture(scope="module", params=["qwen3_next"])  # grouped projections, experts, a linear last layer
def target(request):
    tc, tp = tiny_moe_target(request.param, scale=0.15)  # states of magnitude ~1-3
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, tc.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    ar = generate(tc, tp, prompts, NoProposer(), NoProposer().init(), DecodeSettings(max_new_tokens=MAX_NEW))
    return tc, tp, prompts, ar.tokens


def test_extension_then_lower_lengths_equals_running_only_the_kept_tokens(target):
    tc, tp, prompts, _ = target
    model = TargetModel(tc)
    rng = np.random.default_rng(1)
    b, p = 4, 7
    tokens = rng.integers(0, tc.vocab_size, (b, p + BLOCK)).astype(np.int32)
    positions = np.broadcast_to(np.arange(p + BLOCK, dtype=np.int32), tokens.shape)

    def extend(tp, tokens, positions):  # jitted: op by op, the two forwards took ~20 s on XLA:CPU, compiled ~7 s
        cache = init_cache(tc, b, SLOTS, extension=BLOCK)
        cache = model.apply({"params": tp}, tokens[:, :p], positions[:, :p], cache, skip_logits=True).cache
        return model.apply({"params": tp}, tokens[:, p:], positions[:, p:], cache, skip_logits=True).cache

    cache = jax.jit(extend)(tp, tokens, positions)
    keep = np.asarray([0, 1, 4, BLOCK])
    rolled = cache.with_lengths(jnp.asarray(p + keep))
    assert_states_match(tc, tp, rolled, [tokens[i, : p + k].tolist() for i, k in enumerate(keep)])


@pytest.mark.parametrize("temperature", [0.0, 0.1])
def test_states_after_every_round_equal_a_fresh_prefill_of_the_committed_tokens(target, temperature):
    tc, tp, prompts, ar = target
    # Acceptance schedules per row (committed tokens per round; BLOCK = the whole block accepted): the
    # oracle proposes the greedy continuation, wrong right after each round's accepted part.
    schedules = [[1, BLOCK, 3, 2, BLOCK, 1], [BLOCK, BLOCK, 1, 4, 5], [2, 1, 1, BLOCK, 3]]
    reference, errors = planted_schedule(prompts, ar, schedules, BLOCK, max(PROMPT_LENGTHS) + MAX_NEW + BLOCK)
    prop = OracleProposer(BLOCK, tc.vocab_size)
    consts, pstate = prop.init(jnp.asarray(reference), jnp.asarray(errors))
    settings = DecodeSettings(max_new_tokens=MAX_NEW, sampling=SamplingConfig(temperature))
    lengths = np.asarray(PROMPT_LENGTHS, np.int32)
    padded = np.zeros((len(prompts), 16), np.int32)
    for b, prompt in enumerate(prompts):
        padded[b, : len(prompt)] = prompt
    state = jax.jit(functools.partial(prefill, tc, prop, settings, SLOTS))(
        tp, consts, pstate, jnp.asarray(padded), jnp.asarray(lengths), jax.random.PRNGKey(3))
    round_ = jax.jit(functools.partial(decode_round, tc, prop, settings))
    partial = 0
    for _ in range(5):
        before = np.asarray(state.num_out)
        state = round_(tp, consts, state)
        partial += int(np.sum((np.asarray(state.num_out) - before > 1) & (np.asarray(state.num_out) - before
                                                                              < BLOCK)))
        out, num_out = np.asarray(state.out), np.asarray(state.num_out)
        # The cache holds the prompt and every committed token but the newest (the anchor of the next round).
        committed = [prompts[b] + out[b, : num_out[b] - 1].tolist() for b in range(len(prompts))]
        assert [len(c) for c in committed] == np.asarray(state.cache.lengths).tolist()
        assert_states_match(tc, tp, state.cache, committed)
    print(f"{tc.model_type}, temperature {temperature}: {partial} rounds accepted part of a block")
    assert partial > 0  # some round accepted part of a block (the rollback actually cut inside a block)
    if temperature == 0.0:  # greedy: the planted schedules were followed and the tokens are the target's own
        for b in range(len(prompts)):
            assert out[b, : num_out[b]].tolist() == ar[b][: num_out[b]]
