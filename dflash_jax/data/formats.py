"""Training examples in the layouts people actually have, normalised to two types.

Rows come from JSONL, JSON-array, Parquet and Arrow files, directories, globs and Hub datasets
(:mod:`dflash_jax.data.sources`). Layouts (one object per row, for JSONL one per line, ``.gz`` allowed; blank
lines ignored; unknown extra keys ignored):

- ``{"messages": [{"role": ..., "content": ...}, ...]}`` (OpenAI / Hugging Face chat; an assistant message's
  ``thinking``, the field gpt-oss's template renders as its analysis channel, is kept)
- ``{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}`` (ShareGPT; ``role``/``content``
  inside are accepted too)
- ``{"prompt": ..., "response": ...}``: the prompt may be named ``instruction`` or ``question`` (an Alpaca
  ``input`` is appended to it after a blank line), the response ``completion``, ``output`` or ``answer``; an
  optional ``system`` string becomes a system message. The response may be missing: a prompt-only row is input
  for regeneration.
- ``{"text": ..., "prompt": ...}`` (``prompt`` optional): plain text, where everything after the prompt is
  trained.

The first three become a :class:`Conversation`, the last a :class:`PlainText`. A malformed row is skipped and
reported as ``path:line: reason`` (``path:row: reason`` for a row of a JSON array, Parquet or Arrow file) in
:attr:`ReadStats.warnings`, so one bad line in a million does not stop a
run; a file without a single usable row is a :class:`DataError`. A directory is read file by file in name
order, which is how a regeneration's output (``shard-00000.jsonl``, ...) is read back for training.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Union

# DataError, RowError, REGENERATE_SETTINGS and shard_path are re-exported: they have always been imported from here.
from dflash_jax.data.layout import (
    PROMPT_KEYS, REGENERATE_SETTINGS, RESPONSE_KEYS, ROLE_ALIASES, DataError, RowError, shard_path,
)
from dflash_jax.data.sources import parse_columns, resolve_source, source_rows


@dataclasses.dataclass(frozen=True)
class Conversation:
    """Messages ``{"role": "system"|"user"|"assistant", "content": str}`` (an assistant message may also hold
    ``"thinking"``: the reasoning a template such as gpt-oss's renders before the answer): an optional system message first,
    then user and assistant turns alternating, starting with a user turn. It may end with a user turn (a
    prompt not yet answered)."""

    messages: tuple[dict, ...]

    @property
    def has_answer(self) -> bool:
        return any(m["role"] == "assistant" for m in self.messages)


@dataclasses.dataclass(frozen=True)
class PlainText:
    """Plain text: ``prompt`` (possibly empty) is context, ``text`` (what follows it) is trained."""

    text: str
    prompt: str = ""


Example = Union[Conversation, PlainText]


@dataclasses.dataclass
class ReadStats:
    read: int = 0  # rows (non-blank lines of a JSONL file)
    skipped: int = 0  # malformed rows, each with a warning
    unfinished: int = 0  # regenerated rows with "finished": false, left out on request
    warnings: list[str] = dataclasses.field(default_factory=list)

    @property
    def kept(self) -> int:
        return self.read - self.skipped - self.unfinished


def _content(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise RowError(f"{what} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise RowError(f"{what} is empty")
    return value


def _message(raw: Any, index: int) -> dict:
    if not isinstance(raw, dict):
        raise RowError(f"message {index} is not an object")
    role = raw.get("role", raw.get("from"))
    content = raw.get("content", raw.get("value"))
    if not isinstance(role, str):
        raise RowError(f"message {index} has no 'role' (or 'from') string")
    if role.lower() not in ROLE_ALIASES:
        raise RowError(f"message {index} has unknown role {role!r} (expected one of {', '.join(ROLE_ALIASES)})")
    message = {"role": ROLE_ALIASES[role.lower()], "content": _content(content, f"message {index} content")}
    if "thinking" in raw and message["role"] == "assistant":  # gpt-oss's analysis channel, as its template takes it
        message["thinking"] = _content(raw["thinking"], f"message {index} 'thinking'")
    return message


def check_turn_order(messages: list[dict]) -> None:
    """An optional system message first, then user/assistant alternating from a user turn: the shape every
    chat template accepts and the one regeneration needs (each user turn gets exactly one answer)."""
    turns = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if not turns:
        raise RowError("no user message")
    for i, m in enumerate(turns):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            index = i + len(messages) - len(turns)
            raise RowError(f"message {index} is {m['role']!r} where {expected!r} was expected (an optional system "
                           "message first, then user and assistant turns alternating)")


def conversation_of(raw_messages: Any, key: str) -> Conversation:
    if not isinstance(raw_messages, list) or not raw_messages:
        raise RowError(f"'{key}' must be a non-empty list")
    messages = [_message(m, i) for i, m in enumerate(raw_messages)]
    check_turn_order(messages)
    return Conversation(tuple(messages))


def parse_row(row: Any) -> Example:
    """One JSON value -> an example, or :class:`RowError` saying why not."""
    if not isinstance(row, dict):
        raise RowError(f"expected a JSON object, got {type(row).__name__}")
    for key in ("messages", "conversations"):
        if key in row:
            return conversation_of(row[key], key)
    if "text" in row:
        prompt = row.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise RowError(f"'prompt' must be a string, got {type(prompt).__name__}")
        return PlainText(_content(row["text"], "'text'"), prompt or "")
    prompt_key = next((k for k in PROMPT_KEYS if k in row), None)
    if prompt_key is None:
        raise RowError("unknown layout: expected 'messages', 'conversations', 'text' or a prompt field ("
                       + ", ".join(PROMPT_KEYS) + ")")
    prompt = _content(row[prompt_key], f"'{prompt_key}'")
    extra = row.get("input")
    if extra is not None:
        if not isinstance(extra, str):
            raise RowError(f"'input' must be a string, got {type(extra).__name__}")
        if extra.strip():
            prompt = f"{prompt}\n\n{extra}"
    messages = []
    if row.get("system") is not None:
        messages.append({"role": "system", "content": _content(row["system"], "'system'")})
    messages.append({"role": "user", "content": prompt})
    response_key = next((k for k in RESPONSE_KEYS if row.get(k) is not None), None)
    if response_key is not None:
        messages.append({"role": "assistant", "content": _content(row[response_key], f"'{response_key}'")})
    return Conversation(tuple(messages))


def example_to_row(example: Example) -> dict:
    """The JSON row of an example, in a layout :func:`parse_row` reads back to an equal example."""
    if isinstance(example, Conversation):
        return {"messages": [dict(m) for m in example.messages]}
    return {"prompt": example.prompt, "text": example.text} if example.prompt else {"text": example.text}


def data_files(path: str | Path) -> list[Path]:
    """The data files of a source (a file, a directory, a glob or ``hf:ORG/NAME[:CONFIG[:SPLIT]]``; see
    :mod:`dflash_jax.data.sources`)."""
    return list(resolve_source(path).files)


def read_examples(path: str | Path, limit: int | None = None, drop_unfinished: bool = False,
                  columns: dict[str, str] | str | None = None, files: list[Path] | None = None
                  ) -> tuple[list[Example], ReadStats]:
    """All usable examples of a source (a JSONL, JSON-array, Parquet or Arrow file, a directory such as a
    regeneration's output, a glob, or a Hub dataset ``hf:ORG/NAME[:CONFIG[:SPLIT]]``; see
    :mod:`dflash_jax.data.sources`), the first ``limit`` if given, and what was skipped and why.
    ``drop_unfinished`` leaves out the rows a regeneration marked ``"finished": false`` (an answer cut at
    max_new_tokens). ``columns`` renames columns to layout fields (``prompt=instruction,response=output``).
    ``files``: the source's files when already resolved."""
    mapping = parse_columns(columns)
    examples: list[Example] = []
    stats = ReadStats()
    for file in data_files(path) if files is None else files:
        if limit is not None and len(examples) >= limit:
            break
        for number, row in source_rows(Path(file), mapping):
            if limit is not None and len(examples) >= limit:
                break
            stats.read += 1
            try:
                if isinstance(row, RowError):
                    raise row
                example = parse_row(row)
                if drop_unfinished and row.get("finished") is False:
                    stats.unfinished += 1
                    continue
                examples.append(example)
            except RowError as e:
                stats.skipped += 1
                stats.warnings.append(f"{file}:{number}: {e}")
    if not examples:
        detail = f" ({stats.skipped} malformed, first: {stats.warnings[0]})" if stats.warnings else ""
        if stats.unfinished:
            detail += f" ({stats.unfinished} unfinished rows left out: drop_unfinished)"
        raise DataError(f"{path}: no usable rows{detail}")
    return examples, stats

