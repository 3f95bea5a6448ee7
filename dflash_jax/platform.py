"""The platform a program is traced for: the one place per-platform paths ask."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax

_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("platform", default=None)


def current_platform() -> str:
    """'cpu', 'gpu' or 'tpu': the platform of the program being traced (set by ``compiling_for`` while a
    program is compiled ahead of time for a device this process does not have), else JAX's default backend."""
    forced = _PLATFORM.get()
    return forced if forced is not None else jax.default_backend()


@contextlib.contextmanager
def compiling_for(platform: str | None) -> Iterator[None]:
    """Trace inside this block as for ``platform`` ('cpu', 'gpu', 'tpu'; None: no change)."""
    if platform not in (None, "cpu", "gpu", "tpu"):
        raise ValueError(f"platform must be cpu, gpu or tpu, got {platform!r}")
    token = _PLATFORM.set(platform)
    try:
        yield
    finally:
        _PLATFORM.reset(token)
