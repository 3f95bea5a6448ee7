"""Where training rows come from: one source syntax for ``train regenerate``, ``train fit`` and ``train openings``.

A source is

- a file: ``.jsonl`` / ``.jsonl.gz`` (one JSON object per line), ``.json`` (one JSON array of objects),
  ``.parquet``, or ``.arrow`` (Arrow IPC, file or stream format: what ``datasets`` writes into its cache);
  any other suffix is read as JSONL, as before;
- a directory: its ``.jsonl``, ``.jsonl.gz``, ``.parquet`` and ``.arrow`` files in name order (``.json`` files
  are left out there: a regeneration directory keeps its settings in ``regenerate.json``; name a JSON array
  file itself or through a glob);
- a glob such as ``data/*.parquet`` or ``shards/**/*.jsonl`` (matches in name order);
- a Hugging Face Hub dataset ``hf:ORG/NAME[:CONFIG[:SPLIT]]`` read from the dataset repository's own data
  files (its Parquet conversion or the files it ships) through huggingface_hub's cache, without the
  ``datasets`` library. ``HF_HUB_OFFLINE=1`` reads the cache alone, as for model ids
  (:mod:`dflash_jax.checkpoints.hub`).

Columns map to the layouts of :mod:`dflash_jax.data.formats` (``messages``, ``conversations``, prompt/response,
text) by name; ``columns`` (``--columns prompt=instruction,response=output``) renames them first. Parquet and
Arrow rows are read a record batch at a time, never a whole file into Python objects. In columnar files a
null stands for a missing value: a struct column shared by rows of different shapes (a message without
``thinking``) holds nulls where a JSON row would simply lack the key, so nulls are dropped before parsing.
"""

from __future__ import annotations

import dataclasses
import glob as globlib
import gzip
import json
import re
import zlib
from pathlib import Path
from typing import Any, Iterator, Mapping

from dflash_jax.data.layout import LAYOUT_FIELDS, REGENERATE_SETTINGS, DataError, RowError, shard_path

HUB_PREFIX = "hf:"
COLUMNAR_SUFFIXES = (".parquet", ".arrow")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
DIRECTORY_SUFFIXES = JSONL_SUFFIXES + COLUMNAR_SUFFIXES
HUB_SUFFIXES = DIRECTORY_SUFFIXES  # a dataset repository's data files (its .json files are mostly metadata)
RECORD_BATCH_ROWS = 1024  # rows turned into Python objects at a time
GLOB_CHARS = re.compile(r"[*?\[]")
# A split from a data file's name: "train-00000-of-00003.parquet", "train_sft-00000-of-00001-4f2d.parquet",
# "test.jsonl" -> train, train_sft, test.
SHARD_NAME = re.compile(r"^(?P<split>.+?)(?:[-_]\d{5}[-_]of[-_]\d{5}.*)?(?:\.jsonl\.gz|\.[a-z]+)$")


@dataclasses.dataclass(frozen=True)
class ResolvedSource:
    """A source spec made concrete: the files it reads, and what identifies their content (for the tokenized
    cache: sizes and modification times of local files, the commit of a Hub dataset)."""

    spec: str
    files: tuple[Path, ...]
    identity: tuple  # JSON-able; equal identities mean the same bytes (as far as a cache can cheaply tell)


def parse_columns(text: str | Mapping[str, str] | None, what: str = "--columns") -> dict[str, str]:
    """``prompt=instruction,response=output`` (or a mapping) -> ``{layout field: column}``."""
    if text is None or text == "" or text == {}:
        return {}
    if isinstance(text, Mapping):
        pairs = list(text.items())
    else:
        pairs = []
        for item in str(text).split(","):
            field, sep, column = item.partition("=")
            if not sep or not field.strip() or not column.strip():
                raise DataError(f"{what} {text!r}: expected FIELD=COLUMN pairs separated by commas, e.g. "
                                "prompt=instruction,response=output")
            pairs.append((field.strip(), column.strip()))
    mapping = {}
    for field, column in pairs:
        if not isinstance(field, str) or not isinstance(column, str) or not column:
            raise DataError(f"{what}: {field!r}={column!r}: field and column must be non-empty strings")
        if field not in LAYOUT_FIELDS:
            raise DataError(f"{what}: unknown field {field!r} (fields: {', '.join(LAYOUT_FIELDS)})")
        if field in mapping:
            raise DataError(f"{what}: field {field!r} is given twice")
        mapping[field] = column
    return mapping


