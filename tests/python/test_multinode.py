"""Multi-node training on two test hosts made of network namespaces (issue 18; CTest label multinode).

Each host (tests/python/netns_hosts.py) has a "data" interface (data0, 10.201.0.<i+1>) on the network that
connects the hosts and a "mgmt" interface (mgmt0) that connects nothing but carries the default route, so a
program that does not choose its interface ends up on the wrong one. One fsdprun agent runs per host
(`ip netns exec`), --nproc-per-node 2; checkpoints and metrics go to the test's tmp_path, a directory both
hosts see (as a shared filesystem would be on real nodes).

What is tested: train_gpt on 2 hosts x 2 ranks gives the losses of 1 host x 4 ranks (static and c10d
rendezvous); GLOO_SOCKET_IFNAME picks the interface and a wrong or missing one fails on every rank within
seconds, naming it; a host that never arrives ends the rendezvous with a timeout; a worker killed on host 1
restarts both hosts' workers, which resume from the checkpoint; a killed agent ends the other host's job
naming the lost node. Every process runs under a timeout (the agents also under FSDP_TIMEOUT_S), and the
namespaces are removed whatever happens. Skips (with the reason) where namespaces cannot be created.
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
from netns_hosts import Agent, agent_env as job_env, netns_hosts, show_agents as show  # noqa: E402,F401
from fsdp_testing import FSDPRUN, TRAIN_GPT, assert_close, fsdprun_cmd, metrics, train_losses  # noqa: E402

BINARIES = (FSDPRUN, TRAIN_GPT)

PORT = 29611  # inside the test's own namespaces: no other process can hold it
RTOL = 1e-5   # the tolerance (same world size and order: the losses are in fact bit-identical)
# The tiny preset for a few steps, fp32, a checkpoint every 3 steps (resumable), metrics on rank 0.
RUN = ["--model", "tiny", "--batch-size", "4", "--seed", "7", "--threads", "1", "--steps", "6", "--log-every", "1",
       "--eval-every", "100", "--warmup-steps", "2", "--sample-tokens", "0"]


def launch_args(form, host_index, nproc=2, extra=()):
    if form == "static":
        return ["--nnodes", "2", "--node-rank", str(host_index), "--master-addr", "10.201.0.1", "--master-port", str(PORT),
                "--nproc-per-node", str(nproc), "--shutdown-timeout", "5", *extra]
    return ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"10.201.0.1:{PORT}", "--rdzv-id", "job18",
            "--nproc-per-node", str(nproc), "--shutdown-timeout", "5", *extra]


def two_hosts(hosts, tmp_path, form, program, env, extra=(), order=(0, 1)):
    agents = {}
    for i in order:  # c10d: node ranks follow arrival order, so host 1 may be node 0
        agents[i] = Agent(hosts.hosts[i], launch_args(form, i, extra=extra) + ["--", *map(str, program)], tmp_path,
                          env, f"host{i}")
        time.sleep(0.2)
    return agents[0], agents[1]


@pytest.fixture(scope="module")
def reference(text_files, tmp_path_factory):
    """1 host x 4 ranks, the same global batch (4 ranks x --batch-size 4): the losses to match."""
    d = tmp_path_factory.mktemp("ref")
    cmd = fsdprun_cmd(4, TRAIN_GPT, *RUN, "--data", *text_files, "--metrics", d / "m.jsonl")
    p = subprocess.run(cmd, env=job_env(GLOO_SOCKET_IFNAME=""), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    losses = train_losses(metrics(d / "m.jsonl"))
    assert sorted(losses) == list(range(1, 7)), losses
    return losses


# --------------------------------------------------------------------------------------------------
# 0. The fixture: the hosts reach each other over data0 only; the default route is the mgmt network.
def test_hosts_connect_over_data_only(netns_hosts):
    h0, h1 = netns_hosts.hosts
    server = h1.popen([sys.executable, "-c", "import socket,sys; s=socket.create_server(('0.0.0.0', 5001)); "
                       "print('up', flush=True); [s.accept()[0].close() for _ in range(9)]"],
                      stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "up"
    probe = "import socket,sys; socket.create_connection((sys.argv[1], 5001), timeout=1.5); print('connected')"
    assert h0.run([sys.executable, "-c", probe, h1.data_ip]).stdout.strip() == "connected"
    assert h0.run([sys.executable, "-c", probe, h1.mgmt_ip]).returncode != 0  # mgmt connects nothing
    assert "default via 10.202.0.1 dev mgmt0" in h0.run(["ip", "route"]).stdout
    server.kill()


# --------------------------------------------------------------------------------------------------
# 1. train_gpt across 2 hosts x 2 ranks == 1 host x 4 ranks, both launch forms.
@pytest.mark.parametrize("form", ["static", "c10d"])
def test_two_hosts_match_one_host(netns_hosts, text_files, tmp_path, reference, form):
    prog = [TRAIN_GPT, *RUN, "--data", *text_files, "--metrics", tmp_path / "m.jsonl"]
    # c10d: host 1's agent starts first (it waits for the store on host 0's endpoint).
    a0, a1 = two_hosts(netns_hosts, tmp_path, form, prog, job_env(), order=(0, 1) if form == "static" else (1, 0))
    assert a0.wait(150) == 0 and a1.wait(30) == 0, show(a0, a1)
    worst = assert_close(train_losses(metrics(tmp_path / "m.jsonl")), reference, RTOL, f"{form} 2x2 vs 1x4")
    print(f"[multinode] {form}: 2 hosts x 2 ranks vs 1 host x 4: max relative loss difference {worst:.3g}; "
          f"{a0.elapsed:.1f} s")
    for a in (a0, a1):
        assert "rendezvous complete" in a.stderr(), show(a0, a1)
    # c10d: the node ranks follow the order of arrival (either host may be node 0), one each.
    nodes = sorted(re.search(r"this is node (\d) of 2", a.stderr()).group(1) for a in (a0, a1))
    assert nodes == ["0", "1"], show(a0, a1)


def test_c10d_environment_and_nic_variables_pass_through(netns_hosts, tmp_path):
    """The workers' torchrun environment under c10d, and NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME passed on."""
    prog = ["/bin/sh", "-c", "echo rank=$RANK group=$GROUP_RANK world=$WORLD_SIZE local=$LOCAL_RANK "
            "master=$MASTER_ADDR:$MASTER_PORT run=$TORCHELASTIC_RUN_ID nccl=$NCCL_SOCKET_IFNAME gloo=$GLOO_SOCKET_IFNAME"]
    a0, a1 = two_hosts(netns_hosts, tmp_path, "c10d", prog, job_env(NCCL_SOCKET_IFNAME="=data0"))
    assert a0.wait(60) == 0 and a1.wait(30) == 0, show(a0, a1)
    lines = re.findall(r"rank=(\d) group=(\d) world=4 local=(\d) master=10\.201\.0\.1:29611 run=job18 "
                       r"nccl==data0 gloo=data0", a0.stdout() + a1.stdout())
    assert sorted(int(r) for r, _, _ in lines) == [0, 1, 2, 3], show(a0, a1)
    assert all(int(r) == int(g) * 2 + int(lr) for r, g, lr in lines), lines


