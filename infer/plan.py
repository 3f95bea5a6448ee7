"""``python -m infer plan``: compile the decode engine for a device, without the device or any weight, and
print what one device would hold and run.

The target and draft come from a pairing (--pairing NAME_OR_YAML, configs/<name>.yaml) or from a target's
config.json (--target-config, planning the autoregressive baseline unless --draft-config is given too). The
prefill and the decode loop are compiled by the device's own compiler (--device h100/h200/b200: XLA:GPU through
the CUDA plugin; v5e/v5p/v6e or a topology such as v5p:2x2x2: the TPU compiler through libtpu; cpu: this
machine), from abstract parameters sharded over --mesh. Needs the aot extra for GPUs and TPUs
(pip install -e ".[aot]").

Per device it prints: the weights, the caches (target KV / recurrent state and the draft's context cache), the
temporaries of the larger program, their total against the device's memory; the data-dependent loops inside
one decode round (each costs a host sync per trip on a GPU) and in the prefill; the fused kernels the compiled
programs call; and, for mixture-of-experts targets, the expert weight bytes one round reads against the bytes of
only the experts its tokens are routed to (an estimate per device: expert and tensor shards divide it).

Example: does gpt-oss-120b fit one H200 at 32k tokens and batch 4?

    python -m infer plan --pairing gpt-oss-120b-dflash-b10 --experts packed --context 32768 --batch 4 --device h200
"""

from __future__ import annotations

import argparse
import json
import os

from infer.cli import Parser, UsageError, add_attention_arg, run_cli

PROG = "python -m infer plan"


