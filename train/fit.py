"""``python -m train fit --config configs/<run>.yaml [--set section.key=value ...]``: train a DFlash draft.

Rerunning the same command resumes from the newest checkpoint in output.dir (params, optimizer state, RNG and
data position), and refuses when a setting that decides the model or the data order changed. SIGTERM saves a
checkpoint and stops. At the end the draft is evaluated through the engine (real tau on data.eval_prompts)
and exported to output.dir/export/draft (official layout: servable by SGLang/vLLM, loadable by
'python -m infer --ckpt') and output.dir/export/draft-orbax.

Data: data.train (one source or a list) or data.sources (a mixture with weights or max_samples, a global
data.limit, duplicates removed across sources, length filters). A source is a .jsonl/.jsonl.gz, .json (one
array), .parquet or .arrow file, a directory or glob of them, or a Hub dataset hf:ORG/NAME[:CONFIG[:SPLIT]]
(its Parquet files through the Hugging Face cache; HF_HUB_OFFLINE=1 reads the cache alone). Each source's
tokenized rows are cached (data.cache_dir), keyed by everything that decides them, so a second run skips
tokenizing; per-source counts of every filter stage go to output.dir/source_counts.json.

Multi-host: start the same command on every host with --coordinator HOST:PORT --num-processes N
--process-id I (or let jax.distributed discover them on TPU pods / SLURM with --distributed).
"""

from __future__ import annotations

import argparse
from pathlib import Path

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


def prepare_data(cfg: dict, progress: bool = True):
    """The run's training rows (data.train or the data.sources mixture, through the tokenized cache), with
    per-source counts printed and written to output.dir/source_counts.json by process 0."""
    import jax

    from dflash_jax.checkpoints.hub import resolve_checkpoint
    from dflash_jax.checkpoints.loading import load_tokenizer, tokenizer_dir
    from dflash_jax.data.mixture import COUNTS_FILE, prepare_training_data, settings_of, write_counts

    # The tokenizer as the trainer loads it (dflash_jax/training/trainer.py: prepare_run).
    target_path = resolve_checkpoint(cfg["target"]["path"], cfg["target"]["revision"], "target.path")
    tokenizer = load_tokenizer(cfg["target"]["tokenizer"] or tokenizer_dir(target_path), what="target.tokenizer")
    main_process = jax.process_index() == 0
    log = print if main_process else (lambda _: None)
    tokenized, counts = prepare_training_data(settings_of(cfg), tokenizer, log=log, progress=progress and main_process)
    if main_process:
        write_counts(Path(cfg["output"]["dir"]) / COUNTS_FILE, counts)
    return tokenized


def fit_main(args: argparse.Namespace) -> int:
    setup_devices(args)
    from dflash_jax.training.run_config import load_run_config
    from dflash_jax.training.trainer import fit

    cfg = load_run_config(args.config, args.overrides)
    tokenized = prepare_data(cfg, progress=not args.no_progress)
    result = fit(cfg, tokenized=tokenized, progress=not args.no_progress)
    m = result.final_metrics
    if m:
        print(f"step {result.steps}: loss {m['loss']:.4f}, accuracy {m['accuracy']:.3f}, "
              f"estimated tau {m['implied_acceptance_length']:.2f}")
    if result.eval_tau is not None:
        print(f"real tau through the engine: {result.eval_tau:.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), fit_main, argv)