# --------------------------------------------------------------------------------------------------
# 2. NIC selection: with the default route on mgmt0, only GLOO_SOCKET_IFNAME=data0 works (above); the wrong
# interface, a missing one, or none (Gloo falls back to loopback) fail on every rank within seconds.
@pytest.mark.parametrize("ifname, expect", [
    ("mgmt0", r"GLOO_SOCKET_IFNAME=mgmt0 -> mgmt0 10\.202\.\d\.2.*cannot connect|cannot connect.*GLOO_SOCKET_IFNAME=mgmt0"),
    ("eth7", r"GLOO_SOCKET_IFNAME=eth7: interface 'eth7' does not exist on this host"),
    ("", r"GLOO_SOCKET_IFNAME unset -> (loopback 127\.0\.0\.1|the address of hostname)"),
], ids=["wrong", "missing", "unset"])
def test_wrong_interface_fails_fast_on_every_rank(netns_hosts, text_files, tmp_path, ifname, expect):
    prog = [TRAIN_GPT, *RUN, "--data", *text_files]
    a0, a1 = two_hosts(netns_hosts, tmp_path, "static", prog, job_env(GLOO_SOCKET_IFNAME=ifname))
    rc0, rc1 = a0.wait(60), a1.wait(60)
    assert rc0 == 1 and rc1 == 1, show(a0, a1)
    assert max(a0.elapsed, a1.elapsed) < 30, f"took {a0.elapsed:.1f} / {a1.elapsed:.1f} s\n" + show(a0, a1)
    # Every rank says it, naming the interface and the variable (the failing ones directly, the others in
    # the network check's joint verdict).
    for a, ranks in ((a0, (0, 1)), (a1, (0, 1))):
        for lr in ranks:
            err = "\n".join(l for l in a.stderr().splitlines() if l.startswith(f"[default{lr}]:"))
            assert "train_gpt: error: init_process_group" in err and re.search(expect, err), \
                f"{a.name} local rank {lr}:\n" + show(a0, a1)
            assert "GLOO_SOCKET_IFNAME" in err
    print(f"[multinode] GLOO_SOCKET_IFNAME={ifname or '(unset)'}: every rank failed in "
          f"{max(a0.elapsed, a1.elapsed):.1f} s")


# --------------------------------------------------------------------------------------------------
# 3. A host that never arrives: the rendezvous times out naming what arrived.
@pytest.mark.parametrize("form", ["static", "c10d"])
def test_missing_host_times_out(netns_hosts, tmp_path, form):
    a0 = Agent(netns_hosts.hosts[0], launch_args(form, 0, extra=["--rdzv-timeout", "3"]) + ["--", "/bin/true"],
               tmp_path, job_env(), "host0")
    assert a0.wait(30) == 1, a0.text()
    assert a0.elapsed < 15, a0.text()
    assert re.search(r"timed out after [34] s: 1 of 2 nodes arrived \(node 0 \(\S+ 10\.201\.0\.1\)\)", a0.stderr()), a0.text()
    assert "Fix: start fsdprun on every node" in a0.stderr(), a0.text()


