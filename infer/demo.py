"""``python -m infer demo``: DFlash on a real model, offline, on any machine.

The demo pair ships inside the package: llama2.c's stories260K (a real 260K-parameter LLaMA-architecture model
by Andrej Karpathy, MIT licence) and the DFlash draft this project trained for it (configs/runs/
stories260k-b8.yaml). The demo generates a story greedily with DFlash and with plain autoregressive decoding on
the same engine, checks that the two outputs are identical, and reports tau (tokens committed per round) and
the measured decode speedup.
"""

from __future__ import annotations

import argparse

import numpy as np

from dflash_jax.assets import DEMO_DRAFT, DEMO_TARGET
from dflash_jax.errors import UserError
from infer.cli import Parser, run_cli, text_arg
from infer.run import format_summary, load_decoder, summarize


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m infer demo", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", default="", type=text_arg,
                        help="the story's opening (default: none, the model starts from its BOS token)")
    parser.add_argument("--max-new-tokens", type=int, default=200, metavar="N",
                        help="tokens to generate (default 200, the length llama2.c's own test uses)")
    parser.add_argument("--block-size", type=int, metavar="B",
                        help="tokens per round, at most the draft's 8 (default 8)")
    parser.add_argument("--repeats", type=int, default=3, metavar="N",
                        help="timed runs of each decoder; the median decode time is reported (default 3)")
    return parser


def _median_run(generate, repeats: int):
    runs = [generate() for _ in range(repeats)]
    return sorted(runs, key=lambda r: r.decode_s)[len(runs) // 2]


def demo_main(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {args.repeats}")
    print(f"target: stories260K (llama2.c, {DEMO_TARGET.name})\ndraft:  DFlash draft trained by dflash_jax "
          f"({DEMO_DRAFT.name})")
    decoder, tokenizer, stops = load_decoder(argparse.Namespace(
        target=str(DEMO_TARGET), ckpt=str(DEMO_DRAFT), tokenizer=None, dtype="float32", block_size=args.block_size))
    prompt = [tokenizer.bos_token_id] + list(tokenizer(args.prompt, add_special_tokens=False)["input_ids"])
    dflash = _median_run(lambda: decoder.generate([prompt], args.max_new_tokens, stop_tokens=stops), args.repeats)
    baseline = _median_run(lambda: decoder.generate([prompt], args.max_new_tokens, stop_tokens=stops,
                                                    baseline=True), args.repeats)
    text = tokenizer.decode(prompt + dflash.tokens[0], skip_special_tokens=True)
    print(f"\n{text}\n")
    print(f"identical to the baseline: {dflash.tokens == baseline.tokens}")
    counts = np.bincount(dflash.accept_lengths[0], minlength=decoder.block_size + 1)[1:]
    print("tokens per round: " + ", ".join(f"{k}: {c}" for k, c in enumerate(counts, start=1) if c))
    print(format_summary(summarize(dflash, baseline)))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), demo_main, argv)
