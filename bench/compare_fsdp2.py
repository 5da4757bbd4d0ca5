#!/usr/bin/env python3
"""compare_fsdp2: libfsdp vs PyTorch's own FSDP2, side by side: loss parity, step time and peak memory.

    .venv/bin/python bench/compare_fsdp2.py            # every config, a table (docs/BENCHMARKS.md)
    .venv/bin/python bench/compare_fsdp2.py --quick    # four configs (fp32, raf=true), fewer runs
    .venv/bin/python bench/compare_fsdp2.py --json     # one JSON object per config

For each config, ours is train_gpt through fsdprun and PyTorch's is bench/gpt_twin.py (the same GPT, sharded
with torch.distributed.fsdp.fully_shard on Gloo) through torchrun, with the same world size, threads per rank,
steps, initial weights (train_gpt --save-init) and token batches (train_gpt --dump-batches). The two run
alternately (ABBA order), several times; the step time is the median over all runs of every step after the
first few (warmup), taken on rank 0 around the same work on both sides (forward, backward, clipping,
optimizer step, zero_grad, loss all-reduce). Peak RSS is VmHWM, the largest over the ranks (median over runs).
max |dloss| compares the per-step losses (global batch) of ours and PyTorch's, largest over steps and runs.

The floor is the same per-rank work in one process without collectives or FSDP: train_gpt --no-shard, one
process with the per-rank batch, plain LibTorch (bf16 by CPU autocast). As many such processes as ranks run
at once, so that the machine is as busy as in the sharded run (on 2 cores, one process alone would get a
core and the memory bandwidth to itself). "ours/floor" is what sharding costs us. PyTorch's own floor
(gpt_twin --no-shard, plain eager PyTorch) is shown alongside. --breakdown adds both sides on 1 rank (FSDP
at world size 1: the machinery without communication), again n copies at once.

max |dloss| (same math): PyTorch's side rerun once with gpt_twin --math libtorch, which replays the
arithmetic of LibTorch's AdamW and of fsdp::clip_grad_norm_: 0 means bitwise equal losses.

Timings on a shared machine are noisy: the load average is printed with the results.

--device cuda (issue 12): both sides on the GPU (train_gpt --device cuda on NCCL; gpt_twin.py --device cuda,
PyTorch's fully_shard on NCCL), by default on 1 rank (--nproc 1), the GPT-2-small preset (12 x 768, 12 heads,
context 1024) in bf16 (timing: step ms, tokens/s, MFU, peak GPU memory from the CUDA caching allocator) and in
fp32 (loss parity over 20 steps). No floors; runs start without waiting for an idle CPU.

--model llama-* on the CPU (issue 33): the Llama presets, fp32 and bf16 (reshard_after_forward true), --batch-size
sequences per rank (default 1) of --block-size tokens (default: the preset's); PyTorch's side is transformers' own
LlamaForCausalLM under fully_shard (gpt_twin.py picks it from the --save-init file). Besides step time and memory:
tokens/s (global batch), the model FLOPs per token (train_gpt's count, reporting.cpp: torchtitan's 6 x (parameters -
the untied embedding) + 12 x layers x heads x head_dim x context), the model GFLOP/s and the MFU against
--cpu-peak-gflops (the machine's dense GEMM rate in fp32 / bf16; train_gpt reports MFU on CUDA only), both sides with
the same count.

    .venv/bin/python bench/compare_fsdp2.py --model llama-150m --batch-size 1 --block-size 256 --steps 7 \
        --warmup-steps 2 --repeats 2 --no-floor --max-reruns 1     # docs/BENCHMARKS.md, "Llama vs PyTorch FSDP2"
"""

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD = Path(os.environ.get("FSDP_BUILD_DIR", REPO / "build"))
BIN = BUILD / "bin"      # where train_gpt and fsdprun are run from (main() may point it at a snapshot)
LIB_DIR = None           # a snapshot's libraries, put first on LD_LIBRARY_PATH (before the binaries' RUNPATH)
PYTHON = Path(sys.executable)
DEVICE = "cpu"           # --device: both sides' device
TWIN = REPO / "bench" / "gpt_twin.py"
LICENSES = Path("/usr/share/common-licenses")

# Variables a launcher sets: never inherited from our own environment.
LAUNCHER_VARS = re.compile(r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_\w+"
                           r"|MASTER_ADDR|MASTER_PORT|OMP_NUM_THREADS|TORCHELASTIC_\w+|PET_\w+|SLURM_\w+|OMPI_\w+)$")


def clean_env():
    env = {k: v for k, v in os.environ.items() if not LAUNCHER_VARS.match(k)}
    if LIB_DIR:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(LIB_DIR), env.get("LD_LIBRARY_PATH")]))
    return env


