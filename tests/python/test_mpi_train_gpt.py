"""train_gpt under mpirun (the mpi backend) vs under fsdprun (Gloo) (CTest label mpi; registered only in a
build with MPI).

`mpirun -np N build/bin/train_gpt ...` with no MASTER_ADDR must pick the mpi backend by itself (train_gpt has
no MPI code) and train with the same losses as `fsdprun --nproc-per-node N` on the same global batch (fp32,
relative 1e-5: the reductions sum in another order). As root, mpirun needs --allow-run-as-root, and with more
ranks than cores --oversubscribe; --bind-to none leaves the threads unpinned as under fsdprun.

FSDP_BUILD_DIR is the CMake build directory (default: <repo>/build).
"""

import shutil
import subprocess
import time

import pytest

from fsdp_testing import (FSDPRUN, TEST_MPI, TRAIN_GPT, assert_close, clean_env, free_port, fsdprun_cmd, metric,
                          parity_args)

BINARIES = (FSDPRUN, TRAIN_GPT, TEST_MPI)
MPIRUN = shutil.which("mpirun")
MPIRUN_FLAGS = ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
RTOL = 1e-5


def run(cmd, timeout=240):
    p = subprocess.run(cmd, env=clean_env(), capture_output=True, encoding="utf-8", errors="replace",
                       timeout=timeout)
    assert p.returncode == 0, f"{cmd}\nrc={p.returncode}\n--- stdout ---\n{p.stdout[-4000:]}\n--- stderr ---\n" \
                              f"{p.stderr[-4000:]}"
    return p


def close(mine, ref, what):
    return assert_close(mine, ref, RTOL, what, names=("mpi ", "gloo"))


@pytest.fixture(scope="module", autouse=True)
def mpirun():
    assert MPIRUN, "mpirun is missing: apt-get install openmpi-bin (scripts/setup.sh does)"


@pytest.mark.parametrize("nproc", [2, 3])
def test_mpirun_matches_fsdprun(tmp_path, nproc):
    mpi = run([MPIRUN, *MPIRUN_FLAGS, "-np", str(nproc), str(TRAIN_GPT), *parity_args(tmp_path / "mpi.jsonl")])
    # train_gpt names its backend: mpi, chosen by default under mpirun without MASTER_ADDR.
    assert f"train_gpt: {nproc} ranks x 1 thread (mpi on cpu)" in mpi.stdout, mpi.stdout[-2000:]
    gloo = run(fsdprun_cmd(nproc, TRAIN_GPT, *parity_args(tmp_path / "gloo.jsonl")))
    assert "(gloo on cpu)" in gloo.stdout, gloo.stdout[-2000:]
    worst = close(metric(tmp_path / "mpi.jsonl", "loss"), metric(tmp_path / "gloo.jsonl", "loss"), "train loss")
    close(metric(tmp_path / "mpi.jsonl", "eval_loss"), metric(tmp_path / "gloo.jsonl", "eval_loss"), "eval loss")
    close(metric(tmp_path / "mpi.jsonl", "grad_norm"), metric(tmp_path / "gloo.jsonl", "grad_norm"), "grad norm")
    print(f"[mpi vs gloo] {nproc} ranks: max relative train-loss difference {worst:.3g}")


def test_explicit_gloo_under_mpirun_is_honoured_by_master_addr(tmp_path):
    """With MASTER_ADDR/MASTER_PORT exported, mpirun keeps the Gloo default (the user's choice). A free port, not a
    fixed one: two suites at once both ran this test and their jobs met on one port."""
    cmd = [MPIRUN, *MPIRUN_FLAGS, "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={free_port()}", "-np", "2",
           str(TRAIN_GPT), *parity_args(tmp_path / "m.jsonl", "--steps", "2")]
    p = run(cmd)
    assert "(gloo on cpu)" in p.stdout, p.stdout[-2000:]


def test_backend_mpi_under_fsdprun_fails_naming_the_fix():
    """fsdprun's processes are MPI jobs of one each: backend mpi refuses, naming mpirun."""
    p = run(fsdprun_cmd(2, TEST_MPI, "--expect-launch-error"), timeout=120)
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
