"""Test hosts made of Linux network namespaces, for the multi-node tests (issue 18).

    from netns_hosts import netns_hosts  # the pytest fixture (import it into the test module)

    def test_x(netns_hosts):
        h0, h1 = netns_hosts.hosts
        p = h0.popen(["build/bin/fsdprun", ...], env=...)     # runs inside host 0's namespace

The network (N hosts, default 2; every name carries this run's tag, see NAME_PREFIX):

    host i (netns <tag>-h<i>)                  switch (netns <tag>-sw)
      data0  10.201.0.<i+1>/24  <--veth-->  d<i>  -- bridge br0 --  (all hosts: the "data" network)
      mgmt0  10.202.<i>.2/24    <--veth-->  m<i>  10.202.<i>.1/24   (one per host, bridged to nothing)
      default route: via 10.202.<i>.1 dev mgmt0

so the hosts reach each other only over data0, while the default route (what a program that does not choose
an interface ends up using for other networks) is the wrong NIC, mgmt0: the switch namespace does not
forward between the mgmt links (net.ipv4.ip_forward is 0 in a new namespace). The addresses are used only
inside namespaces this fixture creates, so they cannot collide with the machine's own networks.

Processes run inside a host with `ip netns exec` (Host.cmd / Host.popen / Host.run). The hostname is the
machine's (namespaces do not change it); inside the hosts, /etc/hosts names them host0, host1, ... (data
addresses) and maps only localhost to 127.0.0.1, and there is no DNS server (see _write_etc).

Cleanup: at teardown every process left in a namespace is SIGKILLed and the namespaces are deleted (which
deletes their links), also when the test failed or timed out (pytest-timeout's default signal method raises
in the test, so fixture teardown runs). A run that was SIGKILLed (e.g. ctest's own timeout) cannot clean up:
the next run deletes namespaces whose creating process is gone (the pid is part of the name).

Skips (with the reason) when namespaces cannot be created: not root, no `ip`, or a kernel/container without
network namespace, veth or bridge support.
"""

import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

NAME_PREFIX = "fsdpnh-"  # fsdpnh-<creator pid>-<random>-{sw,h0,h1,...}
DATA_NET = "10.201.0.0/24"


def _ip(*args, check=True, timeout=20):
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({p.returncode}): {p.stderr.strip()}")
    return p


