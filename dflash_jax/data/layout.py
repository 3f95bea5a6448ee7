"""Names the data readers share: the row layouts' field names, the two data errors, and the file names of a
regeneration output directory. A leaf module, so that the row parser (:mod:`dflash_jax.data.formats`) and the
file readers (:mod:`dflash_jax.data.sources`) can both import it without importing each other in a cycle."""

from __future__ import annotations

from pathlib import Path

from dflash_jax.errors import UserError

ROLE_ALIASES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}
PROMPT_KEYS = ("prompt", "instruction", "question")
RESPONSE_KEYS = ("response", "completion", "output", "answer")
# Every field a layout reads from a row: the names a column mapping (--columns) may give a column.
LAYOUT_FIELDS = ("messages", "conversations", "text", "system", "input") + PROMPT_KEYS + RESPONSE_KEYS
REGENERATE_SETTINGS = "regenerate.json"  # written by dflash_jax.data.regenerate next to its shards


class DataError(UserError):
    """A data problem the user can fix; the message names the file (and the line for a row)."""


class RowError(ValueError):
    """Why one row is unusable (internal: becomes a ``path:line: reason`` warning)."""


def shard_path(out_dir: Path, index: int) -> Path:
    """Shard ``index`` of a regeneration output directory."""
    return Path(out_dir) / f"shard-{index:05d}.jsonl"
