"""``python -m train fit --config configs/<run>.yaml [--set section.key=value ...]``: train a DFlash draft.

Rerunning the same command resumes from the newest checkpoint in output.dir (params, optimizer state, RNG and
data position), and refuses when a setting that decides the model or the data order changed. SIGTERM saves a
checkpoint and stops. At the end the draft is evaluated through the engine (real tau on data.eval_prompts)
and exported to output.dir/export/draft (official layout: servable by SGLang/vLLM, loadable by
'python -m infer --ckpt') and output.dir/export/draft-orbax.

Multi-host: start the same command on every host with --coordinator HOST:PORT --num-processes N
--process-id I (or let jax.distributed discover them on TPU pods / SLURM with --distributed).
"""

from __future__ import annotations

import argparse

from infer.cli import Parser, add_device_args, run_cli, setup_devices

PROG = "python -m train fit"


def build_parser() -> argparse.ArgumentParser:
    from dflash_jax.training.run_config import describe_keys

    parser = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                    epilog="Run config keys (YAML sections; override any with --set section.key=value):\n"
                           + describe_keys())
    parser.add_argument("--config", required=True, metavar="FILE", help="the run config YAML (see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set train.max_steps=100 (repeatable)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    add_device_args(parser)
    return parser


def fit_main(args: argparse.Namespace) -> int:
    setup_devices(args)
    from dflash_jax.training.run_config import load_run_config
    from dflash_jax.training.trainer import fit

    cfg = load_run_config(args.config, args.overrides)
    result = fit(cfg, progress=not args.no_progress)
    m = result.final_metrics
    if m:
        print(f"step {result.steps}: loss {m['loss']:.4f}, accuracy {m['accuracy']:.3f}, "
              f"estimated tau {m['implied_acceptance_length']:.2f}")
    if result.eval_tau is not None:
        print(f"real tau through the engine: {result.eval_tau:.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), fit_main, argv)
