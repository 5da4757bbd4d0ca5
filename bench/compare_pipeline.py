"""Runs bench_pipeline (libfsdp) and bench/pp_twin.py (PyTorch's torch.distributed.pipelining) on the same weights
and batches, one after the other per schedule (--repeats times, alternating which goes first, the best run of
each side kept), and prints the comparison (Markdown) per (schedule, m); exits 1 if a loss differs by more than 1e-5:

  .venv/bin/python bench/compare_pipeline.py [--nproc 4] [--blocks 8 --d 256 --batch 128] [--steps 7 --warmup 2]

Step time: per rank the median over the timed steps of zero_grad + schedule.step + optimizer step; the table shows
the slowest rank's. Bubble: libfsdp's measured time blocked receiving / the schedule's step time, the mean over
ranks, against the theory with equal F, B and W costs (bench_pipeline.cpp, theory_bubble); busy: libfsdp's schedule
step time minus that wait, the mean over ranks (compute, and time descheduled when ranks outnumber cores). Alive: per rank the
peak number of microbatches whose activations are held (forwards run minus backwards begun). Heap: per rank the
peak growth of glibc's heap during a step (MB; gradients are zeroed, not freed, so it is the activations), max
over ranks. Loss diff: the largest |libfsdp - PyTorch| over
every microbatch loss of every step (warmup included). Both sides run with OMP_NUM_THREADS=1.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD = Path(os.environ.get("FSDP_BUILD_DIR", REPO / "build"))
PY = REPO / ".venv" / "bin" / "python"
TORCHRUN = REPO / ".venv" / "bin" / "torchrun"
SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble", "zbv-zero-bubble"]


def env():
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    e["OMP_NUM_THREADS"] = "1"
    return e


def load(path):
    return {(r["schedule"], r["m"]): r for r in map(json.loads, Path(path).read_text().splitlines())}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--schedules", nargs="+")
    ap.add_argument("--microbatches", nargs="+", type=int, default=[4, 8, 16])
    ap.add_argument("--repeats", type=int, default=2, help="runs of each side per schedule (best kept)")
    ap.add_argument("--keep", help="folder for the init file and both sides' JSON lines (default: a temporary one)")
    args = ap.parse_args()
    tmp = Path(args.keep or tempfile.mkdtemp(prefix="pp_compare_"))
    tmp.mkdir(parents=True, exist_ok=True)
    init, ours, theirs = tmp / "init.safetensors", tmp / "libfsdp.jsonl", tmp / "pytorch.jsonl"
    subprocess.run([str(PY), str(REPO / "bench" / "pp_twin.py"), "--write-init", str(init), "--blocks",
                    str(args.blocks), "--d", str(args.d), "--batch", str(args.batch), "--n-batches",
                    str(args.steps + args.warmup)], check=True, env=env(), stdout=subprocess.DEVNULL)
    common = ["--init", str(init), "--steps", str(args.steps), "--warmup", str(args.warmup), "--microbatches",
              *map(str, args.microbatches)]

    def run_ours(schedule, out):
        subprocess.run([str(BUILD / "bin" / "fsdprun"), "--standalone", "--nproc-per-node", str(args.nproc), "--",
                        str(BUILD / "bin" / "bench_pipeline"), "--out", str(out), *common, "--schedules", schedule],
                       check=True, env=env())

    def run_theirs(schedule, out):
        subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", str(args.nproc),
                        str(REPO / "bench" / "pp_twin.py"), "--out", str(out), *common, "--schedules", schedule],
                       check=True, env=env(), stderr=subprocess.DEVNULL)

    # Per schedule, both sides one after the other, --repeats times in alternating order (ours first, then
    # theirs first, ...): load from other processes on the machine lands on both alike. Each side keeps, per
    # configuration, the run whose slowest rank's median step time was the lowest.
    a, b = {}, {}
    for schedule in args.schedules or SCHEDULES:
        for rep in range(args.repeats):
            sides = [(run_ours, ours, a), (run_theirs, theirs, b)]
            for fn, path, acc in (sides if rep % 2 == 0 else sides[::-1]):
                fn(schedule, path)
                for key, rec in load(path).items():
                    if key not in acc or max(rec["step_ms"]) < max(acc[key]["step_ms"]):
                        acc[key] = rec
    first = next(iter(a.values()))
    print(f"{args.nproc} ranks, {first['blocks']} blocks of d {first['d']} (4d hidden), batch {first['batch']}, "
          f"{first['threads']} thread(s) per rank, {args.steps} timed steps after {args.warmup}, best of {args.repeats} "
          f"runs per side; files in {tmp}\n")
    print("| schedule | m | libfsdp ms | PyTorch ms | ratio | bubble (theory) | busy ms | alive per rank libfsdp / "
          "PyTorch | heap MB libfsdp / PyTorch | max loss diff |")
    print("|---|---|---:|---:|---:|---|---:|---|---|---|")
    worst = 0.0
    for key in a:
        if key not in b:
            continue
        ra, rb = a[key], b[key]
        ta, tb = max(ra["step_ms"]), max(rb["step_ms"])
        bub = sum(ra["bubble"]) / len(ra["bubble"])
        assert len(ra["losses"]) == len(rb["losses"]), key
        diff = max(abs(x - y) for x, y in zip(ra["losses"], rb["losses"]))
        worst = max(worst, diff)
        alive = lambda r: ",".join(str(int(v)) for v in r["peak_alive"])  # noqa: E731
        busy = sum(ra["busy_ms"]) / len(ra["busy_ms"])
        print(f"| {key[0]} | {key[1]} | {ta:.1f} | {tb:.1f} | {ta / tb:.2f} | {bub:.2f} ({ra['theory_bubble']:.2f}) "
              f"| {busy:.1f} | {alive(ra)} / {alive(rb)} | {max(ra['peak_heap_mb']):.1f} / {max(rb['peak_heap_mb']):.1f} "
              f"| {diff:.1e} |")
    print(f"\nlargest loss difference: {worst:.2e}")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
