"""Sources beyond JSONL (dflash_jax/data/sources.py): Parquet, Arrow and JSON-array files in the layouts of real
datasets read into the same examples as their JSONL equivalents, globs, directories, Hub datasets from a
huggingface_hub cache laid out as it lays it out (offline), column mappings, and one clear error per bad input."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_jax.data.formats import Conversation, DataError, PlainText, read_examples
from dflash_jax.data.sources import choose_hub_files, parse_columns, resolve_source, split_of

# UltraChat-200k (HuggingFaceH4/ultrachat_200k): prompt, prompt_id, messages: list<struct<content, role>>.
ULTRACHAT = [
    {"prompt": "Name a colour.", "prompt_id": "a1",
     "messages": [{"content": "Name a colour.", "role": "user"}, {"content": "Blue.", "role": "assistant"},
                  {"content": "Another?", "role": "user"}, {"content": "Red.", "role": "assistant"}]},
    {"prompt": "Hi", "prompt_id": "a2",
     "messages": [{"content": "Hi", "role": "user"}, {"content": "Hello! How can I help?", "role": "assistant"}]},
    {"prompt": "bad", "prompt_id": "a3",  # an assistant turn first: skipped with its file and row
     "messages": [{"content": "I start.", "role": "assistant"}]},
]
# open-perfectblend (mlabonne/open-perfectblend): conversations: list<struct<from, value>>, source.
PERFECTBLEND = [
    {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}], "source": "math"},
    {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Capital of France?"},
                       {"from": "gpt", "value": "Paris."}], "source": "qa"},
]
# A ShareGPT dump: one JSON array of {"id", "conversations": [{"from", "value"}]}.
SHAREGPT = [
    {"id": "x1", "conversations": [{"from": "human", "value": "Tell a joke."}, {"from": "gpt", "value": "No."}]},
    {"id": "x2", "conversations": [{"from": "human", "value": "Why?"}, {"from": "gpt", "value": "Because."},
                                   {"from": "human", "value": "Ok."}, {"from": "gpt", "value": "Bye."}]},
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list, row_group_size: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def write_arrow(path: Path, rows: list, stream: bool) -> Path:
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink:
        writer = (pa.ipc.new_stream if stream else pa.ipc.new_file)(sink, table.schema)
        writer.write_table(table, max_chunksize=1)  # several record batches: rows are numbered across them
        writer.close()
    return path


@pytest.mark.parametrize("rows", [ULTRACHAT, PERFECTBLEND], ids=["ultrachat", "perfectblend"])
def test_parquet_and_arrow_read_as_their_jsonl(tmp_path, rows):
    expected, expected_stats = read_examples(write_jsonl(tmp_path / "rows.jsonl", rows))
    assert all(isinstance(e, Conversation) for e in expected) and len(expected) == 2
    for path in (write_parquet(tmp_path / "rows.parquet", rows, row_group_size=1),
                 write_arrow(tmp_path / "file.arrow", rows, stream=False),
                 write_arrow(tmp_path / "stream.arrow", rows, stream=True)):
        examples, stats = read_examples(path)
        assert examples == expected, path.name
        assert (stats.read, stats.skipped) == (expected_stats.read, expected_stats.skipped)
        # The same reason as for the JSONL line, under the file's name and the row number.
        assert [w.replace(str(path), "F") for w in stats.warnings] == \
            [w.replace(str(tmp_path / "rows.jsonl"), "F") for w in expected_stats.warnings]
    if rows is ULTRACHAT:
        assert expected[0].messages[-1] == {"role": "assistant", "content": "Red."}
        assert stats.warnings == [f"{path}:3: message 0 is 'assistant' where 'user' was expected (an optional "
                                  "system message first, then user and assistant turns alternating)"]
    else:
        assert expected[1].messages[0] == {"role": "system", "content": "Be brief."}


def test_sharegpt_json_array_reads_as_its_jsonl(tmp_path):
    array = tmp_path / "sharegpt.json"
    array.write_text(json.dumps(SHAREGPT))
    assert read_examples(array)[0] == read_examples(write_jsonl(tmp_path / "sharegpt.jsonl", SHAREGPT))[0]
    assert read_examples(array)[0][1].messages[3] == {"role": "assistant", "content": "Bye."}


def test_struct_nulls_are_missing_keys(tmp_path):
    """Rows of different shapes share one struct type in Parquet: a message without 'thinking' holds null."""
    rows = [{"messages": [{"role": "user", "content": "q"},
                          {"role": "assistant", "content": "a", "thinking": "hmm"}]},
            {"messages": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]}]
    examples, _ = read_examples(write_parquet(tmp_path / "t.parquet", rows))
    assert examples[0].messages[1]["thinking"] == "hmm" and "thinking" not in examples[1].messages[1]


def test_columns_override(tmp_path):
    rows = [{"instruction": "Say hi", "output": "hi", "extra": 1}, {"instruction": "Say bye", "output": "bye"}]
    path = write_parquet(tmp_path / "alpaca.parquet", [{"q": r["instruction"], "a": r["output"]} for r in rows])
    examples, _ = read_examples(path, columns="prompt=q,response=a")
    assert examples == read_examples(write_jsonl(tmp_path / "a.jsonl", rows))[0]
    # The column mapped to the response is not also read as a prompt under its own name.
    swapped, _ = read_examples(write_jsonl(tmp_path / "b.jsonl", rows), columns="prompt=output,response=instruction")
    assert swapped[0].messages == ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "Say hi"})
    # JSONL: a row without the mapped column is skipped with its line.
    write_jsonl(tmp_path / "c.jsonl", [{"q": "x", "a": "y"}, {"q": "only"}])
    kept, stats = read_examples(tmp_path / "c.jsonl", columns={"prompt": "q", "response": "a"})
    assert len(kept) == 1 and stats.warnings == [f"{tmp_path / 'c.jsonl'}:2: no column 'a' (--columns maps it; "
                                                 "the row has q)"]
    for bad, message in (("prompt", "FIELD=COLUMN"), ("answerz=a", "unknown field 'answerz'"),
                         ("prompt=a,prompt=b", "given twice")):
        with pytest.raises(DataError, match=message):
            parse_columns(bad)


def test_globs_and_directories(tmp_path):
    write_parquet(tmp_path / "d" / "b.parquet", PERFECTBLEND)
    write_jsonl(tmp_path / "d" / "a.jsonl", SHAREGPT)
    (tmp_path / "d" / "c.jsonl.gz").write_bytes(gzip.compress(b'{"text": "plain"}\n'))
    (tmp_path / "d" / "meta.json").write_text("{}")  # not a data file of a directory
    by_dir, _ = read_examples(tmp_path / "d")
    assert len(by_dir) == 5 and by_dir[-1] == PlainText("plain")
    assert read_examples(str(tmp_path / "d" / "*.parquet"))[0] == read_examples(tmp_path / "d" / "b.parquet")[0]
    assert [p.name for p in resolve_source(str(tmp_path / "**" / "*.jsonl*")).files] == ["a.jsonl", "c.jsonl.gz"]
    # a pattern matching directories (several regenerate outputs) takes each one's data files
    (tmp_path / "regen-b").mkdir()
    write_jsonl(tmp_path / "regen-b" / "shard-00000.jsonl", SHAREGPT)
    assert [p.parent.name for p in resolve_source(str(tmp_path / "[dr]*")).files] == ["d"] * 3 + ["regen-b"]


def test_bad_inputs_give_one_clear_error(tmp_path):
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet")
    good = write_parquet(tmp_path / "good.parquet", ULTRACHAT)
    not_array = tmp_path / "object.json"
    not_array.write_text('{"conversations": []}')
    arrow = tmp_path / "bad.arrow"
    arrow.write_bytes(b"\x00" * 40)
    unknown = write_parquet(tmp_path / "unknown.parquet", [{"id": 1, "body": "x"}])
    cases = [
        (lambda: read_examples(corrupt), [str(corrupt), "not a readable Parquet file"]),
        (lambda: read_examples(unknown), [str(unknown), "no column of a known layout", "(id, body)", "--columns"]),
        (lambda: read_examples(arrow), [str(arrow), "not a readable Arrow IPC file"]),
        (lambda: read_examples(good, columns="prompt=instruction"), [str(good), "no column 'instruction'",
                                                                     "prompt_id"]),
        (lambda: read_examples(str(tmp_path / "nothing-*.parquet")), ["nothing-*.parquet", "no files match"]),
        (lambda: read_examples(not_array), [str(not_array), "one array of rows"]),
        (lambda: read_examples("hf:not a repo"), ["hf:not a repo", "expected hf:ORG/NAME"]),
    ]
    for call, fragments in cases:
        with pytest.raises(DataError) as err:
            call()
        assert all(f in str(err.value) for f in fragments), str(err.value)


def test_split_and_config_from_file_names():
    assert split_of("data/train_sft-00000-of-00001.parquet") == "train_sft"
    assert split_of("data/test-00000-of-00003-8a9b.parquet") == "test"
    assert split_of("en/train/0000.parquet") == "train"
    assert split_of("validation.jsonl.gz") == "validation"
    files = ["README.md", "data/train_sft-00000-of-00001.parquet", "data/test_sft-00000-of-00001.parquet",
             "data/train_gen-00000-of-00002.parquet", "data/train_gen-00001-of-00002.parquet"]
    assert choose_hub_files("hf:o/n", files, None, "train_gen") == files[3:]
    assert choose_hub_files("hf:o/n", files, "data", "test_sft") == files[2:3]
    for config, split, message in ((None, None, "several splits and none is called train (test_sft, train_gen, "
                                                "train_sft)"),
                                   ("data", "valid", "no split 'valid' (splits: test_sft, train_gen, train_sft)"),
                                   ("fr", "train", "no config 'fr' (configs: data)")):
        with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
            choose_hub_files("hf:o/n", files, config, split)
    configs = ["en/train-00000-of-00001.parquet", "fr/train-00000-of-00001.parquet"]
    with pytest.raises(DataError, match="several configs"):
        choose_hub_files("hf:o/n", configs, None, None)
    assert choose_hub_files("hf:o/n", configs, "fr", None) == configs[1:]


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """A dataset in a huggingface_hub cache as huggingface_hub lays it out, read with HF_HUB_OFFLINE=1
    (huggingface_hub reads its environment at import, so its constants are set too)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "datasets--HuggingFaceH4--ultrachat_200k"
    snapshot = repo / "snapshots" / revision
    write_parquet(snapshot / "data" / "train_sft-00000-of-00001.parquet", ULTRACHAT)
    write_parquet(snapshot / "data" / "test_sft-00000-of-00001.parquet", ULTRACHAT[1:2])
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return {"cache": cache, "snapshot": snapshot, "revision": revision}