def rename_columns(row: Any, columns: Mapping[str, str]) -> Any:
    """The row with each mapped column under its layout field's name (the column's own name dropped, so an
    ``instruction`` column mapped to ``response`` is not read as a prompt too)."""
    if not columns or not isinstance(row, dict):
        return row
    missing = [c for c in columns.values() if c not in row]
    if missing:
        raise RowError(f"no column {missing[0]!r} (--columns maps it; the row has {', '.join(sorted(row)) or 'none'})")
    renamed = {k: v for k, v in row.items() if k not in set(columns.values()) and k not in columns}
    renamed.update({field: row[column] for field, column in columns.items()})
    return renamed


def drop_nulls(value: Any) -> Any:
    """A columnar row without its nulls (in the row and in the messages of a list-of-structs column)."""
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


# ----------------------------------------------------------------------------------------------- resolution


def resolve_source(spec: str | Path) -> ResolvedSource:
    """The files of a source spec (see the module docstring); a :class:`DataError` names what is wrong."""
    text = str(spec)
    if text.startswith(HUB_PREFIX) and not Path(text).exists():  # a local path always wins, as for model ids
        return resolve_hub_source(text)
    if GLOB_CHARS.search(text) and not Path(text).exists():
        # A matching directory (e.g. several regenerate outputs, ``data/regen-*``) stands for its data files.
        matches = [f for p in sorted(globlib.glob(text, recursive=True))
                   for f in (local_data_files(Path(p)) if Path(p).is_dir() else [Path(p)])]
        if not matches:
            raise DataError(f"{text}: no files match the pattern")
        return ResolvedSource(text, tuple(matches), _file_identity(matches))
    files = tuple(local_data_files(Path(text)))
    return ResolvedSource(text, files, _file_identity(files))


def _file_identity(files) -> tuple:
    out = []
    for f in files:
        st = Path(f).stat()
        out.append((str(Path(f).resolve()), st.st_size, st.st_mtime_ns))
    return ("files", tuple(out))


def local_data_files(path: Path) -> list[Path]:
    """A file itself, or a directory's data files in name order. A regeneration output directory must be
    complete: a missing shard would silently drop data."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"{path}: data file not found")
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(DIRECTORY_SUFFIXES))
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
        raise DataError(f"{path}: no .jsonl, .jsonl.gz, .parquet or .arrow files in the directory")
    return files


def parse_hub_spec(spec: str) -> tuple[str, str | None, str | None]:
    """``hf:ORG/NAME[:CONFIG[:SPLIT]]`` -> (repo id, config or None, split or None)."""
    parts = spec[len(HUB_PREFIX):].split(":")
    if len(parts) > 3 or not parts[0] or any(p == "" for p in parts[1:]) or parts[0].count("/") != 1:
        raise DataError(f"{spec}: expected hf:ORG/NAME, hf:ORG/NAME:CONFIG or hf:ORG/NAME:CONFIG:SPLIT")
    repo, config, split = (parts + [None, None])[:3]
    return repo, config, split


def split_of(relative: str) -> str:
    """The split a data file belongs to: a folder below the config (``CONFIG/train/0000.parquet``) or the
    file name's stem before its shard numbering (``data/train_sft-00000-of-00001.parquet``)."""
    parts = relative.split("/")
    if len(parts) >= 3:
        return parts[-2]
    match = SHARD_NAME.match(parts[-1])
    return match.group("split") if match else parts[-1]


def config_of(relative: str) -> str:
    """The config a data file belongs to: its top folder (``data`` is the dataset's only or default config);
    files at the repository's top level belong to ``default``."""
    return relative.split("/")[0] if "/" in relative else "default"


