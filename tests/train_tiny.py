"""Shared pieces of the trainer tests: a tiny tokenized dataset and a run config for the tiny target."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dflash_jax.data.tokenize import TokenizedData
from dflash_jax.training.run_config import parse_run_config

STEP_KW = dict(block_size=8, gamma=4.0, mask_token_id=96, num_anchors=6, anchor_chunk=4)


def tiny_tokenized(rows: int = 16, length: int = 40, seed: int = 0) -> TokenizedData:
    """Random token rows of different lengths with a short untrained prompt, as the tokenizer would give."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 96, (rows, length)).astype(np.int32)
    lengths = rng.integers(length // 2, length + 1, rows).astype(np.int32)
    loss_mask = np.zeros((rows, length), bool)
    for i in range(rows):
        loss_mask[i, rng.integers(2, 6):lengths[i]] = True
        tokens[i, lengths[i]:] = 0
    return TokenizedData.from_padded(tokens, loss_mask, lengths)


def write_text_rows(path: Path, rows: int = 24, seed: int = 0) -> Path:
    """Plain-text JSONL rows for the tiny character tokenizer (tests/cli_tiny.py)."""
    rng = np.random.default_rng(seed)
    letters = list("abcdefghij ")
    with path.open("w") as f:
        for _ in range(rows):
            text = "".join(rng.choice(letters, size=int(rng.integers(20, 40))))
            f.write(json.dumps({"prompt": "ab", "text": text}) + "\n")
    return path


def tiny_run_config(target_dir: Path, out_dir: Path, train_file: str = "unused.jsonl", **sections) -> dict:
    raw = {"target": {"path": str(target_dir)}, "data": {"train": train_file, "max_length": 40},
           "draft": {"num_layers": 2, "block_size": 8, "target_layer_ids": [0, 2]},
           "train": {"epochs": 1, "global_batch": 8, "num_anchors": 6, "anchor_chunk": 4},
           "output": {"dir": str(out_dir), "log_every": 1}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return parse_run_config(raw, "test run config")
