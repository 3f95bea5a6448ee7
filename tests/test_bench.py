"""``python -m infer bench`` and ``dflash_jax.evaluation``: prompt loaders (real and synthetic files), the
benchmark loop end to end on stories260K with an untrained draft, the report files, and user errors."""

import contextlib
import gzip
import io
import json
from pathlib import Path

import pytest

from conftest import shared_file
from dflash_jax.errors import UserError
from dflash_jax.evaluation.bench import conversation_ids, markdown_table, summarize_dataset
from dflash_jax.evaluation.prompts import DATASETS, MATH_SUFFIX, load_datasets
from infer import bench as bench_cli

BLOCK = 8
MAX_NEW = 6

# ---------------------------------------------------------------------------------------------------------
# Loaders on the real files


@pytest.mark.parametrize("name, rows, turns", [
    ("gsm8k", 1319, 1), ("math500", 500, 1), ("humaneval", 164, 1),
    # sanitized-mbpp.json holds 427 tasks; the test split (task_id 11..510) keeps 257 of them, like the
    # Hugging Face "sanitized" test split the paper's script loads.
    ("mbpp", 257, 1), ("mt-bench", 80, 2), ("alpaca", 805, 1),
])
def test_real_prompt_files(name, rows, turns):
    prompts = shared_file("prompts")
    samples = DATASETS[name](prompts)
    assert len(samples) == rows
    assert all(len(s) == turns and all(isinstance(t, str) and t.strip() for t in s) for s in samples)
    if name in ("gsm8k", "math500"):
        assert all(s[0].endswith("\n" + MATH_SUFFIX) for s in samples)
    if name == "gsm8k":
        assert samples[0][0].startswith("Janet\u2019s ducks lay 16 eggs per day.")
    if name == "humaneval":
        assert "def has_close_elements(" in samples[0][0]
    if name == "mbpp":
        raw = json.loads((prompts / "sanitized-mbpp.json").read_text())
        assert samples[0] == [next(r["prompt"] for r in raw if r["task_id"] >= 11)]


def test_load_datasets_takes_the_first_samples_in_file_order():
    prompts = shared_file("prompts")
    got = load_datasets(prompts, ["mt-bench", "gsm8k"], 3)
    assert list(got) == ["mt-bench", "gsm8k"]
    assert got["gsm8k"] == DATASETS["gsm8k"](prompts)[:3]
    assert got["mt-bench"][0][0].startswith("Compose an engaging travel blog post")


# ---------------------------------------------------------------------------------------------------------
# Loaders on synthetic files (no shared data needed)


def write_prompts(root: Path, gsm8k="Tom has 3 apples. How many?",
                  mt_turns=("Once upon a time, there was a little girl named Lily. She liked to play with her big "
                            "red ball in the park with her mom and dad. One day, it rained.", "Go on.")) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "gsm8k_test.jsonl").write_text(
        json.dumps({"question": gsm8k, "answer": "3"}) + "\n\n" + json.dumps({"question": "Q2", "answer": "x"}) + "\n")
    (root / "math500_test.jsonl").write_text(json.dumps({"problem": "What is $1+1$?", "answer": "2"}) + "\n")
    with gzip.open(root / "HumanEval.jsonl.gz", "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f(x):\n    \"\"\"Return x.\"\"\"\n"}) + "\n")
    (root / "sanitized-mbpp.json").write_text(json.dumps(
        [{"task_id": i, "prompt": f"Write function {i}."} for i in (2, 11, 300, 510, 511, 600)]))
    (root / "mt_bench_question.jsonl").write_text(
        json.dumps({"question_id": 81, "category": "writing", "turns": list(mt_turns)}) + "\n")
    (root / "alpaca_eval_instructions.jsonl").write_text(json.dumps({"instruction": "Say hi."}) + "\n")
    return root


