"""train_gpt launched by Slurm's srun on a real one-node cluster (CTest label multinode; issue 18).

`srun --ntasks 2 build/bin/train_gpt ...` with no RANK, WORLD_SIZE, MASTER_ADDR or MASTER_PORT: init_process_group
takes the rank from SLURM_PROCID, the world size from SLURM_NTASKS, MASTER_ADDR from the first host of
SLURM_STEP_NODELIST and MASTER_PORT from SLURM_JOB_ID (src/c10d/slurm_env.h), and trains with the same losses as
`fsdprun --nproc-per-node 2` (fp32, relative 1e-5; both use Gloo on the same ranks, so they agree exactly in
practice). Wrong setups fail within seconds with a message naming the variable. The cluster is
tests/python/slurm_cluster.py (skipped with the reason where its daemons cannot start). ~24 s on 2 cores.

FSDP_BUILD_DIR is the CMake build directory (default: <repo>/build).
"""

import socket
import subprocess
import time
from pathlib import Path

import pytest

from fsdp_testing import FSDPRUN, TRAIN_GPT, assert_close, clean_env, fsdprun_cmd, metric, parity_args, show
from slurm_cluster import running_slurm_cluster, slurm_cluster  # noqa: F401 (fixture)

BINARIES = (FSDPRUN, TRAIN_GPT)
RTOL = 1e-5
# srun: fail the step as soon as one task fails (also KillOnBadExit=1 in the cluster's slurm.conf).
SRUN = ["--ntasks", "2", "--kill-on-bad-exit=1"]


def close(mine, ref, what):
    return assert_close(mine, ref, RTOL, what, names=("srun   ", "fsdprun"))


def derived_port(job_id, step_id=0):
    """MASTER_PORT under srun without one (src/c10d/slurm_env.h, [Note: Slurm rendezvous])."""
    return 20000 + 10 * (job_id % 1000) + step_id % 10


class PortHolder:
    """Listens on a port of 127.0.0.1 so that a TCPStore cannot bind it."""

    def __init__(self, port):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("0.0.0.0", port))
        self.sock.listen(8)

    def close(self):
        self.sock.close()


def test_srun_trains_like_fsdprun(slurm_cluster, tmp_path):
    t0 = time.monotonic()
    p = slurm_cluster.srun([*SRUN, TRAIN_GPT, *parity_args(tmp_path / "srun.jsonl")])
    assert p.returncode == 0, show(p)
    t_srun = time.monotonic() - t0
    # Two ranks from SLURM_NTASKS, Gloo: nothing but Slurm's variables told train_gpt about the job.
    assert "train_gpt: 2 ranks x 1 thread (gloo on cpu)" in p.stdout, show(p)
    gloo = subprocess.run(fsdprun_cmd(2, TRAIN_GPT, *parity_args(tmp_path / "fsdprun.jsonl")), env=clean_env(),
                          capture_output=True, encoding="utf-8", errors="replace", timeout=180)
    assert gloo.returncode == 0, show(gloo)
    worst = close(metric(tmp_path / "srun.jsonl", "loss"), metric(tmp_path / "fsdprun.jsonl", "loss"), "train loss")
    close(metric(tmp_path / "srun.jsonl", "eval_loss"), metric(tmp_path / "fsdprun.jsonl", "eval_loss"), "eval loss")
    close(metric(tmp_path / "srun.jsonl", "grad_norm"), metric(tmp_path / "fsdprun.jsonl", "grad_norm"), "grad norm")
    print(f"[srun vs fsdprun] max relative train-loss difference {worst:.3g}; srun run {t_srun:.1f} s")


def test_one_fsdprun_per_node_under_srun(slurm_cluster, tmp_path):
    """docs/SLURM.md's form (b): srun starts one fsdprun per node with --nnodes/--node-rank/--master-addr from
    Slurm; fsdprun's RANK/WORLD_SIZE/MASTER_* win over the SLURM_* its workers inherit. Same losses as (a)."""
    ref = slurm_cluster.srun([*SRUN, TRAIN_GPT, *parity_args(tmp_path / "srun.jsonl", "--steps", "3")])
    assert ref.returncode == 0, show(ref)
    train = " ".join([str(TRAIN_GPT), *parity_args(tmp_path / "agent.jsonl", "--steps", "3")])
    script = ('head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1); '
              f'exec {FSDPRUN} --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" --master-addr "$head" '
              f'--master-port 0 --nproc-per-node 2 -- {train}')
    # --master-port 0 (a free port) is allowed with one node; a multi-node job names a fixed port.
    p = slurm_cluster.srun(["--ntasks-per-node", "1", "--nodes", "1", "--kill-on-bad-exit=1", "bash", "-c", script])
    assert p.returncode == 0, show(p)
    assert "train_gpt: 2 ranks x 1 thread (gloo on cpu)" in p.stdout, show(p)
    close(metric(tmp_path / "agent.jsonl", "loss"), metric(tmp_path / "srun.jsonl", "loss"), "train loss")


