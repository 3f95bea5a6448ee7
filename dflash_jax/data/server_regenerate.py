"""Regeneration through an OpenAI-compatible server (vLLM, SGLang, tpu-inference, ``transformers serve``): the
same output as :mod:`dflash_jax.data.regenerate` (shards, resumption, ``finished`` flags, settings file), with
the target run by a server that already holds it.

Conversations go to ``/chat/completions``: the server applies the target's chat template, with
``chat_template_kwargs`` (``enable_thinking`` always set, so the thinking mode is known) passed through. Plain
text, and conversations with ``use_chat_template=False``, go to ``/completions`` with the text the engine's
path would render. An answer ``finish_reason == "length"`` is unfinished. Every request carries a seed drawn
from (seed, shard, turn, example), so a server that honours per-request seeds (vLLM, SGLang) samples the same
rows on a rerun; greedy rows do not depend on it.

Up to ``concurrency`` requests are in flight (one asyncio loop, httpx), over as many shards as it takes to keep
them busy; a shard is written whole once every one of its rows is answered. Connection errors, timeouts, HTTP
429 and 5xx are retried with exponential backoff; any other 4xx stops the run with one error naming the example
and the server's message (the same request would fail again). A row still unanswered after the retries is
reported (``OUT/unanswered.json`` and the summary), its shard is not written and the other shards go on: rerun
the same command once the server is back and exactly those shards are redone. No row is written twice or lost.

Servers decode answers without special tokens by default (the engine's path keeps them); pass e.g.
``extra_body={"skip_special_tokens": false}`` to vLLM or SGLang where special tokens carry meaning (gpt-oss's
harmony channels). A server that splits the reasoning out of the answer (a reasoning parser: the reply has a
``reasoning_content``) is refused: the row would lose the text the target generated first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlsplit

from dflash_jax.data.formats import Example, PlainText, shard_path
from dflash_jax.data.regenerate import (
    RegenerateStats, _end, _job, _Job, _Progress, _result_row, batch_seed, check_run_args, common_settings,
    prepare_out_dir, start_shards, write_shard,
)
from dflash_jax.engine.sampling import SamplingConfig
from dflash_jax.errors import UserError
from dflash_jax.fileio import atomic_write

UNANSWERED_FILE = "unanswered.json"  # not .jsonl: the trainer reads every .jsonl of the directory
MAX_WAIT = 60.0  # seconds: the longest pause between two tries of one request


class ServerError(UserError):
    """The server refused a request (a 4xx other than 429), or answered with something that is not an
    OpenAI-style reply: the same request would fail again, so the run stops."""


class _Unanswered(Exception):
    """One request still failing after every retry (the server down, overloaded or failing)."""


@dataclasses.dataclass
class ServerOptions:
    url: str  # the API base, e.g. http://host:8000/v1 (a bare http://host:8000 gets /v1)
    model: str | None = None  # None: the server's only model (GET /models)
    api_key: str | None = None  # sent as a bearer token; never written anywhere
    concurrency: int = 32  # requests in flight
    timeout: float = 600.0  # seconds per request
    max_retries: int = 8  # tries after the first, before a row is reported unanswered
    retry_wait: float = 1.0  # seconds before the first retry, doubling (at most MAX_WAIT)
    extra_body: dict = dataclasses.field(default_factory=dict)  # merged into every request (server extensions)


def api_base(url: str) -> str:
    """The API base of ``url``: as given, or with ``/v1`` when it names only the host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UserError(f"--server {url!r}: expected an http(s) URL such as http://localhost:8000/v1")
    base = url.rstrip("/")
    return base if parts.path.strip("/") else base + "/v1"


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _server_message(response: Any) -> str:
    """The server's own words: OpenAI/vLLM ``{"error": {"message"}}``, FastAPI ``{"detail"}``, or the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("detail", "message", "error"):
            if body.get(key):
                return str(body[key])
    return json.dumps(body)[:500]


def server_models(base: str, api_key: str | None, timeout: float) -> list[str] | str:
    """The models the server lists (``GET /models``), or why it could not list them; checks, before any row,
    that the server is there at all."""
    import httpx

    try:
        response = httpx.get(f"{base}/models", headers=_headers(api_key), timeout=timeout)
    except httpx.HTTPError as e:
        raise UserError(f"--server: cannot reach {base}/models ({type(e).__name__}: {e}); is the server "
                        "running at that address?") from None
    if response.status_code >= 400:  # e.g. transformers serve 5.17 answers 500 without a Hugging Face cache
        return f"{base}/models answered HTTP {response.status_code}: {_server_message(response)}"
    try:
        return [str(m["id"]) for m in response.json()["data"]]
    except (ValueError, KeyError, TypeError):
        return f"{base}/models did not answer an OpenAI model list: {response.text[:200]!r}"


def server_settings(examples: Sequence[Example], *, model: str, max_new_tokens: int, sampling: SamplingConfig,
                    seed: int, shard_size: int, use_chat_template: bool, chat_template_kwargs: dict,
                    extra_body: dict) -> dict:
    """What decides the rows of a server regeneration. Not the URL (a restarted server may move) nor the API
    key (a secret) nor the concurrency (greedy rows do not depend on it, sampled ones on the server's seeds)."""
    return {
        **common_settings(examples, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                          shard_size=shard_size),
        "source": "server",
        "model": model,
        "use_chat_template": bool(use_chat_template),
        "chat_template_kwargs": chat_template_kwargs,
        "enable_thinking": bool(chat_template_kwargs.get("enable_thinking", False)),
        "extra_body": extra_body,
    }


def _request(job: _Job, turn: int, shard: int, *, model: str, max_new_tokens: int, sampling: SamplingConfig,
             seed: int, use_chat_template: bool, chat_template_kwargs: dict, extra_body: dict) -> tuple[str, dict]:
    """The endpoint and body of ``turn``; appends the user turn to a conversation's history."""
    body = {"model": model, "max_tokens": max_new_tokens, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "seed": batch_seed(seed, shard, turn, job.index)}
    if sampling.top_k > 0:  # not in the OpenAI schema (vLLM and SGLang take it; others refuse unknown fields)
        body["top_k"] = sampling.top_k
    if isinstance(job.example, PlainText):
        return "/completions", {**body, "prompt": job.users[0], **extra_body}
    job.history.append({"role": "user", "content": job.users[turn]})
    if not use_chat_template:  # the whole conversation so far, joined, exactly as training renders it
        prompt = "".join(m["content"] for m in job.history if m["role"] != "system")
        return "/completions", {**body, "prompt": prompt, **extra_body}
    return "/chat/completions", {**body, "messages": [dict(m) for m in job.history],
                                 "chat_template_kwargs": chat_template_kwargs, **extra_body}


def _parse_reply(reply: Any, chat: bool, where: str) -> tuple[str, str | None, int]:
    """(answer text, finish_reason, generated tokens) of an OpenAI-style reply."""
    try:
        choice = reply["choices"][0]
        if chat:
            message = choice["message"]
            text = message.get("content") or ""
            reasoning = message.get("reasoning_content") or message.get("reasoning")
        else:
            text, reasoning = choice["text"], None
        finish = choice.get("finish_reason")
        tokens = int((reply.get("usage") or {}).get("completion_tokens") or 0)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        raise ServerError(f"{where}: the server's reply is not an OpenAI completion: {json.dumps(reply)[:300]}") \
            from None
    if not isinstance(text, str):
        raise ServerError(f"{where}: the reply's text is not a string: {text!r:.100}")
    if reasoning:
        raise ServerError(f"{where}: the server returned the reasoning apart from the answer (reasoning_content): "
                          "the row would lose the text the target generated first; run the server without a "
                          "reasoning parser")
    return text, finish, tokens


class _Client:
    """The HTTP side: one request with its retries."""

    def __init__(self, options: ServerOptions, base: str):
        import httpx

        self.options, self.base = options, base
        self.http = httpx.AsyncClient(
            headers=_headers(options.api_key), timeout=options.timeout,
            limits=httpx.Limits(max_connections=options.concurrency, max_keepalive_connections=options.concurrency))
        self.in_flight = asyncio.Semaphore(options.concurrency)

    async def post(self, path: str, body: dict, where: str) -> Any:
        import httpx

        problem = ""
        for attempt in range(self.options.max_retries + 1):
            if attempt:
                await asyncio.sleep(min(self.options.retry_wait * 2 ** (attempt - 1), MAX_WAIT))
            try:
                async with self.in_flight:
                    response = await self.http.post(self.base + path, json=body)
            except httpx.TransportError as e:  # refused or dropped connections, timeouts
                problem = f"{type(e).__name__}: {e}".rstrip(": ")
                continue
            if response.status_code == 429 or response.status_code >= 500:  # overloaded or failing: try again
                problem = f"HTTP {response.status_code}: {_server_message(response)}"
                continue
            if response.status_code >= 400:
                raise ServerError(f"{where}: {self.base}{path} refused the request with HTTP "
                                  f"{response.status_code}: {_server_message(response)}")
            try:
                return response.json()
            except ValueError:
                raise ServerError(f"{where}: {self.base}{path} answered HTTP {response.status_code} with a body "
                                  f"that is not JSON: {response.text[:200]!r}") from None
        raise _Unanswered(f"no answer after {self.options.max_retries + 1} tries ({problem})")


async def _answer_job(client: _Client, job: _Job, shard: int, stats: RegenerateStats, progress: _Progress,
                      **request_args: Any) -> None:
    """Every turn of one example in order, each following the target's own earlier answer."""
    for turn in range(len(job.users)):
        path, body = _request(job, turn, shard, **request_args)
        where = f"example {job.index} turn {turn + 1}"
        text, finish, tokens = _parse_reply(await client.post(path, body, where), path == "/chat/completions",
                                            where)
        stats.generated_tokens += tokens
        if not text.strip():  # as the engine's path: an empty answer ends the conversation
            _end(job)
            progress.update(1, tokens)
            return
        stats.answers += 1
        ended = finish != "length"
        stats.unfinished += int(not ended)
        job.finished &= ended
        job.history.append({"role": "assistant", "content": text})
        job.answers += 1
        last = turn + 1 >= len(job.users)
        progress.update(int(last), tokens)
    job.done = True


async def _run_shards(examples: Sequence[Example], out_dir: Path, pending: list[int], shard_size: int,
                      options: ServerOptions, base: str, stats: RegenerateStats, progress: _Progress,
                      unanswered: list[dict], **request_args: Any) -> None:
    client = _Client(options, base)
    # Enough shards open at once to keep every request slot busy across shard boundaries.
    open_shards = asyncio.Semaphore(max(2, math.ceil(2 * options.concurrency / shard_size)))

    async def one_shard(k: int) -> None:
        async with open_shards:
            jobs = [_job(k * shard_size + i, e) for i, e in enumerate(examples[k * shard_size: (k + 1) * shard_size])]
            results = await asyncio.gather(*(_guard(j, k) for j in jobs))
            failed = [r for r in results if r is not None]
            if failed:
                unanswered.extend(failed)
                return
            rows = [_result_row(j) for j in jobs]
            stats.skipped += sum(r is None for r in rows)
            write_shard(out_dir, k, [r for r in rows if r is not None], stats)

    async def _guard(job: _Job, k: int) -> dict | None:
        try:
            await _answer_job(client, job, k, stats, progress, **request_args)
        except _Unanswered as e:
            progress.update(1, 0)
            return {"example": job.index, "shard": k, "turn": job.answers + 1, "error": str(e)}
        return None

    tasks = [asyncio.ensure_future(one_shard(k)) for k in pending]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION) if tasks else ((), ())
        for task in done:
            if task.exception() is not None:
                raise task.exception()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.http.aclose()


