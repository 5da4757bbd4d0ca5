#!/usr/bin/env bash
# One-shot GPU check (issue 12): on a machine with an NVIDIA GPU, a CUDA PyTorch for Python and NO network,
# builds libfsdp against that PyTorch, runs the `cuda` tests, trains GPT-2-small in bf16 (the loss must fall)
# and compares ours with PyTorch's FSDP2 side by side (bench/compare_fsdp2.py --device cuda, 1 rank).
#
#   scripts/gpu_bundle.sh gpu-bundle          # once, on a connected machine (Debian headers, ~4 MiB)
#   scripts/gpu_check.sh --out DIR            # on the GPU machine
#
# Options: --out DIR (required: gpu_report.json, gpu_check.log and the runs' files), --bundle DIR (default:
# gpu-bundle/ in the repo, or $FSDP_GPU_BUNDLE), --python PY (default: python3, the one with the CUDA torch),
# --jobs N (default: nproc), --train-steps N (default 300), --skip-build (reuse DIR's build).
# Phases run in order, each with a time limit; a failed phase is recorded and the next ones still run (those
# that need the build are skipped when it failed). The report is rewritten after every phase, so an
# interrupted run leaves what it measured. Exit status: 0 when every phase passed, 1 otherwise.
# Budget: under 8 minutes on 16 cores and one H100/H200, the build included.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
orig_args="$*"
out="" bundle="${FSDP_GPU_BUNDLE:-$root/gpu-bundle}" py="${PYTHON:-python3}" jobs="$(nproc)" train_steps=300
skip_build=0
# Dry runs without a GPU (not for the real check): FSDP_GPU_CHECK_DEVICE=cpu FSDP_GPU_CHECK_MODEL=tiny
# FSDP_GPU_CHECK_BATCH=4 run the same phases on the CPU with a small model.
dev="${FSDP_GPU_CHECK_DEVICE:-cuda}" model="${FSDP_GPU_CHECK_MODEL:-gpt2-small}" batch="${FSDP_GPU_CHECK_BATCH:-16}"
# The Llama phase (issue 33): preset, context and batch (dry runs: FSDP_GPU_CHECK_LLAMA=llama-tiny ..._CONTEXT=32).
llama="${FSDP_GPU_CHECK_LLAMA:-llama-150m}" llama_context="${FSDP_GPU_CHECK_LLAMA_CONTEXT:-2048}"
llama_batch="${FSDP_GPU_CHECK_LLAMA_BATCH:-8}"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --bundle) bundle="$2"; shift 2 ;;
    --python) py="$2"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    --train-steps) train_steps="$2"; shift 2 ;;
    --skip-build) skip_build=1; shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$out" ] || { echo "gpu_check: --out DIR is required" >&2; exit 2; }
mkdir -p "$out"
out="$(cd "$out" && pwd)"
log="$out/gpu_check.log"
: > "$log"
exec > >(tee -a "$log") 2>&1
build="$out/build"
phases="$out/phases.jsonl"
: > "$phases"
t_start=$(date +%s)
cmdline="scripts/gpu_check.sh $orig_args"
# Every phase's time limit is capped by what is left of the whole budget (FSDP_GPU_CHECK_BUDGET_S, default
# 470 s: the 8 minutes, less a margin), so that the report is always written in time.
budget="${FSDP_GPU_CHECK_BUDGET_S:-470}"
lim() {
  local want=$1 left=$(( budget - ($(date +%s) - t_start) - 8 ))
  [ "$left" -lt "$want" ] && want=$left
  [ "$want" -lt 5 ] && want=5
  echo "$want"
}
say() { printf '[gpu_check %4ds] %s\n' "$(( $(date +%s) - t_start ))" "$*"; }
# phase NAME STATUS SECONDS [DETAIL]: one JSON line per phase, read by the report.
phase() {
  "$py" - "$phases" "$1" "$2" "$3" "${4:-}" <<'PYEOF'
import json, sys
path, name, status, seconds, detail = sys.argv[1:6]
with open(path, "a") as f:
    f.write(json.dumps({"phase": name, "status": status, "seconds": int(seconds), "detail": detail}) + "\n")
PYEOF
}
report() { "$py" "$root/scripts/gpu_report.py" --out "$out" --command "$cmdline" || true; }

