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
from typing import Any, Callable, Iterable, NamedTuple

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
    """Relative cost of a round of each width (the last one's is 1): ``run_rounds(i)`` runs the compiled
    loop with width ``i`` forced for up to CALIBRATION_ROUNDS rounds and returns (seconds, rounds taken).
    The repeats go round-robin over the widths (a burst of other work on the machine then slows one run of
    each, not every run of one), each width keeps its best; a wider round never costs less than a narrower
    one (the running maximum), so timing noise cannot make a wide verify look cheap."""
    best = [float("inf")] * len(widths)
    for _ in range(CALIBRATION_REPEATS):
        for i in range(len(widths)):
            seconds, rounds = run_rounds(i)
            best[i] = min(best[i], seconds / max(rounds, 1))
    costs = np.maximum.accumulate(np.asarray(best, np.float64))
    return (costs / costs[-1]).astype(np.float32)


def rounds_per_width(widths: Iterable[Iterable[int]]) -> dict[int, int]:
    """How many rounds ran at each verify width, from per-row (or per-answer) width logs."""
    return dict(sorted(Counter(int(w) for row in widths for w in row).items()))


# ----------------------------------------------------------------------------------------------------------
# Tree budget (``--tree auto``, engine/tree.py): the chain or one of a few tree budgets, chosen per phase
#
# The options are the chain (index 0) and the tree budgets (ascending). A choice holds for a phase of
# DRAFT_PHASE rounds, each option running its own ``lax.while_loop`` (zero rounds unless chosen), as for the
# widths above. The rule is CaDDTree's (SPEC 12.5): the most expected tokens per unit of round time,
# ``(1 + Phi(n)) / cost(n)`` with ``Phi(n)`` the draft's probability mass of the budget-``n`` tree
# (``tree.prefix_mass``; the chain's is ``tree.spine_mass``), but evaluated once per phase on decayed
# averages rather than every round: building the largest tree every round only to decide costs, on a small
# model, more than a chain round (on the shipped CPU pair a tree round costs ~3 chain rounds).
#
# - Tree rounds observe the surrogate of every option up to their budget (truncations of their own tree) and
#   the tokens they committed; ``alpha`` = observed / predicted tokens (decayed) corrects the draft's
#   over- or under-confidence and scales every option's surrogate.
# - Chain rounds observe only their committed tokens. After chain phases a one-round probe at the largest
#   budget refreshes the surrogates, every ``gap`` chain phases: 1, doubled after each probe that went back
#   to the chain (up to TREE_MAX_GAP), reset when a tree is chosen. The chain phases between two probes run
#   as one phase of that many phases' rounds (TREE_MAX_GAP's while no budget is hopeful).
# - A budget that cannot pay even if every round accepted a whole block (``block / cost(n)`` below the
#   chain's observed tokens per unit of time) is never probed: where a tree round costs several chain rounds
#   (small models, CPUs) the decode stays a chain.
# - Calibration times every option on the call's own prompts and counts what each committed. Where no budget's
#   calibration rounds beat the chain's (tokens per unit of time, by TREE_MARGIN), ``generate`` runs the plain
#   chain program instead (``paying_budgets``): the phase bookkeeping alone, a zero-round loop per option,
#   cost the shipped CPU pair up to 19% of the chain's speed, and its probes more.
#
# Lossless: every option verifies losslessly, and the choice depends only on drafts and committed tokens.

TREE_MAX_GAP = 16
# A tree must promise this much more than the chain (relative) to be probed or chosen: its measured cost is
# the noisiest figure of the rule (on a busy CPU a tree round measured anywhere from 1.5 to 2.3 chain rounds),
# and a tree chosen wrongly costs a whole phase.
TREE_MARGIN = 0.1


class TreePolicy(NamedTuple):
    """What the tree budget choice carries from phase to phase (the loop state's ``policy``)."""

    costs: jax.Array  # [O] relative time of a round of each option (the chain, then the budgets)
    forced: jax.Array  # option every phase must use (calibration), -1 = choose
    last: jax.Array  # option of the last phase, -1 before the first
    chain: jax.Array  # [2] decayed (rounds, committed tokens per row) of chain rounds
    surrogate: jax.Array  # [2, O] decayed (rounds, 1 + Phi per row) of each option, from tree rounds
    calibration: jax.Array  # [2] decayed (committed tokens, 1 + Phi of the option run) per row, tree rounds
    gap: jax.Array  # chain phases between probes
    chain_phases: jax.Array  # chain phases since the last tree round
    probing: jax.Array  # the last phase was a probe


