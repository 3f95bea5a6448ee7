"""Training checkpoints with Orbax's ``CheckpointManager``: train state, data position and run fingerprint.

Each saved step holds three items: ``state`` (draft params, optimizer state, step, RNG key), ``data`` (the
grain iterator's JSON state) and ``fingerprint`` (every setting that decides the model or the data order).
A resume whose fingerprint differs is refused with the differing keys named: continuing a run under another
block size, mask id or data order would silently train a different model. A latest checkpoint that cannot be
read (a crash mid-write on a filesystem without atomic rename, a damaged file) falls back to the previous one
with a warning.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from dflash_jax.models.config import ConfigError


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def fingerprint_differences(saved: dict, current: dict) -> list[str]:
    """Dotted keys whose values differ between two fingerprints (``key: saved -> current``)."""
    a, b = _flat(saved), _flat(current)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


class TrainCheckpoints:
    def __init__(self, directory: str | Path, keep: int = 3):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "data", "fingerprint"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, data_state: dict, fingerprint: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
            fingerprint=ocp.args.JsonSave(fingerprint)), force=True)
        self.manager.wait_until_finished()

    def restore_latest(self, abstract_state: Any, fingerprint: dict) -> tuple[int, Any, dict] | None:
        """``(step, state, data_state)`` of the newest readable checkpoint (``abstract_state`` carries the
        target shardings), or None when there is none. A changed fingerprint is a ConfigError."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        unreadable: list[int] = []
        for i, step in enumerate(steps):
            try:
                saved = self.manager.restore(step, args=ocp.args.Composite(fingerprint=ocp.args.JsonRestore()))
                saved_fp = saved["fingerprint"]
            except Exception as e:  # Orbax raises many types for a damaged step
                self._warn_fallback(step, e, steps[i + 1:])
                unreadable.append(step)
                continue
            diffs = fingerprint_differences(saved_fp, fingerprint)
            if diffs:
                raise ConfigError(
                    f"{self.directory}: cannot resume step {step}: the run settings changed ("
                    + "; ".join(diffs) + "). Use a new output.dir, or restore the settings.")
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
            except Exception as e:
                self._warn_fallback(step, e, steps[i + 1:])
                unreadable.append(step)
                continue
            self._set_aside(unreadable)
            return step, restored["state"], dict(restored["data"])
        if unreadable:
            raise ConfigError(f"{self.directory}: no checkpoint could be read (steps "
                              f"{', '.join(map(str, unreadable))}); move the folder aside to start over")
        return None

    def _set_aside(self, steps: list[int]) -> None:
        """Rename unreadable step directories out of Orbax's sight (kept for inspection, never deleted): the
        resumed run saves those steps again."""
        if not steps:
            return
        if jax.process_index() == 0:
            for step in steps:
                path = self.directory / str(step)
                if path.exists():
                    path.rename(path.with_name(f"{step}.unreadable-{int(time.time())}"))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("dflash_set_aside_checkpoints")
        self.manager.reload()

    def _warn_fallback(self, step: int, error: Exception, older: list[int]) -> None:
        where = f"falling back to step {older[0]}" if older else "starting from scratch"
        message = " ".join(str(error).split())[:300]
        warnings.warn(f"{self.directory}: checkpoint of step {step} is unreadable ({type(error).__name__}: "
                      f"{message}); {where}", stacklevel=3)

    def close(self) -> None:
        self.manager.close()


def abstract_like(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs with shardings: what ``StandardRestore`` restores into."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
