"""Load a target or a draft from whichever format a path holds (Hugging Face / official directory, or an
Orbax checkpoint of this project), plus the target's tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

from dflash_jax import sharding
from dflash_jax.checkpoints import orbax_io
from dflash_jax.checkpoints.hf_target import abstract_target_params, load_target, with_packed_experts
from dflash_jax.checkpoints.hub import TOKENIZER_FILES, resolve_checkpoint
from dflash_jax.checkpoints.official_draft import abstract_draft_params, load_draft
from dflash_jax.checkpoints.safetensors_io import CheckpointError, flatten
from dflash_jax.models.config import ConfigError, TargetConfig
from dflash_jax.models.draft_config import DraftConfig
from dflash_jax.precision import resolve_dtype

EXTRA_DIR = "hf_extra"  # tokenizer files kept inside an Orbax checkpoint by ``python -m infer convert``
# The non-weight files of a Hugging Face / official directory that travel with its weights (plus *.py
# modeling code of trust_remote_code checkpoints).
EXTRA_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


def _paths(paths: list[tuple[str, ...]]) -> str:
    return ", ".join("/".join(p) for p in paths[:3]) + (" ..." if len(paths) > 3 else "")


def check_params_match(params: Any, abstract: Any, where: str) -> None:
    """Restored params must have exactly the paths and shapes the config implies, so a checkpoint that does
    not fit its config is a clear error naming the param rather than a Flax shape error mid-run."""
    if not isinstance(params, dict):
        raise CheckpointError(f"{where}: expected a tree of parameter dicts")
    want = {k: tuple(v.shape) for k, v in flatten(abstract).items()}
    got = {k: tuple(np.shape(v)) for k, v in flatten(params).items()}
    missing, unexpected = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or unexpected:
        parts = (["missing " + _paths(missing)] if missing else []) + (
            ["unexpected " + _paths(unexpected)] if unexpected else [])
        raise CheckpointError(f"{where}: params do not match the config ({'; '.join(parts)})")
    for k in sorted(want):
        if want[k] != got[k]:
            raise CheckpointError(
                f"{where}: param {'/'.join(k)!r} has shape {list(got[k])}, expected {list(want[k])} from the config"
            )


def restore_orbax(path: str | Path, kind: str, dtype: Any = None) -> tuple[TargetConfig | DraftConfig, dict]:
    """An Orbax checkpoint of this project holding a ``kind`` ('target' or 'draft'), checked against the
    config stored in its ``meta.json``. ``dtype=None`` keeps the stored dtypes."""
    path = Path(path)
    meta = orbax_io.read_meta(path)
    if meta["kind"] != kind:
        raise CheckpointError(f"{path}: holds a {meta['kind']} checkpoint, but a {kind} was expected")
    if not isinstance(meta["config"], dict):
        raise CheckpointError(f"{path / orbax_io.META_FILE}: 'config' must be a JSON object")
    source = f"{path / orbax_io.META_FILE} [config]"
    if kind == "draft":
        config = DraftConfig.from_dict(meta["config"], source=source)
        abstract = abstract_draft_params(config)
    else:
        config = TargetConfig.from_dict(meta["config"], source=source)
        abstract = abstract_target_params(config)
    try:
        params, _ = orbax_io.restore_params(path, dtype=resolve_dtype(dtype) if dtype is not None else None)
    except (CheckpointError, ConfigError):
        raise
    except Exception as e:  # Orbax/TensorStore raise many types for a damaged store
        raise CheckpointError(f"{path / orbax_io.PARAMS_DIR}: cannot restore the Orbax params ({e})") from None
    check_params_match(params, abstract, str(path / orbax_io.PARAMS_DIR))
    return config, params


def load_target_any(path: str | Path, dtype: Any = "float32", progress: bool = False, mesh: Any = None,
                    missing: str = "--target", revision: str | None = None,
                    experts: str = "dequantize") -> tuple[TargetConfig, dict]:
    """A target from a Hugging Face directory, an Orbax checkpoint or a Hugging Face Hub id (at ``revision``;
    ``dflash_jax.checkpoints.hub``). With a ``mesh`` the params land in their rule shardings
    (``dflash_jax.sharding``): a Hugging Face directory is read tensor by tensor and each device receives only
    its slice (no full copy per device). ``missing`` names the argument in errors. ``experts``: quantised
    expert weights (MXFP4, FP8, INT4) decoded at load ("dequantize") or kept packed ("packed", Hugging Face
    directories only; ``hf_target.load_target``)."""
    path = resolve_checkpoint(path, revision, missing)
    if orbax_io.is_orbax_dir(path):
        if experts != "dequantize":
            raise CheckpointError(f"{path}: an Orbax checkpoint holds float experts; experts={experts!r} needs the "
                                  "released (quantised) Hugging Face directory")
        config, params = restore_orbax(path, "target", dtype)
        return config, params if mesh is None else jax.device_put(params, sharding.tree_shardings(params, mesh))
    if mesh is None:
        return load_target(path, dtype=dtype, progress=progress, experts=experts)
    if not path.is_dir():
        raise CheckpointError(f"{path}: target checkpoint directory not found ({missing})")
    # the shardings are needed before the tensors
    config = with_packed_experts(TargetConfig.from_json(path / "config.json"), experts, str(path))
    shardings = sharding.tree_shardings(abstract_target_params(config, resolve_dtype(dtype)), mesh)

    def place(param_path: tuple[str, ...], host: np.ndarray) -> jax.Array:
        s = shardings
        for k in param_path:
            s = s[k]
        return sharding.place(host, s)

    return load_target(path, dtype=dtype, progress=progress, place=place, experts=experts)


def load_draft_any(path: str | Path, dtype: Any = "float32", progress: bool = False, what: str = "--ckpt",
                   revision: str | None = None) -> tuple[DraftConfig, dict]:
    """A draft from an official directory, an Orbax checkpoint or a Hugging Face Hub id (at ``revision``)."""
    path = resolve_checkpoint(path, revision, what)
    if orbax_io.is_orbax_dir(path):
        return restore_orbax(path, "draft", dtype)
    return load_draft(path, dtype=dtype, progress=progress)


def tokenizer_dir(target_path: str | Path, revision: str | None = None, what: str = "--target") -> Path:
    """Where the tokenizer files of a target checkpoint live (of a Hub id: only those files are fetched)."""
    path = resolve_checkpoint(target_path, revision, what, TOKENIZER_FILES)
    if orbax_io.is_orbax_dir(path):
        return path / EXTRA_DIR
    return path


def load_tokenizer(path: str | Path, what: str = "--tokenizer"):
    """A transformers tokenizer from a directory or a Hugging Face Hub id (imported lazily: only the CLI needs
    it)."""
    from transformers import AutoTokenizer

    path = resolve_checkpoint(path, None, what, TOKENIZER_FILES)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise CheckpointError(f"{path}: no tokenizer files (tokenizer.json / tokenizer_config.json); pass --tokenizer")
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many types (JSON, protobuf, OS) for a broken tokenizer
        raise CheckpointError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {e})") from None

