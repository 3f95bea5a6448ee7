"""Mixtures of training sources (dflash_jax/data/mixture.py): weighted draws within the multinomial spread,
identical across runs and after a resume mid-mixture, duplicates removed across sources and layouts, length
filters, max_samples and limit, per-source counts, and the old data.train forms giving exactly their old rows."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cli_tiny import write_tokenizer
from dflash_jax.data.formats import DataError, read_examples
from dflash_jax.data.mixture import (
    MixtureSettings, SourceConfig, mix, prepare_training_data, read_source, settings_of,
)
from dflash_jax.data.pipeline import BatchIterator, make_dataset
from dflash_jax.data.tokenize import tokenize_examples
from dflash_jax.training.run_config import parse_run_config


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("chartok")
    write_tokenizer(out)
    return AutoTokenizer.from_pretrained(str(out))


def qa(i: int, tag: str) -> tuple[str, str]:
    return f"{tag} question {i}?", f"answer {i} " + "x" * (i % 7)


@pytest.fixture(scope="module")
def three_sources(tmp_path_factory):
    """A JSONL file of messages (40 rows), a Parquet file of ShareGPT conversations (25) and an Arrow file of
    prompt/response rows (10), all distinct."""
    root = tmp_path_factory.mktemp("sources")
    a = root / "a.jsonl"
    a.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": r}]})
                         + "\n" for q, r in (qa(i, "a") for i in range(40))))
    b = root / "b.parquet"
    pq.write_table(pa.Table.from_pylist([{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": r}]}
                                         for q, r in (qa(i, "b") for i in range(25))]), b)
    c = root / "c.arrow"
    table = pa.Table.from_pylist([{"prompt": q, "response": r} for q, r in (qa(i, "c") for i in range(10))])
    with pa.OSFile(str(c), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return [str(a), str(b), str(c)]


def settings(paths, weights=(None, None, None), **kw) -> MixtureSettings:
    sources = tuple(SourceConfig(p, w) for p, w in zip(paths, weights))
    return MixtureSettings(sources=sources, **{"max_length": 64, "dedup": True, **kw})


def test_weighted_counts_follow_the_multinomial_over_many_seeds(three_sources, tokenizer):
    base = settings(three_sources, weights=(1.0, 2.0, 3.0), limit=300)
    rows = [read_source(s, base, tokenizer)[0] for s in base.sources]
    p = np.array([1, 2, 3]) / 6
    counts = []
    for seed in range(40):
        data, report = mix(base.sources, rows, dataclasses.replace(base, seed=seed))
        assert len(data) == 300
        counts.append([c["selected"] for c in report["sources"]])
    counts = np.array(counts)
    sigma = np.sqrt(300 * p * (1 - p))
    assert np.all(np.abs(counts - 300 * p) <= 4.5 * sigma), counts  # every seed within the spread
    assert np.all(np.abs(counts.mean(0) - 300 * p) <= 4 * sigma / np.sqrt(len(counts)))  # unbiased
    assert np.all(counts.std(0) > 0.3 * sigma)  # and it does vary with the seed
    # The small source (10 rows) supplies ~150: every row of it repeats, each round a fresh shuffle.
    data, report = mix(base.sources, rows, base)
    assert report["sources"][2]["selected_distinct"] == 10 < report["sources"][2]["selected"]


def test_mixture_is_identical_across_runs_and_after_a_resume(three_sources, tokenizer, tmp_path):
    cfg = settings(three_sources, weights=(0.5, 0.3, 0.2), limit=64, seed=7, cache_dir=tmp_path / "cache")
    first, _ = prepare_training_data(cfg, tokenizer, log=lambda _: None)
    again, _ = prepare_training_data(dataclasses.replace(cfg, cache_dir=None), tokenizer, log=lambda _: None)
    cached, _ = prepare_training_data(cfg, tokenizer, log=lambda _: None)
    assert first.fingerprint() == again.fingerprint() == cached.fingerprint()
    other_seed, _ = prepare_training_data(dataclasses.replace(cfg, seed=8), tokenizer, log=lambda _: None)
    assert other_seed.fingerprint() != first.fingerprint()

    def batches(data, state=None):
        it = BatchIterator(make_dataset(data, 8, seed=3, epochs=2), prefetch_threads=0)
        if state is not None:
            it.restore(state)
        return [b["tokens"].copy() for b in it]

    uninterrupted = batches(first)
    it = BatchIterator(make_dataset(first, 8, seed=3, epochs=2), prefetch_threads=0)
    for _ in range(5):  # into the second epoch's middle: 64 rows make 8 batches an epoch
        next(it)
    state = json.loads(json.dumps(it.state()))  # as a checkpoint stores it
    # A new process: the mixture rebuilt from the sources (through the cache), the position restored.
    rebuilt, _ = prepare_training_data(cfg, tokenizer, log=lambda _: None)
    resumed = batches(rebuilt, state=state)
    assert len(resumed) == len(uninterrupted) - 5
    for a, b in zip(resumed, uninterrupted[5:]):
        np.testing.assert_array_equal(a, b)


def test_duplicates_are_removed_across_sources_and_layouts(tmp_path, tokenizer):
    first = tmp_path / "first.jsonl"
    rows = [qa(i, "d") for i in range(6)]
    first.write_text("".join(json.dumps({"prompt": q, "response": r}) + "\n" for q, r in rows))
    # The same conversations 1 and 4 as ShareGPT in Parquet, one new one, and a duplicate within the file.
    second = tmp_path / "second.parquet"
    pq.write_table(pa.Table.from_pylist(
        [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": r}]}
         for q, r in [rows[1], rows[4], ("new?", "yes"), ("new?", "yes")]]), second)
    cfg = settings([str(first), str(second)], weights=(None, None))
    data, report = prepare_training_data(cfg, tokenizer, log=lambda _: None)
    a, b = report["sources"]
    assert (a["tokenized"], a["duplicates"], a["after_dedup"]) == (6, 0, 6)
    assert (b["tokenized"], b["duplicates"], b["after_dedup"]) == (4, 3, 1)
    assert len(data) == 7 == len({bytes(data.ids[s:e]) for s, e in zip(data.offsets[:-1], data.offsets[1:])})
    kept, _ = prepare_training_data(dataclasses.replace(cfg, dedup=False), tokenizer, log=lambda _: None)
    assert len(kept) == 10


def test_length_filters_max_samples_and_limit(three_sources, tokenizer):
    plain = settings(three_sources)
    _, report = prepare_training_data(plain, tokenizer, log=lambda _: None)
    lengths = {c["source"]: c["tokenized"] for c in report["sources"]}
    assert list(lengths.values()) == [40, 25, 10]
    # Rows are "u:<q>\na:<r>\n" in characters: 27 to 35 tokens (33 in the third source).
    filtered, report = prepare_training_data(dataclasses.replace(plain, min_length=29, max_length=32,
                                                                 drop_truncated=True), tokenizer, log=lambda _: None)
    for c in report["sources"]:
        assert c["too_short"] + c["too_long"] + c["after_length_filters"] == c["after_dedup"]
        assert c["too_short"] > 0 and c["too_long"] > 0
    assert len(filtered) == sum(c["after_length_filters"] for c in report["sources"]) and filtered.num_truncated == 0
    assert filtered.lengths.min() >= 29 and filtered.lengths.max() <= 32
    capped = dataclasses.replace(plain, sources=(dataclasses.replace(plain.sources[0], max_samples=5),
                                                 *plain.sources[1:]), limit=20)
    data, report = prepare_training_data(capped, tokenizer, log=lambda _: None)
    assert report["sources"][0]["after_max_samples"] == 5 and len(data) == 20
    assert sum(c["selected"] for c in report["sources"]) == 20
    with pytest.raises(DataError, match="empty after filtering"):
        prepare_training_data(dataclasses.replace(plain, min_length=1000), tokenizer, log=lambda _: None)
    with pytest.raises(DataError, match="none of the 75 examples has a token to train on"):
        prepare_training_data(dataclasses.replace(plain, max_length=2), tokenizer, log=lambda _: None)


def test_old_data_train_forms_give_their_old_rows(three_sources, tokenizer):
    """data.train as a string or a list: the rows of the old reader (no dedup, no reordering), so runs started
    before resume (their data fingerprint is unchanged)."""
    raw = {"target": {"path": "t"}, "output": {"dir": "o"}, "data": {"train": three_sources, "max_length": 48}}
    cfg = parse_run_config(raw)
    examples = [e for path in three_sources for e in read_examples(path)[0]]
    # Duplicated rows stay with data.train (dedup is off by default there).
    dup = three_sources + [three_sources[0]]
    new, _ = prepare_training_data(dataclasses.replace(settings_of(cfg), cache_dir=None,
                                                       sources=tuple(SourceConfig(p) for p in dup)),
                                   tokenizer, log=lambda _: None)
    assert len(new) == len(examples) + 40
    new, _ = prepare_training_data(dataclasses.replace(settings_of(cfg), cache_dir=None), tokenizer,
                                   log=lambda _: None)
    assert new.fingerprint() == tokenize_examples(tokenizer, examples, 48).fingerprint()
    single = settings_of(parse_run_config({**raw, "data": {"train": three_sources[1]}}))
    assert [s.path for s in single.sources] == [three_sources[1]] and not single.dedup


def test_run_config_sources(three_sources, tmp_path):
    raw = {"target": {"path": "t"}, "output": {"dir": "o"},
           "data": {"sources": [{"path": three_sources[0], "weight": 2, "max_samples": 9},
                                {"path": three_sources[1], "weight": 1, "columns": "conversations=conversations"}],
                    "limit": 30, "min_length": 4, "cache_dir": str(tmp_path)},
           "train": {"seed": 5}}
    cfg = settings_of(parse_run_config(raw))
    assert cfg.weighted and cfg.dedup and cfg.seed == 5 and cfg.limit == 30 and cfg.cache_dir == tmp_path
    assert cfg.sources[0] == SourceConfig(three_sources[0], 2, 9, {})
    assert cfg.sources[1].columns == {"conversations": "conversations"}
    assert settings_of(parse_run_config({**raw, "data": {**raw["data"], "seed": 11, "cache": False}})).seed == 11


def test_fit_writes_source_counts(three_sources, tmp_path):
    """train fit's data step: the counts printed and written beside the run's outputs."""
    import yaml

    from train.fit import prepare_data

    target = tmp_path / "target"
    write_tokenizer(target)
    raw = {"target": {"path": str(target)}, "output": {"dir": str(tmp_path / "run")},
           "data": {"sources": [{"path": p, "weight": w} for p, w in zip(three_sources, (1, 1, 2))], "limit": 40,
                    "max_length": 64, "cache_dir": str(tmp_path / "cache")}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    data = prepare_data(parse_run_config(raw), progress=False)
    counts = json.loads((tmp_path / "run" / "source_counts.json").read_text())
    assert [c["source"] for c in counts["sources"]] == three_sources
    assert sum(c["selected"] for c in counts["sources"]) == counts["total"]["selected"] == len(data) == 40
    assert list(Path(tmp_path / "cache").glob("*.npz")).__len__() == 3
