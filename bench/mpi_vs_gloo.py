"""The same train_gpt training step on the mpi backend (mpirun) and on Gloo (fsdprun): ms/step and ratio.

    .venv/bin/python bench/mpi_vs_gloo.py                    # tiny and small, 2 ranks, 5 runs each side
    .venv/bin/python bench/mpi_vs_gloo.py --models tiny --nproc 3 --repeats 3

Both sides run the same binary with the same arguments (fp32, 1 intra-op thread per rank, the same data,
seed and batch); only the launcher, and with it the backend, differs: `mpirun --allow-run-as-root
--oversubscribe --bind-to none -np N train_gpt ...` (no MASTER_ADDR: train_gpt's init_process_group picks
"mpi") and `fsdprun --standalone --nproc-per-node N -- train_gpt ...` (Gloo over loopback). The runs
alternate (mpi, gloo, mpi, ...) so that load from other processes hits both sides alike; each run's ms/step
is the mean of train_gpt's `step_ms` over the logged intervals after the first (warm-up). Reports the median
per side and their ratio, and the load average before and after, since this machine is shared.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD = Path(os.environ.get("FSDP_BUILD_DIR", REPO / "build"))
LAUNCHER_VARS = re.compile(r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|OMP_NUM_THREADS"
                           r"|TORCHELASTIC_\w+|SLURM_\w+|OMPI_\w+|PMIX_\w+)$")


def run_once(side, nproc, model, steps, log_every, workdir):
    launcher = "gloo" if side == "gloo" else "mpi"
    metrics = Path(workdir) / f"{side}.jsonl"
    if metrics.exists():
        metrics.unlink()
    args = [str(BUILD / "bin" / "train_gpt"), "--model", model, "--steps", str(steps), "--log-every",
            str(log_every), "--eval-every", "100000", "--sample-tokens", "0", "--threads", "1", "--seed", "7",
            "--metrics", str(metrics)]
    if launcher == "mpi":
        cmd = [shutil.which("mpirun"), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np",
               str(nproc), *args]
        if side == "mpi-spin":  # MPI's own busy waiting (the MPI thread never sleeps): for comparison
            cmd[1:1] = ["-x", "FSDP_MPI_SPIN_US=1000000000"]
    else:
        cmd = [str(BUILD / "bin" / "fsdprun"), "--standalone", "--nproc-per-node", str(nproc), "--", *args]
    env = {k: v for k, v in os.environ.items() if not LAUNCHER_VARS.match(k)}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run(cmd, env=env, capture_output=True, encoding="utf-8", errors="replace", timeout=900)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    want = f"({launcher} on cpu)"
    if want not in p.stdout:
        sys.exit(f"expected train_gpt to report {want!r}:\n{p.stdout[-2000:]}")
    rows = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
    ms = [r["step_ms"] for r in rows if r.get("step_ms")][1:]  # drop the first interval: warm-up
    return statistics.mean(ms)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny", "small"])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--spin", action="store_true", help="also run the mpi side with FSDP_MPI_SPIN_US=1e9 (spinning)")
    a = ap.parse_args()
    print(f"load average before: {Path('/proc/loadavg').read_text().split()[:3]}")
    sides = ["mpi", "gloo"] + (["mpi-spin"] if a.spin else [])
    extra = " | mpi-spin ms/step | mpi-spin/gloo" if a.spin else ""
    print(f"| model | ranks | mpi ms/step | gloo ms/step | mpi/gloo{extra} | mpi runs | gloo runs |")
    print("|---|---:|---:|---:|---:|" + ("---:|---:|" if a.spin else "") + "---|---|")
    with tempfile.TemporaryDirectory() as d:
        for model in a.models:
            res = {s: [] for s in sides}
            for _ in range(a.repeats):
                for side in sides:
                    res[side].append(run_once(side, a.nproc, model, a.steps, a.log_every, d))
            m, g = statistics.median(res["mpi"]), statistics.median(res["gloo"])
            fmt = lambda xs: " ".join(f"{x:.1f}" for x in xs)
            spin = ""
            if a.spin:
                sp = statistics.median(res["mpi-spin"])
                spin = f" | {sp:.1f} | {sp / g:.2f}"
            print(f"| {model} | {a.nproc} | {m:.1f} | {g:.1f} | **{m / g:.2f}**{spin} | {fmt(res['mpi'])} | "
                  f"{fmt(res['gloo'])} |", flush=True)
    print(f"load average after: {Path('/proc/loadavg').read_text().split()[:3]}")


if __name__ == "__main__":
    main()