# ---- 0. The machine ---------------------------------------------------------------------------------
say "machine"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
  "$py" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())), "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)' || true
  (nvcc --version | tail -2) 2>/dev/null || echo "nvcc: not on PATH"
  (g++ --version | head -1) 2>/dev/null || echo "g++: not on PATH"
  (cmake --version | head -1; ninja --version) 2>/dev/null || true
  nproc
} | tee "$out/machine.txt"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"  # H100/H200; nothing here compiles kernels
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="/usr/local/cuda/bin:$PATH"
report "$@"

# ---- 1. Build ---------------------------------------------------------------------------------------
build_ok=0
t=$(date +%s)
if [ "$skip_build" = 1 ] && [ -x "$build/bin/train_gpt" ]; then
  build_ok=1
  phase build skipped 0 "--skip-build"
else
  say "build: configuring against $("$py" -c 'import torch; print(torch.__version__)') with the bundle at $bundle"
  [ -d "$bundle/root/usr" ] || say "warning: no bundle at $bundle (scripts/gpu_bundle.sh DIR on a connected machine)"
  prefix="$("$py" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
  gen=(-G Ninja); command -v ninja >/dev/null 2>&1 || gen=()
  # The bundle first: its CMake packages (nlohmann_json, CLI11, GTest) and headers (gloo).
  if timeout "$(lim 120)" cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$bundle/root/usr;$prefix" -DCMAKE_INCLUDE_PATH="$bundle/root/usr/include" \
      -DCMAKE_LIBRARY_ARCHITECTURE=x86_64-linux-gnu -DPython3_EXECUTABLE="$(command -v "$py")" \
      > "$out/configure.log" 2>&1; then
    grep -E "libfsdp|LibTorch" "$out/configure.log" || true
    # train_gpt and fsdprun first (the benchmark needs them), then the tests: a test-only failure (e.g. the
    # bundle's static GoogleTest against an older libstdc++) must not cost the benchmark.
    say "build: compiling fsdp, train_gpt, fsdprun (-j$jobs)"
    if timeout "$(lim 300)" cmake --build "$build" -j "$jobs" --target train_gpt fsdprun > "$out/build.log" 2>&1; then
      build_ok=1
      phase build passed $(( $(date +%s) - t ))
      say "build: compiling test_cuda"
      if ! timeout "$(lim 150)" cmake --build "$build" -j "$jobs" --target test_cuda >> "$out/build.log" 2>&1; then
        grep -E "error|Error" "$out/build.log" | head -20
        say "build: test_cuda FAILED to build"
      fi
    else
      grep -E "error|Error" "$out/build.log" | head -20
      phase build failed $(( $(date +%s) - t )) "$(grep -m1 -E 'error' "$out/build.log" | cut -c1-300)"
    fi
  else
    tail -20 "$out/configure.log"
    phase build failed $(( $(date +%s) - t )) "configure: $(grep -m1 -A2 'CMake Error' "$out/configure.log" | tr '\n' ' ' | cut -c1-300)"
  fi
fi
say "build: $([ $build_ok = 1 ] && echo ok || echo FAILED) in $(( $(date +%s) - t )) s"
report "$@"

