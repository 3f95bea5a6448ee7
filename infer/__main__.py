"""Dispatch ``python -m infer [bench|speed|plan|convert|demo] ...``; no subcommand means generate."""

import os
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sub = argv[0] if argv else None
    if sub == "plan" and "local" not in argv:
        # A plan compiles for devices it does not start: JAX's own backend is the CPU, which also lets the CUDA
        # plugin serve compile-only GPUs on a machine without one.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from dflash_jax.startup import start_jax

    start_jax()
    if sub == "convert":
        from infer.convert import main as run
    elif sub == "bench":
        from infer.bench import main as run
    elif sub == "speed":
        from infer.speed import main as run
    elif sub == "plan":
        from infer.plan import main as run
    elif sub == "demo":
        from infer.demo import main as run
    else:
        from infer.run import main as run

        return run(argv)
    return run(argv[1:])


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C during start-up (imports), before a subcommand's own handler runs
        print("interrupted", file=sys.stderr)
        sys.exit(130)
