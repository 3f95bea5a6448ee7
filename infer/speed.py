"""``python -m infer speed``: where DFlash's time goes on THIS machine, and how close the speedup comes to its
bound.

In one run, with jitted functions (compiled first; median of --repeats timed runs):

  1. t(AR step)  the target on 1 token with a cache holding --context tokens;
  2. t(verify)   the target on a block of --block-size tokens, with the draft's feature layers;
  3. t(draft)    one draft forward (block B; the last round's context features written in the same forward);
  4. t(round)    a full DFlash round (engine.generate.decode_round, jitted on its own);
  5. end to end, through engine.generate.generate (decode time only, compile excluded): autoregressive
     decoding; DFlash with an ORACLE proposer whose planted errors make every round accept exactly --tau
     tokens (tau-1 drafts + the bonus; no draft cost); DFlash with the real draft. Greedy outputs must equal
     the autoregressive output (checked).

Then it reports the bound tau * t(AR step) / (t(verify) + t(draft)), the oracle's bound without the draft
tau * t(AR step) / t(verify), and each measured speedup against its matching bound.

Models: --preset NAME (random weights from shapes: tiny, small, qwen3-8b, qwen3-4b, and the mixture-of-experts
qwen3-coder-30b-a3b and gpt-oss-20b at their real widths with the target cut to a few layers, --target-layers)
or --target DIR --ckpt DIR (real checkpoints). Prompts are --batch random token sequences of --context tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path

from dflash_jax.models.attention_kernels import check_attention_kernel
from dflash_jax.precision import resolve_dtype
from dflash_jax.fileio import ensure_writable_dir, write_text_atomic
from dflash_jax.evaluation.speed import (
    CUT_PRESETS, PRESETS, SpeedSettings, dense_prefill_chunk, format_report, preset_configs, preset_description,
    preset_models, run_speed,
)
from infer.cli import (
    Parser, UsageError, add_attention_arg, add_device_args, run_cli, seed_arg, setup_devices, widths_arg,
)

PROG = "python -m infer speed"
# --low-memory: XLA:CPU's memory-minimising scheduler instead of the concurrency-optimised one (which starts
# independent work early: large temporaries of several layers at once; docs/benchmarking.md), and no hoisting of loop-invariant work out of while loops (in bfloat16 it hoists the
# float32 conversion of every weight out of the decode loop: a float32 copy of the models next to them).
LOW_MEMORY_XLA_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",
                        "--xla_disable_hlo_passes=while-loop-invariant-code-motion")


def positive(name: str, minimum: int = 1):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be at least {minimum}, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    presets = "\n".join(f"  {name:19s} {preset_description(name)}" for name in PRESETS)
    parser = Parser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"Presets:\n{presets}\n\nExit codes: 0 success; 1 a greedy DFlash output differed from the "
               "autoregressive one in float32 (in bfloat16 a difference is a warning: near-ties may flip); "
               "2 bad arguments or files.",
    )
    models = parser.add_mutually_exclusive_group(required=True)
    models.add_argument("--preset", choices=PRESETS, metavar="NAME",
                        help=f"random-weight models built from shapes, one of: {', '.join(PRESETS)} (see below); "
                             "qwen3-8b/qwen3-4b (and the MoE presets at full depth) are for accelerators in "
                             "bfloat16")
    models.add_argument("--target", metavar="DIR",
                        help="a real target: a Hugging Face directory, an Orbax checkpoint or a Hugging Face Hub "
                             "id such as Qwen/Qwen3-8B (the Hugging Face cache; a local path of the same name "
                             "wins) (needs --ckpt)")
    parser.add_argument("--ckpt", metavar="DIR",
                        help="the DFlash draft for --target: an official draft directory, an Orbax checkpoint or "
                             "a Hub id")
    parser.add_argument("--revision", metavar="REV",
                        help="with a Hub id as --target: its branch, tag or commit (default: main)")
    parser.add_argument("--ckpt-revision", metavar="REV",
                        help="with a Hub id as --ckpt: its branch, tag or commit (default: main)")
    parser.add_argument("--draft-layers", type=positive("--draft-layers"), metavar="N",
                        help="draft depth for the tiny/small presets (default: 1 for tiny, 2 for small)")
    parser.add_argument("--target-layers", type=positive("--target-layers", 2), metavar="N",
                        help="target depth for the cut mixture-of-experts presets (default: 2, which "
                             "fits a 23 GB CPU in float32; the "
                             "real depth, 48 or 24, measures the whole model); the draft keeps its depth")
    parser.add_argument("--expert-path", choices=("auto", "dense", "grouped", "routed"), default="auto",
                        help="how mixture-of-experts layers compute (models/experts.py): every expert on every "
                             "token ('dense'), the (token, expert) pairs sorted into one grouped matmul "
                             "('grouped'), each pair reading only its expert's weights ('routed'), or by platform "
                             "and token count ('auto', the engine's choice; default)")
    parser.add_argument("--experts", "--mxfp4", dest="experts", choices=("dequantize", "packed"),
                        default="dequantize",
                        help="gpt-oss presets: experts as bfloat16/float32 weights ('dequantize', default) or kept "
                             "as packed MXFP4 codes decoded inside the layer ('packed', how gpt-oss-120b fits one "
                             "80-141 GB device); --mxfp4 is the older name")
    parser.add_argument("--low-memory", action="store_true",
                        help="lower the peak memory on a CPU (for the real-width mixture-of-experts presets): "
                             "XLA:CPU's memory-minimising scheduler instead of the concurrency-optimised one, no "
                             "hoisting of loop-invariant work out of the decode loop (in bfloat16 it keeps a "
                             "float32 copy of every weight), and mixture-of-experts prefills in chunks small "
                             "enough for the dense expert path (prefill time is not a figure here). Sets "
                             "XLA_FLAGS before JAX starts")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="parameter and compute dtype (default float32; on a CPU bfloat16 is about 6x slower, "
                             "use it on GPU/TPU)")
    parser.add_argument("--batch", type=positive("--batch"), default=1, metavar="N",
                        help="prompts decoded together (default 1)")
    parser.add_argument("--block-size", type=positive("--block-size", 2), metavar="B",
                        help="tokens per round (anchor + B-1 drafts), at most the draft's block_size "
                             "(default: the draft's, 16 for the presets)")
    parser.add_argument("--context", type=positive("--context"), default=256, metavar="N",
                        help="prompt length in tokens, i.e. the context in the cache when decoding starts; "
                             "at least --block-size (default 256)")
    parser.add_argument("--new-tokens", type=positive("--new-tokens", 2), default=128, metavar="N",
                        help="tokens generated per prompt end to end (default 128)")
    parser.add_argument("--tau", type=positive("--tau"), default=4, metavar="T",
                        help="acceptance length forced on the oracle proposer: an error is planted every T "
                             "positions, so every round commits T-1 drafts + 1 bonus token; 1..B (default 4)")
    parser.add_argument("--repeats", type=positive("--repeats"), default=10, metavar="N",
                        help="timed runs per component after a compile and a warm-up run; the median is "
                             "reported (default 10)")
    parser.add_argument("--e2e-repeats", type=positive("--e2e-repeats"), default=1, metavar="N",
                        help="end-to-end generations per mode; the median decode time is reported (default 1)")
    parser.add_argument("--cache-slots", type=positive("--cache-slots"), metavar="N",
                        help="preallocate at least N cache slots for the component timings (default: what "
                             "--context and --new-tokens need); a larger cache must not make a round slower, "
                             "since attention stops at the live length")
    parser.add_argument("--adaptive", type=widths_arg, default=(), metavar="W1,W2,...",
                        help="also decode end to end with adaptive block size over these widths and the block "
                             "(oracle and draft; e.g. 1,4,8 with block 16), reported with the rounds taken at "
                             "each width")
    parser.add_argument("--draft-window", type=positive("--draft-window"), metavar="N",
                        help="bound every draft layer's context to the last N positions (as python -m infer "
                             "--draft-window): the draft's round time at long --context with and without it")
    parser.add_argument("--tree", type=positive("--tree"), default=0, metavar="N",
                        help="also decode end to end with tree verification of N nodes (as python -m infer "
                             "--tree; oracle and draft), beside the chain in the same run")
    parser.add_argument("--mesh", metavar="SPEC",
                        help="shard the models over devices for the end-to-end decodes, e.g. tensor=8 or "
                             "data=2,tensor=4 (the component timings use the sharded params as placed)")
    parser.add_argument("--seed", type=seed_arg, default=0, help="seed of the random weights and prompts (default 0)")
    parser.add_argument("--json", metavar="FILE", help="also write the full report (every timing) as JSON to FILE")
    add_attention_arg(parser)
    add_device_args(parser)
    return parser


def use_low_memory_xla_flags() -> None:
    """Add ``LOW_MEMORY_XLA_FLAGS`` to ``XLA_FLAGS`` (merged into an ``--xla_disable_hlo_passes`` already
    there). XLA reads the variable once, when JAX starts its first backend, so this must come before."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise UsageError("--low-memory sets XLA_FLAGS, which XLA reads when JAX starts, and JAX has already "
                         "started in this process; run python -m infer speed in a fresh process")
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in LOW_MEMORY_XLA_FLAGS:
        name, value = flag.split("=", 1)
        if name == "--xla_disable_hlo_passes" and re.search(f"{name}=\\S+", flags):
            flags = re.sub(f"({name}=\\S+)", f"\\1,{value}", flags, count=1)
        elif name not in flags:
            flags = f"{flags} {flag}".strip()
    os.environ["XLA_FLAGS"] = flags