def tree_options(budgets: tuple[int, ...]) -> tuple[int, ...]:
    """The options of ``--tree auto``: 0 (the chain), then the budgets ascending."""
    return (0,) + tuple(sorted(set(budgets)))


def initial_tree_policy(num_options: int) -> TreePolicy:
    return TreePolicy(costs=jnp.ones((num_options,), jnp.float32), forced=jnp.int32(-1), last=jnp.int32(-1),
                      chain=jnp.zeros((2,), jnp.float32), surrogate=jnp.zeros((2, num_options), jnp.float32),
                      calibration=jnp.zeros((2,), jnp.float32), gap=jnp.int32(1), chain_phases=jnp.int32(0),
                      probing=jnp.bool_(False))


def _row_mean(x: jax.Array, active: jax.Array) -> jax.Array:
    rows = jnp.maximum(jnp.sum(active), 1)
    return jnp.sum(jnp.where(active.reshape(active.shape + (1,) * (x.ndim - 1)), x, 0), axis=0) / rows


def observe_chain(policy: TreePolicy, accepted: jax.Array, active: jax.Array) -> TreePolicy:
    """A chain round: its committed tokens per row (accepted drafts + 1)."""
    mean = _row_mean((accepted + 1).astype(jnp.float32), active)
    chain = jnp.where(active.any(), DECAY * policy.chain + jnp.stack([1.0, mean]), policy.chain)
    return policy._replace(chain=chain)


def observe_tree(policy: TreePolicy, accepted: jax.Array, expected: jax.Array, option: int,
                 active: jax.Array) -> TreePolicy:
    """A tree round of option ``option``: ``expected [R, O]`` is each row's ``1 + Phi`` of every option this
    round's tree covers (NaN where it does not: the budgets above its own)."""
    known = jnp.isfinite(expected[0])
    mean = _row_mean(jnp.where(jnp.isfinite(expected), expected, 0.0), active)
    tokens = _row_mean((accepted + 1).astype(jnp.float32), active)
    update = active.any() & known
    surrogate = jnp.where(update[None], DECAY * policy.surrogate + jnp.stack([jnp.ones_like(mean), mean]),
                          policy.surrogate)
    calibration = jnp.where(active.any(), DECAY * policy.calibration + jnp.stack([tokens, mean[option]]),
                            policy.calibration)
    return policy._replace(surrogate=surrogate, calibration=calibration)


def tree_rates(policy: TreePolicy, options: tuple[int, ...], block: int) -> tuple[jax.Array, jax.Array]:
    """``(tokens per unit of time [O], known [O])``: the expected committed tokens of a round of each option
    over its cost. The chain's from its observed rounds (else its surrogate); a tree's from its surrogate
    times the calibration, capped at what a round can commit (``min(block, budget + 1)``)."""
    alpha = jnp.where(policy.calibration[1] > 0, policy.calibration[0] / jnp.maximum(policy.calibration[1], 1e-6), 1.0)
    seen = policy.surrogate[0] > 0
    predicted = alpha * policy.surrogate[1] / jnp.maximum(policy.surrogate[0], 1e-6)
    cap = jnp.asarray([block] + [min(block, b + 1) for b in options[1:]], jnp.float32)
    tokens = jnp.minimum(predicted, cap)
    chain_seen = policy.chain[0] > 0
    tokens = tokens.at[0].set(jnp.where(chain_seen, policy.chain[1] / jnp.maximum(policy.chain[0], 1e-6), tokens[0]))
    known = seen.at[0].set(chain_seen | seen[0])
    return tokens / policy.costs, known


def hopeful_budgets(costs: Any, options: tuple[int, ...], block: int, chain_rate: Any) -> Any:
    """Per tree budget: could it beat the chain (``chain_rate`` committed tokens per unit of ``costs``) by
    TREE_MARGIN even if every round of it committed all it can (``min(block, budget + 1)`` tokens)?"""
    cap = jnp.asarray([min(block, b + 1) for b in options[1:]], np.float32)
    return cap / costs[1:] > chain_rate * (1.0 + TREE_MARGIN)


