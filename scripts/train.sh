#!/usr/bin/env bash
# Sets up, then runs the main job: train_gpt trains the default preset on the default corpus (the
# fortunes, ~2.5 MB of English) on 2 ranks through fsdprun, in a few minutes on 2 CPU cores. Prints the
# log, the first and the last evaluation loss and a sample; writes runs/train_gpt/{train.log,
# metrics.jsonl, metrics.png}. Extra arguments pass through to train_gpt, later ones winning:
#   scripts/train.sh --steps 100 --mixed-precision bf16
#   NPROC=1 scripts/train.sh --model tiny           # ranks (Default: 2); TRAIN_GPT_OUT sets the folder
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# Only what the main job needs (the library, fsdprun, train_gpt): scripts/test.sh builds the rest.
scripts/setup.sh fsdp fsdprun train_gpt
[ -x build/bin/train_gpt ] || { echo "train.sh: build/bin/train_gpt is missing after setup" >&2; exit 1; }

out="${TRAIN_GPT_OUT:-runs/train_gpt}"
mkdir -p "$out"
rm -f "$out/metrics.jsonl" "$out/metrics.png"
start=$(date +%s)
build/bin/fsdprun --standalone --nproc-per-node "${NPROC:-2}" -- \
  build/bin/train_gpt --metrics "$out/metrics.jsonl" "$@" 2>&1 | tee "$out/train.log"
wall=$(( $(date +%s) - start ))
if [ -s "$out/metrics.jsonl" ]; then  # (not after --help)
  .venv/bin/python scripts/plot_metrics.py "$out/metrics.jsonl" -o "$out/metrics.png" >/dev/null
  echo "train.sh: ${wall} s wall time; log $out/train.log, metrics $out/metrics.jsonl, loss curve $out/metrics.png"
fi