def settings_of(args: argparse.Namespace, draft_block: int) -> SpeedSettings:
    settings = SpeedSettings(batch=args.batch, block_size=args.block_size or draft_block, context=args.context,
                             new_tokens=args.new_tokens, tau=args.tau, repeats=args.repeats,
                             e2e_repeats=args.e2e_repeats, seed=args.seed, dtype=resolve_dtype(args.dtype),
                             cache_slots=args.cache_slots, adaptive_widths=tuple(args.adaptive),
                             attention=args.attention, draft_window=args.draft_window, tree_budget=args.tree)
    settings.validate()
    if settings.block_size > draft_block:
        raise UsageError(f"--block-size {settings.block_size} is larger than the draft's block_size {draft_block}")
    return settings


def load_models(args: argparse.Namespace):
    """(title, settings, target config, target params, draft config, draft params); for presets the
    settings are checked before any weight is drawn."""
    if args.target:
        if not args.ckpt:
            raise UsageError("--target needs --ckpt (the draft)")
        if args.draft_layers is not None:
            raise UsageError("--draft-layers applies to the tiny/small presets only")
        if args.target_layers is not None:
            raise UsageError("--target-layers applies to the cut presets only (" + ", ".join(CUT_PRESETS) + ")")
        from dflash_jax.checkpoints.loading import load_draft_any, load_target_any

        from dflash_jax.checkpoints.hub import resolve_checkpoint

        ckpt = resolve_checkpoint(args.ckpt, args.ckpt_revision, "--ckpt")  # before the target's download
        tc, tp = load_target_any(args.target, dtype=args.dtype, progress=True, revision=args.revision,
                                 experts=args.experts)
        dc, dp = load_draft_any(ckpt, dtype=args.dtype, progress=True)
        dc.validate_against(tc, source=str(args.ckpt))
        return f"target {args.target}, draft {args.ckpt}", settings_of(args, dc.block_size), tc, tp, dc, dp
    if args.ckpt or args.revision or args.ckpt_revision:
        raise UsageError("--ckpt, --revision and --ckpt-revision go with --target, not with --preset")
    _, dc = preset_configs(args.preset, args.block_size, args.draft_layers, args.target_layers, args.experts)
    settings = settings_of(args, dc.block_size)
    tc, tp, dc, dp = preset_models(args.preset, args.block_size, settings.dtype, args.seed, args.draft_layers,
                                   args.target_layers, args.experts)
    title = f"preset {args.preset} (random weights: {preset_description(args.preset, args.target_layers)})"
    return title, settings, tc, tp, dc, dp


