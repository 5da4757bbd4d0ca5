#!/usr/bin/env python3
"""estimate_vs_measured: fsdp::estimate_memory's prediction (train_gpt --estimate-memory) against the
measured per-rank peak of the same train_gpt run, for the table in docs/BENCHMARKS.md ("Memory estimator").

    .venv/bin/python bench/estimate_vs_measured.py [--quick] [--out FILE.md]

Measured: the peak RSS (VmHWM) of the last step's metrics line (max over ranks) minus rank 0's RSS before
the model's construction (train_gpt's "model built" line), 3 steps, 1 intra-op thread per rank; 2 ranks run
under fsdprun. Run it with MALLOC_MMAP_THRESHOLD_=131072 to measure the bytes alive (glibc's default
dynamic threshold keeps freed blocks in its heap, so RSS exceeds them). Predicted: the "total peak" row of --estimate-memory with the same flags (model states,
the step's largest moment and LibTorch's own first-use memory).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "build" / "bin"
COMMON = ["--steps", "3", "--eval-every", "100", "--eval-batches", "1", "--sample-tokens", "0", "--log-every", "1",
          "--threads", "1"]
WIDE = ["--model", "small", "--n-layer", "4", "--n-embd", "1024", "--n-head", "16", "--block-size", "64",
        "--batch-size", "2"]
# (label, ranks, flags)
CONFIGS = [
    ("tiny fp32", 1, ["--model", "tiny"]),
    ("tiny bf16", 2, ["--model", "tiny", "--mixed-precision", "bf16"]),
    ("small fp32", 1, ["--model", "small", "--batch-size", "16"]),
    ("small fp32", 2, ["--model", "small", "--batch-size", "16"]),
    ("small bf16 reshard false", 2, ["--model", "small", "--batch-size", "16", "--mixed-precision", "bf16",
                                     "--reshard-after-forward", "false"]),
    ("small fp32 AC", 1, ["--model", "small", "--batch-size", "16", "--activation-checkpointing", "full"]),
    ("medium fp32", 2, ["--model", "medium", "--batch-size", "16"]),
    ("medium bf16 AC", 1, ["--model", "medium", "--batch-size", "16", "--mixed-precision", "bf16",
                           "--activation-checkpointing", "full"]),
    ("wide fp32", 1, WIDE),
    ("wide fp32", 2, WIDE),
    ("wide fp32 reshard false", 2, WIDE + ["--reshard-after-forward", "false"]),
]
QUICK = {0, 3, 9}


def launch(ranks, args, env):
    cmd = [str(BIN / "train_gpt")] + args
    if ranks > 1:
        cmd = [str(BIN / "fsdprun"), "--standalone", "--nproc-per-node", str(ranks), "--"] + cmd
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        sys.exit(f"estimate_vs_measured: {' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return r.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 configs instead of all")
    ap.add_argument("--out", help="also write the markdown table here")
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    rows = ["| config | ranks | predicted MiB | measured MiB | error | peak moment |", "|---|---|---|---|---|---|"]
    for i, (label, ranks, flags) in enumerate(CONFIGS):
        if args.quick and i not in QUICK:
            continue
        out = launch(ranks, flags + COMMON + ["--estimate-memory"], env)
        predicted = float(re.search(r"total peak\s+([\d.]+) MiB", out).group(1))
        moment = re.search(r"peak, at the (.*):", out).group(1)
        with tempfile.TemporaryDirectory() as tmp:
            metrics = Path(tmp) / "m.jsonl"
            out = launch(ranks, flags + COMMON + ["--metrics", str(metrics)], env)
            baseline = float(re.search(r"over the (\d+) MiB before construction", out).group(1))
            peak = json.loads(metrics.read_text().splitlines()[-1])["peak_rss_mb"]
        measured = peak - baseline
        err = (predicted - measured) / measured
        rows.append(f"| {label} | {ranks} | {predicted:.0f} | {measured:.0f} | {100 * err:+.1f}% | {moment} |")
        print(rows[-1], flush=True)
    allocator = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    rows.insert(0, "glibc malloc: " + (f"MALLOC_MMAP_THRESHOLD_={allocator}" if allocator else "default settings") + "\n")
    table = "\n".join(rows)
    print("\n" + table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
