"""How often DFlash and the autoregressive baseline give the same greedy tokens, on the shipped demo pair.

    python scripts/bf16_agreement.py                       # 64 prompts, 200 new tokens, bfloat16
    python scripts/bf16_agreement.py --dtype float32       # the control: exact up to float32 rounding

In exact arithmetic greedy DFlash (the draft proposes, the target verifies a block) and greedy autoregressive
decoding commit the same tokens. In a low-precision dtype the verify forward (a block of tokens) and the
one-token AR step compute with different shapes, so a near-tie argmax can come out differently and the two
outputs part ways from there on. This script counts the prompts whose two outputs are identical, and for each
one that differs gives the first differing generated token (0 = the first token after the prompt); also tau
(tokens committed per DFlash round, over all rows).

Prompts are made independently of the code under test's decisions: story openings sampled from the target
itself at temperature 1.0 (the baseline loop, float32, from the BOS token), in fixed chunks of
PROMPT_CHUNK rows with seed ``--seed * 1000 + chunk``; each opening is cut to a length drawn from 8..16 tokens
(numpy, seeded by --seed) and at an EOS. A prompt is BOS + those token ids, fed as ids. So the prompts depend
only on --seed and their index, never on --dtype or --batch.

Both greedy decodes then run in --dtype, --batch prompts per call, stopping at the target's EOS (as the demo
does).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `infer` is a top-level package of the repo

from dflash_jax.startup import start_jax  # noqa: E402

start_jax()  # JAX without the CUDA plugin's start-up noise where the aot extra is installed

from dflash_jax.assets import DEMO_DRAFT, DEMO_TARGET  # noqa: E402
from dflash_jax.engine.sampling import SamplingConfig  # noqa: E402
from dflash_jax.errors import UserError  # noqa: E402
from infer.cli import Parser, run_cli, seed_arg  # noqa: E402
from infer.run import load_decoder  # noqa: E402

PROMPT_CHUNK = 16  # rows per prompt-sampling call: fixed, so --batch never changes the prompts
MIN_LEN, MAX_LEN = 8, 16  # sampled tokens per prompt (after BOS)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python scripts/bf16_agreement.py", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64, metavar="N", help="number of prompts (default 64)")
    p.add_argument("--max-new-tokens", type=int, default=200, metavar="N",
                   help="greedy tokens to generate per prompt (default 200, as the demo)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="compute and parameter dtype of the two greedy decodes (default bfloat16; the prompts "
                        "are always sampled in float32)")
    p.add_argument("--batch", type=int, default=16, metavar="B",
                   help="prompts per generate call for the greedy decodes (default 16)")
    p.add_argument("--seed", type=seed_arg, default=0,
                   help="seed of the prompt sampling and of the prompt lengths (default 0)")
    p.add_argument("--json", metavar="PATH", help="also write the results as one JSON document to PATH")
    return p


def demo_decoder(dtype: str):
    return load_decoder(argparse.Namespace(target=str(DEMO_TARGET), ckpt=str(DEMO_DRAFT), tokenizer=None,
                                           dtype=dtype, block_size=None))


def make_prompts(n: int, seed: int, bos: int, stops: list[int]) -> list[list[int]]:
    decoder, _, _ = demo_decoder("float32")
    lengths = np.random.default_rng(seed).integers(MIN_LEN, MAX_LEN + 1, size=n)
    prompts = []
    for chunk in range((n + PROMPT_CHUNK - 1) // PROMPT_CHUNK):
        r = decoder.generate([[bos]] * PROMPT_CHUNK, MAX_LEN, SamplingConfig(temperature=1.0), baseline=True,
                             seed=seed * 1000 + chunk)
        for row in r.tokens:
            if len(prompts) == n:
                break
            toks = row[: int(lengths[len(prompts)])]
            cut = next((i for i, t in enumerate(toks) if t in stops), len(toks))
            prompts.append([bos] + toks[:cut])
    return prompts


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing generated token; None when identical (one a strict prefix of the other
    differs at the shorter one's length)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement_main(args: argparse.Namespace) -> int:
    for name in ("prompts", "max_new_tokens", "batch"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    start = time.perf_counter()
    decoder, tokenizer, stops = demo_decoder(args.dtype)
    prompts = make_prompts(args.prompts, args.seed, tokenizer.bos_token_id, stops)
    print(f"{len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens with BOS), "
          f"{args.max_new_tokens} new tokens, {args.dtype}, batches of {args.batch}", flush=True)
    rows, accepts = [], []
    for i in range(0, len(prompts), args.batch):
        chunk = prompts[i: i + args.batch]
        d = decoder.generate(chunk, args.max_new_tokens, stop_tokens=stops)
        b = decoder.generate(chunk, args.max_new_tokens, stop_tokens=stops, baseline=True)
        accepts += [a for row in d.accept_lengths for a in row]
        for j, (x, y) in enumerate(zip(d.tokens, b.tokens)):
            rows.append({"index": i + j, "prompt": chunk[j], "first_diff": first_difference(x, y),
                         "dflash_tokens": len(x), "baseline_tokens": len(y)})
        print(f"  prompts {i}-{i + len(chunk) - 1}: {sum(r['first_diff'] is None for r in rows[i:])}/{len(chunk)} "
              f"identical", flush=True)
    wall = time.perf_counter() - start
    differ = [r for r in rows if r["first_diff"] is not None]
    tau = float(np.mean(accepts)) if accepts else float("nan")

    print(f"\n{'prompt':>6}  {'first diff':>10}  {'DFlash len':>10}  {'baseline len':>12}  text")
    for r in differ:
        text = tokenizer.decode(r["prompt"], skip_special_tokens=True).replace("\n", " ")
        print(f"{r['index']:>6}  {r['first_diff']:>10}  {r['dflash_tokens']:>10}  {r['baseline_tokens']:>12}  "
              f"{text[:40]!r}")
    print(f"\nidentical: {len(rows) - len(differ)}/{len(rows)}   first differing positions: "
          f"{sorted(r['first_diff'] for r in differ) or 'none'}")
    print(f"tau: {tau:.2f}   wall: {wall:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "dtype": args.dtype, "prompts": len(rows), "max_new_tokens": args.max_new_tokens, "batch": args.batch,
            "seed": args.seed, "identical": len(rows) - len(differ), "tau": tau, "wall_s": wall,
            "first_differences": {r["index"]: r["first_diff"] for r in differ}, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(build_parser(), agreement_main, None))
