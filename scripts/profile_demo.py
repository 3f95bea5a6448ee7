"""Where the time of a round of ``python -m infer demo``'s decode loop goes, on this machine.

    python scripts/profile_demo.py                 # the breakdown: draft forward, verify, bookkeeping
    python scripts/profile_demo.py --reverted      # + the engine's CPU cuts undone (patched in this process only)
    python scripts/profile_demo.py --trace DIR     # + a per-op table of the DFlash loop (jax.profiler)

Everything runs the shipped pair (stories260K + the block-8 draft) on the demo's prompt (BOS only, greedy,
200 new tokens). Each variant is the engine's own compiled decode loop (``engine.generate.executables``),
timed as the demo times it (decode seconds / rounds) and measured round-robin with the others ``--repeats``
times (medians), so the machine's drift hits every variant alike:

- DFlash round: the real loop;
- drafts replayed: the same loop, with the draft forward replaced by a proposer that returns the drafts the
  real run proposed, round by round (same acceptance, same rounds): the difference is the draft forward as
  it costs inside the loop;
- drafts replayed, no target features: also without the 4 feature layers the draft reads (their concatenation
  and the round context);
- verify alone: the target on 8 tokens with the feature layers, then argmax, in a ``fori_loop`` (no
  acceptance, no commit): replayed minus this is the accept/commit bookkeeping;
- AR step: the baseline loop.

The target is decoded as ``Decoder.decoding_target()`` gives it (on CPU the tied head as a pre-transposed
``[hidden, vocab]`` kernel, for the target and the draft). ``--reverted`` adds each of the engine's two CPU
cuts undone, patched into this process only (no file changes): the PRNG split back in greedy rounds
(``decode_round``), and the tied head as ``x @ E.T``; for the DFlash round and the AR step alike. Greedy
outputs must stay identical (checked).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import inspect
import re
import shutil
import statistics
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_jax.startup import start_jax  # noqa: E402

start_jax()  # JAX without the CUDA plugin's start-up noise where the aot extra is installed

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dflash_jax.assets import DEMO_DRAFT, DEMO_TARGET  # noqa: E402
from dflash_jax.engine import generate as g  # noqa: E402
from dflash_jax.engine.proposers import DFlashProposer, NoProposer  # noqa: E402
from dflash_jax.engine.sampling import SamplingConfig, argmax  # noqa: E402
from dflash_jax.evaluation.machine import load_average, machine_info  # noqa: E402
from dflash_jax.models.draft import shared_head  # noqa: E402
from dflash_jax.models.target import TargetModel  # noqa: E402
from infer.run import load_decoder  # noqa: E402

NEW_TOKENS = 200


@dataclasses.dataclass(frozen=True)
class ReplayProposer:
    """Proposes the drafts a real run proposed, round by round: the round without the draft forward."""

    block_size: int
    feature_layers: tuple[int, ...] = ()

    def ingest(self, consts, state, features, positions, valid):
        return state

    def propose(self, consts, state, ctx, anchor, start, key, sampling, block_len=None):
        drafts = jax.lax.dynamic_index_in_dim(consts["drafts"], state["round"], axis=1, keepdims=False)
        return drafts, None, {"round": state["round"] + 1}


def patched_decode_round(*edits: tuple[str, str]):
    """``engine.generate.decode_round`` with textual edits, compiled in the module's namespace (a patch:
    an edit that no longer matches the source fails loudly)."""
    src = textwrap.dedent(inspect.getsource(g.decode_round))
    for old, new in edits:
        if src.count(old) != 1:
            raise SystemExit(f"patch no longer applies: {old.strip()!r} is not once in decode_round")
        src = src.replace(old, new)
    namespace = dict(vars(g))
    exec(compile(src, "<patched decode_round>", "exec"), namespace)
    return namespace["decode_round"]


KEY_SPLIT = ("    if settings.sampling.greedy:\n        # Greedy rounds draw nothing",
             "    if False:  # reverted: the PRNG split in every round, greedy or not\n        # Greedy rounds draw nothing")


class Loop:
    """One variant's compiled prefill and decode loop; ``run()`` -> (decode seconds, rounds, tokens)."""

    def __init__(self, name, target_config, target_params, proposer, inputs, settings, round_fn=None):
        self.name, self.params, self.inputs = name, target_params, inputs
        self.batch = g.pad_prompts(target_config, [[1]], NEW_TOKENS, proposer.block_size)
        self.key = jax.random.PRNGKey(0)
        original = g.decode_round
        g._EXECUTABLES.clear()
        g.decode_round = round_fn or original
        try:
            self.pre, self.loop, _, _ = g.executables(target_config, target_params, proposer, inputs, settings,
                                                   self.batch, self.key, jnp.float32)
        finally:
            g.decode_round = original
            g._EXECUTABLES.clear()

    def run(self):
        consts, pstate = self.inputs
        state = jax.block_until_ready(self.pre(self.params, consts, pstate, self.batch.tokens, self.batch.lengths,
                                               self.key))
        t0 = time.perf_counter()
        state = jax.block_until_ready(self.loop(self.params, consts, state, jnp.int32(NEW_TOKENS)))
        dt = time.perf_counter() - t0
        n = int(state.num_out[0])
        return dt, int(state.rounds[0]), np.asarray(state.out)[0, :n].tolist()