def test_the_store_listens_on_the_port_derived_from_the_job_id(slurm_cluster, tmp_path):
    """With the derived port of the next job taken, rank 0 fails at once naming the port, SLURM_JOB_ID and the
    fix; exporting MASTER_PORT (srun passes it on) moves the store and the same run then trains."""
    job = slurm_cluster.next_job_id()
    port = derived_port(job)
    holder = PortHolder(port)
    try:
        t0 = time.monotonic()
        p = slurm_cluster.srun([*SRUN, TRAIN_GPT, *parity_args(tmp_path / "a.jsonl", "--steps", "1")],
                               env=slurm_cluster.env(FSDP_TIMEOUT_S=20))
        elapsed = time.monotonic() - t0
        out = p.stdout + p.stderr
        assert p.returncode != 0, show(p)
        assert f"MASTER_ADDR:MASTER_PORT = localhost:{port} (hosted by this rank)" in out, show(p)
        assert f"SLURM_JOB_ID={job} % 1000" in out, show(p)
        assert "export MASTER_PORT to choose another" in out, show(p)
        assert "first host of SLURM_STEP_NODELIST=localhost" in out, show(p)
        assert elapsed < 20, f"the failing step took {elapsed:.0f} s\n{show(p)}"
        # The override: the next job's derived port is taken too, but MASTER_PORT is exported.
        holder2 = PortHolder(derived_port(slurm_cluster.next_job_id()))
        try:
            free = socket.socket()
            free.bind(("127.0.0.1", 0))
            free_port = free.getsockname()[1]
            free.close()
            p = slurm_cluster.srun([*SRUN, TRAIN_GPT, *parity_args(tmp_path / "b.jsonl", "--steps", "1")],
                                   env=slurm_cluster.env(MASTER_PORT=free_port))
            assert p.returncode == 0, show(p)
            assert "train_gpt: 2 ranks" in p.stdout, show(p)
        finally:
            holder2.close()
    finally:
        holder.close()


def test_program_run_by_the_batch_script_is_refused_naming_srun(slurm_cluster, tmp_path):
    """`sbatch --ntasks 2` whose script runs train_gpt itself (no srun): one process that would wait for a second
    rank forever. It fails at once, naming SLURM_STEP_ID and `srun`."""
    log = tmp_path / "batch.out"
    cmd = " ".join([str(TRAIN_GPT), *parity_args(tmp_path / "m.jsonl", "--steps", "1")])
    t0 = time.monotonic()
    p = slurm_cluster.run(["sbatch", "--wait", "--ntasks", "2", "-o", str(log), "--wrap", cmd], timeout=120)
    elapsed = time.monotonic() - t0
    text = log.read_text(errors="replace") if log.exists() else ""
    assert p.returncode != 0, show(p) + text
    assert "SLURM_STEP_ID is not" in text, show(p) + text
    assert "srun PROGRAM" in text, text
    assert elapsed < 30, f"took {elapsed:.0f} s\n{text}"


def test_wrong_master_addr_fails_every_rank_naming_it(slurm_cluster, tmp_path):
    """An exported MASTER_ADDR wins over the node list; an unresolvable one fails within seconds, naming it."""
    t0 = time.monotonic()
    p = slurm_cluster.srun([*SRUN, "--label", TRAIN_GPT, *parity_args(tmp_path / "m.jsonl", "--steps", "1")],
                           env=slurm_cluster.env(MASTER_ADDR="no-such-host.invalid"))
    elapsed = time.monotonic() - t0
    assert p.returncode != 0, show(p)
    for rank in (0, 1):  # srun --label prefixes each line with its task's rank
        assert f"{rank}: train_gpt: error: init_process_group: MASTER_ADDR=no-such-host.invalid cannot be resolved" \
            in p.stderr, show(p)
    assert elapsed < 30, f"took {elapsed:.0f} s\n{show(p)}"


def _cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def test_cluster_fixture_cleans_up_even_when_the_test_fails():
    """The fixture's promise: daemons, steps and tasks ended, directory removed, also after an exception."""
    with pytest.raises(RuntimeError, match="test failure"):
        with running_slurm_cluster() as cluster:
            job = subprocess.Popen(["srun", "--ntasks", "2", "sleep", "300"], env=cluster.env(),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            # squeue shows the job running before slurmstepd has started the tasks: wait for the tasks
            # themselves (both sleeps), so the cleanup below is checked on a step with live tasks.
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                running = cluster.leftover_pids()
                if sum(_cmdline(pid) == ["sleep", "300"] for pid in running) >= 2:
                    break
                time.sleep(0.2)
            daemons = [p.pid for p in cluster.procs.values()]
            assert len(running) >= 5, running  # 2 daemons, srun, slurmstepd and the sleeps
            raise RuntimeError("test failure")
    assert job.wait(timeout=10) != 0
    assert cluster.leftover_pids() == []
    for pid in running:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2], pid
    assert all(cluster.procs[n].poll() is not None for n in cluster.procs), daemons
    assert not cluster.root.exists()