# --------------------------------------------------------------------------------------------------
# 4. Failures across hosts.
def test_worker_killed_on_host_1_restarts_both_hosts_and_resumes(netns_hosts, text_files, tmp_path, reference):
    """kill -9 of global rank 3 (host 1) right after the checkpoint of step 3, --max-restarts 1: both agents
    restart their workers, which resume from step-3 in the shared directory; the losses are the
    uninterrupted run's."""
    ckpt = tmp_path / "ckpt"
    prog = [TRAIN_GPT, *RUN, "--data", *text_files, "--metrics", tmp_path / "m.jsonl", "--ckpt-dir", ckpt,
            "--ckpt-every", "3"]
    a0, a1 = two_hosts(netns_hosts, tmp_path, "static", prog, job_env(TRAIN_GPT_TEST_KILL_AFTER_CHECKPOINT="3:3"),
                       extra=["--max-restarts", "1"])
    assert a0.wait(200) == 0 and a1.wait(30) == 0, show(a0, a1)
    # Both agents name the attempt's first failure: rank 3's SIGKILL, unless a rank that lost its connection to
    # rank 3 was reaped first (a race between the two hosts' agents: then that rank's exit code).
    for a in (a0, a1):
        assert re.search(r"attempt 0 failed: node \d \([^)]*\): rank \d \(local_rank \d\) ended with .*; "
                         r"restarting the worker group on every node \(restart 1 of 1\)", a.stderr()), show(a0, a1)
    assert "rank 3 (local_rank 1) ended with signal 9 (SIGKILL)" in a1.stderr() + a0.stderr(), show(a0, a1)
    assert re.search(rf"\[default0\]:resume: {re.escape(str(ckpt))}/step-3 \(after step 3, saved on 4 ranks, loaded on 4",
                     a0.stdout()), show(a0, a1)
    rows = metrics(tmp_path / "m.jsonl")
    assert_close(train_losses(rows), reference, RTOL, "resumed across hosts vs uninterrupted 1x4")


def test_killed_agent_ends_the_other_host_naming_the_lost_node(netns_hosts, text_files, tmp_path):
    """SIGKILL of host 1's fsdprun mid-training: its workers die with it (PDEATHSIG); host 0's workers and agent
    exit with an error naming node 1 within 30 s, and nothing is left running on host 0."""
    prog = [TRAIN_GPT, *RUN, "--steps", "100000", "--data", *text_files]
    a0, a1 = two_hosts(netns_hosts, tmp_path, "static", prog, job_env(), extra=["--max-restarts", "3"])
    deadline = time.monotonic() + 120
    while not re.search(r"\[default0\]:step +2/", a0.stdout()):
        assert a0.p.poll() is None and time.monotonic() < deadline, show(a0, a1)
        time.sleep(0.2)
    t_kill = time.monotonic()
    a1.p.send_signal(signal.SIGKILL)  # ip netns exec execs fsdprun: this is the agent itself
    rc0 = a0.wait(60)
    took = time.monotonic() - t_kill
    assert rc0 == 1, show(a0, a1)
    assert took < 30, f"host 0 took {took:.1f} s to give up\n" + show(a0, a1)
    assert re.search(r"lost node 1 \(\S+ 10\.201\.0\.2\): no heartbeat from its fsdprun for \d+ s", a0.stderr()), show(a0, a1)
    assert "no restart" in a0.stderr(), show(a0, a1)
    time.sleep(1)  # the workers' last exits are reaped by the agent before it exits; give the kernel a moment
    left = subprocess.run(["ip", "netns", "pids", netns_hosts.hosts[0].ns], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes left on host 0: {left}"
    print(f"[multinode] agent of host 1 killed: host 0 exited in {took:.1f} s")


# --------------------------------------------------------------------------------------------------
# 5. Bad rendezvous flags fail at once, naming what is expected (no namespaces needed).
@pytest.mark.parametrize("flags, expect", [
    (["--rdzv-backend", "etcd"], "--rdzv-backend etcd: expected static or c10d"),
    (["--rdzv-backend", "c10d"], "--rdzv-backend c10d needs --rdzv-endpoint HOST[:PORT]"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:99999"], "expected HOST[:PORT] with a port in 1-65535"),
    (["--nnodes", "1:2"], "an elastic range needs --rdzv-backend c10d"),
])
def test_bad_rendezvous_flags(flags, expect):
    nnodes = [] if "--nnodes" in flags else ["--nnodes", "2"]
    p = subprocess.run([str(FSDPRUN), *nnodes, *flags, "--", "/bin/true"], env=job_env(), capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 1 and expect in p.stderr, p.stderr
