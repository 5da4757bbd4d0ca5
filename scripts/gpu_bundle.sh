#!/usr/bin/env bash
# Bundles the Debian build dependencies of libfsdp for an offline GPU machine (scripts/gpu_check.sh).
#
#   scripts/gpu_bundle.sh DIR          (on a connected Debian/Ubuntu machine; DIR e.g. gpu-bundle/)
#
# A GPU machine with a CUDA PyTorch but no network and no Debian development packages lacks the headers that
# the build takes from Debian here: the gloo headers (ProcessGroupGloo.hpp includes them; the wheel does not
# ship them; the gloo code that runs is the one inside libtorch), nlohmann-json, CLI11 and GoogleTest (headers,
# static libraries and CMake package files). This script downloads those .deb files with `apt-get download`
# (no root, nothing installed) and unpacks them with `dpkg -x` into DIR/root (DIR/root/usr/include,
# DIR/root/usr/lib/..., DIR/root/usr/share/cmake...), keeping the .deb files in DIR/debs. gpu_check.sh puts
# DIR/root/usr first on CMAKE_PREFIX_PATH. The bundle is about 2 MiB (limit: 64 MiB).
set -euo pipefail
dir="${1:?usage: scripts/gpu_bundle.sh DIR}"
packages=(libgloo-dev nlohmann-json3-dev libcli11-dev libgtest-dev)
mkdir -p "$dir/debs" "$dir/root"
dir="$(cd "$dir" && pwd)"
cd "$dir/debs"
rm -f ./*.deb
# apt-get download needs the package lists; refresh them once if a package is unknown.
if ! apt-get download "${packages[@]}" >/dev/null 2>"$dir/apt.err"; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q >/dev/null
  apt-get download "${packages[@]}" >/dev/null
fi
rm -f "$dir/apt.err"
rm -rf "$dir/root" && mkdir -p "$dir/root"
for f in ./*.deb; do dpkg -x "$f" "$dir/root"; done
# Not needed by the build: documentation.
rm -rf "$dir/root/usr/share/doc" "$dir/root/usr/share/man"
{
  echo "libfsdp GPU build bundle: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME")"
  for f in ./*.deb; do dpkg-deb -f "$f" Package Version | paste -sd' ' -; done
} > "$dir/MANIFEST"
size=$(du -sm "$dir" | cut -f1)
echo "gpu_bundle: $dir ($size MiB): $(ls ./*.deb | xargs -n1 basename | paste -sd' ' -)"
if [ "$size" -ge 64 ]; then
  echo "gpu_bundle: error: $size MiB exceeds the 64 MiB a GPU machine's working tree may carry" >&2
  exit 1
fi
