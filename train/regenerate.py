"""``python -m train regenerate``: the target answers every prompt of a JSONL file (SPEC section 6: the draft
learns the target's own outputs), written as resumable JSONL shards that ``python -m train fit`` reads."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from dflash_jax.data.formats import read_examples
from dflash_jax.data.regenerate import regenerate
from infer.cli import Parser, UsageError, run_cli
from infer.run import add_model_args, add_sampling_args, load_decoder, sampling_of

PROG = "python -m train regenerate"
MAX_WARNINGS_SHOWN = 20


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog=PROG,
        description=textwrap.dedent("""\
            Answer every prompt of a JSONL file with the target (its own outputs are what the draft learns).
            Input rows: {"messages": [...]}, ShareGPT {"conversations": [...]}, {"prompt"/"instruction"/
            "question": ..., optional "response"/"output"/...}, or {"text": ..., optional "prompt": ...}.
            Each user turn is answered in order (a later turn follows the target's own earlier answer); answers
            in the input are replaced. Output: OUT/shard-NNNNN.jsonl ({"messages": ...} or {"prompt", "text"}
            rows) and OUT/regenerate.json. Rerunning the same command resumes: complete shards are kept."""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit codes: 0 success, 2 bad arguments, files or settings (one 'error: ...' line on stderr).",
    )
    add_model_args(parser)
    for action in parser._actions:  # the shared help mentions --baseline, which this command does not have
        if "--ckpt" in action.option_strings:
            action.help = ("optional DFlash draft (official directory, Orbax or Hub id): generates faster; the "
                           "answers have the target's distribution either way")
    parser.add_argument("--data", required=True, metavar="FILE",
                        help="the prompts: a JSONL file (.gz ok); malformed rows are skipped with a warning")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="output directory (created); rerun into the same directory to resume")
    parser.add_argument("--batch-size", type=int, default=8, metavar="N",
                        help="prompts generated together on the device (default 8)")
    add_sampling_args(parser)
    parser.add_argument("--stop-token", type=int, action="append", metavar="ID",
                        help="stop an answer at this token id (repeatable; default: the model's EOS ids)")
    parser.add_argument("--shard-size", type=int, default=256, metavar="N",
                        help="input examples per output shard, the unit of resumption (default 256)")
    parser.add_argument("--thinking", action="store_true",
                        help="render the chat template with enable_thinking=True (Qwen3 thinking on; default off, "
                             "as in the released drafts' recipe)")
    parser.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                        help="feed the raw prompt text (with BOS) instead of the tokenizer's chat template")
    parser.add_argument("--limit", type=int, metavar="N", help="regenerate only the first N usable examples")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="answer every example N times (with --temperature > 0 each copy gets its own sample: "
                             "many varied answers from a few prompts; default 1)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return parser


def print_warnings(warnings: list[str]) -> None:
    for line in warnings[:MAX_WARNINGS_SHOWN]:
        print(f"warning: {line}", file=sys.stderr)
    if len(warnings) > MAX_WARNINGS_SHOWN:
        print(f"warning: ... and {len(warnings) - MAX_WARNINGS_SHOWN} more", file=sys.stderr)


def regenerate_main(args: argparse.Namespace) -> int:
    for flag, value in (("--batch-size", args.batch_size), ("--shard-size", args.shard_size),
                        ("--limit", args.limit), ("--repeat", args.repeat)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    if args.seed < 0:
        raise UsageError(f"--seed must be non-negative, got {args.seed}")
    sampling = sampling_of(args)
    examples, read_stats = read_examples(Path(args.data), limit=args.limit)
    examples = examples * args.repeat  # the whole file N times, so shards stay contiguous ranges of it
    print_warnings(read_stats.warnings)
    decoder, tokenizer, eos = load_decoder(args, need_draft=False)
    stops = args.stop_token if args.stop_token else eos
    stats = regenerate(decoder, tokenizer, examples, Path(args.out), batch_size=args.batch_size,
                       max_new_tokens=args.max_new_tokens, sampling=sampling, stop_tokens=stops, seed=args.seed,
                       shard_size=args.shard_size, use_chat_template=args.chat_template,
                       enable_thinking=args.thinking, progress=args.progress)
    print_warnings(stats.warnings)
    rate = stats.generated_tokens / stats.seconds if stats.seconds > 0 else 0.0
    print(f"{args.out}: {stats.shards} shards for {stats.examples} examples ({read_stats.skipped} malformed rows "
          f"skipped); this run wrote {stats.shards_written} shards ({stats.shards_done_before} were already complete), "
          f"{stats.rows_written} rows, {stats.answers} answers, {stats.generated_tokens} tokens in "
          f"{stats.seconds:.1f} s ({rate:.0f} tok/s)")
    if stats.skipped:
        print(f"{stats.skipped} examples left out (no turn could be answered)")
    if stats.unfinished:
        print(f"{stats.unfinished} answers reached --max-new-tokens {args.max_new_tokens} before a stop token "
              "(raise it to keep whole answers; their rows have \"finished\": false, which fit's "
              "data.drop_unfinished leaves out)")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), regenerate_main, argv)


if __name__ == "__main__":
    sys.exit(main())
