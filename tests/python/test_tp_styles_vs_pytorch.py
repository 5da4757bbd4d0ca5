"""The boundary styles against PyTorch's own parallelize_module (CTest label tensor_parallel).

The same small model (embedding, two residual blocks of a user's RMSNorm and an MLP, LayerNorm, head), the same
weights (a formula over the parameters in name order) and batches, on 2 ranks over Gloo: libfsdp's
tests/tensor/parallel/tp_styles_twin.cpp under fsdprun, and this file's `__main__` under
torch.multiprocessing with PyTorch's parallelize_module and the same plan:
PrepareModuleInput(Replicate -> Shard(1)) on the first block, PrepareModuleOutput(Shard(1) -> Replicate) on the
last, SequenceParallel on each RMSNorm, PrepareModuleInput(Shard(1) -> Replicate) on each MLP, whose fc1 is
ColwiseParallel and fc2 RowwiseParallel(output_layouts=Shard(1)). Three SGD steps: every loss and every
parameter's full gradient must agree within 1e-5.

FSDP_BUILD_DIR is the CMake build directory (default: <repo>/build).
"""

import json
import sys
from pathlib import Path

import pytest

from fsdp_testing import BUILD, FSDPRUN, fsdprun_cmd, run_program, run_pytorch_reference, show

TWIN = BUILD / "bin" / "tp_styles_twin"
BINARIES = (FSDPRUN, TWIN)
STEPS = 3
TOLERANCE = 1e-5

V, D, H, B, T = 16, 8, 12, 2, 6


def pytorch_side(rank, world, port, out, steps):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    class RMSNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(D, H), nn.Linear(H, D)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.mlp = RMSNorm(D), MLP()

        def forward(self, x):
            return x + self.mlp(self.norm(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.blocks = nn.ModuleList([Block(), Block()])
            self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, V)

        def forward(self, ids):
            x = self.emb(ids)
            for b in self.blocks:
                x = b(x)
            return self.head(self.ln(x))

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    net = Net()
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(net.named_parameters())):
            v = torch.sin(torch.arange(p.numel(), dtype=torch.float64) * 0.7 + i) * 0.5 + (1.0 if p.dim() == 1 else 0.0)
            p.copy_(v.float().view_as(p))
    parallelize_module(net, mesh, {
        "blocks.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                       use_local_output=True),
        "blocks.*.norm": SequenceParallel(),
        "blocks.*.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                           use_local_output=True),
        "blocks.*.mlp.fc1": ColwiseParallel(),
        "blocks.*.mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
        "blocks.1": PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),)),
    })
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    rows = []
    for step in range(steps):
        ids = ((torch.arange(B * T) * 5 + step) % V).view(B, T)
        targets = ((ids * 3 + 1) % V).view(-1)
        loss = F.cross_entropy(net(ids).view(-1, V), targets)
        loss.backward()
        grads = {}
        for name, p in net.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[name] = g.double().flatten().tolist()
        rows.append({"step": step, "loss": loss.item(), "grads": grads})
        opt.step()
        opt.zero_grad()
    if rank == 0:
        Path(out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    dist.barrier()  # both ranks out of every collective before either tears Gloo down
    dist.destroy_process_group()


def read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def test_boundary_styles_equal_pytorchs(tmp_path):
    ours = tmp_path / "ours.jsonl"
    p = run_program(fsdprun_cmd(2, TWIN, ours, STEPS), timeout=180)
    assert p.returncode == 0, show(p)
    theirs = tmp_path / "theirs.jsonl"
    p = run_pytorch_reference([sys.executable, __file__, str(theirs), str(STEPS)], timeout=300)
    assert p.returncode == 0, show(p)
    a, b = read(ours), read(theirs)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(STEPS))
    worst = 0.0
    for ra, rb in zip(a, b):
        assert sorted(ra["grads"]) == sorted(rb["grads"]), (sorted(ra["grads"]), sorted(rb["grads"]))
        d = abs(ra["loss"] - rb["loss"])
        assert d <= TOLERANCE, f"step {ra['step']}: loss {ra['loss']} vs PyTorch's {rb['loss']}"
        worst = max(worst, d)
        for name, ga in ra["grads"].items():
            gb = rb["grads"][name]
            assert len(ga) == len(gb), name
            d = max(abs(x - y) for x, y in zip(ga, gb))
            assert d <= TOLERANCE, f"step {ra['step']}: grad of {name} differs from PyTorch's by {d}"
            worst = max(worst, d)
    print(f"[tp styles vs PyTorch] largest difference (losses and gradients, {STEPS} steps): {worst:.1e}")


if __name__ == "__main__":
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(pytorch_side, args=(2, port, sys.argv[1], int(sys.argv[2])), nprocs=2, join=True)
