#!/usr/bin/env bash
# Installs the build into a temporary prefix, then configures, builds and runs tests/install as a
# user project would: find_package(Torch) + find_package(libfsdp).
# Usage: check_install.sh BUILD_DIR TORCH_CMAKE_PREFIX
set -euo pipefail
export CCACHE_DIR="${CCACHE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.ccache}"
build="$1"; torch_prefix="$2"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
tmp=$(mktemp -d -t libfsdp-install.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
cmake -S "$here" -B "$tmp/build" -G Ninja -DCMAKE_PREFIX_PATH="$tmp/prefix;$torch_prefix" \
  -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
cmake --build "$tmp/build" > "$tmp/build.log" || { head -n 40 "$tmp/build.log"; exit 1; }
# ctest passes this test on its PASS_REGULAR_EXPRESSION alone, whatever the exit status: so the
# status is printed on a line of its own, which the expression requires to say 0.
set +e
RANK=0 WORLD_SIZE=1 MASTER_PORT=0 "$tmp/build/consumer"
rc=$?
set -e
echo "check_install: consumer exit code $rc"
exit "$rc"
