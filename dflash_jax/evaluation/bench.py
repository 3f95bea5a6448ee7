"""The DFlash paper's benchmark protocol (SPEC section 8) on the shared prompt sets.

Batch 1; for every sample and every user turn the conversation so far is encoded (the model's own earlier
answers included, so MT-Bench's second turn follows the first answer), then the autoregressive baseline and
DFlash run on the SAME decoder and engine. Reported per dataset: tau, the decode speedup (mean baseline time
per output token / mean DFlash time per output token; prefill and compilation excluded), both TPOTs, the
acceptance-length histogram and, when greedy, how often DFlash reproduced the baseline token for token.
Prompt sets and their formatting: ``dflash_jax.evaluation.prompts``.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dflash_jax.engine.adaptive import rounds_per_width, tree_budget_summary, verify_widths
from dflash_jax.engine.decoder import encode_conversation
from dflash_jax.engine.generate import programs_compiled, prompt_buckets
from dflash_jax.engine.sampling import SamplingConfig
from dflash_jax.errors import UserError
from dflash_jax.evaluation.machine import machine_info
from dflash_jax.evaluation.prompts import Sample
from dflash_jax.evaluation.replay import replay_adaptive, replay_fixed, replay_oracle, teacher_forced_acceptance
from dflash_jax.fileio import atomic_write, write_text_atomic

# ---------------------------------------------------------------------------------------------------------
# Running

# The prompt-width ladder of a bench run (smallest, factor): 256, 1k, 4k, 16k tokens. Each width compiles 4
# programs (baseline and DFlash, prefill and loop), so a run with prompts up to 16k compiles at most 16 (the
# powers-of-two ladder gave 20-24); padding costs only prefill time, which the metrics exclude.
BENCH_BUCKETS = (256, 4)


def conversation_ids(tokenizer: Any, messages: list[dict], use_chat_template: bool = True,
                     enable_thinking: bool = False) -> list[int]:
    """Token ids of the conversation so far (ending in a user turn). With a chat template: the template with
    the generation prompt and thinking off (unless ``enable_thinking``). Without one (or with
    ``use_chat_template=False``): every message's text joined by blank lines, so later turns still see the
    earlier turns and answers."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        return encode_conversation(tokenizer, messages, True, enable_thinking)
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
        # adaptive block size: rounds taken at each verify width
        **({"rounds_per_width": {str(w): n for w, n in rounds_per_width(r["widths"] for r in done).items()}}
           if any("widths" in r for r in done) else {}),
        # --tree auto: rounds per tree budget (0: the chain), the chain's share, the mean budget
        **({"tree_auto": tree_budget_summary(r["tree_budgets"] for r in done)}
           if any("tree_budgets" in r for r in done) else {}),
        "output_tokens": sum(r["dflash"]["tokens"] for r in done),
        "identical": _mean([float(r["identical"]) for r in done]) if greedy else None,
    }


