"""``python -m infer bench``: the DFlash paper's benchmark protocol (SPEC section 8) on the shared prompt sets.

For every sample and turn (batch 1), the autoregressive baseline and DFlash run through the same engine;
the report gives tau, the decode speedup (mean baseline / mean DFlash time per output token, prefill and
compilation excluded), both TPOTs, the acceptance-length histogram and, when greedy, whether DFlash
reproduced the baseline token for token. Writes results.json, results.md and acceptance.png to --out.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from dflash_jax.checkpoints.hub import resolve_checkpoint
from dflash_jax.evaluation.bench import BENCH_BUCKETS, Journal, check_replay, markdown_table, run_bench, write_report
from dflash_jax.evaluation.thinking import warn_thinking_mismatch
from dflash_jax.fileio import ensure_writable_dir
from dflash_jax.evaluation.prompts import DATASETS, load_datasets, read_prompt_file
from dflash_jax.errors import UserError
from infer.cli import Parser, UsageError, run_cli
from infer.run import add_model_args, add_sampling_args, load_decoder, sampling_of

PROG = "python -m infer bench"
DEFAULT_PROMPTS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "prompts"
PAPER_MAX_NEW_TOKENS = 2048


def _set_help(parser: argparse.ArgumentParser, flag: str, text: str) -> None:
    for action in parser._actions:
        if flag in action.option_strings:
            action.help = text


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog=PROG,
        description=__doc__ + textwrap.dedent(f"""
            Datasets (files in --prompts-dir): {', '.join(DATASETS)}. Math prompts get the paper's
            "Please reason step by step, ..." suffix; MT-Bench's second turn follows the model's own first
            answer (DFlash's output). Samples are the first N of each file, in file order."""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit codes: 0 success, 2 bad arguments, files or prompts (one 'error: ...' line on stderr).",
    )
    add_model_args(parser, need_draft=True)
    parser.add_argument("--prompts-dir", default=str(DEFAULT_PROMPTS), metavar="DIR",
                        help="folder holding the prompt files (default: ../shared/data/prompts next to the repo)")
    parser.add_argument("--datasets", default=None, metavar="LIST",
                        help=f"comma-separated datasets to run (default: all of {','.join(DATASETS)}, or none when "
                             "--prompt-file is given)")
    parser.add_argument("--prompt-file", action="append", default=[], metavar="FILE",
                        help="also run your own prompts (repeatable): .txt (one per line), .json (a list) or .jsonl "
                             "(objects with 'prompt', 'question', ...); each file is a dataset named after it")
    parser.add_argument("--max-samples", type=int, default=10, metavar="N",
                        help="samples per dataset, the first N in file order (default 10; 0 = the whole set)")
    add_sampling_args(parser)
    parser.set_defaults(max_new_tokens=PAPER_MAX_NEW_TOKENS)
    _set_help(parser, "--max-new-tokens",
              f"stop each turn after N generated tokens (default {PAPER_MAX_NEW_TOKENS}, as the paper)")
    _set_help(parser, "--seed", "random seed of the sampler, the same for every turn (default 0); it only "
                                "matters with --temperature > 0, since samples are taken in file order")
    parser.add_argument("--out", default="runs/bench", metavar="DIR",
                        help="where results.json, results.md and acceptance.png are written (default runs/bench)")
    parser.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                        help="feed the raw conversation text (turns joined by blank lines) instead of the "
                             "tokenizer's chat template (the paper uses the template, thinking off)")
    parser.add_argument("--thinking", action="store_true",
                        help="render the chat template with enable_thinking=True (Qwen3 thinking on; default off, "
                             "as the paper); a draft whose metadata says it was trained in the other mode gets a "
                             "warning")
    parser.add_argument("--replay", action="store_true",
                        help="with --adaptive including 1, greedy: also replay width schedules offline on every "
                             "answer (the draft's teacher-forced acceptance at each position, the measured round "
                             "costs): full block, the adaptive policy, and the best schedule knowing every round's "
                             "acceptance in advance, as speedups over autoregressive rounds (results.md, "
                             "summary.<dataset>.replay in results.json)")
    return parser


def parse_datasets(text: str) -> list[str]:
    names = []
    for name in (n.strip() for n in text.split(",")):
        if name and name not in names:
            names.append(name)
    if not names:
        raise UsageError(f"--datasets is empty; valid names: {', '.join(DATASETS)}")
    unknown = [n for n in names if n not in DATASETS]
    if unknown:
        raise UsageError(f"unknown dataset {', '.join(map(repr, unknown))} in --datasets; "
                         f"valid names: {', '.join(DATASETS)}")
    return names


