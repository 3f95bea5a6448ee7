"""``python -m infer`` end to end on a tiny Hugging Face target with a tokenizer and a tiny draft, and its
error handling (one clear line, exit code 2)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from cli_tiny import write_tiny_pair
from infer.__main__ import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_tiny_pair(tmp_path_factory.mktemp("cli"))


def run_json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_with_baseline_json(pair, capsys):
    target, draft = pair
    doc = run_json(capsys, ["--target", str(target), "--ckpt", str(draft), "--prompt", "hello there",
                            "--prompt", "a longer prompt, of other length", "--max-new-tokens", "20", "--baseline"])
    assert len(doc["results"]) == 2
    for row in doc["results"]:
        assert row["matches_baseline"] is True
        assert 1 <= len(row["tokens"]) <= 20
        assert sum(row["accept_lengths"]) + 1 == len(row["tokens"])
    s = doc["summary"]
    assert s["dflash"]["tau"] >= 1 and s["speedup"] > 0 and s["baseline"]["tokens_per_s"] > 0


def test_prompt_file_block_size_sampling_and_stream(pair, tmp_path, capsys):
    target, draft = pair
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"question": "q1"}) + "\n" + json.dumps({"turns": ["t1", "t2"]}) + "\n")
    doc = run_json(capsys, ["--target", str(target), "--ckpt", str(draft), "--prompt-file", str(f),
                            "--max-new-tokens", "8", "--block-size", "4", "--temperature", "0.8", "--top-k", "20"])
    assert [r["prompt"] for r in doc["results"]] == ["q1", "t1"]
    assert all(max(r["accept_lengths"] or [1]) <= 4 for r in doc["results"])
    assert main(["--target", str(target), "--ckpt", str(draft), "--prompt", "hi", "--stream",
                 "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr()
    assert "tau" in out.err


@pytest.mark.parametrize("argv, message", [
    (["--ckpt", "{draft}", "--prompt", "x"], "--target"),
    (["--target", "{tmp}/missing", "--ckpt", "{draft}", "--prompt", "x"], "missing"),
    (["--target", "{target}", "--ckpt", "{draft}", "--prompt", "x", "--block-size", "99"], "block"),
    (["--target", "{target}", "--ckpt", "{draft}", "--prompt", "x", "--max-new-tokens", "5000"], "exceeds"),
    (["--target", "{target}", "--ckpt", "{draft}", "--prompt", "x", "--temperature", "nan"], "finite"),
    (["--target", "{target}", "--ckpt", "{draft}", "--prompt-file", "{tmp}/one.json"], "JSON list"),
    (["--target", "{target}", "--ckpt", "{draft}", "--prompt-file", "{tmp}/empty.txt"], "no prompts"),
    (["--target", "{target}", "--ckpt", "{draft}", "--prompt", "x", "--temperature", "-1"], "temperature"),
    (["--target", "{target}", "--ckpt", "{draft}", "--prompt-file", "{tmp}/nope.txt"], "nope.txt"),
    (["--target", "{target}", "--ckpt", "{draft}"], "--prompt"),
    (["--target", "{target}", "--ckpt", "{target}", "--prompt", "x"], "draft"),
    (["--target", "{target}", "--ckpt", "{draft}", "--prompt", "x", "--bogus"], "--bogus"),
    (["--target", "{target}", "--ckpt", "{draft}", "--prompt", "x", "--attention", "flash"], "--attention"),
] + ([] if jax.default_backend() == "gpu" else [
    (["--target", "{target}", "--ckpt", "{draft}", "--prompt", "x", "--attention", "cudnn"], "needs a CUDA GPU"),
]))
def test_bad_input_is_one_clear_error(pair, tmp_path, capsys, argv, message):
    target, draft = pair
    (tmp_path / "one.json").write_text('"hello"')
    (tmp_path / "empty.txt").write_text("\n  \n")
    argv = [a.format(target=target, draft=draft, tmp=tmp_path) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err, err


def test_help_explains_flags(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--target", "--ckpt", "--block-size", "--baseline", "--json", "--stream", "--top-p"):
        assert flag in out


def test_demo_with_the_shipped_pair_runs_offline(tmp_path):
    """The README's first command, from a folder with no ../shared beside it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "infer", "demo", "--max-new-tokens", "64", "--repeats", "2"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "identical to the baseline: True" in proc.stdout
    assert "tau     :" in proc.stdout and "median of 2 interleaved pairs" in proc.stdout
    assert "AR steps here" in proc.stdout and "a large target at batch 1 on a GPU" in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--repeats", "two"], "--repeats"),
    (["--block-size", "1"], "--block-size must be at least 2"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
])
def test_demo_bad_values_are_one_clear_error(capsys, argv, message):
    assert main(["demo"] + argv) == 2  # refused before anything loads
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err, err


def test_demo_help_explains_every_flag(capsys):
    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--prompt", "--max-new-tokens", "--block-size", "--repeats", "interleaved", "round cost"):
        assert flag in out


