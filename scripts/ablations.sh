#!/usr/bin/env bash
# The paper's ablations at the stories260K scale (docs/ablations.md). Every row trains one draft with
# configs/runs/stories260k-b16.yaml plus one change, then benchmarks it greedily on held-out openings.
# Resumable: a row whose bench results exist is skipped; an interrupted training run resumes from its
# last checkpoint. Needs the data of docs/training.md ("stories260K") under data/stories260k/.
#
# GROUP picks the rows: paper (the paper's ablations, the default), recipe (the 2026 recipe options: Muon and
# the variable-prefix objective, two seeds, trained at blocks 16 and 8, beside the base at both; first the
# step times of the three side by side), dspark (DSpark against DeepSpec's shifted DFlash, the paper's DFlash and
# DFlash2, every draft verifying 8 tokens a round, two seeds) or all.
#
#   scripts/ablations.sh [OUT_DIR [STEPS [GROUP]]]      (defaults: runs/ablations-1200, 1200, paper)
set -euo pipefail
OUT=${1:-runs/ablations-1200}
STEPS=${2:-1200}
GROUP=${3:-paper}
case $GROUP in paper|recipe|dspark|all) ;; *) echo "GROUP must be paper, recipe, dspark or all, got '$GROUP'" >&2; exit 2;; esac
CONFIG=configs/runs/stories260k-b16.yaml
TARGET=dflash_jax/assets/stories260k/target
HELDOUT=data/stories260k/heldout.jsonl
mkdir -p "$OUT"

source "$(dirname "$0")/ablation_lib.sh"

row() {  # NAME BLOCK [--set ...]
  local name=$1 block=$2; shift 2
  train "$name" "$@"
  bench "$name" "$OUT/$name/export/draft" "$block"
}

paper_rows() {
  row base 16
  row input-injection 16 --set draft.context_injection=input
  row uniform-anchors 16 --set train.anchors=uniform
  row uniform-loss 16 --set train.uniform_loss=true
  row layers1 16 --set draft.num_layers=1
  row layers3 16 --set draft.num_layers=3
  row features1 16 --set "draft.target_layer_ids=[2]"
  row features3 16 --set "draft.target_layer_ids=[0, 2, 4]" --set draft.allow_last_layer=true
  row b8 8 --set draft.block_size=8
  bench base-at8 "$OUT/base/export/draft" 8
  # The block-8 draft at 16: the same weights with block_size 16 in its config (positions 8-15 untrained).
  if [ ! -d "$OUT/b8-as16" ]; then
    cp -r "$OUT/b8/export/draft" "$OUT/b8-as16.tmp"
    python - "$OUT/b8-as16.tmp/config.json" <<'PY'
import json, sys
cfg = json.load(open(sys.argv[1])); cfg["block_size"] = 16
json.dump(cfg, open(sys.argv[1], "w"), indent=2)
PY
    mv "$OUT/b8-as16.tmp" "$OUT/b8-as16"
  fi
  bench b8-at16 "$OUT/b8-as16" 16
  row base-seed1 16 --set train.seed=1  # run-to-run noise of the base row
}

recipe_rows() {  # the base, Muon and variable prefix; seed 0 at block 16 first, so a cut run says the most
  [ -f "$OUT/recipe-step-times.txt" ] || python -m train speed --config "$CONFIG" --steps 20 \
    --compare muon:train.optimizer=muon --compare variable_prefix:train.loss_mode=variable_prefix \
    > "$OUT/recipe-step-times.txt" 2> "$OUT/recipe-step-times.log"
  local b seed sfx
  for b in 16 8; do
    for seed in 0 1; do
      sfx=$([ "$seed" = 1 ] && echo -seed1 || true)
      local base=$([ "$b" = 8 ] && echo b8 || echo base)
      row "$base$sfx" "$b" --set "train.seed=$seed" --set "draft.block_size=$b"
      row "muon-b$b$sfx" "$b" --set "train.seed=$seed" --set "draft.block_size=$b" --set train.optimizer=muon
      row "vp-b$b$sfx" "$b" --set "train.seed=$seed" --set "draft.block_size=$b" \
        --set train.loss_mode=variable_prefix
    done
  done
}

dspark_rows() {  # every draft verifies 8 tokens a round: DFlash and DFlash2 at block 8, the DeepSpec kinds at 7
  local seed sfx
  for seed in 0 1; do
    sfx=$([ "$seed" = 1 ] && echo -seed1 || true)
    row "dspark-b7$sfx" 7 --set "train.seed=$seed" --set draft.architecture=dspark --set draft.block_size=7
    row "dflash-shifted-b7$sfx" 7 --set "train.seed=$seed" --set draft.architecture=dspark --set draft.block_size=7 \
      --set draft.markov_rank=0 --set draft.confidence_head=false --set "train.dspark_loss_weights=[1.0, 0.0, 0.0]"
    row "dflash-b8$sfx" 8 --set "train.seed=$seed" --set draft.block_size=8
    row "dflash2-b8$sfx" 8 --set "train.seed=$seed" --set draft.block_size=8 --set draft.architecture=dflash2
  done
}

case $GROUP in
  paper) paper_rows ;;
  recipe) recipe_rows ;;
  dspark) dspark_rows ;;
  all) paper_rows; recipe_rows; dspark_rows ;;
esac
summary