class Journal:
    """``samples.jsonl`` in the output folder: the settings on the first line, then one line per finished
    sample (its turns' rows), flushed and fsynced as each sample ends, so a killed bench keeps its finished
    samples and a rerun of the same command resumes after them. A rerun with other settings is refused
    (naming the setting); a sample whose prompt text changed is run again; a line cut by the kill is dropped."""

    NAME = "samples.jsonl"

    def __init__(self, out_dir: Path | str, settings: dict):
        self.path = Path(out_dir) / self.NAME
        settings = json.loads(json.dumps(settings))  # the form it takes on disk (tuples become lists)
        self.done: dict[tuple[str, int], dict] = {}
        if self.path.exists():
            lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
            try:
                stored = json.loads(lines[0]) if lines else None
            except json.JSONDecodeError:
                stored = None
            if not isinstance(stored, dict) or not isinstance(stored.get("settings"), dict):
                raise UserError(f"{self.path}: not a bench journal of this project; pass another --out or delete it")
            changed = sorted(k for k in set(stored["settings"]) | set(settings)
                             if stored["settings"].get(k) != settings.get(k))
            if changed:
                k = changed[0]
                raise UserError(f"{self.path}: written by a run with other settings ({k}: "
                                f"{stored['settings'].get(k)!r} there, {settings.get(k)!r} now); use another "
                                f"output folder or delete it to start over")
            kept = [lines[0]]
            for line in lines[1:]:
                try:
                    record = json.loads(line)
                    if not isinstance(record.get("rows"), list):
                        raise TypeError("no rows")
                    self.done[(record["dataset"], record["sample"])] = record
                    kept.append(line)
                except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                    break  # the line a kill cut short, and anything after it, is redone
            write_text_atomic(self.path, "".join(line + "\n" for line in kept))
        else:
            write_text_atomic(self.path, json.dumps({"settings": settings}) + "\n")
        self._file = open(self.path, "a", encoding="utf-8")

    def finished(self, dataset: str, sample: int, turns: Sample) -> list[dict] | None:
        record = self.done.get((dataset, sample))
        return record["rows"] if record is not None and record.get("turns") == list(turns) else None

    def record(self, dataset: str, sample: int, turns: Sample, rows: list[dict]) -> None:
        line = json.dumps(_json_safe({"dataset": dataset, "sample": sample, "turns": list(turns), "rows": rows}),
                          ensure_ascii=False)
        self._file.write(line + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def check_replay(adaptive_widths: Sequence[int], sampling: SamplingConfig) -> None:
    """The replay needs greedy decoding (the text must not depend on the widths) and width 1 among the
    adaptive widths (the autoregressive round, whose measured cost is the unit)."""
    if 1 not in adaptive_widths or not sampling.greedy:
        raise UserError("--replay needs --adaptive with width 1 (e.g. --adaptive 1,2,4) and greedy decoding "
                        f"(--temperature 0); got --adaptive {','.join(map(str, adaptive_widths)) or '(none)'}, "
                        f"--temperature {sampling.temperature}")


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
    journal: Journal | None = None,
    replay: bool = False,
    enable_thinking: bool = False,
) -> dict:
    """Run every turn of every sample with the baseline and with DFlash; return per-turn rows and per-dataset
    summaries. Compilation is reported by the engine separately and never enters the metrics. A turn whose
    prompt cannot fit the target's context is recorded as skipped (with the rest of its conversation).
    ``replay`` (greedy, adaptive widths including 1) also records, per turn, the teacher-forced acceptance of
    every position of the answer and the measured round costs, and summarizes the offline replay of width
    policies on them (``evaluation/replay.py``)."""
    from tqdm import tqdm

    if not decoder.has_draft:
        raise UserError("the benchmark needs a draft (DFlash) as well as the target")
    if replay:
        check_replay(decoder.adaptive_widths, sampling)
    draft_config = getattr(decoder, "draft_config", None)
    # tokens a round verifies: the block, or a DSpark draft's block and its anchor
    block = int(decoder.block_size) + (1 if draft_config is not None and draft_config.dspark else 0)
    greedy = sampling.greedy
    rows: list[dict] = []
    summary: dict[str, dict] = {}
    total = sum(len(s) for s in datasets.values())
    bar = tqdm(total=total, desc="bench", unit="sample", disable=not progress, file=sys.stderr)
    compiled_before = programs_compiled()
    try:
        with prompt_buckets(*BENCH_BUCKETS):
            for name, samples in datasets.items():
                bar.set_postfix_str(name)
                ds_rows = []
                for si, turns in enumerate(samples):
                    earlier = journal.finished(name, si, turns) if journal is not None else None
                    if earlier is not None:
                        ds_rows.extend(earlier)
                        bar.update(1)
                        continue
                    first_row = len(ds_rows)
                    messages: list[dict] = []
                    for ti, user in enumerate(turns):
                        messages.append({"role": "user", "content": user})
                        ids = conversation_ids(tokenizer, messages, use_chat_template, enable_thinking)
                        row = {"dataset": name, "sample": si, "turn": ti, "prompt_tokens": len(ids), "user": user}
                        try:
                            decoder.check_fits([len(ids)], max_new_tokens)
                        except UserError as e:
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
                            **({("tree_budgets" if decoder.tree_auto else "widths"): [int(w) for w in flash.widths[0]]}
                               if flash.widths is not None else {}),
                            "identical": (flash.tokens[0] == base.tokens[0]) if greedy else None,
                        })
                        if replay:
                            row["replay"] = {"width_costs": flash.width_costs, "acceptance": [int(a) for a in (
                                teacher_forced_acceptance(decoder.target_config, decoder.target_params,
                                                          decoder.draft_config, decoder.draft_params, ids,
                                                          base.tokens[0], block, decoder.dtype))]}
                        ds_rows.append(row)
                        # The next turn follows the model's own answer (DFlash's, as in the paper's script).
                        messages.append({"role": "assistant", "content": answer})
                    if journal is not None:
                        journal.record(name, si, turns, ds_rows[first_row:])
                    bar.update(1)
                summary[name] = summarize_dataset(ds_rows, block, greedy)
                if replay:
                    summary[name]["replay"] = replay_summary(ds_rows, verify_widths(decoder.adaptive_widths, block))
                rows.extend(ds_rows)
    finally:
        bar.close()
    taus = [s["tau"] for s in summary.values() if s["tau"] is not None]
    speedups = [s["speedup"] for s in summary.values() if s["speedup"] is not None]
    return {
        "settings": {"block_size": block, "max_new_tokens": max_new_tokens, "temperature": sampling.temperature,
                     "top_k": sampling.top_k, "top_p": sampling.top_p, "seed": seed, "batch_size": 1,
                     "chat_template": bool(use_chat_template and getattr(tokenizer, "chat_template", None)),
                     "enable_thinking": bool(enable_thinking),
                     "stop_tokens": [int(t) for t in stop_tokens]},
        "summary": summary,
        "mean": {"tau": _mean(taus), "speedup": _mean(speedups)},  # unweighted over datasets, as Table 1
        # at most 4 per prompt width (baseline and DFlash: prefill and loop); widths from BENCH_BUCKETS
        "programs_compiled": programs_compiled() - compiled_before,
        "turns": rows,
    }