def bench_main(args: argparse.Namespace) -> int:
    names = [] if args.datasets is None and args.prompt_file else parse_datasets(args.datasets or ",".join(DATASETS))
    if args.max_samples < 0:
        raise UsageError(f"--max-samples must be >= 0, got {args.max_samples}")
    sampling = sampling_of(args)
    if args.replay:  # before any model is loaded
        check_replay(args.adaptive, sampling)
    prompts_dir = Path(args.prompts_dir)
    # Read every prompt file before loading any model, so a bad file fails fast.
    datasets = {}
    if names:
        if not prompts_dir.is_dir():
            raise UserError(f"prompts directory not found: {prompts_dir} (pass --prompts-dir)")
        datasets = load_datasets(prompts_dir, names, args.max_samples or None)
    for f in args.prompt_file:
        name = Path(f).name.split(".")[0]
        if name in datasets:
            raise UsageError(f"--prompt-file {f}: a dataset named {name!r} is already in the run")
        datasets[name] = [[p] for p in read_prompt_file(Path(f))][: args.max_samples or None]
        names.append(name)

    out_dir = ensure_writable_dir(args.out, "--out")  # before any model is loaded
    journal = Journal(out_dir, {
        "target": args.target, "draft": args.ckpt, "tokenizer": args.tokenizer, "dtype": args.dtype,
        "revision": args.revision, "ckpt_revision": args.ckpt_revision,
        "block_size": args.block_size, "max_new_tokens": args.max_new_tokens, "temperature": sampling.temperature,
        "top_k": sampling.top_k, "top_p": sampling.top_p, "seed": args.seed, "chat_template": args.chat_template,
        "adaptive": list(args.adaptive), "mesh": args.mesh, "replay": args.replay, "tree": args.tree,
        **({"tree_budgets": list(args.tree_budgets)} if args.tree == "auto" else {}),
        **({"thinking": True} if args.thinking else {})})  # absent when off: earlier journals still resume
    resumed = sum(journal.finished(k, i, s) is not None for k, v in datasets.items() for i, s in enumerate(v))
    if resumed:
        print(f"bench: resuming, {resumed} finished sample(s) read from {journal.path} (delete it to measure "
              f"them again)", file=sys.stderr)
    decoder, tokenizer, stops = load_decoder(args, need_draft=True)
    warn_thinking_mismatch(resolve_checkpoint(args.ckpt, args.ckpt_revision, "--ckpt"), tokenizer, args.chat_template,
                           args.thinking)
    n = sum(len(s) for s in datasets.values())
    print(f"bench: {', '.join(f'{k} ({len(v)})' for k, v in datasets.items())}: {n} samples, block "
          f"{decoder.block_size}" + (", tree auto over budgets " + ",".join(map(str, args.tree_budgets))
                                     if args.tree == "auto" else f", tree of {args.tree} nodes" if args.tree else "") +
          f", max_new_tokens {args.max_new_tokens}, temperature {sampling.temperature}",
          file=sys.stderr)
    results = run_bench(decoder, tokenizer, stops, datasets, args.max_new_tokens, sampling, args.seed,
                        use_chat_template=args.chat_template, progress=True, journal=journal, replay=args.replay,
                        enable_thinking=args.thinking)
    journal.close()
    meta = {"target": str(args.target), "draft": str(args.ckpt), "tokenizer": args.tokenizer,
            "revision": args.revision, "ckpt_revision": args.ckpt_revision,
            "dtype": args.dtype, "prompts_dir": str(prompts_dir), "datasets": names,
            "max_samples": args.max_samples, "block_size": decoder.block_size,
            "max_new_tokens": args.max_new_tokens, "temperature": sampling.temperature,
            "adaptive_widths": list(args.adaptive), "mesh": args.mesh,
            "tree_budget": 0 if args.tree == "auto" else args.tree,
            "tree_auto": list(args.tree_budgets) if args.tree == "auto" else []}
    paths = write_report(results, out_dir, meta)
    print(markdown_table(results))
    print()
    print(f"programs compiled: {results['programs_compiled']} (4 per prompt width at most; widths "
          f"{BENCH_BUCKETS[0]} x {BENCH_BUCKETS[1]}^i tokens)")
    for kind, path in paths.items():
        print(f"{kind:8s} {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), bench_main, argv)
