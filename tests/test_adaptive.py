"""The adaptive width policy on its own (engine/adaptive.py), against brute-force constructions."""

import itertools

import jax.numpy as jnp
import numpy as np

from dflash_jax.engine import adaptive


def test_expected_tokens_equals_enumerating_acceptance_patterns():
    """E[tokens] of width w from the conditional rates, vs summing over every accept/reject pattern of the
    w - 1 verified drafts (a round keeps the accepted prefix plus one token)."""
    rng = np.random.default_rng(0)
    block = 6
    stats = np.stack([rng.uniform(0, 5, block - 1), np.zeros(block - 1)]).astype(np.float32)
    stats[1] = stats[0] * rng.uniform(0, 1, block - 1)
    rate = (stats[1] + adaptive.PRIOR_WEIGHT * adaptive.PRIOR_P) / (stats[0] + adaptive.PRIOR_WEIGHT)
    widths = (1, 2, 4, 6)
    got = np.asarray(adaptive.expected_tokens(jnp.asarray(stats), widths))
    for w, g in zip(widths, got):
        want = 0.0
        for pattern in itertools.product([True, False], repeat=w - 1):
            p = np.prod([rate[j] if ok else 1 - rate[j] for j, ok in enumerate(pattern)])
            prefix = next((j for j, ok in enumerate(pattern) if not ok), w - 1)
            want += p * (prefix + 1)
        np.testing.assert_allclose(g, want, rtol=1e-5)


def test_observe_counts_reached_and_accepted_positions_per_row():
    policy = adaptive.initial_policy(block=5, num_widths=2)
    accepted = jnp.asarray([0, 2, 3, 1])
    active = jnp.asarray([True, True, True, False])
    out = adaptive.observe(policy, accepted, width=4, active=active)
    # Width 4 verifies drafts 1..3. Row 0 tried 1 (rejected); row 1 tried 1..3, accepted 1, 2; row 2 accepted
    # 1..3 (draft 4 not verified); row 3 is finished and does not count. Per active row (3 rows).
    attempts = np.asarray([3, 2, 2, 0]) / 3
    accepts = np.asarray([2, 2, 1, 0]) / 3
    np.testing.assert_allclose(np.asarray(out.stats), np.stack([attempts, accepts]), rtol=1e-6)
    np.testing.assert_allclose(float(out.accepted), 5 / 3, rtol=1e-6)
    again = adaptive.observe(out, accepted, width=4, active=active)
    np.testing.assert_allclose(np.asarray(again.stats), (1 + adaptive.DECAY) * np.stack([attempts, accepts]),
                               rtol=1e-6)
    assert adaptive.observe(out, accepted, width=1, active=active) is out  # autoregressive: nothing seen


def test_cost_decides_between_widths():
    stats = jnp.asarray([[10.0, 0, 0], [5.0, 0, 0]])  # draft 1 accepted ~half the time, the rest never tried
    widths = (1, 2, 4)
    e = np.asarray(adaptive.expected_tokens(stats, widths))
    mid_answer = adaptive.initial_policy(4, 3)._replace(narrow_phases=jnp.int32(0))
    cheap_block = adaptive.next_phase(mid_answer._replace(
        stats=stats, costs=jnp.asarray([1.0, 1.0, 1.0]), last_width=jnp.int32(4)), widths, 4)[0]
    assert int(cheap_block) == 2  # same cost: the most tokens
    def choice(rate, last_width):  # every drafting width at ``rate`` tokens per autoregressive step's time
        return int(adaptive.next_phase(mid_answer._replace(
            stats=stats, costs=jnp.asarray([1.0, e[1] / rate, e[2] / rate]), last_width=jnp.int32(last_width)),
            widths, 4)[0])

    assert choice(0.8, 4) == 0  # clearly below one token per step: autoregressive
    assert choice(0.97, 4) == 2  # a little below: the current width stays (hysteresis) ...
    assert choice(0.97, 2) == 1  # ... whichever it is


def test_probe_schedule_backs_off_and_resets():
    """After a drafting round: autoregressive rounds until a probe is due (probe_gap blocks of them, as one
    phase), then a one-round probe; a failed probe doubles the gap (up to MAX_PROBE_GAP), an accepted one
    resets it."""  # (starting from a gap of 1, as after an accepted probe)
    widths, block = (1, 4, 8), 8
    hopeless = jnp.asarray([[20.0] * 7, [0.0] * 7])
    policy = adaptive.initial_policy(block, 3)._replace(stats=hopeless, costs=jnp.asarray([0.5, 0.8, 1.0]),
                                                        last_width=jnp.int32(8), ar_blocks=jnp.int32(0),
                                                        probe_gap=jnp.int32(1), narrow_phases=jnp.int32(0))
    phases = []
    for _ in range(12):
        choice, rounds, policy = adaptive.next_phase(policy, widths, block)
        width = widths[int(choice)]
        phases.append((min(width, 2), int(rounds)))  # 2: a drafting width (here the cheaper 4)
        if width > 1:  # a probe: it fails (accepts nothing)
            policy = adaptive.observe(policy, jnp.asarray([0]), width, jnp.asarray([True]))
        policy = policy._replace(last_width=jnp.int32(width))
    # Hopeless drafts: autoregressive rounds at once, then probes (one round each) after 1, 2, 4, 8, 8 blocks.
    assert phases[:11] == [(1, block), (2, 1), (1, 2 * block), (2, 1), (1, 4 * block), (2, 1), (1, 8 * block),
                           (2, 1), (1, 8 * block), (2, 1), (1, 8 * block)], phases
    # An accepted probe: the gap resets to one block.
    policy = policy._replace(probing=jnp.bool_(True), accepted=jnp.float32(3.0), last_width=jnp.int32(4))
    _, _, policy = adaptive.next_phase(policy, widths, block)
    assert int(policy.probe_gap) == 1


