#!/usr/bin/env python3
"""low_precision_all_gather: train_gpt with the weight matrices all-gathered in fp32, bf16 and float8 (e4m3, a scale
per shard; fsdp::LowPrecisionAllGather), side by side (issue 30, docs/BENCHMARKS.md).

    .venv/bin/python bench/low_precision_all_gather.py [--model tiny] [--steps 200] [--repeats 1]

Each config trains the same model from the same initial weights on the same batches, 2 ranks x 1 thread on Gloo,
fp32 compute (--all-gather-dtype changes only what the all-gather moves). Reported per config: the all-gather bytes
per step on rank 0 (the collectives' outputs, train_gpt's all_gather_bytes_per_step) and their ratio to fp32's,
all bytes this rank sent per step (transport), the median step time after the warmup and its ratio to fp32's, the
final loss (mean of the last 20 steps) and the largest |loss difference| from the fp32 run over all steps.
"""

import argparse
import statistics
import tempfile
from pathlib import Path

import compare_fsdp2 as cmp


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    base = ["--model", args.model, "--batch-size", "4", "--seed", "7", "--steps", str(args.steps),
            "--warmup-steps", "10"]
    configs = ["fp32", "bf16", "float8"]
    rows = {c: [] for c in configs}
    times = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for r in range(args.repeats):
            for c in configs:
                d = tmp / f"{r}_{c}"
                d.mkdir()
                got = cmp.run_ours(base + ["--all-gather-dtype", c], cmp.default_data(), d / "m.jsonl", timeout=3600)
                if r == 0:
                    rows[c] = got
                times[c] += [x["step_ms"] for x in got if x["step"] > args.warmup_steps]
    ref_bytes = statistics.median(x["all_gather_bytes_per_step"] for x in rows["fp32"] if x["step"] > 1)
    ref_ms = statistics.median(times["fp32"])
    print(f"{args.model}, 2 ranks x 1 thread, fp32 compute, {args.steps} steps, {args.repeats} run(s) per config")
    print(f"{'all-gather':10s} {'AG bytes/step':>14s} {'/ fp32':>7s} {'sent/step':>11s} {'step ms':>8s} {'/ fp32':>7s} "
          f"{'final loss':>10s} {'max |dloss| vs fp32':>20s}")
    for c in configs:
        ag = statistics.median(x["all_gather_bytes_per_step"] for x in rows[c] if x["step"] > 1)
        sent = statistics.median(x["bytes_per_step"] for x in rows[c] if x["step"] > 1)
        ms = statistics.median(times[c])
        final = statistics.mean(x["loss"] for x in rows[c][-20:])
        dloss = cmp.max_abs_loss_diff(rows[c], rows["fp32"])
        print(f"{c:10s} {ag:14.0f} {ag / ref_bytes:7.3f} {sent:11.0f} {ms:8.1f} {ms / ref_ms:7.2f} {final:10.4f} "
              f"{dloss:20.2e}")


if __name__ == "__main__":
    main()