def choose_hub_files(spec: str, relatives: list[str], config: str | None, split: str | None) -> list[str]:
    """The data files of ``config`` and ``split`` among a dataset repository's files (relative paths)."""
    data = sorted(r for r in relatives if r.endswith(HUB_SUFFIXES))
    if not data:
        raise DataError(f"{spec}: the dataset repository has no data files ({', '.join(HUB_SUFFIXES)})")
    configs = sorted({config_of(r) for r in data})
    if config is None:
        config = ("data" if "data" in configs else "default" if "default" in configs
                  else configs[0] if len(configs) == 1 else None)
        if config is None:
            raise DataError(f"{spec}: the dataset has several configs ({', '.join(configs)}); choose one: "
                            f"{spec}:CONFIG")
    in_config = [r for r in data if config_of(r) == config]
    if not in_config and config == "default" and "data" in configs:
        in_config = [r for r in data if config_of(r) == "data"]
    if not in_config:
        raise DataError(f"{spec}: the dataset has no config {config!r} (configs: {', '.join(configs)})")
    splits = sorted({split_of(r) for r in in_config})
    if split is None:
        split = "train" if "train" in splits else splits[0] if len(splits) == 1 else None
        if split is None:
            raise DataError(f"{spec}: config {config!r} has several splits and none is called train "
                            f"({', '.join(splits)}); choose one: hf:REPO:{config}:SPLIT")
    chosen = [r for r in in_config if split_of(r) == split]
    if not chosen:
        raise DataError(f"{spec}: config {config!r} has no split {split!r} (splits: {', '.join(splits)})")
    return chosen


def resolve_hub_source(spec: str) -> ResolvedSource:
    """A Hub dataset's files for one config and split, from huggingface_hub's cache (fetched first when online).
    Offline the cached snapshot of ``main`` is listed; online the repository's file list is asked for, and only
    the chosen files are downloaded."""
    import httpx
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError, HfHubHTTPError, HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError,
    )
    from huggingface_hub.utils import validate_repo_id

    repo, config, split = parse_hub_spec(spec)
    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise DataError(f"{spec}: not a Hugging Face Hub dataset id ({e})") from None
    cache = constants.HF_HUB_CACHE
    offline = constants.is_offline_mode()
    try:
        if offline:
            snapshot = Path(snapshot_download(repo, repo_type="dataset", local_files_only=True))
            relatives = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
            chosen = choose_hub_files(spec, relatives, config, split)
        else:
            relatives = HfApi().list_repo_files(repo, repo_type="dataset")
            chosen = choose_hub_files(spec, relatives, config, split)
            snapshot = Path(snapshot_download(repo, repo_type="dataset", allow_patterns=chosen))
    except GatedRepoError:
        raise DataError(f"{spec}: the dataset is gated; accept its terms on its Hub page and log in ('hf auth "
                        "login' or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise DataError(f"{spec}: no Hugging Face Hub dataset {repo} (a private one needs 'hf auth login' or "
                        "HF_TOKEN)") from None
    except LocalEntryNotFoundError as e:
        if offline:
            raise DataError(f"{spec}: the dataset is not in the Hugging Face cache {cache} while HF_HUB_OFFLINE is "
                            "set; download it once with network access (or unset HF_HUB_OFFLINE)") from None
        cause = e.__cause__ or e
        raise DataError(f"{spec}: the dataset is not in the Hugging Face cache {cache} and the Hub cannot be reached "
                        f"({type(cause).__name__}: {cause})") from None
    except (HfHubHTTPError, httpx.HTTPError, OSError) as e:  # a server error, a lost connection, a full disk
        raise DataError(f"{spec}: cannot fetch the dataset into {cache} ({type(e).__name__}: {e})") from None
    files = tuple(snapshot / r for r in chosen)
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise DataError(f"{spec}: {missing[0]} is missing from the cached snapshot (an interrupted download?); "
                        "fetch the dataset again with network access")
    # The snapshot folder is named by the commit: the same commit and files are the same bytes.
    return ResolvedSource(spec, files, ("hub", repo, snapshot.name, tuple(chosen), tuple(f.stat().st_size for f in files)))


# -------------------------------------------------------------------------------------------------- reading


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, JSON value or RowError) of every non-blank line, streamed."""
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if raw.strip():
                    yield lineno, _json_value(raw)
    except (OSError, EOFError, zlib.error) as e:  # includes a truncated, corrupt or non-gzip .gz file
        raise DataError(f"{path}: cannot read ({e})") from None


def _json_value(raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return RowError(f"not valid UTF-8 ({e.reason} at byte {e.start})")
    except json.JSONDecodeError as e:
        return RowError(f"not valid JSON ({e.msg} at column {e.colno})")


def _json_array_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(1-based element number, value) of a JSON file holding one array (ShareGPT dumps)."""
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read().decode("utf-8"))
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not a valid JSON file ({e})") from None
    if not isinstance(value, list):
        raise DataError(f"{path}: a .json data file must hold one array of rows, got a {type(value).__name__} "
                        "(JSON Lines files are named .jsonl)")
    yield from enumerate(value, start=1)


