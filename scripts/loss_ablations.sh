#!/usr/bin/env bash
# Losses and position weights at the stories260K scale (docs/ablations.md, "Better drafts"): every row trains
# a draft with configs/runs/stories260k-b16.yaml plus one change, two seeds each, the same step budget as the
# paper's ablations; each draft is benchmarked greedily on held-out openings at block 16 and at block 8.
# Resumable like scripts/ablations.sh (a finished row or bench is skipped; a cut run resumes). Needs the data
# of docs/training.md ("stories260K") under data/stories260k/.
#
#   scripts/loss_ablations.sh [OUT_DIR [STEPS]]      (defaults: runs/losses-1200, 1200)
set -euo pipefail
OUT=${1:-runs/losses-1200}
STEPS=${2:-1200}
CONFIG=configs/runs/stories260k-b16.yaml
TARGET=dflash_jax/assets/stories260k/target
HELDOUT=data/stories260k/heldout.jsonl
mkdir -p "$OUT"

train() {  # NAME [--set ...]: one training run
  local name=$1; shift
  [ -f "$OUT/$name/export/draft/config.json" ] && return
  python -m train fit --config "$CONFIG" --set "output.dir=$OUT/$name" --set "train.max_steps=$STEPS" \
    --set output.eval_every=0 --set data.eval_prompts=null --no-progress "$@" > "$OUT/$name.log" 2>&1
}

bench() {  # NAME BLOCK: greedy tau on the first 64 held-out openings
  local name=$1 block=$2
  [ -f "$OUT/bench-$name-at$block/results.json" ] && return
  python -m infer bench --target "$TARGET" --ckpt "$OUT/$name/export/draft" --block-size "$block" \
    --prompt-file "$HELDOUT" --max-samples 64 --max-new-tokens 128 --no-chat-template \
    --out "$OUT/bench-$name-at$block" > "$OUT/bench-$name-at$block.log" 2>&1
}

row() {  # NAME [--set ...]
  local name=$1; shift
  train "$name" "$@"
  bench "$name" 16
  bench "$name" 8
}

for seed in 0 1; do
  row "ce-s$seed" --set "train.seed=$seed"
  row "kl-s$seed" --set "train.seed=$seed" --set train.loss=kl
  row "ce+kl-s$seed" --set "train.seed=$seed" --set train.loss=ce+kl
  row "dpace-s$seed" --set "train.seed=$seed" --set train.position_weights=dpace
  row "dflash2-s$seed" --set "train.seed=$seed" --set draft.architecture=dflash2
done

# The step time of each row relative to the paper's recipe, measured side by side (the runs take turns).
[ -f "$OUT/step-times.txt" ] || python -m train speed --config "$CONFIG" --steps 20 \
  --compare kl:train.loss=kl --compare "ce+kl:train.loss=ce+kl" --compare dpace:train.position_weights=dpace \
  --compare dflash2:draft.architecture=dflash2 > "$OUT/step-times.txt"
cat "$OUT/step-times.txt"

python - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for bench in sorted(out.glob("bench-*/results.json")):
    s = json.loads(bench.read_text())["summary"]["heldout"]
    print(f"{bench.parent.name[6:]:18s} tau {s['tau']:.2f}  identical {s['identical']:.0%}")
PY
