"""The server client's failure handling, which a healthy real server cannot show (tests/test_server_regenerate.py
runs against a real ``transformers serve``): a scripted local HTTP server answers 503 / 429 before it answers,
fails for good, or answers in ways the client must refuse. No model involved."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash_jax.data import Conversation, PlainText
from dflash_jax.data.server_regenerate import ServerError, ServerOptions, regenerate_via_server

EXAMPLES = [Conversation(({"role": "user", "content": "hi"},)), PlainText("", "Once")]


class Scripted:
    """A server whose replies to POSTs follow ``script(path, body, n)`` (n: how many POSTs came before)."""

    def __init__(self, script, models=None):
        owner = self
        self.requests: list[tuple[str, dict, dict]] = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.reply(200, {"data": [{"id": m} for m in (models or ["m"])]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append((self.path, body, dict(self.headers)))
                self.reply(*script(self.path, body, len(owner.requests) - 1))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def answer(path, text="ok", finish="stop", **message_extra):
    usage = {"completion_tokens": 3}
    if path.endswith("/chat/completions"):
        return 200, {"choices": [{"message": {"role": "assistant", "content": text, **message_extra},
                                  "finish_reason": finish}], "usage": usage}
    return 200, {"choices": [{"text": text, "finish_reason": finish}], "usage": usage}


def run(server, out, **options):
    opts = dict(url=server.url, concurrency=2, max_retries=3, retry_wait=0.01, timeout=10)
    opts.update(options)
    return regenerate_via_server(EXAMPLES, out, ServerOptions(**opts), max_new_tokens=4, shard_size=1,
                                 progress=False)


def rows(out):
    return [json.loads(p.read_text()) for p in sorted(out.glob("shard-*.jsonl"))]


def test_5xx_and_429_are_retried_then_answered(tmp_path):
    failures = {"/v1/chat/completions": [503, 502], "/v1/completions": [429]}

    def script(path, body, n):
        if failures[path]:
            return failures[path].pop(0), {"error": {"message": "busy"}}
        return answer(path, finish="stop" if path.endswith("chat/completions") else "length")

    server = Scripted(script)
    try:
        stats, unanswered = run(server, tmp_path / "out", api_key="sk-secret")
    finally:
        server.close()
    assert unanswered == [] and stats.shards_written == 2 and stats.generated_tokens == 6
    assert rows(tmp_path / "out") == [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}], "finished": True},
        {"prompt": "Once", "text": "ok", "finished": False}]  # finish_reason "length": unfinished
    assert len(server.requests) == 5  # 2 + 1 retries, 2 answers
    chat = [b for p, b, _ in server.requests if p.endswith("chat/completions")][-1]
    assert chat["chat_template_kwargs"] == {"enable_thinking": False} and chat["model"] == "m"
    assert chat["max_tokens"] == 4 and chat["temperature"] == 0.0 and "top_k" not in chat
    assert all(h.get("Authorization") == "Bearer sk-secret" for _, _, h in server.requests)
    assert "sk-secret" not in (tmp_path / "out" / "regenerate.json").read_text()


def test_a_row_failing_after_every_retry_is_listed_and_its_shard_left(tmp_path):
    server = Scripted(lambda path, body, n: (500, {"detail": "boom"}) if "chat" in path else answer(path))
    try:
        stats, unanswered = run(server, tmp_path / "out", max_retries=2)
    finally:
        server.close()
    assert [r["example"] for r in unanswered] == [0] and "4 tries" not in unanswered[0]["error"]
    assert "3 tries" in unanswered[0]["error"] and "HTTP 500: boom" in unanswered[0]["error"]
    assert json.loads((tmp_path / "out" / "unanswered.json").read_text()) == unanswered
    assert [p.name for p in sorted((tmp_path / "out").glob("shard-*"))] == ["shard-00001.jsonl"]
    assert stats.shards_written == 1


@pytest.mark.parametrize("case", ["4xx", "reasoning", "garbage"])
def test_replies_that_stop_the_run(tmp_path, case):
    def script(path, body, n):
        if case == "4xx":
            return 400, {"error": {"message": "maximum context length is 8 tokens"}}
        if case == "reasoning" and "chat" in path:
            return answer(path, reasoning_content="let me think")
        return (200, {"unexpected": True}) if case == "garbage" else answer(path)

    server = Scripted(script)
    try:
        with pytest.raises(ServerError) as info:
            run(server, tmp_path / "out", concurrency=1)
    finally:
        server.close()
    message = str(info.value)
    assert "example " in message and "turn 1" in message
    assert {"4xx": "HTTP 400: maximum context length", "reasoning": "reasoning parser",
            "garbage": "not an OpenAI completion"}[case] in message


def test_the_model_is_the_servers_only_one_or_named(tmp_path):
    server = Scripted(lambda path, body, n: answer(path), models=["a", "b"])
    try:
        with pytest.raises(Exception, match="lists 2 models.*--model"):
            run(server, tmp_path / "out")
        stats, _ = run(server, tmp_path / "named", model="b")
    finally:
        server.close()
    assert stats.shards_written == 2 and {b["model"] for _, b, _ in server.requests} == {"b"}