class VerifyAlone:
    """The target on 8 tokens with the draft's feature layers, argmax of the logits, 50 times in a loop."""

    iterations = 50

    def __init__(self, target_config, target_params, feature_layers, settings, block):
        self.name = "verify alone (target, 8 tokens + features)"
        target = TargetModel(target_config)
        proposer = NoProposer()
        slots = g.cache_slots(1, NEW_TOKENS, block, target_config.max_position_embeddings)
        pre, _ = g.jitted_functions(target_config, proposer, settings, slots, jnp.float32)
        batch = g.pad_prompts(target_config, [[1]], NEW_TOKENS, block)
        state = pre(target_params, {}, {}, batch.tokens, batch.lengths, jax.random.PRNGKey(0))

        def loop(params, cache, anchor, start):
            def body(i, c):
                cache, anchor, start = c
                tokens = jnp.broadcast_to(anchor[:, None], (1, block))
                out = target.apply({"params": params}, tokens, start[:, None] + jnp.arange(block)[None], cache,
                                   jnp.ones((1, block), bool), feature_layers=feature_layers)
                top = argmax(out.logits)[:, 0] + (out.features[:, 0, 0] > 1e30).astype(jnp.int32)
                return out.cache.with_lengths(start + 4), top, start + 4  # about tau tokens a round
            return jax.lax.fori_loop(0, self.iterations, body, (cache, anchor, start))

        self.args = (target_params, state.cache, state.anchor, state.start)
        self.compiled = jax.jit(loop).lower(*self.args).compile()
        jax.block_until_ready(self.compiled(*self.args))

    def run(self):
        t0 = time.perf_counter()
        jax.block_until_ready(self.compiled(*self.args))
        return time.perf_counter() - t0, self.iterations, None


def measure(variants, repeats: int, reference: list[int]) -> dict[str, list[float]]:
    for v in variants:  # warm-up
        v.run()
    times = {v.name: [] for v in variants}
    for _ in range(repeats):
        for v in variants:
            dt, rounds, tokens = v.run()
            if tokens is not None and tokens != reference:
                raise SystemExit(f"{v.name}: the greedy output changed")
            times[v.name].append(dt / rounds)
    return times


# ---------------------------------------------------------------------------------------------- the trace