def _record_batches(path: Path, columns: Mapping[str, str]) -> Iterator[Any]:
    """pyarrow record batches of a Parquet or Arrow IPC file, only the columns the rows need; a corrupt file or
    a missing column is a :class:`DataError` naming the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.name.endswith(".parquet"):
            parquet = pq.ParquetFile(path)
            wanted = _wanted_columns(path, parquet.schema_arrow.names, columns)
            yield from parquet.iter_batches(batch_size=RECORD_BATCH_ROWS, columns=wanted)
            return
        with pa.memory_map(str(path)) as source:
            try:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:  # not the random-access file format: the stream format (datasets' cache)
                source.seek(0)
                reader = pa.ipc.open_stream(source)
                batches = iter(reader)
            wanted = _wanted_columns(path, reader.schema.names, columns)
            for batch in batches:
                yield batch.select(wanted)
    except DataError:
        raise
    except (pa.ArrowException, OSError) as e:
        kind = "Parquet" if path.name.endswith(".parquet") else "Arrow IPC"
        raise DataError(f"{path}: not a readable {kind} file ({type(e).__name__}: {e})") from None


def _wanted_columns(path: Path, names: list[str], columns: Mapping[str, str]) -> list[str]:
    """The mapped columns (each must exist), or else the columns a layout reads by name (at least one must
    exist): a dataset's other columns (ids, scores, embeddings) are never turned into Python objects."""
    if columns:
        missing = [c for c in columns.values() if c not in names]
        if missing:
            raise DataError(f"{path}: no column {missing[0]!r} (columns: {', '.join(names)})")
        return sorted(set(columns.values()) | ({"finished"} & set(names)))  # "finished": data.drop_unfinished
    wanted = [n for n in names if n in LAYOUT_FIELDS or n == "finished"]
    if not wanted:
        raise DataError(f"{path}: no column of a known layout ({', '.join(LAYOUT_FIELDS)}) among its columns "
                        f"({', '.join(names)}); map them with --columns (data.sources: columns), e.g. "
                        "prompt=instruction,response=output")
    return wanted


def _columnar_rows(path: Path, columns: Mapping[str, str]) -> Iterator[tuple[int, Any]]:
    """(1-based row number, row dict without nulls), a record batch at a time."""
    number = 0
    for batch in _record_batches(path, columns):
        for row in batch.to_pylist():
            number += 1
            yield number, drop_nulls(row)


def source_rows(file: Path, columns: Mapping[str, str] | None = None) -> Iterator[tuple[int, Any]]:
    """(row number, raw row, or a RowError for an unreadable line) of one data file, with ``columns`` renamed."""
    name = file.name
    columns = columns or {}
    if name.endswith(COLUMNAR_SUFFIXES):
        rows = _columnar_rows(file, columns)
    elif name.endswith(".json"):
        rows = _json_array_rows(file)
    else:
        rows = _jsonl_rows(file)
    for number, row in rows:
        if columns and not isinstance(row, RowError):
            try:
                row = rename_columns(row, columns)
            except RowError as e:
                row = e
        yield number, row

