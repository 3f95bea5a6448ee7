"""Reading training data (every layout; malformed rows reported as file:line and skipped) and tokenising it
into rows whose loss masks cover exactly the target's answers, checked against hand-built expectations."""

import gzip
import json

import numpy as np
import pytest

from cli_tiny import CHARS, SPECIALS, write_harmony_tokenizer, write_tokenizer
from conftest import shared_file
from dflash_jax.data import (
    Conversation, DataError, PlainText, TokenizedData, encode_example, example_to_row, read_examples,
    tokenize_examples,
)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def system(text):
    return {"role": "system", "content": text}


LAYOUTS = [
    ({"messages": [system("be brief"), user("hi"), assistant("hello")]},
     Conversation((system("be brief"), user("hi"), assistant("hello")))),
    ({"id": 7, "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q1"},
                                 {"from": "gpt", "value": "a1"}, {"from": "human", "value": "q2"}]},
     Conversation((system("s"), user("q1"), assistant("a1"), user("q2")))),
    ({"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     Conversation((user("q"), assistant("a")))),
    ({"prompt": "p", "response": "r"}, Conversation((user("p"), assistant("r")))),
    ({"prompt": "p", "completion": "c"}, Conversation((user("p"), assistant("c")))),
    ({"instruction": "do", "input": "this", "output": "done"}, Conversation((user("do\n\nthis"), assistant("done")))),
    ({"instruction": "do", "input": "", "output": "done"}, Conversation((user("do"), assistant("done")))),
    ({"question": "2+2?", "answer": "4"}, Conversation((user("2+2?"), assistant("4")))),
    ({"system": "sys", "prompt": "p", "response": "r"}, Conversation((system("sys"), user("p"), assistant("r")))),
    ({"prompt": "only a prompt"}, Conversation((user("only a prompt"),))),
    ({"prompt": "p", "response": None}, Conversation((user("p"),))),
    ({"text": "plain"}, PlainText("plain")),
    ({"text": "rest", "prompt": "start "}, PlainText("rest", "start ")),
    ({"messages": [user("q"), {"role": "assistant", "content": "a", "thinking": "t"}]},  # gpt-oss's reasoning
     Conversation((user("q"), {"role": "assistant", "content": "a", "thinking": "t"}))),
]


@pytest.mark.parametrize("compress", [False, True])
def test_every_layout(tmp_path, compress):
    path = write_jsonl(tmp_path / "d.jsonl", [row for row, _ in LAYOUTS])
    if compress:
        gz = tmp_path / "d.jsonl.gz"
        gz.write_bytes(gzip.compress(path.read_bytes()))
        path = gz
    examples, stats = read_examples(path)
    assert examples == [expected for _, expected in LAYOUTS]
    assert (stats.read, stats.skipped, stats.warnings) == (len(LAYOUTS), 0, [])
    assert examples[0].has_answer and not examples[9].has_answer
    assert read_examples(path, limit=3)[0] == examples[:3]


def test_rows_written_back_read_the_same(tmp_path):
    examples = [expected for _, expected in LAYOUTS]
    path = write_jsonl(tmp_path / "d.jsonl", [example_to_row(e) for e in examples])
    assert read_examples(path)[0] == examples


MALFORMED = [
    ('{"prompt": "p", "response": ', "not valid JSON"),
    ('["a list"]', "expected a JSON object, got list"),
    ({"title": "x"}, "unknown layout"),
    ({"prompt": 3, "response": "r"}, "'prompt' must be a string, got int"),
    ({"prompt": "p", "response": "  "}, "'response' is empty"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "unknown role 'tool'"),
    ({"messages": [user("a"), user("b")]}, "message 1 is 'user' where 'assistant' was expected"),
    ({"messages": [assistant("a")]}, "message 0 is 'assistant' where 'user' was expected"),
    ({"messages": [system("s")]}, "no user message"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"conversations": [{"from": "human"}]}, "message 0 content must be a string, got NoneType"),
    ({"text": ""}, "'text' is empty"),
    ({"text": "t", "prompt": ["x"]}, "'prompt' must be a string"),
    ({"messages": [user("q"), {"role": "assistant", "content": "a", "thinking": 1}]},
     "message 1 'thinking' must be a string, got int"),
]


