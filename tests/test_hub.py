"""Hugging Face Hub ids where checkpoint paths are taken (``dflash_jax.checkpoints.hub``), with no network.

A fake Hub on localhost (HF_ENDPOINT) serves tiny repositories; huggingface_hub's own ``snapshot_download``
fills an HF_HOME under tmp_path from it in a subprocess (the online path: only config/tokenizer/safetensors
files are fetched). Everything else runs with HF_HUB_OFFLINE=1 against that cache and must give exactly what
the local directories give."""

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import threading
from contextlib import redirect_stdout
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import jax
import numpy as np
import pytest

from cli_tiny import write_tiny_pair, write_tokenizer
from conftest import free_port
from dflash_jax.checkpoints.hf_target import save_target
from dflash_jax.checkpoints.hub import resolve_checkpoint
from dflash_jax.checkpoints.loading import load_draft_any, load_target_any
from dflash_jax.checkpoints.safetensors_io import CheckpointError
from engine_tiny import tiny_target

REPO = Path(__file__).resolve().parents[1]
DECOYS = {"pytorch_model.bin": b"pickle: never fetched", "original/config.json": b"{}", "README.md": b"# tiny"}
PROMPT = ["--prompt", "hello there", "--max-new-tokens", "12", "--json"]

# Run in a subprocess, so huggingface_hub reads HF_HOME and HF_ENDPOINT from the environment as a user's
# process does. Prints the resolved snapshots, then the errors of ids the Hub cannot serve.
POPULATE = """
import json, sys
from huggingface_hub import constants
from dflash_jax.checkpoints.hub import resolve_checkpoint
from dflash_jax.checkpoints.safetensors_io import CheckpointError

def error(repo, revision=None):
    try:
        resolve_checkpoint(repo, revision, "--ckpt")
    except CheckpointError as e:
        return str(e)

out = {"paths": [str(resolve_checkpoint(r, v)) for r, v in json.loads(sys.argv[1])],
       "absent": error("org/absent"), "bad_revision": error("org/tiny", "nope")}
constants.ENDPOINT = "http://127.0.0.1:" + sys.argv[2]  # nothing listens there: the Hub is unreachable
out["unreachable"] = error("org/elsewhere")
print(json.dumps(out))
"""


