#!/usr/bin/env bash
# Sets up (scripts/setup.sh), then runs every test: ctest runs the C++ gtests and the Python-side
# tests (pytest, through ctest entries named py_*). Extra arguments go to ctest, e.g.
#   scripts/test.sh -L fully_shard        # one label
#   scripts/test.sh -R Collectives        # by name
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh
cd build
# Tests run their ranks as threads or processes: two at a time on 2 cores keeps them within timeouts.
ctest --output-on-failure -j "${FSDP_TEST_JOBS:-2}" "$@"
