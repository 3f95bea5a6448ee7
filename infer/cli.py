"""What every ``python -m infer`` / ``python -m train`` subcommand shares: argparse that reports instead of
exiting, and one error policy. A user mistake (``UserError``: bad file, config, flag, prompt) or a failure of
the environment (``OSError``: a missing file, no permission, a full disk; the message names the path) is one
``error: ...`` line on stderr and exit code 2. Anything else is a bug and keeps its traceback. Ctrl-C is one
line and exit code 130."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Callable

from dflash_jax.errors import ServingWarning, UserError

USER_ERRORS = (UserError, OSError)


MAX_SEED = 2**32 - 1


def seed_arg(text: str) -> int:
    """argparse type of every ``--seed``: an integer in ``0 .. 2**32 - 1`` (JAX keys take 32-bit seeds)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be between 0 and {MAX_SEED}, got {value}")
    return value


def text_arg(text: str) -> str:
    """argparse type of prompt text: a shell passes bytes that are not UTF-8 as surrogates; refuse them here
    rather than inside the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("not valid UTF-8 text (the argument holds undecodable bytes)") from None
    return text


class UsageError(UserError):
    """A bad command line; reported as one ``error: ...`` line with exit code 2."""


class Parser(argparse.ArgumentParser):
    """Every command's parser: errors raise instead of exiting, and ``--no-compile-cache`` is always there."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--no-compile-cache", action="store_true",
                          help="do not keep compiled programs on disk for the next run (default: kept under "
                               "~/.cache/dflash_jax/xla; DFLASH_JAX_COMPILE_CACHE=0 also turns it off, "
                               "DFLASH_JAX_COMPILE_CACHE=DIR moves it)")

    def error(self, message: str):  # argparse would print the usage and call sys.exit(2)
        raise UsageError(message)


def _show_warning(message, category, filename, lineno, file=None, line=None):
    if issubclass(category, ServingWarning):
        print(f"warning: {message}", file=sys.stderr if file is None else file)
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


_default_showwarning = warnings.showwarning