def write_target(out: Path, seed: int) -> Path:
    """A tiny target like cli_tiny's, with other weights."""
    config, params = tiny_target(seed=seed)
    save_target(config, params, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(bos_token_id=1, eos_token_id=2)
    (out / "config.json").write_text(json.dumps(cfg))
    write_tokenizer(out)
    return out


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


class FakeHub(ThreadingHTTPServer):
    """The part of the Hub API that ``snapshot_download`` uses: repo info at a revision, the file tree of a
    commit, and HEAD/GET of a file at a commit. ``repos``: id -> {revision: {path: bytes}}."""

    def __init__(self, repos: dict[str, dict[str, dict[str, bytes]]]):
        self.commits: dict[str, dict[str, bytes]] = {}  # sha -> files
        self.refs: dict[str, dict[str, str]] = {}  # repo -> revision -> sha
        for repo, revisions in repos.items():
            for revision, files in revisions.items():
                sha = hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()
                self.commits[sha] = files
                self.refs.setdefault(repo, {})[revision] = sha
        self.fetched: list[str] = []  # "repo/path" of every file body sent
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def commit(self, repo: str, revision: str) -> str | None:
        refs = self.refs[repo]
        return refs.get(revision) or (revision if revision in refs.values() else None)


class Handler(BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args):
        pass

    def reply(self, status: int, body: bytes = b"", headers: dict | None = None, send_body: bool = True):
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def route(self, send_body: bool):
        # /api/models/ORG/NAME/{revision,tree}/REV or /ORG/NAME/resolve/REV/PATH
        parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
        api = parts[:2] == ["api", "models"]
        parts = parts[2:] if api else parts
        repo = "/".join(parts[:2])
        if repo not in self.server.refs or len(parts) < 4:
            return self.reply(404, b"{}", {"X-Error-Code": "RepoNotFound"}, send_body)
        kind, revision, path = parts[2], parts[3], "/".join(parts[4:])
        sha = self.server.commit(repo, revision)
        if sha is None:
            return self.reply(404, b"{}", {"X-Error-Code": "RevisionNotFound"}, send_body)
        files = self.server.commits[sha]
        if api and kind == "revision":
            info = {"id": repo, "sha": sha, "siblings": [{"rfilename": p} for p in files]}
            return self.reply(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, send_body)
        if api and kind == "tree":
            tree = [{"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                    for p, b in files.items()]
            return self.reply(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, send_body)
        if not api and kind == "resolve" and path in files:
            body = files[path]
            if send_body:
                self.server.fetched.append(f"{repo}/{path}")
            return self.reply(200, body, {"X-Repo-Commit": sha, "ETag": f'"{hashlib.sha256(body).hexdigest()}"'},
                              send_body)
        return self.reply(404, b"{}", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha}, send_body)

    def do_GET(self):
        self.route(send_body=True)

    def do_HEAD(self):
        self.route(send_body=False)


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(PYTHONPATH=str(REPO), HF_HUB_DISABLE_TELEMETRY="1", **extra)
    return env


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Local directories and an HF_HOME whose cache huggingface_hub filled from the fake Hub: org/tiny (main:
    the target, v2: other weights), org/tiny-draft."""
    root = tmp_path_factory.mktemp("hub")
    target, draft = write_tiny_pair(root / "local")
    target_v2 = write_target(root / "local" / "target-v2", seed=7)
    server = FakeHub({"org/tiny": {"main": {**files_of(target), **DECOYS}, "v2": files_of(target_v2)},
                      "org/tiny-draft": {"main": {**files_of(draft), "model.pt": b"pickle"}}})
    home = root / "hf"
    jobs = [["org/tiny", None], ["org/tiny", "v2"], ["org/tiny-draft", None]]
    try:
        proc = subprocess.run([sys.executable, "-c", POPULATE, json.dumps(jobs), str(free_port())], cwd=root,
                              env=clean_env(HF_HOME=str(home), HF_ENDPOINT=server.url), capture_output=True,
                              text=True, timeout=120)
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    return dict(root=root, home=home, cache=home / "hub", target=target, target_v2=target_v2, draft=draft,
                snapshots=[Path(p) for p in out["paths"]], online=out, stderr=proc.stderr, server=server)


@pytest.fixture
def offline(hub, tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1 with the hub fixture's cache, in this process too (huggingface_hub reads its
    environment at import, so its constants are set as well); the working directory holds nothing."""
    from huggingface_hub import constants

    for name, value in (("HF_HOME", hub["home"]), ("HF_HUB_CACHE", hub["cache"]), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub["cache"]))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    return hub


def generate(capsys, argv: list) -> list:
    from infer.__main__ import main

    assert main([str(a) for a in argv] + PROMPT) == 0
    return json.loads(capsys.readouterr().out)["results"][0]["tokens"]


def one_error(capsys, rc: int, err: str | None = None) -> str:
    assert rc == 2
    lines = [line for line in (err if err is not None else capsys.readouterr().err).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.fixture(scope="module")
def local_tokens(hub):
    """What the local directories generate (main and v2 targets), for comparison."""
    from infer.__main__ import main

    out = {}
    for name in ("target", "target_v2"):
        buf = io.StringIO()
        with redirect_stdout(buf):
            assert main(["--target", str(hub[name]), "--ckpt", str(hub["draft"])] + PROMPT) == 0
        out[name] = json.loads(buf.getvalue())["results"][0]["tokens"]
    assert out["target"] != out["target_v2"]  # so that the tests below can tell them apart
    return out


# ------------------------------------------------------------------------------------------- online fetch


def test_online_fetch_takes_only_what_the_loaders_read(hub):
    main, v2, draft = hub["snapshots"]
    assert main.parent == v2.parent and main != v2 and str(main).startswith(str(hub["cache"]))
    assert sorted(files_of(main)) == sorted(files_of(hub["target"]))  # no .bin, README or original/
    assert files_of(v2) == files_of(hub["target_v2"])
    assert sorted(files_of(draft)) == sorted(files_of(hub["draft"]))  # no .pt
    assert not [f for f in hub["server"].fetched if f.endswith((".bin", ".pt", ".md")) or "original/" in f]
    assert "Fetching" in hub["stderr"]  # huggingface_hub's own progress bar


def test_online_errors_name_the_id(hub):
    errors = hub["online"]
    assert "--ckpt org/absent: no such local path, and no Hugging Face Hub model" in errors["absent"]
    assert "org/tiny" in errors["bad_revision"] and "no revision 'nope'" in errors["bad_revision"]
    assert "org/elsewhere" in errors["unreachable"] and "cannot be reached" in errors["unreachable"]
    assert str(hub["cache"]) in errors["unreachable"]


# ------------------------------------------------------------------------------------- offline, from cache


def test_infer_with_hub_ids_offline_matches_the_local_dirs(offline, local_tokens, capsys):
    assert generate(capsys, ["--target", "org/tiny", "--ckpt", "org/tiny-draft"]) == local_tokens["target"]


def test_revision_picks_a_cached_revision(offline, local_tokens, capsys):
    argv = ["--target", "org/tiny", "--ckpt", "org/tiny-draft", "--revision", "v2"]
    assert generate(capsys, argv) == local_tokens["target_v2"]
    main_sha = offline["snapshots"][0].name  # a commit hash works as well as a branch name
    assert resolve_checkpoint("org/tiny", main_sha) == offline["snapshots"][0]
    assert resolve_checkpoint("org/tiny", "v2") == offline["snapshots"][1]


def test_a_local_dir_of_the_same_spelling_wins(offline, local_tokens, capsys, tmp_path):
    shutil.copytree(offline["target_v2"], tmp_path / "org" / "tiny")
    shutil.copytree(offline["draft"], tmp_path / "org" / "tiny-draft")
    assert resolve_checkpoint("org/tiny") == Path("org/tiny")
    assert generate(capsys, ["--target", "org/tiny", "--ckpt", "org/tiny-draft"]) == local_tokens["target_v2"]
    from infer.__main__ import main

    msg = one_error(capsys, main(["--target", "org/tiny", "--revision", "v2", "--ckpt", "org/tiny-draft"] + PROMPT))
    assert "--target org/tiny: is a local path, so revision 'v2' cannot apply" in msg


def test_uncached_id_offline_is_one_error_naming_id_and_cache(offline):
    # A fresh process: huggingface_hub must take HF_HOME and HF_HUB_OFFLINE from the environment.
    env = clean_env(HF_HOME=str(offline["home"]), HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "infer", "--target", "org/absent", "--ckpt", "org/tiny-draft",
                           "--prompt", "x"], cwd=os.getcwd(), env=env, capture_output=True, text=True, timeout=120)
    msg = one_error(None, proc.returncode, proc.stderr)
    assert "--target org/absent: no such local path" in msg and "HF_HUB_OFFLINE" in msg
    assert str(offline["cache"]) in msg


@pytest.mark.parametrize("argv, names", [
    # revisions not in the cache: the offline error, naming the cache
    (["--target", "org/tiny", "--ckpt", "org/tiny-draft", "--ckpt-revision", "v9"],
     ["--ckpt org/tiny-draft (revision v9)", "HF_HUB_OFFLINE", "{cache}"]),
    (["--target", "org/tiny", "--revision", "0" * 40], [f"--target org/tiny (revision {'0' * 40})", "{cache}"]),
    # not a Hub id (three components): the loader's own error
    (["--target", "nowhere/at/all", "--ckpt", "org/tiny-draft"], ["nowhere/at/all: target checkpoint directory"]),
    (["--target", "org/tiny", "--ckpt-revision", "v2", "--baseline"], ["--ckpt-revision needs a --ckpt"]),
])
def test_offline_mistakes_are_one_error(offline, capsys, argv, names):
    from infer.__main__ import main

    msg = one_error(capsys, main(argv + PROMPT))
    for name in names:
        assert name.format(cache=offline["cache"]) in msg


def test_other_commands_take_hub_ids(offline, tmp_path, capsys):
    from infer.__main__ import main as infer_main
    from infer.speed import build_parser, load_models
    from train.plan import _target_config_of

    # convert --from a Hub id
    assert infer_main(["convert", "--from", "org/tiny-draft", "--to", str(tmp_path / "orbax"), "--no-progress"]) == 0
    capsys.readouterr()
    local = load_draft_any(offline["draft"])[1]
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), load_draft_any(tmp_path / "orbax")[1], local)
    assert all(jax.tree.leaves(same))
    # speed's model loading, with --revision
    args = build_parser().parse_args(["--target", "org/tiny", "--ckpt", "org/tiny-draft", "--revision", "v2"])
    tp = load_models(args)[3]
    want = load_target_any(offline["target_v2"])[1]
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), tp, want)))
    # plan reads the config alone
    assert _target_config_of("org/tiny", "v2") == load_target_any(offline["target_v2"])[0]


