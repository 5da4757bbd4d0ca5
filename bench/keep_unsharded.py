#!/usr/bin/env python3
"""keep_unsharded: train_gpt with gradient accumulation, the gathered parameters freed after every microbatch's
backward (the default) or kept for the next microbatch (--keep-unsharded-between-microbatches: FSDP2's
set_reshard_after_backward(False) on all but the last), side by side (issue 30, docs/BENCHMARKS.md).

    .venv/bin/python bench/keep_unsharded.py [--model small] [--steps 30] [--accum 4] [--repeats 1]

Two accumulation styles: each microbatch reduce-scattered (--reduce-scatter-each-microbatch, FSDP2's default) and
gradients kept unsharded until the last microbatch (no-sync). Each config trains the same model from the same
weights on the same batches, 2 ranks x 1 thread on Gloo, fp32. Reported: the all-gather bytes per step on rank 0 and
their ratio to the default's, the median step time after the warmup and its ratio, the peak RSS (max over the
ranks), and the largest |loss difference| from the default (the numbers must not move: 0).
"""

import argparse
import statistics
import tempfile
from pathlib import Path

import compare_fsdp2 as cmp


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    base = ["--model", args.model, "--batch-size", "4", "--seed", "7", "--steps", str(args.steps),
            "--warmup-steps", "10", "--grad-accum-steps", str(args.accum)]
    styles = {"reduce-scatter each": ["--reduce-scatter-each-microbatch"], "no-sync": []}
    keep = {"free (default)": [], "keep": ["--keep-unsharded-between-microbatches"]}
    print(f"{args.model}, 2 ranks x 1 thread, fp32, {args.accum} microbatches per step, {args.steps} steps, "
          f"{args.repeats} run(s) per config")
    print(f"{'accumulation':20s} {'gathers':15s} {'AG bytes/step':>14s} {'ratio':>6s} {'step ms':>8s} {'ratio':>6s} "
          f"{'peak RSS MiB':>12s} {'max |dloss|':>12s}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for style, sflags in styles.items():
            rows, times = {}, {}
            for r in range(args.repeats):
                for k, kflags in keep.items():  # alternated, so that drift hits both alike
                    d = tmp / f"{style}_{r}_{k}".replace(" ", "_")
                    d.mkdir()
                    got = cmp.run_ours(base + sflags + kflags, cmp.default_data(), d / "m.jsonl", timeout=3600)
                    rows.setdefault(k, got)
                    times.setdefault(k, []).extend(x["step_ms"] for x in got if x["step"] > args.warmup_steps)
            ref = "free (default)"
            ref_bytes = statistics.median(x["all_gather_bytes_per_step"] for x in rows[ref] if x["step"] > 1)
            ref_ms = statistics.median(times[ref])
            for k in keep:
                ag = statistics.median(x["all_gather_bytes_per_step"] for x in rows[k] if x["step"] > 1)
                ms = statistics.median(times[k])
                peak = max(x["peak_rss_mb"] for x in rows[k])
                dloss = cmp.max_abs_loss_diff(rows[k], rows[ref])
                print(f"{style:20s} {k:15s} {ag:14.0f} {ag / ref_bytes:6.3f} {ms:8.1f} {ms / ref_ms:6.2f} "
                      f"{peak:12.0f} {dloss:12.2e}")


if __name__ == "__main__":
    main()
