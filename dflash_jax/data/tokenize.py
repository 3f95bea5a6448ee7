"""Examples -> token ids and a loss mask marking the tokens the draft learns to predict (SPEC section 6).

The draft is trained on the target's answers, so for every trained answer the sequence should hold what the
target saw when it produced it, then the answer exactly as generated. An example is first rendered into
alternating untrained/trained text spans. Chat-template spans are tokenised on their own
(``add_special_tokens=False``) and the ids concatenated: special tokens mark their boundaries, and tokenising
the joined text could merge tokens across them. Plain text is tokenised as one text and every token is assigned
to the span it starts in, because the target generated the answer as a continuation of the prompt's tokens
(``tokenize_spans``).

With a chat template, the spans of a conversation with assistant turns ``a_1 .. a_n`` are

    untrained  P_1                      the generation prompt of turn 1: the template applied to the messages
                                        before it with ``add_generation_prompt=True`` (thinking off by default)
    trained    content_1 + EOT          the answer and the template's end-of-turn token (``<|im_end|>`` for
                                        Qwen), so the draft learns to stop; not the newline after it
    untrained  D_2                      what the template puts between turn 1's end-of-turn token and the end
                                        of turn 2's generation prompt (the next user turn, the assistant header)
    trained    content_2 + EOT ...

so every answer directly follows its own generation prompt, exactly as at generation time. The template is
rendered with placeholder answers and the text is cut at the placeholders; it is never assumed that the
rendering of the whole conversation extends the per-turn generation prompts. That matters for Qwen3, whose
generation prompt (thinking off) ends in ``<think>\\n\\n</think>\\n\\n`` while its rendering of an EARLIER
assistant turn has no think block: the full rendering would train every non-final answer after a header that
the target never produces at inference. (The price: for turns after the first, the earlier answers in the
context carry the think block of their own generation prompt, where the target's history rendering had none.)
Text after the last answer is left out (nothing to learn there).

Without a chat template a conversation is plain text: BOS (if the tokenizer has one), each user message
untrained and each assistant message trained, concatenated; system messages are left out (as in
``encode_conversation``, which feeds the raw user text). A :class:`PlainText` is BOS + prompt (untrained) + text
(trained). The first token of a sequence is never trained: nothing precedes it to predict it from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dflash_jax.data.formats import DataError, Example, PlainText
from dflash_jax.errors import UserError
from dflash_jax.fileio import atomic_write

# Stands in for an assistant answer while rendering the template: letters and digits only, so that no
# template filter (trim, tojson, escaping) alters it.
PLACEHOLDER = "DFLASHANSWERPLACEHOLDER{}X"

Span = tuple[str, bool]  # (text, trained)


def bos_ids(tokenizer: Any) -> list[int]:
    bos = getattr(tokenizer, "bos_token_id", None)
    return [] if bos is None else [int(bos)]


def plain_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a plain-text prompt: BOS (if any) + the text. Regeneration and training both use this."""
    return bos_ids(tokenizer) + list(tokenizer(text, add_special_tokens=False)["input_ids"])


def special_token_strings(tokenizer: Any) -> tuple[str, ...]:
    """The tokenizer's special tokens as text, longest first (for matching the end-of-turn token)."""
    specials = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            specials.add(str(token))
    return tuple(sorted((s for s in specials if s), key=len, reverse=True))


