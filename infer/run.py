"""``python -m infer --target DIR --ckpt DIR --prompt TEXT``: generate with DFlash (and optionally the
autoregressive baseline on the same engine) and report tau, tokens/s and speedup."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path

import jax

from dflash_jax.checkpoints.hub import resolve_checkpoint
from dflash_jax.checkpoints.loading import load_draft_any, load_target_any, load_tokenizer, tokenizer_dir
from dflash_jax.engine.decoder import Decoder, decode_continuation, encode_conversation, stop_tokens_of
from dflash_jax.engine.adaptive import tree_budget_summary
from dflash_jax.engine.generate import GenerationResult
from dflash_jax.engine.sampling import SamplingConfig
from dflash_jax.evaluation.prompts import read_prompt_file
from dflash_jax.evaluation.thinking import warn_thinking_mismatch
from dflash_jax.models.attention_kernels import check_attention_kernel
from infer.cli import (
    Parser, UsageError, add_attention_arg, add_device_args, add_tree_args, run_cli, seed_arg, setup_devices, text_arg,
    tree_settings, widths_arg,
)

PROG = "python -m infer"


def add_model_args(parser: argparse.ArgumentParser, need_draft: bool = False, demo_default: bool = False) -> None:
    parser.add_argument("--target", required=not demo_default, metavar="DIR",
                        help="the target model: a Hugging Face directory (config.json + safetensors + tokenizer), "
                             "an Orbax checkpoint written by 'python -m infer convert', or a Hugging Face Hub id "
                             "such as Qwen/Qwen3-8B (fetched into the Hugging Face cache: configs, tokenizer and "
                             "safetensors only; HF_HUB_OFFLINE=1 reads the cache alone; a local path of the same "
                             "name wins)"
                             + ("; without --target and --ckpt: the shipped demo pair (stories260K and its "
                                "trained draft)" if demo_default else ""))
    parser.add_argument("--ckpt", required=need_draft, metavar="DIR",
                        help="the DFlash draft: an official draft directory (config.json + model.safetensors), "
                             "an Orbax checkpoint or a Hub id such as z-lab/Qwen3-8B-DFlash-b16"
                             + ("" if need_draft else "; may be left out together with --baseline (baseline only)"))
    parser.add_argument("--revision", metavar="REV",
                        help="with a Hub id as --target: its branch, tag or commit (default: main)")
    parser.add_argument("--ckpt-revision", metavar="REV",
                        help="with a Hub id as --ckpt: its branch, tag or commit (default: main)")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="tokenizer directory or Hub id (default: the target's own tokenizer files)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="compute and parameter dtype (default float32; use bfloat16 on GPU/TPU)")
    parser.add_argument("--experts", "--mxfp4", dest="experts", choices=("dequantize", "packed"),
                        default="dequantize",
                        help="a target's quantised expert weights (released checkpoints: gpt-oss's MXFP4, "
                             "DeepSeek-V3 / GLM-5.1-FP8 / MiniMax-M2's block FP8, Kimi K2.5-K2.7's INT4): "
                             "dequantize (default) decodes them to --dtype at load, 16 bits per expert weight in "
                             "bfloat16 (gpt-oss-120b: ~230 GB); packed keeps them as stored on the device "
                             "(MXFP4 4.25, FP8 8, INT4 4.5 bits per weight) and decodes only the routed experts "
                             "inside each layer. --mxfp4 is the same flag's older name")
    parser.add_argument("--block-size", type=int, metavar="B",
                        help="tokens per round (anchor + B-1 drafts), at most the draft's block_size (default)")
    parser.add_argument("--adaptive", type=widths_arg, default=(), metavar="W1,W2,...",
                        help="adaptive block size (beyond the paper; off by default): every few rounds verify one "
                             "of these widths or the full block, whichever gives the most tokens per unit of time "
                             "from the batch's recent acceptance and each width's round time (measured on this "
                             "device when the program compiles), e.g. 1,2,4 with a block-8 draft (1: plain "
                             "autoregressive rounds, no draft forward, with occasional probes); the output is "
                             "unchanged")
    add_tree_args(parser)
    parser.add_argument("--block-verify", action="store_true",
                        help="with --temperature > 0: verify each sampled draft block as a whole (Sun et al.'s "
                             "block verification) instead of token by token; the same target distribution, never "
                             "fewer accepted drafts in expectation; pays where the drafts are sampled (a DFlash2 "
                             "selector's walk, a DFlash draft's marginals), not for trees")
    parser.add_argument("--confidence-threshold", type=float, default=0.0, metavar="P",
                        help="DSpark drafts with a confidence head: verify each row only up to the first drafted "
                             "position whose predicted acceptance is below P (DeepSpec's evaluator's rule; 0, the "
                             "default, verifies the whole block). The output is unchanged; the rounds are cheaper "
                             "where the target's verify cost grows with its width")
    parser.add_argument("--draft-window", type=int, metavar="N",
                        help="bound every draft layer's context to the last N positions before each query (beyond "
                             "the official code; default: the draft's own layers, sliding ones keep their window): "
                             "at long prompts the draft's attention and cache stop growing with the prompt. Only "
                             "the proposals change, never the output")
    parser.add_argument("--mesh", metavar="SPEC",
                        help="shard the models over devices, e.g. tensor=8 or data=2,tensor=4 (axes data, fsdp, "
                             "tensor, expert; the training's rules table: attention heads and MLP over tensor, "
                             "a mixture-of-experts target's experts over expert, KV caches over KV heads, prompts "
                             "over data); default: one device")
    add_attention_arg(parser)
    add_device_args(parser)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=256, metavar="N",
                        help="stop after N generated tokens (default 256)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default) is greedy; > 0 samples with lossless rejection sampling")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    parser.add_argument("--seed", type=seed_arg, default=0, help="random seed for sampling (default 0)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog=PROG,
        description=textwrap.dedent("""\
            Generate with a DFlash draft and its target. Subcommands:
              python -m infer bench ...    the paper's benchmark protocol on the prompt sets
              python -m infer speed ...    per-round timings and the speedup bound on this machine
              python -m infer convert ...  official/Hugging Face directories <-> Orbax
              python -m infer demo         the shipped stories260K pair: DFlash vs baseline, offline
            Without a subcommand: generate for --prompt / --prompt-file."""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit codes: 0 success, 2 bad arguments, files or prompts (one 'error: ...' line on stderr).",
    )
    add_model_args(parser, demo_default=True)
    parser.add_argument("--prompt", action="append", default=[], metavar="TEXT", type=text_arg,
                        help="a prompt (repeat for a batch)")
    parser.add_argument("--prompt-ids", action="append", default=[], metavar="IDS",
                        help="a prompt as comma-separated token ids, fed as is (no BOS or template added; repeat "
                             "for a batch): for harnesses and parity checks")
    parser.add_argument("--prompt-file", metavar="FILE",
                        help="prompts from a file: .txt (one per line), .json (a list of strings) or .jsonl "
                             "(objects with 'prompt', 'question', 'problem', 'instruction' or 'turns'); .gz ok")
    add_sampling_args(parser)
    parser.add_argument("--baseline", action="store_true",
                        help="also run plain autoregressive decoding on the same engine and report the speedup")
    parser.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                        help="feed the raw prompt text instead of the tokenizer's chat template")
    parser.add_argument("--thinking", action="store_true",
                        help="render the chat template with enable_thinking=True (Qwen3 thinking on; default off); "
                             "a draft whose metadata says it was trained in the other mode gets a warning")
    parser.add_argument("--stream", action="store_true", help="print tokens as they are committed (batch of 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON document with all results instead of text")
    return parser


def load_decoder(args: argparse.Namespace, need_draft: bool = True):
    """Target, draft and tokenizer from the common flags; returns (decoder, tokenizer, stop_tokens). No
    --target at all means the shipped demo pair."""
    if args.target is None:
        if args.ckpt:
            raise UsageError("--ckpt needs its --target")
        from dflash_jax.assets import DEMO_DRAFT, DEMO_TARGET

        args.target, args.ckpt = str(DEMO_TARGET), str(DEMO_DRAFT)
    setup_devices(args)
    check_attention_kernel(getattr(args, "attention", "auto"))  # before loading anything
    mesh = None
    if getattr(args, "mesh", None):
        from dflash_jax.sharding import make_mesh

        # Regeneration splits the work by process, each on a mesh of its own devices (local_mesh).
        mesh = make_mesh(args.mesh, jax.local_devices() if getattr(args, "local_mesh", False) else None)
    ckpt_revision = getattr(args, "ckpt_revision", None)  # namespaces built by hand (the demo) lack the flags
    if ckpt_revision is not None and not args.ckpt:
        raise UsageError("--ckpt-revision needs a --ckpt")
    # Hub ids become their cached snapshot directories once, here; the draft first, so that a mistyped draft id
    # fails before the target's download.
    ckpt = resolve_checkpoint(args.ckpt, ckpt_revision, "--ckpt") if args.ckpt else None
    target_path = resolve_checkpoint(args.target, getattr(args, "revision", None), "--target")
    experts = getattr(args, "experts", "dequantize")  # namespaces built by hand (the demo) lack the flag
    target_config, target_params = load_target_any(target_path, dtype=args.dtype, progress=True, mesh=mesh,
                                                   experts=experts)
    tokenizer = load_tokenizer(args.tokenizer or tokenizer_dir(target_path))
    draft_config = draft_params = None
    if ckpt:
        draft_config, draft_params = load_draft_any(ckpt, dtype=args.dtype, progress=True)
        draft_config.validate_against(target_config, source=str(args.ckpt))
    elif need_draft:
        raise UsageError("--ckpt (the draft) is required")
    if args.block_size is not None and draft_config is None:
        raise UsageError("--block-size needs a draft (--ckpt)")
    adaptive = getattr(args, "adaptive", ())
    if adaptive and draft_config is None:
        raise UsageError("--adaptive needs a draft (--ckpt)")
    draft_window = getattr(args, "draft_window", None)
    if draft_window is not None and draft_config is None:
        raise UsageError("--draft-window needs a draft (--ckpt)")
    tree = tree_settings(args, draft_config is not None, adaptive)
    threshold = getattr(args, "confidence_threshold", 0.0)
    if threshold and draft_config is None:
        raise UsageError("--confidence-threshold needs a DSpark draft (--ckpt)")
    if threshold and not 0.0 <= threshold <= 1.0:
        raise UsageError(f"--confidence-threshold must lie in [0, 1], got {threshold}")
    decoder = Decoder(target_config, target_params, draft_config, draft_params, args.block_size, args.dtype, mesh,
                      adaptive, attention=getattr(args, "attention", "auto"), draft_window=draft_window,
                      **tree, block_verify=getattr(args, "block_verify", False), confidence_threshold=threshold)
    if decoder.head_source == "shared":
        print("DSpark draft: its embedding and head copies equal the target's (one copy kept)", file=sys.stderr)
    elif decoder.head_source == "own":
        print("DSpark draft: its embedding and head copies differ from the target's: drafting with its own",
              file=sys.stderr)
    # EOS ids come from the target's own generation config, whichever tokenizer directory is used.
    return decoder, tokenizer, stop_tokens_of(target_config, tokenizer, tokenizer_dir(target_path))


def sampling_of(args: argparse.Namespace) -> SamplingConfig:
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    return SamplingConfig(args.temperature, args.top_k, args.top_p)


def tokens_per_second(result: GenerationResult) -> float:
    # The first token comes from the prefill; decode throughput counts the rest.
    decoded = result.num_tokens - len(result.tokens)
    return decoded / result.decode_s if result.decode_s > 0 else float("nan")


def summarize(dflash: GenerationResult | None, baseline: GenerationResult | None) -> dict:
    out: dict = {}
    for name, r in (("dflash", dflash), ("baseline", baseline)):
        if r is not None:
            out[name] = {"tokens": r.num_tokens, "prefill_s": r.prefill_s, "decode_s": r.decode_s,
                         "compile_s": r.compile_s, "tokens_per_s": tokens_per_second(r), "tau": r.tau}
    if dflash is not None and baseline is not None:
        ours, theirs = out["dflash"]["tokens_per_s"], out["baseline"]["tokens_per_s"]
        # None when nothing was decoded after the prefill token (max_new_tokens 1, or EOS first).
        out["speedup"] = ours / theirs if ours > 0 and theirs > 0 else None
    return out


class TextStream:
    """Prints row 0's text as chunks of tokens arrive. A multi-byte character split across chunks decodes to
    U+FFFD until its last byte arrives: hold back until then, and only ever print what extends the text
    already shown."""

    def __init__(self, tokenizer, prompt_ids: list[int], out=None):
        self.tokenizer, self.prompt_ids, self.out, self.shown = tokenizer, prompt_ids, out, ""

    def __call__(self, rows: list[list[int]]) -> None:
        text = decode_continuation(self.tokenizer, self.prompt_ids, rows[0])
        if text.endswith("\ufffd") or not text.startswith(self.shown):
            return
        print(text[len(self.shown):], end="", file=self.out or sys.stdout, flush=True)
        self.shown = text


def generate_main(args: argparse.Namespace) -> int:
    prompts = list(args.prompt)
    if args.prompt_file:
        prompts += read_prompt_file(Path(args.prompt_file))
    id_prompts = [parse_prompt_ids(text) for text in args.prompt_ids]
    if not prompts and not id_prompts:
        raise UsageError("give at least one --prompt, --prompt-ids or a --prompt-file")
    if args.stream and len(prompts) != 1:
        raise UsageError("--stream needs exactly one prompt")
    sampling = sampling_of(args)
    decoder, tokenizer, stops = load_decoder(args, need_draft=not args.baseline)
    if prompts and args.ckpt:
        warn_thinking_mismatch(resolve_checkpoint(args.ckpt, args.ckpt_revision, "--ckpt"), tokenizer,
                               args.chat_template, args.thinking)
    ids = [encode_conversation(tokenizer, [{"role": "user", "content": p}], args.chat_template, args.thinking)
           for p in prompts]
    ids += id_prompts
    prompts += [f"ids:{','.join(map(str, p))}" for p in id_prompts]

    # Several processes (--coordinator ...) all run the same program, reading results through collectives,
    # so every process streams the same way; only process 0 prints.
    primary = jax.process_index() == 0
    sink = None if primary else open(os.devnull, "w")
    on_tokens = TextStream(tokenizer, ids[0], out=sink) if args.stream and not args.json else None
    dflash = None
    if decoder.has_draft:
        dflash = decoder.generate(ids, args.max_new_tokens, sampling, stops, seed=args.seed, on_tokens=on_tokens)
        if on_tokens:
            print()
    baseline = None
    if args.baseline or not decoder.has_draft:
        baseline = decoder.generate(ids, args.max_new_tokens, sampling, stops, baseline=True, seed=args.seed,
                                    on_tokens=None if dflash else on_tokens)
    if not primary:
        return 0
    main_result = dflash or baseline
    summary = summarize(dflash, baseline)
    if dflash is not None and decoder.tree_auto:
        summary["dflash"]["tree_auto"] = dict(tree_budget_summary(dflash.widths), chain_program=dflash.tree_auto_chain)
    rows = []
    for i, p in enumerate(prompts):
        row = {"prompt": p, "text": decode_continuation(tokenizer, ids[i], main_result.tokens[i]),
               "tokens": main_result.tokens[i]}
        if dflash is not None:
            row["accept_lengths"] = dflash.accept_lengths[i]
        if dflash is not None and baseline is not None:
            row["matches_baseline"] = dflash.tokens[i] == baseline.tokens[i]
        rows.append(row)
    if args.json:
        print(json.dumps(no_nan({"results": rows, "summary": summary}), indent=2))
        return 0
    if not args.stream:
        for row in rows:
            print(f"### {row['prompt']}\n{row['text']}\n")
    print(format_summary(summary), file=sys.stderr if args.stream else sys.stdout)
    return 0


def parse_prompt_ids(text: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]``; range checks against the vocabulary happen in the engine."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"--prompt-ids {text!r}: expected comma-separated integers like 1,415,2293") from None
    if any(i < 0 for i in ids):
        raise UsageError(f"--prompt-ids {text!r}: token ids cannot be negative")
    return ids


def no_nan(value):
    """JSON has no NaN (e.g. tau when no round ran): write null instead."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [no_nan(v) for v in value]
    return value


def format_summary(summary: dict) -> str:
    lines = []
    for name in ("dflash", "baseline"):
        if name in summary:
            s = summary[name]
            tau = f", tau {s['tau']:.2f}" if name == "dflash" else ""
            lines.append(f"{name:8s}: {s['tokens']} tokens, {s['tokens_per_s']:.1f} tok/s decode "
                         f"({s['decode_s']:.3f} s), prefill {s['prefill_s']:.3f} s{tau}")
            if "tree_auto" in s:
                t = s["tree_auto"]
                lines.append(f"tree    : auto, mean budget {t['mean_budget']:.1f} nodes per round, the chain in "
                             f"{100 * t['chain_share']:.0f}% of rounds (rounds per budget, 0 = chain: "
                             f"{t['rounds_per_budget']})")
                if t["chain_program"]:
                    lines.append("          (calibration on these prompts: no tree budget committed more per unit of "
                                 "time than the chain, so the chain's own program decoded)")
    if summary.get("speedup") is not None:
        lines.append(f"speedup : {summary['speedup']:.2f}x (decode tokens/s, DFlash vs baseline, same engine)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), generate_main, argv)
