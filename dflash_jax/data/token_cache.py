"""A cache of tokenized sources, so that a second ``train fit`` over the same data skips reading and
tokenizing it.

One cache file per source, named by the sha256 of everything that determines its content: the source's
identity (each file's resolved path, size and modification time, or a Hub dataset's commit and files), the
column mapping, ``drop_unfinished``, the tokenizer (its full vocabulary and merges, special tokens and chat
template), whether the template is used and with thinking on, ``max_length`` and the loss-mask rule
(:data:`dflash_jax.data.tokenize.LOSS_MASK_RULE`). Any change gives another name, so a stale file is never
read (the key is also stored in the file and compared on load). Rows are cached per source before the
mixture's filters and sampling: those are cheap, and changing weights, limits or the seed reuses the cache.

A file is written under a temporary name unique to the writer and renamed when complete: an interrupted write
(an exception, Ctrl-C, ``kill -9``) leaves no file under the final name, and two processes writing the same
entry (several hosts on a shared file system) each rename a complete file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from dflash_jax.data.tokenize import TokenizedData

CACHE_FORMAT = 1
PARTIAL_TAG = ".partial-"
MAX_WARNINGS_KEPT = 20  # malformed-row warnings stored with a cache entry (shown again on a cache hit)


ENV = "DFLASH_JAX_DATA_CACHE"  # a directory for the cache (as DFLASH_JAX_COMPILE_CACHE for compiled programs)


def default_cache_dir() -> Path:
    """``$DFLASH_JAX_DATA_CACHE`` when set, else ``$XDG_CACHE_HOME/dflash_jax/tokenized`` (``~/.cache/...``
    when unset), beside the compiled-program cache of :mod:`dflash_jax.compile_cache`."""
    if os.environ.get(ENV, "").strip():
        return Path(os.environ[ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dflash_jax" / "tokenized"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of what decides a tokenizer's output: its vocabulary and model (the fast tokenizer's full JSON, or
    a slow one's vocabulary and SentencePiece model), special and added tokens, and chat template."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode())
        sp_model = getattr(tokenizer, "sp_model", None)
        if sp_model is not None and hasattr(sp_model, "serialized_model_proto"):
            h.update(sp_model.serialized_model_proto())
    extras = {
        "chat_template": getattr(tokenizer, "chat_template", None),
        "bos": getattr(tokenizer, "bos_token_id", None),
        "eos": getattr(tokenizer, "eos_token_id", None),
        "specials": sorted(str(t) for t in (getattr(tokenizer, "all_special_tokens", ()) or ())),
        "added": sorted((str(k), int(v)) for k, v in (getattr(tokenizer, "get_added_vocab", dict)() or {}).items()),
    }
    h.update(json.dumps(extras, sort_keys=True, ensure_ascii=False, default=str).encode())
    return h.hexdigest()


def cache_key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()


@dataclasses.dataclass
class SourceRows:
    """One source read and tokenized: its rows with a trained token, each row's hash of its normalised turns
    (for removing duplicates across sources) and its length before the cut at ``max_length``, and the counts
    of what was left out on the way."""

    data: TokenizedData  # rows with at least one trained token, in the source's order
    row_hashes: np.ndarray  # [N, 16] uint8
    full_lengths: np.ndarray  # [N] int64: tokens before the cut at max_length
    read: int  # rows in the files
    malformed: int  # rows that could not be read (each with a warning)
    unfinished: int  # regenerated rows with "finished": false, left out (data.drop_unfinished)
    warnings: list[str] = dataclasses.field(default_factory=list)

    @property
    def parsed(self) -> int:
        return self.read - self.malformed - self.unfinished

    @property
    def without_targets(self) -> int:
        return self.data.num_without_targets


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """A temporary path to write; renamed to ``path`` when the block succeeds, removed when it fails. The
    temporary name is unique to this writer (process id and a random part)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{PARTIAL_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_source_rows(path: Path, rows: SourceRows, key: dict) -> None:
    meta = {"key": key, "read": rows.read, "malformed": rows.malformed, "unfinished": rows.unfinished,
            "warnings": rows.warnings[:MAX_WARNINGS_KEPT], "format": CACHE_FORMAT}
    with atomic_file(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, ids=rows.data.ids, mask=rows.data.mask, offsets=rows.data.offsets,
                     max_length=np.int64(rows.data.max_length), num_truncated=np.int64(rows.data.num_truncated),
                     num_without_targets=np.int64(rows.data.num_without_targets), row_hashes=rows.row_hashes,
                     full_lengths=rows.full_lengths, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))


def load_source_rows(path: Path, key: dict) -> SourceRows | None:
    """The cached rows of ``key``, or None when there are none (or the file is unreadable or for another key:
    a cache never fails a run, it is only rebuilt)."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(z["meta"].tobytes().decode())
            if meta.get("format") != CACHE_FORMAT or meta.get("key") != json.loads(json.dumps(key, default=str)):
                return None
            data = TokenizedData(z["ids"], z["mask"], z["offsets"], int(z["max_length"]), int(z["num_truncated"]),
                                 int(z["num_without_targets"]))
            return SourceRows(data, z["row_hashes"], z["full_lengths"], int(meta["read"]), int(meta["malformed"]),
                              int(meta["unfinished"]), warnings=list(meta["warnings"]))
    except Exception as e:  # a truncated or foreign file (zipfile, numpy, JSON and OS errors): rebuild it
        print(f"warning: {path}: unreadable tokenized cache entry, rebuilding it ({type(e).__name__}: {e})")
        return None
