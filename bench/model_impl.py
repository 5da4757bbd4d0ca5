#!/usr/bin/env python3
"""model_impl: step time of train_gpt's unchanged model (--model-impl plain) vs its FSDPModule holder model.

    .venv/bin/python bench/model_impl.py                 # tiny and small, fp32 and bf16, a table
    .venv/bin/python bench/model_impl.py --configs tiny  # only the configs matching a regex
    .venv/bin/python bench/model_impl.py --json          # one JSON object per config

Both runs are the same train_gpt invocation (2 ranks through fsdprun, 1 thread each, the same weights and
batches) except for --model-impl: `holder` declares the blocks as fsdp::FSDPModule<Block> (FSDP runs around
each block call), `plain` is the same GPT in plain LibTorch (examples/train_gpt/model_plain.h) that FSDP
drives at tensor level (issue 13). The two run alternately (ABBA order), --repeats times each; the step time
is the median over all runs of every step after the first --warmup-steps (rank 0's step_ms: forward,
backward, clipping, optimizer step). The goal is plain/holder <= 1.02. The per-step losses of the two are
compared too: they must be identical (the same collectives on the same data).

Launching, the idle-machine wait and the rerun of disturbed runs are compare_fsdp2.py's (see there).
"""

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_fsdp2 as cf  # noqa: E402

IMPLS = ("holder", "plain")


def configs(steps):
    """tiny: overhead-bound (a step is a few ms of compute), where a per-op cost shows most; small: ~30x the FLOPs."""
    out = []
    for model, batch, n in (("tiny", 4, steps or 60), ("small", 8, steps or 20)):
        for precision in ("fp32", "bf16"):
            out.append(cf.Config(f"{model} {precision}", model, batch, precision, "true", n))
    return out


def bench_config(cfg, args, data, work):
    d = work / re.sub(r"[^\w.-]+", "_", cfg.name)
    d.mkdir(parents=True, exist_ok=True)
    skip = min(args.warmup_steps, cfg.steps - 1)
    samples = {impl: cf.Samples() for impl in IMPLS}
    losses = {}
    disturbed = 0
    for rep in range(args.repeats):
        order = IMPLS if rep % 2 == 0 else IMPLS[::-1]  # ABBA
        for impl in order:
            metrics = d / f"{impl}_{rep}.jsonl"
            flags = [*cfg.train_flags(), "--model-impl", impl]
            rows, bad = cf.measured(impl, lambda: cf.run_ours(flags, data, metrics, nproc=args.nproc,
                                                              threads=args.threads), args)
            disturbed += bad
            samples[impl].add(rows, skip)
            losses.setdefault(impl, {r["step"]: r["loss"] for r in rows})
            cf.log(f"  {cfg.name} {impl} run {rep + 1}: median {statistics.median(cf.rows_ms(rows, skip)):.2f} ms/step")
    h, p = samples["holder"].median_ms(), samples["plain"].median_ms()
    differing = [s for s in losses["holder"] if losses["holder"][s] != losses["plain"].get(s)]
    return {"config": cfg.name, "holder_step_ms": round(h, 2), "plain_step_ms": round(p, 2),
            "ratio": round(p / h, 3),
            "holder_run_medians": [round(v, 2) for v in samples["holder"].run_medians],
            "plain_run_medians": [round(v, 2) for v in samples["plain"].run_medians],
            "holder_peak_rss_mb": round(samples["holder"].peak(), 1), "plain_peak_rss_mb": round(samples["plain"].peak(), 1),
            "identical_losses": not differing, "first_differing_step": differing[0] if differing else None,
            "runs": args.repeats, "steps": cfg.steps, "timed_steps": cfg.steps - skip, "ranks": args.nproc,
            "threads_per_rank": args.threads, "disturbed_runs": disturbed, "load_avg_1m": round(os.getloadavg()[0], 2)}


def print_table(rows, load_before, load_after):
    head = (f"{'config':<12} {'holder ms':>10} {'plain ms':>9} {'plain/holder':>13} {'holder MiB':>11} "
            f"{'plain MiB':>10} {'losses':>10}")
    cf.print_header(head)
    for r in rows:
        same = "identical" if r["identical_losses"] else f"step {r['first_differing_step']}"
        print(f"{r['config']:<12} {r['holder_step_ms']:>10.2f} {r['plain_step_ms']:>9.2f} {r['ratio']:>13.3f} "
              f"{r['holder_peak_rss_mb']:>11.0f} {r['plain_peak_rss_mb']:>10.0f} {same:>10}")
    r0 = rows[0]
    print(f"\n{r0['ranks']} ranks x {r0['threads_per_rank']} thread; step time = median over {r0['runs']} runs per "
          f"variant in ABBA order (steps after the first {r0['steps'] - r0['timed_steps']}); run medians in --json; "
          f"load average {load_before:.2f} before, {load_after:.2f} after ({os.cpu_count()} CPUs)")
    disturbed = sum(r["disturbed_runs"] for r in rows)
    if disturbed:
        print(f"warning: {disturbed} runs were kept although other processes used more than the allowed CPU "
              f"during them (--max-foreign-cpus, --max-reruns): their times are inflated")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="one JSON object per config on stdout")
    ap.add_argument("--configs", help="only the configs whose name matches this regex (e.g. 'tiny')")
    ap.add_argument("--repeats", type=int, default=4, help="runs per variant and config")
    ap.add_argument("--steps", type=int, help="steps per run (default: tiny 60, small 20)")
    ap.add_argument("--warmup-steps", type=int, default=5, help="first steps of each run left out of the timing")
    ap.add_argument("--nproc", type=int, default=2, help="ranks")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--data", nargs="+", help="text files for train_gpt (default: the licence texts)")
    ap.add_argument("--quiet-wait", type=float, default=10,
                    help="before each run, wait up to this many seconds for the machine to be idle (0: never)")
    ap.add_argument("--max-foreign-cpus", type=float, default=0.25,
                    help="a run during which other processes used more CPUs than this on average is measured again")
    ap.add_argument("--max-reruns", type=int, default=2, help="times a disturbed run is measured again")
    ap.add_argument("--patience", type=float, default=float("inf"),
                    help="seconds after which runs no longer wait for an idle machine nor are measured again")
    ap.add_argument("--no-snapshot", action="store_true",
                    help="run the build directory's binaries in place (default: a private copy, immune to rebuilds)")
    args = ap.parse_args()
    for b in ("train_gpt", "fsdprun"):
        if not (cf.BUILD / "bin" / b).is_file():
            sys.exit(f"model_impl: {cf.BUILD / 'bin' / b} is missing: cmake --build {cf.BUILD} --target {b}")
    todo = [c for c in configs(args.steps) if not args.configs or re.search(args.configs, c.name)]
    if not todo:
        sys.exit(f"model_impl: no config matches {args.configs!r}")
    data = args.data or cf.default_data()
    work = Path(tempfile.mkdtemp(prefix="model_impl."))
    if not args.no_snapshot:
        cf.snapshot_build(work / "snapshot")
    t0 = time.monotonic()
    load_before = os.getloadavg()[0]
    rows = []
    try:
        for cfg in todo:
            rows.append(bench_config(cfg, args, data, work))
            if args.json:
                print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not args.json:
        print_table(rows, load_before, os.getloadavg()[0])
    cf.log(f"model_impl: {len(rows)} configs in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
