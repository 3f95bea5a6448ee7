"""Adaptive block size (beyond the paper): how many tokens each phase of rounds verifies.

The decode loop runs in *phases*: a few rounds at one static width, chosen between phases by
``next_phase``. A phase runs one ``lax.while_loop`` of ordinary rounds per width in sequence, all but the
chosen one for zero rounds, so a round costs what a fixed-width round costs. (A ``lax.switch`` between the
loops made XLA:CPU copy every KV cache on entering a phase.) Width 1 is a plain autoregressive phase: no
draft forward; it runs in blocks of rounds, each gathering the target's features of its tokens in the round
context, filed into the draft's cache in one write before the next block (or by the next drafting round).

The choice maximises expected tokens per unit of time:

- expected tokens of width ``w``: ``1 + sum_{k<w} prod_{j<=k} p_j``, with ``p_j`` the batch's recent rate of
  accepting draft position ``j`` given position ``j - 1`` was accepted (exponentially decayed counts; a
  verified prefix only observes its own positions), shrunk towards a prior ``PRIOR_P`` so that
  positions not verified for a while look promising again;
- time of a round of width ``w``: ``costs[w]``, measured on the device for the compiled program (``calibrate``)
  or given by the caller (``DecodeSettings.width_costs``).

Autoregressive phases observe nothing: after them, one-round probes at the best drafting width follow a
back-off schedule (``next_phase``).

Everything is lossless by construction: a phase only changes how many proposals are verified, never how.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Counts decay by DECAY per drafting round: the estimate follows roughly the last 1 / (1 - DECAY) of them.
# Counts are per row (batch averages), so the prior weighs the same whatever the batch size.
DECAY = 0.9
# Prior on every conditional acceptance rate, worth PRIOR_WEIGHT observed rounds. (Tuned with
# ``python -m infer bench --replay`` on the stories260K drafts: 0.8 beat 0.9 on both block sizes.)
PRIOR_P = 0.8
PRIOR_WEIGHT = 1.0
# A width must promise this much more than the current one (relative) to replace it: a little, against
# switching back and forth on noise. (The replay found 0.15 kept drafting too long: 1-6% slower.)
HYSTERESIS = 0.05
# Rounds per drafting phase; the first drafting phase after autoregressive ones is a single probe round.
DRAFT_PHASE = 8
PROBE_PHASE = 1
# Autoregressive phases run in blocks of rounds (a block's features fill exactly one round context, filed
# into the draft's cache before the next). Blocks before a probe: 1, doubled (up to MAX_PROBE_GAP) after
# every probe whose round committed fewer tokens per unit of time than autoregressive rounds would have; the
# blocks until the next probe run as one phase (an earlier version, deciding after every block, measured its
# autoregressive rounds 8% dearer than baseline steps on XLA:CPU).
MAX_PROBE_GAP = 8
# Narrow drafting widths never observe the draft positions past them, whose estimate then rests on the prior:
# every DEEP_PROBE_EVERY drafting phases in a row below the full block, one round verifies the full block.
DEEP_PROBE_EVERY = 4
# Rounds timed per width by ``calibrate`` (best of CALIBRATION_REPEATS runs).
CALIBRATION_ROUNDS = 32
CALIBRATION_REPEATS = 3


class Policy(NamedTuple):
    """What the width choice carries from phase to phase (part of the decode loop state)."""

    stats: jax.Array  # [2, K] decayed per-row (attempts, acceptances) of each draft position
    costs: jax.Array  # [W] relative time of a round of each verify width
    forced: jax.Array  # index of the width every phase must use (calibration), -1 = choose
    last_width: jax.Array  # width of the last phase
    ar_blocks: jax.Array  # blocks of autoregressive rounds since the last drafting round
    probe_gap: jax.Array  # blocks of autoregressive rounds to wait before the next probe
    probing: jax.Array  # the last phase was a probe
    accepted: jax.Array  # drafts accepted per row in the last drafting round
    narrow_phases: jax.Array  # drafting phases in a row below the full block since it was last verified


def verify_widths(adaptive_widths: tuple[int, ...], block: int) -> tuple[int, ...]:
    """The widths a phase may verify: the requested ones below the block, then the full block."""
    return tuple(w for w in adaptive_widths if w < block) + (block,)


def initial_policy(block: int, num_widths: int) -> Policy:
    """Nothing observed yet: decoding starts as if after an autoregressive phase, with a one-round probe of
    the full block, so a text the draft cannot follow costs one drafting round, not a phase (and, failing,
    one block of autoregressive rounds before the next probe: the gap starts at 0, so the first failure only
    raises it to 1). The full block, not the width the prior favours, because that round observes every draft
    position: opening narrower left the positions past it at the prior, and at high acceptance short answers
    then never left the narrow width (``narrow_phases`` starts as if a deep probe were due)."""
    return Policy(stats=jnp.zeros((2, max(block - 1, 1)), jnp.float32), costs=jnp.ones((num_widths,), jnp.float32),
                  forced=jnp.int32(-1), last_width=jnp.int32(1), ar_blocks=jnp.int32(1),
                  probe_gap=jnp.int32(0), probing=jnp.bool_(False), accepted=jnp.float32(0),
                  narrow_phases=jnp.int32(DEEP_PROBE_EVERY))


def observe(policy: Policy, accepted: jax.Array, width: int, active: jax.Array) -> Policy:
    """Decay, then count one round: draft position ``j`` (1-based) was attempted by the rows that verified it
    and accepted everything before it, and accepted by the rows with more than ``j - 1`` acceptances. A
    width-1 round observes nothing and changes nothing: probes decide when drafting is worth trying again."""
    if width == 1:
        return policy
    j = jnp.arange(1, policy.stats.shape[1] + 1)[None]
    reach = jnp.minimum(accepted + 1, width - 1)[:, None]
    attempts = jnp.sum((j <= reach) & active[:, None], axis=0)
    accepts = jnp.sum((j <= accepted[:, None]) & active[:, None], axis=0)
    rows = jnp.maximum(jnp.sum(active), 1)
    counts = jnp.stack([attempts, accepts]).astype(jnp.float32) / rows
    mean = jnp.sum(jnp.where(active, accepted, 0)) / rows
    return policy._replace(stats=jnp.where(active.any(), DECAY * policy.stats + counts, policy.stats),
                           accepted=mean.astype(jnp.float32))


def expected_tokens(stats: jax.Array, widths: tuple[int, ...]) -> jax.Array:
    """``[len(widths)]`` expected tokens committed by one round of each width (accepted drafts + 1)."""
    attempts, accepts = stats
    rate = (accepts + PRIOR_WEIGHT * PRIOR_P) / (attempts + PRIOR_WEIGHT)
    reach = jnp.concatenate([jnp.ones((1,)), jnp.cumprod(rate)])  # P(position k accepted), k = 0 .. K
    cumulative = jnp.cumsum(reach)
    return jnp.stack([cumulative[w - 1] for w in widths])


def _deep_probe(choice: jax.Array, policy: Policy, widths: tuple[int, ...], first_drafting: int
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(choice, narrow, deep)``: a drafting width below the full block (``narrow``) becomes one round of the
    full block (``deep``) once DEEP_PROBE_EVERY narrow phases ran in a row (and at the opening, which starts
    with the count there)."""
    narrow = (choice >= first_drafting) & (choice < len(widths) - 1)
    deep = narrow & (policy.narrow_phases >= DEEP_PROBE_EVERY)
    return jnp.where(deep, len(widths) - 1, choice), narrow, deep