def test_hub_dataset_read_offline_from_the_cache(offline_hub, tmp_path):
    expected, _ = read_examples(write_jsonl(tmp_path / "u.jsonl", ULTRACHAT))
    examples, stats = read_examples("hf:HuggingFaceH4/ultrachat_200k:data:train_sft")
    assert examples == expected and stats.skipped == 1
    assert stats.warnings[0].startswith(str(offline_hub["snapshot"] / "data" / "train_sft-00000-of-00001.parquet"))
    assert read_examples("hf:HuggingFaceH4/ultrachat_200k:default:test_sft")[0] == expected[1:2]
    resolved = resolve_source("hf:HuggingFaceH4/ultrachat_200k:data:test_sft")
    assert resolved.identity[:3] == ("hub", "HuggingFaceH4/ultrachat_200k", offline_hub["revision"])
    for spec, message in (("hf:HuggingFaceH4/ultrachat_200k", "several splits and none is called train"),
                          ("hf:HuggingFaceH4/ultrachat_200k:data:train", "no split 'train'"),
                          ("hf:HuggingFaceH4/ultrachat_200k:en:train_sft", "no config 'en'"),
                          ("hf:HuggingFaceH4/absent", "not in the Hugging Face cache")):
        with pytest.raises(DataError, match=message) as err:
            read_examples(spec)
        assert spec in str(err.value)


def test_openings_command_reads_any_source(tmp_path, capsys):
    """'train openings --from' takes the same sources (here a Parquet file with its own column names)."""
    from train.openings import main

    stories = [{"story": f"Once there was a fox number {i} who ran."} for i in range(12)]
    path = write_parquet(tmp_path / "openings.parquet", stories)
    assert main(["--from", str(path), "--columns", "text=story", "--out", str(tmp_path / "out"),
                 "--held-out", "3"]) == 0
    held = [json.loads(line)["prompt"] for line in (tmp_path / "out" / "heldout.jsonl").read_text().splitlines()]
    train = (tmp_path / "out" / "train-openings.jsonl").read_text().splitlines()
    assert len(held) == 3 and len(train) == 9 and all(h.startswith("Once there was a fox") for h in held)
    assert "12 openings read" in capsys.readouterr().out
    assert main(["--from", str(path), "--columns", "text=title", "--out", str(tmp_path / "o2")]) == 2
    assert "no column 'title'" in capsys.readouterr().err
