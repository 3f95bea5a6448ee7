"""Dispatch ``python -m train {regenerate,fit,plan} ...``."""

import sys

USAGE = """usage: python -m train {regenerate,openings,fit,plan,speed} ...

  regenerate  the target answers every prompt of a JSONL file with this project's engine (resumable shards)
  openings    training and held-out prompt files from openings the target wrote (regenerate output)
  fit         train a DFlash draft from a run config (configs/<run>.yaml), with checkpoints and resume
  plan        AOT-compile the train step from abstract shapes and print per-device memory and FLOPs
  speed       time the train step on real data: tokens/s and the target's share of the step

Each subcommand explains its flags with --help."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sub = argv[0] if argv else None
    from dflash_jax.startup import start_jax

    start_jax()
    if sub == "regenerate":
        from train.regenerate import main as run
    elif sub == "fit":
        from train.fit import main as run
    elif sub == "plan":
        from train.plan import main as run
    elif sub == "openings":
        from train.openings import main as run
    elif sub == "speed":
        from train.speed import main as run
    elif sub in ("-h", "--help"):
        print(USAGE)
        return 0
    else:
        print(USAGE, file=sys.stderr)
        print(f"error: expected a subcommand (regenerate, openings, fit, plan or speed), got {sub!r}", file=sys.stderr)
        return 2
    return run(argv[1:])


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C during start-up (imports), before a subcommand's own handler runs
        print("interrupted", file=sys.stderr)
        sys.exit(130)
