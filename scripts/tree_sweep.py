"""Tree budgets against the chain on the shipped pair (stories260K + its DFlash2 draft), one prompt at a time.

    python scripts/tree_sweep.py --prompt-file data/stories260k/heldout.jsonl --max-samples 32
    python scripts/tree_sweep.py ... --temperature 1          # sampled (Algorithm S over the tree)

Every configuration (the chain, ``--tree N`` for each of --budgets, ``--tree auto`` over --auto-budgets, and the
autoregressive baseline; sampled: also the chain with --block-verify) decodes every prompt at batch 1 with the engine's compiled loop; then --repeats passes
over all of them, interleaved (each pass runs every configuration on every prompt, in a rotated order), so the
machine's drift hits all alike. Reported per configuration: tau (tokens committed per round), decode tokens/s
(all prompts' decoded tokens over their decode time, per pass), its ratio to the chain's in the same pass
(median and range over passes), a round's cost in autoregressive steps (decode time per round over the
baseline's time per token), and the bound ``tau / round cost``, i.e. the speedup over the baseline; for
greedy decoding, whether every output equals the baseline's; for auto, the mean budget and the chain's share
of rounds. Compilation and the auto options' cost calibration happen in the untimed first call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_jax.startup import start_jax  # noqa: E402

start_jax()  # JAX without the CUDA plugin's start-up noise where the aot extra is installed

from dflash_jax.assets import DEMO_DRAFT, DEMO_TARGET  # noqa: E402
from dflash_jax.checkpoints.loading import load_draft_any, load_target_any, load_tokenizer  # noqa: E402
from dflash_jax.engine.adaptive import tree_budget_summary  # noqa: E402
from dflash_jax.engine.decoder import Decoder  # noqa: E402
from dflash_jax.engine.sampling import SamplingConfig  # noqa: E402
from dflash_jax.evaluation.prompts import read_prompt_file  # noqa: E402


def budgets_arg(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-file", required=True, help="JSONL/text prompts (e.g. the held-out story openings)")
    p.add_argument("--max-samples", type=int, default=32, help="first N prompts (default 32)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    p.add_argument("--budgets", type=budgets_arg, default=(8, 16, 32, 64, 128), help="fixed tree budgets")
    p.add_argument("--auto-budgets", type=budgets_arg, default=(8, 16, 32, 64), help="--tree auto's budgets")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes over everything (default 3)")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)

    tc, tp = load_target_any(DEMO_TARGET)
    dc, dp = load_draft_any(DEMO_DRAFT)
    tokenizer = load_tokenizer(DEMO_TARGET)
    texts = read_prompt_file(Path(args.prompt_file))[: args.max_samples]
    prompts = [[1] + tokenizer.encode(t, add_special_tokens=False) for t in texts]
    sampling = SamplingConfig(args.temperature)
    configs = {"baseline": None, "chain": {}, **{f"tree {b}": {"tree_budget": b} for b in args.budgets},
               "auto": {"tree_auto": tuple(args.auto_budgets)}}
    if not sampling.greedy:  # the sampled chain judged as a whole block (--block-verify)
        configs["chain, block verify"] = {"block_verify": True}
    decoders = {name: Decoder(tc, tp, dc, dp, **(kw or {})) for name, kw in configs.items()}

    def run(name: str, prompt: list[int]):
        return decoders[name].generate([prompt], args.max_new_tokens, sampling, stop_tokens=(), seed=0,
                                       baseline=configs[name] is None)

    names = list(configs)
    print(f"compiling {len(names)} configurations (auto: calibrating its options) ...", file=sys.stderr)
    for name in names:
        for prompt in prompts:
            run(name, prompt)
    passes = []
    for r in range(args.repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        results = {name: [run(name, prompt) for prompt in prompts] for name in order}
        passes.append(results)
        print(f"pass {r + 1}/{args.repeats} done", file=sys.stderr)

    def per_pass(results, name):
        rs = results[name]
        decoded = sum(len(x.tokens[0]) - 1 for x in rs)
        seconds = sum(x.decode_s for x in rs)
        rounds = sum(x.rounds[0] for x in rs)
        return decoded / seconds, seconds / max(rounds, 1), seconds / max(decoded, 1)

    figures = {}
    base_tokens = [x.tokens for x in passes[0]["baseline"]]
    for name in names:
        rs = passes[0][name]
        tps = [per_pass(res, name)[0] for res in passes]
        ratio = [per_pass(res, name)[0] / per_pass(res, "chain")[0] for res in passes]
        round_s = statistics.median(per_pass(res, name)[1] for res in passes)
        ar_token_s = statistics.median(per_pass(res, "baseline")[2] for res in passes)
        accepts = [a for x in rs for a in x.accept_lengths[0]]
        tau = sum(accepts) / len(accepts) if accepts else float("nan")
        row = {"tau": tau if configs[name] is not None else 1.0, "tokens_per_s": statistics.median(tps),
               "vs_chain_median": statistics.median(ratio), "vs_chain_range": [min(ratio), max(ratio)],
               "round_cost_ar_steps": round_s / ar_token_s}
        row["speedup_bound"] = row["tau"] / row["round_cost_ar_steps"]
        if sampling.greedy:
            row["identical"] = [x.tokens for x in rs] == base_tokens
        if name == "auto":
            row.update(tree_budget_summary(x.widths[0] for x in rs))
        figures[name] = row

    print(f"\n{len(prompts)} prompts x {args.max_new_tokens} new tokens, batch 1, temperature {args.temperature}, "
          f"{args.repeats} interleaved passes")
    print("| config | tau | decode tok/s | vs chain (median, range) | round cost (AR steps) | tau / cost |"
          + (" identical |" if sampling.greedy else ""))
    print("|---|---:|---:|---:|---:|---:|" + ("---|" if sampling.greedy else ""))
    for name, f in figures.items():
        lo, hi = f["vs_chain_range"]
        print(f"| {name} | {f['tau']:.2f} | {f['tokens_per_s']:.0f} | {f['vs_chain_median']:.2f}x ({lo:.2f}-{hi:.2f}) "
              f"| {f['round_cost_ar_steps']:.2f} | {f['speedup_bound']:.2f}x |"
              + (f" {'yes' if f['identical'] else 'NO'} |" if sampling.greedy else ""))
    if "auto" in figures:
        a = figures["auto"]
        print(f"\nauto: mean budget {a['mean_budget']:.1f}, the chain in {100 * a['chain_share']:.0f}% of rounds, "
              f"rounds per budget {a['rounds_per_budget']}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
