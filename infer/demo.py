"""``python -m infer demo``: DFlash on a real model, offline, on any machine.

The demo pair ships inside the package: llama2.c's stories260K (a real 260K-parameter LLaMA-architecture model
by Andrej Karpathy, MIT licence) and the DFlash2 draft this project trained for it (configs/runs/
stories260k-b8.yaml). The demo generates a story greedily with DFlash and with plain autoregressive decoding on
the same engine, checks that the two outputs are identical, and reports tau (tokens committed per round) and
the measured decode speedup.

Timing: after one untimed run of each (it compiles), DFlash and the baseline decode alternately, --repeats
pairs in a row (DFlash, baseline, DFlash, baseline, ...). Each pair gives a ratio (baseline decode time /
DFlash decode time: both decode the same tokens); the speedup printed is the median ratio (the lower one of
the middle two for an even N), with the middle half of the ratios (interquartile range) and their extremes as
the spread. A decode of 200 tokens lasts tens of milliseconds on a CPU, so pairing cancels the machine's drift
(other processes, clock changes), which separate medians would not.

The speedup is tau / (round cost): the round cost is the time of a DFlash round (draft forward, verify of the
block, accept and commit) in autoregressive steps, both measured in this run (decode time / rounds). On a CPU
a round of block 8 costs about 3.4 AR steps, which caps the speedup well below tau; where a round costs
about one AR step (a large target at batch 1 on a GPU: verifying a block reads the same weights as one step),
the same tau gives about tau x. This 260K-parameter pair is too small for that even on a GPU: on an H200 its
rounds were launch-bound, 2.6 AR steps each (docs/results-devices.md, "The first H200 run").
"""

from __future__ import annotations

import argparse

import numpy as np

from dflash_jax.assets import DEMO_DRAFT, DEMO_TARGET
from dflash_jax.errors import UserError
from infer.cli import Parser, add_tree_args, run_cli, text_arg
from infer.run import load_decoder

DEFAULT_PAIRS = 25


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m infer demo", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", default="", type=text_arg,
                        help="the story's opening (default: none, the model starts from its BOS token)")
    parser.add_argument("--max-new-tokens", type=int, default=200, metavar="N",
                        help="tokens to generate (default 200, the length llama2.c's own test uses)")
    parser.add_argument("--block-size", type=int, metavar="B",
                        help="tokens per round (anchor + B-1 drafts), 2 to the draft's 8 (default 8)")
    parser.add_argument("--repeats", type=int, default=DEFAULT_PAIRS, metavar="N",
                        help="timed pairs of decodes, interleaved (DFlash then baseline, N times in a row, after "
                             "one untimed run of each); the speedup is the median of the N per-pair ratios, "
                             f"printed with their spread (default {DEFAULT_PAIRS}: about 2 s of decoding on a "
                             "2-core CPU)")
    add_tree_args(parser)
    return parser


def timed_pairs(run_dflash, run_baseline, pairs: int):
    """One untimed run of each (compile + warm-up), then ``pairs`` runs of each, alternating. Returns the
    warm-up results and the list of ``(dflash, baseline)`` results; every run must give the same tokens."""
    first = run_dflash(), run_baseline()
    out = []
    for _ in range(pairs):
        pair = run_dflash(), run_baseline()
        for r, ref, name in zip(pair, first, ("DFlash", "the baseline")):
            if r.tokens != ref.tokens:  # greedy decoding of one program must repeat exactly
                raise RuntimeError(f"{name} gave different tokens on a repeated run")
        out.append(pair)
    return first, out