def test_decoding_opens_with_a_one_round_probe_of_the_full_block():
    # Even where the prior alone favours a narrower width (width 4 at 0.5 of the block's cost: by the prior
    # 2.95 / 0.5 tokens per unit of time against 4.16 / 1), the opening round verifies the whole block.
    policy = adaptive.initial_policy(8, 3)._replace(costs=jnp.asarray([0.4, 0.5, 1.0]))
    e = np.asarray(adaptive.expected_tokens(policy.stats, (1, 4, 8)))
    assert e[1] / 0.5 > e[2] / 1.0
    choice, rounds, policy = adaptive.next_phase(policy, (1, 4, 8), 8)
    assert int(choice) == 2 and bool(policy.probing)
    assert int(rounds) == adaptive.PROBE_PHASE == 1
    assert int(policy.narrow_phases) == 0
    # Judged at the width its round supports: one draft accepted is 2 tokens for 0.5 at width 4, better than
    # autoregressive rounds (0.8 for 2), though worse than them at the full block's cost (1.0): not failed.
    opened = adaptive.observe(policy, jnp.asarray([1]), 8, jnp.asarray([True]))._replace(last_width=jnp.int32(8))
    choice, rounds, after = adaptive.next_phase(opened, (1, 4, 8), 8)
    assert (int(choice), int(rounds), int(after.probe_gap)) == (1, adaptive.DRAFT_PHASE, 1)
    # Nothing accepted fails at every width: straight to autoregressive rounds.
    opened = adaptive.observe(policy, jnp.asarray([0]), 8, jnp.asarray([True]))._replace(last_width=jnp.int32(8))
    assert int(adaptive.next_phase(opened, (1, 4, 8), 8)[0]) == 0
    # A drafting phase after it (accepted: the rates choose, here with width 4 at 0.8 of the block's cost)
    # lasts DRAFT_PHASE rounds.
    policy = adaptive.observe(policy, jnp.asarray([7]), 8, jnp.asarray([True]))._replace(
        last_width=jnp.int32(8), costs=jnp.asarray([0.4, 0.8, 1.0]))
    choice, rounds, _ = adaptive.next_phase(policy, (1, 4, 8), 8)
    assert int(choice) == 2 and int(rounds) == adaptive.DRAFT_PHASE


def test_forced_width_overrides_the_choice():
    policy = adaptive.initial_policy(8, 3)._replace(forced=jnp.int32(1))
    assert int(adaptive.next_phase(policy, (1, 4, 8), 8)[0]) == 1
    assert int(adaptive.next_phase(policy, (2, 4, 8), 8)[0]) == 1
    # A forced autoregressive phase (calibration) is as long as the longest unforced one.
    choice, rounds, _ = adaptive.next_phase(policy._replace(forced=jnp.int32(0)), (1, 4, 8), 8)
    assert int(choice) == 0 and int(rounds) == adaptive.MAX_PROBE_GAP * 8


# Draft positions 1-3 always accepted, 4 never: with widths 4 at half the block's cost, width 4 is best by far.
WIDTH_4_STATS = jnp.asarray([[30.0] * 4 + [0.0] * 3, [30.0] * 3 + [0.0] * 4])


def assert_width_4_with_deep_probes(policy: adaptive.Policy, widths: tuple[int, ...], block: int) -> None:
    """From ``policy`` (stats WIDTH_4_STATS): phases of width 4, and after every DEEP_PROBE_EVERY of them one
    round of the full block."""
    taken = []
    for _ in range(2 * adaptive.DEEP_PROBE_EVERY + 2):
        choice, rounds, policy = adaptive.next_phase(policy, widths, block)
        taken.append((widths[int(choice)], int(rounds)))
        policy = policy._replace(last_width=jnp.int32(widths[int(choice)]))
    narrow = [(4, adaptive.DRAFT_PHASE)] * adaptive.DEEP_PROBE_EVERY
    assert taken == narrow + [(block, 1)] + narrow + [(block, 1)], taken


def test_narrow_phases_are_interrupted_by_one_round_of_the_full_block():
    """A narrow width never observes the draft positions past it: every DEEP_PROBE_EVERY drafting phases in a
    row below the full block, one round verifies the whole block, then the rates choose again."""
    policy = adaptive.initial_policy(8, 3)._replace(stats=WIDTH_4_STATS, costs=jnp.asarray([0.3, 0.5, 1.0]),
                                                    last_width=jnp.int32(4), ar_blocks=jnp.int32(0),
                                                    narrow_phases=jnp.int32(0))
    assert_width_4_with_deep_probes(policy, (1, 4, 8), 8)


def test_drafting_widths_only_open_with_the_full_block_and_probe_it_after_narrow_phases():
    """Widths without 1 (``--adaptive 2,4``): the same opening round of the full block and the same deep
    probes, only never an autoregressive phase."""
    widths, block = (2, 4, 8), 8
    policy = adaptive.initial_policy(block, 3)._replace(costs=jnp.asarray([0.3, 0.5, 1.0]))
    choice, rounds, policy = adaptive.next_phase(policy, widths, block)
    assert (widths[int(choice)], int(rounds)) == (8, adaptive.PROBE_PHASE)
    assert_width_4_with_deep_probes(policy._replace(stats=WIDTH_4_STATS, last_width=jnp.int32(8)), widths, block)