def _namespaces():
    p = _ip("netns", "list", check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def _etc_dir(ns):
    return Path("/etc/netns") / ns


def _kill_and_delete(ns):
    """SIGKILLs every process inside `ns` (they keep it alive), then deletes it, its links and its /etc files."""
    for _ in range(50):
        pids = [int(x) for x in _ip("netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.1)
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(_etc_dir(ns), ignore_errors=True)


def remove_stale_namespaces():
    """Deletes fixture namespaces whose creating process is gone (a run killed before its teardown)."""
    for ns in _namespaces():
        if not ns.startswith(NAME_PREFIX):
            continue
        try:
            pid = int(ns[len(NAME_PREFIX):].split("-")[0])
        except ValueError:
            continue
        if not Path(f"/proc/{pid}").exists():
            _kill_and_delete(ns)


@dataclass
class Host:
    index: int
    ns: str
    data_ip: str
    mgmt_ip: str
    data_if: str = "data0"
    mgmt_if: str = "mgmt0"

    def cmd(self, args):
        """`args` wrapped to run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *map(str, args)]

    def popen(self, args, **kw):
        return subprocess.Popen(self.cmd(args), **kw)

    def run(self, args, **kw):
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("timeout", 60)
        return subprocess.run(self.cmd(args), **kw)


@dataclass
class Hosts:
    tag: str
    switch_ns: str
    hosts: list = field(default_factory=list)

    def namespaces(self):
        return [h.ns for h in self.hosts] + [self.switch_ns]

    def remove(self):
        for ns in self.namespaces():
            _kill_and_delete(ns)


def _write_etc(host, n):
    """/etc/netns/<ns>/{hosts,resolv.conf}, which `ip netns exec` mounts over /etc's: the hosts' names
    (host0, host1, ...) and no DNS server. The machine's DNS server is unreachable from the test network (the
    default route leads nowhere), so without this every reverse lookup (c10d's TCPStore makes one per
    connection) would wait for the resolver's timeout, 5 s and more."""
    d = _etc_dir(host.ns)
    d.mkdir(parents=True, exist_ok=True)
    lines = ["127.0.0.1 localhost", "::1 localhost"] + [f"10.201.0.{i + 1} host{i}" for i in range(n)]
    (d / "hosts").write_text("\n".join(lines) + "\n")
    (d / "resolv.conf").write_text("# no DNS on the test network (tests/python/netns_hosts.py)\nnameserver 127.0.0.1\n")


def create_hosts(n=2):
    """Creates the namespaces and links described in the module docstring; raises RuntimeError on failure
    (after removing what it created)."""
    if shutil.which("ip") is None:
        raise RuntimeError("the `ip` command (iproute2) is not installed")
    if os.geteuid() != 0:
        raise RuntimeError("creating network namespaces needs root (CAP_SYS_ADMIN/CAP_NET_ADMIN)")
    remove_stale_namespaces()
    tag = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
    hs = Hosts(tag=tag, switch_ns=f"{tag}-sw")
    try:
        _ip("netns", "add", hs.switch_ns)
        sw = ("-n", hs.switch_ns)
        _ip(*sw, "link", "set", "lo", "up")
        _ip(*sw, "link", "add", "br0", "type", "bridge")
        _ip(*sw, "link", "set", "br0", "up")
        for i in range(n):
            h = Host(index=i, ns=f"{tag}-h{i}", data_ip=f"10.201.0.{i + 1}", mgmt_ip=f"10.202.{i}.2")
            hs.hosts.append(h)
            _ip("netns", "add", h.ns)
            _write_etc(h, n)
            hn = ("-n", h.ns)
            _ip(*hn, "link", "set", "lo", "up")
            # Created inside the host namespace, the peer end moved to the switch: no name in the root
            # namespace, so parallel runs cannot collide.
            _ip(*hn, "link", "add", h.data_if, "type", "veth", "peer", "name", f"d{i}", "netns", hs.switch_ns)
            _ip(*hn, "link", "add", h.mgmt_if, "type", "veth", "peer", "name", f"m{i}", "netns", hs.switch_ns)
            _ip(*hn, "addr", "add", f"{h.data_ip}/24", "dev", h.data_if)
            _ip(*hn, "addr", "add", f"{h.mgmt_ip}/24", "dev", h.mgmt_if)
            _ip(*hn, "link", "set", h.data_if, "up")
            _ip(*hn, "link", "set", h.mgmt_if, "up")
            _ip(*sw, "link", "set", f"d{i}", "master", "br0")
            _ip(*sw, "link", "set", f"d{i}", "up")
            _ip(*sw, "addr", "add", f"10.202.{i}.1/24", "dev", f"m{i}")
            _ip(*sw, "link", "set", f"m{i}", "up")
            _ip(*hn, "route", "add", "default", "via", f"10.202.{i}.1", "dev", h.mgmt_if)
    except Exception:
        hs.remove()
        raise
    return hs


@pytest.fixture
def netns_hosts():
    """Two hosts (see the module docstring), removed at teardown whatever happened."""
    try:
        hs = create_hosts(2)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        reason = f"cannot create network-namespace test hosts: {e}"
        if os.environ.get("FSDP_REQUIRE_NETNS") == "1":  # CI, where the tests must run (.ci/run)
            pytest.fail(f"network namespaces are required (FSDP_REQUIRE_NETNS=1) but {reason}", pytrace=False)
        pytest.skip(reason)
    try:
        yield hs
    finally:
        hs.remove()


# --------------------------------------------------------------------------------------------------
# One fsdprun agent per host, as the multi-node and elastic tests run them.
def agent_env(**extra):
    """A job's environment on the test hosts: no launcher variables, one thread, a 60 s group timeout, Gloo on
    the data network (an empty value removes a variable)."""
    from fsdp_testing import clean_env
    env = clean_env()
    env.update(OMP_NUM_THREADS="1", FSDP_TIMEOUT_S="60", GLOO_SOCKET_IFNAME="data0")
    env.update({k: str(v) for k, v in extra.items()})
    return {k: v for k, v in env.items() if v != ""}


class Agent:
    """One fsdprun on one host; its output goes to files (no pipe can fill up and block it)."""

    def __init__(self, host, args, tmp_path, env, name):
        from fsdp_testing import FSDPRUN
        self.name = name
        self.out = open(tmp_path / f"{name}.out", "w+")
        self.err = open(tmp_path / f"{name}.err", "w+")
        self.t0 = time.monotonic()
        self.p = host.popen([str(FSDPRUN), *map(str, args)], env=env, stdout=self.out, stderr=self.err,
                            start_new_session=True)

    def wait(self, timeout):
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            pytest.fail(f"{self.name}: fsdprun still running after {timeout} s (a hang)\n{self.text()}")
        self.elapsed = time.monotonic() - self.t0
        return self.p.returncode

    def stdout(self):
        self.out.flush()
        return Path(self.out.name).read_text(errors="replace")

    def stderr(self):
        self.err.flush()
        return Path(self.err.name).read_text(errors="replace")

    def text(self):
        return f"--- {self.name} rc={self.p.returncode} stdout ---\n{self.stdout()[-3000:]}\n" \
               f"--- {self.name} stderr ---\n{self.stderr()[-6000:]}"


def show_agents(*agents):
    """Every agent's output, for an assertion's message."""
    return "\n".join(a.text() for a in agents)

