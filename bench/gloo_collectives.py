#!/usr/bin/env python3
"""gloo_collectives: the time of one Gloo collective on this machine, at the sizes train_gpt's FSDP groups have
(the figures in docs/BENCHMARKS.md, "Where the time goes"). Each op is timed alone (a barrier before each),
median of 200; what FSDP pays per collective before any skew between the ranks.

    .venv/bin/torchrun --standalone --nproc-per-node 2 bench/gloo_collectives.py
"""

import statistics
import time

import torch
import torch.distributed as dist

# Unsharded sizes (fp32 elements): a scalar (the clipping and loss all-reduces), a tiny block (12.7k
# parameters), a small block (0.2M), the whole small model (0.84M).
SIZES = {"scalar": 8, "tiny block": 12_704, "small block": 210_000, "small model": 850_000}


def timed(fn, repeats=200):
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    for name, numel in SIZES.items():
        numel -= numel % world
        full, shard = torch.randn(numel), torch.randn(numel // world)
        gathered, reduced = torch.empty(numel), torch.empty(numel // world)
        ms = {
            "all_gather": timed(lambda: dist.all_gather_into_tensor(gathered, shard)),
            "reduce_scatter": timed(lambda: dist.reduce_scatter_tensor(reduced, full)),
            "all_reduce (same input)": timed(lambda: dist.all_reduce(full)),
        }
        if dist.get_rank() == 0:
            print(f"{name:>12} ({numel * 4 / 1e3:8.1f} kB unsharded): "
                  + ", ".join(f"{op} {v:.3f} ms" for op, v in ms.items()), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
