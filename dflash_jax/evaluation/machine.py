"""What machine a measurement ran on: recorded with every benchmark and speed report."""

from __future__ import annotations

import os
import platform


def _cpu_name() -> str:
    name = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        return name


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def machine_info() -> dict:
    """JAX version, backend and devices, CPU, Python and the 1-minute load average (a busy machine explains
    slow timings)."""
    import jax

    devices = jax.devices()
    return {"jax": jax.__version__, "backend": devices[0].platform, "device": devices[0].device_kind,
            "num_devices": len(devices), "devices": [str(d) for d in devices], "machine": platform.machine(),
            "cpu": _cpu_name(), "cpu_count": os.cpu_count(), "host": platform.node(),
            "platform": platform.platform(), "python": platform.python_version(), "load_avg_1m": load_average()}