def test_malformed_rows_are_reported_with_file_and_line_and_skipped(tmp_path):
    rows = [{"prompt": "good 1"}, ""]  # a blank line is not a row
    for bad, _ in MALFORMED:
        rows.append(bad)
    rows.append({"text": "good 2"})
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    with open(path, "ab") as f:
        f.write(b"\xff\xfe not utf-8\n")
    examples, stats = read_examples(path)
    assert examples == [Conversation((user("good 1"),)), PlainText("good 2")]
    assert stats.read == len(MALFORMED) + 3 and stats.skipped == len(MALFORMED) + 1 and stats.kept == 2
    for (_, reason), warning, lineno in zip(MALFORMED, stats.warnings, range(3, 3 + len(MALFORMED))):
        assert warning.startswith(f"{path}:{lineno}: ") and reason in warning, (warning, reason)
    assert stats.warnings[-1].startswith(f"{path}:{len(rows) + 1}: not valid UTF-8")


def test_file_without_usable_rows_is_an_error_naming_it(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"title": "x"}])
    broken_gz = tmp_path / "broken.jsonl.gz"
    broken_gz.write_bytes(gzip.compress(b'{"text": "x"}\n' * 100)[:30])
    for path, message in ((empty, "no usable rows"), (bad, "bad.jsonl:1: unknown layout"),
                          (tmp_path / "missing.jsonl", "not found"), (broken_gz, "cannot read")):
        with pytest.raises(DataError, match=message) as err:
            read_examples(path)
        assert str(path) in str(err.value)


def test_a_directory_is_read_file_by_file_in_name_order(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", [{"text": "second"}, "oops"])
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(b'{"text": "first"}\n'))
    (tmp_path / "notes.txt").write_text("ignored")
    examples, stats = read_examples(tmp_path)
    assert examples == [PlainText("first"), PlainText("second")]
    assert stats.warnings == [f"{tmp_path / 'b.jsonl'}:2: not valid JSON (Expecting value at column 1)"]
    assert read_examples(tmp_path, limit=1)[0] == [PlainText("first")]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=f"{empty}: no .jsonl"):
        read_examples(empty)


def test_real_gsm8k_file_reads_as_question_answer_conversations():
    examples, stats = read_examples(shared_file("prompts", "gsm8k_test.jsonl"))
    assert len(examples) == 1319 and stats.skipped == 0
    assert all([m["role"] for m in e.messages] == ["user", "assistant"] for e in examples)


# ---------------------------------------------------------------------------------------------------------
# Tokenisation and loss masks


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    """tests/cli_tiny's tokenizer: one id per character (SPECIALS + CHARS; no whitespace, so a newline is
    <unk>), chat template ``{role[0]}:{content}\\n`` and generation prompt ``a:``, BOS <s>."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("chartok")
    write_tokenizer(out)
    return AutoTokenizer.from_pretrained(str(out))


VOCAB = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}  # the same construction, independently indexed


def spell(text):
    """Hand tokenisation for the character tokenizer: one id per character, unknown characters -> <unk>."""
    return [VOCAB.get(ch, VOCAB["<unk>"]) for ch in text]


def spans(*parts):
    """Expected (ids, mask) from (text, trained) parts, with optional leading BOS ids."""
    ids, mask = [], []
    for part, trained in parts:
        piece = part if isinstance(part, list) else spell(part)
        ids += piece
        mask += [trained] * len(piece)
    return ids, mask


@pytest.mark.parametrize("example, use_template, expected", [
    (Conversation((user("hi"), assistant("ok"))), True, spans(("u:hi\na:", False), ("ok", True))),
    (Conversation((system("be"), user("hi"), assistant("ok"), user("yo"), assistant("no"), user("tail"))), True,
     spans(("s:be\nu:hi\na:", False), ("ok", True), ("\nu:yo\na:", False), ("no", True))),
    (Conversation((user("hi"), assistant("ok"))), False, spans(([1], False), ("hi", False), ("ok", True))),
    (Conversation((system("be"), user("hi"), assistant("ok"), user("yo"), assistant("no"))), False,
     spans(([1], False), ("hi", False), ("ok", True), ("yo", False), ("no", True))),
    (PlainText("body", "pre"), True, spans(([1], False), ("pre", False), ("body", True))),
    (PlainText("body"), False, spans(([1], False), ("body", True))),
    (Conversation((user("hi"),)), True, ([], [])),
])
def test_loss_mask_by_hand_for_the_character_tokenizer(char_tokenizer, example, use_template, expected):
    ids, mask, truncated = encode_example(char_tokenizer, example, 64, use_chat_template=use_template)
    assert ids.dtype == np.int32 and mask.dtype == bool and not truncated
    assert ids.tolist() == expected[0] and mask.tolist() == expected[1]


def test_first_token_is_never_a_target(char_tokenizer):
    class NoBos:  # the character tokenizer without a BOS token
        bos_token_id = None
        chat_template = None

        def __call__(self, text, add_special_tokens=False):
            return char_tokenizer(text, add_special_tokens=False)

    ids, mask, _ = encode_example(NoBos(), PlainText("abc"), 8)
    assert ids.tolist() == spell("abc") and mask.tolist() == [False, True, True]


QWEN3_LIKE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@pytest.fixture(scope="module")
def qwen_like_tokenizer(tmp_path_factory):
    """A character tokenizer WITH whitespace, Qwen's special tokens and a template that, like Qwen3's, puts
    the empty think block only before an answer that follows the last user turn (and in the generation prompt
    when thinking is off)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    specials = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = sorted(set(CHARS) | {" ", "\n"})
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    fast.add_tokens(["<think>", "</think>"])  # added, not special: as in Qwen3's tokenizer
    fast.chat_template = QWEN3_LIKE
    out = tmp_path_factory.mktemp("qwenlike")
    fast.save_pretrained(out)
    return AutoTokenizer.from_pretrained(str(out))


