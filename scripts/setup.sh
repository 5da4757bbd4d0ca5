#!/usr/bin/env bash
# Brings everything a fresh machine needs, then builds into build/ (binaries in build/bin/).
# Idempotent and quick when nothing changed. Usage: scripts/setup.sh [TARGET...]
#   With targets (e.g. `scripts/setup.sh fsdp fsdprun train_gpt`, what scripts/train.sh builds), only
#   those and what they need are built; without, everything (library, tools, examples, benchmarks, tests).
#
# Two variants, each with its own Python environment and build folder:
#   CPU  (.venv, build/):            the torch 2.13.0 CPU wheel (requirements.txt). The default.
#   CUDA (.venv-cuda, build-cuda/):  the torch 2.14.1 CUDA 13 wheel (requirements-cuda.txt), NCCL.
#     Chosen automatically when `nvidia-smi -L` lists a GPU; FSDP_CUDA=1 forces it (e.g. to compile the
#     CUDA path on a machine without a GPU, as .ci/run does), FSDP_CUDA=0 forces the CPU variant.
#     The CUDA compiler (nvcc) is taken from /usr/local/cuda (CUDA_TOOLKIT_ROOT_DIR to override).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
log() { printf '[setup] %s\n' "$*" >&2; }

# 1. Debian packages. libgloo-dev supplies the gloo headers that ProcessGroupGloo.hpp includes and the
#    wheel does not ship (headers only: the gloo code that runs is the one inside libtorch_cpu).
#    fortunes + fortunes-min carry train_gpt's default corpus: 2.5 MB of English text in
#    /usr/share/games/fortunes (the text itself, nothing is downloaded at run time).
#    libopenmpi-dev + openmpi-bin: the "mpi" backend (src/c10d/mpi/) and mpirun; the build
#    compiles that backend only when CMake finds MPI, so a machine without them still builds.
#    slurmctld + slurmd + slurm-client (srun, sinfo): a real one-node Slurm that the `multinode` tests start
#    on localhost (tests/python/slurm_cluster.py). Debian bookworm ships Slurm 22.05, which still has
#    AuthType=auth/none and CredType=cred/none, so the tests run no munged; munge is installed only because
#    slurmd and slurmctld depend on it. Installed without Recommends (which would pull ~25 optional plugin
#    packages: HDF5, ROCm SMI, InfluxDB, ...). Nothing is started here: Debian's postinst does not start
#    services in a container without an init, and the tests start their own daemons.
#    iproute2 (`ip netns`, veth, bridges): the two test hosts of the `multinode` tests (tests/python/netns_hosts.py).
#    libsentencepiece-dev, sentencepiece: train_gpt --tokenizer (SentencePiece's C++ library) and spm_train
#    (scripts/train_tokenizer.sh); without the library train_gpt builds with byte-level tokens only.
apt_packages=(build-essential cmake ninja-build ccache git python3-venv python3-dev
              libgloo-dev libgtest-dev nlohmann-json3-dev libcli11-dev fortunes fortunes-min
              libopenmpi-dev openmpi-bin iproute2 libsentencepiece-dev sentencepiece)
apt_packages_no_recommends=(slurmctld slurmd slurm-client munge)
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
# apt_install [apt-get options...] -- packages...: installs those not installed yet (apt-get update first if
# the package lists are stale).
apt_install() {
  local opts=() missing=()
  while [ "$1" != "--" ]; do opts+=("$1"); shift; done; shift
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing Debian packages: ${missing[*]}"
  $SUDO apt-get install -y -q "${opts[@]}" "${missing[@]}" >/dev/null 2>&1 || {
    $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q "${opts[@]}" "${missing[@]}" >/dev/null; }
}
apt_install -- "${apt_packages[@]}"
apt_install --no-install-recommends -- "${apt_packages_no_recommends[@]}"

# 2. Which variant (see the top of this file).
cuda=0
case "${FSDP_CUDA:-auto}" in
  1|on|ON|yes) cuda=1 ;;
  0|off|OFF|no) cuda=0 ;;
  *) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then cuda=1; fi ;;
esac
if [ "$cuda" = 1 ]; then
  venv=.venv-cuda; build=build-cuda; reqs=requirements-cuda.txt
else
  venv=.venv; build=build; reqs=requirements.txt
fi

# 3. Python environment: the wheel whose LibTorch the build uses, and the test packages.
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  log "creating $venv"
  "$py" -m venv "$venv"
fi
stamp=$venv/.requirements.sha
want=$(sha256sum "$reqs" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "installing Python packages ($reqs)"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$reqs"
  echo "$want" > "$stamp"
fi

# 4. Configure (once) and build. cmake/CudaTorch.cmake finds what a CUDA LibTorch needs (nvcc, nvrtc, the
#    wheels' CUDA headers, TORCH_CUDA_ARCH_LIST).
if [ ! -f "$build/build.ninja" ]; then
  prefix=$("$venv/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
  log "configuring $build/ against LibTorch at $prefix"
  cmake -S . -B "$build" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" -DPython3_EXECUTABLE="$root/$venv/bin/python" \
    ${CMAKE_ARGS:-} >/dev/null
fi
export CCACHE_DIR="${CCACHE_DIR:-$root/.ccache}"
jobs="${FSDP_BUILD_JOBS:-$(nproc)}"
if [ $# -gt 0 ]; then
  log "building $* in $build (ninja -j$jobs)"
  cmake --build "$build" -j "$jobs" --target "$@" || { log "build failed"; exit 1; }
else
  log "building $build (ninja -j$jobs)"
  cmake --build "$build" -j "$jobs" || { log "build failed"; exit 1; }
fi
