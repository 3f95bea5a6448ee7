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
    """Right-padded (with 0) token rows, their loss masks and lengths, ready for the trainer."""

    tokens: np.ndarray  # [N, max_length] int32
    loss_mask: np.ndarray  # [N, max_length] bool
    lengths: np.ndarray  # [N] int32
    num_truncated: int = 0  # rows cut at max_length (kept)
    num_without_targets: int = 0  # rows with no trained token (dropped)

    ARRAYS = ("tokens", "loss_mask", "lengths")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def max_length(self) -> int:
        return int(self.tokens.shape[1])

    def fingerprint(self) -> str:
        """sha256 of the arrays (shapes and dtypes included): a resumed training run checks it is fed the same
        data."""
        h = hashlib.sha256()
        for name in self.ARRAYS:
            a = np.ascontiguousarray(getattr(self, name))
            h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
            h.update(a.tobytes())
        return h.hexdigest()

    def save(self, path: str | Path) -> None:
        with atomic_write(path) as f:
            np.savez(f, tokens=self.tokens, loss_mask=self.loss_mask, lengths=self.lengths,
                     num_truncated=np.int64(self.num_truncated),
                     num_without_targets=np.int64(self.num_without_targets))

    @classmethod
    def load(cls, path: str | Path) -> "TokenizedData":
        path = Path(path)
        if not path.is_file():
            raise DataError(f"{path}: tokenized data file not found")
        try:
            with np.load(path, allow_pickle=False) as z:
                missing = [k for k in cls.ARRAYS + ("num_truncated", "num_without_targets") if k not in z.files]
                if missing:
                    raise DataError(f"{path}: not a tokenized data file (missing {', '.join(missing)})")
                data = cls(z["tokens"], z["loss_mask"], z["lengths"], int(z["num_truncated"]),
                           int(z["num_without_targets"]))
        except DataError:
            raise
        except Exception as e:  # zipfile, numpy and OS errors for a truncated or foreign file
            raise DataError(f"{path}: cannot read tokenized data ({type(e).__name__}: {e})") from None
        n = len(data.lengths)
        if (data.tokens.ndim != 2 or data.tokens.shape != data.loss_mask.shape or data.tokens.shape[0] != n
                or data.tokens.dtype != np.int32 or data.loss_mask.dtype != bool or data.lengths.dtype != np.int32):
            raise DataError(f"{path}: inconsistent arrays (tokens {data.tokens.shape} {data.tokens.dtype}, loss_mask "
                            f"{data.loss_mask.shape} {data.loss_mask.dtype}, lengths {data.lengths.shape})")
        return data


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
    tokens = np.zeros((len(rows), max_length), np.int32)
    loss_mask = np.zeros((len(rows), max_length), bool)
    lengths = np.zeros((len(rows),), np.int32)
    for i, (row_ids, mask) in enumerate(rows):
        tokens[i, : len(row_ids)] = row_ids
        loss_mask[i, : len(mask)] = mask
        lengths[i] = len(row_ids)
    return TokenizedData(tokens, loss_mask, lengths, num_truncated, num_without_targets)