def runs(tokenizer, ids, mask):
    """The text of every maximal run of trained (and untrained) tokens, in order."""
    tokens = tokenizer.convert_ids_to_tokens(ids.tolist())
    out, current, state = [], "", None
    for token, trained in zip(tokens, mask.tolist()):
        if trained != state and current:
            out.append((current, state))
            current = ""
        current, state = current + token, trained
    return out + ([(current, state)] if current else [])


def test_qwen3_like_template_each_answer_follows_its_own_generation_prompt(qwen_like_tokenizer):
    tok = qwen_like_tokenizer
    messages = [system("S"), user("u1"), assistant("a1 x"), user("u2"), assistant("a2")]

    def render(msgs, gen):
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, enable_thinking=False)

    think = "<think>\n\n</think>\n\n"
    prompt_1 = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nu1<|im_end|>\n<|im_start|>assistant\n" + think
    between = "\n<|im_start|>user\nu2<|im_end|>\n<|im_start|>assistant\n" + think
    # The template really has the property: the generation prompts are what we expect, and the whole
    # conversation's rendering does NOT extend the first one (no think block before an earlier answer).
    assert render(messages[:2], True) == prompt_1
    assert render(messages[:4], True).endswith(between)
    assert not render(messages, False).startswith(prompt_1)

    ids, mask, _ = encode_example(tok, Conversation(tuple(messages)), 512)
    assert runs(tok, ids, mask) == [(prompt_1, False), ("a1 x<|im_end|>", True), (between, False),
                                    ("a2<|im_end|>", True)]
    # Each span was tokenised on its own: the untrained prefix has exactly the generation prompt's ids.
    n = len(tok(prompt_1, add_special_tokens=False)["input_ids"])
    assert ids[:n].tolist() == tok(prompt_1, add_special_tokens=False)["input_ids"] and not mask[:n].any()

    # Thinking on: the generation prompt has no think block, so neither has the sequence before an answer;
    # the template's empty block before an answer without one is what the target writes there: trained.
    ids, mask, _ = encode_example(tok, Conversation(tuple(messages[:3])), 512, enable_thinking=True)
    assert runs(tok, ids, mask)[0][0].endswith("<|im_start|>assistant\n")
    assert runs(tok, ids, mask)[1] == (think + "a1 x<|im_end|>", True)
    # An answer regenerated with thinking on brings its own think block: it is not given a second one.
    reasoned = assistant("<think>\nr\n</think>\n\na1 x")
    ids, mask, _ = encode_example(tok, Conversation((messages[1], reasoned)), 512, enable_thinking=True)
    assert runs(tok, ids, mask)[1] == (reasoned["content"] + "<|im_end|>", True)