def next_phase(policy: Policy, widths: tuple[int, ...], block: int) -> tuple[jax.Array, jax.Array, Policy]:
    """``(width index, rounds)`` of the next phase. After a drafting phase: the width with the most expected
    tokens per unit of time, for DRAFT_PHASE rounds. Autoregressive phases observe nothing, so what follows
    them is a schedule: an autoregressive phase lasts until the next probe is due (``probe_gap`` blocks of
    rounds since the last drafting round, at least one block), then comes a one-round probe at the best
    drafting width. A probe whose round would have committed fewer tokens per unit of time than autoregressive
    rounds at every drafting width (``(min(accepted, w - 1) + 1) / cost(w) < 1 / cost(1)``) goes straight back
    to autoregressive rounds and doubles the gap (up to MAX_PROBE_GAP); one that beat them resets it to 1 and
    lets the expected rate choose, so a text that turns predictable brings drafting back within a few blocks
    and a hopeless one costs a probe every MAX_PROBE_GAP blocks. ``forced`` >= 0 overrides everything
    (calibration)."""
    rate = expected_tokens(policy.stats, widths) / policy.costs
    # Stay with the current width unless another is clearly better: the estimate is noisy, and a wrong switch
    # to autoregressive rounds costs a whole block of them.
    rate = rate * jnp.where(jnp.asarray(widths) == policy.last_width, 1.0 + HYSTERESIS, 1.0)
    best = jnp.argmax(rate).astype(jnp.int32)
    after_drafting = jnp.where(policy.last_width == 1, PROBE_PHASE, DRAFT_PHASE).astype(jnp.int32)
    if widths[0] != 1:  # no autoregressive width: drafting phases only (and deep probes)
        choice, narrow, deep = _deep_probe(best, policy, widths, first_drafting=0)
        narrow_phases = jnp.where(narrow & ~deep, policy.narrow_phases + 1, 0)
        return (jnp.where(policy.forced >= 0, policy.forced, choice), jnp.where(deep, PROBE_PHASE, after_drafting),
                policy._replace(narrow_phases=narrow_phases))
    # A probe fails when no drafting width would have beaten autoregressive rounds on its round: width w
    # commits min(accepted, w - 1) + 1 tokens (a lower bound for widths above the probe's), so a full-block
    # probe that accepted a little is judged at the narrow width that round supports, not at its own cost.
    drafting = jnp.asarray(widths[1:], jnp.float32)
    committed = jnp.minimum(policy.accepted, drafting - 1.0) + 1.0
    failed = policy.probing & jnp.all(committed * policy.costs[0] < policy.costs[1:])
    gap = jnp.where(policy.probing, jnp.where(failed, jnp.clip(2 * policy.probe_gap, 1, MAX_PROBE_GAP), 1),
                    policy.probe_gap)
    after_ar = policy.last_width == 1
    probe = after_ar & (policy.ar_blocks >= gap)
    best_drafting = 1 + jnp.argmax(rate[1:]).astype(jnp.int32)
    # After autoregressive phases: wait or probe. After a failed probe: straight back to autoregressive rounds
    # (one round of evidence must not be outvoted by the prior of the positions it did not reach).
    choice = jnp.where(after_ar, jnp.where(probe, best_drafting, 0), jnp.where(failed, 0, best))
    choice, narrow, deep = _deep_probe(choice, policy, widths, first_drafting=1)
    choice = jnp.where(policy.forced >= 0, policy.forced, choice)
    plain = choice == 0
    # (A forced autoregressive phase, timed by ``calibrate``, lasts as long as the longest unforced one.)
    blocks = jnp.where(policy.forced >= 0, MAX_PROBE_GAP, jnp.maximum(gap - policy.ar_blocks, 1))
    rounds = jnp.where(plain, blocks * block, jnp.where(deep, PROBE_PHASE, after_drafting))
    narrow_phases = jnp.where(narrow & ~deep, policy.narrow_phases + 1, jnp.where(plain, policy.narrow_phases, 0))
    return choice, rounds, policy._replace(ar_blocks=jnp.where(plain, policy.ar_blocks + blocks, 0),
                                           probe_gap=gap, probing=~plain & after_ar, narrow_phases=narrow_phases)


def calibrate(widths: tuple[int, ...], run_rounds: Callable[[int], tuple[float, int]]) -> np.ndarray:
    """Relative cost of a round of each width (the full block's is 1): ``run_rounds(i)`` runs the compiled
    loop with width ``i`` forced for up to CALIBRATION_ROUNDS rounds and returns (seconds, rounds taken)."""
    per_round = []
    for i in range(len(widths)):
        best = float("inf")
        for _ in range(CALIBRATION_REPEATS):
            seconds, rounds = run_rounds(i)
            best = min(best, seconds / max(rounds, 1))
        per_round.append(best)
    costs = np.asarray(per_round, np.float64)
    return (costs / costs[-1]).astype(np.float32)


def rounds_per_width(widths: Iterable[Iterable[int]]) -> dict[int, int]:
    """How many rounds ran at each verify width, from per-row (or per-answer) width logs."""
    return dict(sorted(Counter(int(w) for row in widths for w in row).items()))
