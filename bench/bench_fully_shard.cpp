// bench_fully_shard: times training steps of a small transformer (train_gpt's GPT) sharded with
// fully_shard, and measures how much collective time is not hidden behind compute (the time ranks
// spend blocked in Work::wait()).
//
//   build/bin/fsdprun --standalone --nproc-per-node 2 -- build/bin/bench_fully_shard --preset small
//
// Prints on rank 0, per configuration: the median step time (max over ranks), the median exposed
// communication per step (max over ranks) and its share of the step, and the bytes all-gathered and
// reduce-scattered per step, the bytes each rank sent over the transport per step (max over ranks:
// fsdp::CommStats) and their ratio to FSDP's minimum, (N-1)/N of the bytes all-gathered and
// reduce-scattered (1.0 = nothing moved beyond what FSDP needs; 1.5 = a reduce-scatter that all-reduces).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include <CLI/CLI.hpp>

#include "fsdp/fsdp.h"
#include "../examples/train_gpt/model.h"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

double max_over_ranks(double v, fsdp::ProcessGroup& pg) {
  auto t = torch::full({1}, v, torch::kFloat64);
  fsdp::all_reduce(t, pg, fsdp::ReduceOp::MAX);
  return t.item<double>();
}

struct Result {
  double step_ms, exposed_ms, ag_bytes, rs_bytes, wire_bytes, ratio_to_min;
};

Result run(const train_gpt::GPTConfig& cfg, fsdp::ProcessGroupPtr pg, bool reshard_after_forward, bool bf16,
           int64_t batch, int steps, int warmup) {
  torch::manual_seed(1234);  // identical weights on every rank
  fsdp::FSDPModule<train_gpt::GPT> model{train_gpt::GPT(cfg)};
  auto mesh = fsdp::init_device_mesh(pg->device_type(), {pg->size()}, {}, pg);
  auto opts = fsdp::FullyShardOptions().mesh(mesh);
  if (bf16) opts.mp_policy(fsdp::MixedPrecisionPolicy().param_dtype(torch::kBFloat16).reduce_dtype(torch::kFloat32));
  auto block_opts = opts;
  block_opts.reshard_after_forward(fsdp::ReshardAfterForward(reshard_after_forward));
  for (auto& b : model->blocks) fsdp::fully_shard(b, block_opts);
  fsdp::fully_shard(model, opts);
  torch::optim::AdamW opt(model->unique_parameters(), torch::optim::AdamWOptions(1e-3));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(42 + pg->rank());
  auto x = torch::randint(0, cfg.vocab_size, {batch, cfg.block_size}, gen, torch::kLong);
  auto y = torch::randint(0, cfg.vocab_size, {batch, cfg.block_size}, gen, torch::kLong);
  std::vector<double> step_ms, exposed_ms;
  double ag0 = 0, rs0 = 0, sent0 = 0;
  for (int s = 0; s < warmup + steps; ++s) {
    if (s == warmup) {
      ag0 = pg->collective_bytes("all_gather_into_tensor");
      rs0 = pg->collective_bytes("reduce_scatter_tensor");
      sent0 = static_cast<double>(pg->comm_stats().sent());
    }
    double wait0 = pg->wait_seconds();
    auto t0 = Clock::now();
    opt.zero_grad();
    auto logits = model(x);
    auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, cfg.vocab_size}).to(torch::kFloat32),
                                                     y.reshape({-1}));
    loss.backward();
    opt.step();
    double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (s >= warmup) {
      step_ms.push_back(ms);
      exposed_ms.push_back((pg->wait_seconds() - wait0) * 1e3);
    }
  }
  // Read before the all-reduces of max_over_ranks below, which are not part of a step.
  const double sent_per_step = (static_cast<double>(pg->comm_stats().sent()) - sent0) / steps;
  Result r;
  r.step_ms = max_over_ranks(median(step_ms), *pg);
  r.exposed_ms = max_over_ranks(median(exposed_ms), *pg);
  r.ag_bytes = (pg->collective_bytes("all_gather_into_tensor") - ag0) / steps;
  r.rs_bytes = (pg->collective_bytes("reduce_scatter_tensor") - rs0) / steps;
  r.wire_bytes = max_over_ranks(sent_per_step, *pg);
  const double n = pg->size();
  // FSDP's minimum: (N-1)/N of each all-gather's output and reduce-scatter's input (the latter includes
  // FSDP's one presence flag per parameter per rank, a few bytes).
  r.ratio_to_min = n > 1 ? r.wire_bytes / ((n - 1) / n * (r.ag_bytes + r.rs_bytes)) : 1.0;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Times fully_shard training steps of train_gpt's GPT; run under fsdprun."};
  std::string preset = "small";
  int64_t batch = 8;
  int steps = 20, warmup = 3, threads = 0;
  app.add_option("--preset", preset, "Model preset (tiny|small|medium)");
  app.add_option("--batch-size", batch, "Sequences per rank per step");
  app.add_option("--steps", steps, "Timed steps");
  app.add_option("--warmup", warmup, "Untimed steps first");
  app.add_option("--threads", threads, "Intra-op threads per rank (0: LibTorch's default)");
  CLI11_PARSE(app, argc, argv);
  try {
    if (threads > 0) torch::set_num_threads(threads);
    auto pg = fsdp::init_process_group();
    auto cfg = train_gpt::preset(preset);
    if (pg->rank() == 0) {
      std::printf("bench_fully_shard: %s, %d rank(s), batch %lld x %lld tokens per rank, %d timed steps, %d threads\n",
                  train_gpt::describe(cfg).c_str(), pg->size(), static_cast<long long>(batch),
                  static_cast<long long>(cfg.block_size), steps, torch::get_num_threads());
      std::printf("%-34s %12s %16s %9s %14s %14s %16s %18s\n", "config", "step ms", "exposed comm ms", "exposed",
                  "AG MB/step", "RS MB/step", "bytes_per_step", "bytes_ratio_to_min");
    }
    for (bool bf16 : {false, true}) {
      for (bool raf : {true, false}) {
        auto r = run(cfg, pg, raf, bf16, batch, steps, warmup);
        if (pg->rank() == 0) {
          char name[64];
          std::snprintf(name, sizeof(name), "%s, reshard_after_forward=%s", bf16 ? "bf16" : "fp32",
                        raf ? "true" : "false");
          std::printf("%-34s %12.1f %16.2f %8.1f%% %14.2f %14.2f %16.0f %18.3f\n", name, r.step_ms, r.exposed_ms,
                      100.0 * r.exposed_ms / r.step_ms, r.ag_bytes / 1e6, r.rs_bytes / 1e6, r.wire_bytes,
                      r.ratio_to_min);
        }
      }
    }
    return 0;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "bench_fully_shard: %s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_fully_shard: %s\n", e.what());
  }
  return 1;
}