def test_harmony_like_template_trains_the_channel_header(tmp_path):
    """gpt-oss's harmony format: the generation prompt ends at ``<|start|>assistant`` and the template writes
    ``<|channel|>final<|message|>`` before every answer, which the target generates itself: that header goes
    into the sequence (before the fix it was in no span at all) and is trained with the answer. A content
    that opens with its own channel header (a raw regenerated answer) is not given a second one."""
    from transformers import AutoTokenizer

    write_harmony_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    messages = (user("u1"), assistant("a1"), user("u2"), assistant("a2"))
    header = "<|channel|>final<|message|>"
    ids, mask, _ = encode_example(tok, Conversation(messages), 512)
    assert runs(tok, ids, mask) == [
        ("<|start|>user<|message|>u1<|end|><|start|>assistant", False), (header + "a1<|end|>", True),
        ("<|start|>user<|message|>u2<|end|><|start|>assistant", False), (header + "a2<|return|>", True)]
    # The sequence is the template's own rendering of the conversation, token for token.
    assert tok.decode(ids.tolist()) == tok.apply_chat_template(list(messages), tokenize=False)
    # An answer as regeneration stores it (the target's analysis channel, then the final one): its sequence
    # is the generation prompt and exactly the generated text, then <|return|>; and the template, which
    # refuses channel tags in a content, renders the next turn's prompt after it.
    from dflash_jax.data.regenerate import assistant_message
    from dflash_jax.engine.decoder import encode_conversation

    generated = "<|channel|>analysis<|message|>r<|end|><|start|>assistant" + header + "a1"
    answer = assistant_message(generated)
    assert answer == {"role": "assistant", "thinking": "r", "content": "a1"}
    ids, mask, _ = encode_example(tok, Conversation((messages[0], answer)), 512)
    assert runs(tok, ids, mask) == [("<|start|>user<|message|>u1<|end|><|start|>assistant", False),
                                    (generated + "<|return|>", True)]
    assert tok.decode(encode_conversation(tok, [messages[0], answer, messages[2]])) == (
        "<|start|>user<|message|>u1<|end|><|start|>assistant" + header + "a1<|end|>"
        "<|start|>user<|message|>u2<|end|><|start|>assistant")
    # Anything else stays as generated: no final channel, another channel, an empty part.
    for other in ("a1", "<|channel|>analysis<|message|>r", "<|channel|>commentary<|message|>c",
                  header + "  ", "<|channel|>analysis<|message|><|end|><|start|>assistant" + header + "a1"):
        assert assistant_message(other) == {"role": "assistant", "content": other}, other
    assert assistant_message(header + "a1") == {"role": "assistant", "content": "a1"}


def test_tokenize_examples_padding_truncation_and_dropped_rows(char_tokenizer):
    examples = [
        Conversation((user("hi"), assistant("okay"))),  # 7 + 4 tokens: truncated at 9, keeps 2 targets
        Conversation((user("hi"),)),  # prompt only: no target, dropped
        Conversation((user("a long prompt"), assistant("x"))),  # the answer starts after max_length: dropped
        PlainText("xy"),  # BOS + 2
    ]
    data = tokenize_examples(char_tokenizer, examples, max_length=9)
    assert (data.num_truncated, data.num_without_targets, len(data), data.max_length) == (1, 2, 2, 9)
    # Stored back to back: memory follows the rows' own lengths, not max_length.
    assert data.lengths.tolist() == [9, 3] and data.ids.shape == data.mask.shape == (12,)
    assert data.ids.dtype == np.int32 and data.mask.dtype == bool
    first, _, _ = encode_example(char_tokenizer, examples[0], 9)
    assert data[0]["tokens"].tolist() == first.tolist()
    # What the pipeline reads: one row padded to max_length.
    assert data[1]["tokens"].tolist() == [1] + spell("xy") + [0] * 6
    assert data[1]["loss_mask"].tolist() == [False, True, True] + [False] * 6
    assert data[-1]["lengths"] == 3 and data[1]["tokens"].dtype == np.int32
    batch = data.padded_rows()
    assert batch["tokens"].shape == batch["loss_mask"].shape == (2, 9) and batch["lengths"].tolist() == [9, 3]
    assert all((batch[k][i] == data[i][k]).all() for k in batch for i in range(2))
    with pytest.raises(IndexError):
        data[2]
    with pytest.raises(IndexError):
        data.padded_rows(-1)
    with pytest.raises(DataError, match="between 1 and their width 9"):
        TokenizedData.from_padded(batch["tokens"], batch["loss_mask"], np.asarray([10, 3]))
    # A chunked (batched) tokenisation gives the same rows as encoding one example at a time.
    again = tokenize_examples(char_tokenizer, examples, max_length=9, chunk_size=1)
    assert again.fingerprint() == data.fingerprint()

    with pytest.raises(DataError, match="mydata.jsonl.*none of the 2 examples"):
        tokenize_examples(char_tokenizer, examples[1:3], max_length=9, source="mydata.jsonl")