def snapshot_build(dest):
    """Copies train_gpt, fsdprun, the build's shared libraries and gpt_twin.py to dest and runs from there: a
    rebuild or an edit during a long benchmark (others share the tree) then neither breaks a run nor mixes
    versions."""
    global BIN, LIB_DIR, TWIN
    (dest / "bin").mkdir(parents=True, exist_ok=True)
    (dest / "lib").mkdir(exist_ok=True)
    for b in ("train_gpt", "fsdprun"):
        shutil.copy2(BUILD / "bin" / b, dest / "bin" / b)
    for lib in (BUILD / "lib").glob("*.so*"):
        shutil.copy2(lib, dest / "lib" / lib.name)
    shutil.copy2(TWIN, dest / TWIN.name)
    BIN, LIB_DIR, TWIN = dest / "bin", dest / "lib", dest / TWIN.name


def busy_cpus(interval=0.5):
    """CPUs busy over `interval` s, from /proc/stat (all processes, ours included)."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait
    t0, i0 = sample()
    time.sleep(interval)
    t1, i1 = sample()
    return (os.cpu_count() or 1) * (1 - (i1 - i0) / max(t1 - t0, 1))


QUIET_WAITS = []  # seconds waited before runs for the machine to be idle
DISCARDED = []    # (variant, CPUs other processes used on average) of runs measured again
START = time.monotonic()


def cpu_seconds():
    """(CPU seconds used by the whole machine, by this process and its finished children) so far."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    machine = (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    ours = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))
    return machine, ours


def measured(name, fn, args):
    """Runs fn (which starts processes and waits for them) on a machine as quiet as can be had: waits for
    idle CPUs first, then checks how much CPU other processes took during the run (the whole machine's busy
    time minus ours and our children's); above --max-foreign-cpus on average, the run is discarded and
    measured again, at most --max-reruns times (then kept, and counted as disturbed)."""
    for attempt in range(args.max_reruns + 1):
        # Past the time budget (--quick: it must finish in minutes), take the machine as it is.
        patient = time.monotonic() - START < args.patience
        if patient:
            wait_until_quiet(args.quiet_wait)
        m0, o0 = cpu_seconds()
        t0 = time.monotonic()
        result = fn()
        m1, o1 = cpu_seconds()
        foreign = max(0.0, (m1 - m0) - (o1 - o0)) / max(time.monotonic() - t0, 1e-9)
        if foreign <= args.max_foreign_cpus or attempt == args.max_reruns or not patient:
            return result, foreign > args.max_foreign_cpus
        DISCARDED.append((name, foreign))
        log(f"  {name}: other processes used {foreign:.2f} CPUs during the run: measuring it again")


def wait_until_quiet(max_wait, threshold=0.3):
    """Before a timed run: waits (up to max_wait s) until the machine is idle (others' builds and tests on a
    shared machine add noise to every step), so that runs start on a quiet machine as far as possible."""
    t0 = time.monotonic()
    while max_wait > 0 and time.monotonic() - t0 < max_wait and busy_cpus() > threshold:
        pass
    QUIET_WAITS.append(time.monotonic() - t0)


def default_data():
    """The licence texts every Debian system ships (as the tests): the content does not change the timing."""
    return sorted(str(p) for p in LICENSES.iterdir() if p.is_file() and not p.is_symlink())


@dataclass
class Config:
    name: str
    model: str            # train_gpt --model preset
    batch_size: int       # per rank
    precision: str        # fp32 | bf16
    reshard: str          # reshard_after_forward of the blocks: true | false
    steps: int
    extra: list = field(default_factory=list)  # more train_gpt flags (both sides replay them via run.json)
    repeats: int = 0      # runs per side (0: --repeats)

    def train_flags(self):
        return ["--model", self.model, "--batch-size", str(self.batch_size), "--mixed-precision", self.precision,
                "--reshard-after-forward", self.reshard, "--steps", str(self.steps), *self.extra]


def llama_configs(model, batch, block_size=None, steps=None):
    """--model llama-* on the CPU: fp32 (also the parity stretch, same math) and bf16, reshard_after_forward true."""
    extra = ["--block-size", str(block_size)] if block_size else []
    return [Config(f"{model} {precision}", model, batch, precision, "true", steps or 8, list(extra))
            for precision in ("fp32", "bf16")]


def single_configs(device, steps=None, batch=16, model="gpt2-small"):
    """--device cuda (or --single): one preset, bf16 for the timing, fp32 for the loss parity (20 steps)."""
    return [Config(f"{model} bf16 {device}", model, batch, "bf16", "true", steps or 30, ["--device", device]),
            Config(f"{model} fp32 {device}", model, batch, "fp32", "true", 20, ["--device", device], repeats=1)]


