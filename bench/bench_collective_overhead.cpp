// The cost of libfsdp's collectives layer (src/c10d/collectives.cpp) per collective, against calling the c10d
// backend (Gloo) directly with the same tensors (issue 16, part 3): what tiny models pay per collective
// on top of Gloo's own latency (sequence numbers, the flight recorder, byte counters, progress marks,
// the Work wrapper; fingerprints are off unless FSDP_DEBUG is set). Each op is timed alone after a
// backend barrier, ours and direct alternating, median of --repeats (a tenth of it, at least 5, for
// tensors of 1M elements and more).
//
// On one host "ours" runs all_reduce, broadcast and all_gather_into_tensor through the shared-memory
// transport (src/c10d/shm_transport.h; issue 16, and issue 37 item 2 for all_reduce and broadcast), so
// for those rows the ratio column is Gloo's sockets against shared memory, with the layer's cost included;
// FSDP_SHM_TRANSPORT=0 puts both sides on Gloo (the layer's cost alone).
//
//   build/bin/fsdprun --standalone --nproc-per-node 2 -- build/bin/bench_collective_overhead
//   ... -- build/bin/bench_collective_overhead --numel 16777216 --repeats 50   (one 64 MiB fp32 size)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include "fsdp/c10d/collectives.h"
#include "fsdp/c10d/distributed.h"

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Per-collective cost of libfsdp's collectives layer vs the Gloo backend; run under fsdprun."};
  int repeats = 300;
  app.add_option("--repeats", repeats, "Timed repetitions per op and side (median reported)");
  // A scalar (the loss and clipping all-reduces), a tiny model's block (12.7k), a small model's (210k),
  // 4 MiB of fp32 (a bucket of gradients, HSDP's replicate all-reduce).
  std::vector<int64_t> sizes = {8, 12704, 210000, 1048576};
  app.add_option("--numel", sizes, "fp32 element counts to time (rounded down to a multiple of the group size)");
  CLI11_PARSE(app, argc, argv);
  try {
    torch::set_num_threads(1);
    auto pg = fsdp::init_process_group();
    const int n = pg->size();
    auto backend = pg->backend();
    auto sync = [&] { backend->barrier(c10d::BarrierOptions())->wait(); };
    if (pg->rank() == 0) {
      std::printf("bench_collective_overhead: %d ranks, %s, median of %d (us per collective)\n", n,
                  backend->getBackendName().c_str(), repeats);
      std::printf("%-24s %10s %10s %10s %12s %10s %10s\n", "op", "elements", "gloo us", "ours us", "overhead us",
                  "gloo/ours", "chained us");
    }
    for (int64_t numel : sizes) {
      numel -= numel % n;
      const int reps = numel >= (int64_t{1} << 20) ? std::max(5, repeats / 10) : repeats;
      auto full = torch::randn({numel}), shard = torch::randn({numel / n});
      struct Op {
        const char* name;
        std::function<void()> ours, direct;
      };
      std::vector<Op> ops = {
          {"all_reduce", [&] { fsdp::all_reduce(full, *pg, fsdp::ReduceOp::SUM); },
           [&] {
             std::vector<at::Tensor> ts{full};
             backend->allreduce(ts, c10d::AllreduceOptions())->wait();
           }},
          {"broadcast", [&] { fsdp::broadcast(full, 0, *pg); },
           [&] {
             std::vector<at::Tensor> ts{full};
             backend->broadcast(ts, c10d::BroadcastOptions())->wait();
           }},
          {"all_gather_into_tensor", [&] { fsdp::all_gather_into_tensor(full, shard, *pg); },
           [&] { backend->_allgather_base(full, shard, c10d::AllgatherOptions())->wait(); }},
      };
      for (auto& op : ops) {
        std::vector<double> ours, direct;
        for (int i = 0; i < reps + 10; ++i) {
          for (int side = 0; side < 2; ++side) {
            sync();
            auto t0 = std::chrono::steady_clock::now();
            (side == 0 ? op.ours : op.direct)();
            const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
            if (i >= 10) (side == 0 ? ours : direct).push_back(us);
          }
        }
        const double o = median(ours), d = median(direct);
        // Back to back: `reps` of ours in a row after one barrier, as a training step issues them (no skew
        // of a barrier's release in each sample): the latency the ranks pay per collective in lockstep.
        sync();
        auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < reps; ++i) op.ours();
        const double chained = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / reps;
        if (pg->rank() == 0) {
          std::printf("%-24s %10lld %10.1f %10.1f %12.1f %10.2f %10.1f\n", op.name, static_cast<long long>(numel), d, o,
                      o - d, d / o, chained);
        }
      }
    }
    // What every collective paid before issue 16 part 3 moved it off the path: one store round trip
    // (the progress mark, now written by a background thread; src/c10d/progress_publisher.h).
    if (pg->store()) {
      std::vector<double> set_us;
      for (int i = 0; i < repeats + 10; ++i) {
        auto t0 = std::chrono::steady_clock::now();
        pg->store()->set("bench_overhead/" + std::to_string(pg->rank()), std::to_string(i));
        const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        if (i >= 10) set_us.push_back(us);
      }
      // Every rank: rank 0 hosts the store (a round trip within the process), the others reach it over TCP.
      for (int r = 0; r < n; ++r) {
        sync();
        if (pg->rank() == r) {
          std::printf("store set (inline mark), rank %d: %.1f us\n", r, median(set_us));
          std::fflush(stdout);
        }
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_collective_overhead: %s\n", e.what());
    return 1;
  }
}
