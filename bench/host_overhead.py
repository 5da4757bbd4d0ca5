#!/usr/bin/env python3
"""host_overhead: host (CPU) time per FSDP group, libfsdp against PyTorch's FSDP2, side by side (issue 37, item 3).

    .venv/bin/python bench/host_overhead.py                    # the table of docs/BENCHMARKS.md
    .venv/bin/python bench/host_overhead.py --groups 64 --rounds 3

The same model on both sides: --groups layers of Linear(--dim, --dim) + relu on a [--batch, --dim] input, each
layer one fully_shard group, one rank (Gloo over one rank: FSDP's collectives run, nothing crosses a wire), one
thread. The matrices are tiny, so a step is almost all host work, and (sharded - unsharded) / groups is what
FSDP's machinery costs per group: pre-forward / post-forward (with the all-gather and the reshard) in the
"forward" phase (forward under no_grad), plus pre-backward / post-backward and the reduce-scatter in the "step"
phase (forward with grad + backward). Ours is build/bin/bench_host_overhead under fsdprun (holder and implicit
paths; see its header); PyTorch's is this file's --torch-side under the same conditions. The two alternate
(ours, PyTorch, ours, PyTorch, ...), --rounds times each; each reports the median of --repeats x --steps steps;
the table shows the median over rounds.

PyTorch's side also times its four FSDPParamGroup hooks (pre_forward, post_forward, pre_backward, post_backward)
with perf_counter in a separate instrumented pass: microseconds per call, inside the hook, i.e. without the
autograd and module-hook plumbing that leads to them (the per-group totals above include that plumbing).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD = Path(os.environ.get("FSDP_BUILD_DIR", REPO / "build"))
BENCH = BUILD / "bin" / "bench_host_overhead"
FSDPRUN = BUILD / "bin" / "fsdprun"


def torch_side(a):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(a.dim, a.dim)

        def forward(self, x):
            return torch.relu(self.fc(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(a.groups))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    def make(sharded):
        net = Net()
        with torch.no_grad():
            for i, p in enumerate(net.parameters()):
                p.copy_((torch.arange(p.numel(), dtype=torch.float32) * 0.37 + i).sin().view_as(p) * 0.3)
        if sharded:
            for layer in net.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(net, mesh=mesh)
        return net

    plain, fsdp2 = make(False), make(True)
    x = (torch.arange(a.batch * a.dim, dtype=torch.float32) * 0.11).sin().view(a.batch, a.dim)
    assert torch.allclose(plain(x), fsdp2(x), atol=1e-6)

    def phase(net, with_backward, n):
        us = []
        for _ in range(n):
            net.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            if with_backward:
                net(x).sum().backward()
            else:
                with torch.no_grad():
                    net(x)
            us.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(us)

    for net in (plain, fsdp2):
        phase(net, False, a.warmup)
        phase(net, True, a.warmup)
    fwd = {"plain": [], "fsdp2": []}
    step = {"plain": [], "fsdp2": []}
    for _ in range(a.repeats):
        for name, net in (("plain", plain), ("fsdp2", fsdp2)):
            fwd[name].append(phase(net, False, a.steps))
            step[name].append(phase(net, True, a.steps))
    fwd = {k: statistics.median(v) for k, v in fwd.items()}
    step = {k: statistics.median(v) for k, v in step.items()}

    # The hooks themselves, instrumented (a separate pass: the wrappers cost a little).
    spent = {n: [0.0, 0] for n in ("pre_forward", "post_forward", "pre_backward", "post_backward")}
    originals = {n: getattr(FSDPParamGroup, n) for n in spent}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name][0] += time.perf_counter() - t0
                spent[name][1] += 1
        return wrapper

    for n, fn in originals.items():
        setattr(FSDPParamGroup, n, timed(n, fn))
    try:
        phase(fsdp2, True, a.steps)
    finally:
        for n, fn in originals.items():
            setattr(FSDPParamGroup, n, fn)
    hooks = {n: (s / c * 1e6 if c else 0.0) for n, (s, c) in spent.items()}
    g = a.groups
    print(json.dumps({
        "forward_us": {"plain": fwd["plain"], "fsdp2": fwd["fsdp2"]},
        "step_us": {"plain": step["plain"], "fsdp2": step["fsdp2"]},
        "per_group_us": {"forward": (fwd["fsdp2"] - fwd["plain"]) / g,
                         "backward": ((step["fsdp2"] - fwd["fsdp2"]) - (step["plain"] - fwd["plain"])) / g,
                         "step": (step["fsdp2"] - step["plain"]) / g},
        "hook_us_per_call": hooks}))
    dist.destroy_process_group()


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_json(cmd, what):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "OMP_NUM_THREADS")}
    env["OMP_NUM_THREADS"] = "1"
    for attempt in (1, 2):
        p = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=1200)
        # (fsdprun prefixes each line with its rank: "[default0]:{...}")
        lines = [line[line.index("{"):] for line in p.stdout.splitlines() if "{\"" in line]
        if lines:  # (PyTorch's Gloo teardown may abort after the JSON is printed: the numbers stand)
            return json.loads(lines[-1])
        if attempt == 2:
            raise RuntimeError(f"{what} failed (rc {p.returncode}):\n{p.stdout}\n{p.stderr}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs of each side")
    ap.add_argument("--torch-side", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.torch_side:
        return torch_side(a)
    common = ["--groups", a.groups, "--dim", a.dim, "--batch", a.batch, "--steps", a.steps, "--warmup", a.warmup,
              "--repeats", a.repeats]
    ours, theirs = [], []
    for _ in range(a.rounds):
        ours.append(run_json([FSDPRUN, "--standalone", "--nproc-per-node", "1", "--", BENCH, *common, "--json"],
                             "bench_host_overhead"))
        theirs.append(run_json([sys.executable, __file__, "--torch-side", "--port", free_port(), *common],
                               "PyTorch's side"))

    def med(rows, *path):
        vals = []
        for r in rows:
            v = r
            for k in path:
                v = v[k]
            vals.append(v)
        return statistics.median(vals)

    print(f"{a.groups} groups of Linear({a.dim}, {a.dim}) + relu, batch {a.batch}, 1 rank (Gloo), 1 thread; "
          f"median of {a.rounds} alternating runs per side, each the median of {a.repeats} x {a.steps} steps")
    print(f"load average {os.getloadavg()[0]:.2f}")
    print()
    print("| per group (us) | forward (pre/post-forward, all-gather) | backward (pre/post-backward, reduce-scatter) "
          "| step | step / FSDP2's |")
    print("|---|---:|---:|---:|---:|")
    fsdp2_step = med(theirs, "per_group_us", "step")
    for label, rows, key in (("libfsdp, holders", ours, "holder"), ("libfsdp, implicit (unchanged model)", ours,
                                                                     "implicit")):
        f = med(rows, "per_group_us", f"{key}_forward")
        b = med(rows, "per_group_us", f"{key}_backward")
        s = med(rows, "per_group_us", f"{key}_step")
        print(f"| {label} | {f:.1f} | {b:.1f} | {s:.1f} | {s / fsdp2_step:.3f} |")
    print(f"| PyTorch FSDP2 | {med(theirs, 'per_group_us', 'forward'):.1f} | "
          f"{med(theirs, 'per_group_us', 'backward'):.1f} | {fsdp2_step:.1f} | 1 |")
    print()
    print("| whole step (us) | unsharded | sharded |")
    print("|---|---:|---:|")
    print(f"| libfsdp (holders / implicit) | {med(ours, 'step_us', 'plain'):.0f} | "
          f"{med(ours, 'step_us', 'holder'):.0f} / {med(ours, 'step_us', 'implicit'):.0f} |")
    print(f"| PyTorch | {med(theirs, 'step_us', 'plain'):.0f} | {med(theirs, 'step_us', 'fsdp2'):.0f} |")
    print()
    hooks = {n: med(theirs, "hook_us_per_call", n) for n in theirs[0]["hook_us_per_call"]}
    print("FSDP2's FSDPParamGroup hooks alone (us per call): " +
          ", ".join(f"{n} {v:.1f}" for n, v in hooks.items()))


if __name__ == "__main__":
    sys.exit(main())