# wide (issue 16): parameter-heavy, little compute per parameter: 4 layers x 512 dims (12.6M parameters,
# 50 MiB in fp32) on a context of 32 and 2 sequences per rank, so that communication dominates the step.
WIDE = ["--n-layer", "4", "--n-head", "8", "--n-embd", "512", "--block-size", "32"]


def configs(quick, steps=None):
    """tiny: overhead-bound (a step is a few ms of compute); small: compute-heavier (~30x the FLOPs); medium:
    6 x 256, context 256 (~5x small's FLOPs per token at 2 sequences per rank); wide: communication-bound."""
    presets = (("tiny", 4, (40, 60), []), ("small", 8, (12, 20), []), ("medium", 2, (8, 12), []),
               ("wide", 2, (12, 20), WIDE))
    all_configs = []
    for name, batch, (quick_steps, full_steps), extra in presets:
        n = steps or (quick_steps if quick else full_steps)
        model = "small" if name == "wide" else name  # wide: the small preset with WIDE's dims
        for precision in ("fp32", "bf16"):
            for reshard in ("true", "false"):
                all_configs.append(Config(f"{name} {precision} raf={reshard}", model, batch, precision, reshard, n,
                                          list(extra)))
    if quick:
        return [c for c in all_configs if c.reshard == "true" and c.precision == "fp32"]
    return all_configs


# ---- Launching -----------------------------------------------------------------------------------------

RETRIES = []  # (what, return code, last line of stderr) of runs that failed once and were rerun
EXIT_CRASHES = []  # (what, return code) of runs that completed their steps, then died at exit


def _run(cmd, what, timeout, retry=False):
    """Runs cmd; raises with its output if it fails. With retry, a failed run is rerun once (and recorded in
    RETRIES): PyTorch's Gloo teardown occasionally aborts ("terminate called without an active exception")
    after the last step, which says nothing about the step times."""
    for attempt in range(2 if retry else 1):
        p = subprocess.run([str(c) for c in cmd], env=clean_env(), capture_output=True, encoding="utf-8",
                           errors="replace", timeout=timeout)
        if p.returncode == 0:
            return p
        # A run that finished its steps (train_gpt printed "done:", gpt_twin "gpt_twin: done": its metrics are
        # complete) and then died
        # at exit is kept, and reported (EXIT_CRASHES): the timing is valid, the crash is a finding.
        if (what == "train_gpt" and "done:" in p.stdout) or (what == "gpt_twin" and "gpt_twin: done" in p.stdout):
            EXIT_CRASHES.append((what, p.returncode))
            log(f"  warning: {what} finished its steps but exited with rc={p.returncode}")
            return p
        if attempt == 0 and retry:
            tail = (p.stderr.strip().splitlines() or [""])[-1]
            RETRIES.append((what, p.returncode, tail))
            log(f"  warning: {what} failed (rc={p.returncode}), running it again: {tail}")
    raise RuntimeError(f"{what} failed (rc={p.returncode}): {' '.join(map(str, cmd))}\n"
                       f"--- stdout ---\n{p.stdout[-3000:]}\n--- stderr ---\n{p.stderr[-3000:]}")


def run_ours(flags, data, metrics, nproc=2, threads=1, save_init=None, dump_batches=None, no_shard=False,
             timeout=600):
    """train_gpt through fsdprun (or alone with no_shard); returns its metrics rows (one per step)."""
    cmd = [BIN / "train_gpt", "--data", *data, *flags, "--threads", threads, "--log-every", "1",
           "--eval-every", "1000000", "--eval-batches", "1", "--sample-tokens", "0", "--metrics", metrics]
    if save_init:
        cmd += ["--save-init", save_init]
    if dump_batches:
        cmd += ["--dump-batches", dump_batches]
    if no_shard:
        cmd += ["--no-shard"]
    else:
        cmd = [BIN / "fsdprun", "--standalone", "--nproc-per-node", nproc, "--", *cmd]
    _run(cmd, "train_gpt", timeout)
    return [r for r in read_metrics(metrics) if r.get("loss") is not None]


def run_torch(init, batches, metrics, nproc=2, threads=1, math="torch", no_shard=False, extra=(), timeout=600):
    """bench/gpt_twin.py through torchrun (or alone with no_shard); returns its metrics rows."""
    twin = [TWIN, "--init", init, "--batches", batches, "--threads", threads, "--math", math, "--metrics", metrics,
            "--device", DEVICE, *extra]
    if no_shard:
        cmd = [PYTHON, *twin, "--no-shard"]
    else:
        cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", nproc, *twin]
    _run(cmd, "gpt_twin", timeout, retry=True)
    return read_metrics(metrics)