def test_tokenized_data_save_load_and_fingerprint(char_tokenizer, tmp_path):
    data = tokenize_examples(char_tokenizer, [Conversation((user("q"), assistant("answer"))), PlainText("t", "p")],
                             max_length=16)
    path = tmp_path / "data.npz"
    data.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["data.npz"]  # no temporary file left
    back = TokenizedData.load(path)
    assert back.fingerprint() == data.fingerprint() and len(back) == 2
    assert (back.num_truncated, back.num_without_targets) == (data.num_truncated, data.num_without_targets)
    changed = TokenizedData(data.ids, data.mask.copy(), data.offsets, data.max_length)
    changed.mask[1] = ~changed.mask[1]
    assert changed.fingerprint() != data.fingerprint()
    wider = TokenizedData(data.ids, data.mask, data.offsets, data.max_length + 1)
    assert wider.fingerprint() != data.fingerprint()
    assert TokenizedData.from_padded(**data.padded_rows()).fingerprint() == data.fingerprint()

    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(path.read_bytes()[:100])
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, x=np.zeros(3))
    torn = tmp_path / "torn.npz"  # a row past the end of the ids
    np.savez(torn, ids=data.ids, mask=data.mask, offsets=data.offsets + np.arange(len(data.offsets)),
             max_length=np.int64(16), num_truncated=np.int64(0), num_without_targets=np.int64(0))
    vector = tmp_path / "vector.npz"  # a count that is not a scalar
    np.savez(vector, ids=data.ids, mask=data.mask, offsets=data.offsets, max_length=np.int64([16, 16]),
             num_truncated=np.int64(0), num_without_targets=np.int64(0))
    for bad, message in ((truncated, "cannot read"), (foreign, "missing ids"), (tmp_path / "no.npz", "not found"),
                         (torn, "offsets must start at 0 and end at the"), (vector, "integer scalars")):
        with pytest.raises(DataError, match=message) as err:
            TokenizedData.load(bad)
        assert str(bad) in str(err.value)


def test_tokenized_data_fingerprint_is_that_of_the_padded_arrays():
    """The digest is sha256 over the padded arrays as they were once held in memory (so a run started with that
    layout still resumes), built here row by row in plain Python and hashed in one piece."""
    import hashlib

    rng = np.random.default_rng(0)
    rows = [(rng.integers(0, 50, n).astype(np.int32), rng.random(n) < 0.5) for n in (5, 1, 7, 3, 7)]
    data = TokenizedData.from_rows(rows, max_length=7)
    tokens = np.zeros((5, 7), np.int32)
    mask = np.zeros((5, 7), bool)
    for i, (ids, m) in enumerate(rows):
        for j in range(len(ids)):
            tokens[i, j], mask[i, j] = ids[j], m[j]
    lengths = np.asarray([len(ids) for ids, _ in rows], np.int32)
    h = hashlib.sha256()
    for name, a in (("tokens", tokens), ("loss_mask", mask), ("lengths", lengths)):
        h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.tobytes())
    assert data.fingerprint() == h.hexdigest() == data.fingerprint(chunk_rows=2)


@pytest.mark.parametrize("arrays, message", [
    (dict(ids=np.zeros(4, np.int64)), "1-D int32 and bool"),
    (dict(mask=np.zeros(3, bool)), "1-D int32 and bool"),
    (dict(offsets=np.asarray([0, 2, 4.0])), "integer array"),
    (dict(offsets=np.asarray([1, 2, 4])), "start at 0"),
    (dict(offsets=np.asarray([0, 0, 4])), "between 1 and max_length 3"),
    (dict(offsets=np.asarray([0, 4, 4])), "between 1 and max_length 3"),
    (dict(max_length=1), "at least 2"),
])
def test_tokenized_data_refuses_an_inconsistent_layout(arrays, message):
    good = dict(ids=np.arange(4, dtype=np.int32), mask=np.ones(4, bool), offsets=np.asarray([0, 2, 4]), max_length=3)
    TokenizedData(**good)
    with pytest.raises(DataError, match=message):
        TokenizedData(**(good | arrays))


def test_opening_split_never_replays_a_training_start(tmp_path):
    from dflash_jax.data.openings import make_opening_prompts, split_openings

    words = ["Lily", "Lily went", "Lily went home", "Tom", "Tom ran", "A cat", "A dog", "The sun", "The sun was"]
    openings = [w for w in words for _ in range(2)]  # duplicates collapse
    for seed in range(10):
        train, held = split_openings(openings, 3, seed)
        assert len(held) == 3 and len(set(held)) == 3 and not set(train) & set(held)
        for t in train:  # brute force over all pairs
            for h in held:
                assert not t.startswith(h) and not h.startswith(t), (t, h)
        assert set(train) | set(held) <= set(words)
    with pytest.raises(DataError, match="cannot give 9 held-out"):
        split_openings(words, 9)
    src = tmp_path / "raw.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": w.split()[0]},
                                                    {"role": "assistant", "content": w[len(w.split()[0]):] or "!"}]})
                           + "\n" for w in words))
    stats = make_opening_prompts(src, tmp_path / "out", held_out=2)
    assert stats["held_out"] == 2 and stats["read"] == len(words)
    assert len((tmp_path / "out" / "heldout.jsonl").read_text().splitlines()) == 2
