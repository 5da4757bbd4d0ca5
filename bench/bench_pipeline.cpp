// bench_pipeline: step time, bubble and activation memory of the pipeline schedules
// (fsdp/pipelining/schedules.h) on an MLP of residual blocks, from the weights and batches that
// bench/pp_twin.py writes, so that the losses can be compared with PyTorch's own schedules.
//
//   .venv/bin/python bench/pp_twin.py --write-init /tmp/pp_init.safetensors       # weights + batches
//   OMP_NUM_THREADS=1 build/bin/fsdprun --standalone --nproc-per-node 4 -- build/bin/bench_pipeline \
//       --init /tmp/pp_init.safetensors --out /tmp/ours.jsonl
//
// bench/compare_pipeline.sh runs both sides and prints the comparison table.
//
// Model: Sequential of --blocks residual blocks x + fc2(gelu(fc1(x))) (d -> 4d -> d), loss MSE against a
// target; SGD (lr 0.05). Each schedule runs at m = 4, 8, 16 microbatches: --warmup untimed steps, then
// --steps timed ones, all ranks starting each step together (a barrier, not timed). Written per
// configuration (one JSON line, rank 0): the median over the timed steps of each rank's step time (zero_grad,
// schedule.step, optimizer step), its bubble (time blocked receiving / the schedule's step time,
// last_step_wait_seconds / last_step_seconds) and busy time (the schedule's step time minus that wait: compute,
// and on an oversubscribed machine time descheduled), the theory's bubble, each rank's peak number of microbatches
// whose activations are alive (forwards run minus backwards begun, over its stages), its peak heap growth
// during a step (glibc mallinfo2 sampled after every forward; gradients are zeroed, not freed, so that growth is
// the activations), and every step's microbatch losses.
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <vector>

#include <CLI/CLI.hpp>

#include "fsdp/fsdp.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/pipelining/schedules.h"
#include "fsdp/pipelining/split.h"