def test_regenerate_with_a_hub_id_matches_the_local_dir(offline, tmp_path):
    from train.__main__ import main

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("hi", "tell me")))
    outs = []
    for target in ("org/tiny", str(offline["target"])):
        out = tmp_path / f"out{len(outs)}"
        assert main(["regenerate", "--target", target, "--data", str(data), "--out", str(out),
                     "--max-new-tokens", "6", "--no-progress"]) == 0
        outs.append(sorted((p.name, p.read_text()) for p in out.glob("shard-*.jsonl")))
    assert outs[0] == outs[1] and outs[0]


def test_run_config_takes_hub_ids_and_revisions(offline, tmp_path):
    from dflash_jax.models.config import ConfigError
    from dflash_jax.training.run_config import parse_run_config
    from dflash_jax.training.trainer import prepare_run
    from train_tiny import tiny_tokenized

    raw = {"target": {"path": "org/tiny", "revision": "v2"}, "draft": {"init": "org/tiny-draft"},
           "data": {"train": "unused.jsonl", "max_length": 40}, "train": {"epochs": 1, "global_batch": 8},
           "output": {"dir": str(tmp_path / "run")}}
    run = prepare_run(parse_run_config(raw, "test"), tokenized=tiny_tokenized(), eval_prompts=[], log=lambda _: None)
    equal = lambda a, b: all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b)))  # noqa
    assert equal(run.target_params, load_target_any(offline["target_v2"])[1])
    assert equal(run.init_params, load_draft_any(offline["draft"])[1])
    with pytest.raises(ConfigError, match="draft.init_revision needs draft.init"):
        parse_run_config({**raw, "draft": {"init_revision": "v2"}}, "test")
    with pytest.raises(CheckpointError, match="target.path org/tiny .revision v3.: no such local path"):
        prepare_run(parse_run_config({**raw, "target": {"path": "org/tiny", "revision": "v3"}}, "test"),
                    tokenized=tiny_tokenized(), eval_prompts=[], log=lambda _: None)
