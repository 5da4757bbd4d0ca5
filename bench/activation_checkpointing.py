#!/usr/bin/env python3
"""activation_checkpointing: train_gpt's --activation-checkpointing modes side by side (none, full, selective-op,
layer:2): step time, peak memory, and fsdp::estimate_memory's prediction of it, for docs/BENCHMARKS.md (issue 31).

    MALLOC_MMAP_THRESHOLD_=131072 .venv/bin/python bench/activation_checkpointing.py [--steps 8] [--repeats 2] \
        [--impls holder,plain]

--impls plain runs the unchanged model (--model-impl plain), whose blocks are checkpointed from their parameters'
ops (recorded regions replayed in backward) instead of through checkpoint_wrapper's holder call.

Each config trains the same model from the same seed on 1 rank x 1 thread, fp32; the modes alternate within each
repeat so that drift hits all alike. Measured memory: the peak RSS of the last step (VmHWM) minus the RSS before
the model's construction, as bench/estimate_vs_measured.py (run with the fixed mmap threshold, so that RSS follows
the bytes alive). Predicted: the "total peak" row of --estimate-memory with the same flags. Reported per mode: the
median step time after the 2nd step and its ratio to none, peak MiB and its ratio, the prediction and its error,
and the largest |loss difference| from none (the modes must not change the numbers: 0).
"""
import argparse
import json
import os
import re
import statistics
import tempfile
from pathlib import Path

import estimate_vs_measured as evm

MODELS = {
    "small": ["--model", "small", "--batch-size", "16"],
    "wide": evm.WIDE,
}
MODES = ["none", "full", "selective-op", "layer:2"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--models", default="small,wide")
    ap.add_argument("--impls", default="holder", help="model implementations, comma-separated: holder, plain")
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    common = ["--steps", str(args.steps), "--eval-every", "1000000", "--eval-batches", "1", "--sample-tokens", "0",
              "--log-every", "1", "--threads", "1", "--seed", "7"]
    print("glibc malloc: " + (f"MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}"
                              if "MALLOC_MMAP_THRESHOLD_" in os.environ else "default settings"))
    print("| model | impl | activation checkpointing | median step ms | / none | peak MiB | / none | predicted MiB "
          "| error | max abs loss diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model, impl in [(m, i) for m in args.models.split(",") for i in args.impls.split(",")]:
        flags = MODELS[model] + ["--model-impl", impl]
        times, peaks, losses, predicted = {}, {}, {}, {}
        for mode in MODES:
            out = evm.launch(1, flags + common + ["--activation-checkpointing", mode, "--estimate-memory"], env)
            predicted[mode] = float(re.search(r"total peak\s+([\d.]+) MiB", out).group(1))
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.repeats):
                for mode in MODES:
                    metrics = Path(tmp) / f"{mode}_{r}.jsonl".replace(":", "_")
                    out = evm.launch(1, flags + common + ["--activation-checkpointing", mode, "--metrics", str(metrics)],
                                     env)
                    baseline = float(re.search(r"over the (\d+) MiB before construction", out).group(1))
                    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
                    rows = [x for x in rows if x.get("loss") is not None and "step_ms" in x]  # (not the eval rows)
                    times.setdefault(mode, []).extend(x["step_ms"] for x in rows if x["step"] > 2)
                    peaks.setdefault(mode, []).append(rows[-1]["peak_rss_mb"] - baseline)
                    losses.setdefault(mode, {x["step"]: x["loss"] for x in rows})
        for mode in MODES:
            ms, peak = statistics.median(times[mode]), statistics.median(peaks[mode])
            ms0, peak0 = statistics.median(times["none"]), statistics.median(peaks["none"])
            dloss = max(abs(losses[mode][s] - losses["none"][s]) for s in losses["none"])
            err = (predicted[mode] - peak) / peak
            print(f"| {model} | {impl} | {mode} | {ms:.1f} | {ms / ms0:.2f} | {peak:.0f} | {peak / peak0:.2f} | "
                  f"{predicted[mode]:.0f} | {100 * err:+.1f}% | {dloss:.1e} |", flush=True)


if __name__ == "__main__":
    main()
