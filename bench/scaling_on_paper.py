#!/usr/bin/env python3
"""scaling_on_paper: predicted FSDP step time at 8, 64 and 512 ranks (issue 16, part 5), no measurement.

    .venv/bin/python bench/scaling_on_paper.py            # the tables in docs/BENCHMARKS.md, "Scaling on paper"
    .venv/bin/python bench/scaling_on_paper.py --mfu 0.5 --json

The model (stated in full so that a reader can check every figure):

* Bytes each rank sends per step (FSDP, reshard_after_forward=True, one group per block): forward all-gather +
  backward all-gather of the parameters in param_dtype, and the reduce-scatter of the gradients in
  reduce_dtype, each (N-1)/N of the unsharded bytes: (N-1)/N x P x (2 x param_bytes + reduce_bytes). This is
  the minimum libfsdp reaches on Gloo since issue 16 part 1 (bytes_ratio_to_min 1.00 in bench_fully_shard).
* HSDP (shard within a node of 8, replicate across nodes): the all-gathers and the reduce-scatter run over the
  8 ranks of a node (NVLink), and the reduced shard (P / 8 x reduce_bytes) is all-reduced across the
  R = N / 8 replicas (IB): 2 (R-1)/R of it sent per rank.
* A ring collective on N ranks takes (N-1) x hop latency + bytes sent per rank / bus bandwidth (NCCL's
  "busbw" is defined so that this holds for all-gather and reduce-scatter: busbw = algbw x (N-1)/N).
* Compute: 6 x P x tokens per rank per step FLOPs (forward + backward, no recomputation) at --mfu of the
  accelerator's dense bf16 peak.
* Overlap: FSDP prefetches the next group's all-gather during the current group's compute and runs the
  reduce-scatter of a group during the next one's backward, so the step is max(compute, communication) plus
  what cannot overlap: the first group's all-gather and the last group's reduce-scatter (one group's share
  each) and the per-collective latencies. "exposed" = step - compute.

Networks (per rank):
* gloo-here: this machine's Gloo over loopback, measured (bench/gloo_collectives.py, 2 ranks, idle machine,
  docs/BENCHMARKS.md "Where the time goes"): an all-gather of a scalar 0.25 ms (the hop latency) and of 3.4 MB
  unsharded (1.7 MB sent per rank) 2.10 ms: 1.7 MB / 1.85 ms = 0.92 GB/s per rank. Shown to say what a
  Gloo-over-TCP-class network would do with the same compute, not a prediction for a real cluster.
* nvlink: NCCL on 8 x H100 SXM in one node (NVLink 4 / NVSwitch), busbw 450 GB/s for all-gather and
  reduce-scatter at large sizes, hop latency 5 us.
* ib: across nodes, one 400 Gb/s InfiniBand NIC per GPU (DGX H100 / HGX H100 layout): busbw 50 GB/s per rank
  (400 Gb/s = 50 GB/s line rate; NCCL reaches ~ 90% of it at large sizes, so this is an upper bound), hop
  latency 10 us.
  The busbw figures are NCCL's published nccl-tests orders of magnitude for this hardware, as quoted in the
  issue, not measured here (no such machine); --nvlink-gbs / --ib-gbs change them.
"""

import argparse
import json

# name: (parameters, layers (= FSDP groups besides the root), tokens per sequence, global batch in tokens)
MODELS = {
    "gpt2-small (124M)": (124e6, 12, 1024, 0.5e6),   # GPT-2 / nanoGPT: ~0.5M tokens per step
    "7B": (6.7e9, 32, 4096, 4e6),                     # Llama-2-7B: 4M tokens per step
}
RANKS = (8, 64, 512)
NODE = 8  # GPUs per node


def ring_time(nranks, bytes_sent, gbs, hop_s):
    """One ring collective: (N-1) hops of latency + bytes sent per rank / bus bandwidth."""
    return (nranks - 1) * hop_s + bytes_sent / (gbs * 1e9)


