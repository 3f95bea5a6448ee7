"""``python -m infer demo``: the whole inference path on a real model, on any machine.

Converts llama2.c's stories260K (from ../shared/data) into a Hugging Face directory, checks that greedy
decoding reproduces llama2.c's expected text, creates an UNTRAINED DFlash draft for it in the official layout,
and runs DFlash against the autoregressive baseline on the same engine. An untrained draft is accepted about
never, so tau is about 1 and DFlash is slower here; the point is the lossless output and the plumbing. Train a
draft (``python -m train``) to see a speedup.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash_jax.checkpoints.llama2c import convert_llama2c
from dflash_jax.checkpoints.official_draft import init_draft_params, save_draft
from dflash_jax.models.draft_config import DraftConfig
from infer.cli import Parser, run_cli
from infer.run import format_summary, load_decoder, summarize

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m infer demo", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(DEFAULT_DATA), metavar="DIR",
                        help="the shared data folder holding stories260K/ (default: ../shared/data)")
    parser.add_argument("--work", default="runs/demo", metavar="DIR",
                        help="where the converted target and the untrained draft are written (default runs/demo)")
    parser.add_argument("--max-new-tokens", type=int, default=200, metavar="N",
                        help="tokens to generate from BOS (default 200, the length llama2.c's test uses)")
    parser.add_argument("--block-size", type=int, default=8, help="draft block size (default 8)")
    return parser


def prepare(data: Path, work: Path, block_size: int) -> tuple[Path, Path]:
    stories = data / "stories260K"
    if not (stories / "stories260K.bin").is_file():
        raise FileNotFoundError(f"{stories / 'stories260K.bin'}: not found; pass --data pointing at shared/data")
    target_dir, draft_dir = work / "stories260K-hf", work / f"draft-untrained-b{block_size}"
    if not (target_dir / "config.json").is_file():
        convert_llama2c(stories / "stories260K.bin", stories / "tok512.model", target_dir)
    if not (draft_dir / "config.json").is_file():
        from dflash_jax.models.config import TargetConfig

        target = TargetConfig.from_json(target_dir)
        config = DraftConfig.for_target(target, num_layers=2, block_size=block_size, mask_token_id=0)
        save_draft(config, init_draft_params(config, seed=0), draft_dir)
    return target_dir, draft_dir


def demo_main(args: argparse.Namespace) -> int:
    target_dir, draft_dir = prepare(Path(args.data), Path(args.work), args.block_size)
    print(f"target: {target_dir} (stories260K converted from llama2.c)\ndraft:  {draft_dir} (untrained)")
    decoder, tokenizer, stops = load_decoder(argparse.Namespace(
        target=str(target_dir), ckpt=str(draft_dir), tokenizer=None, dtype="float32", block_size=args.block_size))
    bos = [tokenizer.bos_token_id]
    dflash = decoder.generate([bos], args.max_new_tokens, stop_tokens=stops)
    baseline = decoder.generate([bos], args.max_new_tokens, stop_tokens=stops, baseline=True)
    text = tokenizer.decode(dflash.tokens[0], skip_special_tokens=True)
    print(f"\n{text}\n")
    print(f"DFlash output identical to the baseline: {dflash.tokens == baseline.tokens}")
    expected = Path(args.data) / "stories260K" / "expected_greedy_200.txt"
    if args.max_new_tokens == 200 and expected.is_file():
        print(f"identical to llama2.c's expected text:  {text.encode() == expected.read_bytes()}")
    print(format_summary(summarize(dflash, baseline)))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), demo_main, argv)
