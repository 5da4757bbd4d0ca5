"""A real one-node Slurm cluster for tests: slurmctld + slurmd on localhost (issue 18).

`slurm_cluster` (a module-scoped pytest fixture) and `running_slurm_cluster()` (the same as a context manager)
start Debian's slurm-wlm daemons in a fresh directory under /tmp and stop them again, also when the test fails:

- slurm.conf: one node `localhost` (NodeAddr 127.0.0.1) with the CPUs this machine has (os.cpu_count()), one
  partition; ProctrackType=proctrack/linuxproc and TaskPlugin=task/none (no cgroups: none are delegated to a
  container), no accounting; AuthType=auth/none + CredType=cred/none (Slurm 22.05, Debian bookworm's, still
  has them), so no munged runs. State, spool, pid and log files live in the directory; the controller's and
  slurmd's ports are free ones found at start, so several clusters (parallel ctest) never meet.
- Start: `slurmctld -D -i` and `slurmd -D -N localhost` as children of this process, then sinfo until the node is
  idle (30 s at most).
- Stop: cancel every job and wait for the queue to drain, SIGTERM both daemons (SIGKILL after 10 s), then end
  any process left from this cluster (slurmstepd, a task): those are found by SLURM_CONF=<this slurm.conf> in
  their environment, which srun and slurmd pass on and nothing else has. Then the directory is removed.
- Skip: when the binaries are missing or the daemons do not start (not root, a kernel without what slurmd
  needs...), the test is skipped with the reason and the tail of the daemons' logs. FSDP_REQUIRE_SLURM=1 turns
  that skip into a failure (for a CI that must run the Slurm tests).

Run a command on the cluster with `cluster.srun([...])` or `cluster.run(["sbatch", ...])`: they get
`cluster.env()`, i.e. the caller's environment without launcher variables (RANK, MASTER_*, SLURM_*...) plus
SLURM_CONF.
"""

import contextlib
import os
import pwd
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from fsdp_testing import clean_env

DAEMONS = ("slurmctld", "slurmd", "srun", "sinfo", "squeue", "scancel", "sbatch", "scontrol")
START_TIMEOUT_S = 30
STOP_TIMEOUT_S = 10

