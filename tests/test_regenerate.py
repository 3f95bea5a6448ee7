"""Regeneration on a tiny target: the rows hold the target's own greedy answers (a later turn following its own
earlier answer), a killed run resumes to exactly the uninterrupted output, and settings changes are refused."""

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_tiny import write_harmony_tokenizer, write_tiny_pair
from dflash_jax.data import (
    Conversation, DataError, PlainText, plain_prompt_ids, read_examples, regenerate, tokenize_examples,
)
from dflash_jax.engine.decoder import Decoder, encode_conversation
from dflash_jax.engine.sampling import SamplingConfig
from infer.run import load_decoder
from train.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
SHARD, BATCH, NEW = 3, 4, 8

ROWS = [
    {"prompt": "What?"}, {"question": "Why"}, {"instruction": "Say", "input": "hi", "output": "replaced"},
    {"messages": [{"role": "system", "content": "Be"}, {"role": "user", "content": "one"},
                  {"role": "assistant", "content": "old answer"}, {"role": "user", "content": "two"}]},
    {"prompt": "x"}, {"prompt": "Tell me more"},
    {"conversations": [{"from": "human", "value": "q"}]}, {"prompt": "Go"}, {"prompt": "7+8="},
    {"prompt": "Hm"}, {"text": "Once"},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("regen")
    target, _ = write_tiny_pair(root)
    data = root / "data.jsonl"
    lines = [json.dumps(r) for r in ROWS]
    lines.insert(5, "{not json")  # a malformed line: reported and skipped
    data.write_text("\n".join(lines) + "\n")
    args = argparse.Namespace(target=str(target), ckpt=None, tokenizer=None, dtype="float32", block_size=None)
    decoder, tokenizer, stops = load_decoder(args, need_draft=False)
    return root, target, data, decoder, tokenizer, stops


def run(setup, out, decoder=None, examples=None, tokenizer=None, **overrides):
    _, _, data, default_decoder, default_tokenizer, stops = setup
    kw = dict(batch_size=BATCH, max_new_tokens=NEW, sampling=SamplingConfig(), stop_tokens=stops, seed=0,
              shard_size=SHARD, progress=False)
    kw.update(overrides)
    examples = read_examples(data)[0] if examples is None else examples
    return regenerate(decoder or default_decoder, tokenizer or default_tokenizer, examples, out, **kw)


def shard_texts(out):
    return {p.name: p.read_text() for p in sorted(out.iterdir())}


@pytest.fixture(scope="module")
def reference(setup):
    out = setup[0] / "reference"
    stats = run(setup, out)
    return out, stats


def cli_args(setup, out, *extra):
    _, target, data, *_ = setup
    return ["regenerate", "--target", str(target), "--data", str(data), "--out", str(out), "--shard-size",
            str(SHARD), "--batch-size", str(BATCH), "--max-new-tokens", str(NEW), "--no-progress", *extra]


def greedy_tokens(decoder, stops, ids):
    """Plain greedy decoding of the target for these prompt ids, alone (every row of the batch is this prompt:
    the compiled programs of the regeneration are reused, its batching and ordering are not)."""
    return decoder.generate([ids] * BATCH, NEW, SamplingConfig(), stops, baseline=True).tokens[0]


def greedy_answer(decoder, tokenizer, stops, ids):
    """The greedy answer's text: special tokens kept, the final stop token left out."""
    tokens = greedy_tokens(decoder, stops, ids)
    tokens = tokens[:-1] if tokens and tokens[-1] in stops else tokens
    whole = tokenizer.decode(list(ids) + tokens, skip_special_tokens=False)
    return whole[len(tokenizer.decode(list(ids), skip_special_tokens=False)):]


def test_rows_are_the_targets_own_greedy_answers(setup, reference):
    _, _, _, decoder, tokenizer, stops = setup
    out, stats = reference
    assert sorted(p.name for p in out.iterdir()) == [
        "regenerate.json", "shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl", "shard-00003.jsonl"]
    assert (stats.shards, stats.shards_written, stats.rows_written, stats.skipped) == (4, 4, 11, 0)
    assert stats.answers == 12 and stats.generated_tokens > 0
    settings = json.loads((out / "regenerate.json").read_text())
    assert (settings["max_new_tokens"], settings["shard_size"], settings["stop_tokens"]) == (NEW, SHARD, stops)

    rows = []
    for k in range(4):
        shard, _ = read_examples(out / f"shard-{k:05d}.jsonl")  # the output reads back as training rows
        assert len(shard) == (SHARD if k < 3 else 2)
        rows += shard
    inputs = read_examples(setup[2])[0]
    for row, source in zip(rows, inputs):
        if isinstance(source, PlainText):
            assert row == PlainText(greedy_answer(decoder, tokenizer, stops, plain_prompt_ids(tokenizer, "Once")),
                                    "Once")
            continue
        users = [m for m in source.messages if m["role"] == "user"]
        assert isinstance(row, Conversation) and [m for m in row.messages if m["role"] == "user"] == users
        assert [m["role"] for m in row.messages if m["role"] != "system"] == ["user", "assistant"] * len(users)
        for i, message in enumerate(row.messages):
            if message["role"] == "assistant":  # what the target says after the conversation so far
                ids = encode_conversation(tokenizer, list(row.messages[:i]))
                assert message["content"] == greedy_answer(decoder, tokenizer, stops, ids)
    assert read_examples(out)[0] == rows  # the whole directory, shards in order

    # "finished": every answer of the row ended with a stop token before NEW tokens (both kinds occur here).
    raw = [json.loads(line) for k in range(4) for line in (out / f"shard-{k:05d}.jsonl").read_text().splitlines()]
    unfinished = 0
    for raw_row, row in zip(raw, rows):
        if isinstance(row, PlainText):
            prompts = [plain_prompt_ids(tokenizer, row.prompt)]
        else:
            prompts = [encode_conversation(tokenizer, list(row.messages[:i]))
                       for i, m in enumerate(row.messages) if m["role"] == "assistant"]
        ended = [t[-1] in stops for t in (greedy_tokens(decoder, stops, ids) for ids in prompts)]
        assert raw_row["finished"] == all(ended), raw_row
        unfinished += ended.count(False)
    assert unfinished == stats.unfinished and {r["finished"] for r in raw} == {True, False}
    # data.drop_unfinished: the trainer reads only the rows whose answers all ended.
    whole, read_stats = read_examples(out, drop_unfinished=True)
    assert whole == [row for row, r in zip(rows, raw) if r["finished"]]
    assert read_stats.unfinished == sum(not r["finished"] for r in raw) and read_stats.kept == len(whole)

    data = tokenize_examples(tokenizer, rows, 64)  # ready for training: every row has answer tokens
    assert len(data) == 11 and data.num_without_targets == 0
    multi = rows[3].messages
    assert multi[0] == {"role": "system", "content": "Be"} and len(multi) == 5
    assert multi[2]["content"] != "old answer" and rows[2].messages[1]["content"] != "replaced"


def test_resume_after_kill_9_equals_an_uninterrupted_run(setup, reference, capsys):
    out = setup[0] / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "train", *cli_args(setup, out)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while not (out / "shard-00000.jsonl").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        # Shard 1 holds the second turn of a conversation: a longer prompt, a new compilation, so the run is
        # still going when the first shard appears.
        proc.send_signal(signal.SIGKILL)
    finally:
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err.decode()
    assert (out / "shard-00000.jsonl").exists() and not (out / "shard-00003.jsonl").exists()
    with pytest.raises(DataError, match="incomplete"):  # training refuses a partial regeneration
        read_examples(out)
    (out / "shard-00002.jsonl.tmp").write_text('{"messages": "half a row')  # as if killed mid-write

    assert main(cli_args(setup, out)) == 0
    captured = capsys.readouterr()
    assert f"warning: {setup[2]}:6: not valid JSON" in captured.err
    assert "were already complete" in captured.out
    assert shard_texts(out) == shard_texts(reference[0])  # no missing, no duplicated row, no .tmp left

    assert main(cli_args(setup, out)) == 0  # a complete run: nothing left to do
    assert "wrote 0 shards (4 were already complete)" in capsys.readouterr().out


def test_sampled_run_resumes_to_the_same_rows(setup, tmp_path):
    sampling = SamplingConfig(temperature=1.0, top_k=20)
    examples = [e for i, e in enumerate(read_examples(setup[2])[0]) if i not in (3, 5)]  # short prompts only
    full = tmp_path / "full"
    run(setup, full, examples=examples, sampling=sampling, seed=3)
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    for k in (1, 2):
        (resumed / f"shard-{k:05d}.jsonl").unlink()
    (resumed / "shard-00001.jsonl.tmp").write_text("partial")
    stats = run(setup, resumed, examples=examples, sampling=sampling, seed=3)
    assert (stats.shards_done_before, stats.shards_written) == (1, 2)
    assert shard_texts(resumed) == shard_texts(full)


def test_other_settings_into_the_same_directory_are_refused(setup, reference, capsys):
    out = reference[0]
    before = shard_texts(out)
    for extra, key in ((["--max-new-tokens", "9"], "max_new_tokens"), (["--seed", "1"], "seed"),
                       (["--thinking"], "enable_thinking"), (["--limit", "4"], "data_sha256")):
        assert main(cli_args(setup, out, *extra)) == 2  # a repeated flag: the later value wins
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and key in errors[0] and str(out) in errors[0], err
    assert shard_texts(out) == before
    with pytest.raises(DataError, match="batch_size: 4 -> 2"):
        run(setup, out, batch_size=2)


def test_bad_input_is_one_error_line_naming_the_file(setup, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "no prompt"}\n[1, 2]\n')
    cases = [
        (["--data", str(bad)], "bad.jsonl"),
        (["--data", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
        (["--batch-size", "0"], "--batch-size"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
    ]
    for extra, message in cases:
        args = cli_args(setup, tmp_path / "out") + extra
        assert main(args) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and message in errors[0] and "Traceback" not in err, err
    assert main(["regenerate", "--help"]) == 0
    help_text = capsys.readouterr().out
    for flag in ("--data", "--out", "--stop-token", "--shard-size", "--thinking", "--no-chat-template", "--limit",
                 "--server", "--concurrency", "--chat-template-kwargs", "--api-key-env", "--max-retries",
                 "--coordinator", "--num-processes", "--process-id", "--distributed"):
        assert flag in help_text


def test_thinking_switch_reaches_the_chat_template(setup, tmp_path):
    real = setup[4]
    seen = []

    class Recording:  # the real tokenizer, recording the template's thinking switch
        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, *args, **kwargs):
            return real(*args, **kwargs)

        def apply_chat_template(self, *args, **kwargs):
            seen.append(kwargs.get("enable_thinking"))
            return real.apply_chat_template(*args, **kwargs)

    examples = read_examples(setup[2])[0][:2]
    for thinking in (True, False):
        seen.clear()
        run(setup, tmp_path / str(thinking), examples=examples, tokenizer=Recording(), enable_thinking=thinking)
        assert seen == [thinking] * len(examples)


def test_prompt_too_long_ends_the_conversation(setup, tmp_path):
    decoder = setup[3]
    short = Decoder(dataclasses.replace(decoder.target_config, max_position_embeddings=22), decoder.target_params)
    stats = run(setup, tmp_path / "short", decoder=short, batch_size=2)
    # At most 22 - 8 = 14 prompt tokens: "u:Tell me more\na:" (17) is left out, and the multi-turn
    # conversation (13 tokens for its first turn) ends before its second turn.
    assert stats.skipped == 1 and len(stats.warnings) == 2, stats.warnings
    assert "example 5 turn 1" in stats.warnings[0] and "left out" in stats.warnings[0]
    assert "example 3 turn 2" in stats.warnings[1] and "ends before this turn" in stats.warnings[1]
    rows = read_examples(tmp_path / "short" / "shard-00000.jsonl")[0] + \
        read_examples(tmp_path / "short" / "shard-00001.jsonl")[0]
    assert len(rows) == 5 and [m["role"] for m in rows[3].messages] == ["system", "user", "assistant"]


def test_multi_turn_without_template_answers_from_the_training_context(setup, tmp_path):
    """Without a chat template a later turn is answered from the whole conversation so far, joined as training
    renders it, so the trained answer follows exactly the ids the target answered from."""
    _, _, _, decoder, tokenizer, stops = setup
    conv = Conversation(({"role": "user", "content": "ab"}, {"role": "assistant", "content": "x"},
                         {"role": "user", "content": "cd"}))
    out = tmp_path / "plain"
    run(setup, out, examples=[conv], use_chat_template=False)
    row, = [json.loads(line) for line in (out / "shard-00000.jsonl").read_text().splitlines()]
    first, second = row["messages"][1]["content"], row["messages"][3]["content"]
    assert first == greedy_answer(decoder, tokenizer, stops, plain_prompt_ids(tokenizer, "ab"))
    assert second == greedy_answer(decoder, tokenizer, stops, plain_prompt_ids(tokenizer, "ab" + first + "cd"))
    data = tokenize_examples(tokenizer, read_examples(out)[0], 64, use_chat_template=False)
    ids, mask = data.ids[: data.offsets[1]].tolist(), data.mask[: data.offsets[1]].tolist()
    start = mask.index(True, len(plain_prompt_ids(tokenizer, "ab" + first)) + 1)
    assert ids[:start] == plain_prompt_ids(tokenizer, "ab" + first + "cd")


def test_repeat_answers_every_example_n_times(setup, tmp_path, capsys):
    out = tmp_path / "rep"
    argv = cli_args(setup, out, "--limit", "2", "--repeat", "3", "--temperature", "1.0")
    assert main(argv) == 0
    rows = [json.loads(line) for f in sorted(out.glob("shard-*.jsonl")) for line in f.read_text().splitlines()]
    assert len(rows) == 6
    prompts = [json.dumps(r["messages"][0] if "messages" in r else r["prompt"]) for r in rows]
    assert prompts[:2] == prompts[2:4] == prompts[4:6]  # the file, three times over
    assert main(cli_args(setup, tmp_path / "bad", "--repeat", "0")) == 2
    assert "--repeat must be at least 1" in capsys.readouterr().err


def test_answers_keep_the_special_tokens_the_target_generated(setup):
    """An answer is the text of exactly the ids the target generated, special tokens included (gpt-oss
    writes its channels with them; dropping them would train on a text the target never produced), less the
    final stop token, which the template or the trainer puts back. Checked with a decoder that answers fixed
    ids, so the ids are known."""
    from dflash_jax.data.regenerate import RegenerateStats, _Progress, answer_shard

    _, _, _, decoder, tokenizer, stops = setup
    h, i = tokenizer.convert_tokens_to_ids(["h", "i"])
    answers = [[h, tokenizer.bos_token_id, i, stops[0]], [i, h]]  # a stop at the end; cut at max_new_tokens

    class FixedDecoder:
        target_config = decoder.target_config

        def generate(self, prompts, *args, **kwargs):
            return argparse.Namespace(tokens=answers[: len(prompts)])

    stats = RegenerateStats()
    rows = answer_shard(FixedDecoder(), tokenizer, [PlainText("", "Go"), PlainText("", "x")], 0, 0, batch_size=2,
                        max_new_tokens=4, sampling=SamplingConfig(), stop_tokens=stops, seed=0,
                        use_chat_template=True, enable_thinking=False, stats=stats,
                        progress=_Progress(2, 0, enabled=False))
    assert [(r["text"], r["finished"]) for r in rows] == [("h<s>i", True), ("ih", False)]


def test_a_template_that_refuses_a_turn_ends_that_conversation(setup):
    """A template that raises (gpt-oss's refuses an earlier answer holding channel tokens) ends that
    conversation before the turn, keeping its answers so far, with a warning; an example whose first turn
    cannot be rendered is left out; the other examples are answered as usual."""
    import copy

    from dflash_jax.data.regenerate import RegenerateStats, _Progress, answer_shard

    _, _, _, decoder, tokenizer, stops = setup
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and '<s>' in m['content'] %}"
        "{{ raise_exception('channel tokens in an assistant content') }}{% endif %}"
        "{% if m['content'] == 'bad' %}{{ raise_exception('a bad user turn') }}{% endif %}"
        "{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}a:{% endif %}")
    h, i = tok.convert_tokens_to_ids(["h", "i"])

    class FixedDecoder:
        target_config = decoder.target_config

        def generate(self, prompts, *args, **kwargs):
            return argparse.Namespace(tokens=[[h, tok.bos_token_id, i, stops[0]], [i, h, stops[0]]][: len(prompts)])

    def conversation(*users):
        return Conversation(tuple(m for u in users for m in ({"role": "user", "content": u},
                                                             {"role": "assistant", "content": "old"})))

    stats = RegenerateStats()
    rows = answer_shard(FixedDecoder(), tok, [conversation("one", "two"), conversation("bad"), conversation("x", "y")],
                        0, 0, batch_size=2, max_new_tokens=4, sampling=SamplingConfig(), stop_tokens=stops, seed=0,
                        use_chat_template=True, enable_thinking=False, stats=stats,
                        progress=_Progress(3, 0, enabled=False))
    assert [[m["content"] for m in r["messages"]] for r in rows] == [["one", "h<s>i"], ["x", "ih", "y", "h<s>i"]]
    assert [w.split(": ", 1)[0] for w in stats.warnings] == ["example 1 turn 1", "example 0 turn 2"]
    assert "a bad user turn" in stats.warnings[0] and stats.warnings[0].endswith("example left out")
    assert "channel tokens" in stats.warnings[1] and stats.warnings[1].endswith("the conversation ends before this turn")


def test_harmony_answers_are_stored_as_thinking_and_content(setup, tmp_path):
    """A gpt-oss answer (analysis channel, then final) is stored as gpt-oss's template takes it, ``thinking``
    and ``content``: the next turn's prompt renders (the template refuses channel tags in a content), and
    training on the row puts back exactly the text the target generated after its last generation prompt."""
    from transformers import AutoTokenizer

    from dflash_jax.data import encode_example
    from dflash_jax.data.regenerate import RegenerateStats, _Progress, answer_shard

    write_harmony_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    stop = tok.convert_tokens_to_ids("<|return|>")
    generated = "<|channel|>analysis<|message|>r<|end|><|start|>assistant<|channel|>final<|message|>ok"
    answer_ids = tok(generated, add_special_tokens=False)["input_ids"] + [stop]
    prompts_seen = []

    class FixedDecoder:
        target_config = setup[3].target_config

        def generate(self, prompts, *args, **kwargs):
            prompts_seen.append(tok.decode(prompts[0]))
            return argparse.Namespace(tokens=[answer_ids] * len(prompts))

    example = Conversation(({"role": "user", "content": "one"}, {"role": "assistant", "content": "old"},
                            {"role": "user", "content": "two"}))
    stats = RegenerateStats()
    rows = answer_shard(FixedDecoder(), tok, [example], 0, 0, batch_size=1, max_new_tokens=64,
                        sampling=SamplingConfig(), stop_tokens=[stop], seed=0, use_chat_template=True,
                        enable_thinking=False, stats=stats, progress=_Progress(1, 0, enabled=False))
    answer = {"role": "assistant", "content": "ok", "thinking": "r"}
    assert rows[0]["messages"] == [{"role": "user", "content": "one"}, answer, {"role": "user", "content": "two"},
                                   answer] and not stats.warnings
    assert prompts_seen[1].endswith("<|channel|>final<|message|>ok<|end|><|start|>user<|message|>two<|end|>"
                                    "<|start|>assistant")
    ids, mask, _ = encode_example(tok, Conversation(tuple(rows[0]["messages"])), 512)
    n = len(answer_ids)
    assert ids[-n:].tolist() == answer_ids and mask[-n:].all() and not mask[-n - 1]
    assert tok.decode(ids[:-n]).endswith("<|start|>user<|message|>two<|end|><|start|>assistant")


def test_two_processes_split_the_shards_and_merge_to_the_one_process_output(setup, reference):
    """jax.distributed with two local processes, each on a data=2 mesh of its own two CPU devices: process i
    answers shards k with k mod 2 == i into the same directory, which ends up byte-identical to the one-process
    run (rows do not depend on which process or how many devices answer a shard)."""
    from conftest import free_port

    out = setup[0] / "two-processes"
    coordinator = f"localhost:{free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "train", *cli_args(setup, out), "--coordinator", coordinator, "--num-processes", "2",
         "--process-id", str(i), "--cpu-devices", "2", "--mesh", "data=2"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (stdout, stderr) in zip(procs, outputs):
        assert p.returncode == 0, stderr[-3000:]
    # Four shards: process 0 wrote shards 0 and 2, process 1 shards 1 and 3.
    assert "wrote 2 shards" in outputs[0][0] and "process 0 of 2" in outputs[0][0]
    assert "wrote 2 shards" in outputs[1][0] and "process 1 of 2" in outputs[1][0]
    assert shard_texts(out) == shard_texts(reference[0])


def test_target_fingerprint_ignores_how_the_checkpoint_stored_its_weights():
    """The settings' target hash covers what the target computes: a quantised checkpoint read from another
    path, or dequantised, hashes like its float copy (older regenerations, written before the config recorded
    its quantisation, still resume); weights kept packed do not (their rounding may differ)."""
    from dflash_jax.checkpoints.quantized import Fp8Scheme
    from dflash_jax.configs import load_pairing
    from dflash_jax.data.regenerate import target_config_fingerprint

    config = load_pairing("qwen3-coder-30b-a3b-dflash-b16").target
    assert config.quantization is None and config.experts.weight_block is None
    fields = dataclasses.asdict(config)
    del fields["quantization"], fields["experts"]["weight_block"]  # the fields an older hash did not have
    older = hashlib.sha256(json.dumps(fields, sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()
    assert target_config_fingerprint(config) == older
    for where in ("/a/config.json", "/b/config.json"):
        scheme = Fp8Scheme(block=(128, 128), scale_fmt="float", source=where)
        assert target_config_fingerprint(dataclasses.replace(config, quantization=scheme)) == older
    packed = dataclasses.replace(config, experts=dataclasses.replace(config.experts, weight_format="fp8",
                                                                     weight_block=(128, 128)))
    assert target_config_fingerprint(packed) != older


def test_settings_record_how_drafts_are_verified():
    """Sampled rows depend on how drafts are verified (a tree's walk or block verification draws other random
    numbers than the chain's token-wise rejection): the settings record it, and only when it is not the chain,
    so a directory regenerated before these options existed still resumes."""
    from dflash_jax.data.regenerate import regeneration_settings
    from dflash_jax.data.formats import PlainText

    @dataclasses.dataclass
    class Config:
        vocab_size: int = 8

    class Stub:  # what regeneration_settings reads of a Decoder
        target_config, has_draft, block_size, dtype = Config(), True, 8, "float32"
        tree_budget, tree_auto, block_verify = 0, (), False

    def settings(**kw):
        decoder = Stub()
        decoder.__dict__.update(kw)
        return regeneration_settings(decoder, None, [PlainText("hi")], batch_size=2,
                                     max_new_tokens=4, sampling=SamplingConfig(1.0), stop_tokens=(), seed=0,
                                     shard_size=2, use_chat_template=False, enable_thinking=False)

    chain = settings()
    assert not {"tree_budget", "tree_auto", "block_verify"} & set(chain)
    assert settings(tree_budget=16)["tree_budget"] == 16
    assert settings(tree_auto=(8, 16))["tree_auto"] == [8, 16]
    assert settings(block_verify=True)["block_verify"] is True
