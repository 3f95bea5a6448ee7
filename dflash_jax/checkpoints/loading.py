"""Load a target or a draft from whichever format a path holds (Hugging Face / official directory, or an
Orbax checkpoint of this project), plus the target's tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax

from dflash_jax.checkpoints import orbax_io
from dflash_jax.checkpoints.hf_target import load_target, resolve_dtype
from dflash_jax.checkpoints.official_draft import load_draft
from dflash_jax.checkpoints.safetensors_io import CheckpointError
from dflash_jax.models.config import TargetConfig
from dflash_jax.models.draft_config import DraftConfig

EXTRA_DIR = "hf_extra"  # tokenizer files kept inside an Orbax checkpoint by ``python -m infer convert``


def _restore(path: Path, kind: str, dtype: Any) -> tuple[dict, dict]:
    params, meta = orbax_io.restore_params(path, dtype=dtype)
    if meta["kind"] != kind:
        raise CheckpointError(f"{path}: holds a {meta['kind']} checkpoint, but a {kind} was expected")
    return params, meta


def load_target_any(path: str | Path, dtype: Any = "float32", progress: bool = False) -> tuple[TargetConfig, dict]:
    path = Path(path)
    if orbax_io.is_orbax_dir(path):
        params, meta = _restore(path, "target", resolve_dtype(dtype))
        return TargetConfig.from_dict(meta["config"], source=str(path / orbax_io.META_FILE)), params
    return load_target(path, dtype=dtype, progress=progress)


def load_draft_any(path: str | Path, dtype: Any = "float32", progress: bool = False) -> tuple[DraftConfig, dict]:
    path = Path(path)
    if orbax_io.is_orbax_dir(path):
        params, meta = _restore(path, "draft", resolve_dtype(dtype))
        return DraftConfig.from_dict(meta["config"], source=str(path / orbax_io.META_FILE)), params
    return load_draft(path, dtype=dtype, progress=progress)


def tokenizer_dir(target_path: str | Path) -> Path:
    """Where the tokenizer files of a target checkpoint live."""
    path = Path(target_path)
    if orbax_io.is_orbax_dir(path):
        return path / EXTRA_DIR
    return path


def load_tokenizer(path: str | Path):
    """A transformers tokenizer from a directory (imported lazily: only the CLI needs it)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise CheckpointError(f"{path}: no tokenizer files (tokenizer.json / tokenizer_config.json); pass --tokenizer")
    return AutoTokenizer.from_pretrained(str(path))


def cast(params: Any, dtype: Any) -> Any:
    dtype = resolve_dtype(dtype)
    return jax.tree.map(lambda a: a.astype(dtype), params)