namespace {

using Clock = std::chrono::steady_clock;
using namespace fsdp::pipelining;

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t d) : fc1(register_module("fc1", torch::nn::Linear(d, 4 * d))),
                         fc2(register_module("fc2", torch::nn::Linear(4 * d, d))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

int64_t heap_in_use() {
  auto mi = mallinfo2();
  return static_cast<int64_t>(mi.uordblks + mi.hblkhd);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

/// The theory's bubble (idle share of a step) with equal F, B (input) and W (weights) costs:
/// GPipe/1F1B (p-1)/(m+p-1); interleaved 1F1B (p-1)/(v m + p-1) (Narayanan et al. 2021); zero bubble
/// ZB-H1 idles (p-1)(F+B-W) against m(F+B+W) of work: interleaved over v chunks (p-1)/(3 v m + p-1);
/// ZB-V idles (p-1)(F+B-2W) = 0 (Qi et al. 2023/2024).
double theory_bubble(const std::string& s, int p, int v, int m) {
  if (s == "gpipe" || s == "1f1b") return double(p - 1) / (m + p - 1);
  if (s == "interleaved-1f1b") return double(p - 1) / (v * m + p - 1);
  if (s == "interleaved-zero-bubble") return double(p - 1) / (3.0 * v * m + p - 1);
  return 0.0;
}

std::string json_list(const std::vector<double>& v) {
  std::ostringstream os;
  os.precision(17);
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Pipeline schedules' step time, bubble and memory; run under fsdprun (see bench/compare_pipeline.sh)."};
  std::string init, out = "-";
  int steps = 5, warmup = 2;
  std::vector<std::string> schedules{"gpipe", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble", "zbv-zero-bubble"};
  std::vector<int> ms{4, 8, 16};
  app.add_option("--init", init, "safetensors file of bench/pp_twin.py --write-init (weights, x, y)")->required();
  app.add_option("--out", out, "JSON lines file (rank 0), '-' for stdout");
  app.add_option("--steps", steps, "Timed steps per configuration");
  app.add_option("--warmup", warmup, "Untimed steps first");
  app.add_option("--schedules", schedules, "Schedules to run");
  app.add_option("--microbatches", ms, "Microbatch counts to run");
  CLI11_PARSE(app, argc, argv);
  try {
    auto pg = fsdp::init_process_group();
    const int p = pg->size(), rank = pg->rank();
    auto data = fsdp::dcp::load_file(init);
    const auto x_all = data.at("x"), y_all = data.at("y");  // [n_batches, B, d]
    const int64_t d = x_all.size(2);
    int n_blocks = 0;
    while (data.count(std::to_string(n_blocks) + ".fc1.weight")) ++n_blocks;
    TORCH_CHECK(warmup + steps <= x_all.size(0), "the init file holds ", x_all.size(0), " batches, need ", warmup + steps);
    std::ofstream file;
    if (rank == 0 && out != "-") file.open(out);
    std::ostream& os = (rank == 0 && out != "-") ? static_cast<std::ostream&>(file) : std::cout;
    for (const auto& sched_name : schedules) {
      const int v = (sched_name == "gpipe" || sched_name == "1f1b") ? 1 : 2;
      for (int m : ms) {
        torch::nn::Sequential model;
        for (int i = 0; i < n_blocks; ++i) model->push_back(std::to_string(i), Block(d));
        {
          torch::NoGradGuard g;
          for (auto& kv : model->named_parameters()) kv.value().copy_(data.at(kv.key()));
        }
        const int num_stages = p * v;
        auto parts = split_sequential(model, even_split_points(model, num_stages));
        const auto ids = stage_ids_this_rank(sched_name, rank, p, num_stages);
        // Activation bookkeeping: forwards run minus backwards begun (a hook on the stage's output), and the
        // heap after each forward.
        int alive = 0, peak_alive = 0;
        int64_t heap0 = 0, peak_heap = 0;
        std::vector<std::unique_ptr<PipelineStage>> stages;
        std::vector<PipelineStage*> ptrs;
        std::vector<torch::Tensor> params;
        for (int id : ids) {
          auto part = parts[id];
          auto fwd = [part = part.ptr(), &alive, &peak_alive, &peak_heap](const torch::Tensor& x) {
            auto y = part->forward(x);
            ++alive;
            peak_alive = std::max(peak_alive, alive);
            peak_heap = std::max(peak_heap, heap_in_use());
            if (y.requires_grad()) {
              // Once per microbatch: a zero-bubble W runs the output's backward a second time.
              y.register_hook([&alive, done = std::make_shared<bool>(false)](const torch::Tensor& g) {
                if (!*done) --alive;
                *done = true;
                return g;
              });
            }
            return y;
          };
          stages.push_back(std::make_unique<PipelineStage>(part.ptr(), fwd, id, num_stages, torch::kCPU, pg));
          ptrs.push_back(stages.back().get());
          for (auto& t : part->parameters()) params.push_back(t);
        }
        const bool has_last = std::any_of(ptrs.begin(), ptrs.end(), [](auto* s) { return s->is_last(); });
        auto schedule = make_schedule(sched_name, ptrs, m, [](const torch::Tensor& o, const torch::Tensor& t) {
          return torch::mse_loss(o, t);
        });
        torch::optim::SGD opt(params, torch::optim::SGDOptions(0.05));
        std::vector<double> step_ms, bubble, busy_ms, losses;
        int step_peak_alive = 0;
        double step_peak_heap = 0;
        for (int s = 0; s < warmup + steps; ++s) {
          fsdp::barrier(*pg);
          alive = 0;
          peak_alive = 0;
          auto t0 = Clock::now();
          opt.zero_grad(/*set_to_none=*/false);  // gradients stay allocated: the heap's growth is activations
          heap0 = heap_in_use();
          peak_heap = heap0;
          std::vector<torch::Tensor> l;
          schedule->step(x_all[s], y_all[s], &l);
          opt.step();
          const double ms_ = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
          if (has_last) {
            for (auto& t : l) losses.push_back(t.item<double>());
          }
          if (s >= warmup) {
            step_ms.push_back(ms_);
            bubble.push_back(schedule->last_step_wait_seconds() / schedule->last_step_seconds());
            busy_ms.push_back((schedule->last_step_seconds() - schedule->last_step_wait_seconds()) * 1e3);
            step_peak_alive = std::max(step_peak_alive, peak_alive);
            step_peak_heap = std::max(step_peak_heap, double(peak_heap - heap0));
          }
        }
        // Rank 0 gathers [step ms, bubble, peak alive, peak heap MB, busy ms] per rank and the losses.
        auto mine = torch::tensor({median(step_ms), median(bubble), double(step_peak_alive), step_peak_heap / 1e6,
                                   median(busy_ms)}, torch::kFloat64);
        constexpr int kCols = 5;
        auto all = torch::zeros({p, kCols}, torch::kFloat64);
        fsdp::all_gather_into_tensor(all, mine, *pg);
        auto loss_t = torch::zeros({(warmup + steps) * m}, torch::kFloat64);
        if (has_last) loss_t.copy_(torch::tensor(losses, torch::kFloat64));
        fsdp::all_reduce(loss_t, *pg);
        if (rank == 0) {
          std::vector<double> col[kCols];
          for (int r = 0; r < p; ++r)
            for (int c = 0; c < kCols; ++c) col[c].push_back(all[r][c].item<double>());
          std::vector<double> lv(loss_t.data_ptr<double>(), loss_t.data_ptr<double>() + loss_t.numel());
          os << "{\"impl\": \"libfsdp\", \"schedule\": \"" << sched_name << "\", \"p\": " << p << ", \"v\": " << v
             << ", \"m\": " << m << ", \"batch\": " << x_all.size(1) << ", \"d\": " << d << ", \"blocks\": " << n_blocks
             << ", \"threads\": " << torch::get_num_threads() << ", \"step_ms\": " << json_list(col[0])
             << ", \"bubble\": " << json_list(col[1]) << ", \"busy_ms\": " << json_list(col[4]) << ", \"theory_bubble\": " << theory_bubble(sched_name, p, v, m)
             << ", \"peak_alive\": " << json_list(col[2]) << ", \"peak_heap_mb\": " << json_list(col[3])
             << ", \"losses\": " << json_list(lv) << "}" << std::endl;
        }
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_pipeline: %s\n", e.what());
    return 1;
  }
  return 0;
}
