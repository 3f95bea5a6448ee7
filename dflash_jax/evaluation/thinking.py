"""The thinking mode a draft was trained in, against the one prompts are rendered in.

The most common complaint about DFlash drafts is low acceptance from a thinking-mode mismatch: a draft trained
on answers generated with thinking off (the released recipe) proposes badly after a prompt rendered with
thinking on (the model then writes a reasoning block the draft never saw), and the other way round. ``train
fit`` records the training data's mode in the exported draft's config (``dflash_training_data``, from
``data.enable_thinking`` and the regeneration's settings); ``python -m infer`` and ``infer bench`` warn once
when they render prompts in the other mode. Drafts without the record (the released ones) are not checked.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from dflash_jax.checkpoints import orbax_io
from dflash_jax.data.regenerate import TRAINING_DATA_KEY
from dflash_jax.errors import ServingWarning


def draft_training_data(path: str | Path) -> dict | None:
    """The ``dflash_training_data`` record of a draft directory (official layout or Orbax), or None."""
    path = Path(path)
    try:
        if orbax_io.is_orbax_dir(path):
            config = orbax_io.read_meta(path)["config"]
        elif (path / "config.json").is_file():
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        else:
            return None
    except (OSError, ValueError):  # the loader reports an unreadable config; this check only reads a record
        return None
    record = config.get(TRAINING_DATA_KEY) if isinstance(config, dict) else None
    return record if isinstance(record, dict) and isinstance(record.get("enable_thinking"), bool) else None


def thinking_mismatch(record: dict | None, enable_thinking: bool, templated: bool) -> str | None:
    """Why prompts rendered with ``enable_thinking`` (through a chat template when ``templated``) do not
    match a draft trained as ``record`` says, or None when they do (or nothing is known)."""
    if record is None or not templated or not record.get("use_chat_template", True):
        return None
    trained = record["enable_thinking"]
    if trained == bool(enable_thinking):
        return None
    on_off = {True: "on", False: "off"}
    return (f"the draft was trained on data with thinking {on_off[trained]} (its config's {TRAINING_DATA_KEY}), "
            f"but these prompts are rendered with thinking {on_off[bool(enable_thinking)]}: acceptance drops where "
            f"the modes differ; {'add' if trained else 'leave out'} --thinking to render them as in training")


def warn_thinking_mismatch(draft_path: str | Path | None, tokenizer: Any, use_chat_template: bool,
                           enable_thinking: bool) -> str | None:
    """Warn (once: call it once per command) when the prompts' thinking mode is not the draft's; returns the
    message, if any."""
    if draft_path is None:
        return None
    templated = bool(use_chat_template and getattr(tokenizer, "chat_template", None))
    message = thinking_mismatch(draft_training_data(draft_path), enable_thinking, templated)
    if message:
        warnings.warn(message, ServingWarning, stacklevel=2)
    return message
