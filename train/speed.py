"""``python -m train speed --config configs/<run>.yaml [--steps 10]``: how fast the train step runs here.

With ``--compare NAME:KEY=VALUE``, variants of the run (another loss, DFlash2, ...) are timed side by side
with it, taking turns step by step, and the ratios of their step times are printed.

Builds the run exactly as 'python -m train fit' would (same target, data, mesh and step), then times N steps
and, on the same batches, the frozen target's feature pass alone. Prints training tokens/s and the share of
the step that the target takes (the rest is the draft's forward, backward and the optimizer). Writes nothing.
"""

from __future__ import annotations

import argparse
import json

from dflash_jax.errors import UserError
from infer.cli import Parser, add_device_args, run_cli, setup_devices


PROG = "python -m train speed"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, metavar="FILE", help="the run config YAML (see configs/runs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set train.global_batch=8 (repeatable)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps after one warm-up step (default 10)")
    parser.add_argument("--compare", action="append", default=[], metavar="NAME:KEY=VALUE[;KEY=VALUE]",
                        help="also time this variant of the run (overrides separated by ';'), side by side with "
                             "the run as configured: the runs take turns step by step, and the ratios of their "
                             "median step times are printed (repeatable), e.g. --compare kl:train.loss=kl")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    add_device_args(parser)
    return parser


def speed_main(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise UserError(f"--steps must be at least 1, got {args.steps}")
    setup_devices(args)
    from dflash_jax.training.run_config import load_run_config
    from dflash_jax.training.trainer import measure_step, prepare_run

    cfg = load_run_config(args.config, args.overrides)
    if args.compare:
        return compare_main(args)
    out = measure_step(prepare_run(cfg, log=lambda _: None), args.steps)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"train step: {out['step_s'] * 1e3:.1f} ms (median of {out['steps']}), {out['tokens_per_s']:.0f} tokens/s "
          f"(global batch {out['global_batch']} x {out['max_length']} tokens, {out['num_anchors']} anchors, "
          f"block {out['block_size']})")
    print(f"target features alone: {out['target_features_s'] * 1e3:.1f} ms = {out['target_share']:.0%} of the step; "
          f"draft forward + backward + optimizer: the other {1 - out['target_share']:.0%}")
    print(f"params: target {out['target_params']:,}, draft {out['draft_params']:,}")
    return 0


def compare_main(args: argparse.Namespace) -> int:
    from dflash_jax.training.run_config import load_run_config
    from dflash_jax.training.trainer import compare_steps, prepare_run

    variants = {"as configured": []}
    for item in args.compare:
        name, sep, overrides = item.partition(":")
        if not sep or not name.strip() or not overrides.strip():
            raise UserError(f"--compare {item!r}: expected NAME:KEY=VALUE[;KEY=VALUE], e.g. kl:train.loss=kl")
        if name.strip() in variants:
            raise UserError(f"--compare {item!r}: the name {name.strip()!r} is given twice")
        variants[name.strip()] = [o.strip() for o in overrides.split(";") if o.strip()]
    runs = {name: prepare_run(load_run_config(args.config, [*args.overrides, *extra]), log=lambda _: None)
            for name, extra in variants.items()}
    out = compare_steps(runs, args.steps)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    width = max(len(n) for n in out)
    print(f"train steps side by side ({args.steps} turns each, medians; interquartile spread in brackets):")
    for name, r in out.items():
        print(f"  {name:<{width}}  {r['step_s'] * 1e3:8.1f} ms  [{r['spread_s'] * 1e3:.1f}]  x{r['ratio']:.2f}"
              + (f"  ({'; '.join(variants[name])})" if variants[name] else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), speed_main, argv)
