"""Parameters <-> Orbax checkpoints.

An Orbax checkpoint written here is a directory with ``params/`` (Orbax's array store) and ``meta.json``
naming what it holds (``kind``: ``target`` or ``draft``) and the Hugging Face style config it was built from,
so that a directory alone is enough to rebuild the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

from dflash_jax.checkpoints.safetensors_io import CheckpointError
from dflash_jax.models.config import read_json_object

META_FILE = "meta.json"
PARAMS_DIR = "params"


def is_orbax_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path / META_FILE).is_file() and (path / PARAMS_DIR).is_dir()


def save_params(path: str | Path, params: Mapping[str, Any], kind: str, config: Mapping[str, Any],
                write_meta: bool = True) -> Path:
    """Save ``params`` (any pytree of arrays) with its config; the parent directory is created. With several
    processes every one calls this (Orbax saves collectively) and only one passes ``write_meta``."""
    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / PARAMS_DIR, params, force=True)
    if write_meta:
        (path / META_FILE).write_text(json.dumps({"kind": kind, "config": dict(config)}, indent=2))
    return path


def read_meta(path: str | Path) -> dict:
    path = Path(path)
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"{path}: not an Orbax checkpoint of this project (no {META_FILE})")
    meta = read_json_object(meta_path, "checkpoint metadata", CheckpointError)
    if "kind" not in meta or "config" not in meta:
        raise CheckpointError(f"{meta_path}: expected keys 'kind' and 'config'")
    return meta


def restore_params(path: str | Path, dtype: Any = None) -> tuple[dict, dict]:
    """Return ``(params, meta)``; arrays come back as stored, or cast to ``dtype``."""
    path = Path(path).absolute()
    meta = read_meta(path)
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(path / PARAMS_DIR)
    for leaf_path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if not jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating):  # a cast would hide a wrong checkpoint
            raise CheckpointError(f"{path}: parameter {jax.tree_util.keystr(leaf_path)} is stored as {leaf.dtype}; "
                                  "weights must be floating point")
    if dtype is not None:
        params = jax.tree.map(lambda a: jax.numpy.asarray(a, dtype), params)
    else:
        params = jax.tree.map(jax.numpy.asarray, params)
    return params, meta


def trees_equal(a: Any, b: Any) -> bool:
    """Bit-exact comparison of two pytrees (structure, dtypes, shapes and bytes)."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            return False
    return True