def build_parser() -> argparse.ArgumentParser:
    from dflash_jax.aot import DEVICES

    parser = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                    epilog="Exit codes: 0 planned (whether or not it fits), 2 bad arguments, a missing extra or "
                           "a config the engine refuses (one 'error: ...' line on stderr).")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--pairing", metavar="NAME_OR_YAML",
                        help="a pairing file (configs/<name>.yaml, by name or path): its target and draft")
    source.add_argument("--target-config", metavar="CONFIG.json",
                        help="a target's Hugging Face config.json (no weights needed)")
    source.add_argument("--preset", metavar="NAME",
                        help="the shapes of a `python -m infer speed` preset, to set a plan beside a measured run "
                             "(with --target-layers for the cut presets)")
    parser.add_argument("--target-layers", type=int, metavar="N",
                        help="with --preset: keep the target's first N layers (the cut presets of infer speed)")
    parser.add_argument("--draft-config", metavar="CONFIG.json",
                        help="with --target-config: a DFlash draft's official config.json (default: plan the "
                             "autoregressive baseline)")
    parser.add_argument("--baseline", action="store_true",
                        help="plan the autoregressive baseline (no draft) even with a pairing")
    parser.add_argument("--device", default="cpu", metavar="DEVICE",
                        help=f"what to compile for: {', '.join(DEVICES)}, or a TPU topology such as v5p:2x2x2 "
                             "(default cpu: this machine; local: the accelerators this process runs on, against "
                             "what JAX's allocator may take of them: 75%% of a GPU's memory unless "
                             "XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise)")
    parser.add_argument("--batch", type=int, default=1, metavar="B", help="rows decoded together (default 1)")
    parser.add_argument("--context", type=int, default=4096, metavar="N",
                        help="positions each row holds at the end: prompt + new tokens (default 4096)")
    parser.add_argument("--max-new-tokens", type=int, default=256, metavar="N",
                        help="new tokens per row (default 256); the prompt is --context minus this")
    parser.add_argument("--block-size", type=int, metavar="B", help="verify block (default: the draft's)")
    parser.add_argument("--tree", type=int, default=0, metavar="N",
                        help="plan rounds that verify a draft tree of N nodes (as python -m infer --tree)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="compute dtype of weights and activations (default bfloat16)")
    parser.add_argument("--mesh", metavar="SPEC",
                        help="device mesh with explicit sizes, e.g. tensor=8 or data=2,expert=4 (default: one "
                             "device)")
    parser.add_argument("--experts", "--mxfp4", dest="experts", choices=("dequantize", "packed"),
                        default="dequantize",
                        help="quantised experts (gpt-oss's MXFP4; the FP8 or INT4 that the pairing's "
                             "quantization_config declares) decoded at load (default) or kept packed on the "
                             "device (--mxfp4: the older name)")
    add_attention_arg(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return parser


def _configs(args):
    from dflash_jax.configs import load_pairing
    from dflash_jax.models.config import TargetConfig, read_json_object
    from dflash_jax.models.draft_config import DraftConfig

    if args.target_layers is not None and not args.preset:
        raise UsageError("--target-layers goes with --preset")
    if args.preset:
        from dflash_jax.evaluation.speed import preset_configs

        if args.draft_config:
            raise UsageError("--draft-config goes with --target-config (a preset names its own draft)")
        target, draft = preset_configs(args.preset, target_layers=args.target_layers)
        return target, None if args.baseline else draft
    if args.pairing:
        if args.draft_config:
            raise UsageError("--draft-config goes with --target-config (a pairing names its own draft)")
        pairing = load_pairing(args.pairing)
        return pairing.target, None if args.baseline else pairing.draft
    target = TargetConfig.from_dict(read_json_object(args.target_config, "target config"), source=args.target_config)
    draft = None
    if args.draft_config and not args.baseline:
        draft = DraftConfig.from_dict(read_json_object(args.draft_config, "draft config"), source=args.draft_config)
    return target, draft


def _table(plan: dict) -> str:
    gib = lambda key: "-" if plan[key] is None else f"{plan[key]:,.2f} GiB"  # noqa: E731
    mesh = ",".join(f"{a}={s}" for a, s in plan["mesh"].items() if s > 1) or "one device"
    fits = {True: "fits", False: "DOES NOT FIT", None: "no memory figure for this device"}[plan["fits"]]
    kernels = sorted({name for found in plan["fused_kernels"].values() for name in found})
    lines = [
        f"device {plan['device']} ({plan['platform']}), {mesh}; batch {plan['batch']}, context {plan['context']} "
        f"({plan['prompt_tokens']} prompt + {plan['max_new_tokens']} new, {plan['cache_slots']} cache slots), "
        f"block {plan['block_size']}{', tree of ' + str(plan['tree_budget']) + ' nodes' if plan.get('tree_budget') else ''}, {plan['dtype']}, experts {plan['experts']}, attention {plan['attention']}",
        "per device:",
        f"  weights            {gib('weights_gib')}",
        f"  caches             {gib('cache_gib')}",
        f"  other loop state   {gib('other_state_gib')}",
        f"  temporaries        {gib('temporaries_gib')}  (the larger program's: prefill "
        f"{gib('prefill_temporaries_gib')}, decode loop {gib('decode_temporaries_gib')})",
        f"  total              {gib('total_gib')}  of {gib('device_memory_gib')}: {fits}",
        f"programs compiled    {plan['programs_compiled']} (prefill, decode loop) in {plan['compile_seconds']} s",
        f"loops per round      {plan['loops_per_round']} data-dependent (prefill: {plan['prefill_loops']})",
        f"fused kernels        {', '.join(kernels) if kernels else 'none'}",
    ]
    if plan["expert_gib_per_round"] or plan["routed_expert_gib_per_round"]:
        ratio = plan["expert_gib_per_round"] / max(plan["routed_expert_gib_per_round"], 1e-9)
        lines.append(f"expert reads/round   {plan['expert_gib_per_round']:,.3f} GiB, routed-only "
                     f"{plan['routed_expert_gib_per_round']:,.3f} GiB ({ratio:.2f}x); busiest device at most "
                     f"{plan['busiest_device_expert_gib_per_round']:,.3f} GiB (every pair on its experts)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from dflash_jax.aot import plan_decode

    target, draft = _configs(args)
    progress = None if args.json else (lambda message: print(message + " ...", flush=True))
    plan = plan_decode(target, draft, batch=args.batch, context=args.context, max_new_tokens=args.max_new_tokens,
                       dtype=args.dtype, mesh=args.mesh, experts=args.experts, attention=args.attention,
                       device=args.device, block_size=args.block_size, tree_budget=args.tree, progress=progress)
    print(json.dumps(plan) if args.json else _table(plan))
    return 0


def main(argv: list[str] | None = None) -> int:
    # The CUDA plugin serves compile-only GPUs only when JAX's own backend is the CPU (its start-up check of
    # the CUDA libraries would otherwise fail on a machine without a GPU and unregister it); a plan never
    # runs anything on a device, so the CPU is all it needs.
    if not _local(argv):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    return run_cli(build_parser(), run, argv)


def _local(argv) -> bool:
    """Whether the command line asks for ``--device local`` (the process's own accelerators)."""
    argv = list(argv or [])
    return any(a == "--device=local" or (a == "--device" and argv[i + 1:i + 2] == ["local"])
               for i, a in enumerate(argv))
