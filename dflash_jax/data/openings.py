"""Prompt sets made of openings the target wrote itself, split into training and held-out prompts.

For a base model without a chat template (stories260K), good prompts are the beginnings of its own texts:
``regenerate`` samples short continuations of a few starter words (temperature 1 gives variety), and this module
turns them into prompts. The held-out prompts are chosen so that no training prompt starts with one of them and
none of them starts with a training prompt: a held-out evaluation then never replays a training row's start.
"""

from __future__ import annotations

import random
from pathlib import Path

from dflash_jax.data.formats import Conversation, DataError, PlainText, read_examples
from dflash_jax.fileio import atomic_write


def opening_text(example) -> str:
    """Prompt + the target's continuation of it, as one opening."""
    if isinstance(example, PlainText):
        return (example.prompt + example.text).strip()
    if isinstance(example, Conversation):
        return "".join(m["content"] for m in example.messages if m["role"] != "system").strip()
    raise TypeError(type(example).__name__)


def split_openings(openings: list[str], held_out: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """``(training, held_out)`` prompts: distinct openings in a seeded random order, ``held_out`` of them kept
    aside, and every training opening that is a prefix of a held-out one (or the reverse) dropped."""
    distinct = sorted(set(o for o in openings if o))
    if held_out >= len(distinct):
        raise DataError(f"{len(distinct)} distinct openings cannot give {held_out} held-out prompts and any for "
                        "training")
    random.Random(seed).shuffle(distinct)
    held = distinct[:held_out]
    train = [o for o in distinct[held_out:] if not any(o.startswith(h) or h.startswith(o) for h in held)]
    return train, held


def write_prompts(path: str | Path, prompts: list[str]) -> None:
    import json

    with atomic_write(path) as f:
        f.write("".join(json.dumps({"prompt": p}) + "\n" for p in prompts).encode())


def make_opening_prompts(source: str | Path, out_dir: str | Path, held_out: int, seed: int = 0,
                         columns: str | dict | None = None) -> dict:
    """Read regenerated openings from ``source`` (a regenerate output directory or any source of
    :mod:`dflash_jax.data.sources`, ``columns`` renamed) and write ``train-openings.jsonl`` and ``heldout.jsonl``
    into ``out_dir``."""
    examples, stats = read_examples(source, columns=columns)
    train, held = split_openings([opening_text(e) for e in examples], held_out, seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_prompts(out_dir / "train-openings.jsonl", train)
    write_prompts(out_dir / "heldout.jsonl", held)
    return {"read": len(examples), "skipped": stats.skipped, "train": len(train), "held_out": len(held)}