def run_cli(parser: argparse.ArgumentParser, action: Callable[[argparse.Namespace], int | None],
            argv: list[str] | None) -> int:
    """Parse ``argv`` and run ``action``; user errors become exit code 2 with one clear line, the project's
    warnings one ``warning: ...`` line."""
    warnings.showwarning = _show_warning
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        print(f"error: {e} (see {parser.prog} --help)", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    try:
        if not getattr(args, "no_compile_cache", False):
            from dflash_jax import compile_cache

            compile_cache.enable()
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


# ------------------------------------------------------------------------------ devices (infer and train)


def widths_arg(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 2,4, got {text!r}") from None
    if not widths or widths[0] < 1:
        raise argparse.ArgumentTypeError(f"widths must be positive, got {text!r}")
    return widths


DEFAULT_TREE_BUDGETS = (8, 16, 32, 64)


def tree_arg(text: str) -> int | str:
    """``--tree``: a number of nodes, or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        nodes = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of nodes or 'auto', got {text!r}") from None
    if nodes < 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of nodes (or 'auto'), got {text!r}")
    return nodes


def add_tree_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tree", type=tree_arg, default=0, metavar="N|auto",
                        help="tree verification (DDTree; beyond the paper; off by default): each round the target "
                             "verifies the N most probable draft prefixes under the draft's per-position "
                             "distributions (a DFlash2 draft's: under its selector's transition scores) in one "
                             "forward, instead of the chain, and keeps the longest path it agrees with; the output "
                             "is unchanged. Costs a verify of N+1 tokens per round: pays where that costs about "
                             "what the chain's block does (small batches, an accelerator). 'auto': every few rounds "
                             "the chain or one of --tree-budgets, whichever promises the most tokens per unit of "
                             "time (CaDDTree's rule on the draft's own probabilities, corrected by what the tree "
                             "rounds accepted, and each option's round time measured on this device when the "
                             "program compiles); where no tree's calibration rounds beat the chain's, it decodes with "
                             "the chain's own program. Every target family, "
                             "Gated DeltaNet (Qwen3.5/3.6, Qwen3-Next) included")
    parser.add_argument("--tree-budgets", type=widths_arg, default=DEFAULT_TREE_BUDGETS, metavar="N1,N2,...",
                        help="the tree budgets --tree auto chooses among, beside the chain (default "
                             f"{','.join(map(str, DEFAULT_TREE_BUDGETS))}; each is one more compiled round)")


def tree_settings(args: argparse.Namespace, has_draft: bool, adaptive: tuple[int, ...] = ()) -> dict:
    """``--tree`` / ``--tree-budgets`` as Decoder fields (``tree_budget``, ``tree_auto``), checked."""
    tree = getattr(args, "tree", 0)
    if tree and not has_draft:
        raise UsageError("--tree needs a draft (--ckpt)")
    if tree and adaptive:
        raise UsageError("--tree and --adaptive cannot be combined")
    budgets = tuple(getattr(args, "tree_budgets", DEFAULT_TREE_BUDGETS))
    if tree != "auto" and budgets != DEFAULT_TREE_BUDGETS:
        raise UsageError("--tree-budgets needs --tree auto")
    return {"tree_budget": 0, "tree_auto": budgets} if tree == "auto" else {"tree_budget": tree, "tree_auto": ()}


def add_attention_arg(parser: argparse.ArgumentParser) -> None:
    from dflash_jax.models.attention_kernels import ATTENTION_KERNELS

    parser.add_argument("--attention", choices=ATTENTION_KERNELS, default="auto",
                        help="attention kernel: auto (default: per platform, cuDNN's fused flash attention on "
                             "a CUDA GPU with --dtype bfloat16 and xla there otherwise, dflash_jax's Pallas kernel "
                             "on a TPU, the loop on a CPU: no accelerator runs a loop whose trip count depends on "
                             "data), loop (the portable chunked online softmax bounded by the live length), cudnn "
                             "(CUDA GPUs only), pallas (the TPU kernel; off a TPU Pallas's interpreter, slow), xla "
                             "(the fused kernels' form through XLA's reference implementation: every cache slot, "
                             "static shapes)")


def add_device_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu-devices", type=int, metavar="N",
                        help="simulate N devices on the CPU (XLA's host platform device count), e.g. to try a mesh")
    parser.add_argument("--coordinator", metavar="HOST:PORT",
                        help="multi-process: address of process 0 (jax.distributed.initialize)")
    parser.add_argument("--num-processes", type=int, metavar="N", help="multi-process: number of processes")
    parser.add_argument("--process-id", type=int, metavar="I", help="multi-process: this process's index")
    parser.add_argument("--distributed", action="store_true",
                        help="call jax.distributed.initialize() with auto-detection (TPU pods, SLURM)")


def setup_devices(args: argparse.Namespace) -> None:
    """Must run before JAX touches a backend. Namespaces without the device flags (the demo) are a no-op."""
    if not hasattr(args, "cpu_devices"):
        return
    if args.cpu_devices:
        if args.cpu_devices < 1:
            raise UserError(f"--cpu-devices must be positive, got {args.cpu_devices}")
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.cpu_devices}".strip()
        if not os.environ.get("JAX_PLATFORMS"):
            os.environ["JAX_PLATFORMS"] = "cpu"
            if "jax" in sys.modules:  # imported at start-up (dflash_jax.startup): its config read the env then
                import jax

                jax.config.update("jax_platforms", "cpu")
    explicit = [args.coordinator, args.num_processes, args.process_id]
    if any(v is not None for v in explicit):
        if any(v is None for v in explicit):
            raise UserError("--coordinator, --num-processes and --process-id go together")
        if not 0 <= args.process_id < args.num_processes:
            raise UserError(f"--process-id {args.process_id} must be in 0..{args.num_processes - 1}")
        import jax

        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    elif args.distributed:
        import jax

        jax.distributed.initialize()