def hlo_op_names(hlo: str) -> dict[str, tuple[str, list[str]]]:
    """HLO instruction name -> (shape, op_name metadata), fusions resolved through their computations."""
    comps, current = {}, None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            current = line.split()[0].lstrip("%")
            comps[current] = []
        elif current is not None:
            comps[current].append(line)
    out = {}
    for lines in comps.values():
        for line in lines:
            m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)", line)
            if not m:
                continue
            name, rest = m.groups()
            ops = re.findall(r'op_name="([^"]*)"', rest)
            called = re.search(r"calls=%([\w.\-]+)", rest)
            if not ops and called:
                ops = [o for l in comps.get(called.group(1), []) for o in re.findall(r'op_name="([^"]*)"', l)]
            operands = re.findall(r"%([\w.\-]+)", rest.split("calls=")[0])
            out[name] = (rest.split(" ")[0], ops, operands)
    # Fusions without any op_name (the attention products): named after what they read.
    for name, (shape, ops, operands) in out.items():
        if not ops:
            ops.extend("reads " + o for x in operands if x in out for o in out[x][1] if not o.startswith("reads "))
    return {name: (shape, ops) for name, (shape, ops, _) in out.items()}


def trace_table(loop: Loop, trace_dir: str, runs: int = 5, top: int = 25) -> str:
    names = hlo_op_names(loop.loop.as_text())
    shutil.rmtree(trace_dir, ignore_errors=True)
    jax.profiler.start_trace(trace_dir)
    for _ in range(runs):
        _, rounds, _ = loop.run()
    jax.profiler.stop_trace()
    data = jax.profiler.ProfileData.from_file(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
    total, count = collections.Counter(), collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if "XLAEigen" not in line.name:  # XLA:CPU's worker threads: one event per executed thunk
                continue
            for ev in line.events:
                if not ev.name.startswith(("ThunkExecutor", "end: ", "ThreadpoolListener")):
                    total[ev.name] += ev.duration_ns
                    count[ev.name] += 1

    def group(ops):
        text = " ".join(ops)
        return "draft" if "DraftModel" in text else "verify" if "TargetModel" in text else "engine/unnamed"

    per = runs * rounds
    groups = collections.Counter()
    rows = []
    for name, ns in total.items():
        shape, ops = names.get(name, ("?", []))
        groups[group(ops)] += ns
        label = sorted({o.replace("jit(wrapped)/while/body/", "") for o in ops},
                       key=lambda o: (o.startswith("reads "), o))
        rows.append((ns, name, shape, group(ops), label[0] if label else "(no op_name)"))
    rows.sort(reverse=True)
    all_ns = sum(total.values())
    lines = [f"per-op trace of the DFlash loop ({runs} decodes, {rounds} rounds each; the profiler slows every op, "
             "so read the shares, not the microseconds):",
             f"  {sum(count.values()) / per:.0f} thunks per round, {all_ns / per / 1e3:.0f} us of thunks per round: "
             + ", ".join(f"{k} {v / all_ns:.0%}" for k, v in groups.most_common())]
    for ns, name, shape, grp, label in rows[:top]:
        lines.append(f"  {ns / per / 1e3:7.1f} us  {grp:14s} {name:34s} {shape[:24]:24s} {label[:80]}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15, help="timed runs of every variant (default 15)")
    parser.add_argument("--reverted", action="store_true", help="also measure the engine's CPU cuts undone")
    parser.add_argument("--trace", metavar="DIR", help="also trace the DFlash loop into DIR and print a per-op table")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")

    decoder, _, stops = load_decoder(argparse.Namespace(target=str(DEMO_TARGET), ckpt=str(DEMO_DRAFT), tokenizer=None,
                                                        dtype="float32", block_size=None))
    (tc, tp), dc, dp = decoder.decoding_target(), decoder.draft_config, decoder.draft_params
    block = decoder.block_size
    settings = g.DecodeSettings(NEW_TOKENS, SamplingConfig(), tuple(stops))
    proposer = DFlashProposer(dc, block)
    slots = g.cache_slots(1, NEW_TOKENS, block, tc.max_position_embeddings)
    inputs = proposer.init(dp, shared_head(tp, tc.tie_word_embeddings), 1, slots)

    recorded = g.generate(tc, tp, [[1]], proposer, inputs, dataclasses.replace(settings, record_drafts=True))
    reference = recorded.tokens[0]
    drafts = np.zeros((1, NEW_TOKENS, block - 1), np.int32)
    drafts[0, : len(recorded.drafts[0])] = recorded.drafts[0]
    replay_inputs = ({"drafts": jnp.asarray(drafts)}, {"round": jnp.int32(0)})

    dflash = Loop("DFlash round", tc, tp, proposer, inputs, settings)
    variants = [
        dflash,
        Loop("  drafts replayed (no draft forward)", tc, tp, ReplayProposer(block, dc.target_layer_ids),
             replay_inputs, settings),
        Loop("  drafts replayed, no target features", tc, tp, ReplayProposer(block), replay_inputs, settings),
        VerifyAlone(tc, tp, dc.target_layer_ids, settings, block),
        Loop("AR step (baseline)", tc, tp, NoProposer(), NoProposer().init(), settings),
    ]
    if args.reverted:
        tied_c, tied_p = decoder.target_config, decoder.target_params  # as loaded: x @ E.T where tied
        tied_inputs = proposer.init(dp, shared_head(tied_p, tied_c.tie_word_embeddings), 1, slots)
        split = patched_decode_round(KEY_SPLIT)
        variants += [
            Loop("reverted: PRNG split in greedy rounds", tc, tp, proposer, inputs, settings, split),
            Loop("reverted: tied heads as x @ E.T", tied_c, tied_p, proposer, tied_inputs, settings),
            Loop("reverted: both", tied_c, tied_p, proposer, tied_inputs, settings, split),
            Loop("reverted: AR step, PRNG split", tc, tp, NoProposer(), NoProposer().init(), settings, split),
            Loop("reverted: AR step, x @ E.T", tied_c, tied_p, NoProposer(), NoProposer().init(), settings),
            Loop("reverted: AR step, both", tied_c, tied_p, NoProposer(), NoProposer().init(), settings, split),
        ]
    machine = machine_info()
    times = measure(variants, args.repeats, reference)
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    low = {k: min(v) * 1e6 for k, v in times.items()}
    rd = med["DFlash round"]
    print(f"JAX {machine['jax']} on {machine['backend']} ({machine['cpu']}, {machine['cpu_count']} CPUs), float32; "
          f"load average {machine['load_avg_1m']} at start, {load_average()} at end; tau {recorded.tau:.2f}, "
          f"{recorded.rounds[0]} rounds; medians of {args.repeats} interleaved runs")
    # Ratios within a cycle (runs a few tens of ms apart) drift less than separate medians: the columns
    # "vs round" and "vs AR" are medians of per-cycle ratios to the DFlash round and to the AR step.
    def paired(name, ref):
        return statistics.median(a / b for a, b in zip(times[name], times[ref]))

    print(f"  {'':44s} {'median':>7s}    {'min':>6s}    {'vs round':>8s} {'vs AR':>6s}")
    for name in times:
        print(f"  {name:44s} {med[name]:7.1f} us {low[name]:6.1f} us  {paired(name, 'DFlash round'):8.3f} "
              f"{paired(name, 'AR step (baseline)'):6.2f}")
    replayed = med["  drafts replayed (no draft forward)"]
    verify = med["verify alone (target, 8 tokens + features)"]
    draft, book = rd - replayed, replayed - verify
    features = replayed - med["  drafts replayed, no target features"]
    print(f"round {rd:.0f} us = draft forward {draft:.0f} us ({draft / rd:.0%}) + verify {verify:.0f} us "
          f"({verify / rd:.0%}) + accept/commit bookkeeping {book:.0f} us ({book / rd:.0%}); the target features "
          f"{features:.0f} us of it")
    cost = paired("DFlash round", "AR step (baseline)")
    print(f"round cost {cost:.2f} AR steps (median per-cycle ratio) -> speedup tau / cost = {recorded.tau / cost:.2f}x")
    if args.reverted:
        both = paired("reverted: both", "reverted: AR step, both")
        print(f"with both cuts undone: {both:.2f} AR steps (against the AR step without them too), "
              f"tau / cost = {recorded.tau / both:.2f}x")
    if args.trace:
        print(trace_table(dflash, args.trace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