def regenerate_via_server(examples: Sequence[Example], out_dir: str | Path, options: ServerOptions, *,
                          max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(), seed: int = 0,
                          shard_size: int = 256, use_chat_template: bool = True,
                          chat_template_kwargs: dict | None = None, progress: bool = True
                          ) -> tuple[RegenerateStats, list[dict]]:
    """Answer every example through the server and write resumable shards to ``out_dir`` (see the module
    docstring). Returns this run's statistics and the rows it could not get answered (also in
    ``out_dir/unanswered.json``; their shards were not written)."""
    check_run_args(options.concurrency, shard_size, max_new_tokens, seed, examples)
    for name, value in (("max_retries", options.max_retries), ("timeout", options.timeout),
                        ("retry_wait", options.retry_wait)):
        if value < 0 or (name == "timeout" and value == 0):
            raise UserError(f"{name} must be {'positive' if name == 'timeout' else 'non-negative'}, got {value}")
    kwargs = dict(chat_template_kwargs or {})
    kwargs.setdefault("enable_thinking", False)  # as the engine's path: the thinking mode is always explicit
    if not isinstance(kwargs["enable_thinking"], bool):
        raise UserError(f"chat_template_kwargs: 'enable_thinking' must be true or false, got "
                        f"{kwargs['enable_thinking']!r}")
    base = api_base(options.url)
    listed = server_models(base, options.api_key, options.timeout)
    # A named model is not looked up in the list: servers also answer to aliases and paths they do not list.
    if not options.model and isinstance(listed, str):
        raise UserError(f"--server: {listed}; name the model with --model")
    if not options.model and len(listed) != 1:
        raise UserError(f"--server: {base} lists {len(listed)} models ({', '.join(map(repr, listed[:10]))}); "
                        "name one with --model")
    model = options.model or listed[0]
    out_dir = Path(out_dir)
    settings = server_settings(examples, model=model, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                               shard_size=shard_size, use_chat_template=use_chat_template,
                               chat_template_kwargs=kwargs, extra_body=options.extra_body)
    prepare_out_dir(out_dir, settings)
    report = out_dir / UNANSWERED_FILE
    stats, pending, bar = start_shards(examples, out_dir, shard_size, progress)
    unanswered: list[dict] = []
    start = time.perf_counter()
    try:
        asyncio.run(_run_shards(
            examples, out_dir, pending, shard_size, options, base, stats, bar, unanswered, model=model,
            max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, use_chat_template=use_chat_template,
            chat_template_kwargs=kwargs, extra_body=options.extra_body))
    finally:
        bar.close()
        stats.seconds = time.perf_counter() - start
        unanswered.sort(key=lambda r: r["example"])
        if unanswered:
            with atomic_write(report) as f:
                f.write((json.dumps(unanswered, indent=1) + "\n").encode())
        elif report.exists() and all(shard_path(out_dir, k).is_file() for k in range(stats.shards)):
            report.unlink()  # an earlier run's list, all answered now
    return stats, unanswered