# Text to train on: this repository's documentation and sources (the machine may have no other text).
mapfile -t data < <(cd "$root" && { ls README.md docs/*.md examples/train_gpt/*.cpp examples/train_gpt/*.h bench/*.py;
  find src include tests -name '*.cpp' -o -name '*.h'; } 2>/dev/null | sort | sed "s|^|$root/|")
if [ -d /usr/share/common-licenses ]; then
  while IFS= read -r f; do data+=("$f"); done < <(find /usr/share/common-licenses -maxdepth 1 -type f | sort)
fi

if [ $build_ok = 1 ]; then
  # ---- 2. The cuda tests --------------------------------------------------------------------------
  t=$(date +%s)
  say "tests: test_cuda (label cuda)"
  # One process per test: a crash (or a CUDA error that poisons the context) costs that test only.
  rc=1
  rm -rf "$out/cuda_tests" && mkdir -p "$out/cuda_tests"
  : > "$out/cuda_tests.log"
  if [ -x "$build/bin/test_cuda" ]; then
    rc=0
    mapfile -t tests < <("$build/bin/test_cuda" --gtest_list_tests --gtest_filter=-CudaGlooRank.Run |
                         awk '/^[^ ]/ {s=$1} /^  / {print s $1}')
    for tname in "${tests[@]}"; do
      timeout "$(lim 90)" "$build/bin/test_cuda" --gtest_filter="$tname" \
        --gtest_output=json:"$out/cuda_tests/$tname.json" >> "$out/cuda_tests.log" 2>&1
      r=$?
      echo "$tname $r" >> "$out/cuda_tests/exit_codes.txt"
      [ $r = 0 ] || { rc=1; echo "$tname: exit $r"; }
    done
  else
    echo "test_cuda was not built (see build.log)"
  fi
  grep -E "^\[ +(OK|FAILED|SKIPPED) +\]|^\[(cuda|bf16|checkpoint)|^\[.*\] rank|Failure|Expected|Which is|error" "$out/cuda_tests.log" | head -60
  phase cuda_tests "$([ $rc = 0 ] && echo passed || echo failed)" $(( $(date +%s) - t )) "exit $rc"
  report "$@"

  # ---- 3. train_gpt: GPT-2-small, bf16, a few hundred steps; the loss must fall ---------------------
  t=$(date +%s)
  say "train_gpt: $model bf16 on $dev, $train_steps steps"
  timeout "$(lim 120)" "$build/bin/train_gpt" --device "$dev" --model "$model" --mixed-precision bf16 --batch-size "$batch" \
    --steps "$train_steps" --lr 1e-3 --min-lr 1e-4 --warmup-steps 30 --log-every 25 --eval-every 100 \
    --eval-batches 4 --sample-tokens 120 --no-progress --metrics "$out/train_metrics.jsonl" --data "${data[@]}" \
    > "$out/train_gpt.log" 2>&1
  rc=$?
  grep -vE "^$" "$out/train_gpt.log" | tail -25
  phase train_gpt "$([ $rc = 0 ] && echo passed || echo failed)" $(( $(date +%s) - t )) "exit $rc"
  report "$@"

  # ---- 4. Side by side with PyTorch FSDP2 on the GPU, 1 rank ----------------------------------------
  t=$(date +%s)
  say "compare_fsdp2 --device $dev ($model bf16 timing, fp32 parity)"
  FSDP_BUILD_DIR="$build" PYTHONUNBUFFERED=1 timeout "$(lim 300)" "$py" "$root/bench/compare_fsdp2.py" --device "$dev" \
    --single --model "$model" --batch-size "$batch" --json \
    --keep "$out/compare" --data "${data[@]}" > "$out/compare.jsonl" 2> "$out/compare.log"
  rc=$?
  cat "$out/compare.log" | tail -20
  cat "$out/compare.jsonl"
  phase compare_fsdp2 "$([ $rc = 0 ] && echo passed || echo failed)" $(( $(date +%s) - t )) "exit $rc"
  report "$@"

  # ---- 5. train_gpt: the Llama preset, bf16, context 2048: MFU (goal >= 0.40 on one H200) ---------------
  t=$(date +%s)
  say "train_llama: $llama bf16 on $dev, context $llama_context, batch $llama_batch"
  timeout "$(lim 90)" "$build/bin/train_gpt" --device "$dev" --model "$llama" --mixed-precision bf16 \
    --batch-size "$llama_batch" --block-size "$llama_context" --steps 40 --lr 1e-3 --min-lr 1e-4 --warmup-steps 5 --log-every 5 \
    --eval-every 0 --eval-batches 1 --sample-tokens 0 --no-progress --metrics "$out/train_llama_metrics.jsonl" \
    --data "${data[@]}" > "$out/train_llama.log" 2>&1
  rc=$?
  grep -vE "^$" "$out/train_llama.log" | tail -12
  phase train_llama "$([ $rc = 0 ] && echo passed || echo failed)" $(( $(date +%s) - t )) "exit $rc"
else
  for p in cuda_tests train_gpt compare_fsdp2 train_llama; do phase "$p" skipped 0 "the build failed"; done
fi

report "$@"
say "done in $(( $(date +%s) - t_start )) s: $out/gpu_report.json"
"$py" -c "import json,sys; r=json.load(open('$out/gpu_report.json')); print(json.dumps(r.get('summary', {}), indent=1)); sys.exit(0 if r.get('all_passed') else 1)"
