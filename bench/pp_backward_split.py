"""What a zero-bubble schedule's split backward costs per microbatch, in one process, against a full backward:
one pipeline stage of bench_pipeline's model (--blocks residual blocks of d -> 4d -> d), a microbatch of --rows.

  OMP_NUM_THREADS=1 .venv/bin/python bench/pp_backward_split.py

- full:    forward, then one backward (what GPipe / 1F1B / interleaved 1F1B run: action B)
- libfsdp: forward, I = torch.autograd.grad(out, x, g, retain_graph=True), then W = out.backward(g): the arithmetic of
           libfsdp's recomputing W, now only its fallback for fully_shard'ed stages (its split backward, like
           PyTorch's, is src/pipelining/backward_split.cpp: [Note: zero-bubble backward])
- PyTorch: forward, I = stage_backward_input, W = stage_backward_weight (torch.distributed.pipelining._backward, what
           PyTorch's PipelineStage runs for I and W)
Best of --reps, in ms; the ratio to "full". Both splits must give the full backward's gradients (checked).
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    torch.manual_seed(0)
    stage = nn.Sequential(*[Block(args.d) for _ in range(args.blocks)])
    params = list(stage.parameters())

    def full(x, g):
        out = stage(x)
        out.backward(g)
        return x.grad

    def ours(x, g):
        out = stage(x)
        (gx,) = torch.autograd.grad(out, x, g, retain_graph=True)
        out.backward(g)
        return gx

    def theirs(x, g):
        out = stage(x)
        gx, param_groups = stage_backward_input([out], [g], [x], iter(params))
        stage_backward_weight(iter(params), param_groups)
        return gx[0]

    print(f"one stage: {args.blocks} blocks of d {args.d}, {torch.get_num_threads()} thread(s), best of {args.reps}")
    print("| rows | full F+B ms | libfsdp F+I+W ms | ratio | PyTorch F+I+W ms | ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        x0 = torch.randn(rows, args.d)
        g = torch.randn(rows, args.d)
        res = {}
        for name, fn in (("full", full), ("ours", ours), ("theirs", theirs)):
            best, grads = float("inf"), None
            for _ in range(args.reps):
                for p in params:
                    p.grad = None
                x = x0.clone().requires_grad_(True)
                t0 = time.perf_counter()
                gx = fn(x, g)
                best = min(best, time.perf_counter() - t0)
                grads = [gx.detach().clone()] + [p.grad.clone() for p in params]
            res[name] = (best * 1e3, grads)
        for name in ("ours", "theirs"):
            for a, b in zip(res[name][1], res["full"][1]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        f = res["full"][0]
        print(f"| {rows} | {f:.2f} | {res['ours'][0]:.2f} | {res['ours'][0] / f:.2f} | {res['theirs'][0]:.2f} | "
              f"{res['theirs'][0] / f:.2f} |")


if __name__ == "__main__":
    main()
