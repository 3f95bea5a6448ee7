"""Training data from several sources: read and tokenize each (through the tokenized cache), remove exact
duplicates across sources, filter by length, and mix by weight or count, deterministically by seed.

Stages, each counted per source (``source_counts.json``):

1. read: rows in the source's files; malformed rows (and, with ``data.drop_unfinished``, rows a regeneration
   cut at its token budget) are left out with a warning;
2. tokenized: rows with at least one trained token (a prompt without an answer has none);
3. dedup (``data.dedup``): a row whose normalised turns (the example as :func:`example_to_row` writes it) equal
   an earlier row's is dropped, earlier sources first, so a row in two sources is kept once, from the first;
4. length filters: ``data.min_length`` drops rows with fewer tokens, ``data.drop_truncated`` drops rows longer
   than ``data.max_length`` (otherwise they are cut to it and kept);
5. ``max_samples``: at most that many rows of the source, a seeded random subset kept in the source's order;
6. mixture: without weights the sources' rows one after the other (the old single-file and list forms of
   ``data.train`` give exactly the rows they gave before); with weights every one of the N rows of the
   mixture (N = ``data.limit``, or all rows of step 5) comes from source i with probability weight_i / sum,
   a source supplying more rows than it has repeating them in a fresh shuffle each time round. A ``limit``
   without weights keeps a seeded random subset of the rows, in order.

Everything random is drawn from ``numpy.random.default_rng`` seeded with (``data.seed``, stage, source index),
so the mixture is a pure function of the inputs and the seed: a resumed run rebuilds exactly the rows it
trained on, and the trainer's saved data position (``dflash_jax.data.pipeline``) continues mid-mixture.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from dflash_jax.data.formats import DataError, example_to_row, read_examples
from dflash_jax.data.sources import parse_columns, resolve_source
from dflash_jax.data.token_cache import (
    SourceRows, cache_key_digest, default_cache_dir, load_source_rows, save_source_rows, tokenizer_fingerprint,
)
from dflash_jax.data.tokenize import LOSS_MASK_RULE, TokenizedData, encode_examples, no_targets_error

COUNTS_FILE = "source_counts.json"
STAGE_MAX_SAMPLES, STAGE_LIMIT, STAGE_WEIGHTED, STAGE_REPEAT = 1, 2, 3, 4  # seed streams of the random draws


@dataclasses.dataclass(frozen=True)
class SourceConfig:
    """One entry of ``data.sources``."""

    path: str
    weight: float | None = None
    max_samples: int | None = None
    columns: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class MixtureSettings:
    sources: tuple[SourceConfig, ...]
    max_length: int
    use_chat_template: bool = True
    enable_thinking: bool = False
    drop_unfinished: bool = False
    dedup: bool = False
    min_length: int | None = None
    drop_truncated: bool = False
    limit: int | None = None
    seed: int = 0
    cache_dir: Path | None = None  # None: no cache

    @property
    def weighted(self) -> bool:
        return any(s.weight is not None for s in self.sources)


def settings_of(cfg: Mapping[str, Any]) -> MixtureSettings:
    """The mixture of a parsed run config (``run_config.parse_run_config``): ``data.sources``, or the older
    ``data.train`` (a source or a list of them, concatenated)."""
    data = cfg["data"]
    if data.get("sources"):
        sources = tuple(SourceConfig(s["path"], s.get("weight"), s.get("max_samples"),
                                     parse_columns(s.get("columns"), f"data.sources {s['path']}: columns"))
                        for s in data["sources"])
    else:
        train = data["train"]
        sources = tuple(SourceConfig(str(p)) for p in ([train] if isinstance(train, str) else train))
    dedup = data.get("dedup")
    cache_dir = None
    if data.get("cache", True):
        cache_dir = Path(data["cache_dir"]) if data.get("cache_dir") else default_cache_dir()
    return MixtureSettings(
        sources=sources, max_length=int(data["max_length"]), use_chat_template=bool(data["use_chat_template"]),
        enable_thinking=bool(data["enable_thinking"]), drop_unfinished=bool(data["drop_unfinished"]),
        dedup=bool(data.get("sources")) if dedup is None else bool(dedup), min_length=data.get("min_length"),
        drop_truncated=bool(data.get("drop_truncated", False)), limit=data.get("limit"),
        seed=int(cfg["train"]["seed"] if data.get("seed") is None else data["seed"]), cache_dir=cache_dir)


def example_hash(example: Any) -> bytes:
    """16 bytes of sha256 of an example's normalised turns (equal for the same conversation read from any
    layout: a ShareGPT row and its OpenAI-messages twin hash alike)."""
    row = json.dumps(example_to_row(example), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(row.encode()).digest()[:16]


def source_cache_key(source: SourceConfig, identity: Any, settings: MixtureSettings, tokenizer_sha: str) -> dict:
    """Everything the tokenized rows of ``source`` depend on."""
    return {"source": identity, "columns": dict(source.columns), "drop_unfinished": settings.drop_unfinished,
            "tokenizer": tokenizer_sha, "use_chat_template": settings.use_chat_template,
            "enable_thinking": settings.enable_thinking, "max_length": settings.max_length,
            "loss_mask_rule": LOSS_MASK_RULE}


def read_source(source: SourceConfig, settings: MixtureSettings, tokenizer: Any, tokenizer_sha: str | None = None,
                progress: bool = False, log: Callable[[str], None] = print) -> tuple[SourceRows, bool]:
    """The tokenized rows of one source and whether they came from the cache."""
    resolved = resolve_source(source.path)
    key = cache_path = None
    if settings.cache_dir is not None:
        tokenizer_sha = tokenizer_sha or tokenizer_fingerprint(tokenizer)
        key = source_cache_key(source, resolved.identity, settings, tokenizer_sha)
        cache_path = Path(settings.cache_dir) / f"{cache_key_digest(key)}.npz"
        cached = load_source_rows(cache_path, key)
        if cached is not None:
            return cached, True
    examples, stats = read_examples(source.path, drop_unfinished=settings.drop_unfinished,
                                    columns=dict(source.columns), files=list(resolved.files))
    encoded = encode_examples(tokenizer, examples, settings.max_length, settings.use_chat_template, progress,
                              settings.enable_thinking, source=source.path)
    kept = [i for i, row in enumerate(encoded) if row.mask.any()]
    data = TokenizedData.from_rows([(encoded[i].ids, encoded[i].mask) for i in kept], settings.max_length,
                                   sum(encoded[i].truncated for i in kept), len(encoded) - len(kept))
    hashes = np.frombuffer(b"".join(example_hash(examples[i]) for i in kept), np.uint8).reshape(len(kept), 16)
    rows = SourceRows(data, hashes, np.asarray([encoded[i].full_length for i in kept], np.int64), stats.read,
                      stats.skipped, stats.unfinished, warnings=list(stats.warnings))
    if cache_path is not None:
        try:
            save_source_rows(cache_path, rows, key)
        except OSError as e:  # a read-only or full cache directory slows the next run down, nothing more
            log(f"warning: cannot write the tokenized cache {cache_path} ({e})")
    return rows, False


def _rng(seed: int, stage: int, index: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, stage, index])


def mix(sources: Sequence[SourceConfig], rows: Sequence[SourceRows], settings: MixtureSettings
        ) -> tuple[TokenizedData, dict]:
    """The mixture of the sources' tokenized rows and the per-source counts of every stage."""
    seen: set[bytes] = set()
    pools, counts = [], []
    for index, (source, r) in enumerate(zip(sources, rows)):
        n = len(r.data)
        keep = np.ones(n, bool)
        if settings.dedup:
            for j, digest in enumerate(r.row_hashes):
                digest = digest.tobytes()
                if digest in seen:
                    keep[j] = False
                else:
                    seen.add(digest)
        after_dedup = int(keep.sum())
        too_short = keep & (r.full_lengths < settings.min_length) if settings.min_length else np.zeros(n, bool)
        keep &= ~too_short
        too_long = keep & (r.full_lengths > settings.max_length) if settings.drop_truncated else np.zeros(n, bool)
        keep &= ~too_long
        pool = np.flatnonzero(keep)
        after_filters = len(pool)
        if source.max_samples is not None and len(pool) > source.max_samples:
            pool = np.sort(_rng(settings.seed, STAGE_MAX_SAMPLES, index).choice(pool, source.max_samples,
                                                                                replace=False))
        pools.append(pool)
        counts.append({"source": source.path, "weight": source.weight, "max_samples": source.max_samples,
                       "read": r.read, "malformed": r.malformed, "unfinished": r.unfinished, "parsed": r.parsed,
                       "without_targets": r.without_targets, "tokenized": n, "duplicates": n - after_dedup,
                       "after_dedup": after_dedup, "too_short": int(too_short.sum()), "too_long": int(too_long.sum()),
                       "after_length_filters": after_filters, "after_max_samples": len(pool)})
    if not any(c["tokenized"] for c in counts):
        raise no_targets_error(", ".join(s.path for s in sources), sum(c["parsed"] for c in counts))
    picks = _weighted_picks(sources, pools, settings) if settings.weighted else _plain_picks(pools, settings)
    for index, count in enumerate(counts):
        chosen = picks[1][picks[0] == index]
        count["selected"], count["selected_distinct"] = int(chosen.size), int(np.unique(chosen).size)
    if not picks[0].size:
        raise DataError("the training data is empty after filtering (" + "; ".join(
            f"{c['source']}: {c['tokenized']} rows with a trained token, {c['after_dedup']} after dedup, "
            f"{c['after_length_filters']} after the length filters" for c in counts) + ")")
    data = _gather(rows, picks, settings.max_length)
    report = {"sources": counts, "total": {"selected": len(data), "truncated": data.num_truncated,
                                           "trained_tokens": int(data.mask.sum())},
              "settings": {"seed": settings.seed, "limit": settings.limit, "dedup": settings.dedup,
                           "min_length": settings.min_length, "drop_truncated": settings.drop_truncated,
                           "max_length": settings.max_length}}
    return data, report