@dataclasses.dataclass(frozen=True)
class SpanRenderer:
    """Renders examples into (text, trained) spans for one tokenizer and one template setting."""

    tokenizer: Any
    use_chat_template: bool = True
    enable_thinking: bool = False
    specials: tuple[str, ...] = ()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, use_chat_template: bool = True, enable_thinking: bool = False):
        use = bool(use_chat_template and getattr(tokenizer, "chat_template", None))
        return cls(tokenizer, use, enable_thinking, special_token_strings(tokenizer) if use else ())

    def spans(self, example: Example) -> tuple[list[int], list[Span]]:
        """(ids before the first span, the non-empty spans). A chat template writes any BOS it wants itself;
        plain text gets the tokenizer's BOS."""
        if isinstance(example, PlainText):
            spans = [(example.prompt, False), (example.text, True)]
        elif self.use_chat_template:
            return [], [s for s in self.chat_spans(list(example.messages)) if s[0]]
        else:
            spans = [(m["content"], m["role"] == "assistant") for m in example.messages if m["role"] != "system"]
        return bos_ids(self.tokenizer), [s for s in _drop_untrained_tail(spans) if s[0]]

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=generation_prompt,
                                                      enable_thinking=self.enable_thinking)
        except Exception as e:  # jinja2 raises TemplateError subclasses, templates raise their own messages
            raise DataError(f"the chat template failed ({type(e).__name__}: {e})") from None

    def chat_spans(self, messages: list[dict]) -> list[Span]:
        answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not answers:
            return []
        placeholders = [dict(m, content=PLACEHOLDER.format(i)) if m["role"] == "assistant" else m
                        for i, m in enumerate(messages)]
        spans: list[Span] = []
        previous = None
        for i in answers:
            prompt = self.render(placeholders[:i], generation_prompt=True)
            if previous is None:
                spans.append((prompt, False))
            else:
                end_of_turn, between = self.split_end_of_turn(self._after(prompt, previous))
                spans += [(messages[previous]["content"] + end_of_turn, True), (between, False)]
            previous = i
        end_of_turn, _ = self.split_end_of_turn(
            self._after(self.render(placeholders[: previous + 1], generation_prompt=False), previous))
        spans.append((messages[previous]["content"] + end_of_turn, True))
        return spans

    @staticmethod
    def _after(text: str, index: int) -> str:
        """The rendered text after answer ``index``'s placeholder."""
        parts = text.split(PLACEHOLDER.format(index))
        if len(parts) != 2:
            raise DataError("the chat template does not render assistant messages verbatim (an answer appears "
                            f"{len(parts) - 1} times in its rendering, expected once); train without the template")
        return parts[1]

    def split_end_of_turn(self, tail: str) -> tuple[str, str]:
        """(the special token that ends the answer, if the template puts one right after it; the rest)."""
        for special in self.specials:
            if tail.startswith(special):
                return special, tail[len(special):]
        return "", tail


def _drop_untrained_tail(spans: list[Span]) -> list[Span]:
    while spans and not spans[-1][1]:
        spans = spans[:-1]
    return spans


def assemble(prefix: Sequence[int], pieces: Sequence[Sequence[int]], trained: Sequence[bool],
             max_length: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """Concatenate ``prefix`` and the tokenised spans; the mask is set on trained spans, never on position 0;
    cut at ``max_length``."""
    ids = list(prefix)
    mask = [False] * len(prefix)
    for piece, train in zip(pieces, trained):
        ids += piece
        mask += [train] * len(piece)
    if mask:
        mask[0] = False
    truncated = len(ids) > max_length
    return np.asarray(ids[:max_length], np.int32), np.asarray(mask[:max_length], bool), truncated


def _check_max_length(max_length: int) -> None:
    if max_length < 2:
        raise UserError(f"max_length must be at least 2, got {max_length}")


def encode_example(tokenizer: Any, example: Example, max_length: int, use_chat_template: bool = True,
                   enable_thinking: bool = False) -> tuple[np.ndarray, np.ndarray, bool]:
    """(ids int32, loss_mask bool, truncated) of one example; see the module docstring for the layout."""
    _check_max_length(max_length)
    renderer = SpanRenderer.for_tokenizer(tokenizer, use_chat_template, enable_thinking)
    prefix, spans = renderer.spans(example)
    pieces = next(iter(tokenize_spans(tokenizer, [spans], joint=not renderer.use_chat_template)))
    return assemble(prefix, pieces, [t for _, t in spans], max_length)


def tokenize_spans(tokenizer: Any, rendered: Sequence[Sequence[Span]], joint: bool) -> list[list[list[int]]]:
    """Token ids of every span of every example (one batched tokenizer call).

    Chat-template spans are tokenised one by one: special tokens sit at their boundaries. Plain text
    (``joint``) is tokenised as ONE text and each token goes to the span where it starts: a SentencePiece
    tokenizer would otherwise give the answer a word-start marker it never had when the target generated it
    as a continuation ("time" + "," would become "time", "_,")."""
    if not joint or not getattr(tokenizer, "is_fast", False):
        texts = [text for spans in rendered for text, _ in spans]
        ids = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
        return [[list(next(ids)) for _ in spans] for spans in rendered]
    texts = ["".join(text for text, _ in spans) for spans in rendered]
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True) if texts else None
    out = []
    for i, spans in enumerate(rendered):
        ends = np.cumsum([len(text) for text, _ in spans])
        pieces: list[list[int]] = [[] for _ in spans]
        for token, (start, _) in zip(enc["input_ids"][i], enc["offset_mapping"][i]):
            pieces[min(int(np.searchsorted(ends, start, side="right")), len(spans) - 1)].append(int(token))
        out.append(pieces)
    return out


