"""The DFlash paper's benchmark protocol (SPEC section 8) on the shared prompt sets.

Batch 1; for every sample and every user turn the conversation so far is encoded (the model's own earlier
answers included, so MT-Bench's second turn follows the first answer), then the autoregressive baseline and
DFlash run on the SAME decoder and engine. Reported per dataset: tau, the decode speedup (mean baseline time
per output token / mean DFlash time per output token; prefill and compilation excluded), both TPOTs, the
acceptance-length histogram and, when greedy, how often DFlash reproduced the baseline token for token.

Prompt formatting follows the official DFlash benchmark script (z-lab/dflash ``dflash/benchmark.py``):

- gsm8k / math500: the problem, a newline, then ``MATH_SUFFIX``.
- humaneval: the official script wraps the code prompt as ``HUMANEVAL_TEMPLATE`` ("Write a solution to the
  following problem and make sure that it passes the tests:" + a fenced python block). We follow the script
  rather than passing the raw prompt, since the script is what produced the paper's numbers.
- mbpp: the raw ``prompt`` (a one-sentence task) of the sanitized set's test split, task_id 11..510.
- mt-bench: the two user ``turns``; alpaca: the raw ``instruction``.

Samples are taken in file order (the first N of each file); nothing is shuffled, so a run is reproducible
without a data seed. (The official script shuffles with a fixed seed when limiting samples.)
"""

from __future__ import annotations

import gzip
import json
import zlib
import math
import platform
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from dflash_jax.engine.decoder import encode_conversation
from dflash_jax.engine.sampling import SamplingConfig
from dflash_jax.errors import UserError

MATH_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"
)
MBPP_TEST_IDS = (11, 510)  # inclusive: the MBPP paper's test split

Sample = list[str]  # the user turns of one conversation


# ---------------------------------------------------------------------------------------------------------
# Loaders: each takes the prompts directory and returns a list of samples (lists of user turns).


def read_text_file(path: Path) -> str:
    if not path.is_file():
        raise UserError(f"{path}: prompt file not found")
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return f.read()
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, EOFError, zlib.error) as e:
        raise UserError(f"{path}: cannot read ({e})") from None


