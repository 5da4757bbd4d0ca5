#!/usr/bin/env bash
# Brings everything a fresh machine needs, then builds into build/ (binaries in build/bin/).
# Idempotent and quick when nothing changed. Usage: scripts/setup.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
log() { printf '[setup] %s\n' "$*" >&2; }

# 1. Debian packages. libgloo-dev supplies the gloo headers that ProcessGroupGloo.hpp includes and the
#    wheel does not ship (headers only: the gloo code that runs is the one inside libtorch_cpu).
#    fortunes + fortunes-min carry train_gpt's default corpus: 2.5 MB of English text in
#    /usr/share/games/fortunes (the text itself, nothing is downloaded at run time).
apt_packages=(build-essential cmake ninja-build ccache git python3-venv python3-dev
              libgloo-dev libgtest-dev nlohmann-json3-dev libcli11-dev fortunes fortunes-min)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 || {
    $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q "${missing[@]}" >/dev/null; }
fi

# 2. Python environment (.venv): torch 2.13.0 CPU wheel (LibTorch for the build) and test packages.
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$py" -m venv .venv
fi
stamp=.venv/.requirements.sha
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "installing Python packages (requirements.txt)"
  .venv/bin/pip install -q --disable-pip-version-check -r requirements.txt
  echo "$want" > "$stamp"
fi

# 3. Configure (once) and build.
if [ ! -f build/build.ninja ]; then
  prefix=$(.venv/bin/python -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
  log "configuring build/ against LibTorch at $prefix"
  cmake -S . -B build -G Ninja -DCMAKE_PREFIX_PATH="$prefix" -DPython3_EXECUTABLE="$root/.venv/bin/python" \
    ${CMAKE_ARGS:-} >/dev/null
fi
export CCACHE_DIR="${CCACHE_DIR:-$root/.ccache}"
jobs="${FSDP_BUILD_JOBS:-$(nproc)}"
log "building (ninja -j$jobs)"
cmake --build build -j "$jobs" || { log "build failed"; exit 1; }
