#!/usr/bin/env python3
"""replicate_vs_fully_shard: step time of fsdp::replicate (DDP semantics) against fully_shard on the same model,
and against PyTorch's own replicate (replicate_with_fsdp), side by side (issue 30, docs/BENCHMARKS.md).

    .venv/bin/python bench/replicate_vs_fully_shard.py [--model small] [--steps 20] [--repeats 3]

Configs, run in turn (ABC... order, `--repeats` times), 2 ranks x 1 thread on Gloo, fp32, the same initial weights
and batches: ours replicate (train_gpt --data-parallel replicate), ours fully_shard on a 1-D mesh, ours fully_shard
on a (2, 1) mesh (HSDP with one-rank shards, what replicate is built on, but resharding after forward), and
PyTorch's replicate and fully_shard (bench/gpt_twin.py). The figure is the median step time over every step after
`--warmup-steps` of every run, taken on rank 0 around the same work on both sides; ratios against ours replicate.
"""

import argparse
import statistics
import tempfile
from pathlib import Path

import compare_fsdp2 as cmp


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    base = ["--model", args.model, "--batch-size", "4", "--seed", "7", "--steps", str(args.steps),
            "--warmup-steps", "2"]
    ours = {"ours replicate": ["--data-parallel", "replicate"], "ours fully_shard": [],
            "ours fully_shard (2,1) mesh": ["--dp-replicate", "2"]}
    times = {k: [] for k in [*ours, "torch replicate", "torch fully_shard"]}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for r in range(args.repeats):
            for name, flags in ours.items():
                d = tmp / f"{r}_{len(times[name])}_{name.replace(' ', '_')}"
                d.mkdir()
                rows = cmp.run_ours(base + flags, cmp.default_data(), d / "m.jsonl", save_init=d / "init.safetensors",
                                    dump_batches=d / "batches")
                times[name] += [x["step_ms"] for x in rows if x["step"] > args.warmup_steps]
                if name in ("ours replicate", "ours fully_shard"):
                    twin = "torch replicate" if name == "ours replicate" else "torch fully_shard"
                    rows = cmp.run_torch(d / "init.safetensors", d / "batches", d / "t.jsonl")
                    times[twin] += [x["step_ms"] for x in rows if x["step"] > args.warmup_steps]
    ref = statistics.median(times["ours replicate"])
    print(f"{args.model}, 2 ranks x 1 thread, fp32, {args.repeats} runs x {args.steps - args.warmup_steps} timed steps")
    print(f"{'config':30s} {'median step ms':>15s} {'/ ours replicate':>17s}")
    for name, t in times.items():
        m = statistics.median(t)
        print(f"{name:30s} {m:15.1f} {m / ref:17.2f}")


if __name__ == "__main__":
    main()
