"""Fault tolerance across replica groups (issue 36 item 3; CTest label elastic): train_gpt --ft-replica-id, one
fsdprun job per replica group (2 ranks each), fsdp_lighthouse as the store they share ([Note: replica quorum] in
src/ft/manager.cpp).

What is tested:
- replica group 1's whole job (agent and workers) killed with SIGKILL mid-run: replica group 0 keeps its state in
  memory (its processes never restart), its step fails and waits (--ft-min-replica-size 2); replica group 1 started
  again receives the model, the optimizer and the data position from replica group 0 (no checkpoint read) and the
  run goes on from the step it was at: every loss of both and the final checkpoints of both equal, bit for bit, a
  run that lost nothing. The time from the kill to the first step trained after the heal is printed. On one host,
  and with each replica group on a test host of its own (network namespaces, tests/python/netns_hosts.py); a
  replica group that starts after the job finished exits 0 saying so;
- replica groups stopped and resumed from their checkpoints continue at the checkpoint's step, bit for bit;
- bad --ft-* flags fail at once naming what is expected.
Every process runs under a timeout; a failed test kills what it started.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_testing import BUILD, FSDPRUN, TRAIN_GPT, clean_env, metrics, run, train_losses  # noqa: E402
from netns_hosts import netns_hosts  # noqa: E402,F401
from test_elastic import assert_same_checkpoint  # noqa: E402

LIGHTHOUSE = BUILD / "bin" / "fsdp_lighthouse"
STEPS = 8
# The tiny preset, fp32, 2 sequences per rank: a global batch of 2 replica groups x 2 ranks x 2.
RUN = ["--model", "tiny", "--batch-size", "2", "--seed", "7", "--threads", "1", "--log-every", "1",
       "--eval-every", "100", "--warmup-steps", "2", "--sample-tokens", "0", "--steps", str(STEPS)]
FT = ["--ft-group-size", "2", "--ft-join-timeout", "2", "--ft-timeout", "30", "--ft-quorum-timeout", "120"]


class Procs:
    """Processes started in sessions of their own (killed as a whole at the end), on this host or in a test host's
    network namespace (`host`: tests/python/netns_hosts.py; Gloo then on its data network)."""

    def __init__(self):
        self.ps = []

    def start(self, cmd, log, host=None):
        cmd = [str(c) for c in cmd]
        env = clean_env(OMP_NUM_THREADS="1", FSDP_TIMEOUT_S="60")
        if host is not None:
            cmd = host.cmd(cmd)
            env["GLOO_SOCKET_IFNAME"] = host.data_if
        p = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        p.log = Path(log)
        self.ps.append(p)
        return p

    def kill_all(self):
        for p in self.ps:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture
def procs():
    ps = Procs()
    yield ps
    ps.kill_all()


def start_lighthouse(procs, tmp_path, name, host=None):
    p = procs.start([LIGHTHOUSE, "--port", "0"], tmp_path / f"{name}.log", host)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = re.search(r"listening on port (\d+)", p.log.read_text())
        if m:
            return int(m.group(1))
        assert p.poll() is None, p.log.read_text()
        time.sleep(0.05)
    raise AssertionError("fsdp_lighthouse did not start: " + p.log.read_text())


def start_replica(procs, port, r, out, text_files, hosts=None, extra=()):
    """Replica group r: on this host, or on test host r with the lighthouse on test host 0."""
    out.mkdir(parents=True, exist_ok=True)
    lighthouse = f"{hosts.hosts[0].data_ip}:{port}" if hosts else f"127.0.0.1:{port}"
    cmd = [FSDPRUN, "--standalone", "--nproc-per-node", "2", "--", TRAIN_GPT, *RUN, "--data", *text_files,
           "--metrics", out / "m.jsonl", "--ckpt-dir", out / "ckpt", "--ft-replica-id", str(r), *FT,
           "--ft-lighthouse", lighthouse, *extra]
    return procs.start(cmd, out / "log.txt", hosts.hosts[r] if hosts else None)


def finish(p, timeout=300):
    try:
        rc = p.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError(f"{p.log} still running after {timeout} s:\n" + p.log.read_text()[-4000:])
    assert rc == 0, f"{p.log}: rc={rc}\n" + p.log.read_text()[-6000:]


def steps_done(path):
    try:
        return max(train_losses(metrics(path)), default=0)
    except (AssertionError, FileNotFoundError, ValueError):
        return 0


def lost_replica_group_is_healed(text_files, tmp_path, procs, hosts=None):
    lighthouse_host = hosts.hosts[0] if hosts else None
    # The run that loses nothing (replica group 1 is healed once, at round 0: the replica groups start alike).
    port = start_lighthouse(procs, tmp_path, "lighthouse_ref", lighthouse_host)
    ref = [start_replica(procs, port, r, tmp_path / f"ref{r}", text_files, hosts) for r in (0, 1)]
    for p in ref:
        finish(p)
    ref_losses = [train_losses(metrics(tmp_path / f"ref{r}" / "m.jsonl")) for r in (0, 1)]
    assert sorted(ref_losses[0]) == list(range(1, STEPS + 1)), ref_losses[0]
    assert ref_losses[0] == ref_losses[1]  # every replica group logs the loss of the whole global batch

    # Replica group 1 killed (agent and workers, SIGKILL) after step 3, then started again.
    port = start_lighthouse(procs, tmp_path, "lighthouse", lighthouse_host)
    r0 = start_replica(procs, port, 0, tmp_path / "r0", text_files, hosts)
    r1 = start_replica(procs, port, 1, tmp_path / "r1", text_files, hosts)
    deadline = time.monotonic() + 240
    while steps_done(tmp_path / "r1" / "m.jsonl") < 3:
        assert r0.poll() is None and r1.poll() is None and time.monotonic() < deadline, \
            r0.log.read_text()[-3000:] + r1.log.read_text()[-3000:]
        time.sleep(0.05)
    os.killpg(r1.pid, signal.SIGKILL)
    t_kill = time.monotonic()
    killed_after = steps_done(tmp_path / "r0" / "m.jsonl")
    r1.wait()
    r1b = start_replica(procs, port, 1, tmp_path / "r1b", text_files, hosts)
    # The time from the loss to the first step the survivor trains after the heal (it cannot train one without
    # replica group 1: --ft-min-replica-size is 2 by default).
    heal_line = re.compile(r"\[default0\]:ft: round (\d+) healed replica group\(s\) 1 from replica group 0 at step "
                           r"(\d+): ([\d.]+) MiB in ([\d.]+) s")
    while not heal_line.search(r1b.log.read_text()):
        assert r0.poll() is None and r1b.poll() is None and time.monotonic() < deadline, \
            r0.log.read_text()[-3000:] + r1b.log.read_text()[-3000:]
        time.sleep(0.02)
    healed_at = int(heal_line.search(r1b.log.read_text()).group(2))
    while steps_done(tmp_path / "r0" / "m.jsonl") <= healed_at:
        assert r0.poll() is None and r1b.poll() is None and time.monotonic() < deadline, \
            r0.log.read_text()[-3000:] + r1b.log.read_text()[-3000:]
        time.sleep(0.02)
    recovery = time.monotonic() - t_kill
    finish(r0)
    finish(r1b)

    log0, log1b = r0.log.read_text(), r1b.log.read_text()
    assert len(heal_line.findall(log1b)) == 1, log1b[-4000:]  # one heal, none that failed
    heal = heal_line.search(log1b)
    assert healed_at >= 3 and float(heal.group(3)) > 0.1, log1b[-4000:]
    assert "not committed" not in log1b, log1b[-4000:]
    assert "resume:" not in log1b  # the state came from replica group 0, not from a checkpoint
    losses0 = train_losses(metrics(tmp_path / "r0" / "m.jsonl"))
    losses1b = train_losses(metrics(tmp_path / "r1b" / "m.jsonl"))
    assert losses0 == ref_losses[0], f"survivor {losses0}\nreference {ref_losses[0]}"
    assert sorted(losses1b) == list(range(healed_at + 1, STEPS + 1)), losses1b
    assert losses1b == {s: ref_losses[1][s] for s in losses1b}, f"healed {losses1b}\nreference {ref_losses[1]}"
    last = f"step-{STEPS}"
    assert_same_checkpoint(tmp_path / "r0" / "ckpt" / last, tmp_path / "ref0" / "ckpt" / last)
    assert_same_checkpoint(tmp_path / "r1b" / "ckpt" / last, tmp_path / "r0" / "ckpt" / last)
    # A replica group that starts after the job finished is told so and exits 0 (no wait for a quorum).
    late = start_replica(procs, port, 1, tmp_path / "late", text_files, hosts)
    finish(late, 120)
    assert f"the job finished at step {STEPS} before this replica group was admitted" in late.log.read_text()
    where = "on two test hosts" if hosts else "on one host"
    print(f"[ft] {where}: replica group 1 killed after step {killed_after}: healed at step {healed_at} "
          f"({heal.group(3)} MiB in {heal.group(4)} s per rank); the survivor trained its next step {recovery:.1f} s "
          f"after the kill (restart of replica group 1's job included); losses and step-{STEPS} bit-identical")


def test_a_lost_replica_group_is_healed_from_a_live_one(text_files, tmp_path, procs):
    lost_replica_group_is_healed(text_files, tmp_path, procs)


def test_a_lost_host_is_healed_from_the_other(netns_hosts, text_files, tmp_path, procs):
    """The same with each replica group on a test host of its own (network namespaces; the lighthouse on host 0):
    the replicate group crosses hosts on the data network."""
    lost_replica_group_is_healed(text_files, tmp_path, procs, netns_hosts)


def test_replica_groups_resume_from_their_checkpoints(text_files, tmp_path, procs):
    """The recovery the "state is lost" error asks for: every replica group stopped after step 4 (--stop-at, a
    checkpoint each) and resumed with a fresh lighthouse continues at step 5 (the first quorum takes the donor's
    step), and ends bit for bit as a run that never stopped."""
    port = start_lighthouse(procs, tmp_path, "lighthouse_ref")
    for p in [start_replica(procs, port, r, tmp_path / f"ref{r}", text_files) for r in (0, 1)]:
        finish(p)
    port = start_lighthouse(procs, tmp_path, "lighthouse_a")
    for p in [start_replica(procs, port, r, tmp_path / f"r{r}", text_files, extra=["--stop-at", "4"]) for r in (0, 1)]:
        finish(p)
    port = start_lighthouse(procs, tmp_path, "lighthouse_b")
    resumed = [start_replica(procs, port, r, tmp_path / f"r{r}", text_files, extra=["--resume"]) for r in (0, 1)]
    for p in resumed:
        finish(p)
    assert "continuing at step 5/8" in resumed[0].log.read_text(), resumed[0].log.read_text()[-3000:]
    last = f"step-{STEPS}"
    for r in (0, 1):
        assert_same_checkpoint(tmp_path / f"r{r}" / "ckpt" / last, tmp_path / f"ref{r}" / "ckpt" / last)
    assert train_losses(metrics(tmp_path / "r0" / "m.jsonl")) == train_losses(metrics(tmp_path / "ref0" / "m.jsonl"))


@pytest.mark.parametrize("flags, expect", [
    (["--ft-replica-id", "0"], "--ft-* flags need both --ft-replica-id N and --ft-group-size G"),
    (["--ft-replica-id", "2", "--ft-group-size", "2"], "--ft-replica-id 2 is not below --ft-group-size 2"),
    (["--ft-replica-id", "0", "--ft-group-size", "2", "--ft-min-replica-size", "3"],
     "--ft-min-replica-size 3 exceeds --ft-group-size 2"),
    (["--ft-replica-id", "0", "--ft-group-size", "2", "--mixed-precision", "fp16"],
     "does not combine with --mixed-precision fp16"),
    (["--ft-replica-id", "0", "--ft-group-size", "2", "--sft", "/nonexistent.jsonl"], "does not combine with --sft"),
    (["--ft-replica-id", "0", "--ft-group-size", "2"], "--ft-replica-id needs the lighthouse's address"),
])
def test_bad_ft_flags(text_files, flags, expect):
    p = run([*RUN, "--data", *text_files, *flags], nproc=None, timeout=60)
    assert p.returncode != 0 and expect in p.stdout + p.stderr, p.stdout[-2000:] + p.stderr[-2000:]