def paying_budgets(costs: np.ndarray, options: tuple[int, ...], tokens: np.ndarray) -> np.ndarray:
    """Per tree budget, from calibration runs: did its rounds commit more tokens per unit of time than the
    chain's rounds did, by TREE_MARGIN? ``tokens [O]``: committed tokens per row and round of each option
    (the chain's first), ``costs [O]`` its round costs. Where none does, ``generate`` decodes with the chain's
    own program: the phase rule would at best choose the chain every phase and pay its bookkeeping and its
    probes (measured on the shipped CPU pair: with budgets 8-32 judged hopeful by their caps, auto ran 85% chain
    rounds and still lost 20% to the chain)."""
    rate = np.asarray(tokens, np.float64) / np.asarray(costs, np.float64)
    return rate[1:] > rate[0] * (1.0 + TREE_MARGIN)


def next_tree_phase(policy: TreePolicy, options: tuple[int, ...], block: int
                    ) -> tuple[jax.Array, jax.Array, TreePolicy]:
    """``(option index, rounds, policy)`` of the next phase (see the section comment above)."""
    rate, known = tree_rates(policy, options, block)
    # A budget is hopeless when a round committing all it can would still lose to the chain as observed.
    chain_rate = rate[0] * (1.0 + TREE_MARGIN)
    hopeful = jnp.where(known[0], hopeful_budgets(policy.costs, options, block, rate[0]), True)
    candidates = jnp.concatenate([jnp.ones((1,), bool), hopeful & known[1:]])
    best = jnp.argmax(jnp.where(candidates, rate.at[0].set(chain_rate), -jnp.inf)).astype(jnp.int32)
    largest = jnp.int32(len(options) - 1) - jnp.argmax(hopeful[::-1]).astype(jnp.int32)
    after_tree = policy.last > 0
    # After chain phases (and at the start, which opens with a chain phase to observe it): chain until a probe
    # is due, then one round at the largest hopeful budget.
    completed = jnp.where(policy.last == 0, policy.chain_phases + 1, 0)  # chain phases since a tree round
    probe = (policy.last == 0) & (completed >= policy.gap) & hopeful.any()
    choice = jnp.where(after_tree, best, jnp.where(probe, largest, 0))
    failed = policy.probing & (choice == 0)
    gap = jnp.where(failed, jnp.minimum(2 * policy.gap, TREE_MAX_GAP), jnp.where(after_tree & (choice > 0), 1, policy.gap))
    # A chain phase lasts until the next probe is due (``gap`` phases' worth of rounds in one), or TREE_MAX_GAP
    # phases' while no tree is hopeful: the bookkeeping of a phase (this decision, one zero-round loop per
    # tree option) is paid once per stretch instead of every DRAFT_PHASE rounds (measured on the shipped
    # pair: 5% of a chain round with four tree options). It is counted as that many chain phases.
    stretch = jnp.where(hopeful.any(), jnp.maximum(gap - completed, 1), TREE_MAX_GAP)
    forced = policy.forced >= 0
    stretch = jnp.where((choice == 0) & ~forced, stretch, 1).astype(jnp.int32)
    chain_phases = jnp.where(choice == 0, completed + stretch - 1, 0)
    rounds = jnp.where(probe, PROBE_PHASE, DRAFT_PHASE * stretch).astype(jnp.int32)
    choice = jnp.where(forced, policy.forced, choice)
    return choice, rounds, policy._replace(gap=gap, chain_phases=chain_phases, probing=probe & ~forced)


def tree_budget_summary(budgets: Iterable[Iterable[int]]) -> dict:
    """``--tree auto``'s choices from per-row budget logs (0: a chain round): rounds per budget, the share of
    chain rounds and the mean budget over all rounds (a chain round counting 0 nodes)."""
    counts = rounds_per_width(budgets)
    total = sum(counts.values())
    return {"rounds_per_budget": {str(b): n for b, n in counts.items()},
            "chain_share": counts.get(0, 0) / total if total else float("nan"),
            "mean_budget": sum(b * n for b, n in counts.items()) / total if total else float("nan")}