def read_jsonl(path: Path) -> list[tuple[int, Any]]:
    """(line number, parsed object) for every non-blank line."""
    rows = []
    for lineno, line in enumerate(read_text_file(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((lineno, json.loads(line)))
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    if not rows:
        raise UserError(f"{path}: no rows")
    return rows


def _string_field(path: Path, where: str, row: Any, field: str) -> str:
    value = row.get(field) if isinstance(row, dict) else None
    if not isinstance(value, str) or not value.strip():
        raise UserError(f"{path}:{where}: expected an object with a non-empty string field '{field}'")
    return value


def _single_field(filename: str, field: str, fmt: Callable[[str], str] = lambda s: s):
    def load(prompts_dir: Path | str) -> list[Sample]:
        path = Path(prompts_dir) / filename
        return [[fmt(_string_field(path, str(n), row, field))] for n, row in read_jsonl(path)]

    load.__name__ = f"load_{filename.split('.')[0]}"
    load.filename = filename
    return load


def math_prompt(problem: str) -> str:
    return f"{problem}\n{MATH_SUFFIX}"


def humaneval_prompt(prompt: str) -> str:
    return HUMANEVAL_TEMPLATE.format(prompt=prompt)


load_gsm8k = _single_field("gsm8k_test.jsonl", "question", math_prompt)
load_math500 = _single_field("math500_test.jsonl", "problem", math_prompt)
load_humaneval = _single_field("HumanEval.jsonl.gz", "prompt", humaneval_prompt)
load_alpaca = _single_field("alpaca_eval_instructions.jsonl", "instruction")


def load_mbpp(prompts_dir: Path | str) -> list[Sample]:
    path = Path(prompts_dir) / "sanitized-mbpp.json"
    text = read_text_file(path)
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(rows, list):
        raise UserError(f"{path}: expected a JSON list of tasks")
    lo, hi = MBPP_TEST_IDS
    samples = []
    for i, row in enumerate(rows):
        task_id = row.get("task_id") if isinstance(row, dict) else None
        if not isinstance(task_id, int):
            raise UserError(f"{path}:entry {i}: expected an object with an integer 'task_id'")
        prompt = _string_field(path, f"entry {i} (task_id {task_id})", row, "prompt")
        if lo <= task_id <= hi:
            samples.append([prompt])
    return samples


load_mbpp.filename = "sanitized-mbpp.json"


def load_mt_bench(prompts_dir: Path | str) -> list[Sample]:
    path = Path(prompts_dir) / "mt_bench_question.jsonl"
    samples = []
    for n, row in read_jsonl(path):
        turns = row.get("turns") if isinstance(row, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise UserError(f"{path}:{n}: expected an object with 'turns', a non-empty list of strings")
        samples.append(list(turns))
    return samples


load_mt_bench.filename = "mt_bench_question.jsonl"

DATASETS: dict[str, Callable[[Path | str], list[Sample]]] = {
    "gsm8k": load_gsm8k,
    "math500": load_math500,
    "humaneval": load_humaneval,
    "mbpp": load_mbpp,
    "mt-bench": load_mt_bench,
    "alpaca": load_alpaca,
}


def load_datasets(prompts_dir: Path | str, names: Sequence[str], max_samples: int | None = None
                  ) -> dict[str, list[Sample]]:
    """The first ``max_samples`` samples (file order; None or 0 = all) of each named dataset."""
    prompts_dir = Path(prompts_dir)
    if not prompts_dir.is_dir():
        raise UserError(f"{prompts_dir}: prompts directory not found")
    unknown = [n for n in names if n not in DATASETS]
    if unknown:
        raise UserError(f"unknown dataset {', '.join(map(repr, unknown))}; valid names: {', '.join(DATASETS)}")
    out = {}
    for name in names:
        samples = DATASETS[name](prompts_dir)
        out[name] = samples[:max_samples] if max_samples else samples
    return out


# ---------------------------------------------------------------------------------------------------------
# Running


def conversation_ids(tokenizer: Any, messages: list[dict], use_chat_template: bool = True) -> list[int]:
    """Token ids of the conversation so far (ending in a user turn). With a chat template: the template with
    the generation prompt and thinking off. Without one (or with ``use_chat_template=False``): every message's
    text joined by blank lines, so later turns still see the earlier turns and answers."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        return encode_conversation(tokenizer, messages, True)
    text = "\n\n".join(m["content"] for m in messages)
    return list(tokenizer(text)["input_ids"])


def _tpot_ms(tokens: int, decode_s: float) -> float | None:
    # The first token comes from the prefill: the decode loop produced tokens - 1.
    return 1000.0 * decode_s / (tokens - 1) if tokens >= 2 else None


def _run_row(result) -> dict:
    n = len(result.tokens[0])
    return {"tokens": n, "prefill_s": result.prefill_s, "decode_s": result.decode_s,
            "compile_s": result.compile_s, "tpot_ms": _tpot_ms(n, result.decode_s)}


def _mean(xs: Sequence[float]) -> float | None:
    return float(np.mean(xs)) if len(xs) else None


def summarize_dataset(rows: list[dict], block_size: int, greedy: bool) -> dict:
    done = [r for r in rows if not r.get("skipped")]
    accepts = [a for r in done for a in r["accept_lengths"]]
    # TPOT over the turns where both runs decoded at least one token after the prefill.
    timed = [r for r in done if r["baseline"]["tpot_ms"] is not None and r["dflash"]["tpot_ms"] is not None]
    tpot_base = _mean([r["baseline"]["tpot_ms"] for r in timed])
    tpot_dflash = _mean([r["dflash"]["tpot_ms"] for r in timed])
    hist = [0] * block_size
    for a in accepts:
        hist[min(max(a, 1), block_size) - 1] += 1
    return {
        "samples": len({r["sample"] for r in rows}),
        "turns": len(done),
        "skipped_turns": len(rows) - len(done),
        "timed_turns": len(timed),
        "tau": _mean(accepts),  # over all rounds of all turns
        "tau_turn_mean": _mean([float(np.mean(r["accept_lengths"])) for r in done if r["accept_lengths"]]),
        "speedup": tpot_base / tpot_dflash if tpot_base is not None and tpot_dflash else None,
        "tpot_baseline_ms": tpot_base,
        "tpot_dflash_ms": tpot_dflash,
        "acceptance_histogram": hist,  # counts of acceptance lengths 1..block_size
        "output_tokens": sum(r["dflash"]["tokens"] for r in done),
        "identical": _mean([float(r["identical"]) for r in done]) if greedy else None,
    }


def run_bench(
    decoder: Any,
    tokenizer: Any,
    stop_tokens: Sequence[int],
    datasets: dict[str, list[Sample]],
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int = 0,
    use_chat_template: bool = True,
    progress: bool = True,
) -> dict:
    """Run every turn of every sample with the baseline and with DFlash; return per-turn rows and per-dataset
    summaries. Compilation is reported by the engine separately and never enters the metrics. A turn whose
    prompt cannot fit the target's context is recorded as skipped (with the rest of its conversation)."""
    from tqdm import tqdm

    if not decoder.has_draft:
        raise UserError("the benchmark needs a draft (DFlash) as well as the target")
    block = int(decoder.block_size)
    greedy = sampling.greedy
    rows: list[dict] = []
    summary: dict[str, dict] = {}
    total = sum(len(s) for s in datasets.values())
    bar = tqdm(total=total, desc="bench", unit="sample", disable=not progress, file=sys.stderr)
    try:
        for name, samples in datasets.items():
            bar.set_postfix_str(name)
            ds_rows = []
            for si, turns in enumerate(samples):
                messages: list[dict] = []
                for ti, user in enumerate(turns):
                    messages.append({"role": "user", "content": user})
                    ids = conversation_ids(tokenizer, messages, use_chat_template)
                    row = {"dataset": name, "sample": si, "turn": ti, "prompt_tokens": len(ids), "user": user}
                    try:
                        decoder.check_fits([len(ids)], max_new_tokens)
                    except ValueError as e:
                        for tj in range(ti, len(turns)):
                            ds_rows.append({"dataset": name, "sample": si, "turn": tj, "user": turns[tj],
                                            "prompt_tokens": len(ids) if tj == ti else None,
                                            "skipped": " ".join(str(e).split())})
                        bar.write(f"warning: {name} sample {si} turn {ti} skipped: {ds_rows[-1]['skipped']}")
                        break
                    base = decoder.generate([ids], max_new_tokens, sampling, stop_tokens, baseline=True, seed=seed)
                    flash = decoder.generate([ids], max_new_tokens, sampling, stop_tokens, seed=seed)
                    answer = tokenizer.decode(flash.tokens[0], skip_special_tokens=True)
                    row.update({
                        "output": answer,
                        "baseline": _run_row(base),
                        "dflash": _run_row(flash),
                        "accept_lengths": [int(a) for a in flash.accept_lengths[0]],
                        "identical": (flash.tokens[0] == base.tokens[0]) if greedy else None,
                    })
                    ds_rows.append(row)
                    # The next turn follows the model's own answer (DFlash's, as in the paper's script).
                    messages.append({"role": "assistant", "content": answer})
                bar.update(1)
            summary[name] = summarize_dataset(ds_rows, block, greedy)
            rows.extend(ds_rows)
    finally:
        bar.close()
    taus = [s["tau"] for s in summary.values() if s["tau"] is not None]
    speedups = [s["speedup"] for s in summary.values() if s["speedup"] is not None]
    return {
        "settings": {"block_size": block, "max_new_tokens": max_new_tokens, "temperature": sampling.temperature,
                     "top_k": sampling.top_k, "top_p": sampling.top_p, "seed": seed, "batch_size": 1,
                     "chat_template": bool(use_chat_template and getattr(tokenizer, "chat_template", None)),
                     "stop_tokens": [int(t) for t in stop_tokens]},
        "summary": summary,
        "mean": {"tau": _mean(taus), "speedup": _mean(speedups)},  # unweighted over datasets, as Table 1
        "turns": rows,
    }


# ---------------------------------------------------------------------------------------------------------
# Reporting


def machine_info() -> dict:
    import jax

    devices = jax.devices()
    return {"backend": jax.default_backend(), "device_kind": devices[0].device_kind, "device_count": len(devices),
            "devices": [str(d) for d in devices], "jax": jax.__version__, "host": platform.node(),
            "platform": platform.platform(), "python": platform.python_version()}


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def markdown_table(results: dict) -> str:
    lines = ["| dataset | samples | tau | speedup | TPOT baseline ms | TPOT DFlash ms | identical |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in results["summary"].items():
        ident = "n/a (sampling)" if s["identical"] is None and results["settings"]["temperature"] > 0 else \
            _fmt(None if s["identical"] is None else 100 * s["identical"], ".0f", "%")
        n = s.get("skipped_turns") or 0
        skipped = f" ({n} turn{'s' if n != 1 else ''} skipped)" if n else ""
        lines.append(f"| {name} | {s['samples']}{skipped} | {_fmt(s['tau'], '.2f')} | {_fmt(s['speedup'], '.2f', 'x')} "
                     f"| {_fmt(s['tpot_baseline_ms'], '.2f')} | {_fmt(s['tpot_dflash_ms'], '.2f')} | {ident} |")
    if len(results["summary"]) > 1:
        m = results["mean"]
        lines.append(f"| mean | | {_fmt(m['tau'], '.2f')} | {_fmt(m['speedup'], '.2f', 'x')} | | | |")
    return "\n".join(lines)


def _json_safe(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, (np.integer, np.floating, np.bool_)):
        return _json_safe(x.item())
    if isinstance(x, Path):
        return str(x)
    return x


def plot_acceptance(results: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg, without touching pyplot's backend
    from matplotlib.figure import Figure

    summary = results["summary"]
    n = max(len(summary), 1)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig = Figure(figsize=(4.2 * cols, 3.2 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    block = results["settings"]["block_size"]
    for ax, (name, s) in zip(axes, summary.items()):
        counts = s["acceptance_histogram"]
        ax.bar(range(1, len(counts) + 1), counts, color="tab:blue")
        ax.set_xticks(range(1, block + 1))
        ax.set_xlabel("acceptance length")
        ax.set_ylabel("rounds")
        ax.set_title(f"{name}: tau = {_fmt(s['tau'], '.2f')}")
    for ax in axes[len(summary):]:
        ax.set_visible(False)
    fig.suptitle(f"DFlash acceptance lengths (block {block})")
    fig.savefig(path, dpi=100)


def write_report(results: dict, out_dir: Path | str, meta: dict | None = None) -> dict[str, Path]:
    """Write ``results.json`` (everything, per-turn rows and ``meta`` included), ``results.md`` (the table)
    and ``acceptance.png`` into ``out_dir``; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(meta or {})
    meta.setdefault("block_size", results["settings"]["block_size"])
    meta.setdefault("max_new_tokens", results["settings"]["max_new_tokens"])
    meta.setdefault("temperature", results["settings"]["temperature"])
    meta.setdefault("machine", machine_info())
    paths = {"json": out / "results.json", "markdown": out / "results.md", "plot": out / "acceptance.png"}
    doc = {"meta": meta, **results}
    paths["json"].write_text(json.dumps(_json_safe(doc), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    m = meta["machine"]
    header = (f"# DFlash benchmark\n\ntarget `{meta.get('target', '?')}`, draft `{meta.get('draft', '?')}`, "
              f"block {meta['block_size']}, max_new_tokens {meta['max_new_tokens']}, "
              f"temperature {meta['temperature']}, batch 1, on {m.get('device_kind')} ({m.get('backend')}).\n"
              f"Speedup = mean baseline / mean DFlash time per output token, decode only (same engine).\n\n")
    paths["markdown"].write_text(header + markdown_table(results) + "\n", encoding="utf-8")
    plot_acceptance(results, paths["plot"])
    return paths
