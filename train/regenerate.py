"""``python -m train regenerate``: the target answers every prompt of a JSONL file (SPEC section 6: the draft
learns the target's own outputs), written as resumable JSONL shards that ``python -m train fit`` reads."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path

from dflash_jax.data.formats import read_examples
from dflash_jax.data.regenerate import regenerate
from dflash_jax.data.server_regenerate import UNANSWERED_FILE, ServerOptions, regenerate_via_server
from infer.cli import Parser, UsageError, run_cli
from infer.run import add_model_args, add_sampling_args, load_decoder, sampling_of

PROG = "python -m train regenerate"
MAX_WARNINGS_SHOWN = 20


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog=PROG,
        description=textwrap.dedent("""\
            Answer every prompt of a data source with the target (its own outputs are what the draft learns).
            Sources: JSONL, JSON-array, Parquet or Arrow files, directories, globs, hf:ORG/NAME[:CONFIG[:SPLIT]].
            Input rows: {"messages": [...]}, ShareGPT {"conversations": [...]}, {"prompt"/"instruction"/
            "question": ..., optional "response"/"output"/...}, or {"text": ..., optional "prompt": ...}.
            Each user turn is answered in order (a later turn follows the target's own earlier answer); answers
            in the input are replaced. Output: OUT/shard-NNNNN.jsonl ({"messages": ...} or {"prompt", "text"}
            rows) and OUT/regenerate.json. Rerunning the same command resumes: complete shards are kept."""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit codes: 0 success, 1 some rows got no answer from --server (rerun to finish), 2 bad "
               "arguments, files, settings or a request the server refused (one 'error: ...' line on stderr).",
    )
    add_model_args(parser)
    for action in parser._actions:  # the shared help mentions --baseline, which this command does not have
        if "--target" in action.option_strings:  # --server answers without a local target
            action.required = False
            action.help += "; required unless --server"
        if {"--coordinator", "--distributed"} & set(action.option_strings):
            action.help += ("; regenerate: every process runs the same command into the same --out (a shared "
                            "file system) and answers its own shards (shard k on process k mod N)")
        if "--mesh" in action.option_strings:
            action.help += "; with several processes, each one's mesh is over its own devices (e.g. data=8 per host)"
        if "--ckpt" in action.option_strings:
            action.help = ("optional DFlash draft (official directory, Orbax or Hub id): generates faster; the "
                           "answers have the target's distribution either way")
    parser.add_argument("--data", required=True, metavar="SOURCE",
                        help="the prompts: a .jsonl/.jsonl.gz, .json (one array), .parquet or .arrow file, a "
                             "directory or glob of them, or a Hugging Face Hub dataset hf:ORG/NAME[:CONFIG[:SPLIT]] "
                             "(its Parquet files through the Hugging Face cache; HF_HUB_OFFLINE=1 reads the cache "
                             "alone); malformed rows are skipped with a 'file:row: reason' warning")
    parser.add_argument("--columns", metavar="FIELD=COLUMN,...",
                        help="read these columns as the layout's fields, e.g. prompt=instruction,response=output "
                             "(fields: messages, conversations, prompt, response, system, input, text; default: "
                             "columns are recognised by name)")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="output directory (created); rerun into the same directory to resume")
    parser.add_argument("--batch-size", type=int, metavar="N",
                        help="prompts generated together on the device (default 8; not with --server)")
    add_sampling_args(parser)
    parser.add_argument("--stop-token", type=int, action="append", metavar="ID",
                        help="stop an answer at this token id (repeatable; default: the model's EOS ids; with "
                             "--server the server's own stop tokens apply)")
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
    server = parser.add_argument_group(
        "through a server", "answer through an OpenAI-compatible server that already holds the target (vLLM, "
        "SGLang, tpu-inference, transformers serve) instead of this project's engine; same output and resumption")
    server.add_argument("--server", metavar="URL",
                        help="the server's API base, e.g. http://localhost:8000/v1 (a bare host:port gets /v1): "
                             "conversations go to /chat/completions (the server applies the chat template), plain "
                             "text to /completions; --target, --ckpt, --batch-size and --stop-token are not used")
    server.add_argument("--model", metavar="NAME",
                        help="with --server: the model name the requests carry (default: the server's only model "
                             "listed by GET /models)")
    server.add_argument("--concurrency", type=int, default=32, metavar="N",
                        help="with --server: requests in flight at once (default 32; the server batches them)")
    server.add_argument("--chat-template-kwargs", metavar="JSON",
                        help="with --server: a JSON object passed to the server's chat template with every chat "
                             "request, e.g. '{\"enable_thinking\": false}'; enable_thinking is always sent "
                             "(false unless --thinking or this object sets it) and recorded with the rest in "
                             "OUT/regenerate.json")
    server.add_argument("--extra-body", metavar="JSON",
                        help="with --server: a JSON object merged into every request (server extensions, e.g. "
                             "'{\"skip_special_tokens\": false}' for vLLM/SGLang to keep special tokens in the "
                             "answers, as the engine's path does); recorded in OUT/regenerate.json")
    server.add_argument("--api-key-env", metavar="NAME",
                        help="with --server: the environment variable holding the API key, sent as a bearer "
                             "token and never written to any file (default OPENAI_API_KEY, used when set)")
    server.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="with --server: seconds one request may take before it is retried (default 600)")
    server.add_argument("--max-retries", type=int, default=8, metavar="N",
                        help="with --server: retries of a request after a connection error, a timeout, HTTP 429 or "
                             "5xx, waiting --retry-wait seconds and doubling (at most 60) between them; a row still "
                             "unanswered is listed in OUT/unanswered.json and its shard left for a rerun "
                             "(default 8)")
    server.add_argument("--retry-wait", type=float, default=1.0, metavar="SECONDS",
                        help="with --server: the wait before the first retry (default 1)")
    return parser


def json_object_arg(flag: str, text: str | None) -> dict:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{flag}: not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise UsageError(f"{flag}: expected a JSON object, got {text!r}")
    return value


def server_options(args: argparse.Namespace) -> tuple[ServerOptions, dict]:
    """The server client's options and the chat template kwargs, from the flags."""
    given = [flag for flag, value in (("--target", args.target), ("--ckpt", args.ckpt),
                                      ("--batch-size", args.batch_size), ("--stop-token", args.stop_token),
                                      ("--mesh", args.mesh), ("--coordinator", args.coordinator),
                                      ("--num-processes", args.num_processes), ("--process-id", args.process_id),
                                      ("--distributed", args.distributed or None))
             if value is not None]
    if given:
        raise UsageError(f"{', '.join(given)} cannot be used with --server (the server holds the model and "
                         "batches the requests: one client with a higher --concurrency keeps it busy)")
    if args.concurrency < 1:
        raise UsageError(f"--concurrency must be at least 1, got {args.concurrency}")
    kwargs = json_object_arg("--chat-template-kwargs", args.chat_template_kwargs)
    if args.thinking:
        if kwargs.get("enable_thinking", True) is not True:
            raise UsageError("--thinking contradicts --chat-template-kwargs' \"enable_thinking\": "
                             f"{json.dumps(kwargs['enable_thinking'])}")
        kwargs["enable_thinking"] = True
    key_env = args.api_key_env or "OPENAI_API_KEY"
    api_key = os.environ.get(key_env) or None
    if args.api_key_env and api_key is None:
        raise UsageError(f"--api-key-env {args.api_key_env}: that environment variable is not set")
    options = ServerOptions(url=args.server, model=args.model, api_key=api_key, concurrency=args.concurrency,
                            timeout=args.request_timeout, max_retries=args.max_retries, retry_wait=args.retry_wait,
                            extra_body=json_object_arg("--extra-body", args.extra_body))
    return options, kwargs


def jax_process() -> tuple[int, int]:
    import jax

    return jax.process_index(), jax.process_count()


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
    options = kwargs = None
    if args.server is not None:
        options, kwargs = server_options(args)  # before reading the data: a bad flag fails fast
    elif args.target is None:
        raise UsageError("the following arguments are required: --target (or --server)")
    elif args.chat_template_kwargs is not None or args.extra_body is not None:
        raise UsageError("--chat-template-kwargs and --extra-body go with --server (without it, --thinking sets "
                         "the template's enable_thinking)")
    examples, read_stats = read_examples(args.data, limit=args.limit, columns=args.columns)
    examples = examples * args.repeat  # the whole file N times, so shards stay contiguous ranges of it
    print_warnings(read_stats.warnings)
    unanswered = []
    if options is not None:
        stats, unanswered = regenerate_via_server(
            examples, Path(args.out), options, max_new_tokens=args.max_new_tokens, sampling=sampling,
            seed=args.seed, shard_size=args.shard_size, use_chat_template=args.chat_template,
            chat_template_kwargs=kwargs, progress=args.progress)
    else:
        args.local_mesh = True  # several processes: each answers its own shards on its own devices
        decoder, tokenizer, eos = load_decoder(args, need_draft=False)  # starts jax.distributed if asked
        stops = args.stop_token if args.stop_token else eos
        import jax

        stats = regenerate(decoder, tokenizer, examples, Path(args.out), batch_size=args.batch_size or 8,
                           max_new_tokens=args.max_new_tokens, sampling=sampling, stop_tokens=stops,
                           seed=args.seed, shard_size=args.shard_size, use_chat_template=args.chat_template,
                           enable_thinking=args.thinking, progress=args.progress,
                           processes=(jax.process_index(), jax.process_count()))
    print_warnings(stats.warnings)
    rate = stats.generated_tokens / stats.seconds if stats.seconds > 0 else 0.0
    print(f"{args.out}: {stats.shards} shards for {stats.examples} examples ({read_stats.skipped} malformed rows "
          f"skipped); this run wrote {stats.shards_written} shards ({stats.shards_done_before} were already complete), "
          f"{stats.rows_written} rows, {stats.answers} answers, {stats.generated_tokens} tokens in "
          f"{stats.seconds:.1f} s ({rate:.0f} tok/s)" + (f"; process {jax_process()[0]} of {jax_process()[1]}"
                                                          if options is None and jax_process()[1] > 1 else ""))
    if stats.skipped:
        print(f"{stats.skipped} examples left out (no turn could be answered)")
    if stats.unfinished:
        print(f"{stats.unfinished} answers reached --max-new-tokens {args.max_new_tokens} before a stop token "
              "(raise it to keep whole answers; their rows have \"finished\": false, which fit's "
              "data.drop_unfinished leaves out)")
    if unanswered:
        shards = sorted({r["shard"] for r in unanswered})
        print(f"{len(unanswered)} examples got no answer from the server after --max-retries {args.max_retries} "
              f"(first: example {unanswered[0]['example']}: {unanswered[0]['error']}); listed in "
              f"{Path(args.out) / UNANSWERED_FILE}. Their {len(shards)} shards were not written: rerun the same "
              "command to answer exactly those", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), regenerate_main, argv)


if __name__ == "__main__":
    sys.exit(main())
