// The cost of libfsdp's collectives layer (src/c10d/collectives.cpp) per collective, against calling the c10d
// backend (Gloo) directly with the same tensors (issue 16, part 3): what tiny models pay per collective
// on top of Gloo's own latency (sequence numbers, the flight recorder, byte counters, progress marks,
// the Work wrapper; fingerprints are off unless FSDP_DEBUG is set). Each op is timed alone after a
// backend barrier, ours and direct alternating, median of --repeats.
//
//   build/bin/fsdprun --standalone --nproc-per-node 2 -- build/bin/bench_collective_overhead
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
      std::printf("%-24s %10s %10s %10s %12s\n", "op", "elements", "gloo us", "ours us", "overhead us");
    }
    // A scalar (the loss and clipping all-reduces), a tiny model's block (12.7k), a small model's (210k).
    for (int64_t numel : {int64_t{8}, int64_t{12704}, int64_t{210000}}) {
      numel -= numel % n;
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
          {"all_gather_into_tensor", [&] { fsdp::all_gather_into_tensor(full, shard, *pg); },
           [&] { backend->_allgather_base(full, shard, c10d::AllgatherOptions())->wait(); }},
      };
      for (auto& op : ops) {
        std::vector<double> ours, direct;
        for (int i = 0; i < repeats + 10; ++i) {
          for (int side = 0; side < 2; ++side) {
            sync();
            auto t0 = std::chrono::steady_clock::now();
            (side == 0 ? op.ours : op.direct)();
            const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
            if (i >= 10) (side == 0 ? ours : direct).push_back(us);
          }
        }
        const double o = median(ours), d = median(direct);
        if (pg->rank() == 0) {
          std::printf("%-24s %10lld %10.1f %10.1f %12.1f\n", op.name, static_cast<long long>(numel), d, o, o - d);
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
