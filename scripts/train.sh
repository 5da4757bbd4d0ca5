#!/usr/bin/env bash
# Sets up, then runs the main job on 2 ranks through fsdprun. Extra arguments pass through.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh
if [ -x build/bin/train_gpt ]; then
  exec build/bin/fsdprun --standalone --nproc-per-node 2 -- build/bin/train_gpt "$@"
fi
# Until train_gpt exists: a smoke demo of fsdprun and the process group.
exec build/bin/fsdprun --standalone --nproc-per-node 2 -- build/bin/fsdp_hello "$@"