def _plain_picks(pools: list[np.ndarray], settings: MixtureSettings) -> tuple[np.ndarray, np.ndarray]:
    """(source index, row index) of every row: the pools one after the other, a random subset under a limit."""
    source_ids = np.concatenate([np.full(len(p), i, np.int64) for i, p in enumerate(pools)] or [np.zeros(0, np.int64)])
    row_ids = np.concatenate([p.astype(np.int64) for p in pools] or [np.zeros(0, np.int64)])
    if settings.limit is not None and settings.limit < len(row_ids):
        chosen = np.sort(_rng(settings.seed, STAGE_LIMIT).choice(len(row_ids), settings.limit, replace=False))
        source_ids, row_ids = source_ids[chosen], row_ids[chosen]
    return source_ids, row_ids


def _weighted_picks(sources: Sequence[SourceConfig], pools: list[np.ndarray], settings: MixtureSettings
                    ) -> tuple[np.ndarray, np.ndarray]:
    """N draws of a source by weight; each source's rows in a fresh seeded shuffle every time round."""
    weights = np.asarray([s.weight for s in sources], np.float64)
    empty = [s.path for s, p in zip(sources, pools) if not len(p)]
    if empty:
        raise DataError(f"data.sources {empty[0]}: no rows left after filtering, but it has a weight (drop it or "
                        "check its filters)")
    total = settings.limit if settings.limit is not None else sum(len(p) for p in pools)
    source_ids = _rng(settings.seed, STAGE_WEIGHTED).choice(len(sources), size=total, p=weights / weights.sum())
    row_ids = np.zeros(total, np.int64)
    for i, pool in enumerate(pools):
        slots = np.flatnonzero(source_ids == i)
        rounds = -(-len(slots) // len(pool))
        rng = _rng(settings.seed, STAGE_REPEAT, i)
        order = np.concatenate([rng.permutation(pool) for _ in range(rounds)] or [np.zeros(0, np.int64)])
        row_ids[slots] = order[: len(slots)]
    return source_ids.astype(np.int64), row_ids


def _gather(rows: Sequence[SourceRows], picks: tuple[np.ndarray, np.ndarray], max_length: int) -> TokenizedData:
    source_ids, row_ids = picks
    pieces, truncated = [], 0
    for s, j in zip(source_ids.tolist(), row_ids.tolist()):
        data = rows[s].data
        start, stop = int(data.offsets[j]), int(data.offsets[j + 1])
        pieces.append((data.ids[start:stop], data.mask[start:stop]))
        truncated += int(rows[s].full_lengths[j] > max_length)
    without_targets = sum(r.without_targets for r in rows)
    return TokenizedData.from_rows(pieces, max_length, truncated, without_targets)


def prepare_training_data(settings: MixtureSettings, tokenizer: Any, log: Callable[[str], None] = print,
                          progress: bool = False) -> tuple[TokenizedData, dict]:
    """Read (or take from the cache), tokenize, filter and mix every source; logs each source's counts."""
    started = time.perf_counter()
    tokenizer_sha = tokenizer_fingerprint(tokenizer) if settings.cache_dir is not None else None
    all_rows = []
    for source in settings.sources:
        source_started = time.perf_counter()
        rows, cached = read_source(source, settings, tokenizer, tokenizer_sha, progress, log)
        for line in rows.warnings[:5]:
            log(f"warning: {line}")
        if rows.malformed > 5:
            log(f"warning: {source.path}: ... {rows.malformed - 5} more malformed rows")
        log(f"{source.path}: {rows.read} rows, {rows.malformed} malformed, {rows.unfinished} unfinished left out, "
            f"{len(rows.data)} with trained tokens ({'tokenized cache' if cached else 'tokenized'} in "
            f"{time.perf_counter() - source_started:.2f} s)")
        all_rows.append(rows)
    data, report = mix(settings.sources, all_rows, settings)
    for c in report["sources"]:
        log(f"{c['source']}: {c['tokenized']} tokenized -> {c['after_dedup']} after dedup -> "
            f"{c['after_length_filters']} after length filters -> {c['after_max_samples']} after max_samples -> "
            f"{c['selected']} in the mixture ({c['selected_distinct']} distinct)")
    report["seconds"] = round(time.perf_counter() - started, 3)
    log(f"training data: {len(data)} rows ({int(data.mask.sum())} trained tokens), {data.num_truncated} truncated "
        f"at {settings.max_length} tokens, ready in {report['seconds']:.2f} s")
    return data, report


def write_counts(path: str | Path, report: dict) -> None:
    from dflash_jax.fileio import write_text_atomic

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(report, indent=2) + "\n")
