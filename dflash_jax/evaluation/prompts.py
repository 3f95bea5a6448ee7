"""The paper's benchmark prompt sets (SPEC section 8) and prompt files: readers that name the file and line of
every problem.

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
from pathlib import Path
from typing import Any, Callable, Sequence

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
# A user's prompt file (python -m infer --prompt-file, bench --prompt-file)

PROMPT_FIELDS = ("prompt", "question", "problem", "instruction", "text")


def read_prompt_file(path: Path) -> list[str]:
    """Prompts from .txt (one per line), .json (a list) or .jsonl (objects with a prompt field); .gz ok."""
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    if name.endswith(".txt"):
        rows = list(enumerate((line for line in read_text_file(path).splitlines() if line.strip()), start=1))
    elif name.endswith(".json"):
        try:
            doc = json.loads(read_text_file(path))
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(doc, list):
            raise UserError(f"{path}: expected a JSON list of prompts, got a {type(doc).__name__}")
        rows = list(enumerate(doc, start=1))
    else:
        rows = read_jsonl(path)
    prompts = []
    for where, row in rows:
        if isinstance(row, str):
            prompts.append(row)
            continue
        if isinstance(row, dict):
            if isinstance(row.get("turns"), list) and row["turns"]:
                prompts.append(str(row["turns"][0]))
                continue
            field = next((k for k in PROMPT_FIELDS if isinstance(row.get(k), str)), None)
            if field:
                prompts.append(row[field])
                continue
        raise UserError(f"{path}:{where}: no prompt field (one of {', '.join(PROMPT_FIELDS)} or 'turns')")
    if not prompts:
        raise UserError(f"{path}: no prompts in the file")
    return prompts
