"""What every ``python -m infer`` subcommand shares: argparse that reports instead of exiting, and one
error policy: a user mistake is one ``error: ...`` line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from dflash_jax.checkpoints.safetensors_io import CheckpointError
from dflash_jax.models.config import ConfigError

USER_ERRORS = (ConfigError, CheckpointError, ValueError, FileNotFoundError, NotADirectoryError, OSError)


class UsageError(Exception):
    """A bad command line; reported as one ``error: ...`` line with exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print the usage and call sys.exit(2)
        raise UsageError(message)


def run_cli(parser: argparse.ArgumentParser, action: Callable[[argparse.Namespace], int | None],
            argv: list[str] | None) -> int:
    """Parse ``argv`` and run ``action``; user errors become exit code 2 with one clear line."""
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        print(f"error: {e} (see {parser.prog} --help)", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    try:
        return int(action(args) or 0)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except USER_ERRORS as e:
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