def read_metrics(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def max_abs_loss_diff(a, b):
    la = {r["step"]: r["loss"] for r in a}
    lb = {r["step"]: r["loss"] for r in b}
    if la.keys() != lb.keys():
        raise RuntimeError(f"the runs logged different steps: {sorted(la)} vs {sorted(lb)}")
    return max(abs(la[s] - lb[s]) for s in la)


# ---- Benchmark -----------------------------------------------------------------------------------------

@dataclass
class Samples:
    step_ms: list = field(default_factory=list)   # every timed step of every run (rank 0)
    peak_mb: list = field(default_factory=list)   # one per run
    run_medians: list = field(default_factory=list)
    peak_gpu_mb: list = field(default_factory=list)  # one per run (CUDA caching allocator, max over ranks)
    mfu: list = field(default_factory=list)          # train_gpt's per-step MFU (--device cuda)
    bytes_per_step: list = field(default_factory=list)      # train_gpt: bytes rank 0 sent, per timed step
    bytes_ratio_to_min: list = field(default_factory=list)  # train_gpt: that / FSDP's minimum
    minor_faults: list = field(default_factory=list)        # rank 0's minor page faults, per timed step

    def add(self, rows, skip, peak=True):
        ms = [r["step_ms"] for r in rows if r["step"] > skip]
        self.step_ms += ms
        self.run_medians.append(statistics.median(ms))
        if peak:
            self.peak_mb.append(rows[-1]["peak_rss_mb"])
        self.peak_gpu_mb.append(rows[-1].get("peak_gpu_mem_mb") or 0.0)
        self.mfu += [r["mfu"] for r in rows if r["step"] > skip and r.get("mfu") is not None]
        for key, dest in (("bytes_per_step", self.bytes_per_step), ("bytes_ratio_to_min", self.bytes_ratio_to_min),
                          ("minor_faults_per_step", self.minor_faults)):
            dest += [r[key] for r in rows if r["step"] > skip and r.get(key) is not None]

    @staticmethod
    def med(values, digits):
        return round(statistics.median(values), digits) if values else None

    def peak_gpu(self):
        return statistics.median(self.peak_gpu_mb) if self.peak_gpu_mb else float("nan")

    def median_ms(self):
        return statistics.median(self.step_ms) if self.step_ms else float("nan")

    def peak(self):
        return statistics.median(self.peak_mb) if self.peak_mb else float("nan")


def concurrently(fns):
    """Runs the callables at the same time (one thread each, each starting processes); returns their results."""
    with ThreadPoolExecutor(max_workers=len(fns)) as ex:
        futures = [ex.submit(fn) for fn in fns]
        return [f.result() for f in futures]


def bench_config(cfg, args, data, work):
    """Runs one config: each variant once per repetition, in ABBA order across repetitions (ours first in the
    first: it writes the weights and batches that every PyTorch run replays). Returns the result row."""
    d = work / re.sub(r"[^\w.-]+", "_", cfg.name)
    d.mkdir(parents=True, exist_ok=True)
    init, batches = d / "init.safetensors", d / "batches"
    init1, batches1 = d / "init_1rank.safetensors", d / "batches_1rank"
    skip = min(args.warmup_steps, cfg.steps - 1)
    flags = cfg.train_flags()
    kw = dict(threads=args.threads)
    n = args.nproc
    samples = {}
    ours_rows = []
    diffs = []
    disturbed = 0  # runs kept although other processes were busy during them

    # Each variant: a function of the repetition that returns the metrics of its runs (one list per process
    # group). The floors and the 1-rank variants run n copies at once: the machine as busy as with n ranks.
    def ours(rep):
        rows = run_ours(flags, data, d / f"ours{rep}.jsonl", nproc=n, save_init=init if rep == 0 else None,
                        dump_batches=batches if rep == 0 else None, **kw)
        ours_rows.append(rows)
        return [rows]

    def torch_(rep):
        rows = run_torch(init, batches, d / f"torch{rep}.jsonl", nproc=n, **kw)
        diffs.append(max_abs_loss_diff(ours_rows[0], rows))
        return [rows]

    def floor(rep):
        return concurrently([lambda i=i: run_ours(flags, data, d / f"floor{rep}_{i}.jsonl", no_shard=True, **kw)
                             for i in range(n)])

    def torch_floor(rep):
        return concurrently([lambda i=i: run_torch(init, batches, d / f"torch_floor{rep}_{i}.jsonl", no_shard=True, **kw)
                             for i in range(n)])

    def ours_1rank(rep):
        first = rep == 0
        return concurrently([lambda i=i: run_ours(flags, data, d / f"ours_1rank{rep}_{i}.jsonl", nproc=1,
                                                  save_init=init1 if first and i == 0 else None,
                                                  dump_batches=batches1 if first and i == 0 else None, **kw)
                             for i in range(n)])

    def torch_1rank(rep):
        return concurrently([lambda i=i: run_torch(init1, batches1, d / f"torch_1rank{rep}_{i}.jsonl", nproc=1, **kw)
                             for i in range(n)])

    repeats = cfg.repeats or args.repeats
    variants = [("ours", ours, repeats), ("torch", torch_, repeats)]
    if not args.no_floor:
        variants += [("floor", floor, args.repeats), ("torch_floor", torch_floor, args.torch_floor_repeats)]
    if args.breakdown:
        variants += [("ours_1rank", ours_1rank, args.repeats), ("torch_1rank", torch_1rank, args.torch_floor_repeats)]
    for rep in range(repeats):
        for name, fn, reps in (variants if rep % 2 == 0 else variants[::-1]):
            if rep >= reps:
                continue
            runs, noisy = measured(f"{cfg.name}: {name}", lambda: fn(rep), args)
            disturbed += noisy
            s = samples.setdefault(name, Samples())
            # Ours' first run writes --save-init, for which train_gpt builds the model in full (the other runs
            # build it sharded, deferred_init): its peak RSS is left out when there are other runs.
            for rows in runs:
                s.add(rows, skip, peak=not (name == "ours" and rep == 0 and reps > 1))
            log(f"  {cfg.name}: {name} run {rep + 1}/{reps}: "
                f"{statistics.median([m for rows in runs for m in rows_ms(rows, skip)]):.1f} ms/step, "
                f"peak {max(rows[-1]['peak_rss_mb'] for rows in runs):.0f} MiB")
    # The stretch of the parity check: LibTorch's optimizer and clipping arithmetic replayed in PyTorch.
    # (--device cuda: for fp32 only, the parity config; bf16 is the timing config.)
    exact = None
    if not cfg.extra or cfg.precision == "fp32":
        exact = run_torch(init, batches, d / "torch_libtorch_math.jsonl", nproc=n, math="libtorch", **kw)

    def ms(name):
        return round(samples[name].median_ms(), 3) if name in samples else None

    o, t = samples["ours"].median_ms(), samples["torch"].median_ms()
    row = {
        "config": cfg.name,
        "ours_step_ms": round(o, 3),
        "torch_step_ms": round(t, 3),
        "step_ratio": round(o / t, 3),
        "ours_peak_rss_mb": round(samples["ours"].peak(), 1),
        "torch_peak_rss_mb": round(samples["torch"].peak(), 1),
        "rss_ratio": round(samples["ours"].peak() / samples["torch"].peak(), 3),
        "max_abs_loss_diff": max(diffs),
        # Issue 16: bytes rank 0 sent per step at the transport level (fsdp::CommStats, train_gpt's metrics),
        # their ratio to FSDP's minimum ((N-1)/N of the all-gathers' outputs + the reduce-scatters' inputs),
        # rank 0's minor page faults per step (getrusage ru_minflt) on both sides; medians over timed steps.
        "bytes_per_step": Samples.med(samples["ours"].bytes_per_step, 0),
        "bytes_ratio_to_min": Samples.med(samples["ours"].bytes_ratio_to_min, 4),
        "minor_faults_per_step": Samples.med(samples["ours"].minor_faults, 1),
        "torch_minor_faults_per_step": Samples.med(samples["torch"].minor_faults, 1),
        # Beyond the required keys: parity with the same optimizer arithmetic, the floors, the breakdown,
        # the spread of the runs, the run shape.
        "max_abs_loss_diff_libtorch_math": max_abs_loss_diff(ours_rows[0], exact) if exact else None,
        "floor_step_ms": ms("floor"),
        "ours_floor_ratio": round(o / samples["floor"].median_ms(), 3) if "floor" in samples else None,
        "floor_peak_rss_mb": round(samples["floor"].peak(), 1) if "floor" in samples else None,
        "torch_floor_step_ms": ms("torch_floor"),
        "torch_floor_ratio": round(t / samples["torch_floor"].median_ms(), 3) if "torch_floor" in samples else None,
        "ours_1rank_step_ms": ms("ours_1rank"),
        "torch_1rank_step_ms": ms("torch_1rank"),
        "ours_peak_rss_runs_mb": [round(m) for m in samples["ours"].peak_mb],
        "torch_peak_rss_runs_mb": [round(m) for m in samples["torch"].peak_mb],
        "ours_run_medians_ms": [round(m, 2) for m in samples["ours"].run_medians],
        "torch_run_medians_ms": [round(m, 2) for m in samples["torch"].run_medians],
        "ranks": n, "threads_per_rank": args.threads, "steps": cfg.steps, "timed_steps": cfg.steps - skip,
        "runs": repeats, "batch_size": cfg.batch_size, "model": cfg.model, "disturbed_runs": disturbed,
        "device": DEVICE,
        "exit_crashes_so_far": len(EXIT_CRASHES),
    }
    if DEVICE == "cuda" or cfg.extra[:1] == ["--device"]:
        go, gt = samples["ours"].peak_gpu(), samples["torch"].peak_gpu()
        mfu_ours = statistics.median(samples["ours"].mfu) if samples["ours"].mfu else None
        row.update({
            "ours_peak_gpu_mem_mb": round(go, 1),
            "torch_peak_gpu_mem_mb": round(gt, 1),
            "gpu_mem_ratio": round(go / gt, 3) if gt else None,
            # Same tokens per step on both sides: tokens/s and MFU scale with 1 / step time.
            "ours_mfu": round(mfu_ours, 4) if mfu_ours is not None else None,
            "torch_mfu": round(mfu_ours * o / t, 4) if mfu_ours is not None else None,
        })
        for side, ms_ in (("ours", o), ("torch", t)):
            row[f"{side}_tokens_per_s"] = round(cfg.batch_size * n * BLOCK_SIZE.get(cfg.model, 0) * 1e3 / ms_, 1)
    if cfg.model.startswith("llama") and DEVICE == "cpu":
        # Throughput with train_gpt's FLOP count; the same tokens per step on both sides.
        block = int(cfg.extra[cfg.extra.index("--block-size") + 1]) if "--block-size" in cfg.extra else BLOCK_SIZE[cfg.model]
        fpt = llama_flops_per_token(init, block)
        peak = args.cpu_peak_gflops[1 if cfg.precision == "bf16" else 0] * 1e9
        row.update({"block_size": block, "flops_per_token": fpt, "cpu_peak_gflops": peak / 1e9})
        for side, ms_ in (("ours", o), ("torch", t)):
            tps = cfg.batch_size * n * block * 1e3 / ms_
            row[f"{side}_tokens_per_s"] = round(tps, 1)
            row[f"{side}_model_gflops"] = round(fpt * tps / 1e9, 2)
            row[f"{side}_mfu"] = round(fpt * tps / peak, 4)
    return row


def llama_flops_per_token(init, block):
    """train_gpt's flops_per_token for a Llama (examples/train_gpt/reporting.cpp, torchtitan's count): 6 x (the
    distinct parameters - an untied embedding, a lookup) + 12 x layers x heads x head_dim x context; the shape
    from the --save-init file (n_head from its metadata, the rest from the tensors)."""
    from math import prod

    from safetensors import safe_open
    with safe_open(init, framework="pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        n_head = int(f.metadata()["n_head"])
    params = sum(prod(v) for v in shapes.values())
    vocab, width = shapes["model.embed_tokens.weight"]
    embedding = vocab * width if "lm_head.weight" in shapes else 0
    layers = len({k.split(".")[2] for k in shapes if k.startswith("model.layers.")})
    return 6.0 * (params - embedding) + 12.0 * layers * n_head * (width // n_head) * block


# Context length of the presets (tokens per sequence), for tokens/s (examples/train_gpt/model.cpp).
BLOCK_SIZE = {"tiny": 32, "small": 128, "medium": 256, "gpt2-small": 1024, "wide": 32, "llama-tiny": 32,
              "llama-150m": 512}


def rows_ms(rows, skip):
    return [r["step_ms"] for r in rows if r["step"] > skip]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def print_header(head):
    print(head)
    print("-" * len(head))


def print_table(rows, load_before, load_after):
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    head = (f"{'config':<20} {'ours ms':>8} {'torch ms':>9} {'ratio':>6} {'floor ms':>9} {'ours/floor':>10} "
            f"{'torch floor':>11} {'torch/floor':>11} {'ours MiB':>9} {'torch MiB':>10} {'ratio':>6} "
            f"{'max|dloss|':>10} {'(same math)':>11}")
    print_header(head)
    for r in rows:
        print(f"{r['config']:<20} {r['ours_step_ms']:>8.1f} {r['torch_step_ms']:>9.1f} {r['step_ratio']:>6.2f} "
              f"{f(r['floor_step_ms'], '.1f'):>9} {f(r['ours_floor_ratio'], '.2f'):>10} "
              f"{f(r['torch_floor_step_ms'], '.1f'):>11} {f(r['torch_floor_ratio'], '.2f'):>11} "
              f"{r['ours_peak_rss_mb']:>9.0f} {r['torch_peak_rss_mb']:>10.0f} {r['rss_ratio']:>6.2f} "
              f"{r['max_abs_loss_diff']:>10.2g} {f(r['max_abs_loss_diff_libtorch_math'], '.2g'):>11}")
        print(f"{'':<20} wire: {f(r['bytes_per_step'] and r['bytes_per_step'] / 2**20, '.2f')} MiB/step sent by "
              f"rank 0, {f(r['bytes_ratio_to_min'], '.3f')} x FSDP's minimum; minor faults/step: ours "
              f"{f(r['minor_faults_per_step'], '.0f')}, torch {f(r['torch_minor_faults_per_step'], '.0f')}")
        if "ours_model_gflops" in r:
            print(f"{'':<20} throughput: tokens/s ours {r['ours_tokens_per_s']:.1f} / torch {r['torch_tokens_per_s']:.1f}; "
                  f"model GFLOP/s ours {r['ours_model_gflops']:.1f} / torch {r['torch_model_gflops']:.1f} "
                  f"({r['flops_per_token']:.4g} FLOP per token); MFU ours {r['ours_mfu']:.3f} / torch "
                  f"{r['torch_mfu']:.3f} (of {r['cpu_peak_gflops']:.0f} GFLOP/s); peak RSS per run ours "
                  f"{r['ours_peak_rss_runs_mb']} / torch {r['torch_peak_rss_runs_mb']} MiB")
        if "ours_peak_gpu_mem_mb" in r:
            print(f"{'':<20} GPU: peak ours {r['ours_peak_gpu_mem_mb']:.0f} MiB / torch {r['torch_peak_gpu_mem_mb']:.0f} "
                  f"MiB (ratio {f(r['gpu_mem_ratio'], '.2f')}); tokens/s ours {r['ours_tokens_per_s']:.0f} / torch "
                  f"{r['torch_tokens_per_s']:.0f}; MFU ours {f(r['ours_mfu'], '.3f')} / torch {f(r['torch_mfu'], '.3f')}")
    if any(r["ours_1rank_step_ms"] is not None for r in rows):
        print(f"\nbreakdown (ms/step; every column with {rows[0]['ranks']} processes busy at once):")
        head = (f"{'config':<20} {'floor':>8} {'ours 1 rank':>12} {'ours':>8} {'torch floor':>12} "
                f"{'torch 1 rank':>13} {'torch':>8}")
        print_header(head)
        for r in rows:
            print(f"{r['config']:<20} {f(r['floor_step_ms'], '.1f'):>8} {f(r['ours_1rank_step_ms'], '.1f'):>12} "
                  f"{r['ours_step_ms']:>8.1f} {f(r['torch_floor_step_ms'], '.1f'):>12} "
                  f"{f(r['torch_1rank_step_ms'], '.1f'):>13} {r['torch_step_ms']:>8.1f}")
    r0 = rows[0]
    print(f"\n{r0['ranks']} ranks x {r0['threads_per_rank']} thread; step time = median over {r0['runs']} runs per "
          f"variant in ABBA order (steps after the first {r0['steps'] - r0['timed_steps']}); floor = {r0['ranks']} "
          f"one-process runs without FSDP at once; peak RSS = max over ranks of VmHWM; max|dloss| with "
          f"torch.optim.AdamW, (same math) with LibTorch's AdamW/clipping arithmetic; load average "
          f"{load_before:.2f} before, {load_after:.2f} after ({os.cpu_count()} CPUs)")
    disturbed = sum(r["disturbed_runs"] for r in rows)
    if disturbed:
        print(f"warning: {disturbed} runs were kept although other processes used more than the allowed CPU "
              f"during them (--max-foreign-cpus, --max-reruns): their times are inflated")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="every model, fp32, raf=true; 2 runs each")
    ap.add_argument("--json", action="store_true", help="one JSON object per config on stdout")
    ap.add_argument("--configs", help="only the configs whose name matches this regex (e.g. 'tiny.*fp32')")
    ap.add_argument("--repeats", type=int, help="runs per side and config (default: 3, --quick 2)")
    ap.add_argument("--steps", type=int, help="steps per run (default: tiny 60 / small 20, --quick 40 / 12)")
    ap.add_argument("--warmup-steps", type=int, default=5, help="first steps of each run left out of the timing")
    ap.add_argument("--nproc", type=int, default=2, help="ranks per side")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank, both sides")
    ap.add_argument("--no-floor", action="store_true", help="skip the one-process floors")
    ap.add_argument("--torch-floor-repeats", type=int, help="runs of PyTorch's floor (and 1-rank run) per config "
                                                         "(default: --repeats, --quick 1)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time both sides on 1 rank (FSDP without communication), n copies at once")
    ap.add_argument("--data", nargs="+", help="text files for train_gpt (default: the licence texts)")
    ap.add_argument("--quiet-wait", type=float, default=20,
                    help="before each run, wait up to this many seconds for the machine to be idle (0: never)")
    ap.add_argument("--max-foreign-cpus", type=float, default=0.25,
                    help="a run during which other processes used more CPUs than this on average is measured again")
    ap.add_argument("--max-reruns", type=int, default=3, help="times a disturbed run is measured again")
    ap.add_argument("--patience", type=float,
                    help="seconds after which runs no longer wait for an idle machine nor are measured again "
                         "(default: none; --quick 150, so that it ends within 5 minutes on a busy machine)")
    ap.add_argument("--no-snapshot", action="store_true",
                    help="run the build directory's binaries in place (default: a private copy, immune to rebuilds)")
    ap.add_argument("--keep", help="keep the runs' files (weights, batches, metrics) in this directory")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: both sides on the GPU with NCCL, GPT-2-small bf16 + fp32 (default --nproc 1)")
    ap.add_argument("--batch-size", type=int, help="--device cuda: sequences per rank per step (default 16); "
                                                  "--model llama-* on the CPU: the same (default 1)")
    ap.add_argument("--model", default="gpt2-small",
                    help="--device cuda: train_gpt preset; on the CPU, a llama-* preset (llama-tiny, llama-150m) "
                         "compares the Llama (fp32 and bf16) against transformers' LlamaForCausalLM under FSDP2")
    ap.add_argument("--block-size", type=int, help="--model llama-*: the context (default: the preset's)")
    ap.add_argument("--cpu-peak-gflops", type=float, nargs=2, default=[193.0, 407.0], metavar=("FP32", "BF16"),
                    help="--model llama-*: the machine's peak GFLOP/s in fp32 and bf16 for the MFU (default 193 407: "
                         "this machine's dense GEMM rate, torch.matmul 3072^3 on one thread, best of 4, measured "
                         "2026-12-05: 96.5 and 203.5 GFLOP/s, x 2 cores)")
    ap.add_argument("--single", action="store_true",
                    help="the --device cuda layout (one --model, bf16 timing + fp32 parity) on --device cpu: "
                         "a dry run of scripts/gpu_check.sh without a GPU")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" or args.single:
        # One GPU by default; no floors; no waiting for an idle CPU (the GPU does the work).
        if "--nproc" not in sys.argv:
            args.nproc = 1
        args.no_floor = True
        args.breakdown = False
        args.quiet_wait = 0
        args.max_reruns = 0
        if args.repeats is None:
            args.repeats = 2
    args.repeats = args.repeats or (2 if args.quick else 3)
    if args.patience is None:
        args.patience = 150 if args.quick else float("inf")
    if args.torch_floor_repeats is None:
        args.torch_floor_repeats = 1 if args.quick else args.repeats
    for b in ("train_gpt", "fsdprun"):
        if not (BUILD / "bin" / b).is_file():
            sys.exit(f"compare_fsdp2: {BUILD / 'bin' / b} is missing: cmake --build {BUILD} --target {b}")

    single = DEVICE == "cuda" or args.single
    llama = not single and args.model.startswith("llama")
    if args.batch_size is None:
        args.batch_size = 1 if llama else 16
    if single:
        all_cfgs = single_configs(DEVICE, args.steps, args.batch_size, args.model)
    elif llama:
        all_cfgs = llama_configs(args.model, args.batch_size, args.block_size, args.steps)
    else:
        all_cfgs = configs(args.quick, args.steps)
    todo = [c for c in all_cfgs if not args.configs or re.search(args.configs, c.name)]
    if not todo:
        sys.exit(f"compare_fsdp2: no config matches {args.configs!r}")
    data = args.data or default_data()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="compare_fsdp2."))
    if not args.no_snapshot:
        snapshot_build(work / "snapshot")
    t0 = time.monotonic()
    load_before = os.getloadavg()[0]
    rows = []
    try:
        for cfg in todo:
            row = bench_config(cfg, args, data, work)
            row["load_avg_1m"] = round(os.getloadavg()[0], 2)
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if not args.json:
        print_table(rows, load_before, os.getloadavg()[0])
    if DISCARDED:
        log(f"compare_fsdp2: {len(DISCARDED)} runs measured again: other processes were busy during them")
    if QUIET_WAITS and sum(QUIET_WAITS) > 1:
        log(f"compare_fsdp2: waited {sum(QUIET_WAITS):.0f} s in all for an idle machine before runs "
            f"({sum(w >= args.quiet_wait for w in QUIET_WAITS)} of {len(QUIET_WAITS)} runs started on a busy one)")
    for what, rc, tail in RETRIES:
        log(f"compare_fsdp2: note: a {what} run failed once (rc={rc}: {tail}) and was rerun")
    log(f"compare_fsdp2: {len(rows)} configs in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