def test_demo_verifies_a_tree(capsys):
    """``demo --tree 16``: the shipped pair through tree verification, still identical to the baseline."""
    assert main(["demo", "--tree", "16", "--max-new-tokens", "32", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "identical to the baseline: True" in out and "verify of a tree of 16 drafts" in out


def test_demo_figures_median_pair_and_round_cost():
    """The speedup is an actual pair's ratio (the lower median), and that pair's round cost explains it
    exactly: speedup = tau / round cost when both decode the same tokens."""
    from types import SimpleNamespace as R

    from infer.demo import format_figures, pair_figures

    decoded, rounds = 199, 50  # tau = 199 / 50
    times = [(0.030, 0.045), (0.040, 0.044), (0.031, 0.041), (0.033, 0.047)]  # ratios 1.5, 1.1, 1.32, 1.42
    pairs = [(R(decode_s=d, rounds=[rounds]), R(decode_s=b, rounds=[decoded])) for d, b in times]
    f = pair_figures(pairs)
    assert f["speedup"] == pytest.approx(0.041 / 0.031)  # the lower of the middle two
    assert decoded / rounds / f["round_cost"] == pytest.approx(f["speedup"])
    assert f["q1"] < f["speedup"] < f["q3"]
    text = format_figures(f, decoded / rounds, decoded, "8 tokens")
    assert "1.32x" in text and "median of 4 interleaved pairs" in text and "all 1.10-1.50x" in text
    assert f"= {f['speedup']:.2f}x" in text and "~4.0x" in text and len(text.splitlines()) == 4


def test_generate_without_target_uses_the_shipped_pair(capsys):
    doc = run_json(capsys, ["--prompt", "Once upon a time", "--max-new-tokens", "24", "--baseline"])
    row = doc["results"][0]
    assert row["matches_baseline"] and len(row["tokens"]) == 24
    assert row["text"].startswith((" ", ",", "."))  # a continuation of the prompt, spacing kept


def test_nothing_decoded_after_prefill_gives_no_speedup_not_a_crash(pair, capsys):
    target, draft = pair
    doc = run_json(capsys, ["--target", str(target), "--ckpt", str(draft), "--prompt", "hi", "--max-new-tokens", "1",
                            "--baseline"])
    assert doc["summary"]["speedup"] is None and doc["summary"]["dflash"]["tau"] is None
    assert [len(r["tokens"]) for r in doc["results"]] == [1]


def test_stream_waits_for_complete_characters():
    import io

    from infer.run import TextStream

    class ByteTokenizer:  # ids are UTF-8 bytes, like a byte-level BPE split inside a character
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    prompt = list("é".encode())  # the prompt is decoded with the answer, then cut off
    ids = list("日本".encode())
    out = io.StringIO()
    stream = TextStream(ByteTokenizer(), prompt, out)
    for n in (2, 4, len(ids)):
        stream([ids[:n]])
    assert out.getvalue() == "日本"


def test_generate_from_orbax_target_and_draft(pair, tmp_path, capsys):
    """--target and --ckpt may be Orbax checkpoints made by `convert` (the tokenizer travels in hf_extra/)."""
    target, draft = pair
    assert main(["convert", "--from", str(target), "--to", str(tmp_path / "t"), "--no-progress"]) == 0
    assert main(["convert", "--from", str(draft), "--to", str(tmp_path / "d"), "--no-progress"]) == 0
    capsys.readouterr()
    argv = ["--prompt", "hello", "--max-new-tokens", "10"]
    from_orbax = run_json(capsys, ["--target", str(tmp_path / "t"), "--ckpt", str(tmp_path / "d")] + argv)
    from_hf = run_json(capsys, ["--target", str(target), "--ckpt", str(draft)] + argv)
    assert from_orbax["results"][0]["tokens"] == from_hf["results"][0]["tokens"]
    assert from_orbax["results"][0]["text"] == from_hf["results"][0]["text"]


def test_prompt_ids_are_fed_as_is(pair, capsys):
    """--prompt-ids gives the same tokens as the text prompt whose ids they are (the char tokenizer: BOS 1, then
    one id per character), and bad ids are one error line."""
    target, draft = pair
    from dflash_jax.checkpoints.loading import load_tokenizer

    tok = load_tokenizer(target)
    ids = tok("hello", add_special_tokens=True)["input_ids"]
    argv = ["--target", str(target), "--ckpt", str(draft), "--max-new-tokens", "12", "--no-chat-template"]
    by_text = run_json(capsys, argv + ["--prompt", "hello"])["results"][0]
    by_ids = run_json(capsys, argv + ["--prompt-ids", ",".join(map(str, ids))])["results"][0]
    assert by_ids["tokens"] == by_text["tokens"] and by_ids["prompt"] == "ids:" + ",".join(map(str, ids))
    assert main(argv + ["--prompt-ids", "1,x"]) == 2
    assert "expected comma-separated integers" in capsys.readouterr().err
    assert main(argv + ["--prompt-ids", "1,5000"]) == 2
    assert "outside the target's vocabulary" in capsys.readouterr().err
