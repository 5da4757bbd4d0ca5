"""train_gpt under mpirun (the mpi backend) vs under fsdprun (Gloo) (CTest label mpi; registered only in a
build with MPI).

`mpirun -np N build/bin/train_gpt ...` with no MASTER_ADDR must pick the mpi backend by itself (train_gpt has
no MPI code) and train with the same losses as `fsdprun --nproc-per-node N` on the same global batch (fp32,
relative 1e-5: the reductions sum in another order). As root, mpirun needs --allow-run-as-root, and with more
ranks than cores --oversubscribe; --bind-to none leaves the threads unpinned as under fsdprun.

FSDP_BUILD_DIR is the CMake build directory (default: <repo>/build).
"""

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("FSDP_BUILD_DIR", REPO / "build"))
FSDPRUN = BUILD / "bin" / "fsdprun"
TRAIN_GPT = BUILD / "bin" / "train_gpt"
TEST_MPI = BUILD / "bin" / "test_mpi"
LICENSES = Path("/usr/share/common-licenses")
MPIRUN = shutil.which("mpirun")
MPIRUN_FLAGS = ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
RTOL = 1e-5

LAUNCHER_VARS = re.compile(r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_\w+"
                           r"|MASTER_ADDR|MASTER_PORT|OMP_NUM_THREADS|TORCHELASTIC_\w+|PET_\w+|SLURM_\w+|OMPI_\w+"
                           r"|PMIX_\w+)$")


def clean_env():
    return {k: v for k, v in os.environ.items() if not LAUNCHER_VARS.match(k)}


def text_files():
    return sorted(str(p) for p in LICENSES.iterdir() if p.is_file() and not p.is_symlink())


def args(out, *extra):
    return ["--model", "tiny", "--data", *text_files(), "--batch-size", "4", "--seed", "7", "--threads", "1",
            "--steps", "6", "--log-every", "1", "--eval-every", "3", "--warmup-steps", "2", "--sample-tokens", "0",
            "--metrics", str(out), *extra]


def run(cmd, timeout=240):
    p = subprocess.run(cmd, env=clean_env(), capture_output=True, encoding="utf-8", errors="replace",
                       timeout=timeout)
    assert p.returncode == 0, f"{cmd}\nrc={p.returncode}\n--- stdout ---\n{p.stdout[-4000:]}\n--- stderr ---\n" \
                              f"{p.stderr[-4000:]}"
    return p


def losses(path, key):
    rows = [json.loads(l) for l in Path(path).read_text().splitlines() if l.strip()]
    return {r["step"]: r[key] for r in rows if r.get(key) is not None}


def assert_close(mine, ref, what):
    assert mine.keys() == ref.keys() and mine, (what, sorted(mine), sorted(ref))
    worst = max(abs(mine[s] - ref[s]) / abs(ref[s]) for s in ref)
    assert worst <= RTOL, f"{what}: max relative difference {worst:.3g} > {RTOL:g}\nmpi  {mine}\ngloo {ref}"
    return worst


@pytest.fixture(scope="module", autouse=True)
def binaries():
    for b in (FSDPRUN, TRAIN_GPT, TEST_MPI):
        assert b.is_file(), f"{b} is missing: build it with `cmake --build {BUILD} --target {b.name}`"
    assert MPIRUN, "mpirun is missing: apt-get install openmpi-bin (scripts/setup.sh does)"


@pytest.mark.parametrize("nproc", [2, 3])
def test_mpirun_matches_fsdprun(tmp_path, nproc):
    mpi = run([MPIRUN, *MPIRUN_FLAGS, "-np", str(nproc), str(TRAIN_GPT), *args(tmp_path / "mpi.jsonl")])
    # train_gpt names its backend: mpi, chosen by default under mpirun without MASTER_ADDR.
    assert f"train_gpt: {nproc} ranks x 1 thread (mpi on cpu)" in mpi.stdout, mpi.stdout[-2000:]
    gloo = run([str(FSDPRUN), "--standalone", "--nproc-per-node", str(nproc), "--", str(TRAIN_GPT),
                *args(tmp_path / "gloo.jsonl")])
    assert "(gloo on cpu)" in gloo.stdout, gloo.stdout[-2000:]
    worst = assert_close(losses(tmp_path / "mpi.jsonl", "loss"), losses(tmp_path / "gloo.jsonl", "loss"),
                         "train loss")
    assert_close(losses(tmp_path / "mpi.jsonl", "eval_loss"), losses(tmp_path / "gloo.jsonl", "eval_loss"),
                 "eval loss")
    assert_close(losses(tmp_path / "mpi.jsonl", "grad_norm"), losses(tmp_path / "gloo.jsonl", "grad_norm"),
                 "grad norm")
    print(f"[mpi vs gloo] {nproc} ranks: max relative train-loss difference {worst:.3g}")


def test_explicit_gloo_under_mpirun_is_honoured_by_master_addr(tmp_path):
    """With MASTER_ADDR/MASTER_PORT exported, mpirun keeps the Gloo default (the user's choice)."""
    cmd = [MPIRUN, *MPIRUN_FLAGS, "-x", "MASTER_ADDR=127.0.0.1", "-x", "MASTER_PORT=29731", "-np", "2",
           str(TRAIN_GPT), *args(tmp_path / "m.jsonl", "--steps", "2")]
    p = run(cmd)
    assert "(gloo on cpu)" in p.stdout, p.stdout[-2000:]


def test_backend_mpi_under_fsdprun_fails_naming_the_fix():
    """fsdprun's processes are MPI jobs of one each: backend mpi refuses, naming mpirun."""
    p = run([str(FSDPRUN), "--standalone", "--nproc-per-node", "2", "--", str(TEST_MPI), "--expect-launch-error"],
            timeout=120)
    assert "not started by one mpirun" in p.stdout, p.stdout[-2000:]


def test_a_failing_rank_ends_the_job_instead_of_hanging():
    """Rank 1 exits with an error while rank 0 waits in an all_reduce: mpirun ends the job within seconds."""
    cmd = [MPIRUN, *MPIRUN_FLAGS, "-x", "FSDP_MPI_EXIT_TIMEOUT_S=3", "-np", "2", str(TEST_MPI), "--rank-1-fails"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=clean_env(), capture_output=True, encoding="utf-8", errors="replace", timeout=120)
    elapsed = time.monotonic() - t0
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert "rank 1: failing on purpose" in out, out[-3000:]
    assert "exiting without MPI_Finalize" in out, out[-3000:]
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end\n{out[-3000:]}"
