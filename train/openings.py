"""``python -m train openings --from DIR --out DIR [--held-out 256]``: training and held-out prompt files from
openings the target wrote (a 'python -m train regenerate' output of short continuations).

Writes DIR/train-openings.jsonl and DIR/heldout.jsonl ({"prompt": ...} rows). No training prompt starts with
a held-out one and no held-out prompt starts with a training one, so evaluating on the held-out prompts never
replays the beginning of a training row.
"""

from __future__ import annotations

import argparse

from dflash_jax.errors import UserError
from infer.cli import Parser, run_cli, seed_arg


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m train openings", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="source", required=True, metavar="SOURCE",
                        help="regenerated openings: a 'train regenerate' output directory, or any data source "
                             "(a .jsonl/.json/.parquet/.arrow file, a directory or glob of them, "
                             "hf:ORG/NAME[:CONFIG[:SPLIT]])")
    parser.add_argument("--columns", metavar="FIELD=COLUMN,...",
                        help="read these columns as the layout's fields, e.g. prompt=instruction,text=story "
                             "(default: columns are recognised by name)")
    parser.add_argument("--out", required=True, metavar="DIR", help="where the two prompt files are written")
    parser.add_argument("--held-out", type=int, default=256, metavar="N", help="held-out prompts (default 256)")
    parser.add_argument("--seed", type=seed_arg, default=0, help="seed of the split (default 0)")
    return parser


def openings_main(args: argparse.Namespace) -> int:
    from dflash_jax.data.openings import make_opening_prompts

    if args.held_out < 1:
        raise UserError(f"--held-out must be at least 1, got {args.held_out}")
    stats = make_opening_prompts(args.source, args.out, args.held_out, args.seed, columns=args.columns)
    print(f"{stats['read']} openings read ({stats['skipped']} malformed rows skipped): {stats['train']} training "
          f"prompts, {stats['held_out']} held out, in {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), openings_main, argv)
