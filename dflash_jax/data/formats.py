"""Training examples read from JSONL files in the layouts people actually have, normalised to two types.

Layouts (one JSON object per line, ``.gz`` allowed; blank lines ignored; unknown extra keys ignored):

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
reported as ``path:line: reason`` in :attr:`ReadStats.warnings`, so one bad line in a million does not stop a
run; a file without a single usable row is a :class:`DataError`. A directory is read file by file in name
order, which is how a regeneration's output (``shard-00000.jsonl``, ...) is read back for training.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import zlib
from pathlib import Path
from typing import Any, Iterator, Union

from dflash_jax.errors import UserError

ROLE_ALIASES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}
PROMPT_KEYS = ("prompt", "instruction", "question")
RESPONSE_KEYS = ("response", "completion", "output", "answer")
REGENERATE_SETTINGS = "regenerate.json"  # written by dflash_jax.data.regenerate next to its shards


class DataError(UserError):
    """A data problem the user can fix; the message names the file (and the line for a row)."""


class RowError(ValueError):
    """Why one row is unusable (internal: becomes a ``path:line: reason`` warning)."""


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
    read: int = 0  # non-blank lines
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


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, raw bytes) of every line, streamed: a dataset may not fit comfortably in memory twice."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            yield from enumerate(f, start=1)
    except (OSError, EOFError, zlib.error) as e:  # includes a truncated, corrupt or non-gzip .gz file
        raise DataError(f"{path}: cannot read ({e})") from None


def data_files(path: Path) -> list[Path]:
    """The JSONL files of ``path``: the file itself, or a directory's ``*.jsonl`` / ``*.jsonl.gz`` in name
    order. A regeneration output directory must be complete: a missing shard would silently drop data."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"{path}: data file not found")
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith((".jsonl", ".jsonl.gz")))
    settings_path = path / REGENERATE_SETTINGS
    if settings_path.is_file():
        try:
            settings = json.loads(settings_path.read_text(encoding="utf-8"))
            expected = -(-int(settings["num_examples"]) // int(settings["shard_size"]))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise DataError(f"{settings_path}: cannot read ({type(e).__name__}: {e})") from None
        missing = [shard_path(path, k).name for k in range(expected) if not shard_path(path, k).is_file()]
        if missing:
            raise DataError(f"{path}: the regeneration is incomplete ({len(missing)} of {expected} shards missing, "
                            f"first {missing[0]}); rerun the same regenerate command to finish it")
    if not files:
        raise DataError(f"{path}: no .jsonl or .jsonl.gz files in the directory")
    return files


def read_examples(path: str | Path, limit: int | None = None, drop_unfinished: bool = False
                  ) -> tuple[list[Example], ReadStats]:
    """All usable examples of a JSONL file, or of every JSONL file of a directory such as a regeneration's
    output (the first ``limit`` if given), and what was skipped and why. ``drop_unfinished`` leaves out the
    rows a regeneration marked ``"finished": false`` (an answer cut at max_new_tokens)."""
    path = Path(path)
    examples: list[Example] = []
    stats = ReadStats()
    for file in data_files(path):
        if limit is not None and len(examples) >= limit:
            break
        for lineno, raw in _lines(file):
            if limit is not None and len(examples) >= limit:
                break
            if not raw.strip():
                continue
            stats.read += 1
            try:
                row = _json_row(raw)
                example = parse_row(row)
                if drop_unfinished and row.get("finished") is False:
                    stats.unfinished += 1
                    continue
                examples.append(example)
            except RowError as e:
                stats.skipped += 1
                stats.warnings.append(f"{file}:{lineno}: {e}")
    if not examples:
        detail = f" ({stats.skipped} malformed, first: {stats.warnings[0]})" if stats.warnings else ""
        if stats.unfinished:
            detail += f" ({stats.unfinished} unfinished rows left out: drop_unfinished)"
        raise DataError(f"{path}: no usable rows{detail}")
    return examples, stats


def _json_row(raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise RowError(f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise RowError(f"not valid JSON ({e.msg} at column {e.colno})") from None


def shard_path(out_dir: Path, index: int) -> Path:
    """Shard ``index`` of a regeneration output directory."""
    return Path(out_dir) / f"shard-{index:05d}.jsonl"