def speed_main(args: argparse.Namespace) -> int:
    log = lambda msg: print(f"[speed] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    if args.json:
        out = Path(args.json)
        if out.is_dir():
            raise UsageError(f"--json {out}: is a directory; give a file name")
        if not out.parent.is_dir():
            raise UsageError(f"--json {out}: folder {out.parent} does not exist")
        ensure_writable_dir(out.parent, "--json")  # before the minutes of measuring
    t0 = time.perf_counter()
    if args.low_memory:
        use_low_memory_xla_flags()
    setup_devices(args)
    check_attention_kernel(args.attention)  # before building any model
    mesh = None
    if args.mesh:
        from dflash_jax.sharding import make_mesh

        mesh = make_mesh(args.mesh)
    log("building models ...")
    title, settings, tc, tp, dc, dp = load_models(args)
    if tc.experts is not None:
        title += f"; expert path {args.expert_path}"
    if args.low_memory:
        settings = dataclasses.replace(settings, prefill_chunk=dense_prefill_chunk(tc))
        chunk = settings.prefill_chunk
        title += "; --low-memory" + ("" if chunk is None else f" (prefill in chunks of {chunk})")
    from dflash_jax.models.experts import force_expert_path

    with force_expert_path(None if args.expert_path == "auto" else args.expert_path):  # read while tracing
        report = run_speed(tc, tp, dc, dp, settings, log=log, mesh=mesh)
    report["models"]["source"] = title
    report["args"] = vars(args)
    report["wall_s"] = time.perf_counter() - t0
    print(format_report(report, f"DFlash speed: {title}"))
    if args.json:
        write_text_atomic(args.json, json.dumps(report, indent=2))
        log(f"wrote {args.json}")
    bad = [k for k in report["e2e"] if not report["e2e"][k]["identical_to_ar"]]
    if bad:
        detail = "; ".join(f"{k}: {report['e2e'][k]['mismatch']}" for k in bad)
        if args.dtype == "float32":
            print(f"error: greedy DFlash output differs from autoregressive decoding ({detail})", file=sys.stderr)
            return 1
        print(f"warning: outputs differ from autoregressive decoding in {args.dtype} ({detail}); near-ties "
              "can flip between 1-token and block verification; tok/round is measured, so the bound "
              "comparison still holds", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), speed_main, argv)


if __name__ == "__main__":
    sys.exit(main())
