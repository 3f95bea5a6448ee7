"""The offline replay of width policies (dflash_jax/evaluation/replay.py) against the engine itself and a
brute-force search."""


import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.engine.generate import DecodeSettings, generate
from dflash_jax.engine.proposers import DFlashProposer, NoProposer, OracleProposer
from dflash_jax.evaluation.replay import replay_adaptive, replay_fixed, replay_oracle, teacher_forced_acceptance
from dflash_jax.models.draft import shared_head
from engine_tiny import tiny_draft, tiny_target

BLOCK = 8
NEW = 64
PROMPTS = ([3, 17, 5, 9, 30], [8, 1, 44, 2, 19, 7, 7, 12, 40, 3, 6])


@pytest.fixture(scope="module")
def models():
    tc, tp = tiny_target()
    dc, dp = tiny_draft(block=BLOCK)
    settings = DecodeSettings(max_new_tokens=NEW)
    answers = [generate(tc, tp, [p], NoProposer(), NoProposer().init(), settings).tokens[0] for p in PROMPTS]
    return tc, tp, dc, dp, answers


def dflash(models, prompt, settings):
    tc, tp, dc, dp, _ = models
    prop = DFlashProposer(dc, BLOCK)
    state = prop.init(dp, shared_head(tp, tc.tie_word_embeddings), 1, 16 + NEW + BLOCK)
    return generate(tc, tp, [prompt], prop, state, settings)


def test_teacher_forced_acceptance_equals_the_engines_rounds(models):
    """A round of the engine (cached, incremental) accepts what the teacher-forced training forward says for
    its anchor; the last round is left out (it may accept past the end of the answer)."""
    tc, tp, dc, dp, answers = models
    for prompt, answer in zip(PROMPTS, answers):
        acceptance = teacher_forced_acceptance(tc, tp, dc, dp, prompt, answer, BLOCK)
        out = dflash(models, prompt, DecodeSettings(max_new_tokens=NEW))
        assert out.tokens[0] == answer
        time, lengths = replay_fixed(acceptance, 1.0)
        assert lengths[:-1] == out.accept_lengths[0][:-1]
        assert time == len(lengths) == len(out.accept_lengths[0])
    assert acceptance.max() > 0  # the random draft does get some right: the check is not all zeros


def test_replayed_policy_takes_the_engines_widths(models):
    """The replay drives the engine's policy functions as the decode loop does: same widths, round by round,
    for the random draft (mostly autoregressive phases and probes) and for planted acceptance patterns
    (drafting phases of every width)."""
    tc, tp, dc, dp, answers = models
    widths, costs = (1, 4, 8), (0.3, 0.8, 1.0)
    settings = DecodeSettings(max_new_tokens=NEW, adaptive_widths=widths[:-1], width_costs=costs)
    for prompt, answer in zip(PROMPTS, answers):
        acceptance = teacher_forced_acceptance(tc, tp, dc, dp, prompt, answer, BLOCK)
        out = dflash(models, prompt, settings)
        assert replay_adaptive(acceptance, widths, costs, BLOCK)[1] == out.widths[0]
    rng = np.random.default_rng(0)
    for prompt, answer in zip(PROMPTS, answers):
        # Errors planted on a random stretch pattern: long runs of good proposals, then of bad ones.
        good = np.repeat(rng.random(12) < 0.5, 8)[: NEW + BLOCK + 1]
        errors = np.zeros((1, 16 + NEW + 2 * BLOCK), bool)
        errors[0, len(prompt): len(prompt) + len(good)] = ~good
        reference = np.zeros_like(errors, np.int32)
        reference[0, : len(prompt) + len(answer)] = prompt + answer
        prop = OracleProposer(BLOCK, tc.vocab_size)
        out = generate(tc, tp, [prompt], prop, prop.init(jnp.asarray(reference), jnp.asarray(errors)), settings)
        assert out.tokens[0] == answer
        planted = errors[0, len(prompt):]
        acceptance = np.asarray([next((k for k in range(BLOCK - 1) if planted[i + 1 + k]), BLOCK - 1)
                                 for i in range(len(answer))])
        replayed = replay_adaptive(acceptance, widths, costs, BLOCK)[1]
        assert replayed == out.widths[0]
        assert {1, 8} <= set(replayed), replayed


def test_oracle_schedule_is_the_cheapest_of_all_schedules():
    rng = np.random.default_rng(1)
    widths, costs = (1, 2, 4), (1.0, 1.6, 2.1)
    for _ in range(20):
        acceptance = rng.integers(0, 4, 9)

        def cheapest(i):  # brute force over every width sequence
            if i >= len(acceptance) - 1:
                return 0.0
            return min(c + cheapest(i + (0 if w == 1 else min(acceptance[i], w - 1)) + 1)
                       for w, c in zip(widths, costs))

        assert replay_oracle(acceptance, widths, costs) == pytest.approx(cheapest(0))
        assert replay_oracle(acceptance, widths, costs) <= replay_adaptive(acceptance, widths, costs, 4)[0] + 1e-9
        assert replay_oracle(acceptance, widths, costs) <= replay_fixed(acceptance, costs[-1])[0] + 1e-9
