"""Hugging Face Hub ids wherever a checkpoint path is taken: ``--target Qwen/Qwen3-8B``.

A string names a Hub model only when nothing of that name exists locally and it has the Hub's ``org/name``
form (huggingface_hub's own check), so a local directory always wins over an id of the same spelling. The
model goes through huggingface_hub's own cache: ``HF_HOME`` / ``HF_HUB_CACHE`` say where it lives, and
``HF_HUB_OFFLINE=1`` reads the cache without touching the network. Online, only what this project reads is
fetched (configs, tokenizer files, safetensors; never pickle weights), with huggingface_hub's progress bars.
huggingface_hub is imported inside the functions, so the package imports without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from dflash_jax.checkpoints.safetensors_io import CheckpointError

# A target or draft directory: configs and the shard index (*.json), the weights, the tokenizer (SentencePiece
# model, chat template, BPE merges / WordPiece vocab), and the modeling code official drafts ship for
# trust_remote_code loaders (never run here; 'infer convert' carries it along). Pickle (*.bin, *.pt, *.pth)
# and other frameworks' weights (*.h5, *.msgpack, *.gguf, ...) match none of these.
CHECKPOINT_FILES = ("*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt", "*.py")
TOKENIZER_FILES = ("*.json", "tokenizer.model", "*.jinja", "*.txt")
CONFIG_FILES = ("config.json",)
# The loaders read the repository's top level only (shards are bare names next to their index), so
# subfolders (original/, onnx/, ...) are never fetched.
SKIPPED = ("*/*",)


def is_hub_id(text: str) -> bool:
    """``org/name`` as huggingface_hub validates repository ids (a bare ``name`` is not taken: it reads as a
    local path)."""
    if text.count("/") != 1:
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def resolve_checkpoint(path_or_id: str | Path, revision: str | None = None, what: str = "--target",
                       files: Sequence[str] = CHECKPOINT_FILES) -> Path:
    """The local directory of ``path_or_id``: the path itself when it exists, else the cached snapshot of that
    Hub model at ``revision`` (a branch, tag or commit; default main), fetching the files matching ``files``
    first when online. ``what`` names the argument in errors."""
    text = str(path_or_id)
    path = Path(path_or_id)
    if path.exists():
        if revision is not None:
            raise CheckpointError(f"{what} {text}: is a local path, so revision {revision!r} cannot apply (a "
                                  "revision selects a version of a Hugging Face Hub model)")
        return path
    if not is_hub_id(text):
        return path  # the loaders' own 'not found' errors name it
    return Path(_snapshot(text, revision, what, files))


def _snapshot(repo_id: str, revision: str | None, what: str, files: Sequence[str]) -> str:
    import httpx
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
    )

    named = f"{what} {repo_id}" + (f" (revision {revision})" if revision else "")
    cache = constants.HF_HUB_CACHE
    try:
        # Offline, say so up front: huggingface_hub would otherwise try the network for a commit-hash revision.
        return snapshot_download(repo_id, revision=revision, allow_patterns=list(files), ignore_patterns=list(SKIPPED),
                                 local_files_only=constants.is_offline_mode())
    except RevisionNotFoundError:
        raise CheckpointError(f"{what} {repo_id}: the Hugging Face Hub has no revision {revision!r} of it") from None
    except GatedRepoError:
        raise CheckpointError(f"{named}: the Hugging Face Hub model is gated; accept its terms on its page and "
                              "log in ('hf auth login' or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{named}: no such local path, and no Hugging Face Hub model of that name (a private "
                              "model needs 'hf auth login' or HF_TOKEN)") from None
    except LocalEntryNotFoundError as e:  # not (completely) in the cache, and the Hub was not asked
        if constants.is_offline_mode():
            raise CheckpointError(f"{named}: no such local path, and the Hugging Face Hub model is not in the cache "
                                  f"{cache} (or only in part) while HF_HUB_OFFLINE is set; download it once with "
                                  "network access, or pass a local directory") from None
        cause = e.__cause__ or e
        raise CheckpointError(f"{named}: no such local path, not in the Hugging Face cache {cache} (or only in part), "
                              f"and the Hub cannot be reached ({type(cause).__name__}: {cause})") from None
    except (HfHubHTTPError, httpx.HTTPError, OSError) as e:  # a server error, a connection lost midway, a full disk
        raise CheckpointError(f"{named}: cannot fetch it from the Hugging Face Hub into {cache} "
                              f"({type(e).__name__}: {e})") from None
