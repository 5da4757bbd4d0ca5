#!/usr/bin/env python3
"""memory_vs_fsdp2: per-rank peak memory of train_gpt against PyTorch's FSDP2 (bench/gpt_twin.py) on the
same model, weights and batches, each minus its own process baseline (issue 14, part 3).

    .venv/bin/python bench/memory_vs_fsdp2.py [--ranks 1 2] [--repeats 3]

Config: `wide`, parameter-dominated (4 layers x 1024, context 64, batch 2 per rank: 50.7M parameters, fp32,
AdamW), 3 steps, 1 thread per rank. Ours: the last metrics line's peak RSS (VmHWM, max over ranks) minus
rank 0's RSS before the model's construction (libtorch and the process group loaded). PyTorch: gpt_twin's
peak_rss_over_baseline_mb (each rank's VmHWM minus its VmRSS after `import torch` and
init_process_group, max over ranks). Both under the same glibc settings (the environment's); the median of
--repeats runs. Model states: train_gpt's "model states on rank 0" line and gpt_twin's model_state_mb.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "build" / "bin"
PY = ROOT / ".venv" / "bin" / "python"
WIDE = ["--model", "small", "--n-layer", "4", "--n-embd", "1024", "--n-head", "16", "--block-size", "64",
        "--batch-size", "2", "--steps", "3", "--eval-every", "100", "--eval-batches", "1", "--sample-tokens", "0",
        "--log-every", "1", "--threads", "1"]


def run(cmd, env):
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        sys.exit(f"memory_vs_fsdp2: {' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return r.stdout


def ours(n, extra, env):
    cmd = [str(BIN / "train_gpt")] + WIDE + extra
    if n > 1:
        cmd = [str(BIN / "fsdprun"), "--standalone", "--nproc-per-node", str(n), "--"] + cmd
    return run(cmd, env)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    allocator = env.get("MALLOC_MMAP_THRESHOLD_")
    print("glibc malloc: " + (f"MALLOC_MMAP_THRESHOLD_={allocator}" if allocator else "default settings"))
    print("| ranks | ours MiB (runs) | PyTorch FSDP2 MiB (runs) | ours / PyTorch | model states ours / PyTorch MiB | 16 x P / N MiB |")
    print("|---|---|---|---|---|---|")
    for n in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            ours(n, ["--save-init", str(tmp / "init.safetensors"), "--dump-batches", str(tmp / "batches")], env)
            a, b, states = [], [], None
            for _ in range(args.repeats):
                out = ours(n, ["--metrics", str(tmp / "ours.jsonl")], env)
                baseline = float(re.search(r"over the (\d+) MiB before construction", out).group(1))
                a.append(json.loads((tmp / "ours.jsonl").read_text().splitlines()[-1])["peak_rss_mb"] - baseline)
                m = re.search(r"model states on rank 0: .* = ([\d.]+) MiB; 16 x P / N = ([\d.]+) MiB", out)
                states = (float(m.group(1)), float(m.group(2)))
                twin = [str(ROOT / "bench" / "gpt_twin.py"), "--init", str(tmp / "init.safetensors"), "--batches",
                        str(tmp / "batches"), "--threads", "1", "--metrics", str(tmp / "torch.jsonl")]
                if n > 1:
                    run([str(PY), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)] + twin, env)
                else:
                    run([str(PY)] + twin, env)
                last = json.loads((tmp / "torch.jsonl").read_text().splitlines()[-1])
                b.append(last["peak_rss_over_baseline_mb"])
                torch_states = last["model_state_mb"]
        ma, mb = statistics.median(a), statistics.median(b)
        runs = lambda xs: ", ".join(f"{x:.0f}" for x in xs)
        print(f"| {n} | {ma:.0f} ({runs(a)}) | {mb:.0f} ({runs(b)}) | {ma / mb:.2f} | "
              f"{states[0]:.1f} / {torch_states:.1f} | {states[1]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
