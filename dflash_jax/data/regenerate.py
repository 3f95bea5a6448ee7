"""Regeneration: the target answers every prompt itself, so the draft is trained on the target's own
distribution (SPEC section 6), not on whatever model wrote the dataset.

Conversations: the target answers each user turn in order, the next user turn following the target's OWN
earlier answer (answers in the input are replaced). Plain text: the target continues the prompt (or the whole
text when there is no prompt). Generation runs batched on the device with this project's engine (DFlash when
the decoder has a draft: the output has the target's distribution either way).

Output: ``out_dir/shard-00000.jsonl``, ... where shard ``k`` holds the rows of input examples
``[k * shard_size, (k + 1) * shard_size)`` in input order, each written atomically, plus ``regenerate.json``
with the settings. Every row carries ``"finished"``: false when one of its answers was cut at
``max_new_tokens`` before a stop token (the trainer's ``data.drop_unfinished`` leaves those rows out). A
rerun skips complete shards, so a killed run resumes with no missing and no duplicated row; a rerun with
other settings is refused. Every batch draws its random key from (seed, shard, turn, batch)
and batches always have ``batch_size`` rows (padded with a copy of the first prompt), so a resumed run writes
exactly what an uninterrupted one would have.

A turn whose prompt plus ``max_new_tokens`` does not fit the target's positions, or whose answer is empty,
ends that conversation; an example with no answered turn is left out (and reported).

Several processes (``jax.distributed``) share one output directory, each answering its own shards on its own
devices (``regenerate(..., processes=...)``). :mod:`dflash_jax.data.server_regenerate` writes the same
directory through an OpenAI-compatible server, with the shard, resume and settings machinery here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dflash_jax.data.formats import (
    REGENERATE_SETTINGS, Conversation, DataError, Example, PlainText, example_to_row, shard_path,
)
from dflash_jax.data.tokenize import plain_prompt_ids
from dflash_jax.engine.decoder import decode_continuation, encode_conversation
from dflash_jax.engine.sampling import SamplingConfig
from dflash_jax.errors import UserError
from dflash_jax.fileio import atomic_write

FORMAT_VERSION = 2  # 2: answers keep the special tokens the target generated (1 dropped them); harmony split


@dataclasses.dataclass
class RegenerateStats:
    examples: int = 0  # input examples
    shards: int = 0
    shards_done_before: int = 0  # complete shards found (a resumed run)
    shards_written: int = 0
    rows_written: int = 0
    answers: int = 0  # generated turns
    unfinished: int = 0  # answers cut at max_new_tokens before a stop token
    generated_tokens: int = 0
    skipped: int = 0  # examples left out: no turn could be answered
    seconds: float = 0.0
    warnings: list[str] = dataclasses.field(default_factory=list)


def _sha256_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()


def target_config_fingerprint(target_config: Any) -> str:
    """sha256 of what the target computes. Left out: ``quantization`` (how the checkpoint stored its weights,
    including the config.json path it was read from: a moved checkpoint must still resume) and an unset
    ``experts.weight_block`` (added after regenerations had been written; leaving it out keeps their hashes).
    ``experts.weight_format`` stays: decoding packed weights inside the layer may round unlike weights
    dequantised at load."""
    fields = dataclasses.asdict(target_config)
    fields.pop("quantization", None)
    experts = fields.get("experts")
    if isinstance(experts, dict) and experts.get("weight_block") is None:
        experts.pop("weight_block", None)
    return _sha256_json(fields)


def examples_fingerprint(examples: Sequence[Example]) -> str:
    """sha256 of the normalised examples: the same data read from a moved or recompressed file matches."""
    h = hashlib.sha256()
    for example in examples:
        h.update(json.dumps(example_to_row(example), sort_keys=True, ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()


def regeneration_settings(decoder: Any, tokenizer: Any, examples: Sequence[Example], *, batch_size: int,
                          max_new_tokens: int, sampling: SamplingConfig, stop_tokens: Sequence[int], seed: int,
                          shard_size: int, use_chat_template: bool, enable_thinking: bool) -> dict:
    """Everything that decides the output rows (batch size included: sampled rows depend on their batch)."""
    import jax.numpy as jnp

    template = getattr(tokenizer, "chat_template", None) if use_chat_template else None
    return {
        **common_settings(examples, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                          shard_size=shard_size),
        "target_config_sha256": target_config_fingerprint(decoder.target_config),
        "draft": bool(decoder.has_draft),
        "block_size": int(decoder.block_size) if decoder.has_draft else None,
        "dtype": jnp.dtype(decoder.dtype).name,
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else None,
        "enable_thinking": bool(enable_thinking),
        "stop_tokens": sorted(int(t) for t in stop_tokens),
        "batch_size": int(batch_size),
        # How drafts are verified changes which random draws a sampled row uses (recorded only when not the
        # default, so that earlier regenerations still resume).
        **({"tree_budget": int(decoder.tree_budget)} if decoder.has_draft and decoder.tree_budget else {}),
        **({"tree_auto": [int(b) for b in decoder.tree_auto]} if decoder.has_draft and decoder.tree_auto else {}),
        **({"block_verify": True} if decoder.has_draft and decoder.block_verify else {}),
    }


def common_settings(examples: Sequence[Example], *, max_new_tokens: int, sampling: SamplingConfig, seed: int,
                    shard_size: int) -> dict:
    """The settings every regeneration records, through the engine or a server."""
    return {
        "format": FORMAT_VERSION,
        "data_sha256": examples_fingerprint(examples),
        "num_examples": len(examples),
        "max_new_tokens": int(max_new_tokens),
        "temperature": float(sampling.temperature),
        "top_k": int(sampling.top_k),
        "top_p": float(sampling.top_p),
        "seed": int(seed),
        "shard_size": int(shard_size),
    }


def regeneration_thinking(path: str | Path) -> dict | None:
    """How the answers of a regeneration output directory were asked for: ``{"enable_thinking": bool,
    "chat_template_kwargs": {...}}`` from its settings file, or None for data that is not one (a plain JSONL
    file, or a directory without the file)."""
    settings_path = Path(path) / REGENERATE_SETTINGS
    if not settings_path.is_file():
        return None
    try:
        settings = json.loads(settings_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{settings_path}: cannot read ({e})") from None
    if not isinstance(settings, dict) or not isinstance(settings.get("enable_thinking", False), bool):
        raise DataError(f"{settings_path}: expected a JSON object whose 'enable_thinking' is true or false")
    thinking = bool(settings.get("enable_thinking", False))
    kwargs = settings.get("chat_template_kwargs") or {"enable_thinking": thinking}
    return {"enable_thinking": thinking, "chat_template_kwargs": kwargs}


def prepare_out_dir(out_dir: Path, settings: dict, own: Any = None) -> None:
    """Create ``out_dir`` with its settings file, or check an existing one matches; remove partial shards
    (of the shards ``own(k)`` says are this process's, when several processes share the directory)."""
    settings_path = out_dir / REGENERATE_SETTINGS
    if settings_path.is_file():
        try:
            previous = json.loads(settings_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{settings_path}: cannot read ({e})") from None
        if not isinstance(previous, dict):
            raise DataError(f"{settings_path}: expected a JSON object")
        differing = [k for k in sorted(set(previous) | set(settings)) if previous.get(k) != settings.get(k)]
        if differing:
            details = "; ".join(f"{k}: {previous.get(k)!r} -> {settings.get(k)!r}" for k in differing)
            raise DataError(f"{out_dir} holds a regeneration with other settings ({details}); use the same settings "
                            "to resume, or another --out")
    else:
        if out_dir.is_dir() and any(out_dir.glob("shard-*.jsonl")):
            raise DataError(f"{out_dir} has shard files but no {REGENERATE_SETTINGS}; use an empty or new --out")
        out_dir.mkdir(parents=True, exist_ok=True)
        with atomic_write(settings_path) as f:
            f.write((json.dumps(settings, indent=2) + "\n").encode())
    for stale in out_dir.glob("*.tmp"):  # left by a killed run
        if own is None or (stale.name.startswith("shard-") and own(int(stale.name[6:11]))):
            stale.unlink(missing_ok=True)


def batch_seed(seed: int, shard: int, turn: int, batch: int) -> int:
    """An independent, reproducible seed for one generate call."""
    return int(np.random.SeedSequence([seed, shard, turn, batch]).generate_state(1)[0])


TRAINING_DATA_KEY = "dflash_training_data"  # the exported draft's config.json / Orbax metadata entry


def training_data_thinking(train: str | Path | Sequence[str | Path], enable_thinking: bool,
                           use_chat_template: bool) -> tuple[dict, list[str]]:
    """The thinking mode a draft is trained in, for its exported metadata (``infer`` and ``infer bench``
    warn when prompts are rendered in the other mode), and warnings about the data. The answers decide it:
    a regeneration directory's settings say how they were asked for; other data is taken to be in the mode
    the trainer renders it (``data.enable_thinking``)."""
    paths = [train] if isinstance(train, (str, Path)) else list(train)
    regenerated = {str(p): regeneration_thinking(p) for p in paths if Path(p).is_dir()}
    regenerated = {k: v for k, v in regenerated.items() if v is not None}
    modes = {v["enable_thinking"] for v in regenerated.values()}
    warnings = []
    if len(modes) > 1:
        warnings.append("data.train mixes regenerations with thinking on and off ("
                        + ", ".join(f"{k}: {'on' if v['enable_thinking'] else 'off'}" for k, v in regenerated.items())
                        + "); the draft's metadata records data.enable_thinking")
    thinking = modes.pop() if len(modes) == 1 else bool(enable_thinking)
    if regenerated and thinking != bool(enable_thinking) and not warnings:
        warnings.append(f"data.train was regenerated with thinking {'on' if thinking else 'off'} but "
                        f"data.enable_thinking is {str(bool(enable_thinking)).lower()}: the prompts are rendered in "
                        "the other mode than the answers were generated in; set data.enable_thinking to match")
    meta = {"enable_thinking": thinking, "use_chat_template": bool(use_chat_template),
            "render_enable_thinking": bool(enable_thinking)}
    kwargs = [v["chat_template_kwargs"] for v in regenerated.values()]
    if kwargs and all(k == kwargs[0] for k in kwargs):
        meta["chat_template_kwargs"] = kwargs[0]
    return meta, warnings


@dataclasses.dataclass
class _Job:
    """One example being answered turn by turn."""

    index: int  # in the input file
    example: Example
    history: list[dict]  # messages so far, with the target's own answers
    users: list[str]  # the user turns to answer in order (the prompt, for plain text)
    answers: int = 0
    done: bool = False
    finished: bool = True  # every answer so far ended with a stop token


def _job(index: int, example: Example) -> _Job:
    if isinstance(example, PlainText):
        return _Job(index, example, [], [example.prompt or example.text])
    system = [dict(m) for m in example.messages[:1] if m["role"] == "system"]
    return _Job(index, example, system, [m["content"] for m in example.messages if m["role"] == "user"])


def _result_row(job: _Job) -> dict | None:
    if job.answers == 0:
        return None
    if isinstance(job.example, PlainText):
        row = example_to_row(PlainText(job.history[-1]["content"], job.users[0]))
    else:
        row = example_to_row(Conversation(tuple(job.history)))
    return {**row, "finished": job.finished}


class _Progress:
    """tqdm bar over examples with rows/s and generated tokens/s of this run."""

    def __init__(self, total: int, initial: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, desc="regenerate", unit="row", disable=not enabled,
                        file=sys.stderr)
        self.start, self.rows, self.tokens = time.perf_counter(), 0, 0

    def update(self, rows: int, tokens: int) -> None:
        self.rows += rows
        self.tokens += tokens
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.rows / elapsed:.2f} rows/s, {self.tokens / elapsed:.0f} tok/s", refresh=False)
        self.bar.update(rows)

    def close(self) -> None:
        self.bar.close()


def _prompt_ids(job: _Job, turn: int, tokenizer: Any, use_chat_template: bool, enable_thinking: bool) -> list[int]:
    """The prompt of ``turn``: the conversation so far (with the target's own answers) and the next user turn."""
    if isinstance(job.example, PlainText):
        return plain_prompt_ids(tokenizer, job.users[0])
    job.history.append({"role": "user", "content": job.users[turn]})
    if not (use_chat_template and getattr(tokenizer, "chat_template", None)):
        # Plain text: the whole conversation so far, joined, exactly as training renders it (tokenize.py).
        return plain_prompt_ids(tokenizer, "".join(m["content"] for m in job.history if m["role"] != "system"))
    return encode_conversation(tokenizer, job.history, use_chat_template, enable_thinking)


def first_prompt_ids(tokenizer: Any, example: Example, use_chat_template: bool = True,
                     enable_thinking: bool = False) -> list[int]:
    """The prompt of an example's first turn exactly as regeneration feeds it to the engine (the trainer's
    held-out prompts for the real tau)."""
    return _prompt_ids(_job(0, example), 0, tokenizer, use_chat_template, enable_thinking)


# gpt-oss's harmony format: an answer generated after ``<|start|>assistant`` is its analysis channel, then the
# final one. Its chat template refuses these markers in a message's content and takes the analysis as a
# ``thinking`` field instead (rendered only before the conversation's last answer, as in training).
HARMONY_ANALYSIS, HARMONY_FINAL = "<|channel|>analysis<|message|>", "<|channel|>final<|message|>"
HARMONY_NEXT = "<|end|><|start|>assistant"


def assistant_message(answer: str) -> dict:
    """The message of a generated answer: a harmony answer of exactly ``[analysis, then] final`` becomes
    ``{"thinking": analysis, "content": final}`` (the template renders it back to the same text); anything
    else (other text, tool calls, other channels) stays as generated, in ``content``."""
    thinking, content = None, None
    if answer.startswith(HARMONY_FINAL):
        content = answer[len(HARMONY_FINAL):]
    elif answer.startswith(HARMONY_ANALYSIS):
        thinking, sep, content = answer[len(HARMONY_ANALYSIS):].partition(HARMONY_NEXT + HARMONY_FINAL)
        content = content if sep else None
    parts = [p for p in (thinking, content) if p is not None]
    if content is None or any(not p.strip() or "<|channel|>" in p or "<|end|>" in p for p in parts):
        return {"role": "assistant", "content": answer}
    return {"role": "assistant", "content": content, **({"thinking": thinking} if thinking is not None else {})}


def _end(job: _Job) -> None:
    """End the conversation before the current turn (its prompt is too long or cannot be rendered, or its
    answer is empty)."""
    if job.history and job.history[-1]["role"] == "user":
        job.history.pop()
    job.done = True


def answer_shard(decoder: Any, tokenizer: Any, examples: Sequence[Example], shard: int, first_index: int, *,
                 batch_size: int, max_new_tokens: int, sampling: SamplingConfig, stop_tokens: Sequence[int],
                 seed: int, use_chat_template: bool, enable_thinking: bool, stats: RegenerateStats,
                 progress: _Progress) -> list[dict]:
    """The output rows of one shard's examples (in input order; an example with no answer has no row). Turn t
    of every example is generated before turn t + 1 of any, so the batches are full."""
    jobs = [_job(first_index + i, e) for i, e in enumerate(examples)]
    stops = {int(t) for t in stop_tokens}
    max_positions = decoder.target_config.max_position_embeddings
    templated = bool(use_chat_template and getattr(tokenizer, "chat_template", None))  # as _prompt_ids decides
    turn = 0
    while active := [j for j in jobs if not j.done and turn < len(j.users)]:
        ready = []
        for j in active:
            try:
                ids = _prompt_ids(j, turn, tokenizer, use_chat_template, enable_thinking)
            except Exception as e:  # noqa: BLE001 (templates raise their own messages, e.g. gpt-oss's)
                # e.g. gpt-oss's template refuses an earlier answer with channel tags in its content (one that
                # assistant_message could not split, such as a tool call): the answers so far are kept.
                problem = f"the chat template failed ({type(e).__name__}: {e})"
            else:
                if len(ids) + max_new_tokens <= max_positions:
                    ready.append((j, ids))
                    continue
                problem = (f"the prompt of {len(ids)} tokens plus max_new_tokens={max_new_tokens} exceeds the "
                           f"target's {max_positions} positions")
            stats.warnings.append(f"example {j.index} turn {turn + 1}: {problem}; "
                                  + ("the conversation ends before this turn" if j.answers else "example left out"))
            _end(j)
            progress.update(1, 0)
        for b in range(0, len(ready), batch_size):
            batch = ready[b: b + batch_size]
            prompts = [ids for _, ids in batch]
            prompts += [prompts[0]] * (batch_size - len(prompts))  # one compiled shape per prompt width
            result = decoder.generate(prompts, max_new_tokens, sampling, stop_tokens,
                                      seed=batch_seed(seed, shard, turn, b // batch_size))
            finished = tokens = 0
            for (j, ids), out in zip(batch, result.tokens):
                tokens += len(out)
                ended = bool(out) and out[-1] in stops
                # The answer is exactly what the target generated, its special tokens included (gpt-oss writes
                # its channels with them), less the stop token: the template or the trainer adds that back.
                answer = decode_continuation(tokenizer, ids, out[:-1] if ended else out, keep_special=True)
                if not answer.strip():
                    _end(j)
                else:
                    stats.answers += 1
                    stats.unfinished += int(not ended)
                    j.finished &= ended
                    chat = templated and not isinstance(j.example, PlainText)
                    j.history.append(assistant_message(answer) if chat else {"role": "assistant", "content": answer})
                    j.answers += 1
                    j.done = turn + 1 >= len(j.users)
                finished += j.done
            stats.generated_tokens += tokens
            progress.update(finished, tokens)
        turn += 1
    rows = [_result_row(j) for j in jobs]
    stats.skipped += sum(r is None for r in rows)
    return [r for r in rows if r is not None]


def regenerate(decoder: Any, tokenizer: Any, examples: Sequence[Example], out_dir: str | Path, *, batch_size: int,
               max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(), stop_tokens: Sequence[int] = (),
               seed: int = 0, shard_size: int = 256, use_chat_template: bool = True, enable_thinking: bool = False,
               progress: bool = True, processes: tuple[int, int] | None = None) -> RegenerateStats:
    """Answer every example with the target and write resumable JSONL shards to ``out_dir`` (see the module
    docstring). Returns the statistics of this run (complete shards found are counted, not re-read).

    ``processes=(index, count)``: one of ``count`` processes sharing ``out_dir`` (``jax.distributed``, every
    process running this with the same arguments), each answering the shards ``k % count == index`` on its own
    devices; rows do not depend on which process answers a shard, so the directory ends up as one process
    would write it. Process 0 writes the settings file first; the others check it."""
    check_run_args(batch_size, shard_size, max_new_tokens, seed, examples)
    decoder.check_fits([1], max_new_tokens)  # max_new_tokens alone must fit the target's positions
    out_dir = Path(out_dir)
    settings = regeneration_settings(
        decoder, tokenizer, examples, batch_size=batch_size, max_new_tokens=max_new_tokens, sampling=sampling,
        stop_tokens=stop_tokens, seed=seed, shard_size=shard_size, use_chat_template=use_chat_template,
        enable_thinking=enable_thinking)
    index, count = processes or (0, 1)
    mine = (lambda k: k % count == index) if count > 1 else None
    if index == 0:
        prepare_out_dir(out_dir, settings, mine)
    if count > 1:
        _barrier("dflash_regenerate_prepared")
        if index != 0:
            prepare_out_dir(out_dir, settings, mine)

    stats, pending, bar = start_shards(examples, out_dir, shard_size, progress, mine)
    start = time.perf_counter()
    try:
        for k in pending:
            part = examples[k * shard_size: (k + 1) * shard_size]
            rows = answer_shard(decoder, tokenizer, part, k, k * shard_size, batch_size=batch_size,
                                max_new_tokens=max_new_tokens, sampling=sampling, stop_tokens=stop_tokens, seed=seed,
                                use_chat_template=use_chat_template, enable_thinking=enable_thinking, stats=stats,
                                progress=bar)
            write_shard(out_dir, k, rows, stats)
    finally:
        bar.close()
        stats.seconds = time.perf_counter() - start
    if count > 1:
        _barrier("dflash_regenerate_done")  # every process's shards written: the directory is complete
    return stats


def _barrier(name: str) -> None:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def check_run_args(batch_size: int, shard_size: int, max_new_tokens: int, seed: int,
                   examples: Sequence[Example]) -> None:
    for name, value in (("batch_size", batch_size), ("shard_size", shard_size), ("max_new_tokens", max_new_tokens)):
        if value < 1:
            raise UserError(f"{name} must be at least 1, got {value}")
    if seed < 0:
        raise UserError(f"seed must be non-negative, got {seed}")
    if not examples:
        raise DataError("nothing to regenerate: no examples")


def start_shards(examples: Sequence[Example], out_dir: Path, shard_size: int, progress: bool, own: Any = None
                 ) -> tuple[RegenerateStats, list[int], _Progress]:
    """The statistics, the shards still to write (in order; complete ones are kept, not re-read; only those
    ``own(k)`` says are this process's) and the progress bar over them, of a run into a prepared ``out_dir``:
    shared by the engine and the server client."""
    num_shards = -(-len(examples) // shard_size)
    mine = [k for k in range(num_shards) if own is None or own(k)]
    done = {k for k in mine if shard_path(out_dir, k).is_file()}
    stats = RegenerateStats(examples=len(examples), shards=num_shards, shards_done_before=len(done))
    size = [len(examples[k * shard_size: (k + 1) * shard_size]) for k in range(num_shards)]
    bar = _Progress(sum(size[k] for k in mine), sum(size[k] for k in done), progress)
    return stats, [k for k in mine if k not in done], bar


def write_shard(out_dir: Path, shard: int, rows: Sequence[dict], stats: RegenerateStats) -> None:
    """One complete shard, atomically: a killed run leaves either the whole shard or none of it."""
    with atomic_write(shard_path(out_dir, shard)) as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8"))
    stats.shards_written += 1
    stats.rows_written += len(rows)
