#!/usr/bin/env python3
"""FSDP + TP (dp x tp) against FSDP alone, same model, same global batch, one invocation (issue 15).

Runs build/bin/train_gpt through fsdprun on --nproc ranks (default 4) with --tp 1 (FSDP over every rank),
--tp 2, and --tp 2 --sequence-parallel, and prints per layout: the bytes each rank sends per step and the
collectives per step on each mesh dimension (from train_gpt's metrics: the transport bytes libfsdp counts,
see fsdp::CommStats), and the median step time as a ratio to FSDP alone. On a machine with fewer cores than
ranks the step times are oversubscribed: only the ratio, taken in one invocation, means anything; the
bytes and counts do not depend on the machine.

    .venv/bin/python bench/tp_vs_fsdp.py [--model small] [--steps 12] [--nproc 4] [--json]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD = Path(os.environ.get("FSDP_BUILD_DIR", REPO / "build"))


def run(layout, extra, args, tmp):
    metrics = Path(tmp) / f"{layout}.jsonl"
    cmd = [str(BUILD / "bin" / "fsdprun"), "--standalone", "--nproc-per-node", str(args.nproc), "--",
           str(BUILD / "bin" / "train_gpt"), "--model", args.model, "--steps", str(args.steps), "--log-every", "1",
           "--eval-every", str(args.steps), "--eval-batches", "1", "--sample-tokens", "0", "--threads", "1",
           "--seed", "7", "--no-progress", "--metrics", str(metrics), *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"{layout} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r.get("step_ms") is not None][2:]  # the first two steps warm up
    out = {"layout": layout, "args": " ".join(extra), "step_ms": statistics.median(r["step_ms"] for r in steps),
           "loss_last": steps[-1]["loss"]}
    last = steps[-1]
    if "comm_per_step" in last:
        out["comm_per_step"] = last["comm_per_step"]
        out["bytes_per_step"] = sum(k["sent"] for g in last["comm_per_step"].values() for k in g.values())
    else:
        out["bytes_per_step"] = last["bytes_per_step"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=2, help="sequences per rank of FSDP alone")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    b = args.batch_size
    layouts = [("fsdp", ["--batch-size", str(b)]),
               ("fsdp+tp2", ["--tp", "2", "--batch-size", str(2 * b)]),
               ("fsdp+tp2+sp", ["--tp", "2", "--sequence-parallel", "--batch-size", str(2 * b)])]
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(name, extra, args, tmp) for name, extra in layouts]
    base = rows[0]["step_ms"]
    for r in rows:
        r["step_time_ratio_to_fsdp"] = r["step_ms"] / base
    if args.json:
        print(json.dumps({"model": args.model, "nproc": args.nproc, "load_before": load_before, "rows": rows}))
        return
    print(f"train_gpt --model {args.model}, {args.nproc} ranks, global batch {b * args.nproc} sequences; "
          f"load average before {' '.join(load_before)}")
    print(f"{'layout':<14} {'bytes/step/rank':>16} {'step time vs fsdp':>18}  collectives per step (group: kind x count)")
    for r in rows:
        comm = r.get("comm_per_step")
        desc = "world: all-gather + reduce-scatter (see bytes_per_step)" if comm is None else "; ".join(
            f"{g}: " + ", ".join(f"{k} x{v['count']:.0f}" for k, v in kinds.items())
            for g, kinds in comm.items() if kinds)
        print(f"{r['layout']:<14} {r['bytes_per_step']:>16,.0f} {r['step_time_ratio_to_fsdp']:>18.2f}  {desc}")


if __name__ == "__main__":
    main()