def replay_summary(rows: list[dict], widths: tuple[int, ...]) -> dict:
    """Speedups over autoregressive rounds (same engine, measured per-round costs of each turn) of three
    schedules replayed on the turns' teacher-forced acceptance: the full block every round, the adaptive
    policy, and the best schedule knowing every round's acceptance in advance (an upper bound)."""
    time = {"autoregressive": 0.0, "fixed": 0.0, "adaptive": 0.0, "best_possible": 0.0}
    for r in rows:
        if "replay" not in r:
            continue
        acceptance, costs = np.asarray(r["replay"]["acceptance"]), r["replay"]["width_costs"]
        time["autoregressive"] += (len(acceptance) - 1) * costs[0]
        time["fixed"] += replay_fixed(acceptance, costs[-1])[0]
        time["adaptive"] += replay_adaptive(acceptance, widths, costs, widths[-1])[0]
        time["best_possible"] += replay_oracle(acceptance, widths, costs)
    return {k: time["autoregressive"] / t if t > 0 else None for k, t in time.items() if k != "autoregressive"}


# ---------------------------------------------------------------------------------------------------------
# Reporting


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
    widths = {name: s["rounds_per_width"] for name, s in results["summary"].items() if "rounds_per_width" in s}
    if widths:
        lines += ["", "Adaptive block size, rounds per verify width: " + "; ".join(
            f"{name} " + ", ".join(f"{w}: {n}" for w, n in counts.items()) for name, counts in widths.items())]
    trees = {name: s["tree_auto"] for name, s in results["summary"].items() if "tree_auto" in s}
    if trees:
        lines += ["", "Tree auto, mean budget (nodes per round, a chain round 0) and the chain's share of rounds: " +
                  "; ".join(f"{name} {_fmt(t['mean_budget'], '.1f')}, chain {_fmt(100 * t['chain_share'], '.0f', '%')}"
                            for name, t in trees.items())]
    replays = {name: s["replay"] for name, s in results["summary"].items() if "replay" in s}
    if replays:
        lines += ["", "Replay on the teacher-forced acceptance, speedup over autoregressive rounds at the measured "
                  "round costs (full block / adaptive policy / best possible schedule): " + "; ".join(
                      f"{name} " + " / ".join(_fmt(r[k], '.2f', 'x') for k in ("fixed", "adaptive", "best_possible"))
                      for name, r in replays.items())]
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
    with atomic_write(path) as f:
        fig.savefig(f, dpi=100, format="png")


