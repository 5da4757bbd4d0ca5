"""PyTorch's twin of bench/bench_pipeline.cpp: the same MLP of residual blocks, weights and batches, trained with
torch.distributed.pipelining's own PipelineStage and schedules over Gloo, under torchrun.

  .venv/bin/python bench/pp_twin.py --write-init /tmp/pp_init.safetensors          # weights + batches, once
  OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 4 bench/pp_twin.py \
      --init /tmp/pp_init.safetensors --out /tmp/theirs.jsonl

Writes one JSON line per (schedule, m) on rank 0, with the fields of bench_pipeline's (the bubble, which PyTorch
does not measure, as null). bench/compare_pipeline.sh runs both and prints the comparison.
"""

import argparse
import ctypes
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble", "zbv-zero-bubble"]


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


def make_model(blocks, d):
    return nn.Sequential(*[Block(d) for _ in range(blocks)])


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _Mallinfo2


def heap_in_use():
    mi = _libc.mallinfo2()
    return mi.uordblks + mi.hblkhd


def write_init(args):
    torch.manual_seed(args.seed)
    model = make_model(args.blocks, args.d)
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(args.seed + 1)
    tensors["x"] = torch.randn(args.n_batches, args.batch, args.d, generator=g)
    tensors["y"] = 0.5 * torch.randn(args.n_batches, args.batch, args.d, generator=g)
    save_file(tensors, args.write_init)
    print(f"wrote {args.write_init}: {args.blocks} blocks, d {args.d}, {args.n_batches} batches of {args.batch}")


def theory_bubble(s, p, v, m):
    if s in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if s == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    if s == "interleaved-zero-bubble":
        return (p - 1) / (3 * v * m + p - 1)
    return 0.0


def run(args):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as S

    classes = {"gpipe": S.ScheduleGPipe, "1f1b": S.Schedule1F1B, "interleaved-1f1b": S.ScheduleInterleaved1F1B,
               "interleaved-zero-bubble": S.ScheduleInterleavedZeroBubble, "zbv-zero-bubble": S.ScheduleZBVZeroBubble}
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    data = load_file(args.init)
    x_all, y_all = data["x"], data["y"]
    d = x_all.shape[2]
    blocks = 0
    while f"{blocks}.fc1.weight" in data:
        blocks += 1
    out = open(args.out, "w") if rank == 0 and args.out != "-" else None
    for name in args.schedules:
        v = 1 if name in ("gpipe", "1f1b") else 2
        for m in args.microbatches:
            model = make_model(blocks, d)
            model.load_state_dict({k: t for k, t in data.items() if k not in ("x", "y")})
            n = p * v
            sizes = [blocks // n + (1 if i < blocks % n else 0) for i in range(n)]
            starts = [sum(sizes[:i]) for i in range(n)]
            ids = [rank, 2 * p - 1 - rank] if name == "zbv-zero-bubble" else [rank + i * p for i in range(v)]
            counters = {"alive": 0, "peak_alive": 0, "peak_heap": 0}

            def fwd_hook(mod, inp, output):
                counters["alive"] += 1
                counters["peak_alive"] = max(counters["peak_alive"], counters["alive"])
                counters["peak_heap"] = max(counters["peak_heap"], heap_in_use())
                if output.requires_grad:
                    done = [False]

                    def bwd_hook(g):
                        if not done[0]:
                            counters["alive"] -= 1
                        done[0] = True
                    output.register_hook(bwd_hook)

            stages, params = [], []
            for i in ids:
                sub = nn.Sequential(*[model[j] for j in range(starts[i], starts[i] + sizes[i])])
                sub.register_forward_hook(fwd_hook)
                stages.append(PipelineStage(sub, i, n, torch.device("cpu")))
                params += list(sub.parameters())
            has_first, has_last = 0 in ids, n - 1 in ids
            loss_fn = lambda o, t: F.mse_loss(o, t)  # noqa: E731
            cls = classes[name]
            sched = cls(stages[0] if v == 1 else stages, m, loss_fn=loss_fn)
            opt = torch.optim.SGD(params, lr=0.05)
            step_ms, losses, peak_alive, peak_heap = [], [], 0, 0
            for s in range(args.warmup + args.steps):
                dist.barrier()
                counters.update(alive=0, peak_alive=0)
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=False)  # gradients stay allocated: the heap's growth is activations
                heap0 = heap_in_use()
                counters["peak_heap"] = heap0
                ls = []
                sched.step(*([x_all[s]] if has_first else []), target=y_all[s] if has_last else None,
                           losses=ls if has_last else None)
                opt.step()
                ms = (time.perf_counter() - t0) * 1e3
                if has_last:
                    losses += [t.detach().item() for t in ls]
                if s >= args.warmup:
                    step_ms.append(ms)
                    peak_alive = max(peak_alive, counters["peak_alive"])
                    peak_heap = max(peak_heap, counters["peak_heap"] - heap0)
            mine = torch.tensor([statistics.median(step_ms), peak_alive, peak_heap / 1e6], dtype=torch.float64)
            allr = [torch.zeros(3, dtype=torch.float64) for _ in range(p)]
            dist.all_gather(allr, mine)
            loss_t = torch.zeros((args.warmup + args.steps) * m, dtype=torch.float64)
            if has_last:
                loss_t.copy_(torch.tensor(losses, dtype=torch.float64))
            dist.all_reduce(loss_t)
            if rank == 0:
                rec = {"impl": "pytorch", "schedule": name, "p": p, "v": v, "m": m, "batch": x_all.shape[1], "d": d,
                       "blocks": blocks, "threads": torch.get_num_threads(),
                       "step_ms": [float(t[0]) for t in allr], "bubble": None,
                       "theory_bubble": theory_bubble(name, p, v, m),
                       "peak_alive": [float(t[1]) for t in allr], "peak_heap_mb": [float(t[2]) for t in allr],
                       "losses": loss_t.tolist()}
                line = json.dumps(rec)
                if out:
                    out.write(line + "\n")
                    out.flush()
                else:
                    print(line, flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write-init", help="write weights and batches to this safetensors file and exit")
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--n-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", help="the file --write-init wrote")
    ap.add_argument("--out", default="-")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--schedules", nargs="+", default=SCHEDULES)
    ap.add_argument("--microbatches", nargs="+", type=int, default=[4, 8, 16])
    args = ap.parse_args()
    if args.write_init:
        write_init(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
