"""Starting JAX from the command-line tools without the CUDA plugin's start-up noise.

With the ``aot`` extra installed (the CUDA plugin and libtpu, to compile for accelerators without one), JAX
imports the CUDA plugin at start-up on every machine. On a machine without an NVIDIA driver its libraries print
a "Could not find cuda drivers" notice, each after an absl preamble line, 6-8 lines in all; and unless
``JAX_PLATFORMS`` names the platforms, the plugin's version check fails with a long traceback, after which JAX
goes on with the CPU. Neither says anything about the user's command, and both would bury the one ``error:``
line the tools promise. ``start_jax`` imports JAX with the process's stderr held back and writes back every
line except those; on a machine with a GPU nothing is dropped (the notices are not printed there).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile

# Lines of the CUDA libraries' "no driver" notice (each preceded by absl's preamble).
NOTICE = ("cudart_stub.cc", "All log messages before absl::InitializeLog() is called")


def _nvidia_driver_present() -> bool:
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia/version"))


def _tpu_present() -> bool:
    return os.path.isdir("/dev/vfio") or any(name.startswith("accel") for name in _listdir("/dev"))


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def default_platforms() -> str | None:
    """``JAX_PLATFORMS`` for a machine that has the CUDA plugin but no NVIDIA driver (and no TPU): "cpu", so
    the plugin skips the version check that would fail; None where JAX's own choice is right."""
    if os.environ.get("JAX_PLATFORMS"):
        return None
    if importlib.util.find_spec("jax_plugins") is None or importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        return None
    if _nvidia_driver_present() or _tpu_present():
        return None
    return "cpu"


def start_jax() -> None:
    """Import JAX and register its plugins (no backend is started: device flags set later still apply), with
    the CUDA plugin's driver notice dropped from stderr. A no-op once JAX is imported."""
    if "jax" in sys.modules:
        return
    platforms = default_platforms()
    if platforms:
        os.environ["JAX_PLATFORMS"] = platforms
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no usable fd 2 (an embedded interpreter): import plainly
        import jax  # noqa: F401

        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            import jax  # noqa: F401
            from jax._src import xla_bridge

            # Plugins are imported when the first backend starts; registering them here (idempotent) keeps
            # their start-up output inside this block.
            getattr(xla_bridge, "_discover_and_register_pjrt_plugins", lambda: None)()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            text = held.read().decode("utf-8", errors="replace")
    kept = [line for line in text.splitlines() if line.strip() and not any(n in line for n in NOTICE)]
    if kept:
        sys.stderr.write("\n".join(kept) + "\n")