def pair_figures(pairs) -> dict:
    """Per pair (batch of one row): the speedup, baseline decode s / DFlash decode s (both decode the same
    tokens), and the round cost, a DFlash round's time in AR steps (decode_s / rounds of each). The median is
    the lower median, an actual pair, whose own round cost is reported: per pair, speedup = tau / round cost
    exactly (tau = decoded tokens / DFlash rounds, and the baseline takes one round per decoded token)."""
    ratios = [b.decode_s / d.decode_s for d, b in pairs]
    order = sorted(range(len(pairs)), key=ratios.__getitem__)
    d, b = pairs[order[(len(pairs) - 1) // 2]]
    q1, q3 = np.percentile(np.asarray(ratios, np.float64), [25, 75])
    return {"ratios": ratios, "speedup": b.decode_s / d.decode_s, "q1": float(q1), "q3": float(q3),
            "round_cost": (d.decode_s / d.rounds[0]) / (b.decode_s / b.rounds[0]),
            "dflash_s": d.decode_s, "baseline_s": b.decode_s}


def format_figures(f: dict, tau: float, decoded: int, verify: str) -> str:
    """``verify``: what a round verifies, in words ("8 tokens", "a tree of 16 drafts")."""
    n = len(f["ratios"])
    spread = (f"middle half {f['q1']:.2f}-{f['q3']:.2f}x, all {min(f['ratios']):.2f}-{max(f['ratios']):.2f}x"
              if n > 1 else "a single pair: no spread")
    return "\n".join([
        f"speedup : {f['speedup']:.2f}x (decode, same engine; median of {n} interleaved pair{'s' if n > 1 else ''}, "
        f"{spread})",
        f"          median pair: DFlash {f['dflash_s'] * 1e3:.1f} ms, baseline {f['baseline_s'] * 1e3:.1f} ms for "
        f"{decoded} tokens ({decoded / f['dflash_s']:.0f} vs {decoded / f['baseline_s']:.0f} tok/s)",
        f"why     : a DFlash round (draft + verify of {verify}) costs {f['round_cost']:.2f} AR steps here: "
        f"tau {tau:.2f} / {f['round_cost']:.2f} = {tau / f['round_cost']:.2f}x;",
        f"          where a round costs about one AR step (a large target at batch 1 on a GPU) the same tau gives "
        f"~{tau:.1f}x",
    ])


def demo_main(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.repeats < 1:
        raise UserError(f"--repeats must be at least 1 (timed pairs of decodes), got {args.repeats}")
    if args.block_size is not None and args.block_size < 2:
        raise UserError(f"--block-size must be at least 2 (the anchor and one draft), got {args.block_size}")
    print(f"target: stories260K (llama2.c, {DEMO_TARGET.name})\ndraft:  DFlash2 draft trained by dflash_jax "
          f"({DEMO_DRAFT.name})")
    decoder, tokenizer, stops = load_decoder(argparse.Namespace(
        target=str(DEMO_TARGET), ckpt=str(DEMO_DRAFT), tokenizer=None, dtype="float32", block_size=args.block_size,
        tree=args.tree, tree_budgets=args.tree_budgets))
    prompt = [tokenizer.bos_token_id] + list(tokenizer(args.prompt, add_special_tokens=False)["input_ids"])
    print(f"compiling, then timing {args.repeats} pair(s) of decodes (DFlash, baseline, alternating) ...",
          flush=True)
    (dflash, baseline), pairs = timed_pairs(
        lambda: decoder.generate([prompt], args.max_new_tokens, stop_tokens=stops),
        lambda: decoder.generate([prompt], args.max_new_tokens, stop_tokens=stops, baseline=True),
        args.repeats)
    text = tokenizer.decode(prompt + dflash.tokens[0], skip_special_tokens=True)
    print(f"\n{text}\n")
    print(f"identical to the baseline: {dflash.tokens == baseline.tokens}")
    decoded = dflash.num_tokens - 1  # the prefill makes the first token
    if decoded < 1 or dflash.rounds[0] < 1:
        print(f"tau     : nothing decoded after the prefill's first token ({dflash.num_tokens} token(s)): no "
              "speedup to measure")
        return 0
    counts = np.bincount(dflash.accept_lengths[0], minlength=decoder.block_size + 1)[1:]
    print(f"tau     : {dflash.tau:.2f} tokens per round ({decoded} tokens in {dflash.rounds[0]} rounds; rounds by "
          "tokens committed: " + ", ".join(f"{k}: {c}" for k, c in enumerate(counts, start=1) if c) + ")")
    verify = f"a tree of {decoder.tree_budget} drafts" if decoder.tree_budget else (
        "the chain or a tree (--tree auto)" if decoder.tree_auto else f"{decoder.block_size} tokens")
    print(format_figures(pair_figures(pairs), dflash.tau, decoded, verify))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), demo_main, argv)
