"""JAX's persistent compilation cache, on by default for the command lines.

Compiling the engine's programs takes seconds on a CPU and minutes for a large target on an accelerator, and
every process did it again. With the cache on, XLA's executables are stored on disk keyed by the program and
the compiler, so the next process with the same shapes loads them instead. ``--no-compile-cache`` (every
``python -m infer`` / ``python -m train`` command) or ``DFLASH_JAX_COMPILE_CACHE=0`` turns it off;
``DFLASH_JAX_COMPILE_CACHE=/some/dir`` moves it (default: ``$XDG_CACHE_HOME/dflash_jax/xla``, else
``~/.cache/dflash_jax/xla``).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import jax

from dflash_jax.errors import ServingWarning

ENV = "DFLASH_JAX_COMPILE_CACHE"
OFF = ("0", "off", "false", "no", "")


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dflash_jax" / "xla"


def cache_dir() -> Path | None:
    """Where the cache goes by the environment: None when ``DFLASH_JAX_COMPILE_CACHE`` turns it off."""
    value = os.environ.get(ENV)
    if value is None:
        return default_dir()
    if value.strip().lower() in OFF:
        return None
    return Path(value).expanduser() if value.strip().lower() not in ("1", "on", "true", "yes") else default_dir()


def enable(path: str | Path | None = None) -> Path | None:
    """Turn the persistent cache on at ``path`` (default: ``cache_dir()``; None there: leave it off). Programs
    that compile in under a second are not stored (JAX's own threshold)."""
    path = Path(path) if path is not None else cache_dir()
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only home: run without the cache rather than not at all
        warnings.warn(f"compiled programs are not kept on disk: cannot create {path} ({e.strerror}); set "
                      f"{ENV}=DIR to keep them elsewhere", ServingWarning)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    return path
