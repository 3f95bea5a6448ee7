"""The tokenized cache (dflash_jax/data/token_cache.py): a second read of the same source is served from it,
every input it depends on invalidates it, and an interrupted write never leaves a file a later run would read."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dflash_jax.data.mixture as mixture
import dflash_jax.data.token_cache as token_cache
from cli_tiny import write_tokenizer
from dflash_jax.data.mixture import MixtureSettings, SourceConfig, read_source
from dflash_jax.data.tokenize import TokenizedData


@pytest.fixture
def tokenizer(tmp_path):
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path / "tok")
    return AutoTokenizer.from_pretrained(str(tmp_path / "tok"))


def write_rows(path, n: int, tag: str = "q"):
    rows = [{"instruction": f"{tag} {i}?", "output": f"answer {i}"} for i in range(n)]
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def same_rows(a: TokenizedData, b: TokenizedData) -> bool:
    return a.fingerprint() == b.fingerprint()


def test_second_read_comes_from_the_cache(tmp_path, tokenizer):
    source = SourceConfig(str(write_rows(tmp_path / "d.parquet", 12)))
    settings = MixtureSettings(sources=(source,), max_length=40, cache_dir=tmp_path / "cache")
    fresh, cached = read_source(source, settings, tokenizer)
    assert not cached and len(list((tmp_path / "cache").glob("*.npz"))) == 1
    again, cached = read_source(source, settings, tokenizer)
    assert cached and same_rows(fresh.data, again.data)
    np.testing.assert_array_equal(fresh.row_hashes, again.row_hashes)
    np.testing.assert_array_equal(fresh.full_lengths, again.full_lengths)
    assert (again.read, again.malformed) == (12, 0)


def test_every_input_invalidates_the_cache(tmp_path, tokenizer, monkeypatch):
    path = write_rows(tmp_path / "d.jsonl", 8)
    source = SourceConfig(str(path), columns={"prompt": "instruction", "response": "output"})
    base = MixtureSettings(sources=(source,), max_length=40, cache_dir=tmp_path / "cache")
    assert not read_source(source, base, tokenizer)[1]

    def cached(settings=base, src=source, tok=tokenizer) -> bool:
        return read_source(src, settings, tok)[1]

    assert cached()
    changes = {
        "max_length": lambda: cached(dataclasses.replace(base, max_length=30)),
        "chat template on/off": lambda: cached(dataclasses.replace(base, use_chat_template=False)),
        "thinking": lambda: cached(dataclasses.replace(base, enable_thinking=True)),
        "drop_unfinished": lambda: cached(dataclasses.replace(base, drop_unfinished=True)),
        "columns": lambda: cached(src=SourceConfig(str(path), columns={"prompt": "output", "response": "instruction"})),
    }
    for what, check in changes.items():
        assert not check(), what
    assert cached()  # the original settings still hit their own entry

    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}={{ m['content'] }}|{% endfor %}"
    assert not cached(), "chat template"
    tokenizer.chat_template = None
    tokenizer.add_tokens(["<extra>"])  # another vocabulary
    assert not cached(dataclasses.replace(base, use_chat_template=False)), "tokenizer vocabulary"

    monkeypatch.setattr(mixture, "LOSS_MASK_RULE", "another rule")
    assert not cached(dataclasses.replace(base, use_chat_template=False)), "loss-mask rule"
    monkeypatch.undo()

    from transformers import AutoTokenizer

    fresh = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert cached(tok=fresh)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched: same size, newer mtime
    assert not cached(tok=fresh), "mtime"
    write_rows(path, 9)  # new content
    rows, hit = read_source(source, base, fresh)
    assert not hit and rows.read == 9


def test_a_hub_revision_is_part_of_the_key(tmp_path, tokenizer, monkeypatch):
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "datasets--org--set"
    for revision in ("a" * 40, "b" * 40):
        (repo / "snapshots" / revision / "data").mkdir(parents=True)
        write_rows(repo / "snapshots" / revision / "data" / "train-00000-of-00001.parquet", 5, revision[0])
    (repo / "refs").mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    source = SourceConfig("hf:org/set")
    settings = MixtureSettings(sources=(source,), max_length=40, cache_dir=tmp_path / "cache")
    (repo / "refs" / "main").write_text("a" * 40)
    assert not read_source(source, settings, tokenizer)[1] and read_source(source, settings, tokenizer)[1]
    (repo / "refs" / "main").write_text("b" * 40)  # main moved to a new commit
    rows, hit = read_source(source, settings, tokenizer)
    assert not hit and rows.warnings == []


def test_an_interrupted_write_leaves_no_cache_file(tmp_path, tokenizer, monkeypatch):
    source = SourceConfig(str(write_rows(tmp_path / "d.jsonl", 6)))
    settings = MixtureSettings(sources=(source,), max_length=40, cache_dir=tmp_path / "cache")
    real_savez = np.savez

    def killed_midway(f, **arrays):
        f.write(b"PK\x03\x04 half of a zip")  # some bytes are out, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(token_cache.np, "savez", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        read_source(source, settings, tokenizer)
    assert list((tmp_path / "cache").iterdir()) == []  # neither a final file nor a leftover temporary one
    monkeypatch.setattr(token_cache.np, "savez", real_savez)
    rows, hit = read_source(source, settings, tokenizer)
    assert not hit and read_source(source, settings, tokenizer)[1]
    # A damaged entry (say, a disk that lost its tail) is rebuilt, not trusted.
    (entry,) = (tmp_path / "cache").glob("*.npz")
    entry.write_bytes(entry.read_bytes()[:100])
    again, hit = read_source(source, settings, tokenizer)
    assert not hit and again.data.fingerprint() == rows.data.fingerprint()