def _free_ports(n):
    """n distinct TCP ports that are free on this host now (held together while chosen, so distinct)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tail(path, lines=25):
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _first_job_id():
    """A first job id whose derived rendezvous ports (20000 + 10 * (id % 1000) + step, src/c10d/slurm_env.h) are free
    now: two test runs at once on one host (each with its own cluster) would otherwise both start at job 1 and
    collide on port 20010."""
    ids = list(range(1, 990))
    random.SystemRandom().shuffle(ids)
    for job in ids:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("0.0.0.0", 20000 + 10 * job))
            return job
        except OSError:
            continue
    return 1


class SlurmCluster:
    """One slurmctld + one slurmd on localhost, configured in `root`. See the module's docstring."""

    def __init__(self, root, cpus=None):
        self.root = Path(root)
        self.cpus = cpus or os.cpu_count() or 1
        self.conf = self.root / "slurm.conf"
        self.logs = self.root / "log"
        self.procs = {}  # name -> Popen of the daemons this object started

    # ---- configuration ---------------------------------------------------------------------------------------
    def write_config(self):
        for d in ("state", "spool", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        ctld_port, slurmd_port = _free_ports(2)
        r = self.root
        user = pwd.getpwuid(os.getuid()).pw_name  # root here and in CI; anyone else may get a skip
        self.conf.write_text(f"""\
# Written by tests/python/slurm_cluster.py: a one-node test cluster, removed when the test ends.
ClusterName=fsdptest
FirstJobId={_first_job_id()}
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser={user}
SlurmdUser={user}
# No munged: Slurm 22.05 still has these (tests only: any local user could impersonate another).
AuthType=auth/none
CredType=cred/none
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
# No cgroups (a container has none delegated): processes tracked through /proc, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
ReturnToService=2
# A task that fails ends its step at once (no rank left waiting in a rendezvous); quick kills.
KillOnBadExit=1
KillWait=2
# The node's CPUs as configured, whatever topology slurmd detects.
SlurmdParameters=config_overrides
NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP
""")

    def env(self, **extra):
        """Environment for Slurm's commands and the jobs they start."""
        env = clean_env()
        env["SLURM_CONF"] = str(self.conf)
        env.update({k: str(v) for k, v in extra.items()})
        return env

    # ---- commands --------------------------------------------------------------------------------------------
    def run(self, cmd, timeout=60, env=None, **kwargs):
        """Runs a Slurm client command (srun, sbatch, squeue...) against this cluster; returns CompletedProcess."""
        return subprocess.run([str(c) for c in cmd], env=env or self.env(), capture_output=True, encoding="utf-8",
                              errors="replace", timeout=timeout, **kwargs)

    def srun(self, args, timeout=180, env=None, **kwargs):
        return self.run(["srun", *args], timeout=timeout, env=env, **kwargs)

    def next_job_id(self):
        """The id the next job will get (scontrol's NEXT_JOB_ID)."""
        p = self.run(["scontrol", "show", "config"], timeout=20)
        m = re.search(r"^NEXT_JOB_ID\s*=\s*(\d+)", p.stdout, re.M)
        assert m, f"scontrol show config has no NEXT_JOB_ID:\n{p.stdout[-2000:]}{p.stderr[-2000:]}"
        return int(m.group(1))

    def daemon_logs(self):
        return "\n".join(f"--- {name} ---\n{_tail(self.logs / (name + '.out'))}\n{_tail(self.logs / (name + '.log'))}"
                         for name in ("slurmctld", "slurmd"))

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self):
        """Starts both daemons and waits until the node is idle. Returns None, or why it could not start."""
        self.write_config()
        env = self.env()
        for name, cmd in (("slurmctld", ["slurmctld", "-D", "-i"]), ("slurmd", ["slurmd", "-D", "-N", "localhost"])):
            out = open(self.logs / (name + ".out"), "w")
            self.procs[name] = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL)
            out.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        state = ""
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    return f"{name} exited with code {p.returncode} while starting"
            try:
                state = self.run(["sinfo", "-h", "-N", "-o", "%T"], timeout=10).stdout.strip()
            except subprocess.TimeoutExpired:
                state = "(sinfo timed out)"
            if state == "idle":
                return None
            time.sleep(0.3)
        return f"the node did not become idle within {START_TIMEOUT_S} s (sinfo says {state!r})"

    def stop(self):
        """Cancels all jobs, stops the daemons, ends what is left of this cluster. Safe to call twice."""
        alive = any(p.poll() is None for p in self.procs.values())
        if alive and self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):
                self.run(["scancel", "--full", "--user", str(os.getuid())], timeout=10)
                deadline = time.monotonic() + STOP_TIMEOUT_S
                while time.monotonic() < deadline:
                    if not self.run(["squeue", "-h"], timeout=10).stdout.strip():
                        break
                    time.sleep(0.3)
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.kill_leftovers()

    def leftover_pids(self):
        """Processes (other than us) whose environment names this cluster's slurm.conf."""
        marker = f"SLURM_CONF={self.conf}\0".encode()
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                if marker in (d / "environ").read_bytes() + b"\0":
                    pids.append(int(d.name))
            except OSError:
                continue  # gone, or not ours to read
        return pids

    def kill_leftovers(self):
        for pid in self.leftover_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while self.leftover_pids() and time.monotonic() < deadline:
            time.sleep(0.1)


def _skip_or_fail(reason):
    if os.environ.get("FSDP_REQUIRE_SLURM") == "1":
        pytest.fail(f"Slurm is required (FSDP_REQUIRE_SLURM=1) but {reason}", pytrace=False)
    pytest.skip(reason)


@contextlib.contextmanager
def running_slurm_cluster(cpus=None):
    """Yields a started SlurmCluster; always stops it and removes its directory. Skips (see the docstring)."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        _skip_or_fail(f"Slurm is not installed ({', '.join(missing)} not found): apt-get install slurmctld "
                      "slurmd slurm-client (scripts/setup.sh does)")
    root = tempfile.mkdtemp(prefix="fsdp-slurm-")  # short: slurmd's socket paths must fit in 108 bytes
    cluster = SlurmCluster(root, cpus)
    try:
        why = cluster.start()
        if why is not None:
            logs = cluster.daemon_logs()
            cluster.stop()
            _skip_or_fail(f"the test Slurm cluster could not start: {why}\n{logs}")
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def slurm_cluster():
    """A one-node Slurm cluster shared by the tests of a module (see running_slurm_cluster)."""
    with running_slurm_cluster() as cluster:
        yield cluster
