"""``train regenerate --server`` against a REAL OpenAI-compatible server: ``transformers serve`` (torch, CPU)
holding a tiny random Llama saved here with a character tokenizer and a chat template that has a thinking
branch. The rows it writes are byte-identical to what this project's engine writes for the same model
(``train regenerate`` without ``--server``, greedy): two independent implementations (torch's generate and the
JAX engine) agreeing on every generated token, since the character tokenizer decodes token by token. A server
killed in the middle of a run and started again: the rerun has every row exactly once.

transformers serve 5.17 (read in its source, transformers/cli/serving): ``transformers serve DIR`` preloads a
local directory (``force_model``; requests may name it or not) with ``from_pretrained(DIR)``; it runs one
``model.generate`` at a time on one inference thread, so greedy answers do not depend on how many requests
are in flight; it decodes answers with ``skip_special_tokens=True``, tokenizes a /completions prompt with the
tokenizer's own special tokens (BOS here, as the engine's plain-text prompts) and a chat through
``apply_chat_template(..., **chat_template_kwargs)`` without adding any; and it reports ``finish_reason
"length"`` whenever ``max_tokens`` tokens were generated, even when the last one is the stop token (the test
model's answers avoid that case, checked below). Its ``GET /v1/models`` scans the Hugging Face cache (HTTP 500
without one), so the client is given ``--model``. Qwen-family model types get a response parser that
rewrites the content, so the test model is a Llama.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cli_tiny import CHARS, write_tokenizer
from dflash_jax.data import DataError, read_examples, regenerate
from infer.run import load_decoder
from train.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
NEW, SHARD = 6, 2
THINKING_TEMPLATE = (  # the generation prompt says whether thinking is on, as Qwen3's does
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% if enable_thinking is defined and enable_thinking %}T{% endif %}{% endif %}"
)
ROWS = [
    {"prompt": "What?"}, {"question": "Why"}, {"instruction": "Say", "input": "hi", "output": "replaced"},
    {"messages": [{"role": "system", "content": "Be"}, {"role": "user", "content": "one"},
                  {"role": "assistant", "content": "old answer"}, {"role": "user", "content": "two"}]},
    {"prompt": "x"}, {"prompt": "q"}, {"prompt": "Go"}, {"prompt": "7+8="}, {"text": "Once"},
]


def serving_missing() -> str | None:
    try:
        import torch  # noqa: F401
        from transformers.utils.import_utils import is_serve_available
    except ImportError as e:
        return f"torch or transformers missing ({e})"
    if not is_serve_available():
        return "transformers' serving extra is not installed (pip install -e '.[test]')"
    return None


pytestmark = pytest.mark.skipif(serving_missing() is not None, reason=str(serving_missing()))


def write_model(out: Path) -> None:
    """A tiny random Llama: tokens 0 and 1 (<unk>, <s>) get zero logits so greedy never picks them (the
    server drops special tokens from its text, the engine keeps them), and the stop token's logits are 1.2x
    those of '5', so some answers end before NEW tokens and others do not."""
    import jax

    from dflash_jax.checkpoints.hf_target import abstract_target_params, save_target
    from dflash_jax.models.config import TargetConfig

    config = TargetConfig.from_dict(dict(
        model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: np.asarray(rng.standard_normal(x.shape) * 0.3 if len(x.shape) > 1
                                               else np.ones(x.shape), x.dtype), abstract_target_params(config))
    head = params["lm_head"]["kernel"]
    head[:, :2] = 0
    head[:, 2] = head[:, 3 + CHARS.index("5")] * 1.2
    save_target(config, params, out)
    write_tokenizer(out)
    config_path = out / "tokenizer_config.json"  # the chat template with the thinking branch
    (out / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    assert "chat_template" not in json.loads(config_path.read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``transformers serve MODEL`` on a free localhost port, as a subprocess."""

    def __init__(self, model: Path, log: Path):
        self.model, self.log, self.proc, self.url = model, log, None, None

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the process without waiting for it (the engine's fixtures run meanwhile)."""
        port = free_port()
        self.url, self.ready = f"http://127.0.0.1:{port}/v1", False
        code = "import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; main()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, "serve", str(self.model), "--host", "127.0.0.1", "--port", str(port),
             "--device", "cpu", "--dtype", "float32"],
            stdout=self.log.open("ab"), stderr=subprocess.STDOUT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})

    def wait_ready(self, timeout: float = 300) -> None:
        import httpx

        deadline = time.time() + timeout
        while not self.ready and time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited ({self.proc.returncode}): "
                                   f"{self.log.read_text()[-2000:]}")
            try:
                self.ready = httpx.get(self.url.removesuffix("/v1") + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.2)
        if not self.ready:
            raise RuntimeError(f"transformers serve did not come up in {timeout} s: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    model = root / "model"
    write_model(model)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    server = Server(model, root / "server.log")
    server.launch()
    yield root, model, data, server
    server.kill()


def server_args(setup, out, *extra, url=None):
    root, model, data, server = setup
    server.wait_ready()
    return ["regenerate", "--server", url or server.url, "--model", str(model), "--data", str(data), "--out",
            str(out), "--shard-size", str(SHARD), "--max-new-tokens", str(NEW), "--no-progress", *extra]


def shard_texts(out):
    return {p.name: p.read_text() for p in sorted(out.glob("shard-*.jsonl"))}


@pytest.fixture(scope="module")
def engine_rows(setup):
    """The engine's own regeneration of the same model and data (greedy), thinking off and on."""
    root, model, data, _ = setup
    args = argparse.Namespace(target=str(model), ckpt=None, tokenizer=None, dtype="float32", block_size=None)
    decoder, tokenizer, stops = load_decoder(args, need_draft=False)
    examples = read_examples(data)[0]
    outs = {}
    for thinking in (False, True):
        out = root / f"engine-{thinking}"
        regenerate(decoder, tokenizer, examples[: None if not thinking else 3], out, batch_size=4,
                   max_new_tokens=NEW, stop_tokens=stops, shard_size=SHARD, enable_thinking=thinking, progress=False)
        outs[thinking] = out
    return outs


@pytest.fixture(scope="module")
def reference(setup):
    out = setup[0] / "server-reference"
    os.environ["DFLASH_TEST_API_KEY"] = "sk-never-written-123"
    try:
        assert main(server_args(setup, out, "--concurrency", "4", "--api-key-env", "DFLASH_TEST_API_KEY")) == 0
    finally:
        del os.environ["DFLASH_TEST_API_KEY"]
    return out


def test_server_rows_equal_the_engines_greedy_rows(setup, engine_rows, reference):
    # Every generated token agrees: the character tokenizer decodes token by token, special tokens never occur.
    assert shard_texts(reference) == shard_texts(engine_rows[False])
    raw = [json.loads(line) for text in shard_texts(reference).values() for line in text.splitlines()]
    assert len(raw) == len(ROWS) and {r["finished"] for r in raw} == {True, False}
    # (transformers serve would call an answer whose NEW-th token is the stop token "length" where the engine
    # says finished; no answer of this model ends so, or the shards above would differ.)
    assert read_examples(reference)[0] == read_examples(engine_rows[False])[0]  # the trainer reads the same rows

    settings = json.loads((reference / "regenerate.json").read_text())
    assert settings["source"] == "server" and settings["chat_template_kwargs"] == {"enable_thinking": False}
    assert settings["enable_thinking"] is False and settings["model"] == str(setup[1])
    assert not any("sk-never-written" in p.read_text() for p in reference.iterdir())  # the API key


def test_chat_template_kwargs_reach_the_servers_template(setup, engine_rows, tmp_path):
    """enable_thinking passed through: the server's rows are the engine's rows rendered with thinking on
    (the template's generation prompt then ends 'a:T', so every answer differs from thinking off)."""
    out = tmp_path / "thinking"
    assert main(server_args(setup, out, "--limit", "3", "--chat-template-kwargs", '{"enable_thinking": true}')) == 0
    assert shard_texts(out) == shard_texts(engine_rows[True])
    assert shard_texts(out)["shard-00000.jsonl"] != shard_texts(engine_rows[False])["shard-00000.jsonl"]
    assert json.loads((out / "regenerate.json").read_text())["enable_thinking"] is True
    # --thinking says the same; the settings match, so it resumes the directory (nothing left to do).
    assert main(server_args(setup, out, "--limit", "3", "--thinking")) == 0


def test_a_refused_request_is_one_error_naming_the_row(setup, tmp_path, capsys):
    """A 4xx (here the server pinned to another model) stops the run: one error line with the example and
    the server's own message."""
    argv = server_args(setup, tmp_path / "refused")
    argv[argv.index("--model") + 1] = "another-model"
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "HTTP 400" in errors[0] and "another-model" in errors[0], err
    assert "example " in errors[0] and "turn 1" in errors[0] and "Traceback" not in err
    for extra, message in ((["--concurrency", "0"], "--concurrency"),
                           (["--chat-template-kwargs", "[1]"], "--chat-template-kwargs"),
                           (["--target", str(setup[1])], "--target"),
                           (["--mesh", "data=2", "--num-processes", "2"], "--mesh, --num-processes"),
                           (["--thinking", "--chat-template-kwargs", '{"enable_thinking": false}'], "--thinking")):
        assert main(server_args(setup, tmp_path / "bad", *extra)) == 2
        assert message in capsys.readouterr().err
    assert main(server_args(setup, tmp_path / "down", url=f"http://127.0.0.1:{free_port()}")) == 2
    assert "cannot reach" in capsys.readouterr().err


def test_server_killed_mid_run_then_restarted_every_row_exactly_once(setup, reference, tmp_path, capsys):
    """The module's server killed while a run (in a thread here) has rows in flight and queued: the run
    reports them and writes no partial shard; the server started again (on another port: the URL is not part
    of the settings), the same command finishes the directory."""
    import threading

    server = setup[3]
    out = tmp_path / "killed"
    argv = server_args(setup, out, "--concurrency", "1", "--max-retries", "1", "--retry-wait", "0.1")
    result = []
    client = threading.Thread(target=lambda: result.append(main(argv)))
    client.start()
    deadline = time.time() + 120
    while not (out / "shard-00000.jsonl").exists() and client.is_alive() and time.time() < deadline:
        time.sleep(0.01)
    server.kill()  # mid-run: the row in flight and the ones after it get no answer
    client.join(timeout=120)
    err = capsys.readouterr().err
    assert result == [1], err  # some rows unanswered: reported, and the exit code says so
    assert "got no answer from the server" in err and "rerun the same command" in err
    unanswered = json.loads((out / "unanswered.json").read_text())
    written = shard_texts(out)
    assert "shard-00000.jsonl" in written and len(written) < len(shard_texts(reference))
    assert {f"shard-{r['shard']:05d}.jsonl" for r in unanswered}.isdisjoint(written)  # no partial shard
    assert all(written[name] == shard_texts(reference)[name] for name in written)
    with pytest.raises(DataError, match="incomplete"):  # training refuses the unfinished directory
        read_examples(out)

    server.start()
    assert main(server_args(setup, out)) == 0
    assert shard_texts(out) == shard_texts(reference)  # every row exactly once
    assert not (out / "unanswered.json").exists()
    assert len(read_examples(out)[0]) == len(ROWS)