@dataclasses.dataclass
class TokenizedData:
    """Token rows of different lengths and their loss masks, stored back to back, ready for the trainer.

    A row takes its own length in memory, not ``max_length``: rows padded to a common length would hold
    ~12 GB per process for 800k rows of max_length 3072 however short most answers are. The pipeline pads a
    row only when it reads it (``self[i]``: the grain record ``tokens, loss_mask [max_length], lengths``)."""

    ids: np.ndarray  # [total tokens] int32: every row's token ids, back to back
    mask: np.ndarray  # [total tokens] bool: their loss masks
    offsets: np.ndarray  # [N + 1] int64: row i is ids[offsets[i]:offsets[i + 1]]
    max_length: int  # the length rows are padded to when read (every row is at most this long)
    num_truncated: int = 0  # rows cut at max_length (kept)
    num_without_targets: int = 0  # rows with no trained token (dropped)

    ARRAYS = ("ids", "mask", "offsets")

    def __post_init__(self):
        self.ids, self.mask = np.asarray(self.ids), np.asarray(self.mask)
        self.offsets = np.asarray(self.offsets)
        problem = self._layout_problem()
        if problem:
            raise DataError(f"inconsistent tokenized data: {problem}")
        self.offsets = self.offsets.astype(np.int64)
        self.max_length = int(self.max_length)

    def _layout_problem(self) -> str | None:
        ids, mask, offsets = self.ids, self.mask, self.offsets
        if ids.ndim != 1 or ids.dtype != np.int32 or mask.shape != ids.shape or mask.dtype != bool:
            return f"ids {ids.shape} {ids.dtype} and mask {mask.shape} {mask.dtype} must be 1-D int32 and bool alike"
        if offsets.ndim != 1 or offsets.size < 1 or not np.issubdtype(offsets.dtype, np.integer):
            return f"offsets {offsets.shape} {offsets.dtype} must be a 1-D integer array of N + 1 row starts"
        if offsets[0] != 0 or offsets[-1] != ids.size:
            return f"offsets must start at 0 and end at the {ids.size} ids, not {offsets[0]} .. {offsets[-1]}"
        lengths = np.diff(offsets)
        if not isinstance(self.max_length, (int, np.integer)) or self.max_length < 2:
            return f"max_length must be an integer of at least 2, got {self.max_length!r}"
        if lengths.size and (lengths.min() < 1 or lengths.max() > self.max_length):
            return (f"row lengths must be between 1 and max_length {self.max_length}, "
                    f"got {lengths.min()} .. {lengths.max()}")
        return None

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[np.ndarray, np.ndarray]], max_length: int, num_truncated: int = 0,
                  num_without_targets: int = 0) -> "TokenizedData":
        """From ``(ids, loss_mask)`` pairs, one per row."""
        lengths = np.asarray([len(ids) for ids, _ in rows], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        ids = np.concatenate([np.asarray(r, np.int32) for r, _ in rows]) if rows else np.zeros((0,), np.int32)
        mask = np.concatenate([np.asarray(m, bool) for _, m in rows]) if rows else np.zeros((0,), bool)
        return cls(ids, mask, offsets, max_length, num_truncated, num_without_targets)

    @classmethod
    def from_padded(cls, tokens: np.ndarray, loss_mask: np.ndarray, lengths: np.ndarray) -> "TokenizedData":
        """From right-padded ``tokens, loss_mask [N, max_length]`` and ``lengths [N]`` (what is past a row's
        length is dropped)."""
        tokens, loss_mask = np.asarray(tokens), np.asarray(loss_mask)
        if tokens.ndim != 2 or loss_mask.shape != tokens.shape or np.shape(lengths) != tokens.shape[:1]:
            raise DataError(f"padded rows need tokens and loss_mask [N, L] and lengths [N], got {tokens.shape}, "
                            f"{loss_mask.shape} and {np.shape(lengths)}")
        lengths = np.asarray(lengths)
        if lengths.size and (lengths.min() < 1 or lengths.max() > tokens.shape[1]):
            raise DataError(f"padded rows need lengths between 1 and their width {tokens.shape[1]}, got "
                            f"{lengths.min()} .. {lengths.max()}")
        keep = np.arange(tokens.shape[1])[None] < lengths[:, None]
        offsets = np.concatenate([[0], np.cumsum(keep.sum(axis=1))]).astype(np.int64)
        return cls(tokens[keep].astype(np.int32), loss_mask[keep].astype(bool), offsets, tokens.shape[1])

    def __len__(self) -> int:
        return int(self.offsets.size - 1)

    @property
    def lengths(self) -> np.ndarray:
        """[N] int32 row lengths."""
        return np.diff(self.offsets).astype(np.int32)

    def padded_rows(self, start: int = 0, stop: int | None = None) -> dict[str, np.ndarray]:
        """Rows ``start:stop`` as a batch of the trainer: ``tokens`` and ``loss_mask`` ``[n, max_length]``
        right-padded with 0, ``lengths [n]``."""
        stop = len(self) if stop is None else stop
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"rows {start}:{stop} of {len(self)}")
        offsets = self.offsets[start: stop + 1]
        lengths = np.diff(offsets)
        n = len(lengths)
        tokens = np.zeros((n, self.max_length), np.int32)
        mask = np.zeros((n, self.max_length), bool)
        if n:
            rows = np.repeat(np.arange(n), lengths)
            cols = np.arange(offsets[-1] - offsets[0]) - np.repeat(offsets[:-1] - offsets[0], lengths)
            tokens[rows, cols] = self.ids[offsets[0]: offsets[-1]]
            mask[rows, cols] = self.mask[offsets[0]: offsets[-1]]
        return {"tokens": tokens, "loss_mask": mask, "lengths": lengths.astype(np.int32)}

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        """Row ``index`` as the trainer's pipeline reads it (a grain random-access source)."""
        index = int(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        index %= len(self)
        return {name: rows[0] for name, rows in self.padded_rows(index, index + 1).items()}

    def fingerprint(self, chunk_rows: int = 4096) -> str:
        """sha256 of the rows as padded arrays (shapes and dtypes included), computed a chunk of rows at a time:
        a resumed training run checks it is fed the same data. (The same digest as when the data was kept
        padded in memory, so runs started then still resume.)"""
        h = hashlib.sha256()
        n = len(self)
        for field, dtype in (("tokens", "<i4"), ("loss_mask", "|b1")):
            h.update(f"{field}:{dtype}:{(n, self.max_length)};".encode())
            for start in range(0, n, chunk_rows):
                h.update(self.padded_rows(start, min(start + chunk_rows, n))[field].tobytes())
        lengths = self.lengths
        h.update(f"lengths:{lengths.dtype.str}:{lengths.shape};".encode())
        h.update(lengths.tobytes())
        return h.hexdigest()

    def save(self, path: str | Path) -> None:
        with atomic_write(path) as f:
            np.savez(f, ids=self.ids, mask=self.mask, offsets=self.offsets, max_length=np.int64(self.max_length),
                     num_truncated=np.int64(self.num_truncated),
                     num_without_targets=np.int64(self.num_without_targets))

    @classmethod
    def load(cls, path: str | Path) -> "TokenizedData":
        path = Path(path)
        if not path.is_file():
            raise DataError(f"{path}: tokenized data file not found")
        try:
            with np.load(path, allow_pickle=False) as z:
                missing = [k for k in cls.ARRAYS + ("max_length", "num_truncated", "num_without_targets")
                           if k not in z.files]
                if missing:
                    raise DataError(f"{path}: not a tokenized data file (missing {', '.join(missing)})")
                arrays = {k: z[k] for k in z.files}
                counts = {k: arrays[k] for k in ("max_length", "num_truncated", "num_without_targets")}
                if any(a.shape != () or not np.issubdtype(a.dtype, np.integer) for a in counts.values()):
                    raise DataError(f"{path}: max_length, num_truncated and num_without_targets must be integer "
                                    "scalars")
        except DataError:
            raise
        except Exception as e:  # zipfile, numpy and OS errors for a truncated or foreign file
            raise DataError(f"{path}: cannot read tokenized data ({type(e).__name__}: {e})") from None
        try:
            return cls(arrays["ids"], arrays["mask"], arrays["offsets"], int(counts["max_length"]),
                       int(counts["num_truncated"]), int(counts["num_without_targets"]))
        except DataError as e:
            raise DataError(f"{path}: {e}") from None


def tokenize_examples(tokenizer: Any, examples: Sequence[Example], max_length: int, use_chat_template: bool = True,
                      progress: bool = False, enable_thinking: bool = False, source: str | Path = "the data",
                      chunk_size: int = 1024) -> TokenizedData:
    """Encode every example (as :func:`encode_example`) into padded arrays. Rows without a trained token (a
    prompt without an answer, or an answer cut off by ``max_length``) are dropped and counted. Spans are
    tokenised a chunk of examples at a time: one batched call to a fast tokenizer runs in parallel in Rust."""
    from tqdm import tqdm

    _check_max_length(max_length)
    renderer = SpanRenderer.for_tokenizer(tokenizer, use_chat_template, enable_thinking)
    rows: list[tuple[np.ndarray, np.ndarray]] = []
    num_truncated = num_without_targets = 0
    with tqdm(total=len(examples), desc="tokenize", unit="ex", disable=not progress, file=sys.stderr) as bar:
        for start in range(0, len(examples), chunk_size):
            chunk = examples[start: start + chunk_size]
            rendered = []
            for offset, example in enumerate(chunk):
                try:
                    rendered.append(renderer.spans(example))
                except DataError as e:
                    raise DataError(f"{source}: example {start + offset}: {e}") from None
            all_pieces = tokenize_spans(tokenizer, [spans for _, spans in rendered],
                                        joint=not renderer.use_chat_template)
            for (prefix, spans), pieces in zip(rendered, all_pieces):
                row_ids, mask, truncated = assemble(prefix, pieces, [t for _, t in spans], max_length)
                if not mask.any():
                    num_without_targets += 1
                    continue
                num_truncated += truncated
                rows.append((row_ids, mask))
            bar.update(len(chunk))
    if not rows:
        raise DataError(f"{source}: none of the {len(examples)} examples has a token to train on (every row is a "
                        "prompt without an answer, or its answer starts after max_length); regenerate answers "
                        "first or raise max_length")
    return TokenizedData.from_rows(rows, max_length, num_truncated, num_without_targets)
