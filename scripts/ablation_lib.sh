# Shared by scripts/ablations.sh and scripts/loss_ablations.sh (sourced, not run): one training run and one
# greedy benchmark of a draft, both skipped when their results exist (an interrupted training run resumes
# from its last checkpoint), and the table of every benchmark so far. The caller sets OUT, STEPS, CONFIG,
# TARGET and HELDOUT.

train() {  # NAME [--set ...]: one training run of CONFIG plus the changes, STEPS optimizer steps
  local name=$1; shift
  [ -f "$OUT/$name/export/draft/config.json" ] && return
  python -m train fit --config "$CONFIG" --set "output.dir=$OUT/$name" --set "train.max_steps=$STEPS" \
    --set output.eval_every=0 --set data.eval_prompts=null --no-progress "$@" > "$OUT/$name.log" 2>&1
}

bench() {  # NAME DRAFT_DIR BLOCK: greedy tau on the first 64 held-out openings, into OUT/bench-NAME
  local name=$1 draft=$2 block=$3
  [ -f "$OUT/bench-$name/results.json" ] && return
  python -m infer bench --target "$TARGET" --ckpt "$draft" --block-size "$block" --prompt-file "$HELDOUT" \
    --max-samples 64 --max-new-tokens 128 --no-chat-template --out "$OUT/bench-$name" > "$OUT/bench-$name.log" 2>&1
}

summary() {  # one line per benchmark in OUT; with the run's last logged training loss and position-1 accuracy
  python - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for bench in sorted(out.glob("bench-*/results.json")):
    name = bench.parent.name[6:]
    s = json.loads(bench.read_text())["summary"]["heldout"]
    line = f"{name:22s} tau {s['tau']:.2f}  identical {s['identical']:.0%}"
    metrics = out / name / "metrics.jsonl"
    rows = [json.loads(r) for r in metrics.read_text().splitlines() if r.strip()] if metrics.is_file() else []
    rows = [r for r in rows if "loss" in r]
    if rows:
        line += f"  loss {rows[-1]['loss']:.3f}  acc@1 {rows[-1].get('accuracy_per_position/1', float('nan')):.2f}"
    print(line)
PY
}