def test_synthetic_loaders(tmp_path):
    root = write_prompts(tmp_path / "prompts")
    got = load_datasets(root, list(DATASETS))
    assert got["gsm8k"] == [[f"Tom has 3 apples. How many?\n{MATH_SUFFIX}"], [f"Q2\n{MATH_SUFFIX}"]]
    assert got["math500"] == [[f"What is $1+1$?\n{MATH_SUFFIX}"]]
    assert len(got["humaneval"]) == 1 and "def f(x):" in got["humaneval"][0][0]
    assert got["mbpp"] == [[f"Write function {i}."] for i in (11, 300, 510)]
    assert len(got["mt-bench"]) == 1 and len(got["mt-bench"][0]) == 2
    assert got["alpaca"] == [["Say hi."]]
    assert load_datasets(root, ["gsm8k"], 1)["gsm8k"] == got["gsm8k"][:1]


def test_malformed_rows_name_the_file_and_line(tmp_path):
    root = write_prompts(tmp_path / "prompts")
    (root / "gsm8k_test.jsonl").write_text(json.dumps({"question": "ok"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"gsm8k_test\.jsonl:2: not valid JSON"):
        DATASETS["gsm8k"](root)
    (root / "alpaca_eval_instructions.jsonl").write_text(json.dumps({"instruction": "ok"}) + "\n"
                                                         + json.dumps({"prompt": "wrong field"}) + "\n")
    with pytest.raises(ValueError, match=r"alpaca_eval_instructions\.jsonl:2: .*'instruction'"):
        DATASETS["alpaca"](root)
    (root / "mt_bench_question.jsonl").write_text(json.dumps({"turns": "not a list"}) + "\n")
    with pytest.raises(ValueError, match=r"mt_bench_question\.jsonl:1: .*'turns'"):
        DATASETS["mt-bench"](root)
    (root / "sanitized-mbpp.json").write_text(json.dumps([{"task_id": 11}]))
    with pytest.raises(ValueError, match=r"sanitized-mbpp\.json:entry 0 .*'prompt'"):
        DATASETS["mbpp"](root)
    (root / "HumanEval.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match=r"HumanEval\.jsonl\.gz"):
        DATASETS["humaneval"](root)


def test_missing_file_and_unknown_name(tmp_path):
    root = write_prompts(tmp_path / "prompts")
    (root / "math500_test.jsonl").unlink()
    with pytest.raises(UserError, match="math500_test.jsonl"):
        load_datasets(root, ["math500"])
    with pytest.raises(ValueError, match="valid names: gsm8k, math500"):
        load_datasets(root, ["gsm9k"])
    with pytest.raises(UserError, match="prompts directory"):
        load_datasets(tmp_path / "nowhere", ["gsm8k"])


def test_summary_metrics_by_hand():
    def row(sample, base, flash, acc, ident=True):
        return {"sample": sample, "accept_lengths": acc, "identical": ident,
                "baseline": {"tokens": base[0], "tpot_ms": base[1]},
                "dflash": {"tokens": flash[0], "tpot_ms": flash[1]}}

    rows = [row(0, (10, 4.0), (10, 1.0), [3, 1, 4, 1]), row(0, (5, 2.0), (5, 1.0), [4], False),
            row(1, (1, None), (1, None), []), {"sample": 2, "skipped": "too long"}]
    s = summarize_dataset(rows, 4, greedy=True)
    assert s["samples"] == 3 and s["turns"] == 3 and s["skipped_turns"] == 1 and s["timed_turns"] == 2
    assert s["tau"] == pytest.approx(13 / 5)
    assert s["tpot_baseline_ms"] == pytest.approx(3.0) and s["tpot_dflash_ms"] == pytest.approx(1.0)
    assert s["speedup"] == pytest.approx(3.0)
    assert s["acceptance_histogram"] == [2, 0, 1, 2]
    assert s["identical"] == pytest.approx(2 / 3)
    assert summarize_dataset(rows, 4, greedy=False)["identical"] is None
    assert "rounds_per_width" not in s  # fixed block: nothing to count
    rows[0]["widths"], rows[1]["widths"], rows[2]["widths"] = [4, 1, 4, 1], [2], []
    adaptive = summarize_dataset(rows, 4, greedy=True)
    assert adaptive["rounds_per_width"] == {"1": 2, "2": 1, "4": 2}
    table = markdown_table({"settings": {"temperature": 0.0}, "summary": {"gsm8k": adaptive}, "mean": {}})
    assert table.splitlines()[-1] == "Adaptive block size, rounds per verify width: gsm8k 1: 2, 2: 1, 4: 2"


# ---------------------------------------------------------------------------------------------------------
# End to end: stories260K + an untrained draft through the CLI


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    from dflash_jax.assets import DEMO_TARGET
    from dflash_jax.checkpoints.official_draft import init_draft_params, save_draft
    from dflash_jax.models.config import TargetConfig
    from dflash_jax.models.draft_config import DraftConfig

    work = tmp_path_factory.mktemp("bench")
    target = DEMO_TARGET  # the shipped stories260K, with an untrained draft (tau ~ 1: the plumbing is tested)
    config = DraftConfig.for_target(TargetConfig.from_json(target / "config.json"), num_layers=2,
                                    block_size=BLOCK, mask_token_id=0)
    draft = save_draft(config, init_draft_params(config, seed=0), work / "draft")
    # Synthetic prompts sized so that every prompt (gsm8k, both MT-Bench turns) pads to the same 256-token
    # bucket: the baseline and DFlash then compile once each, which keeps this module fast.
    prompts = write_prompts(work / "prompts")
    out = work / "out"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = bench_cli.main(["--target", str(target), "--ckpt", str(draft), "--prompts-dir", str(prompts),
                             "--max-samples", "1", "--datasets", "gsm8k,mt-bench", "--max-new-tokens", str(MAX_NEW),
                             "--no-chat-template", "--out", str(out)])
    return rc, out, target, printed.getvalue()


def test_bench_end_to_end(bench_run):
    rc, out, _, stdout = bench_run
    assert rc == 0
    for name in ("results.json", "results.md", "acceptance.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0
    assert (out / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads((out / "results.json").read_text())
    assert doc["meta"]["block_size"] == BLOCK and doc["meta"]["max_new_tokens"] == MAX_NEW
    assert doc["meta"]["temperature"] == 0.0 and doc["meta"]["machine"]["backend"] == "cpu"
    assert doc["meta"]["target"].endswith("target")
    assert list(doc["summary"]) == ["gsm8k", "mt-bench"]
    for name, s in doc["summary"].items():
        assert s["samples"] == 1 and s["skipped_turns"] == 0
        assert 1 <= s["tau"] <= BLOCK
        assert s["identical"] == 1.0
        assert len(s["acceptance_histogram"]) == BLOCK
        assert s["speedup"] > 0 and s["tpot_baseline_ms"] > 0 and s["tpot_dflash_ms"] > 0
    assert doc["summary"]["gsm8k"]["turns"] == 1 and doc["summary"]["mt-bench"]["turns"] == 2
    for r in doc["turns"]:
        assert r["identical"] is True
        assert 1 <= r["dflash"]["tokens"] <= MAX_NEW and r["dflash"]["tokens"] == r["baseline"]["tokens"]
        # Every decode round commits its acceptance length; the first token comes from the prefill.
        assert sum(r["accept_lengths"]) + 1 == r["dflash"]["tokens"]
        assert all(1 <= a <= BLOCK for a in r["accept_lengths"])
        assert r["dflash"]["compile_s"] >= 0 and r["dflash"]["decode_s"] >= 0
    hist = doc["summary"]["mt-bench"]["acceptance_histogram"]
    mt = [r for r in doc["turns"] if r["dataset"] == "mt-bench"]
    assert sum(hist) == sum(len(r["accept_lengths"]) for r in mt)
    table = (out / "results.md").read_text()
    assert "| dataset | samples | tau | speedup | TPOT baseline ms | TPOT DFlash ms | identical |" in table
    assert "| gsm8k | 1 |" in table and "| mt-bench | 1 |" in table and "| mean |" in table
    # The CLI printed the same table and the output paths.
    assert markdown_table({k: doc[k] for k in ("summary", "mean", "settings")}) in stdout
    assert str(out / "results.json") in stdout and str(out / "acceptance.png") in stdout
    # Every prompt pads to the bench ladder's first width (256): at most 4 programs (fewer when this process
    # compiled one of them before), counted and printed.
    assert 0 < doc["programs_compiled"] <= 4
    assert f"programs compiled: {doc['programs_compiled']} " in stdout


def test_second_turn_follows_the_first_answer(bench_run):
    _, out, target, _ = bench_run
    from dflash_jax.checkpoints.loading import load_tokenizer

    doc = json.loads((out / "results.json").read_text())
    first, second = [r for r in doc["turns"] if r["dataset"] == "mt-bench"]
    assert (first["turn"], second["turn"]) == (0, 1) and first["sample"] == second["sample"] == 0
    assert first["output"].strip()
    tok = load_tokenizer(target)
    messages = [{"role": "user", "content": first["user"]}, {"role": "assistant", "content": first["output"]},
                {"role": "user", "content": second["user"]}]
    ids = conversation_ids(tok, messages, use_chat_template=False)
    assert second["prompt_tokens"] == len(ids)
    assert first["output"].strip() in tok.decode(ids, skip_special_tokens=True)
    assert second["prompt_tokens"] > first["prompt_tokens"] + len(tok(second["user"])["input_ids"]) - 1


# ---------------------------------------------------------------------------------------------------------
# User errors: one 'error: ...' line, exit code 2, before any model is loaded


def run_error(capsys, argv):
    rc = bench_cli.main(["--target", "nowhere/target", "--ckpt", "nowhere/draft", *argv])
    err = capsys.readouterr().err.strip()
    return rc, err


def test_unknown_dataset_is_one_clear_error(capsys, tmp_path):
    rc, err = run_error(capsys, ["--prompts-dir", str(write_prompts(tmp_path / "p")), "--datasets", "gsm8k,gsm9k"])
    assert rc == 2 and len(err.splitlines()) == 1
    assert err.startswith("error: unknown dataset 'gsm9k'") and "gsm8k, math500, humaneval, mbpp" in err


def test_missing_prompts_dir_is_one_clear_error(capsys, tmp_path):
    rc, err = run_error(capsys, ["--prompts-dir", str(tmp_path / "absent")])
    assert rc == 2 and len(err.splitlines()) == 1
    assert err.startswith("error: prompts directory not found") and "absent" in err


def test_missing_prompt_file_is_one_clear_error(capsys, tmp_path):
    root = write_prompts(tmp_path / "p")
    (root / "HumanEval.jsonl.gz").unlink()
    rc, err = run_error(capsys, ["--prompts-dir", str(root), "--datasets", "humaneval"])
    assert rc == 2 and len(err.splitlines()) == 1 and "HumanEval.jsonl.gz" in err


def test_bad_numbers_and_help(capsys):
    rc, err = run_error(capsys, ["--max-samples", "-1"])
    assert rc == 2 and "--max-samples" in err
    rc, err = run_error(capsys, ["--max-new-tokens", "0"])
    assert rc == 2 and "--max-new-tokens" in err
    assert bench_cli.build_parser().parse_args(["--target", "t", "--ckpt", "d"]).max_new_tokens == 2048
    assert bench_cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--prompts-dir", "--datasets", "--max-samples", "--seed", "--out", "--no-chat-template",
                 "--max-new-tokens", "default 2048"):
        assert flag in text


# ---------------------------------------------------------------------------------------------------------
# run_bench with stand-ins (no model): conversation building, skipped turns, chat template


class FakeTokenizer:
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if i > 2)

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, enable_thinking):
        assert not tokenize and add_generation_prompt and enable_thinking is False
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class FakeDecoder:
    has_draft, block_size, limit = True, 4, 80

    def __init__(self):
        self.calls = []

    def check_fits(self, lengths, max_new_tokens):
        if max(lengths) + max_new_tokens > self.limit:
            raise UserError(f"a prompt of {max(lengths)} tokens does not\n fit")

    def generate(self, prompts, max_new_tokens, sampling, stop_tokens, baseline=False, seed=0):
        from dflash_jax.engine.generate import GenerationResult

        self.calls.append((list(prompts[0]), baseline))
        tokens = [ord(c) for c in "ok!"][:max_new_tokens]
        acc = [] if baseline else [2]
        return GenerationResult([tokens], [acc], [len(acc)], 0.001, 0.002 if baseline else 0.001, 0.5)


@pytest.mark.parametrize("template", [False, True])
def test_run_bench_follows_the_conversation(template):
    from dflash_jax.evaluation.bench import run_bench
    from dflash_jax.engine.sampling import SamplingConfig

    tok, dec = FakeTokenizer(), FakeDecoder()
    if template:
        tok.chat_template = "{{ fake }}"
    data = {"mt-bench": [["first question", "second"], ["x" * 80, "never asked"]], "gsm8k": [["q"]]}
    res = run_bench(dec, tok, [2], data, 3, SamplingConfig(), 0, use_chat_template=template, progress=False)
    # Baseline then DFlash for each of the three turns that fit; the over-long sample is skipped whole.
    assert [b for _, b in dec.calls] == [True, False] * 3
    second_prompt = tok.decode(dec.calls[2][0])
    expected = ("<user>first question<assistant>ok!<user>second<assistant>" if template
                else "first question\n\nok!\n\nsecond")
    assert second_prompt == expected
    s = res["summary"]["mt-bench"]
    assert s["samples"] == 2 and s["turns"] == 2 and s["skipped_turns"] == 2
    skipped = [r for r in res["turns"] if r.get("skipped")]
    assert [r["turn"] for r in skipped] == [0, 1] and "does not fit" in skipped[0]["skipped"]
    assert s["tau"] == 2.0 and s["speedup"] == pytest.approx(2.0) and s["identical"] == 1.0
    assert s["acceptance_histogram"] == [0, 2, 0, 0]
    assert res["settings"]["chat_template"] is template
    assert res["mean"]["tau"] == 2.0


def test_sampling_report_without_identity(tmp_path):
    from dflash_jax.evaluation.bench import run_bench, write_report
    from dflash_jax.engine.sampling import SamplingConfig

    data = {"alpaca": [["hi"]], "humaneval": [["y" * 90]]}  # humaneval: every turn skipped
    res = run_bench(FakeDecoder(), FakeTokenizer(), [2], data, 3, SamplingConfig(temperature=0.7), 5,
                    progress=False)
    assert res["summary"]["alpaca"]["identical"] is None and res["turns"][0]["identical"] is None
    assert res["summary"]["humaneval"]["tau"] is None and res["summary"]["humaneval"]["speedup"] is None
    paths = write_report(res, tmp_path / "r", {"target": "t", "draft": "d"})
    table = paths["markdown"].read_text()
    assert "| alpaca | 1 | 2.00 | 2.00x |" in table and "n/a (sampling)" in table
    assert "| humaneval | 1 (1 turn skipped) | - | - |" in table
    doc = json.loads(paths["json"].read_text())
    assert doc["meta"]["temperature"] == 0.7 and doc["settings"]["seed"] == 5 and doc["meta"]["target"] == "t"
    assert paths["plot"].stat().st_size > 0


def test_bench_on_a_tiny_hf_target_with_chat_template(tmp_path, capsys):
    """Runs without the shared data: a tiny Hugging Face target saved in the test (character tokenizer with a
    chat template), a tiny draft, synthetic prompt files."""
    from cli_tiny import write_tiny_pair

    target, draft = write_tiny_pair(tmp_path / "models")
    prompts = write_prompts(tmp_path / "prompts", mt_turns=("Tell a story.", "Go on."))
    out = tmp_path / "out"
    rc = bench_cli.main(["--target", str(target), "--ckpt", str(draft), "--prompts-dir", str(prompts),
                         "--max-samples", "1", "--datasets", "gsm8k,mt-bench", "--max-new-tokens", "6",
                         "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads((out / "results.json").read_text())
    assert all(s["identical"] == 1.0 and 1 <= s["tau"] <= 8 for s in doc["summary"].values())
    first, second = [r for r in doc["turns"] if r["dataset"] == "mt-bench"]
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["dflash"]["tokens"] - 1


@pytest.mark.parametrize("tree", [0, 6, "auto"])
def test_bench_on_a_prompt_file(tmp_path, tree):
    """--prompt-file runs your own prompts (here: story openings on the shipped stories260K) as a dataset; with
    --tree the rounds verify a tree (the answers still equal the baseline's); with --tree auto the report
    counts every round under the budget it ran (0: the chain)."""
    from dflash_jax.assets import DEMO_TARGET
    from dflash_jax.checkpoints.official_draft import init_draft_params, save_draft
    from dflash_jax.models.config import TargetConfig
    from dflash_jax.models.draft_config import DraftConfig

    config = DraftConfig.for_target(TargetConfig.from_json(DEMO_TARGET / "config.json"), num_layers=1,
                                    block_size=BLOCK, mask_token_id=0)
    draft = save_draft(config, init_draft_params(config, seed=0), tmp_path / "draft")
    prompts = tmp_path / "openings.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Once upon a time", "Tom had a"]))
    with contextlib.redirect_stdout(io.StringIO()):
        rc = bench_cli.main(["--target", str(DEMO_TARGET), "--ckpt", str(draft), "--prompt-file", str(prompts),
                             "--max-new-tokens", "12", "--no-chat-template", "--out", str(tmp_path / "out")]
                            + (["--tree", str(tree)] if tree else [])
                            + (["--tree-budgets", "4,8"] if tree == "auto" else []))
    assert rc == 0
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["meta"]["tree_budget"] == (0 if tree == "auto" else tree)
    if tree == "auto":
        assert doc["meta"]["tree_auto"] == [4, 8]
        rounds = sum(len(r["accept_lengths"]) for r in doc["turns"])
        per_budget = doc["summary"]["openings"]["tree_auto"]["rounds_per_budget"]
        assert set(per_budget) <= {"0", "4", "8"} and sum(per_budget.values()) == rounds > 0
    assert list(doc["summary"]) == ["openings"] and doc["summary"]["openings"]["samples"] == 2
    assert doc["summary"]["openings"]["identical"] == 1.0


def test_bench_replay_of_width_schedules(tmp_path, capsys):
    """--replay on the shipped demo pair: every turn keeps the teacher-forced acceptance of each position of
    its answer and the measured round costs; replaying the adaptive policy on them takes the engine's own
    widths; the best possible schedule is at least as fast as both the full block and the policy."""
    import numpy as np

    from dflash_jax.assets import DEMO_DRAFT, DEMO_TARGET
    from dflash_jax.evaluation.replay import replay_adaptive

    prompts = tmp_path / "openings.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                               ["Once upon a time, there was a little girl named Lily.", "Tom had a big red ball."]))
    args = ["--target", str(DEMO_TARGET), "--ckpt", str(DEMO_DRAFT), "--prompt-file", str(prompts),
            "--max-new-tokens", "40", "--no-chat-template", "--out", str(tmp_path / "out"), "--replay"]
    assert bench_cli.main(args) == 2  # no --adaptive
    assert "--replay needs --adaptive with width 1" in capsys.readouterr().err
    with contextlib.redirect_stdout(io.StringIO()):
        assert bench_cli.main(args + ["--adaptive", "1,2,4"]) == 0
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    for turn in doc["turns"]:
        acceptance, costs = np.asarray(turn["replay"]["acceptance"]), turn["replay"]["width_costs"]
        assert len(acceptance) == turn["baseline"]["tokens"] and len(costs) == 4 and costs[-1] == 1.0
        assert replay_adaptive(acceptance, (1, 2, 4, 8), costs, 8)[1] == turn["widths"]
    replay = doc["summary"]["openings"]["replay"]
    assert replay["best_possible"] >= max(replay["fixed"], replay["adaptive"]) > 0
    assert "Replay on the teacher-forced acceptance" in (tmp_path / "out" / "results.md").read_text()
    assert (tmp_path / "out" / "replay.png").read_bytes().startswith(b"\x89PNG")


# ------------------------------------------------------------------------------------------ kill and resume


class DyingDecoder(FakeDecoder):
    """Dies (as a kill would) at its n-th generate call."""

    def __init__(self, die_at: int):
        super().__init__()
        self.die_at = die_at

    def generate(self, *args, **kwargs):
        if len(self.calls) == self.die_at:
            raise KeyboardInterrupt
        return super().generate(*args, **kwargs)


def test_killed_bench_keeps_finished_samples_and_resumes(tmp_path):
    from dflash_jax.engine.sampling import SamplingConfig
    from dflash_jax.evaluation.bench import Journal, run_bench

    data = {"gsm8k": [["q1"], ["q2"], ["q3"]], "alpaca": [["a1"]]}
    settings = {"target": "t", "block_size": 4}
    run = lambda dec, journal: run_bench(dec, FakeTokenizer(), [2], data, 3, SamplingConfig(), 0,  # noqa: E731
                                         progress=False, journal=journal)
    journal = Journal(tmp_path, settings)
    with pytest.raises(KeyboardInterrupt):
        run(DyingDecoder(die_at=5), journal)  # samples q1 and q2 finish (2 calls each), q3 dies
    journal.close()
    with open(tmp_path / Journal.NAME, "a") as f:
        f.write('{"dataset": "gsm8k", "sam')  # the line a kill -9 cut short
    journal = Journal(tmp_path, settings)
    assert sorted(journal.done) == [("gsm8k", 0), ("gsm8k", 1)]
    dec = FakeDecoder()
    resumed = run(dec, journal)
    journal.close()
    assert len(dec.calls) == 4, "only q3 and a1 are run again"
    fresh = run(FakeDecoder(), None)
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("baseline", "dflash")} for r in rows]  # noqa
    assert strip(resumed["turns"]) == strip(fresh["turns"]) and resumed["summary"]["gsm8k"]["tau"] == 2.0
    # A changed prompt is measured again; a changed setting is refused by name.
    data["gsm8k"][0] = ["q1 changed"]
    journal = Journal(tmp_path, settings)
    assert journal.finished("gsm8k", 0, data["gsm8k"][0]) is None and journal.finished("gsm8k", 1, ["q2"])
    journal.close()
    with pytest.raises(UserError, match=r"other settings \(block_size: 4 there, 8 now\)"):
        Journal(tmp_path, {**settings, "block_size": 8})


def test_unwritable_out_fails_before_any_model_is_loaded(tmp_path, capsys):
    (tmp_path / "taken").write_text("a file")
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    rc = bench_cli.main(["--target", "nowhere/target", "--ckpt", "nowhere/draft", "--prompt-file", str(prompts),
                         "--out", str(tmp_path / "taken")])
    err = capsys.readouterr().err
    assert rc == 2 and "--out" in err and "not a directory" in err and "nowhere" not in err