def predict(params, layers, seq, global_tokens, n, args, net):
    """Step time (s) and its parts on n ranks; net: 'fsdp-gloo', 'fsdp' or 'hsdp'."""
    tokens = max(global_tokens / n, seq)  # at least one sequence per rank (the global batch grows past that)
    compute = 6 * params * tokens / (args.peak_tflops * 1e12 * args.mfu)
    groups = layers + 1
    pb, rb = args.param_bytes, args.reduce_bytes
    collectives = 3 * groups - 1  # forward AG per group, backward AG per group but the root, RS per group
    if net == "hsdp" and n > NODE:
        s, r = NODE, n // NODE
        shard_bytes = (s - 1) / s * params * (2 * pb + rb)
        comm = ring_time(s, shard_bytes, args.nvlink_gbs, args.nvlink_hop_us * 1e-6) + \
            (collectives - 1) * (s - 1) * args.nvlink_hop_us * 1e-6
        # The replicas' all-reduce of each group's reduced shard (ring all-reduce: 2 (R-1)/R of it sent).
        ar_bytes = 2 * (r - 1) / r * params / s * rb
        comm += ring_time(r, ar_bytes, args.ib_gbs, 0) + groups * 2 * (r - 1) * args.ib_hop_us * 1e-6
        sent, inter = shard_bytes + ar_bytes, ar_bytes
    else:
        if net == "fsdp-gloo":
            gbs, hop = args.gloo_gbs, args.gloo_hop_ms * 1e-3
        elif n <= NODE:
            gbs, hop = args.nvlink_gbs, args.nvlink_hop_us * 1e-6
        else:  # a ring across nodes runs at the slowest link's speed
            gbs, hop = args.ib_gbs, args.ib_hop_us * 1e-6
        sent = (n - 1) / n * params * (2 * pb + rb)
        inter = sent if n > NODE else 0.0
        comm = ring_time(n, sent, gbs, hop) + (collectives - 1) * (n - 1) * hop
    # Not overlapped: the first group's all-gather and the last group's reduce-scatter (one group's share).
    edge = comm * 2 / collectives
    step = max(compute, comm) + edge
    return {"ranks": n, "network": net, "tokens_per_rank": round(tokens), "compute_ms": compute * 1e3,
            "comm_ms": comm * 1e3, "step_ms": step * 1e3, "exposed_ms": (step - compute) * 1e3,
            "comm_over_compute": comm / compute, "mb_sent_per_rank": sent / 1e6, "mb_inter_node_per_rank": inter / 1e6,
            "tokens_per_s": tokens * n / step}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation of the compute (0.4)")
    ap.add_argument("--peak-tflops", type=float, default=989, help="dense bf16 peak per GPU (H100 SXM: 989)")
    ap.add_argument("--param-bytes", type=int, default=2, help="all-gather dtype bytes (bf16 params: 2)")
    ap.add_argument("--reduce-bytes", type=int, default=4, help="reduce-scatter dtype bytes (fp32 reduce: 4)")
    ap.add_argument("--nvlink-gbs", type=float, default=450, help="intra-node NCCL busbw per rank, GB/s")
    ap.add_argument("--ib-gbs", type=float, default=50, help="inter-node NCCL busbw per rank, GB/s")
    ap.add_argument("--nvlink-hop-us", type=float, default=5)
    ap.add_argument("--ib-hop-us", type=float, default=10)
    ap.add_argument("--gloo-gbs", type=float, default=0.92, help="Gloo over loopback here, GB/s per rank")
    ap.add_argument("--gloo-hop-ms", type=float, default=0.25, help="Gloo's latency per collective hop here, ms")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for name, (params, layers, seq, global_tokens) in MODELS.items():
        for net in ("fsdp", "hsdp", "fsdp-gloo"):
            for n in RANKS:
                if net == "hsdp" and n <= NODE:
                    continue
                r = predict(params, layers, seq, global_tokens, n, args, net)
                r["model"] = name
                rows.append(r)
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"bf16 params ({args.param_bytes} B) all-gathered, reduce in {args.reduce_bytes} B; MFU {args.mfu} of "
          f"{args.peak_tflops:g} TFLOP/s; NVLink {args.nvlink_gbs:g} GB/s, IB {args.ib_gbs:g} GB/s per rank, "
          f"Gloo here {args.gloo_gbs:g} GB/s + {args.gloo_hop_ms:g} ms/hop")
    print("| model | network | ranks | tokens/rank | compute ms | comm ms | comm/compute | step ms | exposed ms "
          "| MB sent/rank | of which across nodes | tokens/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['network']} | {r['ranks']} | {r['tokens_per_rank']} | {r['compute_ms']:.1f} | "
              f"{r['comm_ms']:.1f} | {r['comm_over_compute']:.2f} | {r['step_ms']:.1f} | {r['exposed_ms']:.1f} | "
              f"{r['mb_sent_per_rank']:.0f} | {r['mb_inter_node_per_rank']:.0f} | {r['tokens_per_s']:.3g} |")


if __name__ == "__main__":
    main()