def plot_replay(results: dict, path: Path) -> None:
    """Grouped bars per dataset: the replayed speedups over autoregressive rounds of the full block, the
    adaptive policy and the best possible schedule (``--replay``), with autoregressive rounds at 1."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    replays = {name: s["replay"] for name, s in results["summary"].items() if "replay" in s}
    kinds = (("fixed", "full block", "tab:gray"), ("adaptive", "adaptive policy", "tab:blue"),
             ("best_possible", "best possible", "tab:green"))
    fig = Figure(figsize=(max(5.0, 1.4 * len(replays) + 2), 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for i, (key, label, color) in enumerate(kinds):
        ax.bar([j + (i - 1) * 0.27 for j in range(len(replays))],
               [r[key] or 0.0 for r in replays.values()], width=0.27, label=label, color=color)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(replays)), list(replays))
    ax.set_ylabel("speedup over autoregressive rounds")
    ax.legend(fontsize="small")
    block = results["settings"]["block_size"]
    fig.suptitle(f"Width schedules replayed on the teacher-forced acceptance (block {block})")
    with atomic_write(path) as f:
        fig.savefig(f, dpi=100, format="png")


def write_report(results: dict, out_dir: Path | str, meta: dict | None = None) -> dict[str, Path]:
    """Write ``results.json`` (everything, per-turn rows and ``meta`` included), ``results.md`` (the table),
    ``acceptance.png`` and, with a replay, ``replay.png`` into ``out_dir``; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(meta or {})
    meta.setdefault("block_size", results["settings"]["block_size"])
    meta.setdefault("max_new_tokens", results["settings"]["max_new_tokens"])
    meta.setdefault("temperature", results["settings"]["temperature"])
    meta.setdefault("machine", machine_info())
    paths = {"json": out / "results.json", "markdown": out / "results.md", "plot": out / "acceptance.png"}
    doc = {"meta": meta, **results}
    write_text_atomic(paths["json"], json.dumps(_json_safe(doc), indent=1, ensure_ascii=False) + "\n")
    m = meta["machine"]
    header = (f"# DFlash benchmark\n\ntarget `{meta.get('target', '?')}`, draft `{meta.get('draft', '?')}`, "
              f"block {meta['block_size']}, max_new_tokens {meta['max_new_tokens']}, "
              f"temperature {meta['temperature']}, batch 1, on {m.get('device')} ({m.get('backend')}).\n"
              f"Speedup = mean baseline / mean DFlash time per output token, decode only (same engine).\n\n")
    write_text_atomic(paths["markdown"], header + markdown_table(results) + "\n")
    plot_acceptance(results, paths["plot"])
    if any("replay" in s for s in results["summary"].values()):
        paths["replay_plot"] = out / "replay.png"
        plot_replay(results, paths["replay_plot"])
    return paths
